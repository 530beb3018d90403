"""vLLM's own control routes on a plugin server, through the weight-update gate (an ASGI middleware
the plugin adds to vLLM's app; docs/WEIGHT-UPDATES.md, "vLLM's own routes").

A framework written for vLLM pauses, reloads, resets caches and resumes through vLLM's routes
(dev mode: ``vllm/entrypoints/rl/online/api_router.py``, ``serve/dev/{cache,rpc,sleep}/api_router.py``).
Stock, that recipe kills the engine under image traffic (``updates.py`` states the cause: a pause or
a cache reset under requests that hold state). On a plugin server each of those calls goes through
the same gate as the plugin's own update (:class:`~vllm_plugin.updates.WeightUpdates`):

- ``/pause`` (any ``mode``) **holds**: the gate closes, requests in flight run to their end under
  the old weights (``mode=abort``: vLLM aborts them first, as stock does), then the engine is paused
  with no cache cleared. It answers stock's ``{"status": "paused"}`` once held; a second ``/pause``
  answers the same. ``mode=keep`` cannot keep requests frozen across a weight change safely (the
  cause above): it waits for them instead.
- ``/resume`` **releases** a hold (whoever took it: ``/pause``, ``/sleep`` or the plugin's
  ``/mmref/v1/weights/hold``): caches reset with nothing running, the engine's version read again,
  the engine resumed, the gate opened. Not held: vLLM's own ``/resume``.
- ``/collective_rpc`` (``reload_weights``...), ``/reset_prefix_cache``, ``/reset_encoder_cache``,
  ``/reset_mm_cache``, ``/update_weight_version`` and ``/weight_checker`` run as they are while
  held; not held, under a hold of their own (hold, the call, release), so no cache is reset and
  no weight or version changes under a running request, and the next answers are fresh.
- ``/sleep`` holds (as ``/pause`` with its ``mode``) before vLLM sleeps; ``/wake_up`` releases
  once the engine is fully awake.
- The weight-transfer steps (``/start_weight_update``, ``/start_draft_weight_update``,
  ``/update_weights``, ``/finish_weight_update``) run only while held: otherwise the plugin's typed
  409 ``update_conflict`` names the safe sequence (they span several calls: no hold of their own
  could cover them).

Control calls run one at a time (a lock). A malformed query (``mode=fast``) goes to vLLM's route
untouched, which refuses it with stock's 400 before acting. Everything else passes untouched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from fastapi.responses import JSONResponse

from protocol.errors import MMRefError, UpdateConflict
from vllm_plugin.http_edge import Receive, Scope, Send, post_state, refuse, route_path
from vllm_plugin.updates import WeightUpdates

__all__ = ["HELD_ONLY", "UNDER_HOLD", "ControlGate", "ControlMiddleware"]

logger = logging.getLogger("vllm.mmref")

_App = Callable[[Scope, Receive, Send], Awaitable[None]]

UNDER_HOLD = frozenset(
    {
        "/collective_rpc",
        "/reset_prefix_cache",
        "/reset_encoder_cache",
        "/reset_mm_cache",
        "/update_weight_version",
        "/weight_checker",
    }
)
"""Routes that run under a hold of their own when the server is not held."""

HELD_ONLY = frozenset(
    {"/start_weight_update", "/start_draft_weight_update", "/update_weights", "/finish_weight_update"}
)
"""Weight-transfer steps: refused unless the server is held."""

_PAUSE_MODES = ("abort", "wait", "keep")
_BOOLS = frozenset({"0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"})
"""What FastAPI (pydantic) reads as a bool query value; anything else is stock's 400."""
_SAFE = (
    "hold the server first: POST /pause (or /mmref/v1/weights/hold), then /start_weight_update, "
    "/update_weights, /finish_weight_update, then /resume"
)


class ControlGate:
    """The control routes' state of one API process (see the module doc).

    Args:
        updates: the process's weight-update procedure (hold, release).
        engine_client: vLLM's ``EngineClient`` (``is_sleeping``).
    """

    def __init__(self, updates: WeightUpdates, engine_client: Any) -> None:
        self.updates = updates
        self.engine = engine_client
        self.lock = asyncio.Lock()

    async def pause(self, *, abort: bool) -> None:
        """Hold the server (idempotent: already held, nothing to do)."""
        await self.updates.settled()
        if self.updates.held:
            return
        await self.updates.hold(abort=abort)
        logger.info("mmref: vLLM's /pause held the server (%s)", "aborting" if abort else "draining")

    async def resume(self) -> bool:
        """Release the hold if there is one; returns whether there was."""
        await self.updates.settled()
        if not self.updates.held:
            return False
        await self.updates.release(version=None)
        return True

    async def under_hold(self, call: Callable[[], Awaitable[None]]) -> None:
        """``call()`` while held: under the present hold, or one of its own (released after,
        whatever ``call`` did)."""
        await self.updates.settled()
        if self.updates.held:
            await call()
            return
        await self.updates.hold()
        try:
            await call()
        finally:
            await self.updates.release_after_call()


class ControlMiddleware:
    """The ASGI middleware (see the module doc); finds the :class:`ControlGate` on
    ``app.state.mmref_control`` (set by the plugin's ``init_state`` in dev mode; absent: a
    pass-through)."""

    def __init__(self, app: _App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gate = _gate(scope)
        if gate is None:
            await self.app(scope, receive, send)
            return
        route, query = route_path(scope), parse_qs(scope.get("query_string", b"").decode("latin-1"))
        handler = _HANDLERS.get(route)
        if handler is None or not _well_formed(route, query):
            await self.app(scope, receive, send)
            return
        async with gate.lock:
            try:
                await handler(self, gate, _Call(scope, receive, send, query))
            except MMRefError as e:
                await refuse(scope, send, e)

    async def forward(self, call: _Call) -> int:
        """vLLM's route for ``call``; returns the status it answered."""
        status = [0]

        async def send(message: dict[str, Any]) -> None:
            if message.get("type") == "http.response.start":
                status[0] = int(message.get("status", 200))
            await call.send(message)

        await self.app(call.scope, call.receive, send)
        return status[0]


class _Call:
    """One control request: its ASGI triple and its query."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, query: dict[str, list[str]]) -> None:
        self.scope, self.receive, self.send, self.query = scope, receive, send, query

    def arg(self, name: str, default: str) -> str:
        return self.query.get(name, [default])[-1]

    async def answer(self, content: dict[str, Any], status: int = 200) -> None:
        await JSONResponse(content=content, status_code=status)(self.scope, self.receive, self.send)


async def _pause(mw: ControlMiddleware, gate: ControlGate, call: _Call) -> None:
    await gate.pause(abort=call.arg("mode", "abort") == "abort")
    await call.answer({"status": "paused"})


async def _resume(mw: ControlMiddleware, gate: ControlGate, call: _Call) -> None:
    if not await gate.resume():
        await mw.forward(call)
        return
    await call.answer({"status": "resumed"})


async def _under_hold(mw: ControlMiddleware, gate: ControlGate, call: _Call) -> None:
    async def forward() -> None:
        await mw.forward(call)

    await gate.under_hold(forward)


async def _held_only(mw: ControlMiddleware, gate: ControlGate, call: _Call) -> None:
    await gate.updates.settled()
    if not gate.updates.held:
        raise UpdateConflict(f"{route_path(call.scope)} with requests in flight: {_SAFE}")
    await mw.forward(call)


async def _sleep(mw: ControlMiddleware, gate: ControlGate, call: _Call) -> None:
    """Hold, then vLLM's sleep (nothing runs: its cache clear is safe); refused, the hold ends."""
    held = gate.updates.held
    await gate.pause(abort=call.arg("mode", "abort") == "abort")
    if await mw.forward(call) != 200 and not held:
        await gate.resume()


async def _wake_up(mw: ControlMiddleware, gate: ControlGate, call: _Call) -> None:
    await mw.forward(call)
    if not await gate.engine.is_sleeping():
        await gate.resume()


_HANDLERS: dict[str, Callable[[ControlMiddleware, ControlGate, _Call], Awaitable[None]]] = {
    "/pause": _pause,
    "/resume": _resume,
    "/sleep": _sleep,
    "/wake_up": _wake_up,
    **dict.fromkeys(UNDER_HOLD, _under_hold),
    **dict.fromkeys(HELD_ONLY, _held_only),
}


def _well_formed(route: str, query: dict[str, list[str]]) -> bool:
    """Whether vLLM's route would accept this query (otherwise it answers stock's 400 untouched;
    a ``/sleep`` vLLM refuses for its ``level`` ends the hold it took)."""
    if route not in ("/pause", "/sleep"):
        return True
    ok = all(m in _PAUSE_MODES for m in query.get("mode", []))
    return ok and all(v.lower() in _BOOLS for v in query.get("clear_cache", []))


def _gate(scope: Scope) -> ControlGate | None:
    gate = post_state(scope, "mmref_control")
    return gate if isinstance(gate, ControlGate) else None
