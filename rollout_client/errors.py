"""What the client raises besides the protocol's typed errors (:mod:`protocol.errors`).

A plugin refusal (an error body with ``mmref_code``) is raised as its :class:`~protocol.errors.MMRefError`
subclass, rebuilt by :func:`protocol.errors.error_from_body`. Everything else the client can meet::

    RolloutError(Exception)
    ├── ServerRefusal          stock vLLM refused the request (no ``mmref_code``): schema, sampling
    │                          checks, a prompt over ``max_model_len``, a 500...
    ├── RetriesExhausted       a retryable answer (429, 502, 503, 504, a refused connection) every
    │   │                      attempt, until ``RetryPolicy.max_attempts`` or its deadline
    │   ├── StoreUnavailableRetriesExhausted  the last answer: the plugin's 503 store_unavailable
    │   │                      (also a protocol.errors.StoreUnavailable)
    │   └── DrainTimeoutRetriesExhausted      the last answer: the plugin's 503 drain_timeout
    │                          (also a protocol.errors.DrainTimeout)
    ├── WeightVersionMismatch  answered under other weights than asked for, every attempt; or a group
    │                          that never came back under one version
    └── RolloutTimeout         (also a ``TimeoutError``) no answer within the timeout

A store outage is therefore caught by ``except StoreUnavailable`` (what the server said) and by
``except RetriesExhausted`` (with ``attempts``, what the client did); ``__cause__`` is the last
answer's error as the server sent it.
"""

from __future__ import annotations

from typing import Any

from protocol.errors import DrainTimeout, MMRefError, StoreUnavailable

__all__ = [
    "DrainTimeoutRetriesExhausted",
    "RetriesExhausted",
    "RolloutError",
    "RolloutTimeout",
    "ServerRefusal",
    "StoreUnavailableRetriesExhausted",
    "WeightVersionMismatch",
    "retries_exhausted",
]


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


class _TypedRetriesExhausted(RetriesExhausted):
    """Retries exhausted on one of the plugin's retryable refusals: also an instance of its
    :mod:`protocol.errors` class (``code``, ``http_status``, ``ref`` of the last answer)."""

    def __init__(
        self, attempts: int, last_status: int | None, last_message: str, ref: str | None = None
    ) -> None:
        super().__init__(attempts, last_status, last_message)
        self.ref = ref

    def __reduce__(self):  # the protocol error's pickling would call this class with its arguments
        return (type(self), (self.attempts, self.last_status, self.last_message, self.ref))


class StoreUnavailableRetriesExhausted(_TypedRetriesExhausted, StoreUnavailable):
    """Every attempt ended in a retryable answer, the last the plugin's 503 ``store_unavailable``:
    an object store the server reads could not be asked (the image may exist)."""


class DrainTimeoutRetriesExhausted(_TypedRetriesExhausted, DrainTimeout):
    """Every attempt ended in a retryable answer, the last the plugin's 503 ``drain_timeout``."""


def retries_exhausted(
    attempts: int, last_status: int | None, last_message: str, refusal: MMRefError | None
) -> RetriesExhausted:
    """The error raised when the policy gives up: typed after the last answer's refusal when it is
    one of the plugin's retryable ones (``__cause__``: that refusal as the server sent it)."""
    if isinstance(refusal, StoreUnavailable):
        error: RetriesExhausted = StoreUnavailableRetriesExhausted(
            attempts, last_status, last_message, refusal.ref
        )
    elif isinstance(refusal, DrainTimeout):
        error = DrainTimeoutRetriesExhausted(attempts, last_status, last_message, refusal.ref)
    else:
        error = RetriesExhausted(attempts, last_status, last_message)
    error.__cause__ = refusal
    return error


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
