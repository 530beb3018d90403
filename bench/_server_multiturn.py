"""Part (d) of ``bench/server.py``: multi-turn agent conversations, refs vs data URLs.

Agent-style rollouts: every turn adds one new screenshot-sized photo (1024x768 JPEG) and re-sends
every earlier one. ``CONVERSATIONS`` conversations run concurrently for ``TURNS`` turns (turn k
carries k images: one new, k-1 earlier); each turn of all conversations is one phase, its CPU
seconds per server process taken from the OS (psutil). Three paths, each with photos no other path
or round uses, run side by side: turn k of every path before turn k+1 of any, the order of the
paths rotated per round:

- **refs**: ``rollout_client.AsyncRolloutClient`` with a ``Conversation`` per agent: the prompt grows
  in tokens, the earlier images are re-sent as the refs they already are (nothing re-read or
  offloaded again; every photo is offloaded before any phase, so the client's own work is a cache
  lookup);
- **data URLs**: stock vLLM's ``/v1/chat/completions`` with the whole conversation as messages, every
  image as a data URL, the assistant turns as the text vLLM answered (what an OpenAI-style agent
  loop sends);
- **new image only (floor)**: the refs request with the earlier images' placeholders replaced by a
  text token and only the new image as a ref: the same route and prompt size, one image resolved
  (decoded and processed: the new image's processing) and nothing else. No refs request of the turn
  can cost the API server less.

Reported: API-server CPU per request at each turn and its least-squares slope per earlier image,
refs vs data URLs (target: refs slope <= 1/10 of the data URLs' slope); the whole-request API-server
CPU ratio refs / data URLs beside the floor's ratio; request bytes (target: data URLs >= 30x refs).
Every path suppresses the image placeholder (``logit_bias``) and samples ``MAX_TOKENS`` tokens with
``ignore_eos``. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import asyncio
import base64
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from _common import BENCH_OUTPUTS, bench_asset_root, fmt_bytes, ratio_row, unique_photos
from _server_load import ROLES, server_cpu

__all__ = ["CONVERSATIONS", "TURNS", "part_d"]

CONVERSATIONS = 8
TURNS = 6
MAX_TOKENS = 4
SLOPE_TARGET = 0.1
BYTES_TARGET = 30.0
FLOOR = "new image only (floor)"
PATHS = ("refs", "data URLs", FLOOR)
TEXT = "Here is the screen now. What do you do next?"


@dataclass
class TurnResult:
    """One path's figures at one turn, summed over rounds (``api_ms``: each round's API-server CPU
    ms per request)."""

    requests: int = 0
    bytes: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    api_ms: list[float] = field(default_factory=list)

    def cpu_ms(self, role: str) -> float:
        return self.cpu.get(role, 0.0) / self.requests * 1000


def slope(ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against 0, 1, 2, ... (earlier images at turns 1, 2, 3, ...)."""
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


class _Agents:
    """``CONVERSATIONS`` conversations of one path, each with its own photos, run turn by turn."""

    def __init__(self, path: str, client, model: Path, photos: list[list[bytes]], pad: int, text_id: int):
        self.path, self.client, self.model, self.photos = path, client, model, photos
        self.pad, self.text_id = pad, text_id
        self.convs = [client.conversation() for _ in photos]
        self.chats: list[list[dict]] = [[] for _ in photos]

    async def turn(self, http, k: int) -> int:
        """Turn ``k`` (0-based) of every conversation, concurrently; returns the request bytes sent."""
        sizes = await asyncio.gather(*(self._one(http, i, k) for i in range(len(self.photos))))
        return sum(sizes)

    async def _one(self, http, i: int, k: int) -> int:
        from rollout_client import Rollout, Sampling

        jpeg = self.photos[i][k]
        sampling = Sampling(temperature=1.0, max_tokens=MAX_TOKENS, extra={"ignore_eos": True})
        if self.path == "refs":
            conv = self.convs[i].add_user(TEXT, images=[jpeg])
            prepared = conv.prepare()
            size = len(self.client.body(prepared, sampling))
            rollout = await self.client.generate(conv, sampling)
            _check(rollout.completion_ids)
            return size
        if self.path == "data URLs":
            url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT}]
            self.chats[i].append({"role": "user", "content": content})
            body = {
                "model": str(self.model),
                "messages": self.chats[i],
                "temperature": 1.0,
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "logprobs": True,
                "return_token_ids": True,
                "logit_bias": {str(self.pad): -100},
            }
            choice, size = await _post(http, "/v1/chat/completions", body, self.path)
            self.chats[i].append({"role": "assistant", "content": choice["message"]["content"] or ""})
            return size
        # floor: the refs prompt, earlier images' placeholders as text, the new image only
        conv = self.convs[i].add_user(TEXT, images=[jpeg])
        prepared = conv.prepare()
        earlier = sum(r.num_placeholders for r in prepared.images[:-1])
        tokens, seen = [], 0
        for t in prepared.prompt_ids:
            if t == self.pad and seen < earlier:
                t, seen = self.text_id, seen + 1
            tokens.append(t)
        body = {
            "token_ids": tokens,
            "mm_refs": [prepared.images[-1].ref],
            "sampling_params": sampling.params(self.client.suppressed_token_ids()),
        }
        choice, size = await _post(http, "/inference/v1/generate", body, self.path)
        logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
        conv.record(
            Rollout(prepared.prompt_ids, choice["token_ids"], logprobs, "length", None, None, prepared.images)
        )
        return size


async def _post(http, route: str, body: dict, path: str) -> tuple[dict, int]:
    """POST ``body`` to ``route``; the answer's first choice (its tokens checked) and the request bytes."""
    request = http.build_request("POST", route, json=body)
    r = await http.send(request)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:500]}")
    choice = r.json()["choices"][0]
    _check(choice["token_ids"])
    return choice, len(request.content)


def _check(tokens: list[int]) -> None:
    if len(tokens) != MAX_TOKENS:
        raise RuntimeError(f"{len(tokens)} tokens, expected {MAX_TOKENS}")


def _photos(rounds: int, offloader) -> tuple[list[list[bytes]], list[dict[str, list[list[bytes]]]]]:
    """Distinct photos: two warm-up turns per conversation, and per round, path and conversation one
    per turn; those of the refs paths offloaded now (the client's work is then a lookup)."""
    total = rounds * len(PATHS) * CONVERSATIONS * TURNS + CONVERSATIONS * 2
    print(
        f"\n[multi-turn] preparing {total} distinct 1024x768 photos; offloading the refs paths' ...",
        flush=True,
    )
    jpegs: Iterator[bytes] = iter(unique_photos(total))
    warm_photos = [[next(jpegs) for _ in range(2)] for _ in range(CONVERSATIONS)]
    plan: list[dict[str, list[list[bytes]]]] = []
    for _ in range(rounds):
        plan.append({})
        for p in PATHS:
            plan[-1][p] = [[next(jpegs) for _ in range(TURNS)] for _ in range(CONVERSATIONS)]
    offloaded = [photos for round_ in plan for p, photos in round_.items() if p != "data URLs"]
    for photos in [*offloaded, warm_photos]:
        for conv in photos:
            for jpeg in conv:
                offloader.offload(jpeg)
    return warm_photos, plan


async def _timed_turn(agents: _Agents, http, k: int, pid: int, results: dict) -> None:
    """Turn ``k`` of one path's conversations; adds its bytes and per-process CPU to ``results``."""
    cpu0 = server_cpu(pid)
    sent = await agents.turn(http, k)
    cpu1 = server_cpu(pid)
    res = results.setdefault((agents.path, k), TurnResult())
    res.requests += CONVERSATIONS
    res.bytes += sent
    for role, t in cpu1.items():
        res.cpu[role] = res.cpu.get(role, 0.0) + t - cpu0.get(role, 0.0)
    api = cpu1.get("api server", 0.0) - cpu0.get("api server", 0.0)
    res.api_ms.append(api / CONVERSATIONS * 1000)


def part_d(model: Path, rounds: int, server_args: tuple[str, ...] = ()) -> tuple[list[tuple], list[tuple]]:
    """Run (d); return (target rows, detail rows)."""
    import httpx

    from rollout_client import AsyncRolloutClient, ChatTemplate, Offloader
    from vllm_server import start_server

    template, offloader = ChatTemplate(model), Offloader(model, bench_asset_root())
    pad = template.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    text_id = template.tokenizer.convert_tokens_to_ids("a")
    warm_photos, plan = _photos(rounds, offloader)
    log_dir = Path(tempfile.mkdtemp(prefix="mmref-bench-multiturn-"))
    limit = f'{{"image": {{"count": {TURNS}, "width": 1024, "height": 768}}, "video": 0}}'
    extra = (
        "--max-model-len", "8192", "--max-num-seqs", str(CONVERSATIONS), "--enable-prefix-caching",
        "--limit-mm-per-prompt", limit, *server_args,
    )  # fmt: skip
    print(f"[multi-turn] starting vLLM (log {log_dir / 'server.log'}) ...", flush=True)
    server = start_server(model, BENCH_OUTPUTS, log_dir / "server.log", extra_args=extra)
    results: dict[tuple[str, int], TurnResult] = {}

    async def run() -> None:
        limits = httpx.Limits(max_connections=CONVERSATIONS, max_keepalive_connections=CONVERSATIONS)
        async with (
            AsyncRolloutClient(server.url, model, bench_asset_root(), template=template, offloader=offloader,
                               max_concurrency=CONVERSATIONS) as client,
            httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as http,
        ):  # fmt: skip
            for p in PATHS:  # warm-up: two turns of every path
                agents = _Agents(p, client, model, warm_photos, pad, text_id)
                for k in range(2):
                    await agents.turn(http, k)
            for rnd, photos in enumerate(plan):
                order = PATHS[rnd % len(PATHS) :] + PATHS[: rnd % len(PATHS)]
                agents = {p: _Agents(p, client, model, photos[p], pad, text_id) for p in order}
                t0 = time.monotonic()
                for k in range(TURNS):
                    for p in order:
                        await _timed_turn(agents[p], http, k, server.process.pid, results)
                print(
                    f"[multi-turn] round {rnd + 1}/{len(plan)}: {len(order)} paths x {CONVERSATIONS} "
                    f"conversations x {TURNS} turns in {time.monotonic() - t0:.1f} s",
                    flush=True,
                )

    try:
        asyncio.run(run())
    finally:
        server.stop()
    shutil.rmtree(log_dir, ignore_errors=True)
    return _report(results)


def _report(results: dict[tuple[str, int], TurnResult]) -> tuple[list[tuple], list[tuple]]:
    detail = []
    api = {p: [results[(p, k)].cpu_ms("api server") for k in range(TURNS)] for p in PATHS}
    for p in PATHS:
        for k in range(TURNS):
            res = results[(p, k)]
            detail.append(
                (p, k + 1, k, res.requests, fmt_bytes(res.bytes / res.requests),
                 *(f"{res.cpu_ms(role):.1f}" for role in ROLES))
            )  # fmt: skip
    rounds = len(results[(PATHS[0], 0)].api_ms)
    per_round = {  # each round's slope: their spread is the slope's uncertainty on a shared machine
        p: [slope([results[(p, k)].api_ms[r] for k in range(TURNS)]) for r in range(rounds)] for p in PATHS
    }
    spread = {
        p: 2 * statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else math.nan
        for p, v in per_round.items()
    }
    s_refs, s_urls, s_floor = (slope(api[p]) for p in PATHS)
    mean = {p: sum(api[p]) / TURNS for p in PATHS}
    nbytes = {p: sum(results[(p, k)].bytes for k in range(TURNS)) for p in PATHS}
    targets = [
        ratio_row(
            f"(d) multi-turn ({TURNS} turns, {CONVERSATIONS} agents): API-server CPU slope per "
            "earlier image, refs / data URLs",
            s_refs / s_urls,
            SLOPE_TARGET,
            higher_is_better=False,
            detail=f" ({s_refs:.2f} ± {spread['refs']:.2f} vs {s_urls:.2f} ± {spread['data URLs']:.2f} ms "
            f"per earlier image; floor {s_floor:.2f} ± {spread[FLOOR]:.2f}; ± 2 standard errors over "
            f"{rounds} rounds)",
        ),
        ratio_row(
            "(d) multi-turn: request bytes, data URLs / refs",
            nbytes["data URLs"] / nbytes["refs"],
            BYTES_TARGET,
            detail=f" ({fmt_bytes(nbytes['data URLs'])} vs {fmt_bytes(nbytes['refs'])} over all turns)",
        ),
        (
            "(d) multi-turn: API-server CPU per request, refs / data URLs (whole request; its floor: the new "
            "image's processing)",
            f"{mean['refs'] / mean['data URLs']:.2f}x ({mean['refs']:.1f} vs {mean['data URLs']:.1f} ms); "
            f"floor {mean[FLOOR] / mean['data URLs']:.2f}x ({mean[FLOOR]:.1f} ms)",
            "(info)",
            "",
        ),
    ]
    return targets, detail
