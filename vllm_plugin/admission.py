"""Admission of every request that may reach the engine, on every route of the server (an ASGI
middleware the plugin adds to vLLM's app).

For each ``POST`` under the engine's routes (:data:`ENGINE_PREFIXES`: ``/v1/``, ``/inference/``,
pooling and scoring routes; never the control routes: ``/pause``, ``/collective_rpc``,
``/update_weights``, ``/mmref/v1/weights/*``, ``/metrics``...):

- **the gate** (:class:`Admission`): while a weight update holds the server
  (``updates.py``, shared by every API process: ``hold_state.py``), new requests wait here, before
  vLLM reads them; the update first waits until every process's admitted requests have finished
  (it reads :attr:`Admission.admitted`), so nothing admitted runs while the weights change, and
  nothing admitted after it meets the old weights;
- **the seed rule** (``seeds.py``) on vLLM's own routes, on a CPU server: a JSON body naming a
  ``seed`` is parsed (bodies without the bytes ``"seed"`` are passed on unparsed), run alone
  (:meth:`Ticket.run_alone`) when only other requests could split its prefill, refused with
  ``seed_unsupported`` when it can be split even alone; the plugin's generate route applies the
  rule itself, with the exact token count;
- **refs in image URLs** on vLLM's own routes (``chat_refs.py``): a JSON body mentioning a ref or
  the reserved ``mmref-`` namespace is parsed once; a ``uuid`` in that namespace is refused, and
  every image part whose URL is a ref is read, checked and keyed (its ``uuid`` set, the body
  rewritten) and its image pinned for the media connector (``connector.py``) before vLLM reads
  the body; a ref the connector refuses inside vLLM's parser is answered as the plugin's typed
  refusal, whatever vLLM's handlers made of it. Refusals here are the generate route's bodies;
- **the weight version** on vLLM's own routes: the answer carries ``x-mmref-weight-version``, the
  version the engine reported when the answer started (for a non-streamed answer, once generated).
  In a server with one API process, updated through the plugin, this is the version the whole
  answer was generated under (the gate above); the plugin's generate route sets its own.

Everything else (GET requests, websockets, other paths) passes untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from protocol.errors import MMRefError
from vllm_plugin import chat_refs, request_scope
from vllm_plugin.http_edge import (
    Message,
    Receive,
    Scope,
    Send,
    declared_length,
    decode_json,
    labelled,
    mentions,
    post_state,
    read_messages,
    refuse,
    replay,
    route_path,
    with_length,
)
from vllm_plugin.seeds import SplitRule

__all__ = [
    "ENGINE_PREFIXES",
    "PLUGIN_PATHS",
    "UNGATED",
    "Admission",
    "AdmissionMiddleware",
    "Ticket",
    "rule_check",
]

logger = logging.getLogger("vllm.mmref")

ENGINE_PREFIXES = (
    "/v1/",
    "/v2/",
    "/inference/",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/invocations",
    "/tokenize",
    "/cohere/",
)
"""Path prefixes of vLLM's routes that may hand a request to the engine, or read a chat body's
images through the media connector (``/tokenize``: a ref there gets its typed refusal too)."""

UNGATED = ("/tokenize",)
"""Admitted routes that never reach the engine: their refs are checked, but they do not wait at a
weight update's gate."""

PLUGIN_PATHS = frozenset({"/inference/v1/generate", "/inference/v1/resolve"})
"""The plugin's own routes: they bind and label versions and apply the seed rule themselves."""

_SOLO_POLL_S = 0.005
"""How often a request waiting behind (or for) a request that runs alone looks again (a seeded
request on a CPU server: rare)."""


class Ticket:
    """One admitted request's place at the gate (:meth:`Admission.admit`)."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    async def run_alone(self) -> None:
        """Wait until no other admitted request runs, then keep new ones out until this one ends
        (a seeded request that splits only beside others: ``seeds.py``). Idempotent."""
        await self._admission._run_alone(self)


class Admission:
    """The gate and the count of admitted requests of this API process.

    Args:
        versions: the engine's weight version (for the header on vLLM's own routes).
        split_rule: seeded requests that can be split (``seeds.py``); None: no seed rule.
        max_body_bytes: the plugin routes' body limit: the middleware reads at most this much of
            their bodies before admitting them (the route refuses a larger one).
    """

    def __init__(
        self,
        versions: Callable[[], Awaitable[str]],
        split_rule: SplitRule | None,
        max_body_bytes: int | None = None,
    ) -> None:
        self.versions = versions
        self.split_rule = split_rule
        self.max_body_bytes = max_body_bytes
        self._open = asyncio.Event()
        self._open.set()
        self.admitted = 0
        """Requests admitted and not finished."""
        self._solo: Ticket | None = None
        """The request running alone (nothing else is admitted meanwhile)."""
        self._solo_waiting = 0
        """Admitted requests waiting to run alone (new requests wait behind them)."""

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[Ticket]:
        """Wait while the gate is closed (or a request runs alone, or waits to), then count the
        request until it finishes."""
        while True:
            while not self._open.is_set():
                await self._open.wait()
            if self._solo is None and not self._solo_waiting:
                break
            await asyncio.sleep(_SOLO_POLL_S)
        self.admitted += 1  # no suspension point since the gate was seen open
        ticket = Ticket(self)
        try:
            yield ticket
        finally:
            if self._solo is ticket:
                self._solo = None
            self.admitted -= 1

    async def _run_alone(self, ticket: Ticket) -> None:
        """:meth:`Ticket.run_alone`: the admitted requests that are not waiting to run alone
        themselves finish first (new ones wait at the gate meanwhile), then ``ticket`` runs alone."""
        if self._solo is ticket:
            return
        self._solo_waiting += 1
        try:
            while self._solo is not None or self.admitted > self._solo_waiting:
                await asyncio.sleep(_SOLO_POLL_S)
            self._solo = ticket
        finally:
            self._solo_waiting -= 1

    def close(self) -> None:
        """New requests wait (those admitted run on)."""
        self._open.clear()

    def open(self) -> None:
        """Let held requests in."""
        self._open.set()


class AdmissionMiddleware:
    """The ASGI middleware (see the module doc); finds the :class:`Admission` on
    ``app.state.mmref_admission`` (set by the plugin's ``init_state``; absent: a pass-through)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        admission = _admission(scope)
        if admission is None:
            await self.app(scope, receive, send)
            return
        route = route_path(scope)
        plugin = route in PLUGIN_PATHS
        limit = admission.max_body_bytes if plugin else None
        # the body first: a client still sending (or stalled) is not admitted, so it never holds
        # up a weight update's drain nor, through it, the requests queued at the gate (a body
        # declared over the plugin's limit is left to the route, which refuses it from the header)
        over = limit is not None and declared_length(scope) > limit
        messages = [] if over else await read_messages(receive, limit)
        gate = contextlib.nullcontext() if route.startswith(UNGATED) else admission.admit()
        async with gate as ticket, _scoped(ticket):
            if plugin:
                await self.app(scope, replay(messages, receive), send)
                return
            try:
                scope, receive, alone = await _inspect(admission, scope, messages, receive)
                if alone and ticket is not None:
                    await ticket.run_alone()
            except MMRefError as e:
                await refuse(scope, send, e)
                return
            errors = request_scope.errors_scope()
            typed = _typed(labelled(send, admission.versions), scope, errors)
            try:
                await self.app(scope, receive, typed)
            except MMRefError as e:  # a connector refusal no handler of vLLM answered
                await typed(e)


@contextlib.asynccontextmanager
async def _scoped(ticket: Ticket | None) -> AsyncIterator[None]:
    with request_scope.admitted(ticket):
        yield


def _admission(scope: Scope) -> Admission | None:
    if not route_path(scope).startswith(ENGINE_PREFIXES):
        return None
    admission = post_state(scope, "mmref_admission")
    return admission if isinstance(admission, Admission) else None


async def _inspect(
    admission: Admission, scope: Scope, messages: list[Message], receive: Receive
) -> tuple[Scope, Receive, bool]:
    """On the body's ``messages``: refuse a seeded request that can be split (CPU servers), a
    reserved uuid; key and pin image refs (``chat_refs``). Returns the scope (its
    ``content-length`` rewritten with the body), the ``receive`` that replays the body to
    vLLM's route, and whether the request must run alone (``seeds.py``).

    Raises:
        MMRefError: the refusal.
    """
    chunks = [m.get("body", b"") for m in messages if m.get("type") == "http.request"]
    # UTF-16/32 JSON (vLLM's json.loads reads it) hides every needle below: parsed, and passed on
    # as UTF-8; UTF-8 JSON never holds a raw NUL
    wide = any(b"\x00" in chunk for chunk in chunks)
    seeded = admission.split_rule is not None and mentions(chunks, (b'"seed"',))
    if not (wide or seeded or mentions(chunks, chat_refs.needles())):  # only then is it joined and parsed
        return scope, replay(messages, receive), False
    try:
        body, encode = decode_json(b"".join(chunks))
    except (RequestValidationError, HTTPException):  # not JSON: vLLM's route refuses it with its own error
        return scope, replay(messages, receive), False
    alone = admission.split_rule is not None and rule_check(admission.split_rule, body)
    if await chat_refs.bind_body(body, request_scope.active(), admission.versions) or wide:
        raw = encode(body)
        messages = [{"type": "http.request", "body": raw, "more_body": False}]
        scope = {**scope, "headers": with_length(scope.get("headers", ()), len(raw))}
    return scope, replay(messages, receive), alone


def rule_check(rule: SplitRule, body: Any) -> bool:
    """The seed rule on an OpenAI-style body (``/v1/completions``, ``/v1/chat/completions``,
    ``/v1/responses``...): ``seed``, ``temperature``, ``max_tokens`` /
    ``max_completion_tokens`` / ``max_output_tokens`` at the top level, and the same in a
    ``sampling_params`` object (a route that reads it); the prompt's length is known only for a
    ``prompt`` of token ids without ``prompt_embeds``, images only as content parts (of a message,
    or of a batch's conversation).

    Returns:
        Whether it must run alone (:meth:`SplitRule.check`).

    Raises:
        SeedUnsupported: see :meth:`SplitRule.check`.
    """
    if not isinstance(body, dict):
        return False
    prompt = body.get("prompt")
    ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    prompt_tokens = len(prompt) if ids and "prompt_embeds" not in body else None
    image_tokens = int(_has_media(body))
    nested = body.get("sampling_params")
    alone = False
    for params in (body, nested) if isinstance(nested, dict) else (body,):
        max_tokens = next(
            (params[k] for k in ("max_tokens", "max_completion_tokens", "max_output_tokens") if k in params),
            None,
        )
        alone |= rule.check(
            seed=params.get("seed"),
            temperature=params.get("temperature"),
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            image_tokens=image_tokens,
            n=params.get("n", 1),
        )
    return alone


def _has_media(body: dict[str, Any]) -> bool:
    """Whether a chat-style body carries a content part other than text (``messages`` may be a
    batch: a list of conversations)."""
    for key in ("messages", "input"):
        items = body.get(key)
        stack = list(items) if isinstance(items, list) else []
        while stack:
            message = stack.pop()
            if isinstance(message, list):
                stack.extend(message)
                continue
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") not in ("text", "input_text") for p in content
            ):
                return True
    return False


def _typed(send: Send, scope: Scope, errors: list[MMRefError]) -> Callable[[Any], Awaitable[None]]:
    """``send``, with an error answer of vLLM's route replaced by the plugin's typed refusal when the
    connector recorded one for this request (what vLLM's handlers made of it: a 400 or a 500).
    Called with an :class:`MMRefError` instead of a message: answer it, unless an answer started."""
    state = {"started": False, "replaced": False}

    async def typed(message: Any) -> None:
        if isinstance(message, MMRefError):
            if not state["started"]:
                state["started"] = state["replaced"] = True
                logger.info("mmref: a ref vLLM's parser refused reached no handler of vLLM")
                await refuse(scope, send, message)
            return
        if message.get("type") == "http.response.start":
            state["started"] = True
            if message.get("status", 200) >= 400 and errors:
                state["replaced"] = True
                logger.info("mmref: vLLM answered %s to a ref its parser refused", message.get("status"))
                await refuse(scope, send, errors[0])
                return
        if not state["replaced"]:
            await send(message)

    return typed
