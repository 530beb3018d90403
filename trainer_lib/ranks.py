"""Deal a packed mini-batch's micro-batches to data-parallel ranks and align them (docs/PACKING.md §5).

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

from collections.abc import Sequence
from typing import Any

from trainer_lib.micro_batch import PackedBatch, PackedMicroBatch
from trainer_lib.packing import PackEntry, build_micro_batch
from trainer_lib.padding import make_pad_sample, smallest_image_grid, synthetic_image_pad

__all__ = ["balance_micro_batches", "split_micro_batches"]


def split_micro_batches(step: PackedBatch, dp_size: int) -> list[PackedBatch]:
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
        synthetic_image_grid: the synthetic-image pad's grid; default :func:`smallest_image_grid`.

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
        pad = synthetic_image_pad(
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
                f"aligning the vision tower needs the adapter (synthetic-image pads)"
            )
        if deficit:
            grid = grid or tuple(synthetic_image_grid or smallest_image_grid(adapter))
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
                            [PackEntry(s.sample, s.sample_index) for s in mb.slots], mb.run_id, mb.lora_id
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
        steps.append(PackedBatch(micro_batches=mbs, micro_batch_max_tokens=cap))
    return steps
