"""HTTP routes of the plugin: ``POST /inference/v1/generate`` (replacing vLLM's) and
``POST /inference/v1/resolve`` (mirrors upstream ``token_in_token_out/api_router.py``).

The body is read under a byte limit and decoded by the HTTP edge (``http_edge.read_body``: JSON as
FastAPI decodes it, or msgpack), validated
as :class:`~vllm_plugin.protocol.MMRefGenerateRequest`, checked and resolved by
:class:`~vllm_plugin.serving.MMRefServing`, and served by vLLM's own ``serve_tokens``
(``serving_tokens.py``: resolved items reach the engine input as they are). A request
stock vLLM refuses gets stock's own error body: validation errors are raised as FastAPI's
``RequestValidationError`` and vLLM's exceptions propagate, both to the exception handlers vLLM
registered on the app. Only refusals this plugin adds are answered here (``http_edge.error_response``).
Routes only: what a body is and what an answer carries is ``http_edge.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from protocol.errors import InvalidRequest, MMRefError
from upstream import load
from vllm_plugin.http_edge import error_response, no_engine, read_body, version_headers
from vllm_plugin.serving import MMRefServing
from vllm_plugin.updates import WeightUpdates

__all__ = [
    "WeightsRequest",
    "attach_router",
    "generate",
    "hold_weights",
    "mmref_serving",
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


def mmref_serving(request: Request) -> MMRefServing:
    """The app's :class:`MMRefServing` (set by the plugin's ``init_state``).

    Raises:
        InvalidRequest: the server has no engine (vLLM's CPU-only render server).
    """
    serving = getattr(request.app.state, "mmref_serving", None)
    if not isinstance(serving, MMRefServing):
        raise no_engine()
    return serving


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
    headers = version_headers(version)
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
    return JSONResponse(content=content, headers=version_headers(version))


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


def _updates(raw_request: Request) -> WeightUpdates:
    updates = getattr(raw_request.app.state, "mmref_updates", None)
    if not isinstance(updates, WeightUpdates):
        raise no_engine()
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
