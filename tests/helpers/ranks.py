"""Ranks as processes (``torch.multiprocessing.start_processes``) for the multi-rank tests
(``tests/test_distributed.py``, ``tests/test_fsdp.py``)."""

from __future__ import annotations

import time

import pytest

__all__ = ["join_ranks"]


def join_ranks(ctx, timeout_s: float) -> None:
    """Wait for every process of ``ctx`` (a ``ProcessContext`` from ``start_processes(...,
    join=False)``) and kill those still alive when it returns or raises.

    Raises:
        pytest.fail.Exception: a rank still running after ``timeout_s`` seconds (a rank hangs in a
            collective).
        torch.multiprocessing.ProcessRaisedException: a rank raised (``ctx.join``'s own error).
    """
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"ranks still running after {timeout_s} s: a rank hangs in a collective")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
