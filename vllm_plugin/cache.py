"""A byte-bounded LRU with single-flight, for resolved multimodal items.

- Concurrent requests for one key compute it once: the first caller starts the work
  as its own task; later callers await the same future.
- Failures are never cached: the future is dropped and the next request retries.
- A cancelled request never poisons the shared work: callers await the task through
  ``asyncio.shield``, so one client hanging up does not cancel it for the others.
- Entries are evicted least-recently-used once their summed ``nbytes`` exceed the budget;
  an entry larger than the whole budget is returned but not kept.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["ByteBudgetLRU", "CacheStats"]

_V = TypeVar("_V")


@dataclass
class CacheStats:
    hits: int = 0
    """Lookups answered from the cache."""
    joined: int = 0
    """Lookups that awaited a computation already in flight for the same key."""
    misses: int = 0
    """Computations started."""
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


class ByteBudgetLRU(Generic[_V]):
    """Async single-flight LRU keyed by ``str``, bounded by the bytes its values hold.

    Args:
        budget_bytes: the most bytes kept (sum of ``sizeof(value)``).
        sizeof: bytes one value holds.
    """

    def __init__(self, budget_bytes: int, sizeof: Callable[[_V], int]) -> None:
        self.budget_bytes = budget_bytes
        self._sizeof = sizeof
        self._entries: OrderedDict[str, tuple[_V, int]] = OrderedDict()
        self._inflight: dict[str, asyncio.Task[_V]] = {}
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> _V | None:
        """The cached value (marked most recently used and counted as a hit), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry[0]

    async def get_or_compute(self, key: str, compute: Callable[[], Awaitable[_V]]) -> _V:
        """Return the cached value for ``key`` or compute it once for all concurrent callers.

        Raises:
            Whatever ``compute`` raises (nothing is cached then).
        """
        value = self.get(key)
        if value is not None:
            return value
        task = self._inflight.get(key)
        if task is not None:
            self.stats.joined += 1
        else:
            self.stats.misses += 1
            task = asyncio.ensure_future(compute())
            self._inflight[key] = task
            task.add_done_callback(lambda t, k=key: self._settle(k, t))
        return await asyncio.shield(task)

    def put(self, key: str, value: _V) -> None:
        """Keep ``value`` under ``key`` (a computation made outside :meth:`get_or_compute`, e.g. on a
        thread without an event loop); a value larger than the whole budget is not kept."""
        self._put(key, value)

    def _settle(self, key: str, task: asyncio.Task[_V]) -> None:
        self._inflight.pop(key, None)
        if task.cancelled() or task.exception() is not None:
            return
        self._put(key, task.result())

    def _put(self, key: str, value: _V) -> None:
        size = self._sizeof(value)
        if size > self.budget_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.stats.bytes -= old[1]
        self._entries[key] = (value, size)
        self.stats.bytes += size
        while self.stats.bytes > self.budget_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.stats.bytes -= evicted
            self.stats.evictions += 1
        self.stats.entries = len(self._entries)
