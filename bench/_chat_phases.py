"""The phases the chat-route benches share: ``bench/chat_refs.py`` (images) and
``bench/video_refs.py`` (videos), each path measured by the server's CPU from the OS (psutil).

- :func:`rl_groups`: RL groups, each body :data:`GROUP` times in a row, ``concurrency`` clients,
  the paths' order rotated per round; per path: requests, wall seconds, request bytes as sent and
  CPU seconds by role (:data:`~_server_load.ROLES`).
- :func:`agent_turns`: agents whose conversation grows by one media part per turn, every earlier one
  re-sent, the assistant turns as the text vLLM answered (what an OpenAI-style agent loop sends),
  all conversations of a path concurrently; per path and turn: API-server CPU ms per request, bytes.
- :func:`timed_phase`: one phase of posts, the server's CPU read around it (also the benches' own
  phases, e.g. chat_refs' repeated ref); :func:`served`: the plugin server the phases load, started
  over the bench's store and stopped after.

A bench hands its request bodies as a :class:`Bodies` (``make`` a body for a path and one medium,
``url`` of a medium on the chat route, ``chat`` body of messages) and its media as an iterator,
so no medium is used by two paths or rounds.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from _common import BENCH_OUTPUTS, bench_asset_root
from _server_load import GROUP, server_cpu

__all__ = [
    "CHAT",
    "GENERATE",
    "MAX_TOKENS",
    "SAMPLING",
    "Bodies",
    "Groups",
    "Server",
    "Turns",
    "agent_turns",
    "encoded",
    "rl_groups",
    "rotated",
    "route",
    "send_all",
    "served",
    "tally",
    "timed_phase",
    "warm_up",
]

CHAT, GENERATE = "/v1/chat/completions", "/inference/v1/generate"
MAX_TOKENS = 4
SAMPLING = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
"""Every request's sampling: four tokens, always (``ignore_eos``), checked on each answer."""


class Bodies(Protocol):
    """A bench's request bodies (``chat_refs.Bodies``, ``video_refs.Bodies``)."""

    def make(self, path: str, media: bytes) -> dict:
        """One request body of ``path`` for one medium (a photo, a clip)."""
        ...

    def url(self, path: str, media: bytes) -> str:
        """The medium's URL on the chat route: its content-named ref, or a data URL."""
        ...

    def chat(self, messages: list[dict]) -> dict:
        """A chat-route body for ``messages``."""
        ...


class Server(NamedTuple):
    """The server under load: its URL, the API server's pid (its process tree's CPU is read),
    and the clients of an RL-group phase."""

    url: str
    pid: int
    concurrency: int


@dataclass(frozen=True)
class Groups:
    """An RL-group part: its paths, the groups per path and round, the log's label."""

    paths: tuple[str, ...]
    groups: int
    label: str


@dataclass(frozen=True)
class Turns:
    """An agent-turn part: its paths, the conversations and turns, the media part's type
    (``"image_url"``, ``"video_url"``), the system prompt and each turn's question."""

    paths: tuple[str, ...]
    conversations: int
    turns: int
    part: str
    system: str
    question: str
    label: str


@contextmanager
def served(model: Path, extra_args: tuple[str, ...], concurrency: int, name: str) -> Iterator[Server]:
    """The plugin server for ``model`` over the bench's store (``scripts/vllm_server.py``, its log
    in a temporary folder ``mmref-bench-<name>-*``), stopped and its log removed on the way out."""
    from vllm_server import start_server

    bench_asset_root()  # the server's asset root exists before it starts
    log_dir = Path(tempfile.mkdtemp(prefix=f"mmref-bench-{name}-"))
    server = start_server(model, BENCH_OUTPUTS, log_dir / "server.log", extra_args=extra_args)
    try:
        yield Server(server.url, server.process.pid, concurrency)
    finally:
        server.stop()
        shutil.rmtree(log_dir, ignore_errors=True)


def route(path: str) -> str:
    """The route a path posts to: the token route for ``"token ..."`` paths, else the chat route."""
    return GENERATE if path.startswith("token") else CHAT


def rotated(paths: tuple[str, ...], rnd: int) -> tuple[str, ...]:
    """``paths`` in round ``rnd``'s order (each path first once every ``len(paths)`` rounds)."""
    k = rnd % len(paths)
    return paths[k:] + paths[:k]


def encoded(body: dict) -> bytes:
    """A body as sent (JSON; its length is the request bytes counted)."""
    return json.dumps(body).encode()


async def send_all(url: str, path: str, raws: list[bytes], concurrency: int) -> float:
    """Post the encoded bodies in order on ``path``'s route with ``concurrency`` clients; the wall
    seconds.

    Raises:
        RuntimeError: an answer that is not 200, or not :data:`MAX_TOKENS` tokens.
    """
    import httpx

    where, queue = route(path), list(reversed(raws))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def worker() -> None:
            while queue:
                r = await http.post(where, content=queue.pop(), headers={"content-type": "application/json"})
                if r.status_code != 200:
                    raise RuntimeError(f"{where}: HTTP {r.status_code}: {r.text[:300]}")
                ids = r.json()["choices"][0].get("token_ids")
                if ids and len(ids) != MAX_TOKENS:
                    raise RuntimeError(f"{where}: {len(ids)} tokens, expected {MAX_TOKENS}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0


def tally() -> dict[str, Any]:
    """An empty record of a path's phases: requests, wall seconds, request bytes, CPU s by role."""
    return {"requests": 0, "wall": 0.0, "bytes": 0, "cpu": {}}


def timed_phase(server: Server, path: str, raws: list[bytes], res: dict[str, Any]) -> float:
    """Post ``raws`` (:func:`send_all`), the server's CPU read before and after; added to ``res``
    (a :func:`tally`). Returns the phase's wall seconds."""
    cpu0 = server_cpu(server.pid)
    wall = asyncio.run(send_all(server.url, path, raws, server.concurrency))
    cpu1 = server_cpu(server.pid)
    res["requests"] += len(raws)
    res["wall"] += wall
    res["bytes"] += sum(map(len, raws))
    for role, t in cpu1.items():
        res["cpu"][role] = res["cpu"].get(role, 0.0) + t - cpu0.get(role, 0.0)
    return wall


def rl_groups(
    server: Server, bodies: Bodies, media: Iterator[bytes], part: Groups, rounds: int
) -> dict[str, dict[str, Any]]:
    """RL groups: ``part.groups`` media per path and round, each body :data:`GROUP` times in a row
    (one medium per group), the order of ``part.paths`` rotated per round. Returns a
    :func:`tally` per path."""
    results: dict[str, dict[str, Any]] = {}
    for rnd in range(rounds):
        for path in rotated(part.paths, rnd):
            raws = [encoded(bodies.make(path, next(media))) for _ in range(part.groups)]
            raws = [raw for raw in raws for _ in range(GROUP)]
            wall = timed_phase(server, path, raws, results.setdefault(path, tally()))
            print(f"[{part.label}] RL groups {path:<22}: {len(raws)} requests in {wall:.1f} s", flush=True)
    return results


async def _turn(http, bodies: Bodies, part: Turns, chats: list[list[dict]], urls: list[str]) -> int:
    """One turn of every conversation, concurrently; the request bytes sent."""

    async def one(chat: list[dict], url: str) -> int:
        media = {"type": part.part, part.part: {"url": url}}
        chat.append({"role": "user", "content": [media, {"type": "text", "text": part.question}]})
        raw = encoded(bodies.chat(chat))
        r = await http.post(CHAT, content=raw, headers={"content-type": "application/json"})
        if r.status_code != 200:
            raise RuntimeError(f"chat: HTTP {r.status_code}: {r.text[:300]}")
        chat.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})
        return len(raw)

    return sum(await asyncio.gather(*(one(c, u) for c, u in zip(chats, urls, strict=True))))


def agent_turns(
    server: Server, bodies: Bodies, media: Iterator[bytes], part: Turns, rounds: int
) -> dict[tuple[str, int], dict[str, Any]]:
    """Agents, the order of ``part.paths`` rotated per round; each round's URLs made first (a ref
    path's media offloaded outside the timed turns: the client's own work is then a lookup).
    Returns ``{(path, turn): {"api_ms": [API-server CPU ms per request, per round], "bytes": n}}``."""
    import httpx

    results: dict[tuple[str, int], dict[str, Any]] = {}

    async def run(path: str, shots: list[list[str]]) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as http:
            chats = [[{"role": "system", "content": part.system}] for _ in shots]
            for k in range(part.turns):
                cpu0 = server_cpu(server.pid)
                sent = await _turn(http, bodies, part, chats, [s[k] for s in shots])
                api = server_cpu(server.pid).get("api server", 0.0) - cpu0.get("api server", 0.0)
                res = results.setdefault((path, k), {"api_ms": [], "bytes": 0})
                res["api_ms"].append(api / part.conversations * 1000)
                res["bytes"] += sent

    for rnd in range(rounds):
        for path in rotated(part.paths, rnd):
            shots = [
                [bodies.url(path, next(media)) for _ in range(part.turns)] for _ in range(part.conversations)
            ]
            t0 = time.monotonic()
            asyncio.run(run(path, shots))
            print(f"[{part.label}] agents round {rnd} {path}: {time.monotonic() - t0:.1f} s", flush=True)
    return results


def warm_up(server: Server, bodies: Bodies, media: Iterator[bytes], paths: tuple[str, ...]) -> None:
    """Two requests of each path (a new medium each; a ``"(floor)"`` path's without one)."""
    for path in paths:
        body = bodies.make(path, None if "floor" in path else next(media))  # type: ignore[arg-type]
        asyncio.run(send_all(server.url, path, [encoded(body)] * 2, 2))
