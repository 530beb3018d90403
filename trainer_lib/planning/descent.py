"""The descent, the refinement's step 1 (:mod:`~trainer_lib.planning.refine`), compiled with numba.

On a :class:`~trainer_lib.planning.search.SearchState`, with the moves and costs of
:mod:`~trainer_lib.planning.search` (whose docstring gives the layout, the arrays-one-by-one rule
of the hot helpers, and the on-disk cache): each slot's slowest bins hand a sample (or swap it)
to the bin that lowers the step most, until no change gains enough.
"""

from __future__ import annotations

import numpy as np

from trainer_lib.planning.search import (
    _JIT,
    _allowed,
    _change,
    _exchange,
    _pair_cost,
    _pair_now,
    _retop,
    njit,
)

__all__ = ["descend"]


# fmt: off
@njit(**_JIT)
def _best_partner(
    i, a, dp, S, vis_slot, where, lang, size, grp, members, count, cnt, nd, V, L, T, frozen, gcost,
    tops, cap, reserve, eps
):
    """The move or swap of sample ``i`` (in bin ``a``) that lowers the step most, at least by
    ``eps``: ``(gain, bin, partner or -1, vision of a, vision of the bin)``; bin -1 if none.
    Arrays one by one, not the :class:`~trainer_lib.planning.search.SearchState`
    (:mod:`~trainer_lib.planning.search`'s docstring: 15x)."""
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
    (:class:`~trainer_lib.planning.search.SearchState`, ``dp`` bins per slot), changed in place:
    slot after slot, a sample of its slowest bin (language, then vision) takes its best partner
    (the first such sample that has one); a changed slot is visited again; it stops after a round
    of the slots without a change of at least ``eps_share`` of the slot, or after ``max_changes``.
    A bin holds at most ``cap`` tokens, ``cap - reserve`` in a tower-running slot without an image
    of its own. Returns the number of changes."""
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
