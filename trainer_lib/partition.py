"""Balanced data-parallel micro-batches: every rank gets the same slots with the same work (docs/BALANCE.md).

:func:`partition_mini_batch` takes one mini-batch's sample lengths (with their isolation keys, bin
kinds and vision-tower costs) and returns, for every data-parallel rank, the sample indices of each
of its ``M`` micro-batches. ``M`` is the same on every rank, and micro-batch ``k`` ("slot ``k``")
holds nearly the same tokens on every rank: with FSDP every slot is synchronous (parameters are
gathered layer by layer), so the slowest rank of a slot sets its pace. The algorithm:

1. **Sections.** With images, a slot runs the vision tower on every rank or on none. Samples with
   pixels go to *vision* slots; stray-placeholder text, and text within ``reserve`` tokens of the
   cap (no room for an image pad), to *text* slots, topped up with plain text (LPT, up to the
   expected fill). Other text joins the vision slots, whose bins keep ``reserve`` tokens free for
   the multimodal pad a bin without images gets there.
2. **Head.** A section is packed first-fit-decreasing (:func:`trainer_lib.packing.plan_bins`:
   isolation keys and kinds respected). Every FFD bin but the last of its key holds more than
   ``cap - largest sample`` tokens; whole slots of these full bins form the head, grouped by
   descending vision cost so that the vision tower's work is balanced inside each slot too.
3. **Tail.** The other bins' samples are re-dealt, largest first, to the least-loaded of ``dp``
   bins per remaining slot (LPT, Graham 1969), per key; if that overflows a bin, FFD's are kept.
   A tail sample larger than the tail's mean bin first trades its bin for the head bin of the
   smallest samples (LPT cannot balance around it).
4. **Deal.** Slot by slot, the bin with the most tokens goes to the rank with the fewest so far.

Guarantee (proof in docs/BALANCE.md): rank token totals differ by at most the largest token spread
inside one slot. With one isolation key, no sample above the cap and a last slot holding at most
``dp * (cap - largest sample)`` tokens, every slot's spread, hence the ranks' spread, is at most
the largest sample. verl balances whole-rank token totals with Karmarkar-Karp and packs each rank's
share afterwards (``verl/utils/seqlen_balancing.py``: ``get_seqlen_balanced_partitions``,
``rearrange_micro_batches``); here the slots, the points every rank waits at, are balanced.
Pure Python on top of the existing packer; no torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from trainer_lib.packing import NEUTRAL, PIXELS, STRAY, plan_bins

__all__ = ["CostModel", "DpPartition", "min_micro_batches", "partition_mini_batch", "sync_idle"]

_VISION, _TEXT, _EITHER = 0, 1, 2
"""Where a sample may go: vision slots only (pixels), text slots only, either (plain text)."""


@dataclass(frozen=True)
class CostModel:
    """Forward FLOPs of one sample; backward is ~2x forward for every term, so ratios hold.

    language model: ``llm_per_token * n + llm_per_token_sq * n**2`` for an ``n``-token sample
    (linear layers + LM head; causal attention); vision tower, per image of ``v`` placeholder
    tokens: ``vision_per_token * v + vision_per_token_sq * v**2`` (linear layers; full attention
    over the image's patches). Units: FLOPs (multiply-add = 2).
    """

    llm_per_token: float
    llm_per_token_sq: float
    vision_per_token: float = 0.0
    vision_per_token_sq: float = 0.0

    def language(self, num_tokens: int) -> float:
        """FLOPs of the language model (and LM head) for one ``num_tokens``-token sample."""
        return self.llm_per_token * num_tokens + self.llm_per_token_sq * num_tokens**2

    def vision(self, image_tokens: Sequence[int]) -> float:
        """FLOPs of the vision tower for one sample's images (placeholder tokens per image)."""
        return sum(self.vision_per_token * v + self.vision_per_token_sq * v * v for v in image_tokens)

    @classmethod
    def from_config(cls, config: Any) -> CostModel:
        """Coefficients from a Qwen2-VL / Qwen2.5-VL / Qwen3-VL config (``text_config``, ``vision_config``).

        Per layer and token: projections ``2*d*(2*H*hd + 2*kv*hd)``, gated MLP ``6*d*I``; causal
        attention ``2*H*hd*n**2`` per sample; LM head ``2*d*vocab`` (Kaplan et al. 2020, Table 1;
        Narayanan et al. 2021, §5.1). Vision, per patch (``merge**2`` per placeholder token): qkv+proj
        ``8*E**2``, MLP ``2*m*E*I_v`` (``m`` matrices: 3 when gated, Qwen2.5-VL), attention
        ``4*E*p**2`` per ``p``-patch image (Qwen2.5-VL: ``fullatt_block_indexes`` layers; windowed
        ones count as linear), patch embedding, merger(s). ValueError for another vision family.
        """
        t, v = config.text_config, config.vision_config
        d, heads = t.hidden_size, t.num_attention_heads
        hd = getattr(t, "head_dim", None) or d // heads
        proj = 2 * d * (2 * heads * hd + 2 * t.num_key_value_heads * hd) + 6 * d * t.intermediate_size
        llm = t.num_hidden_layers * proj + 2 * d * t.vocab_size
        llm_sq = t.num_hidden_layers * 2 * heads * hd
        kind = v.model_type.removesuffix("_vision")
        if kind == "qwen2_vl":
            width, inner, matrices, out, mergers = v.embed_dim, v.embed_dim * v.mlp_ratio, 2, v.hidden_size, 1
        elif kind in ("qwen2_5_vl", "qwen3_vl"):
            width, inner, out = v.hidden_size, v.intermediate_size, v.out_hidden_size
            matrices = 3 if kind == "qwen2_5_vl" else 2
            mergers = 1 + len(getattr(v, "deepstack_visual_indexes", None) or ())
        else:
            raise ValueError(
                f"no cost model for vision config {v.model_type!r}; supported: qwen2_vl, qwen2_5_vl, qwen3_vl"
            )
        merge = v.spatial_merge_size**2
        full = v.depth if kind != "qwen2_5_vl" else len(v.fullatt_block_indexes)
        window = (v.window_size // v.patch_size) ** 2 if kind == "qwen2_5_vl" else 0
        per_patch = v.depth * (8 * width**2 + 2 * matrices * width * inner)
        per_patch += (v.depth - full) * 4 * width * window
        per_patch += 2 * v.in_channels * v.temporal_patch_size * v.patch_size**2 * width
        per_token = merge * per_patch + mergers * 2 * (merge * width) * (merge * width + out)
        return cls(llm, llm_sq, per_token, full * 4 * width * merge**2)


def sync_idle(*stages: Sequence[Sequence[float]]) -> float:
    """``1 - work / (dp * sum over stages and slots of the slowest rank's cost)``: the idle share.

    ``stages``: one ``[rank][slot]`` cost table per synchronous stage (tokens alone, as
    ``bench/pack.py`` counts; or vision-tower and language-model FLOPs, which FSDP gathers layer by
    layer, so each waits for its own slowest rank). 0.0 without work; ValueError when ranks have
    different slot counts.
    """
    busy = peak = 0.0
    for table in stages:
        if len({len(row) for row in table}) > 1:
            raise ValueError(f"ranks have different slot counts: {[len(row) for row in table]}")
        for column in zip(*table, strict=True):
            busy += sum(column)
            peak += len(column) * max(column)
    return 1.0 - busy / peak if peak else 0.0


@dataclass(frozen=True)
class DpPartition:
    """Dealt mini-batch: ``ranks[r][k]`` = sorted sample indices of rank ``r``'s slot ``k``.

    Every rank has the same slot count; an empty list is a slot that rank fills with a pad
    micro-batch. ``slot_has_pixels[k]``: slot ``k`` runs the vision tower on every rank, so a bin
    there without images gets a multimodal pad (vision-section bins keep ``reserve`` tokens free).
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


def min_micro_batches(
    lengths: Sequence[int],
    *,
    dp_size: int,
    cap: int,
    keys: Sequence[Hashable] | None = None,
    kinds: Sequence[int] | None = None,
    reserve: int = 0,
) -> int:
    """A lower bound on the micro-batches per rank of any plan under :func:`partition_mini_batch`'s rules.

    ``ceil(bins / dp_size)``, where per isolation key a sample above the cap fills a bin alone and
    the others fill bins completely; with images, at least the vision slots plus the text slots
    this bound gives each section (a slot runs the vision tower on every rank or none).
    """
    keys = [None] * len(lengths) if keys is None else keys
    kinds = [NEUTRAL] * len(lengths) if kinds is None else kinds
    return _floor(lengths, keys, _places(lengths, kinds, cap, reserve), dp_size, cap, reserve)


def partition_mini_batch(
    lengths: Sequence[int],
    *,
    dp_size: int,
    cap: int,
    keys: Sequence[Hashable] | None = None,
    kinds: Sequence[int] | None = None,
    vision_cost: Sequence[float] | None = None,
    reserve: int = 0,
) -> DpPartition:
    """Deal one mini-batch's samples to ``dp_size`` ranks as equal-count, equal-work micro-batches.

    Args:
        lengths: tokens per sample (``len(input_ids)``), each >= 1.
        dp_size: data-parallel ranks.
        cap: micro-batch token cap (``micro_batch_max_tokens``); a longer sample runs alone.
        keys: isolation key per sample (``(run_id, lora_id)``); keys never share a micro-batch.
        kinds: :data:`~trainer_lib.packing.NEUTRAL`, ``PIXELS`` or ``STRAY`` per sample.
        vision_cost: vision-tower work per sample, any unit (``CostModel.vision`` of its images'
            placeholder counts); groups the vision slots. Default: all equal.
        reserve: tokens a vision-slot bin keeps free for a multimodal pad (``[pad] +
            placeholders + [pad]`` of the minimal grid: 6 for Qwen2-VL).

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
    if not len(keys) == len(kinds) == len(weight) == n:
        raise ValueError(f"{n} lengths but {len(keys)} keys, {len(kinds)} kinds, {len(weight)} vision costs")
    if (n and min(lengths) < 1) or not set(kinds) <= {NEUTRAL, PIXELS, STRAY}:
        raise ValueError("every length must be >= 1 and every kind NEUTRAL, PIXELS or STRAY")
    if PIXELS not in kinds:
        return _deal(_section(list(range(n)), lengths, keys, kinds, cap, dp_size, weight), kinds, dp_size)
    place = _places(lengths, kinds, cap, reserve)
    vision = [i for i in range(n) if place[i] == _VISION]
    text = [i for i in range(n) if place[i] == _TEXT]
    free = [i for i in range(n) if place[i] == _EITHER]
    text_slots: list[list[tuple[int, list[int]]]] = []
    if text:
        target = min(cap, sum(lengths) / (dp_size * _floor(lengths, keys, place, dp_size, cap, reserve)))
        x = _slots_needed(text, lengths, keys, cap, dp_size)
        while (dealt := _lpt(text, lengths, keys, x * dp_size, cap, free, target)) is None:
            x += 1
        bins, free = dealt
        text_slots = _slots(_sized(bins, lengths), [], x, dp_size)
    vision += free
    slots = _section(vision, lengths, keys, kinds, cap - reserve, dp_size, weight) + text_slots
    return _deal(slots, kinds, dp_size)


def _places(lengths: Sequence[int], kinds: Sequence[int], cap: int, reserve: int) -> list[int]:
    """Per sample: :data:`_VISION`, :data:`_TEXT` or :data:`_EITHER` (see step 1 of the module doc)."""
    return [
        _VISION if k == PIXELS else _TEXT if k == STRAY or n > cap - reserve else _EITHER
        for n, k in zip(lengths, kinds, strict=True)
    ]


def _slots_needed(
    items: Iterable[int], lengths: Sequence[int], keys: Sequence[Hashable], cap: int, dp: int
) -> int:
    """``ceil(bins / dp)``, bins counted per key: one per sample above ``cap``, the rest full."""
    over, fit = 0, {}
    for i in items:
        if lengths[i] > cap:
            over += 1
        else:
            fit[keys[i]] = fit.get(keys[i], 0) + lengths[i]
    return -(-(over + sum(-(-tokens // cap) for tokens in fit.values())) // dp)


def _floor(
    lengths: Sequence[int], keys: Sequence[Hashable], place: Sequence[int], dp: int, cap: int, reserve: int
) -> int:
    """:func:`min_micro_batches` from the samples' places."""
    total = _slots_needed(range(len(lengths)), lengths, keys, cap, dp)
    pix = [i for i, p in enumerate(place) if p == _VISION]
    text = [i for i, p in enumerate(place) if p == _TEXT]
    split = _slots_needed(pix, lengths, keys, cap - reserve, dp) + _slots_needed(text, lengths, keys, cap, dp)
    return max(total, split) if pix else total


def _lpt(
    items: list[int],
    lengths: Sequence[int],
    keys: Sequence[Hashable],
    nbins: int,
    cap: int,
    optional: Sequence[int] = (),
    target: float = 0.0,
) -> tuple[list[list[int]], list[int]] | None:
    """``items`` largest first into the least-loaded of ``nbins`` bins of their key (LPT).

    Then ``optional`` samples, largest first, join only where the bin stays within ``target``
    tokens; the others come back as leftovers. Bins per key: one for each key with
    ``items``, then each next bin to the key with the most tokens per bin (at most one bin per
    sample). A sample above ``cap`` takes an empty bin and closes it. None: an item did not fit.
    """
    need = set(items)
    members: dict[Hashable, list[int]] = {}
    for i in [*sorted(items, key=lambda i: -lengths[i]), *sorted(optional, key=lambda i: -lengths[i])]:
        members.setdefault(keys[i], []).append(i)
    total = {k: sum(lengths[i] for i in group) for k, group in members.items()}
    alloc = {k: int(not need.isdisjoint(group)) for k, group in members.items()}
    if sum(alloc.values()) > nbins:
        return None
    queue = [(-total[k] / (a or 0.5), n, k) for n, (k, a) in enumerate(alloc.items()) if len(members[k]) > a]
    heapq.heapify(queue)
    for _ in range(nbins - sum(alloc.values())):
        if not queue:
            break
        _, n, k = heapq.heappop(queue)
        alloc[k] += 1
        if len(members[k]) > alloc[k]:
            heapq.heappush(queue, (-total[k] / alloc[k], n, k))
    out: list[list[int]] = []
    left: list[int] = []
    for k, group in members.items():
        heap = [(0, len(out) + j) for j in range(alloc[k])]
        out.extend([] for _ in range(alloc[k]))
        for i in group:
            n = lengths[i]
            if i not in need and (not heap or heap[0][0] + n > target):
                left.append(i)
                continue
            if not heap or (heap[0][0] + n > cap and out[heap[0][1]]):
                return None
            load, b = heapq.heappop(heap)
            out[b].append(i)
            if load + n <= cap:
                heapq.heappush(heap, (load + n, b))
    return out, left


def _sized(bins: list[list[int]], lengths: Sequence[int]) -> list[tuple[int, list[int]]]:
    """``(tokens, bin)`` pairs, most tokens first."""
    return sorted(((sum(lengths[i] for i in b), b) for b in bins), key=lambda x: -x[0])


def _slots(
    head: list[tuple[int, list[int]]], tail: list[tuple[int, list[int]]], num_slots: int, dp: int
) -> list[list[tuple[int, list[int]]]]:
    """``head + tail`` padded with empty bins and cut into ``num_slots`` slots of ``dp``."""
    ordered = head + tail + [(0, [])] * (num_slots * dp - len(head) - len(tail))
    return [ordered[s * dp : (s + 1) * dp] for s in range(num_slots)]


def _section(
    items: list[int],
    lengths: Sequence[int],
    keys: Sequence[Hashable],
    kinds: Sequence[int],
    cap: int,
    dp: int,
    weight: Sequence[float],
) -> list[list[tuple[int, list[int]]]]:
    """Slots of ``dp`` ``(tokens, bin)`` pairs (empty bins included) holding ``items``: FFD head, LPT tail."""
    if not items:
        return []
    ffd = plan_bins(
        [lengths[i] for i in items], cap, keys=[keys[i] for i in items], kinds=[kinds[i] for i in items]
    )
    bins = [[items[j] for j in b] for b in ffd]
    last = {keys[b[0]]: j for j, b in enumerate(bins)}  # plan_bins: bins by key, then by creation
    full = _sized([b for j, b in enumerate(bins) if last[keys[b[0]]] != j], lengths)
    num_slots = -(-len(bins) // dp)
    head_slots = min(len(full) // dp, num_slots)
    head = full[: head_slots * dp]
    tail = _sized([*(b for _, b in full[head_slots * dp :]), *(bins[j] for j in last.values())], lengths)
    largest = max((lengths[i] for i in items if lengths[i] <= cap), default=0)
    _swap_big_samples_out(head, tail, (num_slots - head_slots) * dp, cap - largest, lengths)
    if tail and (
        dealt := _lpt([i for _, b in tail for i in b], lengths, keys, (num_slots - head_slots) * dp, cap)
    ):
        tail = _sized(dealt[0], lengths)
    head.sort(key=lambda x: (-max(x[0] - cap, 0), -sum(weight[i] for i in x[1])))  # oversized bins first
    return _slots(head, tail, num_slots, dp)


def _swap_big_samples_out(
    head: list[tuple[int, list[int]]],
    tail: list[tuple[int, list[int]]],
    nbins: int,
    full: int,
    lengths: Sequence[int],
) -> None:
    """While the tail's largest sample exceeds its mean bin (LPT could not balance around it), swap
    that sample's bin into the head for the head bin of the smallest samples. Head bins stay above
    ``full`` tokens."""
    biggest = [max(lengths[i] for i in b) for _, b in head]
    for _ in range(len(tail)):
        j, big = max(
            ((j, max(lengths[i] for i in b)) for j, (_, b) in enumerate(tail) if b),
            key=lambda x: x[1],
            default=(0, 0),
        )
        if not head or big * nbins <= sum(load for load, _ in tail) or tail[j][0] <= full:
            return
        k = min(range(len(head)), key=biggest.__getitem__)
        if biggest[k] >= big:
            return
        head[k], tail[j], biggest[k] = tail[j], head[k], big


def _deal(slots: list[list[tuple[int, list[int]]]], kinds: Sequence[int], dp: int) -> DpPartition:
    """Slot by slot, the bin with the most tokens to the rank with the fewest so far (ties: lower
    rank); slots of empty bins only (LPT may leave bins unused) are dropped."""
    slots = [slot for slot in slots if any(b for _, b in slot)]
    ranks: list[list[list[int]]] = [[] for _ in range(dp)]
    tokens: list[list[int]] = [[] for _ in range(dp)]
    total = [0] * dp
    for slot in slots:
        order = sorted(range(dp), key=lambda r: (total[r], r))
        for (load, b), r in zip(sorted(slot, key=lambda x: -x[0]), order, strict=True):
            ranks[r].append(sorted(b))
            tokens[r].append(load)
            total[r] += load
    pix = {i for i, k in enumerate(kinds) if k == PIXELS}
    pixels = [any(not pix.isdisjoint(b) for _, b in slot) for slot in slots]
    return DpPartition(ranks=ranks, slot_has_pixels=pixels, tokens=tokens)
