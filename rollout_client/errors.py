"""What the client raises besides the protocol's typed errors (:mod:`protocol.errors`).

A plugin refusal (an error body with ``mmref_code``) is raised as its :class:`~protocol.errors.MMRefError`
subclass, rebuilt by :func:`protocol.errors.error_from_body`. Everything else the client can meet::

    RolloutError(Exception)
    ├── ServerRefusal          stock vLLM refused the request (no ``mmref_code``): schema, sampling
    │                          checks, a prompt over ``max_model_len``, a 500...
    ├── RetriesExhausted       a retryable answer (429, 502, 503, 504, a refused connection) every
    │                          attempt, until ``RetryPolicy.max_attempts`` or its deadline
    ├── WeightVersionMismatch  answered under other weights than asked for, every attempt; or a group
    │                          that never came back under one version
    └── RolloutTimeout         (also a ``TimeoutError``) no answer within the timeout
"""

from __future__ import annotations

from typing import Any

__all__ = ["RetriesExhausted", "RolloutError", "RolloutTimeout", "ServerRefusal", "WeightVersionMismatch"]


class RolloutError(Exception):
    """Base class of the client's own errors."""


class ServerRefusal(RolloutError):
    """An error answer without ``mmref_code``: stock vLLM's own refusal (or an answer that is not
    vLLM's ``ErrorResponse`` at all, e.g. a proxy's).

    Attributes:
        status_code: the HTTP status.
        message: ``error.message`` of the body (or the body's first 500 characters).
        body: the decoded JSON body, None when it was not JSON.
    """

    def __init__(self, status_code: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.body = body


class RetriesExhausted(RolloutError):
    """Every attempt met a retryable answer.

    Attributes:
        attempts: attempts made.
        last_status: the last answer's HTTP status, None for a transport error.
        last_message: what the last answer said.
    """

    def __init__(self, attempts: int, last_status: int | None, last_message: str) -> None:
        status = f"HTTP {last_status}" if last_status is not None else "no answer"
        super().__init__(f"gave up after {attempts} attempt(s); last: {status}: {last_message}")
        self.attempts = attempts
        self.last_status = last_status
        self.last_message = last_message


class WeightVersionMismatch(RolloutError):
    """The server answered under another weight version than the one asked for, on every attempt
    (``expected_weight_version``), or a group's samples never all came back under one version.

    Attributes:
        expected: the version asked for (None for a group that did not settle).
        served: the version(s) the answers named (``x-mmref-weight-version``).
    """

    def __init__(self, message: str, *, expected: str | None, served: list[str]) -> None:
        super().__init__(message)
        self.expected = expected
        self.served = served


class RolloutTimeout(RolloutError, TimeoutError):
    """No answer within the read timeout or the call's deadline (not retried: the server may
    still be generating it)."""
