"""The search of a compute-balanced plan on the step itself, on by default (docs/PACKING.md §3.8).

The constructive plan (:mod:`~trainer_lib.planning.grouped`) is fast but leaves a few percent of
the ranks' FLOPs idle at the syncs. :func:`refine_slots` lowers the predicted step, the sum over
slots of the slowest rank's vision-tower cost plus the slowest rank's language cost (each distinct
image set costed once per bin, as the trainer encodes it), by changing which bin holds which
sample; the slots keep their count and their kind, so token waste stays where it was:

1. **Descent** (always): the interchange neighbourhood of makespan scheduling (Finn & Horowitz
   1979): a sample of a slot's slowest bin, in either stage, moves to any bin of any slot or swaps
   with one of its samples, the partner that lowers the step most, until no change lowers it by
   ``1e-6`` of the slot or ``changes`` were made.
2. **Annealing** (``anneal_steps > 0``): random moves and swaps accepted with probability
   ``exp(-delta / T)`` (Kirkpatrick, Gelatt & Vecchi 1983), ``T`` falling geometrically from
   ``2e-3`` to ``2e-6`` of the mean slot cost; the best plan seen is kept, then the descent runs
   again from it (at most :data:`POLISH_CHANGES`: the annealing ends cold, not at a local optimum).

Every change keeps the partition's rules: a sample with images stays in a slot that runs the
tower, a stray-placeholder or near-cap text sample in one that does not; a bin holds at most
``cap`` tokens, ``cap - reserve`` where it runs the tower without an image of its own (the
synthetic pad needs the room); a bin above the cap (a sample longer than it, or a stretched slot)
is left as it is. Only single-key mini-batches are refined.

**Budget.** Both stages run for at most :attr:`Refinement.plan_time_budget_s` per mini-batch,
converted to iteration counts by rates measured once (:data:`DESCENT_CHANGES_PER_S`,
:data:`ANNEAL_STEPS_PER_S`), never by reading a clock: the same inputs give the same plan on any
machine. The descent gets the budget first, then the final descent's :data:`POLISH_CHANGES`;
what they leave (at the measured rates) goes to the annealing. Default budget
(:func:`default_budget_s`): :data:`BUDGET_SHARE` of the mini-batch's predicted step on the cost
model's card, at least :data:`BUDGET_FLOOR_S`, at most :data:`BUDGET_CAP_S`
(docs/DESIGN-DECISIONS.md, "Issue 43: the plan's search under a time budget").

Costs: both stages are compiled with numba (:mod:`~trainer_lib.planning.descent`,
:mod:`~trainer_lib.planning.annealing`, on :mod:`~trainer_lib.planning.search`'s state)."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from trainer_lib.planning.annealing import anneal
from trainer_lib.planning.descent import descend
from trainer_lib.planning.items import VISION, MiniBatchItems
from trainer_lib.planning.search import SearchState, bins_of

__all__ = [
    "ANNEAL_STEPS_PER_S",
    "BUDGET_CAP_S",
    "BUDGET_FLOOR_S",
    "BUDGET_SHARE",
    "DESCENT_CHANGES_PER_S",
    "POLISH_CHANGES",
    "Refinement",
    "default_budget_s",
    "refine_plan",
    "refine_slots",
]

_Bins = list[tuple[int, list[int]]]
_EPS = 1e-6
"""The smallest change the descent makes, as a share of its slot's cost."""
_T0, _T1 = 2e-3, 2e-6
"""Annealing temperatures at the first and last step, as shares of the mean slot cost (``T0``
4e-4 until the annealing ran ~3x faster: at ~450k steps per mini-batch 2e-3 did best of 1e-4 to
8e-3; docs/DESIGN-DECISIONS.md, "Issue 43: the planning targets met")."""
POLISH_CHANGES = 32
"""Most descent changes from the annealing's best plan (the annealing ends at a low temperature,
not at a local optimum: on ``bench/pack.py``'s mix 7 changes on average, at most 30); counted in
the budget before the annealing gets its share."""

BUDGET_SHARE = 0.02
"""The default budget's share of the mini-batch's predicted step (issue 43: planning <= 2%)."""
BUDGET_FLOOR_S = 0.002
"""The default budget's floor, seconds: the descent to its optimum on ``bench/pack.py``'s
mini-batches, and what a step without a time on the card (no cost model) gets."""
BUDGET_CAP_S = 0.045
"""The default budget's cap, seconds: the search's share of issue 43's 50 ms of planning per
mini-batch, 5 ms left to the construction (~1 ms at cap 16k) and the descent's overshoot."""
DESCENT_CHANGES_PER_S = 60_000.0
"""Descent changes per second, compiled, its final round without a change included: measured
once by ``bench/search_rate.py`` (``bench/pack.py``'s mix, dp 8, mini-batch 256, cap 16k, 12
mini-batches) on the project's shared 2-core AMD EPYC VM, 2026-12-04: 59.7k at load 8, 72.0k at
load 3-5 (docs/DESIGN-DECISIONS.md, "Issue 43: the plan's search under a time budget")."""
ANNEAL_STEPS_PER_S = 10_000_000.0
"""Annealing steps per second, compiled, measured as :data:`DESCENT_CHANGES_PER_S`. Before the
step was written out over scalars (``annealing._walk``): 4.81M at load 8, 6.38M at load 3-5, 3.7M in
``bench/pack.py``'s 1M-step row (load ~4), kept as 3.5M, the lowest rounded down. The written-out
step, side by side with the old one on the same VM (2026-12-04, load ~1, two runs each): 26.6M
against 7.4-7.6M steps/s, 3.5x; the old 3.5M scaled by less than that, 2.86x, so that a budget
still holds on this loaded machine (docs/DESIGN-DECISIONS.md, "Issue 43: the planning targets
met")."""


@dataclass(frozen=True)
class Refinement:
    """How hard to search (:func:`refine_slots`).

    The search stops at whichever comes first: its counts or its time budget, the budget
    converted to counts by measured rates (module docstring), so plans are deterministic.

    Attributes:
        changes: most descent changes per mini-batch (each lowers the predicted step).
        anneal_steps: most annealing steps per mini-batch after the descent (0: none; None: as
            many as the budget allows). On ``bench/pack.py``'s mix, 1M steps take ~0.2 s per
            256-sample mini-batch on this project's CPU (compiled; :data:`ANNEAL_STEPS_PER_S`).
        seed: the annealing's random seed, in ``[0, 2**64)`` (plans are reproducible; every rank
            gets the same).
        plan_time_budget_s: seconds of search per mini-batch (descent, then annealing), >= 0;
            0: the plan as constructed; ``math.inf``: the counts alone decide (``anneal_steps``
            then must be given). None (default): :func:`default_budget_s` of the mini-batch's
            predicted step on the cost model's card.

    Raises:
        ValueError: a negative count or budget, a seed outside ``[0, 2**64)``, or no bound on the
            annealing (``anneal_steps=None`` with an infinite budget).
    """

    changes: int = 1000
    anneal_steps: int | None = None
    seed: int = 0
    plan_time_budget_s: float | None = None

    def __post_init__(self) -> None:
        if self.changes < 0 or (self.anneal_steps is not None and self.anneal_steps < 0):
            raise ValueError(
                f"changes and anneal_steps must be >= 0, got {self.changes}, {self.anneal_steps}"
            )
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        budget = self.plan_time_budget_s
        if budget is not None and not budget >= 0:  # NaN too
            raise ValueError(f"plan_time_budget_s must be >= 0 seconds, got {budget}")
        if budget == math.inf and self.anneal_steps is None:
            raise ValueError("an infinite plan_time_budget_s needs anneal_steps (a bound on the search)")

    def budget_s(self, step_s: float | None) -> float:
        """Seconds of search for a mini-batch whose predicted step takes ``step_s`` seconds on
        the card (None: not known): :attr:`plan_time_budget_s`, or :func:`default_budget_s`."""
        return default_budget_s(step_s) if self.plan_time_budget_s is None else self.plan_time_budget_s


def default_budget_s(step_s: float | None) -> float:
    """The default search budget, seconds, of a mini-batch whose predicted step takes ``step_s``
    seconds (None: not known, the floor): :data:`BUDGET_SHARE` of it within
    ``[BUDGET_FLOOR_S, BUDGET_CAP_S]``. E.g. a 1.5 s step: 0.03 s."""
    if step_s is None:
        return BUDGET_FLOOR_S
    return min(BUDGET_CAP_S, max(BUDGET_FLOOR_S, BUDGET_SHARE * step_s))


def _within(limit: int | None, affordable: float) -> int:
    """``min(limit, floor(affordable))``, ``limit`` None meaning none (``affordable`` finite)."""
    if math.isinf(affordable):  # an infinite budget: Refinement requires a limit then
        return limit if limit is not None else 0
    return int(affordable) if limit is None else min(limit, int(affordable))


def refine_plan(items: MiniBatchItems, slots: list[_Bins], refine: Refinement | None) -> list[_Bins]:
    """A partition's ``slots`` (:mod:`~trainer_lib.planning.partition`) searched by
    :func:`refine_slots` where ``refine`` asks for it, with ``items.groups`` and one isolation key
    (as the compute plan applies); its empty slots are dropped first. Otherwise ``slots`` as given."""
    if refine is None or items.groups is None or not items.one_key:
        return slots
    return refine_slots([slot for slot in slots if any(b for _, b in slot)], items, refine)


def refine_slots(slots: list[_Bins], items: MiniBatchItems, refine: Refinement) -> list[_Bins]:
    """``slots`` (each a list of ``dp`` ``(tokens, sample indices)`` bins) with their samples
    re-dealt to lower the predicted step (module docstring).

    Args:
        slots: the plan's slots over ``items``' samples.
        items: the mini-batch: per sample its tokens, place (vision, text or either), image set
            (``groups``, None: no image; a bin costs each set once), language and vision cost (any
            consistent unit); the cap a bin may hold, and the ``reserve`` a tower-running bin
            without an image keeps free.
        refine: how hard to search.

    Returns:
        The same number of slots of the same width, every sample index once; no image joins a
        slot that had none.
    """
    dp, S = len(slots[0]) if slots else 0, len(slots)
    if S == 0 or dp == 0:
        return slots
    state = _state(slots, items)
    step = _step_cost(state, S, dp)
    budget = refine.budget_s(None if items.unit_seconds is None else step * items.unit_seconds)
    changes = _within(refine.changes, budget * DESCENT_CHANGES_PER_S)
    made = descend(state, dp, items.cap, items.reserve, changes, _EPS) if changes else 0
    polish = min(POLISH_CHANGES, refine.changes - made)  # the descent again, from the annealing's best
    left = max(budget - (made + polish) / DESCENT_CHANGES_PER_S, 0.0)  # seconds, at the measured rates
    steps = _within(refine.anneal_steps, left * ANNEAL_STEPS_PER_S)
    if made == 0 and steps == 0:
        return slots  # nothing changed: the plan as constructed (budget 0 among others)
    per_slot = _step_cost(state, S, dp) / S  # 0: every plan costs nothing, none to search
    if steps and per_slot > 0:
        with np.errstate(over="ignore"):  # SplitMix64 wraps by design (as Python, numpy warns)
            seed = np.uint64(refine.seed)
            best = anneal(state, dp, items.cap, items.reserve, steps, seed, _T0 * per_slot, _T1 * per_slot)
        state = _state(_slots_of(best, S, dp, items.lengths), items)
        if polish:
            descend(state, dp, items.cap, items.reserve, polish, _EPS)
    return _slots_of(bins_of(state.members, state.count, items.n), S, dp, items.lengths)


def _slots_of(bin_of: np.ndarray, S: int, dp: int, lengths: list[int]) -> list[_Bins]:
    """The ``S`` slots of ``dp`` ``(tokens, sample indices)`` bins that ``bin_of`` (``[n]`` int64,
    each sample's bin ``k * dp + r``) describes, each bin's samples in index order."""
    held: list[list[int]] = [[] for _ in range(S * dp)]
    for i in np.argsort(bin_of, kind="stable").tolist():
        held[int(bin_of[i])].append(i)
    return [
        [(sum(lengths[i] for i in held[k * dp + r]), held[k * dp + r]) for r in range(dp)] for k in range(S)
    ]


def _step_cost(state: SearchState, S: int, dp: int) -> float:
    """The predicted step of ``state``'s plan: per slot, its slowest bin's vision cost plus its
    slowest bin's language cost, summed (the costs' unit)."""
    return float(np.sum(state.V.reshape(S, dp).max(1) + state.L.reshape(S, dp).max(1)))


def _state(slots: list[_Bins], items: MiniBatchItems) -> SearchState:
    """The search's arrays (:class:`~trainer_lib.planning.search.SearchState`) of ``slots``."""
    dp, S, n = len(slots[0]), len(slots), items.n
    ids: dict[Hashable, int] = {}
    groups = items.groups if items.groups is not None else [None] * n
    grp = np.array([-1 if g is None else ids.setdefault(g, len(ids)) for g in groups], np.int64)
    gcost = np.zeros(max(len(ids), 1))
    has = grp >= 0
    gcost[grp[has]] = np.asarray(items.vision, np.float64)[has]
    bin_of = np.empty(n, np.int64)
    for k, slot in enumerate(slots):
        for r, (_, held) in enumerate(slot):
            bin_of[held] = k * dp + r
    nbins, size = S * dp, np.asarray(items.lengths, np.int64)
    count = np.bincount(bin_of, minlength=nbins)
    order = np.argsort(bin_of, kind="stable")
    members = np.full((nbins, n), -1, np.int64)
    members[bin_of[order], np.arange(n) - np.repeat(np.cumsum(count) - count, count)] = order
    cnt = np.zeros((nbins, len(gcost)), np.int64)
    np.add.at(cnt, (bin_of[has], grp[has]), 1)
    place = items.place
    vis_slot = np.array([any(place[i] == VISION for _, held in slot for i in held) for slot in slots])
    tokens = np.bincount(bin_of, size, minlength=nbins).astype(np.int64)
    lang = np.asarray(items.language, np.float64)
    return SearchState(
        vis_slot=vis_slot, where=np.asarray(place, np.int64), lang=lang, size=size, grp=grp,
        members=members, count=count, cnt=cnt, nd=(cnt > 0).sum(1), V=(cnt > 0) @ gcost,
        L=np.bincount(bin_of, lang, minlength=nbins), T=tokens, frozen=tokens > items.cap, gcost=gcost,
    )  # fmt: skip
