"""Admission of every request that may reach the engine, on every route of the server (an ASGI
middleware the plugin adds to vLLM's app).

For each ``POST`` under the engine's routes (:data:`ENGINE_PREFIXES`: ``/v1/``, ``/inference/``,
pooling and scoring routes; never the control routes: ``/pause``, ``/collective_rpc``,
``/update_weights``, ``/mmref/v1/weights/*``, ``/metrics``...):

- **the gate** (:class:`Admission`): while a weight update holds the server
  (``updates.py``), new requests wait here, before vLLM reads them; the update first waits until
  every admitted request has finished (:meth:`Admission.drain`), so nothing this process admitted
  runs while the weights change, and nothing admitted after it meets the old weights;
- **the seed rule** (``seeds.py``) on vLLM's own routes, on a CPU server: a JSON body naming a
  ``seed`` is read once (bodies without the bytes ``"seed"`` are passed on unread) and refused with
  ``seed_unsupported`` when its prefill can be split; the plugin's generate route applies the rule
  itself, with the exact token count;
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
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from protocol.errors import DrainTimeout, MMRefError
from vllm_plugin.seeds import SplitRule
from vllm_plugin.weights import WEIGHT_VERSION_HEADER

__all__ = ["ENGINE_PREFIXES", "PLUGIN_PATHS", "Admission", "AdmissionMiddleware", "rule_check"]

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
)
"""Path prefixes of vLLM's routes that may hand a request to the engine."""

PLUGIN_PATHS = frozenset({"/inference/v1/generate", "/inference/v1/resolve"})
"""The plugin's own routes: they bind and label versions and apply the seed rule themselves."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Admission:
    """The gate and the count of admitted requests of this API process.

    Args:
        versions: the engine's weight version (for the header on vLLM's own routes).
        split_rule: seeded requests that can be split (``seeds.py``); None: no seed rule.
    """

    def __init__(self, versions: Callable[[], Awaitable[str]], split_rule: SplitRule | None) -> None:
        self.versions = versions
        self.split_rule = split_rule
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.admitted = 0
        """Requests admitted and not finished."""

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Wait while the gate is closed, then count the request until it finishes."""
        while not self._open.is_set():
            await self._open.wait()
        self.admitted += 1  # no suspension point since the gate was seen open
        self._idle.clear()
        try:
            yield
        finally:
            self.admitted -= 1
            if self.admitted == 0:
                self._idle.set()

    async def drain(self, timeout_s: float | None) -> None:
        """Close the gate and wait until every admitted request has finished.

        Raises:
            DrainTimeout: not within ``timeout_s`` (the gate is open again).
        """
        self._open.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            self._open.set()
            raise DrainTimeout(
                f"{self.admitted} requests admitted before the update still run after {timeout_s} s; "
                "nothing was changed"
            ) from None

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
        path = scope.get("path", "")
        async with admission.admit():
            if path in PLUGIN_PATHS:
                await self.app(scope, receive, send)
                return
            if admission.split_rule is not None:
                receive, refusal = await _seed_check(admission.split_rule, receive)
                if refusal is not None:
                    await _refuse(send, refusal)
                    return
            await self.app(scope, receive, _labelled(send, admission.versions))


def _admission(scope: Scope) -> Admission | None:
    if scope.get("type") != "http" or scope.get("method") != "POST":
        return None
    if not scope.get("path", "").startswith(ENGINE_PREFIXES):
        return None
    app = scope.get("app")
    admission = getattr(getattr(app, "state", None), "mmref_admission", None)
    return admission if isinstance(admission, Admission) else None


def _labelled(send: Send, versions: Callable[[], Awaitable[str]]) -> Send:
    """``send`` with the weight version added to a successful answer's headers."""

    async def labelled(message: Message) -> None:
        if message.get("type") == "http.response.start" and message.get("status") == 200:
            try:
                version = await versions()
            except Exception:
                version = None
            if version is not None:
                headers = list(message.get("headers", ()))
                headers.append((WEIGHT_VERSION_HEADER.encode(), version.encode("utf-8", "replace")))
                message = {**message, "headers": headers}
        await send(message)

    return labelled


async def _seed_check(rule: SplitRule, receive: Receive) -> tuple[Receive, MMRefError | None]:
    """Read the body; refuse a seeded request that can be split. Returns the ``receive`` that
    replays the body to vLLM's route."""
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message.get("type") != "http.request" or not message.get("more_body", False):
            break
    chunks = [m.get("body", b"") for m in messages if m.get("type") == "http.request"]
    refusal = None
    if _mentions_seed(chunks):  # only then is the body joined and parsed
        try:
            rule_check(rule, msgspec.json.decode(b"".join(chunks)))
        except MMRefError as e:
            refusal = e
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            pass  # not JSON: vLLM's route refuses it with its own error

    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()

    return replay, refusal


def _mentions_seed(chunks: list[bytes]) -> bool:
    """Whether the bytes ``"seed"`` occur in the body, across chunk boundaries, without copying it."""
    needle, tail = b'"seed"', b""
    for chunk in chunks:
        if needle in tail + chunk[: len(needle) - 1] or needle in chunk:
            return True
        tail = (tail + chunk[-(len(needle) - 1) :])[-(len(needle) - 1) :]
    return False


def rule_check(rule: SplitRule, body: Any) -> None:
    """The seed rule on an OpenAI-style body (``/v1/completions``, ``/v1/chat/completions``,
    ``/v1/responses``...): ``seed``, ``temperature``, ``max_tokens`` /
    ``max_completion_tokens`` / ``max_output_tokens`` at the top level (or in ``sampling_params``);
    the prompt's length is known only for a ``prompt`` of token ids, images only as content parts.

    Raises:
        SeedUnsupported: see :meth:`SplitRule.check`.
    """
    if not isinstance(body, dict):
        return
    params = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else body
    prompt = body.get("prompt")
    prompt_tokens = (
        len(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else None
    )
    max_tokens = next(
        (params[k] for k in ("max_tokens", "max_completion_tokens", "max_output_tokens") if k in params), None
    )
    rule.check(
        seed=params.get("seed"),
        temperature=params.get("temperature"),
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        image_tokens=int(_has_media(body)),
    )


def _has_media(body: dict[str, Any]) -> bool:
    """Whether a chat-style body carries a content part other than text."""
    for key in ("messages", "input"):
        for message in body.get(key) or () if isinstance(body.get(key), list) else ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") not in ("text", "input_text") for p in content
            ):
                return True
    return False


async def _refuse(send: Send, error: MMRefError) -> None:
    from vllm_plugin.protocol import error_body

    logger.info("mmref refused a request on vLLM's route: %s %s", error.code, error.message[:300])
    content = msgspec.json.encode(error_body(error, error.message))
    await send(
        {
            "type": "http.response.start",
            "status": error.http_status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(content)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": content})
