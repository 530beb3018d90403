"""Refs on vLLM's own chat route (``/v1/chat/completions``, the media connector ``mmref``) vs data URLs.

One real vLLM server with the plugin (the bench model: tiny Qwen2-VL, real image-size limits,
1024x768 photos, ``--enable-prefix-caching``); API-server CPU per request from the OS (psutil) per
phase, paths side by side, photos no other path or round uses:

(a) **RL groups** (each image 8 times in a row, 16 concurrent clients): the chat route with refs
    (``mmraw:v2:`` in ``image_url.url``) vs the same route with data URLs, and the token route with
    refs (``/inference/v1/generate`` ``mm_refs``) beside them. Target: the token route's own,
    API-server CPU per request refs / data URLs <= 0.25x.
(b) **a repeated ref** (one image every request has seen before, 16 concurrent clients): the chat
    route vs the token route, API-server CPU per request; the chat route with the same text and no
    image beside them (the chat route's own floor: template, tokenizer, answer). Target: the chat
    route's repeated ref within 2x of the token route's.
(c) **multi-turn agents** (8 concurrent conversations x 6 turns, a new photo per turn, every earlier
    one re-sent, assistant turns as the text vLLM answered: what an OpenAI-style agent loop sends):
    the chat route with refs vs data URLs; API-server CPU slope per earlier image (target: the
    token route's own, <= 0.1x) and per request; request bytes.

Usage: ``.venv/bin/python bench/chat_refs.py [--parts a,b,c] [--group-requests 64] [--hits 64]
[--rounds 2] [--turn-rounds 2]`` (about 6 minutes on 2 cores). Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path

from _chat_phases import (
    MAX_TOKENS,
    SAMPLING,
    Groups,
    Server,
    Turns,
    agent_turns,
    encoded,
    rl_groups,
    rotated,
    send_all,
    served,
    tally,
    timed_phase,
    warm_up,
)
from _common import BENCH_OUTPUTS, bench_asset_root, fmt_bytes, print_facts, print_table, ratio_row
from _common import unique_photos as distinct_photos
from _models import ensure_bench_model
from _server_load import GROUP, ROLES
from _server_multiturn import slope

GROUP_CPU_TARGET = 0.25
HIT_TARGET = 2.0
SLOPE_TARGET = 0.1
CONCURRENCY = 16
CONVERSATIONS = 8
TURNS = 6
TEXT = "Describe the picture."


class Bodies:
    """Request bodies per path for one photo (refs offloaded before any timed phase)."""

    def __init__(self, model: Path) -> None:
        from transformers import AutoTokenizer

        from protocol.adapters import load_adapter

        self.model, self.adapter = model, load_adapter(model)
        tokenizer = AutoTokenizer.from_pretrained(model)
        self.pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
        self.chat_ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]

    def url(self, path: str, jpeg: bytes) -> str:
        """The image's URL on the chat route: its content-named ref, or a data URL."""
        from protocol.adapters import offload_image

        if path == "chat, data URLs":
            return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
        return offload_image(jpeg, BENCH_OUTPUTS, self.adapter, form="v2").ref

    def chat(self, messages: list[dict]) -> dict:
        extra = {"logprobs": True, "return_token_ids": True, "logit_bias": {str(self.pad): -100}}
        return {"model": str(self.model), "messages": messages, **SAMPLING, **extra}

    def make(self, path: str, jpeg: bytes | None) -> dict:
        from protocol.adapters import offload_image
        from protocol.placeholders import expand_image_placeholders

        if path == "token route, refs":
            ref = offload_image(jpeg, bench_asset_root(), self.adapter)
            ids = expand_image_placeholders(self.chat_ids, [ref], self.pad)
            return {"token_ids": ids, "mm_refs": [ref.ref], "sampling_params": {**SAMPLING, "logprobs": 0}}
        parts = [{"type": "image_url", "image_url": {"url": self.url(path, jpeg)}}] if jpeg else []
        return self.chat([{"role": "user", "content": [*parts, {"type": "text", "text": TEXT}]}])


def _api_ms(res: dict) -> float:
    return res["cpu"].get("api server", 0.0) / res["requests"] * 1000


GROUP_PATHS = ("chat, refs", "chat, data URLs", "token route, refs")
HIT_PATHS = ("chat, refs", "token route, refs", "chat, text only (floor)")
TURN_PATHS = ("chat, refs", "chat, data URLs")


def part_a(server: Server, make: Bodies, photos: Iterator[bytes], requests: int, rounds: int) -> dict:
    """RL groups: each image GROUP times in a row, paths rotated per round (``_chat_phases``)."""
    groups = Groups(GROUP_PATHS, requests // GROUP, "chat refs")
    return {("RL groups", p): r for p, r in rl_groups(server, make, photos, groups, rounds).items()}


def part_b(server: Server, make: Bodies, photos: Iterator[bytes], requests: int, rounds: int) -> dict:
    """A repeated ref: one image, seen before by its path (one warm request), then only hits."""
    results: dict = {}
    for rnd in range(rounds):
        for path in rotated(HIT_PATHS, rnd):
            raw = encoded(make.make(path, None if "floor" in path else next(photos)))
            asyncio.run(send_all(server.url, path, [raw], 1))  # seen before
            res = results.setdefault(("repeated ref", path), tally())
            wall = timed_phase(server, path, [raw] * requests, res)
            print(f"[chat refs] repeated ref {path:<22}: {requests} requests in {wall:.1f} s", flush=True)
    return results


TURNS_PART = Turns(
    TURN_PATHS, CONVERSATIONS, TURNS, "image_url", "You operate a computer.", "What now?", "chat refs"
)
"""(c) multi-turn agents: refs offloaded before each round (the client's own work is a lookup)."""


def _report_a(res: dict) -> tuple[list[tuple], list[tuple]]:
    rows = []
    for (scenario, path), r in res.items():
        cpu = (f"{r['cpu'].get(role, 0) / r['requests'] * 1000:.1f}" for role in ROLES)
        rows.append((scenario, path, r["requests"], f"{r['requests'] / r['wall']:.2f}", *cpu))
    targets = []
    if all(("RL groups", p) in res for p in GROUP_PATHS):
        refs, urls, token = (_api_ms(res[("RL groups", p)]) for p in GROUP_PATHS)
        targets.append(
            ratio_row(
                f"(a) RL groups (each image {GROUP}x): API-server CPU per request, chat refs / data URLs",
                refs / urls,
                GROUP_CPU_TARGET,
                higher_is_better=False,
                detail=f" ({refs:.1f} vs {urls:.1f} ms; token route refs: {token:.1f} ms)",
            )
        )
    if all(("repeated ref", p) in res for p in HIT_PATHS):
        chat, token, floor = (_api_ms(res[("repeated ref", p)]) for p in HIT_PATHS)
        targets.append(
            ratio_row(
                "(b) a repeated ref: API-server CPU per request, chat route / token route",
                chat / token,
                HIT_TARGET,
                higher_is_better=False,
                detail=f" ({chat:.1f} vs {token:.1f} ms; chat route, same text, no image: {floor:.1f} ms)",
            )
        )
    return targets, rows


def _report_c(res: dict) -> tuple[list[tuple], list[tuple]]:
    api = {
        p: [sum(res[(p, k)]["api_ms"]) / len(res[(p, k)]["api_ms"]) for k in range(TURNS)] for p in TURN_PATHS
    }
    nbytes = {p: sum(res[(p, k)]["bytes"] for k in range(TURNS)) for p in TURN_PATHS}
    refs, urls = api["chat, refs"], api["chat, data URLs"]
    s_refs, s_urls = slope(refs), slope(urls)
    rows = [(p, k + 1, f"{api[p][k]:.1f}") for p in TURN_PATHS for k in range(TURNS)]
    by_bytes = nbytes["chat, data URLs"] / nbytes["chat, refs"]
    targets = [
        ratio_row(
            f"(c) multi-turn ({TURNS} turns, {CONVERSATIONS} agents): API-server CPU slope per earlier "
            "image, chat refs / data URLs",
            s_refs / s_urls,
            SLOPE_TARGET,
            higher_is_better=False,
            detail=f" ({s_refs:.2f} vs {s_urls:.2f} ms per earlier image)",
        ),
        (
            "(c) multi-turn: API-server CPU per request, chat refs / data URLs",
            f"{sum(refs) / sum(urls):.2f}x ({sum(refs) / TURNS:.1f} vs {sum(urls) / TURNS:.1f} ms)",
            "(info)",
            "",
        ),
        (
            "(c) multi-turn: request bytes, data URLs / refs",
            f"{by_bytes:.1f}x ({fmt_bytes(nbytes['chat, data URLs'])} vs {fmt_bytes(nbytes['chat, refs'])})",
            "(info)",
            "",
        ),
    ]
    return targets, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="a,b,c", help="comma list of a, b, c")
    parser.add_argument("--group-requests", type=int, default=64, help="(a) requests per path and round")
    parser.add_argument("--hits", type=int, default=64, help="(b) requests per path and round")
    parser.add_argument("--rounds", type=int, default=2, help="(a, b) rounds, the path order rotated")
    parser.add_argument("--turn-rounds", type=int, default=2, help="(c) rounds of both paths")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    model = ensure_bench_model()
    make = Bodies(model)
    print_facts(make.adapter.backend)
    need = (
        args.rounds * (3 * (args.group_requests // GROUP) + 2)
        + args.turn_rounds * 2 * CONVERSATIONS * TURNS
        + 3
    )
    print(f"[chat refs] preparing {need} distinct 1024x768 photos ...", flush=True)
    photos = iter(distinct_photos(need))
    limit = f'{{"image": {{"count": {TURNS}, "width": 1024, "height": 768}}, "video": 0}}'
    extra = (
        "--max-model-len", "8192", "--max-num-seqs", str(CONCURRENCY), "--enable-prefix-caching",
        "--limit-mm-per-prompt", limit,
    )  # fmt: skip
    targets, rows, turn_rows = [], [], []
    with served(model, extra, CONCURRENCY, "chat") as load:
        warm_up(load, make, photos, (*GROUP_PATHS, "chat, text only (floor)"))
        results: dict = {}
        if "a" in parts:
            results |= part_a(load, make, photos, args.group_requests, args.rounds)
        if "b" in parts:
            results |= part_b(load, make, photos, args.hits, args.rounds)
        t, rows = _report_a(results)
        targets += t
        if "c" in parts:
            t, turn_rows = _report_c(agent_turns(load, make, photos, TURNS_PART, args.turn_rounds))
            targets += t
    header = ("scenario", "path", "requests", "req/s", *(f"CPU ms/req: {r}" for r in ROLES))
    print_table(
        f"(a, b) {CONCURRENCY} concurrent clients, max_tokens {MAX_TOKENS}, 1024x768 photos", header, rows
    )
    if turn_rows:
        print_table(
            "(c) multi-turn: API-server CPU ms per request by turn", ("path", "turn", "API ms/req"), turn_rows
        )
    print_table("targets", ("measure", "value", "target", "verdict"), targets)


if __name__ == "__main__":
    main()
