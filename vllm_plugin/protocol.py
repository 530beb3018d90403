"""Request and error schemas of the plugin's routes (mirrors upstream
``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``, which it extends).

:class:`MMRefGenerateRequest` is vLLM's own ``GenerateRequest`` plus one field, ``mm_refs``; a
``features.kwargs_data`` slot may also hold a ref string (vLLM's schema already types slots as
``str | None``). Everything else (types, ranges, ``sampling_params``, vLLM's cross-field rules)
is vLLM's validation, so a body stock vLLM refuses is refused with stock's own error body.

Error bodies (:func:`error_body`) parse as vLLM's ``ErrorResponse``: ``{"error": {"message",
"type", "param", "code"}}`` with ``code`` the integer HTTP status, plus, for refusals only this
plugin makes, ``mmref_code`` (a stable string, :mod:`protocol.errors`) and ``ref`` (the
offending ref, at most 512 characters, or null).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Annotated, Any

import msgspec
from fastapi.exceptions import RequestValidationError
from pydantic import PlainSerializer, PlainValidator, ValidationError, model_validator

from protocol.errors import InvalidRef, InvalidRequest, MMRefError
from protocol.structs import RawMMRef
from upstream import load

__all__ = ["ERROR_TYPES", "MMRefEntry", "MMRefGenerateRequest", "error_body", "parse_request"]


def _ref_entry(value: Any) -> str | RawMMRef:
    """An ``mm_refs`` entry: a ref string as is, an object converted to a :class:`RawMMRef`.

    Raises:
        InvalidRef: an object that is not a valid ``RawMMRef``.
        InvalidRequest: neither a string nor an object.
    """
    if isinstance(value, str | RawMMRef):
        return value
    if isinstance(value, dict):
        try:
            return msgspec.convert(value, RawMMRef)
        except msgspec.ValidationError as e:
            raise InvalidRef(f"mm_refs entry is not a RawMMRef: {e}") from e
    raise InvalidRequest(
        f"mm_refs entries must be ref strings or RawMMRef objects, got {type(value).__name__}"
    )


MMRefEntry = Annotated[
    str | RawMMRef,
    PlainValidator(_ref_entry),
    PlainSerializer(lambda v: v if isinstance(v, str) else msgspec.to_builtins(v)),
]
"""One image of ``mm_refs``: an ``mmraw:``/``mmfile:v1:`` string or a ``RawMMRef`` object."""


_GenerateRequest = load("GenerateRequest")
"""vLLM's ``GenerateRequest`` (``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``)."""


class MMRefGenerateRequest(_GenerateRequest):  # type: ignore[misc,valid-type]
    """vLLM's ``GenerateRequest`` with top-level refs.

    ``mm_refs`` (prompt order) replace ``features``: the server resolves each ref and locates
    each image's run of ``num_placeholders`` placeholder tokens in ``token_ids``.
    """

    mm_refs: list[MMRefEntry] | None = None
    """Images by reference, in prompt order; exclusive with ``features`` and ``content_parts``."""

    @model_validator(mode="after")
    def _check_mm_refs(self) -> MMRefGenerateRequest:
        if self.mm_refs is None:
            return self
        if not self.mm_refs:
            raise InvalidRequest("mm_refs must be a non-empty list of refs")
        if self.features is not None or self.content_parts:
            raise InvalidRequest("give either mm_refs or features/content_parts, not both")
        return self


ERROR_TYPES = {
    400: "BadRequestError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    503: "ServiceUnavailableError",
}
"""``error.type`` by HTTP status, the OpenAI client's exception names (vLLM uses the same)."""


def error_body(error: MMRefError, message: str) -> dict[str, Any]:
    """The response body of a refusal only this plugin makes (see the module doc).

    Args:
        error: the refusal.
        message: its message, already cleaned for the client.
    """
    status = HTTPStatus(error.http_status)
    return {
        "error": {
            "message": _printable(message),
            "type": ERROR_TYPES.get(status.value, status.phrase),
            "param": None,
            "code": status.value,
            "mmref_code": error.code,
            "ref": _printable(error.ref[:512]) if isinstance(error.ref, str) else None,
        }
    }


def _printable(text: str) -> str:
    """``text`` with lone surrogates (valid in a JSON string, not in UTF-8) escaped, so the body
    can be encoded."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
