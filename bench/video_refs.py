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
import base64
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

from _chat_phases import SAMPLING, Groups, Turns, agent_turns, rl_groups, served, warm_up
from _common import BENCH_OUTPUTS, REPO, fmt_bytes, print_facts, print_table
from _server_load import GROUP, ROLES
from _server_multiturn import slope

sys.path.insert(0, str(REPO / "scripts"))  # the clips the tests and the demo use

GROUP_CONCURRENCY = 8
CONVERSATIONS = 4
TURNS = 6
FAMILY = "qwen2_5_vl"
TEXT = "Describe the video."
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field")
GROUP_PATHS = ("chat, refs", "chat, data URLs", "token route, refs")
TURN_PATHS = ("chat, refs", "chat, data URLs")
TURNS_PART = Turns(
    TURN_PATHS, CONVERSATIONS, TURNS, "video_url", "You watch videos.", "And now?", "video refs"
)
"""(b) agents with a growing clip history; refs offloaded before each round."""


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

    model = ensure_tiny_model(FAMILY)
    make = Bodies(model)
    print_facts(make.adapter.backend)
    source = clips(args.seconds)
    limit = f'{{"image": 0, "video": {TURNS}}}'
    extra = (
        "--max-model-len", "4096", "--max-num-seqs", str(GROUP_CONCURRENCY), "--enable-prefix-caching",
        "--limit-mm-per-prompt", limit,
    )  # fmt: skip
    rows_a, rows_b, ratios = [], [], []
    with served(model, extra, GROUP_CONCURRENCY, "video") as load:
        warm_up(load, make, source, GROUP_PATHS)
        if "a" in parts:
            groups = Groups(GROUP_PATHS, args.groups, "video refs")
            rows_a, more = _report_a(rl_groups(load, make, source, groups, args.rounds))
            ratios += more
        if "b" in parts:
            rows_b, more = _report_b(agent_turns(load, make, source, TURNS_PART, args.rounds))
            ratios += more
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
