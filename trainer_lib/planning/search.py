"""The search's state and the moves and costs its two stages share, compiled with numba.

The refinement (:mod:`~trainer_lib.planning.refine`) searches one mini-batch's per-bin arrays, a
:class:`SearchState` (:func:`~trainer_lib.planning.refine.refine_slots` builds it): bin ``b`` is
rank ``b % dp`` of slot ``b // dp``; a slot costs its slowest bin's vision cost plus its slowest
bin's language cost, and a bin's vision cost is the sum of its distinct image sets' costs. The
stages are :func:`~trainer_lib.planning.descent.descend` (the descent) and
:func:`~trainer_lib.planning.annealing.anneal` (the annealing), the refine module's steps 1 and 2.
This module holds what they share: the state, the rules of a change (:func:`_change`: which moves
and swaps the places, the cap and the reserve allow, and the two bins' vision costs after), its
application (:func:`_exchange`), and the slot costs (:func:`_retop`, :func:`_one_changed`,
:func:`_pair_cost`).

The stages take the state as one :class:`SearchState` and unpack it once; the hot helpers they
call (:func:`~trainer_lib.planning.descent._best_partner` per sample of a slowest bin, and the
inlined :func:`_change` per candidate) take its arrays one by one: handed the NamedTuple,
``_best_partner`` made the descent 15x slower on ``bench/pack.py``'s mini-batches (7.8 ms against
0.53 ms per mini-batch, the same changes), the tuple's fields read at every call. The annealing's
step goes further (:func:`~trainer_lib.planning.annealing._walk`): its checks and costs are
written out over scalars, as even an inlined helper taking arrays costs their reference counts
(issue 43: 3.5x the steps/s, the same plans).

numba compiles every kernel on first use (a few seconds, cached on disk in the ``__pycache__``
beside its module: ``search.*``, ``descent.*``, ``annealing.*`` ``.nbi``/``.nbc``) with
``nogil``, so a trainer may plan the next step in a thread while the GPU runs this one. numba's
cache checks only the kernel's own file, not the helpers it calls from another one (numba's
"Notes on Caching", limitations): after editing a helper here, delete those cache files, or the
descent and the annealing keep running the old helper. Without numba they run as the same Python:
the same plans (``tests/planning/test_refine.py``), about 250x slower for the descent and 200x for
the annealing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from trainer_lib.planning.items import EITHER, VISION

try:
    from numba import njit
except ImportError:  # pragma: no cover - numba ships with vLLM; without it the kernels run as Python

    def njit(*_args, **_kwargs):  # type: ignore[no-redef]
        return lambda fn: fn


__all__ = ["SearchState", "bins_of"]


class SearchState(NamedTuple):
    """One mini-batch's plan as the kernels search it: numpy arrays, changed in place (numba takes
    a NamedTuple of arrays as one argument). ``S`` slots of ``dp`` bins, bin ``b`` is rank
    ``b % dp`` of slot ``b // dp``; ``n`` samples; ``G`` image sets (at least 1).
    :func:`~trainer_lib.planning.refine._state` builds it."""

    vis_slot: np.ndarray
    """``[S]`` bool: the slot runs the vision tower."""
    where: np.ndarray
    """``[n]`` int64: the sample's place (``VISION``, ``TEXT``, ``EITHER``)."""
    lang: np.ndarray
    """``[n]`` float64: the sample's language cost."""
    size: np.ndarray
    """``[n]`` int64: the sample's tokens."""
    grp: np.ndarray
    """``[n]`` int64: the sample's image set, -1 without images."""
    members: np.ndarray
    """``[S*dp, n]`` int64: the bin's samples in ``members[b, :count[b]]``."""
    count: np.ndarray
    """``[S*dp]`` int64: samples per bin."""
    cnt: np.ndarray
    """``[S*dp, G]`` int64: the bin's samples of each image set."""
    nd: np.ndarray
    """``[S*dp]`` int64: the bin's distinct image sets."""
    V: np.ndarray
    """``[S*dp]`` float64: the bin's vision cost (each distinct set once)."""
    L: np.ndarray
    """``[S*dp]`` float64: the bin's language cost."""
    T: np.ndarray
    """``[S*dp]`` int64: the bin's tokens."""
    frozen: np.ndarray
    """``[S*dp]`` bool: the bin is above the cap and left as it is."""
    gcost: np.ndarray
    """``[G]`` float64: each image set's vision cost."""


_JIT = {"cache": True, "nogil": True}
_INLINE = {**_JIT, "inline": "always"}
"""Small helpers inlined into the loops (as separate calls the descent ran ~6x slower)."""


@njit(**_JIT)
def bins_of(members, count, n):
    """Each of the ``n`` samples' bin, from the per-bin lists (``members[b, :count[b]]``)."""
    bin_of = np.empty(n, np.int64)
    for b in range(count.shape[0]):
        for p in range(count[b]):
            bin_of[members[b, p]] = b
    return bin_of


@njit(**_INLINE)
def _tops(k, dp, X):
    """Slot ``k``'s largest value of ``X``, its bin, and the second largest."""
    i1, v1, v2 = k * dp, X[k * dp], -1.0
    for j in range(k * dp + 1, (k + 1) * dp):
        if X[j] > v1:
            v2, v1, i1 = v1, X[j], j
        elif X[j] > v2:
            v2 = X[j]
    return v1, i1, v2


@njit(**_INLINE)
def _slot_cost(k, dp, V, L, a, va, la, b, vb, lb):
    """Slot ``k``'s slowest vision plus slowest language cost, bins ``a`` and ``b`` (-1: none)
    taking the given costs."""
    mv = ml = 0.0
    for j in range(k * dp, (k + 1) * dp):
        v, lc = (va, la) if j == a else (vb, lb) if j == b else (V[j], L[j])
        mv, ml = max(mv, v), max(ml, lc)
    return mv + ml


@njit(**_INLINE)
def _vision_after(a, gout, gin, cnt, nd, gcost, V):
    """Bin ``a``'s vision cost and distinct image sets once a sample of set ``gout`` leaves it and
    one of set ``gin`` joins it (-1: no sample, or no image); arrays as :class:`SearchState`'s."""
    if gout == gin:
        return V[a], nd[a]
    v, d = V[a], nd[a]
    if gout >= 0 and cnt[a, gout] == 1:
        v, d = v - gcost[gout], d - 1
    if gin >= 0 and cnt[a, gin] == 0:
        v, d = v + gcost[gin], d + 1
    return (v if d > 0 else 0.0), d


@njit(**_INLINE)
def _allowed(where, i, vis_slot_k):
    """Whether sample ``i`` (its place: vision, text or either) may sit in a slot that does or
    does not run the tower."""
    return where[i] == EITHER or (where[i] == VISION) == vis_slot_k


@njit(**_INLINE)
def _change(i, j, a, b, vis_slot, where, size, grp, cnt, nd, gcost, V, T, dp, cap, reserve):
    """Sample ``i`` from bin ``a`` to ``b`` and ``j`` (-1: none) back: the two bins' vision costs,
    or ``(-1.0, -1.0)`` where a rule forbids it (arrays: :class:`SearchState`'s)."""
    ka, kb = a // dp, b // dp
    if not _allowed(where, i, vis_slot[kb]) or (j >= 0 and not _allowed(where, j, vis_slot[ka])):
        return -1.0, -1.0
    ds = size[i] - (size[j] if j >= 0 else 0)
    if T[a] - ds > cap or T[b] + ds > cap:
        return -1.0, -1.0
    gj = grp[j] if j >= 0 else -1
    va, da = _vision_after(a, grp[i], gj, cnt, nd, gcost, V)
    vb, db = _vision_after(b, gj, grp[i], cnt, nd, gcost, V)
    room_a = cap - reserve if vis_slot[ka] and da == 0 else cap
    room_b = cap - reserve if vis_slot[kb] and db == 0 else cap
    if T[a] - ds > room_a or T[b] + ds > room_b:
        return -1.0, -1.0
    return va, vb


@njit(**_JIT)
def _apply(i, a, b, s):
    """Move sample ``i`` from bin ``a`` to bin ``b``, every per-bin array of state ``s`` kept."""
    members, count, cnt, nd, grp = s.members, s.count, s.cnt, s.nd, s.grp
    lang, size, L, T = s.lang, s.size, s.L, s.T
    for p in range(count[a]):
        if members[a, p] == i:
            members[a, p] = members[a, count[a] - 1]
            count[a] -= 1
            break
    members[b, count[b]] = i
    count[b] += 1
    L[a] -= lang[i]
    L[b] += lang[i]
    T[a] -= size[i]
    T[b] += size[i]
    g = grp[i]
    if g >= 0:
        cnt[a, g] -= 1
        nd[a] -= 1 if cnt[a, g] == 0 else 0
        nd[b] += 1 if cnt[b, g] == 0 else 0
        cnt[b, g] += 1


@njit(**_INLINE)
def _pair_cost(a, b, va, la, vb, lb, dp, V, L, tops):
    """The cost of the slots of bins ``a`` and ``b`` once they take the given costs (``tops``: per
    slot, the largest vision cost, its bin, the second; the same for language)."""
    ka, kb = a // dp, b // dp
    if ka == kb:
        return _slot_cost(ka, dp, V, L, a, va, la, b, vb, lb)
    return _one_changed(ka, a, va, la, tops) + _one_changed(kb, b, vb, lb, tops)


@njit(**_INLINE)
def _one_changed(k, j, v, lc, tops):
    """Slot ``k``'s cost once bin ``j`` costs ``v`` in vision and ``lc`` in language."""
    ov = tops[k, 2] if tops[k, 1] == j else tops[k, 0]
    ol = tops[k, 5] if tops[k, 4] == j else tops[k, 3]
    return max(ov, v) + max(ol, lc)


@njit(**_INLINE)
def _pair_now(ka, kb, tops):
    """The cost of slots ``ka`` and ``kb`` (once if they are one slot) as ``tops`` has them."""
    return tops[ka, 0] + tops[ka, 3] + (0.0 if kb == ka else tops[kb, 0] + tops[kb, 3])


@njit(**_INLINE)
def _exchange(i, j, a, b, va, vb, s):
    """Sample ``i`` from bin ``a`` to ``b`` and ``j`` (-1: none) back in state ``s``, the bins'
    vision costs becoming ``va`` and ``vb`` (:func:`_change`'s)."""
    _apply(i, a, b, s)
    if j >= 0:
        _apply(j, b, a, s)
    s.V[a], s.V[b] = va, vb


@njit(**_JIT)
def _retop(k, dp, V, L, tops):
    """``tops[k]``: slot ``k``'s largest vision cost, its bin, the second; the same for language."""
    tops[k, 0], tops[k, 1], tops[k, 2] = _tops(k, dp, V)
    tops[k, 3], tops[k, 4], tops[k, 5] = _tops(k, dp, L)
