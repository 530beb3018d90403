"""Plan step ``t + 1`` on a background thread while the trainer runs step ``t`` (docs/PACKING.md §3.8).

:func:`plan_ahead` wraps :func:`~trainer_lib.planning.plan.plan_step` over an iterable of steps'
samples: it yields step ``t``'s plan while one worker thread draws step ``t + 1``'s samples and
plans them. The plans are the ones :func:`plan_step` gives in sequence (planning is
deterministic: one seed, one plan, on every rank); the search's kernels release the GIL, so the
overlap is real where the GPU runs the step. Example::

    for plan in plan_ahead(rollout_steps, spec, shape, rank=rank, cost_model=cm):
        for share in (ranks[rank] for ranks in plan.mini_batches):
            ...  # materialize, forward/backward, optimizer step
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from protocol.structs import TrainingSample
from trainer_lib.planning.plan import StepPlan, plan_step
from trainer_lib.planning.ranks import StepShape
from trainer_lib.spec import PackingSpec

__all__ = ["plan_ahead"]

_END = object()
"""The worker's answer once the steps run out."""


def plan_ahead(
    steps: Iterable[Sequence[TrainingSample]],
    spec: PackingSpec,
    shape: StepShape,
    *,
    rank: int | None = None,
    **options: Any,
) -> Iterator[StepPlan]:
    """Each step's :func:`~trainer_lib.planning.plan.plan_step` plan, in order, the next step
    drawn from ``steps`` and planned on one background thread while the caller uses this one.

    Args:
        steps: each step's samples; drawn on the worker thread, one step ahead of the caller (a
            source that blocks, e.g. on rollouts, blocks the worker, not the training loop).
        spec, shape: as :func:`plan_step`'s.
        rank: this process's data-parallel rank: its micro-batches' wire structs are built on the
            worker too (:attr:`~trainer_lib.micro_batch.PackedMicroBatch.micro_batch`, otherwise
            built on first read), so the token copies also leave the training loop. None: none.
        options: :func:`plan_step`'s keywords (``cost_model``, ``balance``, ``refine``).

    Yields:
        Step ``t``'s :class:`~trainer_lib.planning.plan.StepPlan`, with step ``t + 1`` already
        being planned (none after the last step).

    Raises:
        What drawing or planning step ``t`` raised (:func:`plan_step`'s errors), at the request for
        step ``t``'s plan; plans already yielded stand, and nothing further is planned. Closing the
        iterator early waits for the plan in flight.
    """
    source = iter(steps)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmref-plan-ahead") as pool:
        pending = pool.submit(_next_plan, source, spec, shape, rank, options)
        while True:
            plan = pending.result()  # step t's exception, if any, is raised here
            if plan is _END:
                return
            pending = pool.submit(_next_plan, source, spec, shape, rank, options)
            yield plan


def _next_plan(
    source: Iterator[Sequence[TrainingSample]],
    spec: PackingSpec,
    shape: StepShape,
    rank: int | None,
    options: dict[str, Any],
) -> StepPlan | object:
    """The next step's plan (rank ``rank``'s wire structs built), or :data:`_END`."""
    samples = next(source, _END)
    if samples is _END:
        return _END
    plan = plan_step(samples, spec, shape, **options)  # type: ignore[arg-type]
    if rank is not None:
        for ranks in plan.mini_batches:
            for mb in ranks[rank].micro_batches:
                _ = mb.micro_batch  # built now, on this thread
    return plan
