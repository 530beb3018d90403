"""Which weight version is the newest: the one named by the answer this client received last.

vLLM's version labels are whatever the trainer set (``"default"``, ``"step-7"``): opaque, not
ordered. What orders them is time. Updated through the plugin's one call
(``POST /mmref/v1/weights/update``), a server answers every request it admitted before the update
under the old weights and before the update ends, and every later one (those sent during the update
wait at its gate) under the new weights (docs/WEIGHT-UPDATES.md). So, for one server, the answer
received last names the newest version. :class:`VersionClock` keeps it by the time each answer was
received (not by the order in which threads get to record it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from rollout_client.errors import WeightVersionMismatch
from rollout_client.result import Rollout

__all__ = ["VersionClock"]


class VersionClock:
    """The version named by the latest answer received (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at = float("-inf")
        self._latest: str | None = None

    @property
    def latest(self) -> str | None:
        """The version of the answer received last (None before the first answer)."""
        return self._latest

    def observe(self, version: str | None, received_at: float | None = None) -> None:
        """Record an answer's version; ``received_at`` (``time.monotonic()``, default now)."""
        at = time.monotonic() if received_at is None else received_at
        with self._lock:
            if at >= self._at:
                self._at, self._latest = at, version

    def stale(self, group: Sequence[Rollout]) -> list[int]:
        """Indices of a group's rollouts not under the newest version (empty: one version)."""
        if len({r.weight_version for r in group}) <= 1:
            return []
        return [i for i, r in enumerate(group) if r.weight_version != self._latest]

    @staticmethod
    def unsettled(group: Sequence[Rollout]) -> WeightVersionMismatch:
        """The error of a group that never came back under one version."""
        served = sorted({r.weight_version or "" for r in group})
        return WeightVersionMismatch(
            f"a group of {len(group)} never came back under one weight version: {served}",
            expected=None,
            served=served,
        )
