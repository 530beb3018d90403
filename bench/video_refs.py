"""Video by reference vs video as data URLs, on one real vLLM server with the plugin (issue 44).

The tiny Qwen2.5-VL (float32, built offline), real clips (scikit-image photos panned into MP4 with
OpenCV, the decoder both sides use: ``scripts/video_clips.py``), API-server CPU per request from the
OS (psutil), request bytes as sent; paths side by side, clips no other path or round uses:

(a) **RL groups of 8** (each clip 8 times in a row, 8 concurrent clients): the chat route with
    refs (``mmraw:v2:`` in ``video_url.url``) vs the same route with ``data:video/mp4`` URLs, and
    the token route with refs (``mm_refs``) beside them.
(b) **agents with a growing clip history** (4 concurrent conversations x 6 turns, a new clip per
    turn, every earlier one re-sent, assistant turns as the text vLLM answered): the chat route
    with refs vs data URLs; API-server CPU per request and its slope per earlier clip, and bytes.

Usage: ``.venv/bin/python bench/video_refs.py [--parts a,b] [--groups 4] [--rounds 2]
[--seconds 4]`` (about 5 minutes on 2 cores). Only 127.0.0.1 is contacted. Results:
docs/PERFORMANCE.md ("Video by reference").
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _common import BENCH_OUTPUTS, REPO, bench_asset_root, fmt_bytes, print_facts, print_table
from _server_load import ROLES, server_cpu
from _server_multiturn import slope

sys.path.insert(0, str(REPO / "scripts"))  # the clips the tests and the demo use

GROUP = 8
GROUP_CONCURRENCY = 8
CONVERSATIONS = 4
TURNS = 6
MAX_TOKENS = 4
FAMILY = "qwen2_5_vl"
TEXT = "Describe the video."
CHAT, GENERATE = "/v1/chat/completions", "/inference/v1/generate"
SAMPLING = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field")
GROUP_PATHS = ("chat, refs", "chat, data URLs", "token route, refs")
TURN_PATHS = ("chat, refs", "chat, data URLs")


def clips(seconds: int) -> Iterator[bytes]:
    """Distinct clips: each photo panned from a later start frame each time round."""
    from video_clips import clip_bytes

    for start in itertools.count():
        for photo in PHOTOS:
            yield clip_bytes(photo, seconds=seconds, size=(320, 240), start=start)


class Bodies:
    """Request bodies per path for one clip (refs offloaded before any timed phase)."""

    def __init__(self, model: Path) -> None:
        from transformers import AutoTokenizer

        from protocol.adapters import load_adapter

        self.model, self.adapter = model, load_adapter(model)
        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        self.pad = tokenizer.convert_tokens_to_ids("<|video_pad|>")
        self.image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        chat = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": TEXT}]}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        self.chat_ids = list(ids["input_ids"]) if not isinstance(ids, list) else ids

    def url(self, path: str, clip: bytes) -> str:
        """The clip's URL on the chat route: its content-named ref, or a data URL."""
        from protocol.adapters import offload_video

        if path == "chat, data URLs":
            return "data:video/mp4;base64," + base64.b64encode(clip).decode()
        return offload_video(clip, BENCH_OUTPUTS, self.adapter, form="v2").ref

    def chat(self, messages: list[dict]) -> dict:
        bias = {str(self.pad): -100, str(self.image_pad): -100}
        extra = {"logprobs": True, "return_token_ids": True, "logit_bias": bias}
        return {"model": str(self.model), "messages": messages, **SAMPLING, **extra}

    def make(self, path: str, clip: bytes) -> dict:
        from protocol.adapters import offload_video

        if path == "token route, refs":
            ref = offload_video(clip, BENCH_OUTPUTS, self.adapter, form="v2")
            at = self.chat_ids.index(self.pad)
            ids = [*self.chat_ids[:at], *[self.pad] * ref.num_placeholders, *self.chat_ids[at + 1 :]]
            return {"token_ids": ids, "mm_refs": [ref.ref], "sampling_params": {**SAMPLING, "logprobs": 0}}
        part = {"type": "video_url", "video_url": {"url": self.url(path, clip)}}
        return self.chat([{"role": "user", "content": [part, {"type": "text", "text": TEXT}]}])


async def _send(url: str, route: str, raws: list[bytes], concurrency: int) -> float:
    """Post the encoded bodies in order with ``concurrency`` clients; the wall seconds."""
    import httpx

    queue = list(reversed(raws))
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def worker() -> None:
            while queue:
                raw = queue.pop()
                r = await http.post(route, content=raw, headers={"content-type": "application/json"})
                if r.status_code != 200:
                    raise RuntimeError(f"{route}: HTTP {r.status_code}: {r.text[:300]}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0


def part_a(url: str, pid: int, make: Bodies, source: Iterator[bytes], groups: int, rounds: int) -> dict:
    """RL groups: each clip GROUP times in a row, the path order rotated per round."""
    results: dict = {}
    for rnd in range(rounds):
        for path in GROUP_PATHS[rnd % 3 :] + GROUP_PATHS[: rnd % 3]:
            raws = [json.dumps(make.make(path, next(source))).encode() for _ in range(groups)]
            raws = [raw for raw in raws for _ in range(GROUP)]
            route = GENERATE if path.startswith("token") else CHAT
            cpu0 = server_cpu(pid)
            wall = asyncio.run(_send(url, route, raws, GROUP_CONCURRENCY))
            cpu1 = server_cpu(pid)
            res = results.setdefault(path, {"requests": 0, "wall": 0.0, "bytes": 0, "cpu": {}})
            res["requests"] += len(raws)
            res["wall"] += wall
            res["bytes"] += sum(map(len, raws))
            for role, t in cpu1.items():
                res["cpu"][role] = res["cpu"].get(role, 0.0) + t - cpu0.get(role, 0.0)
            print(f"[video refs] RL groups {path:<18}: {len(raws)} requests in {wall:.1f} s", flush=True)
    return results


async def _turn(http, make: Bodies, chats: list[list[dict]], urls: list[str]) -> int:
    """One turn of every conversation, concurrently; the request bytes sent."""

    async def one(chat: list[dict], url: str) -> int:
        part = {"type": "video_url", "video_url": {"url": url}}
        chat.append({"role": "user", "content": [part, {"type": "text", "text": "And now?"}]})
        raw = json.dumps(make.chat(chat)).encode()
        r = await http.post(CHAT, content=raw, headers={"content-type": "application/json"})
        if r.status_code != 200:
            raise RuntimeError(f"chat: HTTP {r.status_code}: {r.text[:300]}")
        chat.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})
        return len(raw)

    return sum(await asyncio.gather(*(one(c, u) for c, u in zip(chats, urls, strict=True))))


def part_b(url: str, pid: int, make: Bodies, source: Iterator[bytes], rounds: int) -> dict:
    """Agents with a growing clip history; refs offloaded before each round."""
    import httpx

    results: dict = {}

    async def run(path: str, shots: list[list[str]]) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            chats: list[list[dict]] = [[{"role": "system", "content": "You watch videos."}] for _ in shots]
            for k in range(TURNS):
                cpu0 = server_cpu(pid)
                sent = await _turn(http, make, chats, [s[k] for s in shots])
                api = server_cpu(pid).get("api server", 0.0) - cpu0.get("api server", 0.0)
                res = results.setdefault((path, k), {"api_ms": [], "bytes": 0})
                res["api_ms"].append(api / CONVERSATIONS * 1000)
                res["bytes"] += sent

    for rnd in range(rounds):
        for path in TURN_PATHS[rnd % 2 :] + TURN_PATHS[: rnd % 2]:
            shots = [[make.url(path, next(source)) for _ in range(TURNS)] for _ in range(CONVERSATIONS)]
            t0 = time.monotonic()
            asyncio.run(run(path, shots))
            print(f"[video refs] agents round {rnd} {path}: {time.monotonic() - t0:.1f} s", flush=True)
    return results


def _report_a(res: dict) -> tuple[list[tuple], list[tuple]]:
    """(the paths' rows, the ratios)."""
    rows = []
    for path, r in res.items():
        cpu = (f"{r['cpu'].get(role, 0) / r['requests'] * 1000:.1f}" for role in ROLES)
        per = fmt_bytes(r["bytes"] / r["requests"])
        rows.append((path, r["requests"], f"{r['requests'] / r['wall']:.2f}", per, *cpu))
    ratios = []
    if all(p in res for p in GROUP_PATHS[:2]):
        refs, urls = (res[p]["cpu"].get("api server", 0) / res[p]["requests"] for p in GROUP_PATHS[:2])
        nbytes = [res[p]["bytes"] / res[p]["requests"] for p in GROUP_PATHS[:2]]
        ratios.append(("(a) API-server CPU per request, chat refs / data URLs", f"{refs / urls:.2f}x"))
        ratios.append(("(a) request bytes, data URLs / refs", f"{nbytes[1] / nbytes[0]:.0f}x"))
    return rows, ratios


def _report_b(res: dict) -> tuple[list[tuple], list[tuple]]:
    """(the turns' rows, the ratios)."""
    rows, per_path, nbytes = [], {}, {}
    for (path, k), r in sorted(res.items()):
        ms = sum(r["api_ms"]) / len(r["api_ms"])
        per_path.setdefault(path, []).append(ms)
        nbytes[path] = nbytes.get(path, 0) + r["bytes"]
        rows.append((path, k + 1, f"{ms:.1f}", fmt_bytes(r["bytes"] / len(r["api_ms"]) / CONVERSATIONS)))
    ratios = [
        (f"(b) API-server CPU slope, {p}", f"{slope(ys):.2f} ms per earlier clip")
        for p, ys in per_path.items()
    ]
    if all(p in per_path for p in TURN_PATHS):
        refs, urls = (sum(per_path[p]) for p in TURN_PATHS)
        ratios.append(("(b) API-server CPU per request, chat refs / data URLs", f"{refs / urls:.2f}x"))
        ratios.append(
            ("(b) request bytes, data URLs / refs", f"{nbytes[TURN_PATHS[1]] / nbytes[TURN_PATHS[0]]:.0f}x")
        )
    return rows, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="a,b", help="comma list of a, b")
    parser.add_argument("--groups", type=int, default=6, help="(a) groups of 8 per path and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every path, the order rotated")
    parser.add_argument("--seconds", type=int, default=4, help="each clip's length (8 fps, 320x240)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    from make_tiny_models import ensure_tiny_model
    from vllm_server import start_server

    model = ensure_tiny_model(FAMILY)
    make = Bodies(model)
    print_facts(make.adapter.backend)
    source = clips(args.seconds)
    limit = f'{{"image": 0, "video": {TURNS}}}'
    extra = (
        "--max-model-len", "4096", "--max-num-seqs", str(GROUP_CONCURRENCY), "--enable-prefix-caching",
        "--limit-mm-per-prompt", limit,
    )  # fmt: skip
    bench_asset_root()  # the server's asset root exists before it starts
    log_dir = Path(tempfile.mkdtemp(prefix="mmref-bench-video-"))
    server = start_server(model, BENCH_OUTPUTS, log_dir / "server.log", extra_args=extra)
    rows_a, rows_b, ratios = [], [], []
    try:
        pid = server.process.pid
        for path in GROUP_PATHS:  # warm-up
            route = GENERATE if path.startswith("token") else CHAT
            asyncio.run(_send(server.url, route, [json.dumps(make.make(path, next(source))).encode()] * 2, 2))
        if "a" in parts:
            rows_a, more = _report_a(part_a(server.url, pid, make, source, args.groups, args.rounds))
            ratios += more
        if "b" in parts:
            rows_b, more = _report_b(part_b(server.url, pid, make, source, args.rounds))
            ratios += more
    finally:
        server.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
    if rows_a:
        header = ("path", "requests", "req/s", "bytes/req", *(f"CPU ms/req: {r}" for r in ROLES))
        print_table(
            f"(a) RL groups of {GROUP}, {args.seconds} s clips, {GROUP_CONCURRENCY} clients", header, rows_a
        )
    if rows_b:
        header = ("path", "turn", "API ms/req", "bytes/req")
        print_table(f"(b) {CONVERSATIONS} agents x {TURNS} turns, every earlier clip re-sent", header, rows_b)
    print_table("refs vs data URLs, measured side by side in this run", ("measure", "value"), ratios)


if __name__ == "__main__":
    main()
