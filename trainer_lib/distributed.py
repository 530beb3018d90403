"""Rank-wide fail-fast for data-parallel training (docs/PACKING.md §5).

A materialization or packing error on one rank (a missing image under ``policy="error"``, a
placeholder mismatch) must fail **every** rank before any collective of the step; otherwise the
failing rank leaves and the others wait forever in their next all-reduce / all-gather.

Protocol, run by every rank at the same point (after materialize + pack, before the forward)::

    with fail_fast():                        # or: check_all_ranks(error_or_None)
        batch = materialize(samples, adapter, root, MaterializeOptions(policy="error"))
        inputs = packed_inputs(...)

1. all-reduce (MAX) one int flag: 1 if this rank failed;
2. if any rank failed: ``all_gather_object`` of each rank's error, pickled where possible (the
   :mod:`protocol.errors` types keep their ``ref`` across pickling), else a
   :class:`RankFailed` carrying the type name, message and ``ref``;
3. every rank raises the error of the **lowest failing rank**: the failing rank re-raises its
   own exception object; the others raise the unpickled copy (same type, message and ``ref``)
   with a note naming the origin rank, chained (``__cause__``) to their own error if they had one.

A rank that dies without reaching the check (killed, segfault) is outside this protocol: the
others then wait until the process group's timeout.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankFailed", "check_all_ranks", "fail_fast"]


class RankFailed(RuntimeError):
    """Stand-in for an error that could not be pickled across ranks.

    Attributes:
        type_name: qualified name of the original exception type.
        message: ``str`` of the original exception.
        ref: its ``ref`` attribute, if any.
        rank: the rank it was raised on.
    """

    def __init__(self, type_name: str, message: str, ref: str | None, rank: int) -> None:
        super().__init__(f"{type_name} on rank {rank}: {message}")
        self.type_name, self.message, self.ref, self.rank = type_name, message, ref, rank

    def __reduce__(self):
        return (RankFailed, (self.type_name, self.message, self.ref, self.rank))


def _flag_device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _portable(error: BaseException, rank: int) -> bytes:
    """``error`` pickled, else a :class:`RankFailed` of it: never raises (a rank that raised here,
    between the two collectives, would leave the others waiting in the second)."""
    try:
        data = pickle.dumps(error)
        pickle.loads(data)  # some exceptions pickle but fail to rebuild (required init args)
        return data
    except Exception:
        pass
    name = f"{type(error).__module__}.{type(error).__qualname__}"
    try:
        message = str(error)
    except Exception:
        message = "<an error whose str() raised>"
    ref = getattr(error, "ref", None)
    return pickle.dumps(RankFailed(name, message, ref if isinstance(ref, str) else None, rank))


def check_all_ranks(error: BaseException | None, *, group: Any = None) -> None:
    """Collective: raise on every rank if any rank passes an error (see the module docstring).

    Every rank of ``group`` must call it at the same point. Without an initialized process
    group (single process) it just re-raises ``error``.

    Args:
        error: this rank's exception, or None.
        group: process group (default: the world).

    Raises:
        The lowest failing rank's exception (same type, message and ``ref`` on every rank), or
        :class:`RankFailed` when that exception cannot be pickled.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=_flag_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return
    rank = dist.get_rank(group)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, None if error is None else _portable(error, rank), group=group)
    origin, payload = next((r, p) for r, p in enumerate(gathered) if p is not None)
    if origin == rank and error is not None:
        raise error
    remote = pickle.loads(payload)
    if hasattr(remote, "add_note"):
        remote.add_note(f"raised on rank {origin}; re-raised on rank {rank} by trainer_lib.distributed")
    raise remote from error


@contextmanager
def fail_fast(*, group: Any = None) -> Iterator[None]:
    """Run a block on every rank; if the block raises on any rank, raise on all of them.

    The check (one all-reduce, plus an all-gather only when something failed) runs when the
    block exits, whether it raised or not: every rank must enter and leave the block.
    """
    error: BaseException | None = None
    try:
        yield
    except Exception as e:
        error = e
    check_all_ranks(error, group=group)
