"""trainer_lib.planning.ahead: plan_ahead yields plan_step's plans, one step planned ahead."""

from __future__ import annotations

import threading

import pytest

from helpers import FAKE, make_ref, make_sample
from protocol.structs import TrainingSample
from trainer_lib import plan_ahead
from trainer_lib.planning.plan import StepPlan, plan_step
from trainer_lib.planning.ranks import StepShape

SHAPE = StepShape(dp_size=4, mini_batch_size=12, seq_len=512, micro_batch_max_tokens=160)


def _step(seed: int) -> list[TrainingSample]:
    """24 samples, groups of 4 sharing an image, lengths varied by ``seed``."""
    refs = [make_ref(2 + (seed + k) % 3, 2, seed * 10 + k) for k in range(6)]
    return [
        make_sample([1] * (3 + (seed * 7 + k) % 11), [refs[k // 4]], completion=5 + (seed * 13 + k * 5) % 40)
        for k in range(24)
    ]


def _layout(plan: StepPlan) -> list:
    """``[mini_batch][rank][micro_batch]``: the sample indices (None: a micro-batch pad)."""
    return [
        [[[s.sample_index for s in mb.slots] for mb in share.micro_batches] for share in ranks]
        for ranks in plan.mini_batches
    ]


def test_the_plans_are_plan_steps_in_order():
    steps = [_step(seed) for seed in range(4)]
    ahead = list(plan_ahead(steps, FAKE, SHAPE))
    alone = [plan_step(samples, FAKE, SHAPE) for samples in steps]
    assert [_layout(p) for p in ahead] == [_layout(p) for p in alone]
    assert ahead == alone  # micro-batches, wire structs included
    assert list(plan_ahead([], FAKE, SHAPE)) == []


def test_the_next_step_is_planned_before_the_caller_asks():
    drawn = [threading.Event() for _ in range(3)]

    def steps():
        for k, event in enumerate(drawn):
            event.set()
            yield _step(k)

    plans = plan_ahead(steps(), FAKE, SHAPE)
    first = next(plans)
    assert drawn[1].wait(timeout=30)  # step 1 drawn (and planned) while the caller holds step 0
    assert not drawn[2].is_set()  # one step ahead, not more
    assert _layout(first) == _layout(plan_step(_step(0), FAKE, SHAPE))
    assert len(list(plans)) == 2


def test_an_error_surfaces_at_its_own_step():
    bad = _step(1)
    bad[3] = make_sample([1] * 4, completion=3)
    bad[3].loss_mask[0] = True  # refused: a sample's first token has no logprob
    plans = plan_ahead([_step(0), bad, _step(2)], FAKE, SHAPE)
    assert _layout(next(plans)) == _layout(plan_step(_step(0), FAKE, SHAPE))
    with pytest.raises(ValueError, match="loss_mask\\[0\\] is True"):
        next(plans)
    assert list(plans) == []  # nothing planned after the failed step


def test_the_ranks_wire_structs_are_built_on_the_worker():
    (plan,) = plan_ahead([_step(0)], FAKE, SHAPE, rank=2, refine=None)
    for ranks in plan.mini_batches:
        for r, share in enumerate(ranks):
            assert all((mb.__dict__.get("_wire") is not None) == (r == 2) for mb in share.micro_batches)
