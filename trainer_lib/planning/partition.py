"""Balanced data-parallel micro-batches: every rank, the same slots, the same work (docs/PACKING.md §3).

:func:`partition_mini_batch` takes one mini-batch's
:class:`~trainer_lib.planning.items.MiniBatchItems` (sample lengths with their isolation keys, bin
kinds, costs and image sets) and returns, for every data-parallel rank, the sample indices of each
of its ``M`` micro-batches. ``M`` is the same on every rank, and micro-batch ``k`` ("slot ``k``")
holds nearly the same tokens on every rank: with FSDP every slot is synchronous (parameters are
gathered layer by layer), so the slowest rank of a slot sets its pace. The algorithm:

0. **Long slots.** Samples above the cap run alone; per side (with images, without) they are
   grouped largest first, ``dp`` to a slot, and the slot's other bins are filled by LPT up to the
   cap (``stretch_cap``: up to the slot's longest sample).
1. **Sections.** With images, a slot runs the vision tower on every rank or on none. Samples with
   pixels go to *vision* slots; stray-placeholder text, and text within ``reserve`` tokens of the
   cap (no room for an image pad), to *text* slots, topped up with plain text (LPT, up to the
   expected fill, or in one text slot up to its longest sample, which sets its pace). Other text
   joins the vision slots, whose bins keep ``reserve`` tokens free for the synthetic-image pad a
   bin without images gets there.
2. **Head.** A section is packed first-fit-decreasing (:func:`~trainer_lib.planning.bins.plan_bins`; in
   step 4's second pass, by minimum bin slack). Every bin but the last of its key holds more than
   ``cap - largest sample`` tokens; whole slots of these full bins form the head, grouped by
   descending vision cost.
3. **Tail.** The other bins' samples are re-dealt to ``dp`` bins per remaining slot by LPT
   (:func:`~trainer_lib.planning.bins.lpt_bins`); if that overflows a bin, the packer's are kept. A
   tail sample larger than the tail's mean bin first trades its bin for the head bin of the smallest
   samples.
4. **Fewer slots.** While the plan has more slots than the bound
   (:func:`~trainer_lib.planning.slot_bound.min_micro_batches`), its lightest slot is emptied into the
   others (best fit, else one trade between two bins that makes room: Fleszar & Hindi 2002's
   exchange moves), or the plan is kept. No bin loses tokens. If the plan
   is still above the bound, steps 2-4 run again with minimum bin slack for FFD
   (:func:`~trainer_lib.planning.repack.min_slack_bins`), kept if it has fewer slots.
5. **Deal.** Slot by slot, the bin with the most tokens goes to the rank with the fewest so far.
   Before it, with ``refine`` (``plan_step``'s default), the slots' samples are searched for a
   shorter predicted step (:mod:`~trainer_lib.planning.refine`; every rule kept, (G2) not promised).

Guarantees (proofs in docs/PACKING.md §3): (G1) rank token totals differ by at most the largest
token spread inside one slot; (G2) with one isolation key, no image, no sample above the cap and a
last slot of at most ``dp * (cap - largest sample)`` tokens, every slot's spread, hence the ranks',
is at most the largest sample. verl balances whole-rank token totals with Karmarkar-Karp and packs
each rank's share afterwards (``verl/utils/seqlen_balancing.py``: ``get_seqlen_balanced_partitions``,
``rearrange_micro_batches``); here the slots, the points every rank waits at, are balanced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter

from trainer_lib.planning.bins import PIXELS, STRAY, TopUp, lpt_bins, plan_bins
from trainer_lib.planning.grouped import even_text_slots, grouped_vision_slots
from trainer_lib.planning.items import EITHER, TEXT, VISION, MiniBatchItems
from trainer_lib.planning.refine import Refinement, refine_plan
from trainer_lib.planning.repack import best_fit_with_exchange, min_slack_bins
from trainer_lib.planning.slot_bound import slot_floor, slots_needed

__all__ = ["DpPartition", "partition_mini_batch"]

_Bins = list[tuple[int, list[int]]]
"""``(tokens, sample indices)`` bins; a slot is ``dp`` of them (an empty bin: ``(0, [])``)."""


@dataclass(frozen=True)
class DpPartition:
    """Dealt mini-batch: ``ranks[r][k]`` = sorted sample indices of rank ``r``'s slot ``k``.

    Every rank has the same slot count; an empty list is a slot that rank fills with a pad
    micro-batch. ``slot_has_pixels[k]``: slot ``k`` runs the vision tower on every rank, so a bin
    there without images gets a synthetic-image pad (vision-section bins keep ``reserve`` tokens
    free).
    """

    ranks: list[list[list[int]]]
    slot_has_pixels: list[bool]
    tokens: list[list[int]]
    """``[rank][slot]`` tokens of the samples (pads not included)."""

    @property
    def num_micro_batches(self) -> int:
        return len(self.slot_has_pixels)

    @property
    def rank_tokens(self) -> list[int]:
        return [sum(row) for row in self.tokens]


def partition_mini_batch(items: MiniBatchItems, refine: Refinement | None = None) -> DpPartition:
    """Deal one mini-batch's samples to ``items.dp`` ranks as equal-count, equal-work micro-batches.

    With ``items.groups`` (each sample's image set; the trainer encodes each distinct image once
    per micro-batch), images and one isolation key, the vision slots are planned by compute
    (:func:`~trainer_lib.planning.grouped.grouped_vision_slots`: samples sharing an image kept
    together, language cost levelled per slot, slots of similar vision cost) in the slots the
    bound leaves after the long and text slots, and the text slots are re-dealt by language cost;
    otherwise, or where that does not fit, by tokens (steps 0-5 above).

    Args:
        items: the mini-batch's samples (lengths, keys, kinds, costs, image sets) and its cap,
            reserve, rank count and ``stretch`` rule, checked when built
            (:class:`~trainer_lib.planning.items.MiniBatchItems`).
        refine: with ``items.groups`` and one isolation key, search the plan's samples for a
            shorter predicted step (:func:`~trainer_lib.planning.refine.refine_slots`).

    Returns:
        A :class:`DpPartition` in which every sample index appears exactly once.
    """
    if items.dp == 1:  # nothing to align: first-fit-decreasing is the plan (groups kept together)
        bins = plan_bins(items.lengths, items.cap, keys=items.keys, kinds=items.kinds, groups=items.groups)
        slots = [[(sum(items.lengths[i] for i in b), b)] for b in bins]
        return _deal(slots, items)
    if PIXELS not in items.kinds:  # no vision slots: no side to keep, no pad to make room for
        long_slots, section = _long_slots(items)
        text_slots, room = [], items.cap
    else:
        long_slots, rest = _long_slots(items)
        text_slots, free = _text_slots(items, rest)
        section, room = [i for i in rest if items.place[i] == VISION] + free, items.cap - items.reserve
        if items.groups is not None and items.one_key:
            if vision_slots := _by_compute(items, section, len(long_slots) + len(text_slots)):
                slots = long_slots + vision_slots + even_text_slots(text_slots, items)
                return _deal(refine_plan(items, slots, refine), items)
    slots = _planned(items, lambda pack: long_slots + _section(items, section, room, pack) + text_slots)
    return _deal(refine_plan(items, slots, refine), items)


def _by_compute(items: MiniBatchItems, section: list[int], other_slots: int) -> list[_Bins] | None:
    """The vision section's slots by compute
    (:func:`~trainer_lib.planning.grouped.grouped_vision_slots`) in what the bound leaves after
    ``other_slots`` (step 0's long slots, step 1's text slots); None where they do not fit."""
    return grouped_vision_slots(section, items, slot_floor(items, range(items.n)) - other_slots)


def _planned(items: MiniBatchItems, build: Callable[[Callable], list[_Bins]]) -> list[_Bins]:
    """Steps 2-4 on ``build(pack)``'s slots (a section packed by ``pack``): with first-fit-decreasing,
    then, if step 4 leaves more slots than the bound (:func:`~trainer_lib.planning.slot_bound.slot_floor`),
    with minimum bin slack."""
    floor = slot_floor(items, range(items.n))
    slots = _drop_slots(items, build(plan_bins), floor)
    if len(slots) > floor:
        tight = _drop_slots(items, build(min_slack_bins), floor)
        if len(tight) < len(slots):
            return tight
    return slots


def _text_slots(items: MiniBatchItems, section: list[int]) -> tuple[list[_Bins], list[int]]:
    """Step 1's text slots: the samples that must not meet the vision tower, LPT into the fewest
    slots that hold them, topped up with plain text up to the mini-batch's expected fill, or, in
    one text slot, up to its longest sample if that is more: that sample sets the slot's pace, and
    a bin of at most its tokens costs at most as much (``sum n_i**2 <= (sum n_i)**2``), so the room
    takes language the vision slots then need not hold. Returns the slots and the plain text left
    for the vision slots."""
    lengths, keys, cap, dp = items.lengths, items.keys, items.cap, items.dp
    text = [i for i in section if items.place[i] == TEXT]
    free = [i for i in section if items.place[i] == EITHER]
    if not text:
        return [], free
    target = min(cap, sum(lengths[i] for i in section) / (dp * max(slot_floor(items, section), 1)))
    x = slots_needed(items, text, cap)
    if x == 1:
        target = min(cap, max(target, max(lengths[i] for i in text)))
    while (dealt := lpt_bins(text, lengths, keys, x * dp, cap, TopUp(free, target))) is None:
        x += 1
    bins, free = dealt
    return _slots(_sized(bins, lengths), [], x, dp), free


def _long_slots(items: MiniBatchItems) -> tuple[list[_Bins], list[int]]:
    """Slots for the samples above the cap (they run alone): per side (with pixels, without),
    largest first, ``dp`` to a slot; the slot's other bins are filled by LPT up to the cap
    (``stretch``: up to the slot's longest sample), less ``reserve`` on the vision side. Returns
    the slots and the samples left for the sections."""
    lengths, keys, kinds, place, cap, dp, n = (
        items.lengths,
        items.keys,
        items.kinds,
        items.place,
        items.cap,
        items.dp,
        items.n,
    )
    over_all = [i for i in range(n) if lengths[i] > cap]
    if not over_all:
        return [], list(range(n))
    length = lengths.__getitem__
    used: set[int] = set()
    slots = []
    for pixels in (True, False):
        over = sorted((i for i in over_all if (kinds[i] == PIXELS) == pixels), key=length, reverse=True)
        if not over:
            continue
        ok = (VISION, EITHER) if pixels else (TEXT, EITHER)
        pool = [
            i
            for i in range(n)
            if lengths[i] <= cap and place[i] in ok and not (pixels and kinds[i] == STRAY) and i not in used
        ]
        for c in range(0, len(over), dp):
            group = over[c : c + dp]
            room = (lengths[group[0]] if items.stretch else cap) - (items.reserve if pixels else 0)
            # a bin closes past the cap: two long samples never share one (stretched: past the
            # slot's longest sample, which they may share, as the slot's other bins do)
            limit = max(room, lengths[group[0]]) if items.stretch else room
            dealt = lpt_bins(group, lengths, keys, dp, limit, TopUp(pool, room))
            if dealt is None:
                return slots, [i for i in range(n) if i not in used]
            bins, pool = dealt
            slots.append(_sized(bins, lengths) + [(0, [])] * (dp - len(bins)))
            used.update(i for b in bins for i in b)
    return slots, [i for i in range(n) if i not in used]


def _sized(bins: list[list[int]], lengths: Sequence[int]) -> _Bins:
    """``(tokens, bin)`` pairs, most tokens first."""
    length = lengths.__getitem__
    return sorted(((sum(map(length, b)), b) for b in bins), key=itemgetter(0), reverse=True)


def _slots(head: _Bins, tail: _Bins, num_slots: int, dp: int) -> list[_Bins]:
    """``head + tail`` padded with empty bins and cut into ``num_slots`` slots of ``dp``."""
    ordered = head + tail + [(0, [])] * (num_slots * dp - len(head) - len(tail))
    return [ordered[s * dp : (s + 1) * dp] for s in range(num_slots)]


def _section(items: MiniBatchItems, section: list[int], cap: int, pack: Callable = plan_bins) -> list[_Bins]:
    """Slots of ``dp`` ``(tokens, bin)`` pairs (empty bins included) holding ``section``, each bin at
    most ``cap`` tokens unless it is one longer sample: head of ``pack``'s full bins
    (:func:`~trainer_lib.planning.bins.plan_bins` or
    :func:`~trainer_lib.planning.repack.min_slack_bins`; a section never holds both ``PIXELS`` and
    ``STRAY``), LPT tail."""
    if not section:
        return []
    lengths, keys, dp = items.lengths, items.keys, items.dp
    packed = pack(
        [lengths[i] for i in section], cap, keys=None if items.one_key else [keys[i] for i in section]
    )
    bins = [[section[j] for j in b] for b in packed]
    last = {keys[b[0]]: j for j, b in enumerate(bins)}  # bins by key, then by creation
    full = _sized([b for j, b in enumerate(bins) if last[keys[b[0]]] != j], lengths)
    num_slots = -(-len(bins) // dp)
    head_slots = min(len(full) // dp, num_slots)
    head = full[: head_slots * dp]
    tail = _sized([*(b for _, b in full[head_slots * dp :]), *(bins[j] for j in last.values())], lengths)
    largest = max(map(lengths.__getitem__, section))
    if largest > cap:  # a sample above the cap runs alone: the largest one that shares counts
        largest = max((lengths[i] for i in section if lengths[i] <= cap), default=0)
    _swap_big_samples_out(head, tail, (num_slots - head_slots) * dp, cap - largest, lengths)
    if tail and (
        dealt := lpt_bins([i for _, b in tail for i in b], lengths, keys, (num_slots - head_slots) * dp, cap)
    ):
        tail = _sized(dealt[0], lengths)
    cost = items.vision.__getitem__
    head.sort(key=lambda x: (-max(x[0] - cap, 0), -sum(map(cost, x[1]))))  # oversized bins first
    return _slots(head, tail, num_slots, dp)


def _swap_big_samples_out(head: _Bins, tail: _Bins, nbins: int, full: int, lengths: Sequence[int]) -> None:
    """While the tail's largest sample exceeds its mean bin (LPT could not balance around it), swap
    that sample's bin into the head for the head bin of the smallest samples. Head bins stay above
    ``full`` tokens."""
    biggest = [max(map(lengths.__getitem__, b)) for _, b in head]
    for _ in range(len(tail)):
        j, big = max(
            ((j, max(map(lengths.__getitem__, b))) for j, (_, b) in enumerate(tail) if b),
            key=lambda x: x[1],
            default=(0, 0),
        )
        if not head or big * nbins <= sum(load for load, _ in tail) or tail[j][0] <= full:
            return
        k = min(range(len(head)), key=biggest.__getitem__)
        if biggest[k] >= big:
            return
        head[k], tail[j], biggest[k] = tail[j], head[k], big


def _drop_slots(items: MiniBatchItems, slots: list[_Bins], floor: int) -> list[_Bins]:
    """Step 4: while the plan has more slots than ``floor`` (the bound), empty its lightest slot
    into the others by :func:`_relocate`, or keep the slots as they are. A sample goes only to
    a slot of its side (pixels: vision slots; stray or near-cap text: text slots; plain text:
    either), and a bin holds at most its limit (:func:`_limit`), so every rule holds; bins only
    gain tokens, so full bins stay full."""
    slots = [slot for slot in slots if any(b for _, b in slot)]
    dp = items.dp
    pix = {i for i, k in enumerate(items.kinds) if k == PIXELS}
    while len(slots) > floor:
        v = min(range(len(slots)), key=lambda s: sum(load for load, _ in slots[s]))
        bins = [
            [load, list(b), _limit(items, slot, vision), vision]
            for s, slot in enumerate(slots)
            if s != v
            for vision in [any(not pix.isdisjoint(b) for _, b in slot)]
            for load, b in slot
        ]
        if not _relocate(items, [i for _, b in slots[v] for i in b], bins):
            break
        slots = [[(c[0], c[1]) for c in bins[s * dp : (s + 1) * dp]] for s in range(len(slots) - 1)]
    return slots


def _limit(items: MiniBatchItems, slot: _Bins, vision: bool) -> int:
    """Tokens a bin of ``slot`` may hold: ``cap`` (``stretch``: at least the slot's longest sample,
    as :func:`_long_slots` filled it), less ``reserve`` in a vision slot."""
    longest = max((items.lengths[i] for _, b in slot for i in b), default=0) if items.stretch else 0
    return max(items.cap, longest) - (items.reserve if vision else 0)


def _relocate(items: MiniBatchItems, todo: list[int], bins: list[list]) -> bool:
    """:func:`~trainer_lib.planning.repack.best_fit_with_exchange` where a sample may go only where its key
    and its side (``place``: vision, text or either) allow."""

    keys, place = items.keys, items.place

    def fits(i: int, c: list) -> bool:
        return (not c[1] or keys[c[1][0]] == keys[i]) and (place[i] == EITHER or (place[i] == VISION) == c[3])

    return best_fit_with_exchange(todo, bins, items.lengths, fits)


def _deal(slots: list[_Bins], items: MiniBatchItems) -> DpPartition:
    """Slot by slot, the bin with the most tokens to the rank with the fewest so far (ties: lower
    rank); slots of empty bins only (LPT may leave bins unused) are dropped."""
    slots, dp = [slot for slot in slots if any(b for _, b in slot)], items.dp
    ranks: list[list[list[int]]] = [[] for _ in range(dp)]
    tokens: list[list[int]] = [[] for _ in range(dp)]
    total = [0] * dp
    for slot in slots:
        order = sorted(range(dp), key=total.__getitem__)  # stable: ties to the lower rank
        for (load, b), r in zip(sorted(slot, key=itemgetter(0), reverse=True), order, strict=True):
            ranks[r].append(sorted(b))
            tokens[r].append(load)
            total[r] += load
    pix = {i for i, k in enumerate(items.kinds) if k == PIXELS}
    pixels = [any(not pix.isdisjoint(b) for _, b in slot) for slot in slots]
    return DpPartition(ranks=ranks, slot_has_pixels=pixels, tokens=tokens)
