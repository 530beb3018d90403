"""Deal one mini-batch to the data-parallel ranks as balanced micro-batches (docs/PACKING.md §3).

Every rank must run the same number of forward/backward passes, and with a sharded model (FSDP)
micro-batch ``k`` ("slot ``k``") is synchronous: parameters are gathered layer by layer, so the
slot lasts as long as its slowest rank, and it must run the vision tower on every rank or on
none. :func:`deal_mini_batch` analyses the mini-batch's samples once, plans the slots with
:func:`trainer_lib.planning.partition.partition_mini_batch` (samples sharing an image kept together,
compute balanced inside every slot with each distinct image encoded once per micro-batch, or tokens
where that plan does not apply) and builds each rank's micro-batches:

- a bin in a vision slot that holds no image gets a **synthetic-image pad** (placeholder tokens of
  ``spec.image_pad_grid``, zero features from ``adapter.zero_features``); the partition
  kept room for it (``reserve``);
- an empty bin (a rank with nothing left for that slot) becomes a lone pad: a synthetic-image pad
  in a vision slot, a text pad otherwise, keyed like the mini-batch's last entry (its
  sample-count pads' key).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from trainer_lib.micro_batch import PackedBatch, PackedMicroBatch
from trainer_lib.planning.bins import PIXELS, bin_capacity
from trainer_lib.planning.cost import CostModel
from trainer_lib.planning.items import MiniBatchItems
from trainer_lib.planning.packing import PackEntry, SampleAnalysis, analyze_entry, build_micro_batch
from trainer_lib.planning.padding import make_pad_sample, pad_key
from trainer_lib.planning.partition import partition_mini_batch
from trainer_lib.planning.refine import Refinement
from trainer_lib.spec import PackingSpec

__all__ = ["Balance", "StepShape", "deal_mini_batch"]

Balance = Literal["compute", "tokens"]
"""What a data-parallel plan balances per slot: FLOPs with each distinct image encoded once per
micro-batch (samples sharing an image kept together), or tokens (issue 13's plan)."""


@dataclass(frozen=True)
class StepShape:
    """A training step's sizes: ranks, samples per optimizer step, the micro-batch cap and its
    ``stretch_cap`` rule.

    Example: 8 ranks, 256 samples per optimizer step, micro-batches of at most 8192 tokens out of
    16k sequences::

        StepShape(dp_size=8, mini_batch_size=256, seq_len=16384, micro_batch_max_tokens=8192)
        # .cap == 8192

    Raises:
        ValueError: a ``seq_len`` or ``micro_batch_max_tokens`` below 1, or a cap above
            ``seq_len`` (:func:`~trainer_lib.planning.bins.bin_capacity`); the sample counts are
            checked where the step is padded (:func:`~trainer_lib.planning.padding.padded_sample_count`).
    """

    dp_size: int
    """Data-parallel ranks."""
    mini_batch_size: int
    """Samples per optimizer step, pads included (the sample count is padded to a multiple)."""
    seq_len: int
    """The longest sequence the model takes; the cap when ``micro_batch_max_tokens`` is None."""
    micro_batch_max_tokens: int | None = None
    """A micro-batch holds at most this many tokens, pads included, unless it is one longer
    sample (or ``stretch_cap``)."""
    critic_mini_batch_size: int | None = None
    """A critic's mini-batch size: enters only the padded sample count."""
    stretch_cap: bool = False
    """In a slot where some rank runs a sample longer than the cap, the other ranks'
    micro-batches may hold up to that sample's length (see
    :func:`~trainer_lib.planning.partition.partition_mini_batch`)."""

    def __post_init__(self) -> None:
        bin_capacity(self.seq_len, self.micro_batch_max_tokens)  # checked once, here

    @property
    def cap(self) -> int:
        """Tokens per micro-batch: ``micro_batch_max_tokens`` or ``seq_len``."""
        return bin_capacity(self.seq_len, self.micro_batch_max_tokens)


def deal_mini_batch(
    entries: Sequence[PackEntry],
    spec: PackingSpec,
    shape: StepShape,
    *,
    cost_model: CostModel | None = None,
    balance: Balance = "compute",
    refine: Refinement | None = None,
) -> list[PackedBatch]:
    """One mini-batch's samples as ``shape.dp_size`` ranks' micro-batches, the same count on every
    rank.

    Args:
        entries: the mini-batch's samples (sample-count pads included), each with its
            ``sample_index``.
        spec: the family's facts; its adapter checks every ref's count, and the synthetic-image
            pads need it (required when ``dp_size > 1`` and there are images).
        shape: ranks (``dp_size``), the cap and ``stretch_cap`` (:class:`StepShape`; its sample
            counts are not read here).
        cost_model: language and vision-tower FLOPs per sample, the partition's cost (default:
            tokens, and image placeholder tokens for the vision tower).
        balance: ``"compute"`` (default) or ``"tokens"`` (:data:`Balance`).
        refine: with ``"compute"``, search the plan for a shorter predicted step
            (:class:`~trainer_lib.planning.refine.Refinement`; None: no search), for at most its
            ``plan_time_budget_s`` (seconds; default from the cost model's predicted step).

    Returns:
        ``dp_size`` :class:`~trainer_lib.PackedBatch` es in rank order: micro-batch ``k`` runs the
        vision tower on every rank or on none; vision slots come first.

    Raises:
        ValueError: a bad ``dp_size`` or ``balance``, a pad's room not below the cap, images to align
            without an adapter, and what :func:`~trainer_lib.planning.packing.build_micro_batch` raises.
        PlaceholderMismatch: a sample whose image tokens do not match its refs.
        GridMismatch: a ``spec.synthetic_grid`` the processor cannot produce.
    """
    if balance not in ("compute", "tokens"):
        raise ValueError(f"balance must be 'compute' or 'tokens', got {balance!r}")
    dp_size, cap = shape.dp_size, shape.cap
    analyses = [analyze_entry(e, spec, e.sample_index) for e in entries]
    kinds = [a.kind for a in analyses]
    aligned = dp_size > 1 and PIXELS in kinds and spec.adapter is not None
    items = MiniBatchItems(
        [a.length for a in analyses],
        dp=dp_size,
        cap=cap,
        keys=[e.sample.isolation_key for e in entries],
        kinds=kinds,
        vision=[cost_model.vision(a.image_tokens) if cost_model else sum(a.image_tokens) for a in analyses],
        language=None if cost_model is None else [cost_model.language(a.length) for a in analyses],
        groups=[a.image_key for a in analyses] if balance == "compute" else None,
        reserve=spec.image_pad_length if aligned else 0,
        stretch=shape.stretch_cap,
        unit_seconds=None if cost_model is None else cost_model.seconds_per_unit,
    )
    part = partition_mini_batch(items, refine)  # searched only where groups are given ("compute")
    last_key = pad_key(entries[-1].sample if entries else None)  # the sample-count pads' key
    build = functools.partial(_micro_batch, entries, analyses, spec, last_key)
    return [
        PackedBatch(
            micro_batches=[build(b, pix) for b, pix in zip(row, part.slot_has_pixels, strict=True)],
            micro_batch_max_tokens=cap,
        )
        for row in part.ranks
    ]


def _micro_batch(
    entries: Sequence[PackEntry],
    analyses: Sequence[SampleAnalysis],
    spec: PackingSpec,
    last_key: tuple[str, str | None],
    indices: Sequence[int],
    vision_slot: bool,
) -> PackedMicroBatch:
    """The bin's samples (padding samples last), plus a synthetic-image pad in a vision slot
    without an image, or a lone text pad for an empty bin of a text slot."""
    order = sorted(indices, key=lambda i: (entries[i].sample.is_padding, i))
    chosen = [entries[i] for i in order]
    found = [analyses[i] for i in order]
    key = chosen[0].sample.isolation_key if chosen else last_key
    if vision_slot and all(a.kind != PIXELS for a in found):
        chosen.append(make_pad_sample(spec, key, grid=spec.image_pad_grid))
    elif not chosen:
        chosen.append(make_pad_sample(spec, key))
    found += [analyze_entry(pad, spec, None) for pad in chosen[len(found) :]]
    return build_micro_batch(chosen, spec, found)
