"""The annealing, the refinement's step 2 (:mod:`~trainer_lib.planning.refine`), compiled with numba.

On a :class:`~trainer_lib.planning.search.SearchState`, with the moves and costs of
:mod:`~trainer_lib.planning.search` (whose docstring gives the layout and the on-disk cache):
random moves and swaps, kept by the Metropolis rule under a falling temperature, the draws from
SplitMix64 inside the kernel (:func:`_splitmix`), so one seed gives one plan on every rank. Its
step (:func:`_walk`) writes the search module's checks and costs out over scalars.
"""

from __future__ import annotations

import math

import numpy as np

from trainer_lib.planning.items import EITHER, VISION
from trainer_lib.planning.search import _INLINE, _JIT, _exchange, _one_changed, _retop, bins_of, njit

__all__ = ["anneal"]


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
    (``joins``: new to the bin): :func:`~trainer_lib.planning.search._vision_after` over scalars,
    for :func:`anneal`."""
    if leaves:
        v, d = v - cost_out, d - 1
    if joins:
        v, d = v + cost_in, d + 1
    return (v if d > 0 else 0.0), d


@njit(**_JIT)
def anneal(state, dp, cap, reserve, steps, seed, t0, t1):
    """The annealing (:mod:`~trainer_lib.planning.refine`'s step 2) from ``state`` (as
    :func:`~trainer_lib.planning.descent.descend`'s): ``steps`` random moves (40%) and swaps (60%)
    of a random sample to a random bin, each kept if it shortens the step or with probability
    ``exp(-delta / T)``, ``T`` falling geometrically from ``t0`` to ``t1``; the draws from
    SplitMix64 started at ``seed`` (a ``numpy.uint64``). Returns the best plan seen, as each
    sample's bin."""
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
    :func:`~trainer_lib.planning.search._retop`) and ``cur`` (the step).
    :func:`~trainer_lib.planning.search._change` and :func:`~trainer_lib.planning.search._pair_cost`
    are written out over scalars: called with their arrays, even inlined, they took 2.5x the rest
    of a step (numba counts the references of every array argument; ``bench/search_rate.py``: ~3x
    the steps/s, the same plans)."""
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
    """:func:`_walk` keeps a change (as :func:`~trainer_lib.planning.search._exchange`):
    ``bin_of`` and the two slots' ``tops`` follow."""
    _exchange(i, j, a, b, va, vb, state)
    bin_of[i] = b
    if j >= 0:
        bin_of[j] = a
    _retop(a // dp, dp, state.V, state.L, tops)
    if b // dp != a // dp:
        _retop(b // dp, dp, state.V, state.L, tops)
