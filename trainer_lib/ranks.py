"""Deal a packed mini-batch's micro-batches to data-parallel ranks and align them (docs/PACKING.md §3).

Every rank must run the same number of forward/backward passes, and with a sharded model (FSDP)
micro-batch ``k`` must run the vision tower on every rank or on none (its parameters are
gathered collectively). :func:`split_micro_batches` deals micro-batches to ranks (pixels first,
token-balanced); :func:`balance_micro_batches` then orders each rank's micro-batches
pixels-first, gives a rank with fewer pixel micro-batches a **synthetic-image pad** (placeholder
tokens of a minimal grid, zero features from ``adapter.synthesize_placeholder``) added to a text
micro-batch that has room and no stray placeholder sample, or as a micro-batch of its own, and
finally tops up ranks with fewer micro-batches with text-pad micro-batches.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainer_lib.micro_batch import PackedBatch, PackedMicroBatch
from trainer_lib.packing import PackEntry, build_micro_batch
from trainer_lib.padding import make_pad_sample, smallest_image_grid, synthetic_image_pad

__all__ = ["balance_micro_batches", "split_micro_batches"]


def split_micro_batches(step: PackedBatch, dp_size: int) -> list[PackedBatch]:
    """Deal a packed mini-batch's micro-batches to ``dp_size`` ranks.

    Each rank gets ``ceil(B / dp)`` or fewer micro-batches: first those with pixels (at most
    ``ceil(B_pixels / dp)`` per rank), then text ones; each goes, largest first, to the rank with
    the fewest tokens that is below its quota (LPT, longest processing time first). Ranks list
    pixel micro-batches first, each group by decreasing size, so micro-batch ``k`` has similar
    sizes on every rank. The counts may still differ: :func:`balance_micro_batches` evens them.

    Returns:
        ``dp_size`` :class:`~trainer_lib.PackedBatch` es (same capacity), rank order.

    Raises:
        ValueError: ``dp_size < 1``.
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
    return [PackedBatch(micro_batches=r, micro_batch_max_tokens=step.micro_batch_max_tokens) for r in ranks]


def balance_micro_batches(
    per_rank: Sequence[PackedBatch],
    *,
    pad_token_id: int,
    placeholder_token_id: int,
    adapter: Any = None,
    synthetic_image_grid: Sequence[int] | None = None,
    pad_tokens: int = 2,
) -> list[PackedBatch]:
    """Give every rank the same number of micro-batches, with pixels in the same positions.

    Args:
        per_rank: each rank's packed share (same cap on every rank).
        adapter: needed when some rank has fewer pixel micro-batches than another (for
            ``num_placeholders``; features come later from ``synthesize_placeholder``).
        synthetic_image_grid: the synthetic-image pad's grid (bounded by ``adapter.check_grid``);
            default :func:`~trainer_lib.padding.smallest_image_grid`.

    Returns:
        New per-rank steps: on every rank micro-batches ``0..P-1`` carry pixels and ``P..M-1``
        do not, where ``P``/``M`` are the largest pixel/total counts over the ranks.

    Raises:
        ValueError: ranks with different caps, or pixels to align without an adapter.
        GridMismatch: a ``synthetic_image_grid`` the processor cannot produce.
    """
    caps = {s.micro_batch_max_tokens for s in per_rank}
    if len(caps) != 1:
        raise ValueError(f"ranks packed with different caps: {sorted(caps)}")
    cap = caps.pop()
    n_pix = max((sum(mb.has_pixels for mb in s.micro_batches) for s in per_rank), default=0)
    pads = _Pads(adapter, synthetic_image_grid, pad_token_id, placeholder_token_id, pad_tokens)
    aligned = [_align_pixels(rank, s.micro_batches, n_pix, cap, pads) for rank, s in enumerate(per_rank)]
    total = max((len(mbs) for mbs in aligned), default=0)
    return [
        PackedBatch(
            micro_batches=mbs + [pads.text(*_key(mbs)) for _ in range(total - len(mbs))],
            micro_batch_max_tokens=cap,
        )
        for mbs in aligned
    ]


def _key(mbs: Sequence[PackedMicroBatch]) -> tuple[str, str | None]:
    """The ``(run_id, lora_id)`` a pad added to these micro-batches takes (the last one's)."""
    return (mbs[-1].run_id, mbs[-1].lora_id) if mbs else ("", None)


@dataclass
class _Pads:
    """Builds the pad micro-batches of :func:`balance_micro_batches`."""

    adapter: Any
    requested_grid: Sequence[int] | None
    pad_token_id: int
    placeholder_token_id: int
    pad_tokens: int

    @functools.cached_property
    def grid(self) -> tuple[int, ...]:
        """The synthetic image's grid: the requested one (bounded by ``adapter.check_grid``), or the
        smallest the processor makes."""
        if self.requested_grid is None:
            return smallest_image_grid(self.adapter)
        return tuple(self.adapter.check_grid(tuple(int(g) for g in self.requested_grid)))

    @functools.cached_property
    def image_pad_length(self) -> int:
        return self.adapter.num_placeholders(self.grid) + 2

    def with_image(self, entries: list[PackEntry], run_id: str, lora_id: str | None) -> PackedMicroBatch:
        """``entries`` plus a synthetic-image pad, as one micro-batch."""
        pad = synthetic_image_pad(
            self.adapter,
            grid=self.grid,
            pad_token_id=self.pad_token_id,
            placeholder_token_id=self.placeholder_token_id,
            run_id=run_id,
            lora_id=lora_id,
        )
        return build_micro_batch(
            [*entries, pad],
            placeholder_token_id=self.placeholder_token_id,
            num_placeholders=self.adapter.num_placeholders,
        )

    def text(self, run_id: str, lora_id: str | None) -> PackedMicroBatch:
        """A micro-batch of one text pad."""
        pad = make_pad_sample(
            pad_token_id=self.pad_token_id, num_tokens=self.pad_tokens, run_id=run_id, lora_id=lora_id
        )
        return build_micro_batch([PackEntry(pad)], placeholder_token_id=self.placeholder_token_id)


def _align_pixels(
    rank: int, mbs: Sequence[PackedMicroBatch], n_pix: int, cap: int, pads: _Pads
) -> list[PackedMicroBatch]:
    """``mbs`` pixels first, with ``n_pix`` pixel micro-batches: text micro-batches with room (and
    no stray placeholder sample) take a synthetic-image pad first, then pads come alone."""
    pix = [mb for mb in mbs if mb.has_pixels]
    text = [mb for mb in mbs if not mb.has_pixels]
    deficit = n_pix - len(pix)
    if not deficit:
        return pix + text
    if pads.adapter is None:
        raise ValueError(
            f"rank {rank} has {len(pix)} micro-batches with images, another has {n_pix}: "
            f"aligning the vision tower needs the adapter (synthetic-image pads)"
        )
    kept: list[PackedMicroBatch] = []
    for mb in text:
        if (
            deficit
            and mb.num_tokens + pads.image_pad_length <= cap
            and not any(s.stray_placeholders for s in mb.slots)
        ):  # a text micro-batch: its slots carry no images
            entries = [PackEntry(s.sample, s.sample_index) for s in mb.slots]
            pix.append(pads.with_image(entries, mb.run_id, mb.lora_id))
            deficit -= 1
        else:
            kept.append(mb)
    return pix + [pads.with_image([], *_key(mbs)) for _ in range(deficit)] + kept
