"""HTTP routes of the plugin: ``POST /inference/v1/generate`` (replacing vLLM's) and
``POST /inference/v1/resolve``; one function maps errors to responses."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from vllm.entrypoints.serve.utils.api_utils import load_aware_call, with_cancellation

from protocol.errors import AssetTooLarge, InvalidRequest, MMRefError
from vllm_plugin import metrics

__all__ = ["attach_router", "error_response"]

logger = logging.getLogger("vllm.mmref")  # a child of vLLM's configured logger
router = APIRouter()


def error_response(error: MMRefError) -> JSONResponse:
    """vLLM's ``ErrorResponse`` shape plus our stable ``code`` and the offending ``ref``.

    ``{"error": {"message", "type", "param", "code", "ref"}}`` with the error's HTTP status.
    No traceback ever leaves the server.
    """
    metrics.REF_ERRORS.labels(error.code).inc()
    status = HTTPStatus(error.http_status)
    ref = error.ref[:512] if isinstance(error.ref, str) else None
    return JSONResponse(
        status_code=status.value,
        content={
            "error": {
                "message": error.message,
                "type": type(error).__name__,
                "param": None,
                "code": error.code,
                "ref": ref,
            }
        },
    )


_MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


async def _read_body(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a dict: JSON, or msgpack when the content type says so.

    Raises:
        AssetTooLarge: the body exceeds ``limit`` bytes (checked on Content-Length first).
        InvalidRequest: undecodable, or not an object/map.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise AssetTooLarge(f"request body is {declared} bytes, limit {limit}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise AssetTooLarge(f"request body exceeds {limit} bytes")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if content_type in _MSGPACK_TYPES:
            body = msgspec.msgpack.decode(raw)  # msgspec reads the bytearray: no copy of the body
        else:
            body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:  # ~1000 nested levels
        kind = "msgpack" if content_type in _MSGPACK_TYPES else "JSON"
        raise InvalidRequest(f"body is not valid {kind}: {e}") from e
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object (or a msgpack map)")
    return body


def _resolver(request: Request):
    resolver = getattr(request.app.state, "mmref_resolver", None)
    if resolver is None:
        raise InvalidRequest("this server has no engine: mmref routes need `vllm serve`")
    return resolver


@router.post("/inference/v1/generate")
async def generate(raw_request: Request) -> Response:
    """vLLM's token-in/token-out generate, with refs resolved first (see ``serving.py``)."""
    try:
        resolver = _resolver(raw_request)
        body = await _read_body(raw_request, resolver.config.max_body_bytes)
    except MMRefError as e:
        return error_response(e)
    return await _generate(body, raw_request)


@with_cancellation  # as vLLM's own route: a client that hangs up aborts its generation
@load_aware_call
async def _generate(body: dict[str, Any], raw_request: Request) -> Response:
    """Resolve, validate with vLLM's ``GenerateRequest``, run vLLM's ``serve_tokens``.

    The body is read before this runs: ``with_cancellation`` listens to the request's remaining
    messages for a disconnect (vllm/entrypoints/serve/utils/api_utils.py).
    """
    from pydantic import ValidationError
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateRequest,
        GenerateResponseBase,
    )
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.exceptions import VLLMClientError

    resolver = raw_request.app.state.mmref_resolver
    try:
        body = await resolver.fill_features(body)
        try:
            request = GenerateRequest.model_validate(body)
        except ValidationError as e:
            raise InvalidRequest(_summarize(e)) from e
        except VLLMClientError as e:  # vLLM's own checks (e.g. max_tokens < 1, temperature < 0)
            raise InvalidRequest(str(e)) from e
    except MMRefError as e:
        logger.info("mmref refused a generate request: %s %s", e.code, e.message)
        return error_response(e)

    handler = raw_request.app.state.serving_tokens
    try:
        result = await handler.serve_tokens(request, raw_request)
    except Exception as e:  # vLLM raises some validation errors (e.g. out-of-vocab ids)
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        result = create_error_response(e)  # vLLM's own status mapping; 5xx stays 5xx
    if isinstance(result, ErrorResponse):
        return _engine_error(result)
    if isinstance(result, GenerateResponseBase):
        return JSONResponse(content=result.model_dump())
    return StreamingResponse(content=result, media_type="text/event-stream")


@router.post("/inference/v1/resolve")
async def resolve(raw_request: Request) -> Response:
    """Resolve ``{"token_ids", "mm_refs"}`` into the ``features`` the engine would get.

    Returns ``{"features": {...}}`` in vLLM's wire format (``kwargs_data`` items are vLLM's
    base64 msgpack encoding): the exact tensors ``/inference/v1/generate`` feeds the model.
    """
    try:
        resolver = _resolver(raw_request)
        body = await _read_body(raw_request, resolver.config.max_body_bytes)
        body = await resolver.fill_features(body)
    except MMRefError as e:
        return error_response(e)
    return JSONResponse(
        content={
            "features": body.get("features"),
            "fingerprint": resolver.adapter.fingerprint,
            "pixel_mode": resolver.pixel_mode,
        }
    )


def _engine_error(result: Any) -> JSONResponse:
    """vLLM's own ``ErrorResponse`` (e.g. a prompt longer than ``max_model_len``, a token id out of
    vocabulary), with its integer ``code`` replaced by our stable string code: ``engine_rejected``
    for a 4xx, ``engine_error`` for a 5xx. Message, type and status are vLLM's."""
    content = result.model_dump()
    status = int(result.error.code)
    content["error"]["code"] = "engine_rejected" if status < 500 else "engine_error"
    content["error"].setdefault("ref", None)
    metrics.REF_ERRORS.labels(content["error"]["code"]).inc()
    return JSONResponse(content=content, status_code=status)


def _summarize(error: Any) -> str:
    parts = []
    for err in error.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg', '')}")
    return "invalid generate request: " + "; ".join(parts)


def attach_router(app: FastAPI) -> None:
    app.include_router(router)
