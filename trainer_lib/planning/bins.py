"""Bin capacity and bin planning for packing (docs/PACKING.md): first-fit-decreasing
(:func:`plan_bins`) and longest-processing-time-first into a given number of bins
(:func:`lpt_bins`); tighter, slower packings are in :mod:`trainer_lib.planning.repack`.

Pure Python + numpy: lengths, isolation keys and compatibility kinds in, bins of indices out.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["NEUTRAL", "PIXELS", "STRAY", "TopUp", "bin_capacity", "key_groups", "lpt_bins", "plan_bins"]

NEUTRAL, PIXELS, STRAY = 0, 1, 2
"""Bin-compatibility classes: text without placeholder tokens joins any bin; a sample with
images (``PIXELS``) never joins a bin holding a ``STRAY`` text sample, and vice versa."""


def bin_capacity(seq_len: int, micro_batch_max_tokens: int | None = None) -> int:
    """The bin size: ``micro_batch_max_tokens`` or ``seq_len``.

    Raises:
        ValueError: a non-positive value, or a cap larger than ``seq_len`` (prime-rl #2183).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    cap = seq_len if micro_batch_max_tokens is None else micro_batch_max_tokens
    if cap < 1:
        raise ValueError(f"micro_batch_max_tokens must be >= 1, got {cap}")
    if cap > seq_len:
        raise ValueError(
            f"micro_batch_max_tokens {cap} is larger than seq_len {seq_len}; it must be <= seq_len"
        )
    return cap


def key_groups(keys: Sequence[Any] | None, n: int) -> list[list[int]]:
    """Indices ``0 .. n-1`` grouped by isolation key, keys in first-seen order, indices ascending
    (one group when ``keys`` is None or holds a single key)."""
    if keys is None or not n or keys.count(keys[0]) == n:  # one key: no grouping to do
        return [list(range(n))]
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def plan_bins(
    lengths: Sequence[int],
    cap: int,
    *,
    keys: Sequence[Any] | None = None,
    kinds: Sequence[int] | None = None,
    groups: Sequence[Hashable | None] | None = None,
) -> list[list[int]]:
    """First-fit-decreasing bin assignment; returns bins of indices into ``lengths``.

    Items are visited by decreasing length (ties: input order); each goes into the first open bin
    of its key with room and a compatible kind, else opens a bin. With ``groups``, an item first
    tries the bins already holding its group (in creation order): samples sharing an image stay in
    as few bins as first fit allows, so the trainer encodes that image fewer times. An item longer
    than ``cap`` gets a bin of its own that nothing else joins. Bins are ordered by key (first-seen
    order), then by creation; indices inside a bin are ascending.

    Args:
        lengths: token count per item.
        cap: bin size in tokens.
        keys: isolation key per item (``(run_id, lora_id)``); items of different keys never share.
        kinds: :data:`NEUTRAL`, :data:`PIXELS` or :data:`STRAY` per item; PIXELS and STRAY never share.
        groups: per item, a hashable key of its image set (None: no group), or None.
    """
    n = len(lengths)
    lengths_list = list(map(int, lengths))
    kinds_list = [NEUTRAL] * n if kinds is None else list(map(int, kinds))
    out: list[list[int]] = []
    for members in key_groups(keys, n):
        order = sorted(members, key=lengths_list.__getitem__, reverse=True)  # stable: ties keep input order
        few = sum(map(lengths_list.__getitem__, members)) <= _SCAN_BINS * cap
        if groups is not None and any(groups[i] is not None for i in members):
            bins = _first_fit_scan(
                _by_group(order, lengths_list, groups), lengths_list, kinds_list, cap, groups
            )
            plain = (_first_fit_scan if few else _first_fit)(order, lengths_list, kinds_list, cap)
            bins = plain if len(plain) < len(bins) else bins  # keeping groups never costs a bin
        else:
            bins = (_first_fit_scan if few else _first_fit)(order, lengths_list, kinds_list, cap)
        out.extend(sorted(b) for b in bins)
    return out


def _by_group(order: list[int], lengths: list[int], groups: Sequence[Hashable | None]) -> list[int]:
    """``order`` (decreasing length) with each group's items together: groups by decreasing total
    length, each in decreasing length, then the ungrouped items."""
    members: dict[Hashable, list[int]] = {}
    loose = []
    for i in order:
        (loose if groups[i] is None else members.setdefault(groups[i], [])).append(i)
    ranked = sorted(members.values(), key=lambda m: -sum(map(lengths.__getitem__, m)))
    return [i for m in ranked for i in m] + loose


_SCAN_BINS = 192
"""Below about this many bins a plain scan of the open bins beats one numpy search per item
(measured on bench/pack.py's mix: ~36 bins 4x faster, ~145 bins 1.6x, ~290 bins 0.9x)."""


def _first_fit_scan(
    order: list[int],
    lengths: list[int],
    kinds: list[int],
    cap: int,
    groups: Sequence[Hashable | None] | None = None,
) -> list[list[int]]:
    """:func:`_first_fit` by scanning the bins in creation order (same result, no numpy); with
    ``groups``, the bins holding an item's group are tried first."""
    bins: list[list[int]] = []
    rooms: list[int] = []
    holds: list[int] = []  # per bin: PIXELS or STRAY once it holds one, else NEUTRAL
    home: dict[Hashable, list[int]] = {}  # group -> bins holding it
    smallest = min((lengths[i] for i in order), default=0)  # with groups, ``order`` is not by size
    first = 0  # bins before this one have no room for any item left
    for i in order:
        size, kind = lengths[i], kinds[i]
        group = None if groups is None else groups[i]
        clash = STRAY if kind == PIXELS else PIXELS if kind == STRAY else -1
        while first < len(rooms) and rooms[first] < smallest:
            first += 1
        j = -1
        if size <= cap:
            candidates = home.get(group, []) if group is not None else []
            for b in (*candidates, *range(first, len(rooms))):
                if rooms[b] >= size and holds[b] != clash:
                    j = b
                    break
        if j < 0:
            j = len(bins)
            bins.append([i])
            rooms.append(cap - size if size <= cap else -1)  # an oversized item closes its bin
            holds.append(kind)
        else:
            bins[j].append(i)
            rooms[j] -= size
            if kind != NEUTRAL:
                holds[j] = kind
        if group is not None and j not in home.setdefault(group, []):
            home[group].append(j)
    return bins


def _first_fit(order: list[int], lengths: list[int], kinds: list[int], cap: int) -> list[list[int]]:
    """First fit of the items in ``order`` (one isolation key): bins of indices, in creation order.

    Remaining room per bin as seen by each kind (-1 where the kind may not join): one vectorized
    first-fit search per item, no per-bin Python loop.
    """
    m = len(order)
    room = {kind: np.full(m, -1, dtype=np.int64) for kind in (NEUTRAL, PIXELS, STRAY)}
    has_pix = [False] * m
    has_stray = [False] * m
    bins: list[list[int]] = []
    max_room = -1  # upper bound on any open bin's room (refreshed when a search fails)
    for i in order:
        size, kind, nb = lengths[i], kinds[i], len(bins)
        j = nb
        if size <= max_room:
            k = int((room[kind][:nb] >= size).argmax())
            if room[kind][k] >= size:
                j = k
            else:
                max_room = int(room[NEUTRAL][:nb].max())
        if j == nb:
            bins.append([i])
            left = cap - size if size <= cap else -1  # an oversized item closes its bin
            room[NEUTRAL][j] = room[PIXELS][j] = room[STRAY][j] = left
            max_room = max(max_room, left)
        else:
            bins[j].append(i)
            left = int(room[NEUTRAL][j]) - size  # NEUTRAL room is the bin's true room
            room[NEUTRAL][j] = left
            if not has_stray[j]:
                room[PIXELS][j] = left
            if not has_pix[j]:
                room[STRAY][j] = left
        if kind == PIXELS and not has_pix[j]:
            has_pix[j] = True
            room[STRAY][j] = -1
        elif kind == STRAY and not has_stray[j]:
            has_stray[j] = True
            room[PIXELS][j] = -1
    return bins


class TopUp(NamedTuple):
    """:func:`lpt_bins`' optional items: ``items`` (indices into its ``lengths`` and ``keys``) join
    the least-loaded bin, largest first, only where it stays within ``target`` tokens.

    Example: ``TopUp([2, 3, 4], target=7)``: each of samples 2, 3 and 4 fills a bin up to 7 tokens
    at most, or is left over.
    """

    items: Sequence[int] = ()
    """Optional sample indices."""
    target: float = 0.0
    """Tokens an optional item may fill a bin up to."""


def lpt_bins(
    items: list[int],
    lengths: Sequence[int],
    keys: Sequence[Hashable],
    nbins: int,
    cap: int,
    top_up: TopUp | None = None,
) -> tuple[list[list[int]], list[int]] | None:
    """Longest processing time first (Graham 1969): ``items`` largest first into the least-loaded
    of ``nbins`` bins of their key; a bin is closed once it holds more than ``cap``.

    Then ``top_up.items`` (optional), largest first, join the least-loaded bin only where it stays
    within ``top_up.target`` tokens; the others come back as leftovers. Bins per key: one for each key with
    ``items``, then each next bin to the key with the most tokens per bin (at most one bin per
    item). Loads only grow, so an optional item that fits no bin never will: a binary search skips
    them (``O(n log n)``).

    Args:
        items: indices into ``lengths`` and ``keys``.
        top_up: the optional items (indices too) and their fill :class:`TopUp`; None: none.
        nbins: bins to fill (some may stay empty).

    Returns:
        ``(bins, leftovers)``: bins of indices (largest first), then the optional items left out;
        None when an item does not fit (a bin would exceed ``cap`` with another item in it) or
        the keys of ``items`` need more than ``nbins`` bins.
    """
    top_up = top_up or TopUp()
    if not items and not top_up.items:
        return [], []
    groups = _lpt_groups(items, top_up.items, lengths, keys, nbins)
    if groups is None:
        return None
    out: list[list[int]] = []
    left: list[int] = []
    for must, may, nb in groups:
        heap = [(0, len(out) + j) for j in range(nb)]
        out.extend([] for _ in range(nb))
        rest = _lpt_fill(heap, out, must, TopUp(may, top_up.target), lengths, cap)
        if rest is None:
            return None
        left += rest
    return out, left


def _lpt_groups(
    items: list[int], optional: Sequence[int], lengths: Sequence[int], keys: Sequence[Hashable], nbins: int
) -> list[tuple[list[int], list[int], int]] | None:
    """Per key (first-seen order): its ``items`` and its ``optional`` items, largest first, and its
    number of bins (:func:`_bins_per_key`); None when the needed keys need more than ``nbins``."""
    length = lengths.__getitem__
    everyone = [*items, *optional]
    if len(set(map(keys.__getitem__, everyone))) == 1:  # one key (the usual case): no grouping
        if items and not nbins:
            return None
        ordered = (sorted(items, key=length, reverse=True), sorted(optional, key=length, reverse=True))
        return [(*ordered, min(nbins, len(everyone)))]
    needed: dict[Hashable, list[int]] = {}
    extra: dict[Hashable, list[int]] = {}
    for group, chosen in ((needed, items), (extra, optional)):
        for i in sorted(chosen, key=length, reverse=True):
            group.setdefault(keys[i], []).append(i)
    groups = {k: (needed.get(k, []), extra.get(k, [])) for k in {**needed, **extra}}
    alloc = _bins_per_key(groups, lengths, nbins)
    return None if alloc is None else [(must, may, alloc[k]) for k, (must, may) in groups.items()]


def _lpt_fill(
    heap: list[tuple[int, int]],
    out: list[list[int]],
    must: list[int],
    top_up: TopUp,
    lengths: Sequence[int],
    cap: int,
) -> list[int] | None:
    """One key's LPT into its bins: ``heap`` holds ``(load, index into out)`` of the bins still open;
    ``top_up.items`` are the key's optional items, largest first.
    Returns the optional items left out, or None when a needed item does not fit."""
    may, target = list(top_up.items), top_up.target
    for i in must:
        n = lengths[i]
        if not heap or (heap[0][0] + n > cap and out[heap[0][1]]):
            return None
        load, b = heapq.heappop(heap)
        out[b].append(i)
        if load + n <= cap:
            heapq.heappush(heap, (load + n, b))
    left: list[int] = []
    sizes = [-lengths[i] for i in may]  # ascending: bisect finds the first that fits
    p = 0
    while heap and p < len(may):
        q = bisect.bisect_left(sizes, heap[0][0] - target, p)  # skip what fits no bin any more
        left += may[p:q]  # (the least load only grows: skipped samples never fit later)
        if q == len(may):
            p = q
            break
        load, b = heapq.heappop(heap)
        out[b].append(may[q])
        if load - sizes[q] <= cap:
            heapq.heappush(heap, (load - sizes[q], b))
        p = q + 1
    return left + may[p:]


def _bins_per_key(
    groups: dict[Hashable, tuple[list[int], list[int]]], lengths: Sequence[int], nbins: int
) -> dict[Hashable, int] | None:
    """Bins per key for :func:`lpt_bins`: one for each key with needed samples, then each next to the
    key with the most tokens per bin (at most one bin per sample); None if the needed keys
    alone take more than ``nbins``."""
    total = {
        k: sum(map(lengths.__getitem__, must)) + sum(map(lengths.__getitem__, may))
        for k, (must, may) in groups.items()
    }
    size = {k: len(must) + len(may) for k, (must, may) in groups.items()}
    alloc = {k: int(bool(must)) for k, (must, _) in groups.items()}
    if sum(alloc.values()) > nbins:
        return None
    queue = [(-total[k] / (a or 0.5), n, k) for n, (k, a) in enumerate(alloc.items()) if size[k] > a]
    heapq.heapify(queue)
    for _ in range(nbins - sum(alloc.values())):
        if not queue:
            break
        _, n, k = heapq.heappop(queue)
        alloc[k] += 1
        if size[k] > alloc[k]:
            heapq.heappush(queue, (-total[k] / alloc[k], n, k))
    return alloc
