"""Vision slots balanced by compute, samples that share an image kept together (docs/PACKING.md §3.7).

With deduplicated features (the trainer's default) a micro-batch runs the vision tower once per
*distinct* image it holds, so an RL group of ``G`` rollouts sharing a photo costs the tower once
per micro-batch it lands in, not ``G`` times. :func:`grouped_vision_slots` plans one mini-batch's
vision section for that cost model (``bench/pack.py`` measures it against the token-balanced
plan):

0. **The heavy slot.** If 1 to ``dp`` samples cost more than ``HEAVY`` times the level in
   language (causal attention: up to 1.5x near the cap), they set one slot's pace wherever they
   go: they open a slot, one per bin, whose bins take the other samples, largest first, into the
   least-loaded bin with room (``cap``; ``cap - reserve`` without images) below the pace; a new
   image set joins a bin within a tower budget (:mod:`~trainer_lib.planning.heavy_slot`). Steps
   1-4 plan the rest (else everything, without step 0).
1. **Groups, densest vision first.** Text samples above ``BIG_TEXT`` of a bin go first, into the
   last bins (placed after the groups they might fit nowhere). Samples with images are grouped by
   their image set (``groups``); groups are visited by descending vision cost. Each group starts
   in a bin holding no other group and fills bins one after the other up to the language level
   ``lam`` (the section's language cost over its bins), largest samples first: a group lands in
   about ``ceil(L_g / lam)`` bins, and consecutive bins hold groups of similar vision cost.
2. **Level.** What did not fit (a group's remainder) and the text samples, largest first, go to
   the bin with the least language cost that has room (LPT; Graham 1969); a group's remainder
   first to the least loaded bin already holding the group while that stays within the level.
3. **Slots.** Bins are sorted by vision cost and cut into slots of ``dp``, so each slot's ranks
   encode images of similar cost (for sorted values, slots of consecutive bins minimise the sum of
   the slot maxima). Bins well above the level (one sample longer than the level, which nothing
   can balance) share one slot, the one where the first of them ranks by vision (at most ``dp``
   of them; more go first).
4. **Even each slot.** In every slot, the bin with the most language cost gives a sample (or
   swaps one) with another bin of the slot where that adds no image to encode (text samples; a
   group's samples between two bins holding the group), while that lowers the slot's maximum by
   at least ``_EVEN_MIN_GAIN`` of it (at most ``_EVEN_STEPS`` changes).

The text slots, packed by tokens before the vision section (``partition``'s step 1), are
re-dealt by language cost (:func:`even_text_slots`).

Costs are any consistent unit (``CostModel.language`` / ``CostModel.vision`` FLOPs, or tokens and
image tokens). Pure Python.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Hashable, Sequence

from trainer_lib.planning.heavy_slot import heavy_slot
from trainer_lib.planning.items import MiniBatchItems

__all__ = ["BIG_TEXT", "FILL", "HEAVY", "even_text_slots", "grouped_vision_slots"]

HEAVY = 1.05
"""A sample (or bin) whose language cost exceeds the level by this factor sets its slot's pace:
such samples open the heavy slot (step 0), such bins share one slot (step 3)."""
FILL = 0.25
"""Step 1 fills groups up to the level less this share of the text per bin, so that step 2 has
small samples left everywhere to level with (with step 0: 0.15-0.35 gave the same FLOP idle on
``bench/pack.py``'s mix and a shorter step than 0.5, whose groups spread over more bins)."""
BIG_TEXT = 0.4
"""Text samples longer than this share of a bin are placed before the groups (step 1)."""
_EVEN_STEPS = 8
"""Moves or swaps per slot in step 4 (each lowers the slot's maximum; few are needed: 8 and 24 gave
the same FLOP idle on bench/pack.py's mix)."""
_EVEN_MIN_GAIN = 1e-3
"""Step 4's smallest worthwhile change, as a share of the slot's largest language cost."""


class _Bins:
    """The section's bins: language cost, tokens, image groups and samples of each."""

    def __init__(self, nbins: int) -> None:
        self.load = [0.0] * nbins
        self.tokens = [0] * nbins
        self.groups: list[dict[Hashable, int]] = [{} for _ in range(nbins)]
        self.items: list[list[int]] = [[] for _ in range(nbins)]

    def add(self, j: int, i: int, cost: float, size: int, group: Hashable | None) -> None:
        self.load[j] += cost
        self.tokens[j] += size
        self.items[j].append(i)
        if group is not None:
            self.groups[j][group] = self.groups[j].get(group, 0) + 1


def grouped_vision_slots(
    section: Sequence[int], items: MiniBatchItems, num_slots: int
) -> list[list[tuple[int, list[int]]]] | None:
    """``num_slots`` slots of ``items.dp`` ``(tokens, sample indices)`` bins holding ``section``.

    Args:
        section: the section's samples (indices into ``items``).
        items: the mini-batch: tokens per sample; ``image_sets`` (each sample's image set, None
            without images: samples with equal keys show the same images); ``language`` per
            sample; ``vision``, the tower cost of a sample's images (a group's members all carry
            it; a bin costs each of its groups once); ``cap``, the tokens a bin may hold, of which
            a bin without images keeps ``reserve`` free (the synthetic-image pad a micro-batch
            without an image gets in a vision slot).

    Returns:
        The slots (empty bins as ``(0, [])``), or None when the samples do not fit
        ``num_slots * dp`` bins this way (the caller falls back to the token-balanced plan).
    """
    lengths, groups, language, cap = items.lengths, items.image_sets, items.language, items.cap
    nbins = num_slots * items.dp
    if nbins < 1 or sum(lengths[i] for i in section) > nbins * cap:
        return None
    level = sum(language[i] for i in section) / nbins
    heavy = sorted((i for i in section if language[i] > HEAVY * level), key=lambda i: -language[i])
    fits = all(lengths[i] <= (cap if groups[i] is not None else cap - items.reserve) for i in heavy)
    if heavy and len(heavy) <= items.dp and num_slots > 1 and fits:
        slot, taken = heavy_slot(section, heavy, items)
        rest = _vision_slots([i for i in section if i not in taken], num_slots - 1, items)
        if rest is not None:
            return [*rest, slot]
    return _vision_slots(section, num_slots, items)


def _vision_slots(
    section: Sequence[int], num_slots: int, items: MiniBatchItems
) -> list[list[tuple[int, list[int]]]] | None:
    """Steps 1-4: ``num_slots`` slots of ``dp`` bins holding ``section`` (arguments as
    :func:`grouped_vision_slots`), or None where they do not fit."""
    lengths, groups, language, cap, dp = items.lengths, items.image_sets, items.language, items.cap, items.dp
    nbins = num_slots * dp
    if sum(lengths[i] for i in section) > nbins * cap:
        return None
    members: dict[Hashable, list[int]] = {}
    text = []
    for i in section:
        (text if groups[i] is None else members.setdefault(groups[i], [])).append(i)
    level = sum(language[i] for i in section) / nbins
    filler = sum(language[i] for i in text) / nbins  # text per bin: what step 2 levels with
    bins = _Bins(nbins)
    text = _place_big_text(bins, text, items, level)
    left = _fill_groups(bins, members, items, level - FILL * filler)
    if left is None or not _level(bins, left + text, items, level):
        return None
    cost = {g: items.vision[m[0]] for g, m in members.items()}
    order = _slot_order(bins, cost, level, dp)
    slots = [order[s * dp : (s + 1) * dp] for s in range(num_slots)]
    for slot in slots:
        _even(bins, slot, items, cost)
    return [[(bins.tokens[j], sorted(bins.items[j])) for j in slot] for slot in slots]


def even_text_slots(
    slots: list[list[tuple[int, list[int]]]], items: MiniBatchItems
) -> list[list[tuple[int, list[int]]]]:
    """The text slots (packed by tokens, no images) re-dealt by language cost: each slot's samples,
    largest first, to its bin with the least language cost that has room (``items.cap``; LPT, as
    step 2); a slot whose samples do not fit this way is kept as it was."""
    out = []
    for slot in slots:
        bins = _Bins(len(slot))
        todo = [i for _, held in slot for i in held]
        if _level(bins, todo, items, text=True):
            slot = [(bins.tokens[j], sorted(bins.items[j])) for j in range(len(slot))]
        out.append(slot)
    return out


def _place_big_text(bins: _Bins, text: list[int], items: MiniBatchItems, level: float) -> list[int]:
    """Text samples above ``BIG_TEXT`` of the room (``cap - reserve``), largest first, into the last
    bins (up to the level, within the room), before the groups fill the bins from the first: placed
    after the groups they may fit nowhere. Returns the text left for step 2."""
    lengths, language, room = items.lengths, items.language, items.cap - items.reserve
    big = sorted((i for i in text if lengths[i] > BIG_TEXT * room), key=lambda i: -language[i])
    b, placed = len(bins.load) - 1, set()
    for i in big:
        while (
            b >= 0
            and bins.items[b]
            and (bins.tokens[b] + lengths[i] > room or bins.load[b] + language[i] > level)
        ):
            b -= 1
        if b < 0:
            break
        bins.add(b, i, language[i], lengths[i], None)
        placed.add(i)
    return [i for i in text if i not in placed]


def _fill_groups(
    bins: _Bins, members: dict[Hashable, list[int]], items: MiniBatchItems, level: float
) -> list[int] | None:
    """Step 1: each group, densest vision first, from a fresh bin, bin after bin up to ``level``
    (an empty bin takes one sample even above it). Returns the samples left for step 2, or None
    when the groups alone need more bins than there are."""
    lengths, language, vision, cap = items.lengths, items.language, items.vision, items.cap
    nbins, b = len(bins.load), 0
    left: list[int] = []
    for group in sorted(members, key=lambda g: -vision[members[g][0]]):
        todo = sorted(members[group], key=lambda i: -language[i])
        if b < nbins and bins.groups[b]:
            b += 1
        while todo and b < nbins:
            rest = []
            for i in todo:
                if bins.tokens[b] + lengths[i] <= cap and (
                    not bins.items[b] or bins.load[b] + language[i] <= level
                ):
                    bins.add(b, i, language[i], lengths[i], group)
                else:
                    rest.append(i)
            if rest:
                b += 1
            todo = rest
        left += todo
    return left


def _level(
    bins: _Bins, todo: list[int], items: MiniBatchItems, level: float | None = None, *, text: bool = False
) -> bool:
    """Step 2: ``todo`` largest first into the bin with the least language cost that has room
    (``cap``, less ``reserve`` for a sample without images joining a bin without images); with a
    ``level``, a sample whose image set some bins hold joins the least loaded of them that stays
    within it (no new encode). ``text``: the samples are taken as text (no image set, no pad to
    make room for: a text slot). False when one fits nowhere."""
    lengths, language, cap = items.lengths, items.language, items.cap
    groups = [None] * items.n if text else items.image_sets
    reserve = 0 if text else items.reserve
    heap = [(load, j) for j, load in enumerate(bins.load)]
    heapq.heapify(heap)
    holders: dict[Hashable, list[int]] = {}
    for j, held in enumerate(bins.groups):
        for g in held:
            holders.setdefault(g, []).append(j)
    for i in sorted(todo, key=lambda i: -language[i]):
        g, j = groups[i], -1
        if level is not None and g is not None:
            top, most = level - language[i], cap - lengths[i]
            for k in holders.get(g, ()):
                if bins.load[k] <= top and bins.tokens[k] <= most and (j < 0 or bins.load[k] < bins.load[j]):
                    j = k
        skipped = []
        while j < 0 and heap:
            load, k = heapq.heappop(heap)
            if load != bins.load[k]:  # stale: the bin's current entry is in the heap too
                continue
            room = cap if g is not None or bins.groups[k] else cap - reserve
            if bins.tokens[k] + lengths[i] <= room:
                j = k
            else:
                skipped.append((load, k))
        if j < 0:
            return False
        if g is not None and g not in bins.groups[j]:
            holders.setdefault(g, []).append(j)
        bins.add(j, i, language[i], lengths[i], g)
        heapq.heappush(heap, (bins.load[j], j))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return True


def _slot_order(bins: _Bins, cost: dict[Hashable, float], level: float, dp: int) -> list[int]:
    """Step 3: bins by descending vision cost (each group counted once per bin), the bins above
    ``HEAVY * level`` together (most language cost first) at the start of the slot where the first
    of them ranks by vision."""
    vision = [sum(cost[g] for g in held) for held in bins.groups]
    heavy = sorted(
        (j for j, load in enumerate(bins.load) if load > HEAVY * level), key=lambda j: -bins.load[j]
    )
    rest = sorted((j for j in range(len(vision)) if bins.load[j] <= HEAVY * level), key=lambda j: -vision[j])
    if not heavy or len(heavy) > dp:
        return heavy + rest
    top = max(vision[j] for j in heavy)
    at = sum(vision[j] > top for j in rest) // dp * dp
    return rest[:at] + heavy + rest[at:]


def _even(bins: _Bins, slot: list[int], items: MiniBatchItems, cost: dict[Hashable, float]) -> None:
    """Step 4 on one slot: the heaviest bin moves a sample to, or swaps one with, another bin of
    the slot (the partner: one of the two samples around half the gap, by bisection), choosing the
    change that lowers the pair's maximum most, where no bin's vision cost rises above the slot's
    largest (a sample joins a bin holding its images, or one whose tower finishes before the
    slot's slowest anyway) and tokens stay within ``cap`` (less ``reserve`` in a bin left without
    images); until no change helps."""
    lengths, groups, language, cap, reserve = (
        items.lengths,
        items.image_sets,
        items.language,
        items.cap,
        items.reserve,
    )
    load, tokens = bins.load, bins.tokens
    vision = {j: sum(cost[g] for g in bins.groups[j]) for j in slot}
    ceiling = max(vision.values())

    def joins(g: Hashable | None, j: int) -> bool:  # a sample of image set g may join bin j
        return g is None or g in bins.groups[j] or (bool(bins.groups[j]) and vision[j] + cost[g] <= ceiling)

    for _ in range(_EVEN_STEPS):
        hi = max(slot, key=load.__getitem__)
        best = (load[hi] * _EVEN_MIN_GAIN, -1, -1, -1)  # (gain, moved out, moved in or -1, to bin)
        for lo in sorted(slot, key=load.__getitem__):  # the widest gap first
            gap = load[hi] - load[lo]
            if gap <= 2 * best[0]:  # a change gains at most half the gap: so do the bins after
                break
            out = [i for i in bins.items[hi] if language[i] > best[0] and joins(groups[i], lo)]
            if not out:
                continue
            back = sorted((i for i in bins.items[lo] if joins(groups[i], hi)), key=language.__getitem__)
            keys = [language[i] for i in back]
            for a in out:
                p = bisect.bisect_left(keys, language[a] - gap / 2)  # the partners around half the gap
                for b in (-1, *back[max(p - 1, 0) : p + 1]):
                    x = language[a] - (language[b] if b >= 0 else 0.0)
                    gain = min(x, gap - x)
                    if gain <= best[0]:
                        continue
                    size = lengths[a] - (lengths[b] if b >= 0 else 0)
                    held = _holds_image(bins.groups[lo], groups[b] if b >= 0 else None, groups[a])
                    room = cap if held else cap - reserve
                    if tokens[lo] + size <= room and tokens[hi] - size <= cap - reserve:
                        best = (gain, a, b, lo)
        if best[1] < 0:
            return
        _, a, b, lo = best
        _move(bins, a, hi, lo, items)
        if b >= 0:
            _move(bins, b, lo, hi, items)
        for j in (hi, lo):
            vision[j] = sum(cost[g] for g in bins.groups[j])


def _holds_image(held: dict[Hashable, int], leaving: Hashable | None, joining: Hashable | None) -> bool:
    """Whether a bin holding the image sets ``held`` holds an image once a sample of set
    ``leaving`` leaves it and one of set ``joining`` joins it (None: no image, or no sample)."""
    if joining is not None:
        return True
    return bool(held) and not (leaving is not None and len(held) == 1 and held[leaving] == 1)


def _move(bins: _Bins, i: int, src: int, dst: int, items: MiniBatchItems) -> None:
    """Sample ``i`` from bin ``src`` to bin ``dst``, costs and group counts kept."""
    lengths, language = items.lengths, items.language
    bins.items[src].remove(i)
    bins.load[src] -= language[i]
    bins.tokens[src] -= lengths[i]
    g = items.image_sets[i]
    if g is not None:
        bins.groups[src][g] -= 1
        if not bins.groups[src][g]:
            del bins.groups[src][g]
    bins.add(dst, i, language[i], lengths[i], g)
