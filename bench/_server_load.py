"""Part (c) of ``bench/server.py``: a real vLLM server under load, refs vs data URLs.

``scripts/vllm_server.py`` serves the tiny Qwen2-VL with the real image-size limits
(``bench/_models.py``); 16 concurrent asyncio+httpx clients on 127.0.0.1 send, per scenario,
four paths side by side:

- **refs**: ``/inference/v1/generate`` with ``mm_refs`` (the plugin's route);
- **data URLs**: ``/v1/chat/completions`` with the same kind of image as a data URL (stock vLLM);
- **feature refs**: ``/inference/v1/generate`` with ``mmfile:v1`` refs to processed items in the
  feature store (``protocol.features.write_feature_item``; the items come from the server's own
  ``/inference/v1/resolve`` before any timed phase): the image is decoded and processed once,
  outside the serving path (e.g. when a dataset is prepared), and the server only reads and checks;
- **tokens only (floor)**: ``/inference/v1/generate`` with the refs request's token ids, every
  placeholder replaced by a text token, and no image: what the same route costs the API server
  for a request of the same size without any image work. No refs path can cost less than it, so
  ``floor / data URLs`` bounds the API-server CPU ratio any refs design can reach.

Scenarios: unique images (every request a new image; targets: refs/URLs throughput >= 1.2x,
API-server CPU per request refs/URLs <= 0.5) and RL groups (each image 8 times in a row; >= 1.5x
and <= 0.25). Rounds rotate the order of the paths; every request of a path gets images no other
path or round uses. CPU seconds per server process (API server, engine core, model worker) come
from the OS (psutil) per phase. Only 127.0.0.1 is contacted; request counts are fixed.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from _common import BENCH_OUTPUTS, bench_asset_root, percentile, ratio_row, unique_photos
from _profile import Recorder, summarize

__all__ = ["CONCURRENCY", "GROUP", "MAX_TOKENS", "part_c", "write_feature"]

UNIQUE_TARGET = 1.2
GROUP_TARGET = 1.5
UNIQUE_CPU_TARGET = 0.5
GROUP_CPU_TARGET = 0.25
GROUP = 8
CONCURRENCY = 16
MAX_TOKENS = 4
TEXT = "Describe the picture."
PATHS = ("refs", "data URLs", "feature refs", "tokens only")
ROUTE = {
    "refs": "/inference/v1/generate",
    "data URLs": "/v1/chat/completions",
    "feature refs": "/inference/v1/generate",
    "tokens only": "/inference/v1/generate",
}
LABEL = {
    "refs": "refs (/inference/v1/generate)",
    "data URLs": "data URLs (/v1/chat/completions)",
    "feature refs": "feature refs (mmfile:v1, processed beforehand)",
    "tokens only": "tokens only, no image (floor)",
}
ROLES = ("api server", "engine core", "model worker")
SAMPLING = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 0}


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


def body_maker(model: Path) -> Callable[[str, bytes], dict]:
    """``make(path, jpeg)``: the request body of one path for one photo (refs are offloaded to the
    bench's asset root first, outside any timed phase)."""
    from transformers import AutoTokenizer

    from protocol.adapters import load_adapter, offload_image
    from protocol.placeholders import expand_image_placeholders

    adapter = load_adapter(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    text_id = tokenizer.convert_tokens_to_ids("a")
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
    chat_ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    asset_root = bench_asset_root()

    def make(path: str, jpeg: bytes) -> dict:
        if path == "data URLs":
            url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT}]
            return {
                "model": str(model),
                "messages": [{"role": "user", "content": content}],
                **{k: v for k, v in SAMPLING.items() if k != "logprobs"},
                "logprobs": True,
                "return_token_ids": True,
            }
        ref = offload_image(jpeg, asset_root, adapter)
        token_ids = expand_image_placeholders(chat_ids, [ref], pad_id)
        if path == "tokens only":
            token_ids = [text_id if t == pad_id else t for t in token_ids]
            return {"token_ids": token_ids, "sampling_params": SAMPLING}
        return {"token_ids": token_ids, "mm_refs": [ref.ref], "sampling_params": SAMPLING}

    return make


def write_feature(payload: bytes, fingerprint: str, placeholder_length: int) -> str:
    """Store one item (vLLM's msgpack encoding) in the bench run's feature store, under the sha256
    of the payload; returns its ``mmfile:v1`` ref."""
    import hashlib

    from protocol.features import write_feature_item
    from protocol.refs import FileRef

    ids = FileRef(
        run_id="bench", fingerprint=fingerprint, modality="image", mm_hash=hashlib.sha256(payload).hexdigest()
    )
    return write_feature_item(bench_asset_root(), ids, payload, placeholder_length=placeholder_length)


async def to_feature_refs(url: str, body_sets: list[list[dict]]) -> None:
    """Turn the bodies' ``mmraw`` refs into ``mmfile:v1`` refs in place: the server's own
    ``/inference/v1/resolve`` gives vLLM's encoding of each item, stored with
    :func:`write_feature` (untimed: before any phase)."""
    import httpx
    import pybase64

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        mmfile: dict[str, str] = {}
        for body in (b for bodies in body_sets for b in bodies):
            raw = body["mm_refs"][0]
            if raw.startswith("mmfile:"):  # the same body again (a group repeats one dict)
                continue
            if raw not in mmfile:
                resolve = {"token_ids": body["token_ids"], "mm_refs": [raw]}
                r = await client.post("/inference/v1/resolve", json=resolve)
                r.raise_for_status()
                answer = r.json()
                features = answer["features"]
                payload = pybase64.b64decode(features["kwargs_data"]["image"][0])
                length = features["mm_placeholders"]["image"][0]["length"]
                mmfile[raw] = write_feature(payload, answer["fingerprint"], length)
            body["mm_refs"] = [mmfile[raw]]


def _plan(
    make: Callable[[str, bytes], dict], scenarios: dict[str, int], per_set: dict[str, int], rounds: int
) -> tuple[dict[str, list[dict]], list[tuple[str, int, str, list[dict]]]]:
    """Warm-up bodies per path, then (scenario, round, path, bodies), the path order rotated per
    round; every (scenario, round, path) gets its own photos."""
    total = sum(per_set.values()) * rounds * len(PATHS) + 2 * len(PATHS)
    print(f"\n[server] preparing {total} distinct 1024x768 photos ...", flush=True)
    jpegs: Iterator[bytes] = iter(unique_photos(total))

    def bodies(path: str, count: int, repeat: int) -> list[dict]:
        return [body for body in (make(path, next(jpegs)) for _ in range(count)) for _ in range(repeat)]

    warm = {p: bodies(p, 2, 2) for p in PATHS}
    plan = []
    for scenario, k in scenarios.items():
        for rnd in range(rounds):
            for p in PATHS[rnd % len(PATHS) :] + PATHS[: rnd % len(PATHS)]:
                plan.append((scenario, rnd, p, bodies(p, per_set[scenario], k)))
    return warm, plan


def _run_phases(url: str, pid: int, warm: dict, plan: list, profile: Path | None) -> dict:
    for p in PATHS:
        asyncio.run(run_load(url, ROUTE[p], warm[p], CONCURRENCY))
    results: dict[tuple[str, str], PathResult] = {}
    for scenario, rnd, p, bodies in plan:
        cpu0 = server_cpu(pid)
        if profile is not None:
            raw = profile / f"{_slug(scenario)}-{_slug(p)}-r{rnd}.txt"
            with Recorder(pid, raw):
                wall, lat = asyncio.run(run_load(url, ROUTE[p], bodies, CONCURRENCY))
            raw.with_suffix(".summary.txt").write_text(summarize(raw) + "\n")
        else:
            wall, lat = asyncio.run(run_load(url, ROUTE[p], bodies, CONCURRENCY))
        cpu1 = server_cpu(pid)
        res = results.setdefault((scenario, p), PathResult())
        for role, t in cpu1.items():
            res.cpu[role] = res.cpu.get(role, 0.0) + t - cpu0.get(role, 0.0)
        res.wall += wall
        res.latencies += lat
        res.requests += len(bodies)
        print(
            f"[server] {scenario:<28} round {rnd} {p:<11}: {len(bodies)} requests in {wall:.1f} s "
            f"({len(bodies) / wall:.1f} req/s, p50 {percentile(lat, 50) * 1000:.0f} ms)",
            flush=True,
        )
    return results


def part_c(
    model: Path,
    requests: int,
    group_requests: int,
    rounds: int,
    profile: Path | None,
    server_args: tuple[str, ...] = (),
) -> tuple[list[tuple], list[tuple]]:
    """Run (c); return (target rows, detail rows)."""
    from vllm_server import start_server

    scenarios = {"unique images": 1, f"each image {GROUP}x (RL groups)": GROUP}
    per_set = {s: (requests if k == 1 else group_requests) // k for s, k in scenarios.items()}
    warm, plan = _plan(body_maker(model), scenarios, per_set, rounds)
    log_dir = Path(tempfile.mkdtemp(prefix="mmref-bench-server-"))
    extra = (
        "--max-model-len", "4096", "--max-num-seqs", str(CONCURRENCY),
        "--limit-mm-per-prompt", '{"image": {"count": 1, "width": 1024, "height": 768}, "video": 0}',
        *server_args,
    )  # fmt: skip
    print(f"[server] starting vLLM (log {log_dir / 'server.log'}) ...", flush=True)
    t0 = time.monotonic()
    server = start_server(model, BENCH_OUTPUTS, log_dir / "server.log", extra_args=extra)
    print(f"[server] healthy after {time.monotonic() - t0:.0f} s; warming up every path", flush=True)
    try:
        features = [warm["feature refs"], *(bodies for *_, p, bodies in plan if p == "feature refs")]
        asyncio.run(to_feature_refs(server.url, features))
        results = _run_phases(server.url, server.process.pid, warm, plan, profile)
    finally:
        server.stop()
    shutil.rmtree(log_dir, ignore_errors=True)
    return _report(results, scenarios)


def _report(results: dict, scenarios: dict[str, int]) -> tuple[list[tuple], list[tuple]]:
    detail, targets = [], []
    for scenario, k in scenarios.items():
        for p in PATHS:
            res = results[(scenario, p)]
            detail.append(
                (
                    scenario,
                    LABEL[p],
                    res.requests,
                    f"{res.throughput:.2f}",
                    f"{percentile(res.latencies, 50) * 1000:.0f}",
                    f"{percentile(res.latencies, 95) * 1000:.0f}",
                    *(f"{res.cpu_ms_per_request(role):.1f}" for role in ROLES),
                )
            )
        refs, urls = results[(scenario, "refs")], results[(scenario, "data URLs")]
        target = UNIQUE_TARGET if k == 1 else GROUP_TARGET
        ratio = refs.throughput / urls.throughput
        targets.append(ratio_row(f"(c) throughput refs / data URLs, {scenario}", ratio, target))
        cpu = {p: results[(scenario, p)].cpu_ms_per_request("api server") for p in PATHS}
        cpu_target = UNIQUE_CPU_TARGET if k == 1 else GROUP_CPU_TARGET
        targets.append(
            ratio_row(
                f"(c) API-server CPU per request refs / data URLs, {scenario}",
                cpu["refs"] / cpu["data URLs"],
                cpu_target,
                higher_is_better=False,
                detail=f" ({cpu['refs']:.1f} vs {cpu['data URLs']:.1f} ms)",
            )
        )
        targets.append(
            (
                f"(c) feature refs / data URLs, {scenario}: throughput; API-server CPU",
                f"{results[(scenario, 'feature refs')].throughput / urls.throughput:.2f}x; "
                f"{cpu['feature refs'] / cpu['data URLs']:.2f}x ({cpu['feature refs']:.1f} ms)",
                "(info)",
                "",
            )
        )
        floor_ratio = cpu["tokens only"] / cpu["data URLs"]
        targets.append(
            (
                f"(c) floor: tokens-only request / data URLs, API-server CPU, {scenario}",
                f"{floor_ratio:.2f}x ({cpu['tokens only']:.1f} vs {cpu['data URLs']:.1f} ms)",
                "(info)",
                "target below the floor" if floor_ratio > cpu_target else "target above the floor",
            )
        )
    return targets, detail


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s).strip("_")[:40]
