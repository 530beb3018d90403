"""The thread pool ``materialize`` reads and processes images on, kept by the process.

A fresh ``ThreadPoolExecutor`` per call made every call's first images 2-3x slower than the rest;
one pool per size, kept across calls, made a call 1.08-1.14x faster (docs/PERFORMANCE.md §3).
Calls from several threads share the pool's threads (their items queue in submission order). A
call from one of the pool's own threads runs its items inline (no deadlock on a full pool); a
forked child drops the parent's pools (their threads do not exist in it) and makes its own.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

__all__ = ["run_on_pool"]

_T = TypeVar("_T")
_R = TypeVar("_R")
_PREFIX = "mmref-mat"


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    """The process's pool of ``workers`` threads (one per distinct size: keep the size fixed)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=_PREFIX)


os.register_at_fork(after_in_child=_pool.cache_clear)


def run_on_pool(fn: Callable[[_T], _R], items: Sequence[_T], workers: int) -> list[_R]:
    """``[fn(x) for x in items]``, on the kept pool of ``workers`` threads.

    When one raises, the call's queued items are cancelled and those running waited for before
    the error propagates: nothing of the call runs on after it returns or raises.
    """
    if not items:
        return []
    if threading.current_thread().name.startswith(_PREFIX):
        return [fn(x) for x in items]
    futures = []
    try:
        pool = _pool(workers)
        for x in items:
            futures.append(pool.submit(fn, x))
        return [f.result() for f in futures]
    finally:
        for f in futures:
            f.cancel()
        wait(futures)
