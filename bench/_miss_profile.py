"""A cProfile of the refs route's whole in-process miss path, and its base64/msgpack share.

The path: the route's ``MMRefServing.prepare`` for a ref never seen (confined read, sha256, decode,
the model's HF processor, vLLM's ``MultiModalKwargsItem``), then vLLM's ``mm_kwargs_from_features``
on the prepared ``features`` (as ``serve_tokens`` runs it) and the hand-off's fill of the engine
input (``vllm_plugin.serving_tokens._fill``). The resolver's worker pool is replaced by an inline
executor so that every step runs in the profiled thread.
"""

from __future__ import annotations

import asyncio
import cProfile
import pstats
from concurrent.futures import Executor, Future

__all__ = ["miss_profile"]

WIRE_MARKERS = ("msgpack", "mm_serde", "pybase64", "b64encode")
"""A profiled function counts as the item's wire format (vLLM's base64 msgpack: ``mm_serde``,
msgspec's msgpack, pybase64, any base64 encode) when its file or name contains one of these. The
stdlib ``base64.urlsafe_b64decode`` of the ref string itself (tens of µs) is reported apart."""


class _Inline(Executor):
    def submit(self, fn, /, *args, **kwargs) -> Future:  # type: ignore[override]
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # handed to the awaiting coroutine
            future.set_exception(e)
        return future


def miss_profile(serving, bodies: list[dict], parse_request) -> tuple[float, float, float, list[tuple]]:
    """Profile ``bodies`` (each with refs the resolver has not seen) through the miss path.

    Returns:
        ``(seconds per request, the item wire format's share of the self time, seconds per
        request in any other base64 function, top rows)``; each top row is ``(function, self ms
        per request, share)``.
    """
    from upstream import load
    from vllm_plugin.serving_tokens import _fill

    mm_kwargs_from_features = load("mm_kwargs_from_features")

    serving.resolver.pool = _Inline()

    async def one(body: dict) -> None:
        prepared = await serving.prepare(parse_request({"sampling_params": {}, **body}))
        features = prepared.request.features
        engine_input = {"mm_kwargs": mm_kwargs_from_features(features), "mm_hashes": features.mm_hashes}
        _fill(engine_input, prepared.resolution.slots)

    async def run() -> None:
        for body in bodies:
            await one(body)

    profile = cProfile.Profile()
    profile.enable()
    asyncio.run(run())
    profile.disable()
    stats = pstats.Stats(profile).stats  # {(file, line, name): (cc, nc, self, cumulative, callers)}
    total = sum(v[2] for v in stats.values())
    is_wire = {k: any(m in f"{k[0]}:{k[2]}" for m in WIRE_MARKERS) for k in stats}
    wire = sum(v[2] for k, v in stats.items() if is_wire[k])
    b64 = {k: "b64" in f"{k[0]}:{k[2]}" or "base64" in f"{k[0]}:{k[2]}" for k in stats}
    other_b64 = sum(v[2] for k, v in stats.items() if b64[k] and not is_wire[k])
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:8]
    n = len(bodies)
    rows = [
        (
            f"{k[2]} ({'/'.join(k[0].split('/')[-2:])}:{k[1]})",
            v[2] / n * 1000,
            v[2] / total,
        )
        for k, v in top
    ]
    return total / n, wire / total, other_b64 / n, rows
