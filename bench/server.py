"""Server-side costs of refs: resolver cache hit, cache-miss overhead, end-to-end vs data URLs.

(a) ``MMRefResolver.resolve`` on a cache hit, in process (the resolver built exactly as the
    plugin builds it: the adapter, a ``PluginConfig``, and ``fields_config`` from vLLM's
    engine-free processor). Target <= 0.05 ms per image.
(b) A cache miss (read + sha256 + decode + validation + HF processor + vLLM item,
    ``MMRefResolver._resolve_raw_sync`` on the ref ``resolve`` checked once before it, the
    check timed apart) vs the bare HF processor call on the same decoded
    image, in both pixel modes. Target: overhead <= 10 %. Also the breakdown of a miss, and a
    cProfile of the route's whole in-process miss path (``prepare`` + vLLM's
    ``mm_kwargs_from_features`` + the hand-off's fill) with the share of base64/msgpack
    functions in it (the item reaches the engine input as is: target 0 %).
(c) A real vLLM server under load: refs vs data URLs vs feature refs (``mmfile:v1``, processed
    beforehand) vs a tokens-only request of the same size (the floor of the route), unique
    images and RL groups (``bench/_server_load.py``).
(d) Multi-turn agent conversations (6 turns, 8 concurrent conversations, one new 1024x768 photo
    per turn, every earlier one re-sent): API-server CPU per request and its slope per earlier
    image, refs (``rollout_client``) vs data URLs vs the new image alone (the floor), request
    bytes (``bench/_server_multiturn.py``).

Usage: ``.venv/bin/python bench/server.py [--parts a,b,c,d] [--requests 64] [--group-requests 128]
[--rounds 2] [--turn-rounds 3] [--profile DIR] [--server-arg=ARG ...]`` (a+b about 1 min; c about
6 min; d about 5 min). ``--profile``
records the server's processes with py-spy during (c): raw collapsed stacks and a text summary per
phase (``bench/_profile.py``). ``--server-arg`` appends vLLM arguments, e.g.
``--server-arg=--mm-processor-cache-gb --server-arg=0``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _common import (
    BENCH_OUTPUTS,
    bench_asset_root,
    fmt_ms,
    print_facts,
    print_table,
    timeit,
    unique_photos,
    verdict,
    vllm_processor,
)
from _models import ensure_bench_model
from _profile import py_spy
from _server_load import CONCURRENCY, GROUP, MAX_TOKENS, ROLES, part_c, write_feature
from _server_multiturn import CONVERSATIONS, TURNS, part_d

HIT_TARGET_S = 0.05e-3
MISS_OVERHEAD_TARGET = 0.10


# --- (a) and (b): in process --------------------------------------------------------------------


def build_resolver(model: Path, *, raw_pixels: bool):
    """The plugin's serving object (its resolver at ``.resolver``), built in process with
    ``vllm_plugin.startup.build_resolver``, as ``build_serving`` builds it (no engine: ``null``
    slots pass, nothing serves)."""
    from vllm_plugin.config import PluginConfig
    from vllm_plugin.engine_items import EngineItems
    from vllm_plugin.feature_positions import PositionChecks
    from vllm_plugin.resolution import FeatureForm
    from vllm_plugin.serving import MMRefServing
    from vllm_plugin.startup import build_resolver as plugin_resolver

    mc, proc = vllm_processor(model, raw_pixels=raw_pixels)
    resolver = plugin_resolver(proc, mc, PluginConfig(asset_root=BENCH_OUTPUTS))
    pad = resolver.adapter.placeholder_token_id(mc.hf_config)
    serving = MMRefServing(
        FeatureForm(
            PositionChecks(resolver, EngineItems(object()), placeholder_token_id=pad, ec_transfer=False)
        ),
        serving_tokens=None,
        allowed_local_media_path=None,
        max_body_bytes=1 << 30,
        weight_version=_default_weight_version,
    )
    return serving, mc, proc


async def _default_weight_version() -> str:
    """vLLM's weight version before any update (no engine here)."""
    return "default"


async def fill_features(serving, body: dict):
    """What the route does to a body before vLLM's ``serve_tokens``: validate, check, resolve."""
    from vllm_plugin.protocol import parse_request

    prepared = await serving.prepare(parse_request({"sampling_params": {}, **body}))
    return prepared.request


def part_a(model: Path) -> list[tuple]:
    from protocol.adapters import offload_image
    from protocol.placeholders import expand_image_placeholders

    serving, _, _ = build_resolver(model, raw_pixels=True)
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

    from protocol.refs import file_uri_to_path, parse_ref
    from upstream import load

    mm_kwargs_from_features = load("mm_kwargs_from_features")
    hash_kwargs = load("MultiModalHasher.hash_kwargs")

    sampling = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "logprobs": 0}
    body = {"token_ids": token_ids, "mm_refs": [ref.ref], "sampling_params": sampling}

    def refs_hit() -> object:
        request = asyncio.run(fill_features(serving, body))
        return mm_kwargs_from_features(request.features)

    jpeg = Path(file_uri_to_path(parse_ref(ref.ref).raw_image_uri)).read_bytes()
    url = "data:image/jpeg;base64," + b64.b64encode(jpeg).decode()
    connector = load("MediaConnector")()

    def data_url_hit() -> object:
        image = connector.fetch_image(url)
        return hash_kwargs("blake3", model_id=str(model), image=image)

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

    from protocol.adapters import offload_image
    from protocol.adapters.values import CheckedRef
    from protocol.images import load_image
    from protocol.refs import parse_ref
    from upstream import load

    from_hf_inputs = load("MultiModalKwargsItems.from_hf_inputs")
    resolver = serving.resolver
    adapter, raw = resolver.adapter, resolver.raw_pixels
    ref = offload_image(jpeg, bench_asset_root(), adapter).ref
    body = parse_ref(ref)
    checked = CheckedRef(body, adapter.check_ref(body, ref=ref))  # as resolve() checks it, once
    image = load_image(jpeg)
    hf_inputs = BatchFeature(dict(adapter.process(image, raw_pixels=raw).tensors))
    mmfile = feature_ref(resolver, resolver._resolve_raw_sync(checked, ref))
    return {
        "bare HF processor call": lambda: adapter.image_processor(images=[image], **kwargs),
        "full miss (_resolve_raw_sync)": lambda: resolver._resolve_raw_sync(checked, ref),
        "parse_ref + check_ref": lambda: adapter.check_ref(parse_ref(ref), ref=ref),
        "read + sha256 (read_image)": lambda: resolver.store.read_image(body)[0],
        "decode (load_image)": lambda: load_image(jpeg),
        "adapter.process (HF processor + wrap)": lambda: adapter.process(image, raw_pixels=raw),
        "vLLM item (from_hf_inputs)": lambda: from_hf_inputs(
            hf_inputs, resolver.layout.fields_config(hf_inputs)
        ),
        "feature ref instead: miss (_resolve_file_sync)": lambda: resolver._resolve_file_sync(
            parse_ref(mmfile), mmfile
        ),
    }


def feature_ref(resolver, resolved) -> str:
    """An ``mmfile:v1`` ref to ``resolved``'s item (vLLM's encoding, as ``/inference/v1/resolve``
    gives it), written to the bench's run."""
    import pybase64

    from vllm_plugin.items import encode_item

    payload = pybase64.b64decode(encode_item(resolved.item))
    return write_feature(payload, resolver.adapter.fingerprint, resolved.num_placeholders)


def part_b(model: Path, photos: int, repeat: int) -> tuple[list[tuple], list[tuple]]:
    """Cache miss vs bare HF processor, both pixel modes, steps interleaved per photo."""
    import torch

    targets, breakdown_rows = [], []
    for mode in ("raw", "normalized"):
        serving, _, _ = build_resolver(model, raw_pixels=mode == "raw")
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
    from vllm_plugin.protocol import parse_request

    serving, _, _ = build_resolver(model, raw_pixels=True)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="a,b,c,d", help="comma list of a, b, c, d")
    parser.add_argument(
        "--requests", type=int, default=64, help="(c) unique images: requests per path and round"
    )
    parser.add_argument(
        "--group-requests", type=int, default=128, help="(c) RL groups: requests per path and round"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per scenario")
    parser.add_argument("--turn-rounds", type=int, default=3, help="(d): rounds of every path")
    parser.add_argument("--photos", type=int, default=4, help="(b): distinct photos")
    parser.add_argument("--repeat", type=int, default=5, help="(b): interleaved repeats per photo")
    parser.add_argument("--profile", type=Path, help="(c): py-spy profiles of the server processes here")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="(c, d): extra vLLM argument (repeat), e.g. --server-arg=--mm-processor-cache-gb --server-arg=0",
    )
    args = parser.parse_args()
    if args.profile and py_spy() is None:
        parser.error("--profile needs py-spy, the bench extra: bash scripts/install.sh bench")
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
    if "d" in parts:
        t, rows = part_d(model, args.turn_rounds, tuple(args.server_arg))
        targets += t
        print_table(
            f"(d) multi-turn: {CONVERSATIONS} concurrent conversations x {TURNS} turns, one new "
            f"1024x768 photo per turn, max_tokens 4; per request, {args.turn_rounds} rounds",
            ("path", "turn", "earlier images", "requests", "bytes/req", *(f"CPU ms/req: {r}" for r in ROLES)),
            rows,
        )
    print_table("targets", ("measure", "value", "target", "verdict"), targets)


if __name__ == "__main__":
    main()
