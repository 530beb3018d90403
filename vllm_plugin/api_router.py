"""HTTP routes of the plugin: ``POST /inference/v1/generate`` (replacing vLLM's) and
``POST /inference/v1/resolve`` (mirrors upstream ``token_in_token_out/api_router.py``).

The body is read under a byte limit, decoded (JSON as FastAPI decodes it, or msgpack), validated
as :class:`~vllm_plugin.protocol.MMRefGenerateRequest`, checked and resolved by
:class:`~vllm_plugin.serving.MMRefServing`, and served by vLLM's own ``serve_tokens``
(``serving_tokens.py``: resolved items reach the engine input as they are). A request
stock vLLM refuses gets stock's own error body: validation errors are raised as FastAPI's
``RequestValidationError`` and vLLM's exceptions propagate, both to the exception handlers vLLM
registered on the app. Only refusals this plugin adds are answered here (:func:`error_response`).
"""

from __future__ import annotations

import email.message
import json
import logging
import math
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from protocol.errors import AssetTooLarge, HashMismatch, InvalidRequest, MMRefError
from vllm_plugin import metrics
from vllm_plugin.protocol import error_body, parse_request
from vllm_plugin.serving import MMRefServing
from vllm_plugin.vllm_surface import load
from vllm_plugin.weights import WEIGHT_VERSION_HEADER, version_header

__all__ = [
    "WeightsRequest",
    "attach_router",
    "error_response",
    "generate",
    "hold_weights",
    "mmref_serving",
    "parse_request",
    "read_body",
    "release_weights",
    "resolve",
    "router",
    "update_weights",
    "weights_router",
]

logger = logging.getLogger("vllm.mmref")  # a child of vLLM's configured logger
router = APIRouter()
_ErrorResponse = load("ErrorResponse")
"""vLLM's error body (``vllm/entrypoints/serve/engine/protocol.py``): the route's documented answers."""

_MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
_UNSUPPORTED_MEDIA = "Unsupported Media Type: Only 'application/json' is allowed"
"""vLLM's ``validate_json_request`` message (``vllm/entrypoints/serve/utils/api_utils.py``)."""


def mmref_serving(request: Request) -> MMRefServing:
    """The app's :class:`MMRefServing` (set by the plugin's ``init_state``).

    Raises:
        InvalidRequest: the server has no engine (vLLM's CPU-only render server).
    """
    serving = getattr(request.app.state, "mmref_serving", None)
    if not isinstance(serving, MMRefServing):
        raise InvalidRequest("this server has no engine: mmref routes need `vllm serve`")
    return serving


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


async def read_body(request: Request, limit: int) -> Any:
    """The request body, decoded: msgpack when the content type says so, else JSON exactly as
    vLLM's own route admits it (stock's errors for a non-JSON content type or invalid JSON).

    Raises:
        AssetTooLarge: the body exceeds ``limit`` bytes (checked on Content-Length first; logged).
        InvalidRequest: undecodable msgpack.
        RequestValidationError: stock's refusal (content type, JSON syntax).
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
    body = _decode_json(raw) if raw and _json_like(content_type) else None
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


def _decode_json(raw: bytearray) -> Any:
    """msgspec's fast decoder, falling back to the stdlib's (what Starlette uses) for what msgspec
    refuses (NaN, integers beyond 64 bits, lone surrogates) and for stock's error.

    Raises:
        RequestValidationError: FastAPI's ``json_invalid`` error, position and message included.
        HTTPException: FastAPI's 400 for a body the JSON parser fails on otherwise (nesting).
    """
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        pass
    try:
        return json.loads(bytes(raw))
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([{**error, "ctx": {"error": e.msg}}], body=e.doc) from e
    except (ValueError, RecursionError) as e:  # FastAPI's answer to any other parse failure
        # (UnicodeDecodeError; an integer over Python's 4300-digit limit: a plain ValueError),
        # raised as FastAPI raises it (Starlette's class: FastAPI's default handler, ``{"detail"}``)
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e


@router.post(
    "/inference/v1/generate",
    responses={
        HTTPStatus.OK.value: {"content": {"text/event-stream": {}}},
        HTTPStatus.BAD_REQUEST.value: {"model": _ErrorResponse},
        HTTPStatus.NOT_FOUND.value: {"model": _ErrorResponse},
        HTTPStatus.UNPROCESSABLE_ENTITY.value: {"model": _ErrorResponse},
        HTTPStatus.INTERNAL_SERVER_ERROR.value: {"model": _ErrorResponse},
    },
)
async def generate(raw_request: Request) -> Response:
    """vLLM's token-in/token-out generate, with refs resolved and requests checked first."""
    try:
        serving = mmref_serving(raw_request)
        body = await read_body(raw_request, serving.max_body_bytes)
    except MMRefError as e:
        return error_response(e)
    return await _generate(body, raw_request)


@load("with_cancellation")  # as vLLM's own route: a client that hangs up aborts its generation
@load("load_aware_call")
async def _generate(body: Any, raw_request: Request) -> Response:
    """:meth:`MMRefServing.serve` (its errors are stock's, or the plugin's typed refusals).

    The body is read before this runs: ``with_cancellation`` listens to the request's remaining
    messages for a disconnect (vllm/entrypoints/serve/utils/api_utils.py).
    """
    try:
        result, version = await mmref_serving(raw_request).serve(body, raw_request)
    except MMRefError as e:
        logger.info("mmref refused a generate request: %s %s", e.code, e.message[:300])
        return error_response(e)
    if isinstance(result, _ErrorResponse):
        return JSONResponse(content=result.model_dump(), status_code=result.error.code)
    headers = _version_headers(version)
    if isinstance(result, load("GenerateResponseBase")):
        return JSONResponse(content=result.model_dump(), headers=headers)
    return StreamingResponse(content=result, media_type="text/event-stream", headers=headers)


@router.post("/inference/v1/resolve")
async def resolve(raw_request: Request) -> Response:
    """Resolve a generate request's refs into the ``features`` the engine would get.

    Returns ``{"features", "fingerprint", "pixel_mode"}``: ``kwargs_data`` items are vLLM's base64
    msgpack encoding (made here, in the worker pool) of the exact tensors
    ``/inference/v1/generate`` feeds the model.
    """
    try:
        serving = mmref_serving(raw_request)
        body = await read_body(raw_request, serving.max_body_bytes)
        content, version = await serving.resolved_features(body)
    except MMRefError as e:
        return error_response(e)
    return JSONResponse(content=content, headers=_version_headers(version))


def _version_headers(version: str) -> dict[str, str]:
    """The answer's weight-version header (none for a version no header can carry)."""
    value = version_header(version)
    return {} if value is None else {WEIGHT_VERSION_HEADER: value}


weights_router = APIRouter()
"""The weight-update routes (``updates.py``), attached only with ``VLLM_SERVER_DEV_MODE=1``, as vLLM's own
weight routes: they reload weights from a path on the server."""


class WeightsRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of ``/mmref/v1/weights/{update,hold,release}`` (fields each route does not use: refused)."""

    weights_path: str | None = None
    """``update``: the checkpoint folder ``reload_weights`` reads (on the server)."""
    version: str | None = None
    """``update`` (required), ``release`` (optional): the new weights' version, new for every set."""
    timeout_s: float | None = None
    """``update``, ``hold``: how long requests in flight may take to finish (None: no limit)."""


async def _weights_request(raw_request: Request, allowed: set[str]) -> WeightsRequest:
    raw = await raw_request.body()
    try:
        request = msgspec.json.decode(raw or b"{}", type=WeightsRequest)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"weights request body: {e}") from e
    given = {f for f in WeightsRequest.__struct_fields__ if getattr(request, f) is not None}
    if given - allowed:
        raise InvalidRequest(f"fields {sorted(given - allowed)} do not apply to this route")
    return request


def _updates(raw_request: Request) -> Any:
    from vllm_plugin.updates import WeightUpdates

    updates = getattr(raw_request.app.state, "mmref_updates", None)
    if not isinstance(updates, WeightUpdates):
        raise InvalidRequest("this server has no engine: mmref routes need `vllm serve`")
    return updates


async def _weights_call(
    raw_request: Request, fields: set[str], call: Callable[[Any, WeightsRequest], Awaitable[dict]]
) -> Response:
    """Parse the body (only ``fields`` allowed), run ``call(updates, body)``, answer its JSON or
    the typed refusal."""
    try:
        body = await _weights_request(raw_request, fields)
        result = await call(_updates(raw_request), body)
    except MMRefError as e:
        return error_response(e)
    return JSONResponse(content=result)


@weights_router.post("/mmref/v1/weights/update")
async def update_weights(raw_request: Request) -> Response:
    """Drain, ``reload_weights`` from ``weights_path``, bind ``version``, resume (``updates.py``)."""

    def update(updates: Any, body: WeightsRequest) -> Awaitable[dict]:
        if body.weights_path is None or body.version is None:
            raise InvalidRequest("weights_path and version are required")
        return updates.update(weights_path=body.weights_path, version=body.version, timeout_s=body.timeout_s)

    return await _weights_call(raw_request, {"weights_path", "version", "timeout_s"}, update)


@weights_router.post("/mmref/v1/weights/hold")
async def hold_weights(raw_request: Request) -> Response:
    """Drain and pause: the weights may then change through any of vLLM's weight routes. A client
    that hangs up while the drain runs cancels the hold (the gate reopens): no one would release
    a hold whose answer never arrived."""
    try:
        body = await _weights_request(raw_request, {"timeout_s"})
    except MMRefError as e:
        return error_response(e)
    return await _hold(body, raw_request)


@load("with_cancellation")  # the body is read: it listens for the client's disconnect
async def _hold(body: WeightsRequest, raw_request: Request) -> Response:
    try:
        return JSONResponse(content=await _updates(raw_request).hold(timeout_s=body.timeout_s))
    except MMRefError as e:
        return error_response(e)


@weights_router.post("/mmref/v1/weights/release")
async def release_weights(raw_request: Request) -> Response:
    """Reset the caches, bind ``version`` (if given), resume."""
    return await _weights_call(raw_request, {"version"}, lambda u, b: u.release(version=b.version))


def attach_router(app: FastAPI, *, dev_mode: bool) -> None:
    """Attach the generate and resolve routes, and, in dev mode, the weight-update routes."""
    app.include_router(router)
    if dev_mode:
        app.include_router(weights_router)
