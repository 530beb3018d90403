"""Server-side costs of refs: resolver cache hit, cache-miss overhead, end-to-end vs data URLs.

(a) ``MMRefResolver.resolve`` on a cache hit, in process (the resolver built exactly as the
    plugin builds it: the adapter, a ``PluginConfig``, and ``fields_config`` from vLLM's
    engine-free processor). Target <= 0.05 ms per image.
(b) A cache miss (read + sha256 + decode + validation + HF processor + vLLM item,
    ``MMRefResolver._resolve_raw_sync``) vs the bare HF processor call on the same decoded
    image, in both pixel modes. Target: overhead <= 10 %. Also the breakdown of a miss, and a
    cProfile of the route's whole in-process miss path (``prepare`` + vLLM's
    ``mm_kwargs_from_features`` + the hand-off's fill) with the share of base64/msgpack
    functions in it (the item reaches the engine input as is: target 0 %).
(c) A real vLLM server (``scripts/vllm_server.py``; the tiny Qwen2-VL with the real image-size
    limits, ``bench/_models.py``), 16 concurrent asyncio+httpx clients on 127.0.0.1:
    ``/inference/v1/generate`` with ``mm_refs`` vs ``/v1/chat/completions`` with data URLs for
    the same kind of images (1024x768 real photos), ``max_tokens`` 4, ``ignore_eos``.
    Unique images (every request a new image; targets: refs/URLs throughput >= 1.2x, API-server
    CPU per request refs/URLs <= 0.5) and RL groups (each image 8 times in a row; targets >= 1.5x
    and <= 0.25). Rounds alternate the order of the
    two paths; every request of a path gets images no other path or round uses. CPU seconds per
    server process (API server, engine core, model worker) come from the OS (psutil) per phase.
    Only 127.0.0.1 is contacted; request counts are fixed.

Usage: ``.venv/bin/python bench/server.py [--parts a,b,c] [--requests 64] [--group-requests 128]
[--rounds 2] [--profile DIR] [--server-arg=ARG ...]`` (a+b about 30 s; c about 90 s). ``--profile``
records the server's processes with py-spy during (c): raw collapsed stacks and a text summary per
phase (``bench/_profile.py``). ``--server-arg`` appends vLLM arguments, e.g.
``--server-arg=--mm-processor-cache-gb --server-arg=0``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _common import (
    BENCH_OUTPUTS,
    bench_asset_root,
    fmt_ms,
    percentile,
    print_facts,
    print_table,
    ratio_row,
    timeit,
    unique_photos,
    verdict,
    vllm_processor,
)
from _models import ensure_bench_model
from _profile import Recorder, summarize

HIT_TARGET_S = 0.05e-3
MISS_OVERHEAD_TARGET = 0.10
UNIQUE_TARGET = 1.2
GROUP_TARGET = 1.5
UNIQUE_CPU_TARGET = 0.5
GROUP_CPU_TARGET = 0.25
GROUP = 8
CONCURRENCY = 16
MAX_TOKENS = 4
TEXT = "Describe the picture."


# --- (a) and (b): in process --------------------------------------------------------------------


def build_resolver(model: Path, *, device_normalize: bool):
    """The plugin's serving object (its resolver at ``.resolver``), built in process the way
    ``vllm_plugin.startup.build_serving`` builds it (no engine: ``null`` slots pass, nothing serves)."""
    from protocol.adapters import adapter_class
    from vllm_plugin.config import PluginConfig
    from vllm_plugin.engine_items import EngineItems
    from vllm_plugin.items import ItemLayout
    from vllm_plugin.resolver import MMRefResolver
    from vllm_plugin.serving import MMRefServing

    mc, proc = vllm_processor(model, device_normalize=device_normalize)
    hf_config = mc.hf_config
    image_processor = proc.info.get_hf_processor().image_processor
    adapter = adapter_class(hf_config.model_type)(image_processor, family=hf_config.model_type)
    resolver = MMRefResolver(
        adapter,
        PluginConfig(asset_root=BENCH_OUTPUTS),
        layout=ItemLayout(adapter, lambda hf_inputs: proc._get_mm_fields_config(hf_inputs, {})),
        device_normalize=bool(mc.multimodal_config.mm_device_do_normalize),
    )
    serving = MMRefServing(
        resolver,
        EngineItems(object()),
        placeholder_token_id=adapter.placeholder_token_id(hf_config),
        serving_tokens=None,
        allowed_local_media_path=None,
        ec_transfer=False,
        max_body_bytes=1 << 30,
        weight_version=_default_weight_version,
    )
    return serving, mc, proc


async def _default_weight_version() -> str:
    """vLLM's weight version before any update (no engine here)."""
    return "default"


async def fill_features(serving, body: dict):
    """What the route does to a body before vLLM's ``serve_tokens``: validate, check, resolve."""
    from vllm_plugin.api_router import parse_request

    prepared = await serving.prepare(parse_request({"sampling_params": {}, **body}))
    return prepared.request


def part_a(model: Path) -> list[tuple]:
    from protocol.adapters import offload_image
    from protocol.placeholders import expand_image_placeholders

    serving, _, _ = build_resolver(model, device_normalize=True)
    resolver = serving.resolver
    refs = [offload_image(jpeg, bench_asset_root(), resolver.adapter) for jpeg in unique_photos(8)]
    n = 20000
    pad = serving.placeholder_token_id
    one = expand_image_placeholders([1, 2, pad, 3], refs[:1], pad)
    eight = expand_image_placeholders([1, *([pad, 7] * GROUP), 3], refs, pad)

    async def run() -> tuple[list[float], list[float], list[float]]:
        for r in refs:  # fill the cache (misses)
            await resolver.resolve(r.ref)
        hit, fill1, fill8 = [], [], []
        for _ in range(7):
            t0 = time.perf_counter()
            for i in range(n):
                await resolver.resolve(refs[i % len(refs)].ref)
            hit.append((time.perf_counter() - t0) / n)
            t0 = time.perf_counter()
            for _ in range(n // 20):
                await fill_features(serving, {"token_ids": one, "mm_refs": [refs[0].ref]})
            fill1.append((time.perf_counter() - t0) / (n // 20))
            t0 = time.perf_counter()
            for _ in range(n // 100):
                await fill_features(serving, {"token_ids": eight, "mm_refs": [r.ref for r in refs]})
            fill8.append((time.perf_counter() - t0) / (n // 100) / GROUP)
        return hit, fill1, fill8

    hit, fill1, fill8 = asyncio.run(run())
    assert resolver.cache.stats.misses == len(refs), resolver.cache.stats
    h = statistics.median(hit)
    return [
        *_per_request_hit_rows(serving, refs[0], one, model),
        (
            "(a) resolve() cache hit, per image",
            fmt_ms(h),
            "<= 0.05 ms",
            verdict(h, HIT_TARGET_S, higher_is_better=False),
        ),
        ("    fill_features(), 1 image, hit (per image)", fmt_ms(statistics.median(fill1)), "(info)", ""),
        ("    fill_features(), 8 images, hit (per image)", fmt_ms(statistics.median(fill8)), "(info)", ""),
    ]


def _per_request_hit_rows(serving, ref, token_ids: list[int], model: Path) -> list[tuple]:
    """What one request with an already-seen image costs the API server, per path (in process).

    refs: ``fill_features`` (validation, checks, cache hit; the resolved slot stays ``null``) +
    vLLM's ``mm_kwargs_from_features`` (as ``serve_tokens`` runs it: nothing to decode), then the
    item enters the engine input as is (``serving_tokens.py``). data URL on a vLLM
    processor-cache hit: vLLM's ``MediaConnector.fetch_image`` (base64 + JPEG decode + EXIF + RGB)
    + the blake3 content hash.
    """
    import base64 as b64

    from vllm.entrypoints.scale_out.token_in_token_out.mm_features import mm_kwargs_from_features
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.multimodal.media.connector import MediaConnector

    from protocol.refs import file_uri_to_path, parse_ref

    sampling = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "logprobs": 0}
    body = {"token_ids": token_ids, "mm_refs": [ref.ref], "sampling_params": sampling}

    def refs_hit() -> object:
        request = asyncio.run(fill_features(serving, body))
        return mm_kwargs_from_features(request.features)

    jpeg = Path(file_uri_to_path(parse_ref(ref.ref).raw_image_uri)).read_bytes()
    url = "data:image/jpeg;base64," + b64.b64encode(jpeg).decode()
    connector = MediaConnector()

    def data_url_hit() -> object:
        image = connector.fetch_image(url)
        return MultiModalHasher.hash_kwargs("blake3", model_id=str(model), image=image)

    empty = lambda: asyncio.run(asyncio.sleep(0))  # noqa: E731 (asyncio.run overhead, subtracted)
    base = timeit(empty, repeat=15).median
    t_refs = timeit(refs_hit, repeat=15).median - base
    t_url = timeit(data_url_hit, repeat=15).median
    return [
        ("    per request, image seen before: refs (validate + hit)", fmt_ms(t_refs), "(info)", ""),
        ("    per request, image seen before: data URL (fetch_image + blake3)", fmt_ms(t_url), "(info)", ""),
    ]


@dataclass
class Breakdown:
    rows: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.rows.setdefault(name, []).append(seconds)

    def median(self, name: str) -> float:
        return statistics.median(self.rows[name])


def miss_steps(serving, jpeg: bytes, kwargs: dict) -> dict[str, Callable[[], object]]:
    """Each step of one cache miss for ``jpeg`` (already in the store), as a callable."""
    from transformers import BatchFeature
    from vllm.multimodal.inputs import MultiModalKwargsItems

    from protocol.adapters import offload_image
    from protocol.images import load_image
    from protocol.refs import parse_ref

    resolver = serving.resolver
    adapter, raw = resolver.adapter, resolver.device_normalize
    ref = offload_image(jpeg, bench_asset_root(), adapter).ref
    body = parse_ref(ref)
    image = load_image(jpeg)
    hf_inputs = BatchFeature(dict(adapter.process(image, device_normalize=raw).tensors))
    return {
        "bare HF processor call": lambda: adapter.image_processor(images=[image], **kwargs),
        "full miss (_resolve_raw_sync)": lambda: resolver._resolve_raw_sync(body, ref),
        "parse_ref + check_ref": lambda: adapter.check_ref(parse_ref(ref), ref=ref),
        "read + sha256 (read_hashed)": lambda: resolver.store.read_hashed(body.raw_image_uri, body.mm_hash)[
            0
        ],
        "decode (load_image)": lambda: load_image(jpeg),
        "adapter.process (HF processor + wrap)": lambda: adapter.process(image, device_normalize=raw),
        "vLLM item (from_hf_inputs)": lambda: MultiModalKwargsItems.from_hf_inputs(
            hf_inputs, resolver.layout.fields_config(hf_inputs)
        ),
    }


def part_b(model: Path, photos: int, repeat: int) -> tuple[list[tuple], list[tuple]]:
    """Cache miss vs bare HF processor, both pixel modes, steps interleaved per photo."""
    import torch

    targets, breakdown_rows = [], []
    for mode in ("raw", "normalized"):
        serving, _, _ = build_resolver(model, device_normalize=mode == "raw")
        kwargs = {"return_tensors": "pt", "device": "cpu"}
        if mode == "raw":  # what vLLM's merge_mm_processor_kwargs passes with mm_device_do_normalize
            kwargs.update(do_rescale=False, do_normalize=False)
        b = Breakdown()
        for jpeg in unique_photos(photos):
            steps = miss_steps(serving, jpeg, kwargs)
            for _ in range(repeat):  # interleave: each step once per round
                for name, fn in steps.items():
                    b.add(name, timeit(fn, repeat=1, warmup=0).best)
        bare = b.median("bare HF processor call")
        miss = b.median("full miss (_resolve_raw_sync)")
        overhead = miss / bare - 1
        label = f"(b) miss overhead over bare HF processor, {mode} pixels"
        if mode == "raw":
            label += " (server default)"
        targets.append(
            (
                label,
                f"{overhead * 100:+.0f}% ({fmt_ms(miss)} vs {fmt_ms(bare)})",
                "<= +10%",
                verdict(overhead, MISS_OVERHEAD_TARGET, higher_is_better=False),
            )
        )
        for name in b.rows:
            m = b.median(name)
            breakdown_rows.append((mode, name, fmt_ms(m), f"{m / bare * 100:.0f}%"))
        if mode == "raw":  # thread sensitivity: the resolver pool runs 2 such calls at once
            bare_call = steps["bare HF processor call"]
            threads = torch.get_num_threads()
            for t in sorted({1, threads}):
                torch.set_num_threads(t)
                s = timeit(bare_call, repeat=repeat * 2).median
                breakdown_rows.append((mode, f"bare HF processor, torch threads = {t}", fmt_ms(s), ""))
            torch.set_num_threads(threads)
    return targets, breakdown_rows


def part_b_profile(model: Path, photos: int) -> tuple[list[tuple], list[tuple]]:
    """The route's whole in-process miss path under cProfile (``bench/_miss_profile.py``)."""
    from _miss_profile import miss_profile

    from protocol.adapters import offload_image
    from protocol.placeholders import expand_image_placeholders
    from vllm_plugin.api_router import parse_request

    serving, _, _ = build_resolver(model, device_normalize=True)
    pad = serving.placeholder_token_id
    refs = [offload_image(jpeg, bench_asset_root(), serving.adapter) for jpeg in unique_photos(photos)]
    bodies = [
        {"token_ids": expand_image_placeholders([1, pad, 2], [r], pad), "mm_refs": [r.ref]} for r in refs
    ]
    per_request, wire, ref_b64, top = miss_profile(serving, bodies, parse_request)
    target = (
        "(b) item base64/msgpack share of the refs miss path (cProfile self time)",
        f"{wire * 100:.1f}% of {fmt_ms(per_request)} per request (ref-string base64: {fmt_ms(ref_b64)})",
        "0%",
        "pass" if wire == 0 else "MISS",
    )
    return [target], [(name, f"{ms:.2f} ms", f"{share * 100:.0f}%") for name, ms, share in top]


# --- (c): a real server ------------------------------------------------------------------------


@dataclass
class PathResult:
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    requests: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds (user + system) per server process role during this path's phases."""

    @property
    def throughput(self) -> float:
        return self.requests / self.wall

    def cpu_ms_per_request(self, role: str) -> float:
        return self.cpu.get(role, 0.0) / self.requests * 1000


def server_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of the API server and its children, by role (from the OS, via psutil)."""
    import psutil

    root = psutil.Process(pid)
    out: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            cmd = " ".join(proc.cmdline())
            t = proc.cpu_times()
        except psutil.Error:
            continue
        role = "api server" if proc.pid == pid else "engine core" if "EngineCore" in cmd else "model worker"
        if "Worker" in cmd:
            role = "model worker"
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


async def run_load(url: str, path: str, bodies: list[dict], concurrency: int) -> tuple[float, list[float]]:
    """Send ``bodies`` (in order) with ``concurrency`` clients; return (wall seconds, latencies)."""
    import httpx

    queue: asyncio.Queue[dict] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while True:
                try:
                    body = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                t0 = time.perf_counter()
                r = await client.post(path, json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:500]}")
                choice = r.json()["choices"][0]
                n = len(choice["token_ids"]) if choice.get("token_ids") else None
                if n is not None and n != MAX_TOKENS:
                    raise RuntimeError(f"{path}: {n} tokens, expected {MAX_TOKENS}")
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, latencies


def part_c(
    model: Path,
    requests: int,
    group_requests: int,
    rounds: int,
    profile: Path | None,
    server_args: tuple[str, ...] = (),
) -> tuple[list[tuple], list[tuple]]:
    from transformers import AutoTokenizer

    from protocol.adapters import load_adapter, offload_image
    from protocol.placeholders import expand_image_placeholders
    from vllm_server import start_server

    adapter = load_adapter(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
    chat_ids = list(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    asset_root = bench_asset_root()

    scenarios = {"unique images": 1, f"each image {GROUP}x (RL groups)": GROUP}
    paths = ("refs", "data URLs")
    # Image sets: one per (scenario, round, path), disjoint; plus warm-up images.
    per_set = {s: (requests if k == 1 else group_requests) // k for s, k in scenarios.items()}
    total = sum(per_set.values()) * rounds * len(paths) + 4
    print(f"\n[server] preparing {total} distinct 1024x768 photos ...", flush=True)
    jpegs = iter(unique_photos(total))

    def bodies_for(path: str, images: list[bytes], repeat: int) -> list[dict]:
        out = []
        for jpeg in images:
            if path == "refs":
                ref = offload_image(jpeg, asset_root, adapter)
                body = {
                    "token_ids": expand_image_placeholders(chat_ids, [ref], pad_id),
                    "mm_refs": [ref.ref],
                    "sampling_params": {
                        "temperature": 1.0,
                        "max_tokens": MAX_TOKENS,
                        "ignore_eos": True,
                        "logprobs": 0,
                    },
                }
            else:
                url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
                body = {
                    "model": str(model),
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": url}},
                                {"type": "text", "text": TEXT},
                            ],
                        }
                    ],
                    "temperature": 1.0,
                    "max_tokens": MAX_TOKENS,
                    "ignore_eos": True,
                    "logprobs": True,
                    "return_token_ids": True,
                }
            out.extend([body] * repeat)
        return out

    route = {"refs": "/inference/v1/generate", "data URLs": "/v1/chat/completions"}
    warm = {p: bodies_for(p, [next(jpegs), next(jpegs)], 2) for p in paths}
    plan = []  # (scenario, round, path, bodies)
    for scenario, k in scenarios.items():
        for rnd in range(rounds):
            order = paths if rnd % 2 == 0 else paths[::-1]
            for p in order:
                plan.append(
                    (scenario, rnd, p, bodies_for(p, [next(jpegs) for _ in range(per_set[scenario])], k))
                )

    log_dir = Path(tempfile.mkdtemp(prefix="mmref-bench-server-"))
    extra = (
        "--max-model-len", "4096", "--max-num-seqs", str(CONCURRENCY),
        "--limit-mm-per-prompt", '{"image": {"count": 1, "width": 1024, "height": 768}, "video": 0}',
        *server_args,
    )  # fmt: skip
    print(f"[server] starting vLLM (log {log_dir / 'server.log'}) ...", flush=True)
    t0 = time.monotonic()
    server = start_server(model, BENCH_OUTPUTS, log_dir / "server.log", extra_args=extra)
    print(f"[server] healthy after {time.monotonic() - t0:.0f} s; warming up both paths", flush=True)
    results: dict[tuple[str, str], PathResult] = {}
    try:
        for p in paths:
            asyncio.run(run_load(server.url, route[p], warm[p], CONCURRENCY))
        for scenario, rnd, p, bodies in plan:
            cpu0 = server_cpu(server.process.pid)
            if profile is not None:
                raw = profile / f"{_slug(scenario)}-{_slug(p)}-r{rnd}.txt"
                with Recorder(server.process.pid, raw):
                    wall, lat = asyncio.run(run_load(server.url, route[p], bodies, CONCURRENCY))
                raw.with_suffix(".summary.txt").write_text(summarize(raw) + "\n")
            else:
                wall, lat = asyncio.run(run_load(server.url, route[p], bodies, CONCURRENCY))
            cpu1 = server_cpu(server.process.pid)
            res = results.setdefault((scenario, p), PathResult())
            for role, t in cpu1.items():
                res.cpu[role] = res.cpu.get(role, 0.0) + t - cpu0.get(role, 0.0)
            res.wall += wall
            res.latencies += lat
            res.requests += len(bodies)
            print(
                f"[server] {scenario:<28} round {rnd} {p:<9}: {len(bodies)} requests in {wall:.1f} s "
                f"({len(bodies) / wall:.1f} req/s, p50 {percentile(lat, 50) * 1000:.0f} ms)",
                flush=True,
            )
    finally:
        server.stop()
    shutil.rmtree(log_dir, ignore_errors=True)

    detail, targets = [], []
    for scenario, k in scenarios.items():
        refs, urls = results[(scenario, "refs")], results[(scenario, "data URLs")]
        for p, res in (("refs (/inference/v1/generate)", refs), ("data URLs (/v1/chat/completions)", urls)):
            detail.append(
                (
                    scenario,
                    p,
                    res.requests,
                    f"{res.throughput:.2f}",
                    f"{percentile(res.latencies, 50) * 1000:.0f}",
                    f"{percentile(res.latencies, 95) * 1000:.0f}",
                    f"{res.cpu_ms_per_request('api server'):.0f}",
                    f"{res.cpu_ms_per_request('engine core'):.0f}",
                    f"{res.cpu_ms_per_request('model worker'):.0f}",
                )
            )
        ratio = refs.throughput / urls.throughput
        target = UNIQUE_TARGET if k == 1 else GROUP_TARGET
        targets.append(ratio_row(f"(c) throughput refs / data URLs, {scenario}", ratio, target))
        cpu_refs, cpu_urls = refs.cpu_ms_per_request("api server"), urls.cpu_ms_per_request("api server")
        targets.append(
            ratio_row(
                f"(c) API-server CPU per request refs / data URLs, {scenario}",
                cpu_refs / cpu_urls,
                UNIQUE_CPU_TARGET if k == 1 else GROUP_CPU_TARGET,
                higher_is_better=False,
                detail=f" ({cpu_refs:.1f} vs {cpu_urls:.1f} ms)",
            )
        )
    return targets, detail


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s).strip("_")[:40]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="a,b,c", help="comma list of a, b, c")
    parser.add_argument(
        "--requests", type=int, default=64, help="(c) unique images: requests per path and round"
    )
    parser.add_argument(
        "--group-requests", type=int, default=128, help="(c) RL groups: requests per path and round"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per scenario")
    parser.add_argument("--photos", type=int, default=4, help="(b): distinct photos")
    parser.add_argument("--repeat", type=int, default=5, help="(b): interleaved repeats per photo")
    parser.add_argument("--profile", type=Path, help="(c): py-spy profiles of the server processes here")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="(c): extra vLLM argument (repeat), e.g. --server-arg=--mm-processor-cache-gb --server-arg=0",
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    model = ensure_bench_model()

    from protocol.adapters import load_adapter

    print_facts(load_adapter(model).backend)
    targets: list[tuple] = []
    if "a" in parts:
        targets += part_a(model)
    if "b" in parts:
        t, rows = part_b(model, args.photos, args.repeat)
        targets += t
        print_table(
            "(b) one cache miss, broken down (median per call; % of the bare HF processor call)",
            ("pixels", "step", "time", "% of bare"),
            rows,
        )
        t, rows = part_b_profile(model, args.photos)
        targets += t
        print_table(
            "(b) refs miss path under cProfile: top functions by self time (per request)",
            ("function", "self time", "share"),
            rows,
        )
    if "c" in parts:
        t, rows = part_c(
            model, args.requests, args.group_requests, args.rounds, args.profile, tuple(args.server_arg)
        )
        if args.server_arg:
            print(f"\n(c) ran with extra vLLM arguments: {' '.join(args.server_arg)}")
        targets += t
        print_table(
            f"(c) real vLLM server, {CONCURRENCY} concurrent clients, max_tokens {MAX_TOKENS}, "
            "1024x768 photos",
            (
                "scenario",
                "path",
                "requests",
                "req/s",
                "p50 ms",
                "p95 ms",
                "CPU ms/req: API server",
                "engine core",
                "model worker",
            ),
            rows,
        )
    print_table("targets", ("measure", "value", "target", "verdict"), targets)


if __name__ == "__main__":
    main()
