"""``vllm_plugin.cache.ByteBudgetLRU``: single-flight, no cached failures, cancellation safety, byte LRU."""

from __future__ import annotations

import asyncio

import pytest

from vllm_plugin.cache import ByteBudgetLRU


def sized_cache(budget: int) -> ByteBudgetLRU[bytes]:
    return ByteBudgetLRU(budget, sizeof=len)


class Computer:
    """A compute function that counts its calls and, optionally, waits for a gate."""

    def __init__(
        self, value: bytes = b"v", gate: asyncio.Event | None = None, error: Exception | None = None
    ):
        self.value = value
        self.gate = gate
        self.error = error
        self.calls = 0
        self.finished = 0

    async def __call__(self) -> bytes:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        else:
            await asyncio.sleep(0)
        if self.error is not None:
            raise self.error
        self.finished += 1
        return self.value


def gated(value: bytes) -> tuple[ByteBudgetLRU[bytes], asyncio.Event, Computer]:
    """A 1 MiB cache, a gate, and a computation of ``value`` that waits for the gate."""
    gate = asyncio.Event()
    return sized_cache(1 << 20), gate, Computer(value, gate)


async def settle(rounds: int = 5) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def put(cache: ByteBudgetLRU[bytes], key: str, value: bytes) -> bytes:
    return await cache.get_or_compute(key, Computer(value))


def test_concurrent_callers_compute_once():
    async def main():
        cache, gate, compute = gated(b"pixels")
        tasks = [asyncio.create_task(cache.get_or_compute("k", compute)) for _ in range(16)]
        await settle()
        assert compute.calls == 1
        assert not any(t.done() for t in tasks)
        gate.set()
        results = await asyncio.gather(*tasks)
        assert compute.calls == 1
        assert all(r is results[0] for r in results)
        assert results[0] == b"pixels"
        assert cache.stats.misses == 1
        assert cache.get("k") == b"pixels"
        assert len(cache) == 1
        # A later caller is a hit and computes nothing.
        assert await cache.get_or_compute("k", Computer(b"other")) == b"pixels"
        assert cache.stats.hits >= 1
        assert compute.calls == 1

    asyncio.run(main())


def test_failure_is_not_cached_and_next_call_retries():
    async def main():
        cache = sized_cache(1 << 20)
        gate = asyncio.Event()
        failing = Computer(gate=gate, error=RuntimeError("decoder exploded"))
        tasks = [asyncio.create_task(cache.get_or_compute("k", failing)) for _ in range(4)]
        await settle()
        gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert failing.calls == 1
        assert all(isinstance(r, RuntimeError) and str(r) == "decoder exploded" for r in results)
        assert len(cache) == 0
        assert cache.get("k") is None
        assert cache.stats.bytes == 0

        good = Computer(b"ok")
        assert await cache.get_or_compute("k", good) == b"ok"
        assert good.calls == 1
        assert cache.get("k") == b"ok"
        assert cache.stats.misses == 2

    asyncio.run(main())


def test_cancelling_a_waiter_does_not_cancel_the_shared_work():
    async def main():
        cache, gate, compute = gated(b"value")
        first = asyncio.create_task(cache.get_or_compute("k", compute))  # starts the work
        others = [asyncio.create_task(cache.get_or_compute("k", compute)) for _ in range(3)]
        await settle()
        first.cancel()
        others[0].cancel()
        await settle()
        assert first.cancelled()
        assert others[0].cancelled()
        assert not others[1].done()
        gate.set()
        assert await others[1] == b"value"
        assert await others[2] == b"value"
        assert compute.calls == 1
        assert compute.finished == 1
        assert cache.get("k") == b"value"
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(main())


def test_cancelling_the_only_waiter_keeps_work_for_a_later_caller():
    async def main():
        cache, gate, compute = gated(b"value")
        only = asyncio.create_task(cache.get_or_compute("k", compute))
        await settle()
        only.cancel()
        await settle()
        assert only.cancelled()
        late = asyncio.create_task(cache.get_or_compute("k", Computer(b"recomputed")))
        await settle()
        gate.set()
        assert await late == b"value"  # joined the in-flight work, did not start another
        assert compute.calls == 1
        assert cache.get("k") == b"value"

    asyncio.run(main())


def test_lru_eviction_by_byte_budget():
    async def main():
        cache = sized_cache(100)
        await put(cache, "a", b"a" * 40)
        await put(cache, "b", b"b" * 40)
        assert cache.stats.bytes == 80
        assert cache.stats.entries == 2
        assert cache.stats.evictions == 0

        await cache.get_or_compute("a", Computer(b"unused"))  # touch: a is now most recent
        await put(cache, "c", b"c" * 40)  # 120 > 100: evict the least recent, b
        assert cache.get("b") is None
        assert cache.get("a") == b"a" * 40
        assert cache.get("c") == b"c" * 40
        assert cache.stats.evictions == 1
        assert cache.stats.bytes == 80
        assert cache.stats.entries == len(cache) == 2

        # get() refreshes recency too: the reads above left a older than c.
        await put(cache, "d", b"d" * 30)  # 110 > 100: evict a
        assert cache.get("a") is None
        assert cache.get("c") is not None and cache.get("d") is not None
        assert cache.stats.evictions == 2
        assert cache.stats.bytes == 70

        await put(cache, "e", b"e" * 100)  # exactly the budget: kept, everything else goes
        assert len(cache) == 1
        assert cache.get("e") == b"e" * 100
        assert cache.stats.bytes == 100
        assert cache.stats.evictions == 4

    asyncio.run(main())


def test_value_larger_than_budget_is_returned_but_not_kept():
    async def main():
        cache = sized_cache(100)
        await put(cache, "small", b"s" * 40)
        big = Computer(b"x" * 150)
        assert await cache.get_or_compute("big", big) == b"x" * 150
        assert cache.get("big") is None
        assert cache.get("small") == b"s" * 40  # not evicted to make room for nothing
        assert cache.stats.bytes == 40
        assert cache.stats.evictions == 0
        assert len(cache) == 1
        assert await cache.get_or_compute("big", big) == b"x" * 150
        assert big.calls == 2  # not cached, so computed again

    asyncio.run(main())


def test_hits_and_misses_counted():
    async def main():
        cache = sized_cache(1000)
        await put(cache, "a", b"1")
        await put(cache, "a", b"2")
        await put(cache, "a", b"3")
        await put(cache, "b", b"4")
        await put(cache, "b", b"5")
        assert (cache.stats.hits, cache.stats.misses) == (3, 2)
        assert cache.get("a") == b"1"
        assert cache.get("b") == b"4"

    asyncio.run(main())


def test_falsy_values_are_cached():
    """An empty value is a value, not a miss (only ``None`` means absent)."""

    async def main():
        cache = sized_cache(1000)
        empty = Computer(b"")
        assert await cache.get_or_compute("k", empty) == b""
        assert await cache.get_or_compute("k", empty) == b""
        assert empty.calls == 1

    asyncio.run(main())
