"""Opt-in refinement of a compute-balanced plan by search on the step itself (docs/PACKING.md §3.8).

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
   ``4e-4`` to ``2e-6`` of the mean slot cost; the best plan seen is kept.

Every change keeps the partition's rules: a sample with images stays in a slot that runs the
tower, a stray-placeholder or near-cap text sample in one that does not; a bin holds at most
``cap`` tokens, ``cap - reserve`` where it runs the tower without an image of its own (the
synthetic pad needs the room); a bin above the cap (a sample longer than it, or a stretched slot)
is left as it is. Only single-key mini-batches are refined.

Costs: both stages are compiled with numba (:mod:`~trainer_lib.planning.search`)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from trainer_lib.planning.items import VISION, MiniBatchItems
from trainer_lib.planning.search import SearchState, anneal, bins_of, descend

__all__ = ["Refinement", "refine_plan", "refine_slots"]

_Bins = list[tuple[int, list[int]]]
_EPS = 1e-6
"""The smallest change the descent makes, as a share of its slot's cost."""
_T0, _T1 = 4e-4, 2e-6
"""Annealing temperatures at the first and last step, as shares of the mean slot cost."""


@dataclass(frozen=True)
class Refinement:
    """How hard to search (:func:`refine_slots`).

    Attributes:
        changes: most descent changes per mini-batch (each lowers the predicted step).
        anneal_steps: annealing steps per mini-batch after the descent (0: none). On
            ``bench/pack.py``'s mix, 1M steps take ~0.1 s per 256-sample mini-batch (compiled).
        seed: the annealing's random seed, in ``[0, 2**64)`` (plans are reproducible; every rank
            gets the same).
    """

    changes: int = 1000
    anneal_steps: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.changes < 0 or self.anneal_steps < 0:
            raise ValueError(
                f"changes and anneal_steps must be >= 0, got {self.changes}, {self.anneal_steps}"
            )
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")


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
    descend(state, dp, items.cap, items.reserve, refine.changes, _EPS)
    V, L = state.V.reshape(S, dp), state.L.reshape(S, dp)
    per_slot = float(np.sum(V.max(1) + L.max(1))) / S  # 0: every plan costs nothing, none to search
    if refine.anneal_steps and per_slot > 0:
        with np.errstate(over="ignore"):  # SplitMix64 wraps by design (as Python, numpy warns)
            seed = np.uint64(refine.seed)
            temperatures = (_T0 * per_slot, _T1 * per_slot)
            bin_of = anneal(state, dp, items.cap, items.reserve, refine.anneal_steps, seed, *temperatures)
    else:
        bin_of = bins_of(state.members, state.count, items.n)
    held: list[list[int]] = [[] for _ in range(S * dp)]
    for i in np.argsort(bin_of, kind="stable").tolist():
        held[int(bin_of[i])].append(i)
    lengths = items.lengths
    return [
        [(sum(lengths[i] for i in held[k * dp + r]), held[k * dp + r]) for r in range(dp)] for k in range(S)
    ]


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
