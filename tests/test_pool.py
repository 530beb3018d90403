"""trainer_lib.pool.run_on_pool: the kept pool's results, re-entry, concurrent callers, errors."""

from __future__ import annotations

import threading
import time

import pytest

from trainer_lib.pool import run_on_pool


def test_results_in_order_from_the_same_kept_threads():
    names = run_on_pool(lambda x: threading.current_thread().name, range(8), 2)
    assert all(n.startswith("mmref-mat") for n in names)
    assert set(run_on_pool(lambda x: threading.current_thread().name, range(8), 2)) <= set(names) | {
        t.name for t in threading.enumerate()
    }
    assert run_on_pool(lambda x: x * x, range(10), 2) == [x * x for x in range(10)]
    assert run_on_pool(lambda x: x, [], 2) == []


def test_a_call_from_a_pool_thread_runs_inline_instead_of_waiting_on_a_full_pool():
    """Re-entry from the pool's only thread: queued on the pool it would wait for itself forever."""
    out: list = []
    caller = threading.Thread(
        target=lambda: out.append(run_on_pool(lambda x: run_on_pool(lambda y: y + x, [1, 2], 1), [10], 1)),
        daemon=True,
    )
    caller.start()
    caller.join(timeout=20)
    assert not caller.is_alive() and out == [[[11, 12]]]


def test_concurrent_callers_share_the_pool_and_get_their_own_results():
    out: dict[int, list] = {}

    def call(k: int) -> None:
        out[k] = run_on_pool(lambda x: (time.sleep(0.01), k * 100 + x)[1], range(6), 2)

    callers = [threading.Thread(target=call, args=(k,)) for k in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=30)
    assert out == {k: [k * 100 + x for x in range(6)] for k in range(4)}


def test_an_error_cancels_the_queued_items_and_waits_for_the_running_ones():
    started, finished = [], []

    def work(x: int) -> int:
        if x == 0:
            raise KeyError("first")
        started.append(x)
        time.sleep(0.1)
        finished.append(x)
        return x

    with pytest.raises(KeyError):
        run_on_pool(work, range(8), 2)
    seen = (list(started), list(finished))
    time.sleep(0.4)
    assert (started, finished) == seen and sorted(started) == sorted(finished) and len(started) < 7
