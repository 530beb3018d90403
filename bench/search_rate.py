"""Measure the plan search's rates, the constants its time budget converts with.

Usage::

    .venv/bin/python bench/search_rate.py [--steps 3] [--anneal 200000]

On ``bench/pack.py``'s mix at dp 8, mini-batch 256, cap 16k (the compute plan, Qwen2-VL-2B's
``CostModel``): per mini-batch, the constructed plan's search state, then the descent to its
optimum (changes, and seconds with its last round without a change) and ``--anneal`` annealing
steps from there, compiled (numba; the first call compiles and is not timed). Printed: per
mini-batch the predicted step on the card (``CostModel.seconds_per_unit``) and the default budget
it gets; the rates over all mini-batches (total iterations / total seconds), which
``trainer_lib.planning.refine.DESCENT_CHANGES_PER_S`` and ``ANNEAL_STEPS_PER_S`` hold as measured
once (docs/DESIGN-DECISIONS.md, "Issue 43: the plan's search under a time budget").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_facts, print_table
from _models import qwen2_vl_2b_config
from pack import RESERVE, SEQ_LEN, make_step, mini_batch_inputs

from trainer_lib.planning import annealing, descent, refine, search
from trainer_lib.planning.cost import CostModel
from trainer_lib.planning.items import MiniBatchItems
from trainer_lib.planning.partition import partition_mini_batch

DP, MBS, CAP = 8, 256, SEQ_LEN


def _items(inputs: tuple) -> MiniBatchItems:
    lengths, keys, kinds, vision, extra = inputs  # extra: groups, language, unit_seconds
    return MiniBatchItems(
        lengths, dp=DP, cap=CAP, keys=keys, kinds=kinds, vision=vision, reserve=RESERVE, **extra
    )


def _state(items: MiniBatchItems) -> tuple[search.SearchState, int]:
    """The constructed compute plan's search state and its slot count."""
    part = partition_mini_batch(items)
    slots = [
        [(part.tokens[r][k], part.ranks[r][k]) for r in range(DP)] for k in range(part.num_micro_batches)
    ]
    return refine._state(slots, items), len(slots)


def measure(items: MiniBatchItems, anneal_steps: int) -> tuple[int, float, float, float]:
    """``(descent changes, descent s, anneal s, predicted step s)`` of one mini-batch."""
    state, S = _state(items)
    step = refine._step_cost(state, S, DP)
    t0 = time.perf_counter()
    made = descent.descend(state, DP, CAP, items.reserve, 10**9, refine._EPS)
    t1 = time.perf_counter()
    per_slot = refine._step_cost(state, S, DP) / S
    with np.errstate(over="ignore"):
        temps = (refine._T0 * per_slot, refine._T1 * per_slot)
        annealing.anneal(state, DP, CAP, items.reserve, anneal_steps, np.uint64(0), *temps)
    t2 = time.perf_counter()
    return made, t1 - t0, t2 - t1, step * (items.unit_seconds or 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps (random draws) of 4 mini-batches")
    parser.add_argument("--anneal", type=int, default=200_000, help="annealing steps per mini-batch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print_facts()
    cm, rng = CostModel.from_config(qwen2_vl_2b_config()), np.random.default_rng(args.seed)
    inputs = [x for _ in range(args.steps) for x in mini_batch_inputs(make_step(rng), DP, MBS, cm)]
    measure(_items(inputs[0]), 1000)  # compiles (or loads the cache): not timed
    rows, total = [], np.zeros(3)
    for j, x in enumerate(inputs):
        made, t_desc, t_anneal, step_s = measure(_items(x), args.anneal)
        total += (made, t_desc, t_anneal)
        budget = refine.default_budget_s(step_s)
        rows.append(
            (j, made, f"{t_desc * 1e3:.3f}", f"{t_anneal * 1e3:.1f}", f"{step_s:.3f}", f"{budget * 1e3:.1f}")
        )
    header = ("mini-batch", "descent changes", "descent ms", f"{args.anneal} anneal steps ms")
    print_table("the search, per mini-batch", (*header, "predicted step s", "default budget ms"), rows)
    rates = [
        ("descent changes / s", f"{total[0] / total[1]:,.0f}", f"{refine.DESCENT_CHANGES_PER_S:,.0f}"),
        (
            "anneal steps / s",
            f"{args.anneal * len(inputs) / total[2]:,.0f}",
            f"{refine.ANNEAL_STEPS_PER_S:,.0f}",
        ),
    ]
    print_table(f"rates over {len(inputs)} mini-batches", ("rate", "measured", "constant"), rates)


if __name__ == "__main__":
    main()
