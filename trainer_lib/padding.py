"""Padding samples and balanced micro-batch plans across data-parallel ranks (DESIGN §6).

Two kinds of padding, both **zero-loss and out of metrics** (``is_padding=True``,
``loss_mask`` all False, advantages 0, own token ids — never a copy of a real sample, and no
group, so group-relative advantages computed elsewhere never see them):

1. **Sample-count padding** (:func:`padded_sample_count`; :func:`pad_samples` appends the pads,
   :func:`plan_step` tops up each mini-batch with them): the step's sample count is rounded up to
   a multiple of ``lcm(dp_size, mini_batch_size[, critic_mini_batch_size])`` with minimal text
   samples of ``pad_tokens`` pad ids (verl's scheme: 2 tokens, independent ids).
2. **Micro-batch balancing** (:func:`balance_micro_batches`): every rank must run the same
   number of forward/backward passes, and with a sharded model (FSDP) micro-batch ``k`` must
   run the vision tower on every rank or on none (its parameters are gathered collectively).
   Each rank's micro-batches are ordered pixels-first; a rank with fewer pixel micro-batches
   gets a **multimodal pad** (placeholder tokens of a minimal grid, zero features from
   ``adapter.synthesize_placeholder``) added to a text micro-batch that has room and no stray
   placeholder sample, or as a micro-batch of its own; then ranks with fewer micro-batches get
   text-pad micro-batches.

:func:`plan_step` runs the whole chain: pad, split into mini-batches (real samples spread
evenly, so no optimizer step is pads alone), pack each mini-batch (first-fit-decreasing, bins
spread to a multiple of ``dp_size``), deal the micro-batches to the ranks
(:func:`split_micro_batches`), balance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.structs import TrainingSample
from trainer_lib.packing import (
    PackedMicroBatch,
    PackedStep,
    PackEntry,
    build_micro_batch,
    pack_samples,
    resolve_cap,
)

__all__ = [
    "StepPlan",
    "balance_micro_batches",
    "image_pad_entry",
    "make_pad_sample",
    "minimal_pad_grid",
    "pad_samples",
    "padded_sample_count",
    "plan_step",
    "split_micro_batches",
]


def padded_sample_count(
    num_samples: int, *, dp_size: int, mini_batch_size: int, critic_mini_batch_size: int | None = None
) -> int:
    """``num_samples`` rounded up to a multiple of ``lcm(dp_size, mini_batch_size[, critic])``.

    Raises:
        ValueError: a size below 1 or a negative sample count.
    """
    sizes = [dp_size, mini_batch_size] + (
        [critic_mini_batch_size] if critic_mini_batch_size is not None else []
    )
    if num_samples < 0 or min(sizes) < 1:
        raise ValueError(f"need num_samples >= 0 and sizes >= 1, got {num_samples}, {sizes}")
    multiple = math.lcm(*sizes)
    return -(-num_samples // multiple) * multiple


def make_pad_sample(
    *, pad_token_id: int, num_tokens: int = 2, run_id: str = "", lora_id: str | None = None
) -> TrainingSample:
    """A minimal zero-loss text sample: ``num_tokens`` pad ids, ``is_padding=True``."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    return TrainingSample(
        input_ids=[pad_token_id] * num_tokens,
        loss_mask=[False] * num_tokens,
        advantages=[0.0] * num_tokens,
        inference_logprobs=[0.0] * num_tokens,
        run_id=run_id,
        lora_id=lora_id,
        is_padding=True,
    )


def minimal_pad_grid(adapter: Any) -> tuple[int, ...]:
    """The smallest grid the family's processor produces (a 1x1 image after its resize rules).

    Qwen-VL: ``smart_resize`` lifts tiny images to ``min_pixels``; released Qwen2-VL gives
    ``(1, 4, 4)`` = 4 placeholder tokens.
    """
    return tuple(adapter.grid_for_size(1, 1))


def image_pad_entry(
    adapter: Any,
    *,
    grid: Sequence[int],
    pad_token_id: int,
    placeholder_token_id: int,
    run_id: str = "",
    lora_id: str | None = None,
) -> PackEntry:
    """A zero-loss pad carrying one synthetic image: ``[pad] + [placeholder] * n + [pad]``.

    Its features are ``adapter.synthesize_placeholder(grid)`` (zeros of the right shapes), added
    by :func:`trainer_lib.forward.materialize_micro_batch`.
    """
    n = adapter.num_placeholders(grid)
    ids = [pad_token_id] + [placeholder_token_id] * n + [pad_token_id]
    sample = TrainingSample(
        input_ids=ids,
        loss_mask=[False] * len(ids),
        advantages=[0.0] * len(ids),
        inference_logprobs=[0.0] * len(ids),
        run_id=run_id,
        lora_id=lora_id,
        is_padding=True,
    )
    return PackEntry(sample, None, tuple(int(g) for g in grid))


def pad_samples(
    samples: Sequence[TrainingSample],
    *,
    dp_size: int,
    mini_batch_size: int,
    critic_mini_batch_size: int | None = None,
    pad_token_id: int,
    pad_tokens: int = 2,
) -> list[TrainingSample]:
    """``samples`` followed by text pads up to :func:`padded_sample_count`.

    Pads take the ``run_id``/``lora_id`` of the last sample (so they pack with it and never
    open a bin of their own just for isolation).
    """
    target = padded_sample_count(
        len(samples),
        dp_size=dp_size,
        mini_batch_size=mini_batch_size,
        critic_mini_batch_size=critic_mini_batch_size,
    )
    run_id, lora_id = (samples[-1].run_id, samples[-1].lora_id) if samples else ("", None)
    pads = [
        make_pad_sample(pad_token_id=pad_token_id, num_tokens=pad_tokens, run_id=run_id, lora_id=lora_id)
        for _ in range(target - len(samples))
    ]
    return [*samples, *pads]


def split_micro_batches(step: PackedStep, dp_size: int) -> list[PackedStep]:
    """Deal a packed mini-batch's micro-batches to ``dp_size`` ranks.

    Each rank gets ``ceil(B / dp)`` or fewer micro-batches: first those with pixels (at most
    ``ceil(B_pixels / dp)`` per rank), then text ones; each goes, largest first, to the rank with
    the fewest tokens that is below its quota (LPT). Ranks list pixel micro-batches first, each
    group by decreasing size, so micro-batch ``k`` has similar sizes on every rank.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    mbs = step.micro_batches
    ranks: list[list[PackedMicroBatch]] = [[] for _ in range(dp_size)]
    tokens = [0] * dp_size
    quota = -(-len(mbs) // dp_size)
    pixels = sorted((mb for mb in mbs if mb.has_pixels), key=lambda mb: -mb.num_tokens)
    text = sorted((mb for mb in mbs if not mb.has_pixels), key=lambda mb: -mb.num_tokens)
    for group, limit in ((pixels, -(-len(pixels) // dp_size)), (text, quota)):
        for mb in group:
            r = min((r for r in range(dp_size) if len(ranks[r]) < limit), key=lambda r: (tokens[r], r))
            ranks[r].append(mb)
            tokens[r] += mb.num_tokens
    return [PackedStep(micro_batches=r, micro_batch_max_tokens=step.micro_batch_max_tokens) for r in ranks]


def balance_micro_batches(
    per_rank: Sequence[PackedStep],
    *,
    pad_token_id: int,
    placeholder_token_id: int,
    adapter: Any = None,
    mm_pad_grid: Sequence[int] | None = None,
    pad_tokens: int = 2,
) -> list[PackedStep]:
    """Give every rank the same number of micro-batches, with pixels in the same positions.

    Args:
        per_rank: each rank's packed share (same cap on every rank).
        adapter: needed when some rank has fewer pixel micro-batches than another (for
            ``num_placeholders``; features come later from ``synthesize_placeholder``).
        mm_pad_grid: the multimodal pad's grid; default :func:`minimal_pad_grid`.

    Returns:
        New per-rank steps: on every rank micro-batches ``0..P-1`` carry pixels and ``P..M-1``
        do not, where ``P``/``M`` are the largest pixel/total counts over the ranks.

    Raises:
        ValueError: ranks with different caps, or pixels to align without an adapter.
    """
    caps = {s.micro_batch_max_tokens for s in per_rank}
    if len(caps) != 1:
        raise ValueError(f"ranks packed with different caps: {sorted(caps)}")
    cap = caps.pop()
    n_pix = max((sum(mb.has_pixels for mb in s.micro_batches) for s in per_rank), default=0)
    grid = None

    def with_image_pad(entries: list[PackEntry], run_id: str, lora_id: str | None) -> PackedMicroBatch:
        pad = image_pad_entry(
            adapter,
            grid=grid,
            pad_token_id=pad_token_id,
            placeholder_token_id=placeholder_token_id,
            run_id=run_id,
            lora_id=lora_id,
        )
        return build_micro_batch(
            [*entries, pad],
            placeholder_token_id=placeholder_token_id,
            num_placeholders=adapter.num_placeholders,
        )

    out_lists: list[list[PackedMicroBatch]] = []
    for rank, step in enumerate(per_rank):
        pix = [mb for mb in step.micro_batches if mb.has_pixels]
        text = [mb for mb in step.micro_batches if not mb.has_pixels]
        key = (
            (step.micro_batches[-1].run_id, step.micro_batches[-1].lora_id)
            if step.micro_batches
            else ("", None)
        )
        deficit = n_pix - len(pix)
        if deficit and adapter is None:
            raise ValueError(
                f"rank {rank} has {len(pix)} micro-batches with images, another has {n_pix}: "
                f"aligning the vision tower needs the adapter (multimodal pads)"
            )
        if deficit:
            grid = grid or tuple(mm_pad_grid or minimal_pad_grid(adapter))
            pad_len = adapter.num_placeholders(grid) + 2
            kept: list[PackedMicroBatch] = []
            for mb in text:
                if (
                    deficit
                    and mb.num_tokens + pad_len <= cap
                    and not any(s.stray_placeholders for s in mb.slots)
                ):
                    # a text micro-batch: its slots carry no images
                    pix.append(
                        with_image_pad(
                            [PackEntry(s.sample, s.index) for s in mb.slots], mb.run_id, mb.lora_id
                        )
                    )
                    deficit -= 1
                else:
                    kept.append(mb)
            text = kept
            pix += [with_image_pad([], *key) for _ in range(deficit)]
        out_lists.append(pix + text)
    total = max((len(mbs) for mbs in out_lists), default=0)
    steps = []
    for mbs in out_lists:
        key = (mbs[-1].run_id, mbs[-1].lora_id) if mbs else ("", None)
        while len(mbs) < total:
            pad = make_pad_sample(
                pad_token_id=pad_token_id, num_tokens=pad_tokens, run_id=key[0], lora_id=key[1]
            )
            mbs.append(build_micro_batch([PackEntry(pad)], placeholder_token_id=placeholder_token_id))
        steps.append(PackedStep(micro_batches=mbs, micro_batch_max_tokens=cap))
    return steps


@dataclass(frozen=True)
class StepPlan:
    """``mini_batches[i][rank]``: rank ``rank``'s micro-batches for optimizer step ``i``."""

    mini_batches: list[list[PackedStep]]
    num_padding_samples: int
    """Sample-count pads added by :func:`pad_samples` (micro-batch pads are counted per step)."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for mb in self.mini_batches for s in mb)

    @property
    def num_loss_tokens(self) -> int:
        return sum(s.num_loss_tokens for mb in self.mini_batches for s in mb)

    @property
    def num_samples(self) -> int:
        """Real samples (padding excluded)."""
        return sum(s.num_samples for mb in self.mini_batches for s in mb)

    @property
    def num_loss_tokens_per_mini_batch(self) -> list[int]:
        """Loss tokens of each optimizer step, all ranks together (a per-step loss normalizer)."""
        return [sum(s.num_loss_tokens for s in ranks) for ranks in self.mini_batches]


def _mini_batch_indices(num_real: int, num_padded: int, mini_batch_size: int) -> list[list[int]]:
    """Indices of each mini-batch: the real samples in order, spread as evenly as possible
    (``floor`` or ``ceil`` of ``num_real / k`` each), each topped up with pads (indices
    ``>= num_real``). Only with fewer real samples than mini-batches is one all padding."""
    k = num_padded // mini_batch_size
    q, r = divmod(num_real, k) if k else (0, 0)
    out, real, pad = [], 0, num_real
    for j in range(k):
        n = q + (j < r)
        out.append([*range(real, real + n), *range(pad, pad + mini_batch_size - n)])
        real, pad = real + n, pad + mini_batch_size - n
    return out


def plan_step(
    samples: Sequence[TrainingSample],
    *,
    dp_size: int,
    mini_batch_size: int,
    seq_len: int,
    placeholder_token_id: int,
    pad_token_id: int,
    micro_batch_max_tokens: int | None = None,
    critic_mini_batch_size: int | None = None,
    adapter: Any = None,
    mm_pad_grid: Sequence[int] | None = None,
    pad_tokens: int = 2,
) -> StepPlan:
    """Pad, split into mini-batches, pack each, deal its micro-batches to the ranks, balance.

    The real samples keep their order and are spread evenly over the mini-batches; the
    sample-count pads top each one up to ``mini_batch_size``, so no optimizer step is made of
    pads alone unless there are fewer real samples than mini-batches (then
    :attr:`StepPlan.num_loss_tokens_per_mini_batch` shows a 0: skip that ``optimizer.step()``;
    every rank computes the same plan, so they agree). Sample ``i`` of the input is
    ``slot.index == i`` wherever it lands; pads have indices ``>= len(samples)`` (sample-count
    pads) or None (micro-batch pads). ``critic_mini_batch_size`` only enters the padded count
    (a critic cuts its own mini-batches from the same padded samples).

    Raises:
        ValueError, PlaceholderMismatch: see :func:`pack_samples` and :func:`balance_micro_batches`.
    """
    cap = resolve_cap(seq_len, micro_batch_max_tokens)
    n = len(samples)
    target = padded_sample_count(
        n, dp_size=dp_size, mini_batch_size=mini_batch_size, critic_mini_batch_size=critic_mini_batch_size
    )
    counter = adapter.num_placeholders if adapter is not None else None
    mini_batches = []
    for chunk in _mini_batch_indices(n, target, mini_batch_size):
        last = samples[max((i for i in chunk if i < n), default=n - 1)] if n else None
        pad = make_pad_sample(  # keyed like the chunk's last sample: pads never open a bin for isolation
            pad_token_id=pad_token_id,
            num_tokens=pad_tokens,
            run_id=last.run_id if last else "",
            lora_id=last.lora_id if last else None,
        )
        packed = pack_samples(
            [PackEntry(samples[i] if i < n else pad, i) for i in chunk],
            placeholder_token_id=placeholder_token_id,
            seq_len=seq_len,
            micro_batch_max_tokens=cap,
            num_placeholders=counter,
            bins_multiple_of=dp_size,
        )
        mini_batches.append(
            balance_micro_batches(
                split_micro_batches(packed, dp_size),
                pad_token_id=pad_token_id,
                placeholder_token_id=placeholder_token_id,
                adapter=adapter,
                mm_pad_grid=mm_pad_grid,
                pad_tokens=pad_tokens,
            )
        )
    return StepPlan(mini_batches=mini_batches, num_padding_samples=target - n)
