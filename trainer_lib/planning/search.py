"""The refinement's search kernels (:mod:`~trainer_lib.planning.refine`), compiled with numba.

They work on one mini-batch's per-bin arrays, a :class:`SearchState`
(:func:`~trainer_lib.planning.refine.refine_slots` builds it): bin ``b`` is rank ``b % dp`` of
slot ``b // dp``; a slot costs its slowest bin's vision cost plus its slowest bin's language
cost, and a bin's vision cost is the sum of its distinct image sets' costs. :func:`descend` is
the descent, :func:`anneal` the annealing (the algorithms are the refine module's steps 1 and 2).

:func:`descend` and :func:`anneal` take the state as one :class:`SearchState` and unpack it once;
the hot helpers they call (:func:`_best_partner` per sample of a slowest bin, and the inlined
:func:`_change` per candidate) take its arrays one by one: handed the NamedTuple, ``_best_partner``
made the descent 15x slower on ``bench/pack.py``'s mini-batches (7.8 ms against 0.53 ms per
mini-batch, the same changes), the tuple's fields read at every call. The annealing's step goes
further (:func:`_walk`): its checks and costs are written out over scalars, as even an inlined
helper taking arrays costs their reference counts (issue 43: 3.5x the steps/s, the same plans).

numba compiles them on first use (a few seconds, cached on disk next to this file) with ``nogil``,
so a trainer may plan the next step in a thread while the GPU runs this one. Without numba they
run as the same Python: the same plans (``tests/planning/test_refine.py``), about 250x slower for
the descent and 200x for the annealing.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from trainer_lib.planning.items import EITHER, VISION

try:
    from numba import njit
except ImportError:  # pragma: no cover - numba ships with vLLM; without it the kernels run as Python

    def njit(*_args, **_kwargs):  # type: ignore[no-redef]
        return lambda fn: fn


__all__ = ["SearchState", "anneal", "bins_of", "descend"]


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


# fmt: off
@njit(**_JIT)
def _best_partner(
    i, a, dp, S, vis_slot, where, lang, size, grp, members, count, cnt, nd, V, L, T, frozen, gcost,
    tops, cap, reserve, eps
):
    """The move or swap of sample ``i`` (in bin ``a``) that lowers the step most, at least by
    ``eps``: ``(gain, bin, partner or -1, vision of a, vision of the bin)``; bin -1 if none.
    Arrays one by one, not the :class:`SearchState` (module docstring: 15x)."""
    # fmt: on
    best, bb, bj, bva, bvb = eps, -1, -1, 0.0, 0.0
    ka = a // dp
    for b in range(count.shape[0]):
        kb = b // dp
        if b == a or frozen[b] or not _allowed(where, i, vis_slot[kb]):
            continue
        base = _pair_now(ka, kb, tops)
        for q in range(-1, count[b]):
            j = members[b, q] if q >= 0 else -1
            va, vb = _change(i, j, a, b, vis_slot, where, size, grp, cnt, nd, gcost, V, T, dp, cap, reserve)
            if va < 0.0:
                continue
            dl = lang[i] - (lang[j] if j >= 0 else 0.0)
            gain = base - _pair_cost(a, b, va, L[a] - dl, vb, L[b] + dl, dp, V, L, tops)
            if gain > best:
                best, bb, bj, bva, bvb = gain, b, j, va, vb
    return best, bb, bj, bva, bvb


@njit(**_JIT)
def descend(state, dp, cap, reserve, max_changes, eps_share):
    """The descent (:mod:`~trainer_lib.planning.refine`'s step 1) on ``state``
    (:class:`SearchState`, ``dp`` bins per slot), changed in place: slot after slot, a sample of
    its slowest bin (language, then vision) takes its best partner (the first such sample that has
    one); a changed slot is visited again; it stops after a round of the slots without a change of
    at least ``eps_share`` of the slot, or after ``max_changes``. A bin holds at most ``cap``
    tokens, ``cap - reserve`` in a tower-running slot without an image of its own. Returns the
    number of changes."""
    S, V, L, frozen = state.vis_slot.shape[0], state.V, state.L, state.frozen
    count, members, lang, size, grp = state.count, state.members, state.lang, state.size, state.grp
    vis_slot, where, cnt, nd = state.vis_slot, state.where, state.cnt, state.nd
    gcost, T = state.gcost, state.T
    tops = np.empty((S, 6))
    for k in range(S):
        _retop(k, dp, V, L, tops)
    dirty = np.ones(S, np.bool_)
    changes, k, quiet = 0, 0, 0
    while changes < max_changes and quiet < S:
        if not dirty[k]:
            k, quiet = (k + 1) % S, quiet + 1
            continue
        dirty[k] = False
        eps = eps_share * (tops[k, 0] + tops[k, 3])
        done = False
        for src in range(2):  # the slowest bin in language, then in vision
            a = int(tops[k, 4]) if src == 0 else int(tops[k, 1])
            if done or frozen[a] or (src == 1 and a == int(tops[k, 4])):
                continue
            for p in range(count[a]):
                i = members[a, p]
                _, b, j, va, vb = _best_partner(
                    i, a, dp, S, vis_slot, where, lang, size, grp, members, count, cnt, nd, V, L, T,
                    frozen, gcost, tops, cap, reserve, eps,
                )  # fmt: skip
                if b >= 0:
                    _exchange(i, j, a, b, va, vb, state)
                    for kk in (k, b // dp):
                        _retop(kk, dp, V, L, tops)
                        dirty[kk] = True
                    changes, done = changes + 1, True
                    break
        quiet = 0 if done else quiet + 1
        if not done:
            k = (k + 1) % S
    return changes


@njit(**_INLINE)
def _splitmix(state):
    """The next state and 64 random bits of SplitMix64 (Steele, Lea & Flood 2014; the seeding
    generator of Java's ``SplittableRandom``): a few multiplies, against the tens of nanoseconds a
    ``numpy.random.Generator`` draw costs inside a kernel. Unsigned arithmetic wraps (the caller
    silences numpy's overflow warnings where the kernel runs as Python). Keep the state inside the
    kernel: numba hands a returned ``uint64`` to Python as a signed int."""
    state = state + np.uint64(0x9E3779B97F4A7C15)
    z = (state ^ (state >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return state, z ^ (z >> np.uint64(31))


@njit(**_INLINE)
def _below(bits, m):
    """An integer in ``[0, m)`` from the low 32 of random ``bits`` (``m`` far below 2**32)."""
    return np.int64((bits & np.uint64(0xFFFFFFFF)) % np.uint64(m))


@njit(**_INLINE)
def _unit(bits):
    """A float in ``[0, 1)`` from the high 32 of random ``bits``."""
    return np.float64(bits >> np.uint64(32)) * (1.0 / 4294967296.0)


@njit(**_INLINE)
def _after(v, d, leaves, joins, cost_out, cost_in):
    """A bin's vision cost and distinct image sets ``(v, d)`` once the set costing ``cost_out``
    leaves it (``leaves``: its last sample goes) and the set costing ``cost_in`` joins it
    (``joins``: new to the bin): :func:`_vision_after` over scalars, for :func:`anneal`."""
    if leaves:
        v, d = v - cost_out, d - 1
    if joins:
        v, d = v + cost_in, d + 1
    return (v if d > 0 else 0.0), d


@njit(**_JIT)
def anneal(state, dp, cap, reserve, steps, seed, t0, t1):
    """The annealing (:mod:`~trainer_lib.planning.refine`'s step 2) from ``state`` (as
    :func:`descend`'s): ``steps`` random moves (40%) and swaps (60%) of a random sample to a random
    bin, each kept if it shortens the step or with probability ``exp(-delta / T)``, ``T`` falling
    geometrically from ``t0`` to ``t1``; the draws from SplitMix64 started at ``seed`` (a
    ``numpy.uint64``). Returns the best plan seen, as each sample's bin."""
    S, count, members = state.vis_slot.shape[0], state.count, state.members
    bin_of = bins_of(members, count, state.lang.shape[0])
    tops = np.empty((S, 6))  # per slot, as in the descent: each stage's largest cost, its bin, the second
    cur = 0.0
    for k in range(S):
        _retop(k, dp, state.V, state.L, tops)
        cur += tops[k, 0] + tops[k, 3]
    return _walk(state, dp, cap, reserve, steps, seed, t0, t1, bin_of, tops, cur)


@njit(**_JIT)
def _walk(state, dp, cap, reserve, steps, seed, t0, t1, bin_of, tops, cur):
    """:func:`anneal`'s steps from ``bin_of`` (each sample's bin), ``tops`` (per slot, as
    :func:`_retop`) and ``cur`` (the step). :func:`_change` and :func:`_pair_cost` are written out
    over scalars: called with their arrays, even inlined, they took 2.5x the rest of a step (numba
    counts the references of every array argument; ``bench/search_rate.py``: ~3x the steps/s, the
    same plans)."""
    S, V, L, frozen = state.vis_slot.shape[0], state.V, state.L, state.frozen
    count, members, lang, size, grp = state.count, state.members, state.lang, state.size, state.grp
    vis_slot, where, cnt, nd = state.vis_slot, state.where, state.cnt, state.nd
    gcost, T = state.gcost, state.T
    n, nbins = lang.shape[0], S * dp
    best, best_of = cur, bin_of.copy()
    ratio, rng = math.log(t1 / t0), seed
    for step in range(steps):
        rng, bits = _splitmix(rng)
        i, b = _below(bits, n), _below(bits >> np.uint64(32), nbins)
        a = bin_of[i]
        if b == a or frozen[a] or frozen[b]:
            continue
        rng, bits = _splitmix(rng)
        j = -1
        if count[b] > 0 and _unit(bits) < 0.6:
            j = members[b, _below(bits, count[b])]
        ka, kb = a // dp, b // dp
        if not (where[i] == EITHER or (where[i] == VISION) == vis_slot[kb]):
            continue
        if j >= 0 and not (where[j] == EITHER or (where[j] == VISION) == vis_slot[ka]):
            continue
        ds = size[i] - (size[j] if j >= 0 else 0)
        if T[a] - ds > cap or T[b] + ds > cap:
            continue
        gi, gj = grp[i], (grp[j] if j >= 0 else -1)
        va, da, vb, db = V[a], nd[a], V[b], nd[b]
        if gi != gj:
            ci, cj = gcost[max(gi, 0)], gcost[max(gj, 0)]
            va, da = _after(va, da, gi >= 0 and cnt[a, gi] == 1, gj >= 0 and cnt[a, gj] == 0, ci, cj)
            vb, db = _after(vb, db, gj >= 0 and cnt[b, gj] == 1, gi >= 0 and cnt[b, gi] == 0, cj, ci)
        if vis_slot[ka] and da == 0 and T[a] - ds > cap - reserve:
            continue  # a bin left without an image keeps the synthetic pad's room
        if vis_slot[kb] and db == 0 and T[b] + ds > cap - reserve:
            continue
        old = tops[ka, 0] + tops[ka, 3] + (0.0 if kb == ka else tops[kb, 0] + tops[kb, 3])
        dl = lang[i] - (lang[j] if j >= 0 else 0.0)
        la, lb = L[a] - dl, L[b] + dl
        if ka == kb:
            mv = ml = 0.0
            for q in range(ka * dp, (ka + 1) * dp):
                v, lc = (va, la) if q == a else (vb, lb) if q == b else (V[q], L[q])
                mv, ml = max(mv, v), max(ml, lc)
            delta = mv + ml - old
        else:
            delta = _one_changed(ka, a, va, la, tops) + _one_changed(kb, b, vb, lb, tops) - old
        if delta > 0.0:
            rng, bits = _splitmix(rng)
            if _unit(bits) >= math.exp(-delta / (t0 * math.exp(ratio * step / steps))):
                continue
        _accept(i, j, a, b, va, vb, state, bin_of, tops, dp)
        cur += delta
        if cur < best * (1.0 - 1e-12):
            best = cur
            best_of[:] = bin_of
    return best_of


@njit(**_JIT)
def _accept(i, j, a, b, va, vb, state, bin_of, tops, dp):
    """:func:`_walk` keeps a change (as :func:`_exchange`): ``bin_of`` and the two slots' ``tops``
    follow."""
    _exchange(i, j, a, b, va, vb, state)
    bin_of[i] = b
    if j >= 0:
        bin_of[j] = a
    _retop(a // dp, dp, state.V, state.L, tops)
    if b // dp != a // dp:
        _retop(b // dp, dp, state.V, state.L, tops)
