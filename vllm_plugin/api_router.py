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

import asyncio
import email.message
import json
import logging
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.utils.api_utils import load_aware_call, with_cancellation

from protocol.errors import AssetTooLarge, HashMismatch, InvalidRequest, MMRefError
from vllm_plugin import metrics
from vllm_plugin.items import encode_item
from vllm_plugin.protocol import MMRefGenerateRequest, error_body
from vllm_plugin.serving import MMRefServing
from vllm_plugin.serving_tokens import pending_items
from vllm_plugin.weights import WEIGHT_VERSION_HEADER, served_by

__all__ = [
    "attach_router",
    "error_response",
    "generate",
    "mmref_serving",
    "parse_request",
    "read_body",
    "resolve",
    "router",
]

logger = logging.getLogger("vllm.mmref")  # a child of vLLM's configured logger
router = APIRouter()

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
    the ref); a hash mismatch never echoes the digest of what the file holds.
    """
    from vllm.entrypoints.serve.exception_handling.utils import sanitize_message

    metrics.REF_ERRORS.labels(error.code).inc()
    message = error.message
    if isinstance(error, HashMismatch):
        message = "the bytes read do not have the sha256 the ref (or the feature envelope) names"
    return JSONResponse(status_code=error.http_status, content=error_body(error, sanitize_message(message)))


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
    media_type = content_type.split(";")[0].strip().lower()
    if media_type in _MSGPACK_TYPES:
        try:
            return msgspec.msgpack.decode(raw) if raw else None
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
            raise InvalidRequest(f"body is not valid msgpack: {e}") from e
    body = _decode_json(raw) if raw and _json_like(content_type) else None
    if media_type != "application/json":  # vLLM's validate_json_request, after FastAPI's parse
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
    except (UnicodeDecodeError, RecursionError) as e:  # FastAPI's answer to any other parse failure,
        # raised as FastAPI raises it (Starlette's class: FastAPI's default handler, ``{"detail"}``)
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e


def parse_request(body: Any) -> MMRefGenerateRequest:
    """Validate the body the way FastAPI validates stock's ``GenerateRequest`` parameter.

    Raises:
        RequestValidationError: what stock vLLM refuses (its handler builds stock's body).
        MMRefError: ``mm_refs`` errors (stock has no such field).
    """
    if body is None:
        missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise RequestValidationError([missing])
    try:
        return MMRefGenerateRequest.model_validate(body, from_attributes=True)  # as FastAPI
    except ValidationError as e:
        errors = e.errors(include_url=False)
        stock = [err for err in errors if not _is_mm_refs_error(err)]
        if stock:
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in stock]) from e
        ours = next((err["ctx"]["error"] for err in errors if _ctx_error(err) is not None), None)
        if ours is not None:
            raise ours from e
        raise InvalidRequest(f"mm_refs must be a list of refs: {errors[0]['msg']}") from e


def _ctx_error(err: dict[str, Any]) -> MMRefError | None:
    error = err.get("ctx", {}).get("error")
    return error if isinstance(error, MMRefError) else None


def _is_mm_refs_error(err: dict[str, Any]) -> bool:
    return (err.get("loc") or ("",))[0] == "mm_refs" or _ctx_error(err) is not None


@router.post(
    "/inference/v1/generate",
    responses={
        HTTPStatus.OK.value: {"content": {"text/event-stream": {}}},
        HTTPStatus.BAD_REQUEST.value: {"model": ErrorResponse},
        HTTPStatus.NOT_FOUND.value: {"model": ErrorResponse},
        HTTPStatus.UNPROCESSABLE_ENTITY.value: {"model": ErrorResponse},
        HTTPStatus.INTERNAL_SERVER_ERROR.value: {"model": ErrorResponse},
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


@with_cancellation  # as vLLM's own route: a client that hangs up aborts its generation
@load_aware_call
async def _generate(body: Any, raw_request: Request) -> Response:
    """Validate, check, resolve, then vLLM's ``serve_tokens`` (its errors are stock's).

    The body is read before this runs: ``with_cancellation`` listens to the request's remaining
    messages for a disconnect (vllm/entrypoints/serve/utils/api_utils.py).
    """
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateResponseBase

    serving = mmref_serving(raw_request)
    for attempt in (1, 2):  # once more if the weights changed between prepare and prefill
        try:
            prepared = await serving.prepare(parse_request(body))
        except MMRefError as e:
            logger.info("mmref refused a generate request: %s %s", e.code, e.message[:300])
            return error_response(e)
        with pending_items(prepared.slots):
            result = await serving.serving_tokens.serve_tokens(prepared.request, raw_request)
        if isinstance(result, ErrorResponse):
            return JSONResponse(content=result.model_dump(), status_code=result.error.code)
        serving.record(prepared.sent)
        done = not isinstance(result, GenerateResponseBase) or served_by(result, prepared.version)
        if done or attempt == 2:
            break
        logger.info("mmref: weights changed from %r before prefill; generating again", prepared.version)
    headers = {WEIGHT_VERSION_HEADER: prepared.version}
    if isinstance(result, GenerateResponseBase):
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
        if isinstance(body, dict):  # resolving needs no sampling parameters
            body.setdefault("sampling_params", {})
        prepared = await serving.prepare(parse_request(body))
    except MMRefError as e:
        return error_response(e)
    features = prepared.request.features.model_dump() if prepared.request.features is not None else None
    if prepared.slots:
        loop = asyncio.get_running_loop()
        encoded = await asyncio.gather(
            *(loop.run_in_executor(serving.resolver.pool, encode_item, s.item) for s in prepared.slots)
        )
        for slot, data in zip(prepared.slots, encoded, strict=True):
            features["kwargs_data"][slot.modality][slot.index] = data
    return JSONResponse(
        content={
            "features": features,
            "fingerprint": serving.adapter.fingerprint,
            "pixel_mode": serving.resolver.pixel_mode,
        },
        headers={WEIGHT_VERSION_HEADER: prepared.version},
    )


def attach_router(app: FastAPI) -> None:
    app.include_router(router)
