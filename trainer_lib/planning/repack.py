"""Tighter packings for where first fit misses a bound (docs/PACKING.md §3.2, step 4): minimum bin
slack (:func:`min_slack_bins`) and best fit with one exchange move into existing bins
(:func:`best_fit_with_exchange`). Slower than :mod:`trainer_lib.planning.bins`' first fit; the
data-parallel partition runs them only on a plan above its slot bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from trainer_lib.planning.bins import key_groups

__all__ = ["best_fit_with_exchange", "min_slack_bins"]


def min_slack_bins(lengths: Sequence[int], cap: int, *, keys: Sequence[Any] | None = None) -> list[list[int]]:
    """Bins filled one at a time, each nearly as full as the items left allow: the bin opens with
    the largest item left and is completed by a subset of the others found by an exact subset sum.

    The minimum bin slack heuristic of Gupta & Ho (1999, "A new heuristic algorithm for the
    one-dimensional bin-packing problem", Production Planning & Control 10(6)), with its bounded
    subset enumeration replaced by a subset sum over reachable sums held as the bits of one Python
    integer (``reach | reach << size``, items largest first). The search stops at the first subset
    that leaves at most the bin's share of the spare room of the bound ``ceil(tokens / cap)``
    (``(bound * cap - tokens) / bins left``; none once the bound is passed: the closest subset),
    topped up first-fit with what still fits; a bin that cannot get that full takes the closest
    subset. Same contract as :func:`plan_bins` without kinds (the caller keeps ``PIXELS`` and
    ``STRAY`` apart): an item longer than ``cap`` gets a bin of its own; bins are ordered by key
    (first-seen order), then by creation; indices inside a bin are ascending. As with first fit,
    every bin but the last of its key holds more than ``cap`` minus its key's largest item: no
    item left fits a bin once it is closed, so the item that opened a later bin did not fit an
    earlier one.

    Cost: ``O(n)`` big-integer operations on ``cap`` bits per bin (~2 ms for 256 samples at cap
    8k, several times :func:`plan_bins`); :func:`~trainer_lib.planning.partition.partition_mini_batch` runs
    it only where first-fit-decreasing misses the slot bound (docs/PACKING.md §3.2).
    """
    out: list[list[int]] = []
    for members in key_groups(keys, len(lengths)):
        left = sorted(members, key=lengths.__getitem__, reverse=True)  # stable: ties keep input order
        sizes = [lengths[i] for i in left]
        fit = sum(n for n in sizes if n <= cap)
        bound = -(-fit // cap)
        spare = bound * cap - fit
        while left:
            room = cap - sizes.pop(0)
            bin_ = [left.pop(0)]
            if room >= 0:  # else above the cap: alone, outside the bound
                share = spare // bound if bound > 0 else 0
                chosen = _subset_sum(sizes, room, max(room - share, 0))
                short = room - sum(sizes[k] for k in chosen)
                if sizes and short >= sizes[-1]:  # stopped early: top up
                    chosen |= _first_fit_into(sizes, short, chosen)
                for k in sorted(chosen, reverse=True):
                    room -= sizes.pop(k)
                    bin_.append(left.pop(k))
                spare -= room
                bound -= 1
            out.append(sorted(bin_))
    return out


def _first_fit_into(sizes: list[int], room: int, chosen: set[int]) -> set[int]:
    """Positions of the items not in ``chosen`` that fit, largest first, into the ``room`` that
    ``chosen`` leaves: afterwards no other item fits the bin."""
    more = set()
    for k, size in enumerate(sizes):
        if size <= room and k not in chosen:
            more.add(k)
            room -= size
    return more


def _subset_sum(sizes: list[int], target: int, enough: int) -> set[int]:
    """Positions in ``sizes`` of a subset summing to at most ``target``: the first (in ``sizes``'
    order) to reach ``enough``, else the closest to ``target``. Bit ``t`` of ``reach[k]``: some
    subset of the first ``k`` sizes sums to ``t``."""
    mask = (1 << (target + 1)) - 1
    reach = [1]
    for size in sizes:
        r = reach[-1]
        reach.append((r | (r << size)) & mask if size <= target else r)
        if reach[-1] >> enough:
            break
    t = reach[-1].bit_length() - 1
    chosen = set()
    for k in range(len(reach) - 1, 0, -1):
        if t and not (reach[k - 1] >> t) & 1:  # t needs size k - 1
            chosen.add(k - 1)
            t -= sizes[k - 1]
    return chosen


def best_fit_with_exchange(
    items: list[int], bins: list[list], lengths: Sequence[int], fits: Callable[[int, list], bool]
) -> bool:
    """Place ``items`` (indices into ``lengths``, largest first) into ``bins`` by best fit, or else
    make room by one exchange (the moves of Fleszar & Hindi 2002's bin-packing local search): a
    sample ``y`` of a bin ``A`` moves to another bin ``B``, in trade for one of ``B``'s smaller
    samples or for nothing, so that ``A`` gains the room the item needs and ``B`` stays within its
    limit. No bin loses more tokens than the item brings.

    Args:
        items: the samples to place.
        bins: ``[load, indices, limit, *extra]`` each (tokens, sample indices, token limit, any
            data ``fits`` reads), changed in place; a bin above its limit is closed.
        lengths: tokens per sample.
        fits: whether sample ``i`` may join bin ``c`` (isolation keys, sides).

    Returns:
        True when every item was placed; False (``bins`` then unspecified) when one fits neither way.
    """
    for x in sorted(items, key=lengths.__getitem__, reverse=True):
        n = lengths[x]
        ok = sorted((c for c in bins if c[0] <= c[2] and fits(x, c)), key=lambda c: c[0] - c[2])
        if fit := [c for c in ok if c[2] - c[0] >= n]:
            c = fit[-1]  # best fit: the least room that holds x
        elif not (c := _make_room(n, ok, bins, lengths, fits)):
            return False
        c[0] += n
        c[1].append(x)
    return True


def _make_room(
    n: int, ok: list[list], bins: list[list], lengths: Sequence[int], fits: Callable[[int, list], bool]
) -> list | None:
    """The exchange of :func:`best_fit_with_exchange`: the first bin of ``ok`` (most room first)
    that one trade with another bin leaves ``n`` tokens of room, after the trade; None if none."""
    for a in ok:
        need = n - (a[2] - a[0])
        for b in bins:
            room = b[2] - b[0]
            if b is a or room < need or b[0] > b[2]:
                continue
            for y in a[1]:
                if not fits(y, b) or lengths[y] < need:
                    continue
                for z in [None, *b[1]]:
                    d = lengths[y] - (0 if z is None else lengths[z])
                    if need <= d <= min(room, n) and (z is None or fits(z, a)):
                        a[1].remove(y)
                        b[1].append(y)
                        if z is not None:
                            b[1].remove(z)
                            a[1].append(z)
                        a[0] -= d
                        b[0] += d
                        return a
    return None
