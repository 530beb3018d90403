"""When and how long the client waits before sending a request again (pure: no I/O here).

Retried: HTTP 429, 502, 503 and 504 (an overloaded, restarting or draining server, or a router in
front of one), a refused or reset connection, and an answer under another weight version than the
call asked for. Never retried: the plugin's refusals and stock vLLM's (the same body gets the same
answer), and read timeouts (the server may still be generating: sending again doubles the work).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["RETRYABLE_STATUSES", "RetryPolicy", "parse_retry_after"]

RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
"""HTTP statuses sent again by default."""


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded attempts, exponential backoff with full jitter, one deadline per call.

    The wait before attempt ``k + 1`` (``k >= 1`` failed attempts) is uniform in
    ``[0, min(max_backoff_s, initial_backoff_s * 2 ** (k - 1))]`` (AWS's "full jitter"), or the
    server's ``Retry-After`` seconds when it sends one (capped at ``max_backoff_s``).

    Attributes:
        max_attempts: attempts per request, the first included (>= 1); also the most draws of a
            ``sample_group`` whose versions do not settle.
        initial_backoff_s: the first wait's upper bound, seconds.
        max_backoff_s: the largest wait, seconds.
        deadline_s: the whole call (every attempt and wait, a group's redraws included) ends
            within this many seconds.
        statuses: the HTTP statuses sent again.
    """

    max_attempts: int = 6
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 8.0
    deadline_s: float = 900.0
    statuses: frozenset[int] = RETRYABLE_STATUSES

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.deadline_s <= 0:
            raise ValueError("backoffs must be >= 0 and the deadline > 0 seconds")

    def delay(
        self, failed_attempts: int, retry_after: float | None = None, rng: random.Random | None = None
    ) -> float:
        """Seconds to wait after ``failed_attempts`` (>= 1) failures; ``retry_after`` from the
        server's ``Retry-After`` header wins when given."""
        if retry_after is not None and retry_after >= 0:
            return min(retry_after, self.max_backoff_s)
        cap = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (failed_attempts - 1))
        return (rng or random).uniform(0.0, cap)


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (delta-seconds form only; an HTTP date is ignored)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None
