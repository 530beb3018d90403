"""The data-parallel plans ``plan_step`` replaced in issue 13, kept as ``bench/pack.py``'s baselines.

- :func:`plan_today`: ``plan_step`` before issue 13 (git ``b9e1f26``, ``trainer_lib/plan.py`` and
  ``ranks.py``): pack each mini-batch first-fit-decreasing, re-plan the bins at the smallest size
  that needs a multiple of ``dp`` of them, deal them to the ranks largest-first (pixel
  micro-batches first, at most ``ceil(B/dp)`` per rank), then even the counts: a rank short of
  pixel micro-batches gets a synthetic-image pad (in a text micro-batch with room, else alone), a
  rank short of micro-batches gets text-pad micro-batches.
- :func:`plan_verl`: verl's order (``RayPPOTrainer._balance_batch`` in
  ``verl/trainer/ppo/ray_trainer.py`` -> ``get_seqlen_balanced_partitions`` in
  ``verl/utils/seqlen_balancing.py``): Karmarkar-Karp over the samples' token counts into ``dp``
  rank shares, each share packed first-fit-decreasing on its own (``rearrange_micro_batches`` packs
  per rank), then the counts evened as above.

Both share ``plan_step``'s padding and mini-batch split (:func:`trainer_lib.planning.plan.mini_batch_entries`)
and the library's micro-batch builder, so only the dealing differs.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from protocol.structs import TrainingSample
from trainer_lib.micro_batch import PackedBatch, PackedMicroBatch
from trainer_lib.planning.bins import PIXELS, plan_bins
from trainer_lib.planning.packing import PackEntry, analyze_entry, build_micro_batch
from trainer_lib.planning.padding import make_pad_sample, pad_key
from trainer_lib.planning.plan import StepPlan, mini_batch_entries
from trainer_lib.planning.ranks import StepShape
from trainer_lib.spec import PackingSpec

__all__ = ["karmarkar_karp", "plan_today", "plan_verl"]


def plan_today(samples: Sequence[TrainingSample], spec: PackingSpec, shape: StepShape) -> StepPlan:
    """``plan_step`` as it was before issue 13 (same shape, no ``cost_model``)."""
    return _plan(samples, spec, _today_shares, shape)


def plan_verl(samples: Sequence[TrainingSample], spec: PackingSpec, shape: StepShape) -> StepPlan:
    """verl's order: KK rank shares, each packed on its own, counts evened with pads."""
    return _plan(samples, spec, _verl_shares, shape)


def _plan(samples: Sequence[TrainingSample], spec: PackingSpec, shares, shape: StepShape) -> StepPlan:
    cap, dp_size = shape.cap, shape.dp_size
    chunks = mini_batch_entries(samples, spec, dp_size=dp_size, mini_batch_size=shape.mini_batch_size)
    mini_batches = []
    for entries in chunks:
        analyses = [analyze_entry(e, spec, None) for e in entries]

        def build(b: list[int], entries=entries, analyses=analyses) -> PackedMicroBatch:
            b = sorted(b, key=lambda i: (entries[i].sample.is_padding, i))
            return build_micro_batch([entries[i] for i in b], spec, [analyses[i] for i in b])

        lengths = [a.length for a in analyses]
        keys = [e.sample.isolation_key for e in entries]
        kinds = [a.kind for a in analyses]
        per_rank = [[build(b) for b in bins] for bins in shares(lengths, keys, kinds, cap, dp_size)]
        mini_batches.append([PackedBatch(mbs, cap) for mbs in _even(per_rank, cap, spec)])
    num_pads = sum(e.sample.is_padding for entries in chunks for e in entries)
    return StepPlan(mini_batches=mini_batches, num_padding_samples=num_pads)


def _today_shares(lengths, keys, kinds, cap: int, dp: int) -> list[list[list[int]]]:
    """FFD bins (spread to a multiple of ``dp``), dealt largest first to the least-loaded rank
    under its quota, pixel bins first."""
    bins = plan_bins(lengths, cap, keys=keys, kinds=kinds)
    target = -(-len(bins) // dp) * dp
    if len(bins) < target:
        bins = _spread_bins(lengths, cap, keys, kinds, target) or bins
    size = [sum(lengths[i] for i in b) for b in bins]
    pix = [any(kinds[i] == PIXELS for i in b) for b in bins]
    ranks: list[list[list[int]]] = [[] for _ in range(dp)]
    tokens = [0] * dp
    for group, limit in ((True, -(-sum(pix) // dp)), (False, -(-len(bins) // dp))):
        for j in sorted((j for j in range(len(bins)) if pix[j] == group), key=lambda j: -size[j]):
            r = min((r for r in range(dp) if len(ranks[r]) < limit), key=lambda r: (tokens[r], r))
            ranks[r].append(bins[j])
            tokens[r] += size[j]
    return ranks


def _spread_bins(lengths, cap: int, keys, kinds, target: int) -> list[list[int]] | None:
    """FFD bins at the smallest bin size in ``[total / target, cap]`` needing ``<= target`` bins."""
    fitting = [n for n in lengths if n <= cap]
    lo = max([-(-sum(fitting) // target), *fitting], default=1)
    hi, best = cap, None
    while lo <= hi:
        mid = (lo + hi) // 2
        bins = plan_bins(lengths, mid, keys=keys, kinds=kinds)
        if len(bins) <= target:
            best, hi = bins, mid - 1
        else:
            lo = mid + 1
    return best


def _verl_shares(lengths, keys, kinds, cap: int, dp: int) -> list[list[list[int]]]:
    out = []
    for part in karmarkar_karp(lengths, dp):
        sub = sorted(part)
        bins = plan_bins(
            [lengths[i] for i in sub], cap, keys=[keys[i] for i in sub], kinds=[kinds[i] for i in sub]
        )
        out.append([[sub[j] for j in b] for b in bins])
    return out


def karmarkar_karp(values: Sequence[float], k: int) -> list[list[int]]:
    """``k``-way largest differencing (Karmarkar & Karp 1982): indices of ``values`` per part.

    verl's ``karmarkar_karp`` (``verl/utils/seqlen_balancing.py``) with ``equal_size=False`` (better
    balanced totals than its equal-count mode), written here because verl is not a dependency: each
    value starts a state of ``k`` sums; the two states of largest spread merge, largest with smallest.
    """
    heap = [(-v, i, [(v, [i])] + [(0, [])] * (k - 1)) for i, v in enumerate(values)]
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(
            ((x + y, p + q) for (x, p), (y, q) in zip(a, reversed(b), strict=True)), key=lambda s: -s[0]
        )
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], tie, merged))
        tie += 1
    return [items for _, items in heap[0][2]] if heap else [[] for _ in range(k)]


def _even(
    per_rank: list[list[PackedMicroBatch]], cap: int, spec: PackingSpec
) -> list[list[PackedMicroBatch]]:
    """Pixels first with the same count on every rank (synthetic-image pads: into a text micro-batch
    with room and no stray sample, else alone), then text-pad micro-batches up to the same count."""
    room = spec.image_pad_length

    def with_image(mb: PackedMicroBatch | None, key: tuple) -> PackedMicroBatch:
        entries = [PackEntry(s.sample, s.sample_index) for s in mb.slots] if mb else []
        return build_micro_batch([*entries, make_pad_sample(spec, key, grid=spec.image_pad_grid)], spec)

    n_pix = max(sum(mb.has_pixels for mb in mbs) for mbs in per_rank)
    out = []
    for mbs in per_rank:
        key = pad_key(mbs[-1].slots[-1].sample if mbs else None)
        pix = [mb for mb in mbs if mb.has_pixels]
        text = [mb for mb in mbs if not mb.has_pixels]
        kept = []
        for mb in text:
            stray = any(s.stray_placeholders for s in mb.slots)
            if len(pix) < n_pix and mb.num_tokens + room <= cap and not stray:
                pix.append(with_image(mb, (mb.run_id, mb.lora_id)))
            else:
                kept.append(mb)
        out.append(pix + [with_image(None, key) for _ in range(n_pix - len(pix))] + kept)
    total = max(len(mbs) for mbs in out)
    for mbs in out:
        pad = make_pad_sample(spec, pad_key(mbs[-1].slots[-1].sample if mbs else None))
        mbs += [build_micro_batch([pad], spec) for _ in range(total - len(mbs))]
    return out
