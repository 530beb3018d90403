"""Pinned plans: ``plan_step`` on varied mini-batches gives exactly the recorded plans.

Planning is deterministic (the annealing draws from a seeded SplitMix64), so a refactor of the
planning modules must leave every plan byte-identical. The cases cover text only, images of
several sizes with shared image sets (dedup groups), samples above the cap, several isolation
keys, the token plan and ``stretch_cap``, the opt-in search (descent, annealing, both within the
default time budget), and dp 1, 2, 4 and 8. Each plan is recorded as
``[mini_batch][rank][micro_batch]`` lists of sample indices (``None``: a micro-batch pad).

To record them again (only where a change of plans is deliberate, with the reason in the
commit)::

    MMREF_REGENERATE_PINNED_PLANS=1 .venv/bin/python -m pytest tests/planning/test_pinned_plans.py
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from protocol.structs import TrainingSample
from trainer_lib.planning.plan import StepPlan, plan_step
from trainer_lib.planning.ranks import StepShape
from trainer_lib.planning.refine import Refinement

DATA = Path(__file__).parent / "data" / "pinned_plans.json"
REGENERATE = os.environ.get("MMREF_REGENERATE_PINNED_PLANS") == "1"


def _text_step(rng: np.random.Generator, n: int, median: float, top: int) -> list[TrainingSample]:
    """``n`` text-only samples of lognormal lengths (median ``median``, at most ``top`` tokens)."""
    lengths = np.clip(rng.lognormal(np.log(median), 0.9, size=n), 2, top).astype(int)
    return [
        TrainingSample(
            input_ids=[int(t) for t in rng.integers(0, 256, size=int(m))],
            loss_mask=[False] + [True] * (int(m) - 1),
            advantages=[0.1] * int(m),
            inference_logprobs=[-1.0] * int(m),
            run_id="run_1",
        )
        for m in lengths
    ]


SHAPE = {f.name for f in dataclasses.fields(StepShape)}
"""A case's keys that are the step's sizes (the others are ``plan_step``'s options)."""


def _plan(samples: list[TrainingSample], spec, kw: dict) -> StepPlan:
    """``plan_step`` of a case: its sizes as one :class:`StepShape`, the rest as options."""
    shape = StepShape(**{k: v for k, v in kw.items() if k in SHAPE})
    return plan_step(samples, spec, shape, **{k: v for k, v in kw.items() if k not in SHAPE})


def _cases(pack, cm) -> dict[str, tuple[list[TrainingSample], dict]]:
    """Name: (samples, ``plan_step`` options); every draw seeded."""

    def mix(seed: int, **kw) -> list[TrainingSample]:
        return pack.make_step(np.random.default_rng(seed), **kw)

    step = {"seq_len": pack.SEQ_LEN}
    return {
        "text only, dp 2, cap 4k": (
            _text_step(np.random.default_rng(0), 96, 700, 6000),
            {**step, "dp_size": 2, "mini_batch_size": 48, "micro_batch_max_tokens": 4096},
        ),
        "images, dp 8, cap 16k, compute": (
            mix(1, prompts=16),
            {**step, "dp_size": 8, "mini_batch_size": 256, "cost_model": cm},
        ),
        "small images, dp 4, cap 2k, over the cap, descent": (
            mix(2, prompts=12, scale=0.5),
            {
                **step,
                "dp_size": 4,
                "mini_batch_size": 96,
                "micro_batch_max_tokens": 2048,
                "cost_model": cm,
                "refine": Refinement(anneal_steps=0),  # the descent alone
            },
        ),
        "images, dp 8, cap 8k, anneal": (
            mix(3, prompts=16),
            {
                **step,
                "dp_size": 8,
                "mini_batch_size": 128,
                "micro_batch_max_tokens": 8192,
                "cost_model": cm,
                "refine": Refinement(anneal_steps=3000, seed=5),
            },
        ),
        "images, dp 4, cap 8k, tokens, stretch": (
            mix(4, prompts=8),
            {
                **step,
                "dp_size": 4,
                "mini_batch_size": 128,
                "micro_batch_max_tokens": 8192,
                "cost_model": cm,
                "balance": "tokens",
                "stretch_cap": True,
            },
        ),
        "images, 3 LoRAs, dp 2, cap 8k": (
            mix(5, prompts=6, lora_ids=("a", "b", "c")),
            {**step, "dp_size": 2, "mini_batch_size": 48, "micro_batch_max_tokens": 8192, "cost_model": cm},
        ),
        "images, dp 1, cap 8k": (
            mix(6, prompts=4),
            {**step, "dp_size": 1, "mini_batch_size": 64, "micro_batch_max_tokens": 8192},
        ),
        "images, dp 8, cap 16k, no cost model, descent": (
            mix(7, prompts=16),
            {**step, "dp_size": 8, "mini_batch_size": 256, "refine": Refinement(changes=50, anneal_steps=0)},
        ),
        "images, dp 8, cap 16k, search at the default budget": (
            mix(8, prompts=16),
            {**step, "dp_size": 8, "mini_batch_size": 256, "cost_model": cm, "refine": Refinement()},
        ),
    }


def _recorded(plan: StepPlan) -> list[list[list[list[int | None]]]]:
    """``[mini_batch][rank][micro_batch]``: each slot's sample index, in the micro-batch's order."""
    return [
        [[[slot.sample_index for slot in mb.slots] for mb in share.micro_batches] for share in ranks]
        for ranks in plan.mini_batches
    ]


@pytest.fixture(scope="module")
def cases(bench_mix) -> dict[str, tuple[list[TrainingSample], dict]]:
    pack, cm = bench_mix
    return _cases(pack, cm)


@pytest.fixture(scope="module")
def plans(bench_mix, cases) -> dict[str, list]:
    spec = bench_mix[0].SPEC
    # a case without ``refine`` pins the plan as constructed (the search's default is its own case)
    out = {
        name: _recorded(_plan(samples, spec, {"refine": None, **kw})) for name, (samples, kw) in cases.items()
    }
    if REGENERATE:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(out, indent=None, separators=(",", ":")) + "\n")
    return out


def test_the_plans_are_the_pinned_ones(plans):
    pinned = json.loads(DATA.read_text())
    assert sorted(pinned) == sorted(plans)
    for name, plan in plans.items():
        assert plan == pinned[name], name


def test_the_cases_cover_what_they_say(cases, plans):
    """Every recorded plan holds each real sample once, on ``dp`` ranks with equal micro-batch
    counts; the cases hold what their names promise: samples above the cap (each alone in its
    micro-batch), several isolation keys, images shared by several samples, micro-batch pads."""
    over = 0
    for name, (samples, kw) in cases.items():
        plan, cap = plans[name], kw.get("micro_batch_max_tokens", kw["seq_len"])
        real = [i for mini in plan for share in mini for mb in share for i in mb if i is not None]
        assert sorted(i for i in real if i < len(samples)) == list(range(len(samples))), name
        assert all(len(mini) == kw["dp_size"] and len({len(s) for s in mini}) == 1 for mini in plan), name
        long = {i for i, s in enumerate(samples) if len(s.input_ids) > cap}
        for mb in (mb for mini in plan for share in mini for mb in share):
            assert not long & set(mb) or len([i for i in mb if i is not None and i < len(samples)]) == 1
        over += len(long)
    assert over >= 2
    lora = cases["images, 3 LoRAs, dp 2, cap 8k"][0]
    assert len({s.isolation_key for s in lora}) == 3
    shared = cases["images, dp 8, cap 16k, compute"][0]
    assert len({s.mm_refs.items[0].sha256 for s in shared if s.mm_refs}) < sum(
        bool(s.mm_refs) for s in shared
    )
    assert any(None in mb for mini in plans["images, 3 LoRAs, dp 2, cap 8k"] for s in mini for mb in s)
    assert {kw["dp_size"] for _, kw in cases.values()} == {1, 2, 4, 8}
