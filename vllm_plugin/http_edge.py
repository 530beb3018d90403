"""The plugin's HTTP edge: what comes in (a body's bytes under a limit, their decoding) and what
goes out (the typed refusal, the weight-version header), for the plugin's routes
(``api_router.py``) and for the admission middleware on vLLM's own routes (``admission.py``).

Both import it from below; it imports nothing of the plugin's request path. One rule each:

- a JSON body is decoded by :func:`decode_json` (msgspec, else the stdlib as Starlette reads it,
  with stock's own errors); a route's body is read by :func:`read_body`, the middleware's ASGI
  messages by :func:`read_messages` and given back by :func:`replay`;
- a plugin refusal becomes its answer in :func:`error_response` (:func:`refuse` on the ASGI side);
  a server without an engine is :func:`no_engine`;
- the version an answer was generated under is :func:`version_headers` (:func:`labelled` on the
  ASGI side).
"""

from __future__ import annotations

import email.message
import json
import logging
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from protocol.errors import AssetTooLarge, HashMismatch, InvalidRequest, MMRefError
from upstream import load
from vllm_plugin import metrics
from vllm_plugin.protocol import error_body
from vllm_plugin.weights import WEIGHT_VERSION_HEADER, version_header

__all__ = [
    "Message",
    "Receive",
    "Scope",
    "Send",
    "declared_length",
    "decode_json",
    "error_response",
    "labelled",
    "mentions",
    "no_engine",
    "post_state",
    "read_body",
    "read_messages",
    "refuse",
    "replay",
    "route_path",
    "version_headers",
    "with_length",
]

logger = logging.getLogger("vllm.mmref")  # a child of vLLM's configured logger

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
_UNSUPPORTED_MEDIA = "Unsupported Media Type: Only 'application/json' is allowed"
"""vLLM's ``validate_json_request`` message (``vllm/entrypoints/serve/utils/api_utils.py``)."""


# --- what comes in ----------------------------------------------------------------------------


def decode_json(raw: bytes | bytearray) -> tuple[Any, Callable[[Any], bytes]]:
    """A JSON body and the encoder that writes it back the way it was read: msgspec's fast
    decoder, else the stdlib's (what Starlette uses) for what msgspec refuses (NaN, integers
    beyond 64 bits, lone surrogates, UTF-16/32).

    Raises:
        RequestValidationError: FastAPI's ``json_invalid`` error, position and message included.
        HTTPException: FastAPI's 400 for a body the JSON parser fails on otherwise (nesting, an
            integer over Python's 4300-digit limit, undecodable bytes).
    """
    try:
        return msgspec.json.decode(raw), msgspec.json.encode
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        pass
    try:
        return json.loads(bytes(raw)), _stdlib_encode
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([{**error, "ctx": {"error": e.msg}}], body=e.doc) from e
    except (ValueError, RecursionError) as e:  # FastAPI's answer to any other parse failure,
        # raised as FastAPI raises it (Starlette's class: FastAPI's default handler, ``{"detail"}``)
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e


def _stdlib_encode(body: Any) -> bytes:
    return json.dumps(body).encode()


async def read_body(request: Request, limit: int) -> Any:
    """A plugin route's body, decoded: msgpack when the content type says so, else JSON exactly
    as vLLM's own route admits it (stock's errors for a non-JSON content type or invalid JSON).

    Raises:
        AssetTooLarge: the body exceeds ``limit`` bytes (checked on Content-Length first; logged).
        InvalidRequest: undecodable msgpack.
        RequestValidationError, HTTPException: stock's refusal (content type, JSON syntax).
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        _log_too_large(int(declared), limit)
        raise AssetTooLarge(f"request body is {declared} bytes, limit {limit} (MMREF_MAX_BODY_BYTES)")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            _log_too_large(len(raw), limit)
            raise AssetTooLarge(f"request body exceeds {limit} bytes (MMREF_MAX_BODY_BYTES)")
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() in _MSGPACK_TYPES:
        try:
            return msgspec.msgpack.decode(raw) if raw else None
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
            raise InvalidRequest(f"body is not valid msgpack: {e}") from e
    body = decode_json(raw)[0] if raw and _json_like(content_type) else None
    # vLLM's validate_json_request (serve/utils/api_utils.py), after FastAPI's parse: no strip
    if content_type.lower().split(";", 1)[0] != "application/json":
        raise RequestValidationError(errors=[_UNSUPPORTED_MEDIA])
    return body


def _log_too_large(size: int, limit: int) -> None:
    logger.warning("mmref refused a %d-byte request body: limit %d bytes (MMREF_MAX_BODY_BYTES)", size, limit)


def _json_like(content_type: str) -> bool:
    """FastAPI's rule for parsing a body as JSON (``fastapi/routing.py``)."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


async def read_messages(receive: Receive, limit: int | None) -> list[Message]:
    """The request's ASGI messages up to the end of its body (or a disconnect), or past ``limit``
    bytes of it (the rest is left to the route)."""
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        size += len(message.get("body", b""))
        if message.get("type") != "http.request" or not message.get("more_body", False):
            return messages
        if limit is not None and size > limit:
            return messages


def declared_length(scope: Scope) -> int:
    """The request's ``content-length`` (-1 when absent or not a number)."""
    for key, value in scope.get("headers", ()):
        if key.lower() == b"content-length":
            return int(value) if value.isdigit() else -1
    return -1


def replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that gives ``messages`` first, then the live ones."""

    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed


def with_length(headers: Any, length: int) -> list[tuple[bytes, bytes]]:
    """``headers`` with ``content-length`` set to ``length`` (a body rewritten by the middleware)."""
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    return [*kept, (b"content-length", str(length).encode())]


def mentions(chunks: list[bytes], needles: tuple[bytes, ...]) -> bool:
    """Whether any of ``needles`` occurs in the body, across chunk boundaries, without copying it."""
    width = max(len(n) for n in needles) - 1
    tail = b""
    for chunk in chunks:
        joint = tail + chunk[:width]
        if any(n in joint or n in chunk for n in needles):
            return True
        tail = (tail + chunk[-width:])[-width:]
    return False


# --- what goes out ----------------------------------------------------------------------------


def no_engine() -> InvalidRequest:
    """The refusal of a plugin route on a server without an engine (vLLM's CPU-only render server)."""
    return InvalidRequest("this server has no engine: mmref routes need `vllm serve`")


def error_response(error: MMRefError) -> JSONResponse:
    """The one mapping from a plugin refusal to its HTTP answer (body: ``protocol.error_body``).

    Messages go through vLLM's ``sanitize_message`` (no object addresses, no server paths beyond
    the ref); a hash mismatch never echoes the digest of what the file holds. A store outage says
    when asking again can help: ``Retry-After`` (whole seconds, rounded up), the root's hold-down
    (docs/SCALING.md §7).
    """
    sanitize_message = load("sanitize_message")
    metrics.REF_ERRORS.labels(error.code).inc()
    message = error.message
    if isinstance(error, HashMismatch):
        message = "the bytes read do not have the sha256 the ref (or the feature envelope) names"
    retry_after = getattr(error, "retry_after_s", None)
    headers = {"Retry-After": str(math.ceil(retry_after))} if retry_after else None
    content = error_body(error, sanitize_message(message))
    return JSONResponse(status_code=error.http_status, content=content, headers=headers)


async def refuse(scope: Scope, send: Send, error: MMRefError) -> None:
    """Answer ``error`` on the ASGI side (:func:`error_response`: the generate route's body), logged."""
    logger.info("mmref refused a request on vLLM's route: %s %s", error.code, error.message[:300])
    await error_response(error)(scope, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.disconnect"}


def version_headers(version: str) -> dict[str, str]:
    """The answer's weight-version header (none for a version no header can carry)."""
    value = version_header(version)
    return {} if value is None else {WEIGHT_VERSION_HEADER: value}


def labelled(send: Send, versions: Callable[[], Awaitable[str]]) -> Send:
    """``send`` with the weight version (``await versions()`` when the answer starts) added to a
    successful answer's headers."""

    async def with_version(message: Message) -> None:
        if message.get("type") == "http.response.start" and message.get("status") == 200:
            try:
                version = await versions()
            except Exception:
                version = None
            value = None if version is None else version_header(version)
            if value is not None:
                headers = list(message.get("headers", ()))
                headers.append((WEIGHT_VERSION_HEADER.encode(), value.encode("latin-1")))
                message = {**message, "headers": headers}
        await send(message)

    return with_version


def route_path(scope: Scope) -> str:
    """The path the app routes on: ``path`` less the ``root_path`` prefix (vLLM's ``--root-path``),
    as Starlette's own routing computes it (``starlette/_utils.py``, ``get_route_path``)."""
    path: str = scope.get("path", "")
    root = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


def post_state(scope: Scope, name: str) -> Any:
    """``app.state.<name>`` for an HTTP ``POST`` (what the plugin's middlewares act on); None for
    any other request, or where the app has no such attribute."""
    if scope.get("type") != "http" or scope.get("method") != "POST":
        return None
    return getattr(getattr(scope.get("app"), "state", None), name, None)
