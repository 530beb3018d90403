"""``bench/pack.py``'s target rows and step-time measure (kept apart to keep the bench readable)."""

from __future__ import annotations

import numpy as np
from _common import verdict

from trainer_lib.planning.cost import CostModel
from trainer_lib.planning.plan import encoded_image_tokens

__all__ = ["BASE", "COMPUTE", "compute_target_rows", "step_flops", "target_rows"]

TARGET_IDLE, TARGET_WASTE, TARGET_PLAN, TARGET_FLOP_IDLE = 0.02, 0.04, 200_000, 0.03
BASE, COMPUTE = "balanced, tokens (#13)", "balanced, compute (#29)"
"""The plan before issue 29 (the step-time reference) and ``plan_step``'s default since."""


def step_flops(plan, cm: CostModel, dedup: bool = True) -> float:
    """Predicted step time in FLOPs: per slot, the slowest rank's vision tower (each distinct image
    once per micro-batch with ``dedup``) plus its slowest language model, pads included."""
    return sum(
        max(
            cm.vision(encoded_image_tokens(mb, dedup=dedup) + encoded_image_tokens(mb, padding=True))
            for mb in c
        )
        + max(sum(cm.language(s.length) for s in mb.slots) for mb in c)
        for ranks in plan.mini_batches
        for c in zip(*(r.micro_batches for r in ranks), strict=True)
    )


def target_rows(name: str, plan: str, r: dict) -> list[tuple]:
    """The issue's targets for a balanced plan, each with its floor (under the cap)."""
    b, f = r[plan], r["floor"]
    name = f"{name}, {plan}"
    waste, idle = 1 - b["real"] / b["cap"], float(np.mean(b["idle"]))
    waste_floor, idle_floor = float(np.mean(f["waste"])), float(np.mean(f["idle"]))
    compute, rate = b["pad"] / b["all"], float(np.median(b["plan"]))

    def row(figure, value, target, shown, floor=None, higher=False):
        v = verdict(value, target, higher_is_better=higher)
        if floor is not None and v != "pass" and floor > target:
            v += f" (floor {floor:.2%}: no plan reaches the target)"
        return (
            f"{name}: {figure}",
            shown,
            f"{'>=' if higher else '<='} {target:,.0%}" if target < 1 else f">= {target:,}",
            v,
        )

    return [
        row("sync idle (tokens)", idle, TARGET_IDLE, f"{idle:.2%}", idle_floor),
        row("waste, capacity", waste, TARGET_WASTE, f"{waste:.2%}", waste_floor),
        row("waste, compute (pad tokens)", compute, TARGET_WASTE, f"{compute:.3%}"),
        row("plan samples/s (partition)", rate, TARGET_PLAN, f"{rate:,.0f}", higher=True),
        (f"{name}: plan_step ms per 1024 samples", f"{np.median(b['ms']):.0f}", "printed", "-"),
    ]


def compute_target_rows(name: str, r: dict) -> list[tuple]:
    """Issue 29's targets for the compute-balanced plan: FLOP idle with each distinct image encoded
    once per micro-batch, the micro-batch count (hence the capacity waste) at its floor, the plan
    rate; the step time printed."""
    c, f = r[COMPUTE], r["floor"]
    idle, rate = float(np.mean(c["flop"])), float(np.median(c["plan"]))
    waste, m, floor = 1 - c["real"] / c["cap"], float(np.mean(c["m"])), float(np.mean(f["m"]))
    label = f"{name}, compute (#29)"
    idle_verdict = verdict(idle, TARGET_FLOP_IDLE, higher_is_better=False)
    rate_verdict = verdict(rate, TARGET_PLAN, higher_is_better=True)
    at_floor = "pass" if m <= floor else f"MISS by {m - floor:.2f} micro-batches"
    steps = f"{c['step'] / r[BASE]['step']:.3f}; {c['step'] / r[BASE]['step_slot']:.3f}"
    return [
        (f"{label}: FLOP idle (dedup)", f"{idle:.2%}", f"<= {TARGET_FLOP_IDLE:.0%}", idle_verdict),
        (f"{label}: micro-batches/rank (floor), waste", f"{m:.2f} ({floor:.2f}), {waste:.2%}", "floor", at_floor),  # noqa: E501
        (f"{label}: plan samples/s (partition)", f"{rate:,.0f}", f">= {TARGET_PLAN:,}", rate_verdict),
        (f"{label}: step FLOPs vs #13 with dedup; vs #13 per slot", steps, "printed", "-"),
    ]  # fmt: skip
