"""Balanced data-parallel micro-batches: every rank, the same slots, the same work (docs/PACKING.md §3).

:func:`partition_mini_batch` takes one mini-batch's sample lengths (with their isolation keys, bin
kinds and vision-tower costs) and returns, for every data-parallel rank, the sample indices of each
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
   Before it, with ``refine`` (opt-in), the slots' samples are searched for a shorter predicted
   step (:mod:`~trainer_lib.planning.refine`; every rule kept, (G2) not promised).

Guarantees (proofs in docs/PACKING.md §3): (G1) rank token totals differ by at most the largest
token spread inside one slot; (G2) with one isolation key, no image, no sample above the cap and a
last slot of at most ``dp * (cap - largest sample)`` tokens, every slot's spread, hence the ranks',
is at most the largest sample. verl balances whole-rank token totals with Karmarkar-Karp and packs
each rank's share afterwards (``verl/utils/seqlen_balancing.py``: ``get_seqlen_balanced_partitions``,
``rearrange_micro_batches``); here the slots, the points every rank waits at, are balanced.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from operator import itemgetter

from trainer_lib.planning.bins import NEUTRAL, PIXELS, STRAY, lpt_bins, plan_bins
from trainer_lib.planning.grouped import even_text_slots, grouped_vision_slots
from trainer_lib.planning.refine import Refinement, refine_plan
from trainer_lib.planning.repack import best_fit_with_exchange, min_slack_bins
from trainer_lib.planning.slot_bound import EITHER, TEXT, VISION, SlotRules, places, slot_floor, slots_needed

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


def partition_mini_batch(
    lengths: Sequence[int],
    *,
    dp_size: int,
    cap: int,
    keys: Sequence[Hashable] | None = None,
    kinds: Sequence[int] | None = None,
    vision_cost: Sequence[float] | None = None,
    reserve: int = 0,
    stretch_cap: bool = False,
    groups: Sequence[Hashable | None] | None = None,
    language_cost: Sequence[float] | None = None,
    refine: Refinement | None = None,
) -> DpPartition:
    """Deal one mini-batch's samples to ``dp_size`` ranks as equal-count, equal-work micro-batches.

    With ``groups`` (each sample's image set; the trainer encodes each distinct image once per
    micro-batch), images and one isolation key, the vision slots are planned by compute
    (:func:`~trainer_lib.planning.grouped.grouped_vision_slots`: samples sharing an image kept
    together, language cost levelled per slot, slots of similar vision cost) in the slots the
    bound leaves after the long and text slots, and the text slots are re-dealt by language cost;
    otherwise, or where that does not fit, by tokens (steps 0-5 above).

    Args:
        lengths: tokens per sample (``len(input_ids)``), each >= 1.
        dp_size: data-parallel ranks.
        cap: micro-batch token cap (``micro_batch_max_tokens``); a longer sample runs alone.
        keys: isolation key per sample (``(run_id, lora_id)``); keys never share a micro-batch.
        kinds: :data:`~trainer_lib.planning.bins.NEUTRAL`, ``PIXELS`` or ``STRAY`` per sample.
        vision_cost: vision-tower work per sample, any unit (``CostModel.vision`` of its images'
            placeholder counts); groups the vision slots. Default: all equal.
        reserve: tokens a vision-slot bin keeps free for a synthetic-image pad (``[pad] +
            placeholders + [pad]`` of the smallest grid: 6 for Qwen2-VL).
        stretch_cap: group the samples above the cap into slots of their own first and fill the
            other bins of such a slot up to its longest sample instead of the cap (no bin then
            exceeds the longest sample of the mini-batch).
        groups: per sample, a hashable key of its image set (equal keys: the same images), None
            without images; default: no grouping (every slot planned by tokens).
        language_cost: per sample, its language-model cost (``CostModel.language``); default its
            tokens. Used with ``groups``.
        refine: with ``groups`` and one isolation key, search the plan's samples for a shorter
            predicted step (:func:`~trainer_lib.planning.refine.refine_slots`: slower, opt-in).

    Returns:
        A :class:`DpPartition` in which every sample index appears exactly once.

    Raises:
        ValueError: ``dp_size`` or ``cap`` below 1, ``reserve`` outside ``[0, cap)``, a length
            below 1, an unknown kind, or a per-sample list of another length.
    """
    n = len(lengths)
    keys = [None] * n if keys is None else keys
    kinds = [NEUTRAL] * n if kinds is None else kinds
    weight = [0.0] * n if vision_cost is None else vision_cost
    if dp_size < 1 or cap < 1 or not 0 <= reserve < cap:
        raise ValueError(f"need dp_size, cap >= 1 and 0 <= reserve < cap; got {dp_size}, {cap}, {reserve}")
    if not len(keys) == len(kinds) == len(weight) == n or len(groups or [0] * n) != n:
        raise ValueError(f"{n} lengths but {len(keys)} keys, {len(kinds)} kinds, {len(weight)} vision costs")
    if (n and min(lengths) < 1) or not set(kinds) <= {NEUTRAL, PIXELS, STRAY}:
        raise ValueError("every length must be >= 1 and every kind NEUTRAL, PIXELS or STRAY")
    language = lengths if language_cost is None else language_cost
    if dp_size == 1:  # nothing to align: first-fit-decreasing is the plan (groups kept together)
        bins = plan_bins(lengths, cap, keys=keys, kinds=kinds, groups=groups)
        slots = [[(sum(lengths[i] for i in b), b)] for b in bins]
        return _deal(slots, kinds, 1)
    if PIXELS not in kinds:  # no vision slots: no side to keep, no pad to make room for
        mb = SlotRules(lengths, keys, kinds, [EITHER] * n, cap, 0, dp_size, stretch_cap)
        long_slots, section = _long_slots(mb)
        text_slots, room = [], cap
    else:
        where = places(lengths, kinds, cap, reserve)
        mb = SlotRules(lengths, keys, kinds, where, cap, reserve, dp_size, stretch_cap)
        long_slots, rest = _long_slots(mb)
        text_slots, free = _text_slots(mb, rest)
        section, room = [i for i in rest if mb.place[i] == VISION] + free, cap - reserve
        if groups is not None and mb.one_key:
            if vision_slots := _by_compute(
                mb, section, len(long_slots) + len(text_slots), groups, language, weight
            ):
                text_slots = even_text_slots(text_slots, lengths=lengths, language=language, cap=cap)
                slots = long_slots + vision_slots + text_slots
                return _deal(refine_plan(mb, slots, refine, groups, language, weight), kinds, dp_size)
    slots = _planned(mb, lambda pack: long_slots + _section(mb, section, room, weight, pack) + text_slots)
    return _deal(refine_plan(mb, slots, refine, groups, language, weight), kinds, dp_size)


def _by_compute(
    mb: SlotRules,
    section: list[int],
    other_slots: int,
    groups: Sequence[Hashable | None],
    language: Sequence[float],
    vision: Sequence[float],
) -> list[_Bins] | None:
    """The vision section's slots by compute
    (:func:`~trainer_lib.planning.grouped.grouped_vision_slots`) in what the bound leaves after
    ``other_slots`` (step 0's long slots, step 1's text slots); None where they do not fit."""
    return grouped_vision_slots(
        section,
        lengths=mb.lengths,
        groups=[g if mb.place[i] == VISION else None for i, g in enumerate(groups)],
        language=language,
        vision=vision,
        num_slots=slot_floor(mb, range(mb.n)) - other_slots,
        dp=mb.dp,
        cap=mb.cap,
        reserve=mb.reserve,
    )


def _planned(mb: SlotRules, build: Callable[[Callable], list[_Bins]]) -> list[_Bins]:
    """Steps 2-4 on ``build(pack)``'s slots (a section packed by ``pack``): with first-fit-decreasing,
    then, if step 4 leaves more slots than the bound (:func:`~trainer_lib.planning.slot_bound.slot_floor`),
    with minimum bin slack."""
    floor = slot_floor(mb, range(mb.n))
    slots = _drop_slots(mb, build(plan_bins), floor)
    if len(slots) > floor:
        tight = _drop_slots(mb, build(min_slack_bins), floor)
        if len(tight) < len(slots):
            return tight
    return slots


def _text_slots(mb: SlotRules, items: list[int]) -> tuple[list[_Bins], list[int]]:
    """Step 1's text slots: the samples that must not meet the vision tower, LPT into the fewest
    slots that hold them, topped up with plain text up to the mini-batch's expected fill, or, in
    one text slot, up to its longest sample if that is more: that sample sets the slot's pace, and
    a bin of at most its tokens costs at most as much (``sum n_i**2 <= (sum n_i)**2``), so the room
    takes language the vision slots then need not hold. Returns the slots and the plain text left
    for the vision slots."""
    lengths, keys, cap, dp = mb.lengths, mb.keys, mb.cap, mb.dp
    text = [i for i in items if mb.place[i] == TEXT]
    free = [i for i in items if mb.place[i] == EITHER]
    if not text:
        return [], free
    target = min(cap, sum(lengths[i] for i in items) / (dp * max(slot_floor(mb, items), 1)))
    x = slots_needed(mb, text, cap)
    if x == 1:
        target = min(cap, max(target, max(lengths[i] for i in text)))
    while (dealt := lpt_bins(text, lengths, keys, x * dp, cap, free, target)) is None:
        x += 1
    bins, free = dealt
    return _slots(_sized(bins, lengths), [], x, dp), free


def _long_slots(mb: SlotRules) -> tuple[list[_Bins], list[int]]:
    """Slots for the samples above the cap (they run alone): per side (with pixels, without),
    largest first, ``dp`` to a slot; the slot's other bins are filled by LPT up to the cap
    (``stretch``: up to the slot's longest sample), less ``reserve`` on the vision side. Returns
    the slots and the samples left for the sections."""
    lengths, keys, kinds, place, cap, dp, n = mb.lengths, mb.keys, mb.kinds, mb.place, mb.cap, mb.dp, mb.n
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
            room = (lengths[group[0]] if mb.stretch else cap) - (mb.reserve if pixels else 0)
            # a bin closes past the cap: two long samples never share one (stretched: past the
            # slot's longest sample, which they may share, as the slot's other bins do)
            limit = max(room, lengths[group[0]]) if mb.stretch else room
            dealt = lpt_bins(group, lengths, keys, dp, limit, pool, room)
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


def _section(
    mb: SlotRules, items: list[int], cap: int, weight: Sequence[float], pack: Callable = plan_bins
) -> list[_Bins]:
    """Slots of ``dp`` ``(tokens, bin)`` pairs (empty bins included) holding ``items``, each bin at
    most ``cap`` tokens unless it is one longer sample: head of ``pack``'s full bins
    (:func:`~trainer_lib.planning.bins.plan_bins` or
    :func:`~trainer_lib.planning.repack.min_slack_bins`; a section never holds both ``PIXELS`` and
    ``STRAY``), LPT tail."""
    if not items:
        return []
    lengths, keys, dp = mb.lengths, mb.keys, mb.dp
    packed = pack([lengths[i] for i in items], cap, keys=None if mb.one_key else [keys[i] for i in items])
    bins = [[items[j] for j in b] for b in packed]
    last = {keys[b[0]]: j for j, b in enumerate(bins)}  # bins by key, then by creation
    full = _sized([b for j, b in enumerate(bins) if last[keys[b[0]]] != j], lengths)
    num_slots = -(-len(bins) // dp)
    head_slots = min(len(full) // dp, num_slots)
    head = full[: head_slots * dp]
    tail = _sized([*(b for _, b in full[head_slots * dp :]), *(bins[j] for j in last.values())], lengths)
    largest = max(map(lengths.__getitem__, items))
    if largest > cap:  # a sample above the cap runs alone: the largest one that shares counts
        largest = max((lengths[i] for i in items if lengths[i] <= cap), default=0)
    _swap_big_samples_out(head, tail, (num_slots - head_slots) * dp, cap - largest, lengths)
    if tail and (
        dealt := lpt_bins([i for _, b in tail for i in b], lengths, keys, (num_slots - head_slots) * dp, cap)
    ):
        tail = _sized(dealt[0], lengths)
    cost = weight.__getitem__
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


def _drop_slots(mb: SlotRules, slots: list[_Bins], floor: int) -> list[_Bins]:
    """Step 4: while the plan has more slots than ``floor`` (the bound), empty its lightest slot
    into the others by :func:`_relocate`, or keep the slots as they are. A sample goes only to
    a slot of its side (pixels: vision slots; stray or near-cap text: text slots; plain text:
    either), and a bin holds at most its limit (:func:`_limit`), so every rule holds; bins only
    gain tokens, so full bins stay full."""
    slots = [slot for slot in slots if any(b for _, b in slot)]
    dp = mb.dp
    pix = {i for i, k in enumerate(mb.kinds) if k == PIXELS}
    while len(slots) > floor:
        v = min(range(len(slots)), key=lambda s: sum(load for load, _ in slots[s]))
        bins = [
            [load, list(b), _limit(mb, slot, vision), vision]
            for s, slot in enumerate(slots)
            if s != v
            for vision in [any(not pix.isdisjoint(b) for _, b in slot)]
            for load, b in slot
        ]
        if not _relocate(mb, [i for _, b in slots[v] for i in b], bins):
            break
        slots = [[(c[0], c[1]) for c in bins[s * dp : (s + 1) * dp]] for s in range(len(slots) - 1)]
    return slots


def _limit(mb: SlotRules, slot: _Bins, vision: bool) -> int:
    """Tokens a bin of ``slot`` may hold: ``cap`` (``stretch``: at least the slot's longest sample,
    as :func:`_long_slots` filled it), less ``reserve`` in a vision slot."""
    longest = max((mb.lengths[i] for _, b in slot for i in b), default=0) if mb.stretch else 0
    return max(mb.cap, longest) - (mb.reserve if vision else 0)


def _relocate(mb: SlotRules, items: list[int], bins: list[list]) -> bool:
    """:func:`~trainer_lib.planning.repack.best_fit_with_exchange` where a sample may go only where its key
    and its side (``place``: vision, text or either) allow."""

    keys, place = mb.keys, mb.place

    def fits(i: int, c: list) -> bool:
        return (not c[1] or keys[c[1][0]] == keys[i]) and (place[i] == EITHER or (place[i] == VISION) == c[3])

    return best_fit_with_exchange(items, bins, mb.lengths, fits)


def _deal(slots: list[_Bins], kinds: Sequence[int], dp: int) -> DpPartition:
    """Slot by slot, the bin with the most tokens to the rank with the fewest so far (ties: lower
    rank); slots of empty bins only (LPT may leave bins unused) are dropped."""
    slots = [slot for slot in slots if any(b for _, b in slot)]
    ranks: list[list[list[int]]] = [[] for _ in range(dp)]
    tokens: list[list[int]] = [[] for _ in range(dp)]
    total = [0] * dp
    for slot in slots:
        order = sorted(range(dp), key=total.__getitem__)  # stable: ties to the lower rank
        for (load, b), r in zip(sorted(slot, key=itemgetter(0), reverse=True), order, strict=True):
            ranks[r].append(sorted(b))
            tokens[r].append(load)
            total[r] += load
    pix = {i for i, k in enumerate(kinds) if k == PIXELS}
    pixels = [any(not pix.isdisjoint(b) for _, b in slot) for slot in slots]
    return DpPartition(ranks=ranks, slot_has_pixels=pixels, tokens=tokens)
