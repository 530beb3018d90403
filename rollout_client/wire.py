"""The request and the answer of ``POST /inference/v1/generate``, without I/O.

:func:`encode_body` writes the request (the prompt's token ids, its refs as strings, the sampling
parameters); :func:`read_answer` turns what one attempt got (an ``httpx.Response`` or a transport
error) into the decoded 200 body, a :class:`Retry`, or raises the refusal:

- a 200 under the version the call asked for (or any, when it asked for none): the body;
- a retryable answer (:mod:`rollout_client.retry`: 429, 502, 503, 504, typed or not, e.g. the
  plugin's 503 ``drain_timeout``; a refused or reset connection; a 200 under another version than
  the call asked for): a :class:`Retry`;
- a plugin refusal (a body with ``mmref_code``): raised as its :mod:`protocol.errors` class;
  any other error answer: :class:`~rollout_client.errors.ServerRefusal`; a read timeout:
  :class:`~rollout_client.errors.RolloutTimeout` (never sent again: the server may still be
  generating).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from protocol.errors import MMRefError, error_from_body
from protocol.structs import RawMMRef
from rollout_client.conversation import PreparedPrompt
from rollout_client.errors import RolloutTimeout, ServerRefusal, WeightVersionMismatch, retries_exhausted
from rollout_client.result import WEIGHT_VERSION_HEADER
from rollout_client.retry import parse_retry_after

__all__ = [
    "GENERATE_PATH",
    "RETRYABLE_TRANSPORT",
    "SESSION_HEADER",
    "Retry",
    "encode_body",
    "read_answer",
    "request_headers",
]

GENERATE_PATH = "/inference/v1/generate"
SESSION_HEADER = "X-Session-ID"
"""vLLM's session header (``vllm/entrypoints/generate/base/serving.py``): routers use it for affinity."""

RETRYABLE_TRANSPORT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)
"""Connection refused or reset, the server closing without an answer, no free connection in a
caller's capped pool (the request was never sent): sent again. Other timeouts (read, write) raise
:class:`RolloutTimeout`."""


@dataclass
class Retry:
    """A retryable outcome of one attempt.

    Attributes:
        status: the HTTP status, None for a transport error.
        message: what the answer said.
        retry_after: the server's ``Retry-After`` seconds, if any.
        served_version, expected_version: for a 200 under another version than asked for.
        refusal: the plugin's typed error of a retryable refusal (``store_unavailable``,
            ``drain_timeout``): the error raised when the policy gives up is also of its class,
            and chains it (:func:`~rollout_client.errors.retries_exhausted`).
    """

    status: int | None
    message: str
    retry_after: float | None = None
    served_version: str | None = None
    expected_version: str | None = None
    refusal: MMRefError | None = None

    def exhausted(self, attempts: int) -> Exception:
        """The error to raise once the policy gives up after ``attempts`` attempts."""
        if self.expected_version is not None:
            return WeightVersionMismatch(
                f"asked for weight version {self.expected_version!r}, the server answered under "
                f"{self.served_version!r} on all {attempts} attempt(s)",
                expected=self.expected_version,
                served=[self.served_version or ""],
            )
        return retries_exhausted(attempts, self.status, self.message, self.refusal)


def encode_body(
    prepared: PreparedPrompt, sampling_params: dict[str, Any], extra_body: Mapping[str, Any] | None
) -> bytes:
    """The JSON request body: ``token_ids``, ``mm_refs`` (ref strings), ``sampling_params``, then
    ``extra_body``'s fields."""
    body: dict[str, Any] = {"token_ids": prepared.prompt_ids}
    if prepared.images:
        body["mm_refs"] = [r.ref if isinstance(r, RawMMRef) else r for r in prepared.images]
    body["sampling_params"] = sampling_params
    body.update(extra_body or {})
    return msgspec.json.encode(body)


def request_headers(headers: Mapping[str, str], session_id: str | None) -> dict[str, str]:
    """``headers`` plus the content type and, when given, ``X-Session-ID``."""
    out = {"Content-Type": "application/json", **headers}
    if session_id:
        out[SESSION_HEADER] = session_id
    return out


def read_answer(
    answer: httpx.Response | Exception,
    *,
    expected_version: str | None,
    retry_statuses: Collection[int],
    read_timeout: float | None = None,
) -> dict[str, Any] | Retry:
    """One attempt's answer: the 200's decoded body, a :class:`Retry`, or raises (module doc).

    Raises:
        MMRefError subclasses: the plugin's refusals (not retryable).
        ServerRefusal: any other error answer that is not retryable.
        RolloutTimeout: no answer within the attempt's timeout.
    """
    if isinstance(answer, RETRYABLE_TRANSPORT):
        return Retry(None, f"{type(answer).__name__}: {answer}")
    if isinstance(answer, httpx.TimeoutException):
        raise RolloutTimeout(f"no answer within {read_timeout} s: {answer}") from answer
    if isinstance(answer, Exception):
        raise answer
    status = answer.status_code
    try:
        data = msgspec.json.decode(answer.content) if answer.content else None
    except msgspec.DecodeError:
        data = None
    if status == 200 and isinstance(data, dict):
        served = answer.headers.get(WEIGHT_VERSION_HEADER)
        if expected_version is not None and served != expected_version:
            return Retry(status, "other weights", None, served, expected_version)
        return data
    refusal = error_from_body(data)
    message = _message(data, answer)
    if status in retry_statuses:
        retry_after = parse_retry_after(answer.headers.get("retry-after"))
        code = f"{refusal.code}: " if refusal is not None else ""
        return Retry(status, code + message, retry_after, refusal=refusal)
    if refusal is not None:
        raise refusal
    raise ServerRefusal(status, message, data)


def _message(data: Any, response: httpx.Response) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message", ""))
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])
    return response.text[:500]
