"""A batch's image results placed into its slots: what :func:`trainer_lib.materialize` returns.

Each image slot gets its ref's processed image, or zero features of the ref's grid where the ref
failed (``placeholder_zero_loss``; the sample's whole loss mask is then zeroed); the slots are
counted (:class:`MaterializeStats`, the ``mmref_trainer_*`` counters) and collated: with a
:class:`~trainer_lib.collate.FeatureWriter` (``dedup``) each distinct image once plus an
``image_index`` per slot, else one block per slot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import torch

from protocol.adapters import ImageAdapter, ProcessedImage
from protocol.errors import MMRefError
from protocol.structs import TrainingSample
from trainer_lib import metrics
from trainer_lib.collate import FeatureWriter

__all__ = ["MaterializeStats", "MaterializedBatch", "assemble_images"]


@dataclass
class MaterializeStats:
    """What one :func:`~trainer_lib.materialize` call did (also added to the ``mmref_trainer_*``
    counters of :mod:`trainer_lib.metrics`)."""

    images: int = 0
    """Image slots filled (one per ref occurrence)."""
    unique_refs: int = 0
    """Distinct ref strings."""
    processed: int = 0
    """Images actually read and run through the processor by this call (distinct resolvable refs
    not already in the step's :data:`~trainer_lib.materialize.Resolved`)."""
    placeholders: int = 0
    """Slots filled with zero features because the image was missing or unreadable."""
    zeroed_samples: int = 0
    """Samples whose whole loss mask was zeroed (one of their images was replaced)."""
    failed_by_code: dict[str, int] = field(default_factory=dict)
    """Distinct refs replaced by zero features, by error code (``asset_not_found``, ...)."""


@dataclass
class MaterializedBatch:
    """Features for a list of samples, in sample order then prompt order.

    ``features`` holds the family's HF tensors collated along dim 0 (Qwen-VL:
    ``pixel_values`` float32 ``[sum(t*h*w), C*T*P*P]``, ``image_grid_thw`` int64 ``[N, 3]``);
    empty when no sample has images. With ``dedup=True`` (the default) they hold each distinct image
    once (in first-seen order) and :attr:`image_index` maps every image slot to its row of
    ``image_grid_thw``: slot ``k``'s grid is ``image_grid_thw[image_index[k]]``.
    """

    samples: list[TrainingSample]
    """The input samples; those with a replaced image have ``loss_mask`` all False."""
    features: dict[str, torch.Tensor]
    images_per_sample: list[int]
    placeholder_refs: list[str] = field(default_factory=list)
    """Refs replaced by zero features (each once, in first-seen order)."""
    stats: MaterializeStats = field(default_factory=MaterializeStats)
    image_index: torch.Tensor | None = None
    """int64 ``[N_slots]`` with ``dedup=True``: the distinct image each slot shows; None with
    ``dedup=False`` or without images."""
    video_index: torch.Tensor | None = None
    """Videos (issue 44): ``features`` then also holds ``pixel_values_videos``, ``video_grid_thw``
    (Qwen2.5-VL: ``second_per_grid_ts``), each distinct video once with ``dedup``; this maps each
    video slot to its row (None without videos or with ``dedup=False``)."""
    videos_per_sample: list[int] | None = None
    """Per sample, its video refs (None: no sample has one; ``images_per_sample`` counts images)."""


def assemble_images(
    samples: Sequence[TrainingSample],
    per_sample: list[list[str]],
    results: Mapping[str, ProcessedImage | MMRefError | None],
    grids: dict[str, tuple[int, ...]],
    adapter: ImageAdapter,
    *,
    writer: FeatureWriter | None,
) -> MaterializedBatch:
    """Place each ref's result into every slot naming it (zero features of the ref's grid and a
    zeroed loss mask where it failed), count, and collate: with a ``writer`` (dedup) each distinct
    image once, those it does not hold yet (written on the pool) put now; else one block per slot.

    Args:
        samples: the batch; ``per_sample``: each one's image ref strings, in prompt order.
        results: per distinct ref, its processed image, the replaceable error that stood for it,
            or None (an image written into ``writer`` and not kept).
        grids: per distinct ref, its checked grid (the stand-in's shape).
    """
    stats = MaterializeStats(unique_refs=len(results))
    stats.failed_by_code = dict(Counter(r.code for r in results.values() if isinstance(r, MMRefError)))
    placeholders: dict[str, ProcessedImage] = {}
    items: list[ProcessedImage | None] = []  # one per slot, for the per-slot layout
    out_samples: list[TrainingSample] = []
    for sample, refs in zip(samples, per_sample, strict=True):
        failed = [ref for ref in refs if isinstance(results[ref], MMRefError)]
        for ref in failed:
            if ref not in placeholders:
                placeholders[ref] = adapter.zero_features(grids[ref])
        if writer is None:
            items += [_item(ref, results, placeholders) for ref in refs]
        if failed:
            stats.placeholders += len(failed)
            stats.zeroed_samples += 1
            sample = msgspec.structs.replace(sample, loss_mask=[False] * len(sample.loss_mask))
        out_samples.append(sample)
    stats.images = sum(map(len, per_sample))
    metrics.IMAGE_SLOTS.inc(stats.images)
    metrics.PLACEHOLDER_FALLBACKS.inc(stats.placeholders)
    metrics.ZEROED_SAMPLES.inc(stats.zeroed_samples)
    image_index, features = None, adapter.collate(items) if items else {}
    if writer is not None:
        index = writer.index
        image_index = torch.tensor([index[ref] for refs in per_sample for ref in refs], dtype=torch.int64)
        for ref in index:  # failed, or processed by an earlier call of the step
            if not writer.has(ref):
                writer.put(ref, _item(ref, results, placeholders))
        features = writer.features()
    return MaterializedBatch(
        samples=out_samples,
        features=features,
        image_index=image_index,
        images_per_sample=[len(refs) for refs in per_sample],
        placeholder_refs=list(placeholders),
        stats=stats,
    )


def _item(
    ref: str,
    results: Mapping[str, ProcessedImage | MMRefError | None],
    placeholders: dict[str, ProcessedImage],
) -> ProcessedImage | None:
    """The features a slot naming ``ref`` gets: the processed image (None: written, not kept), or
    its zero stand-in."""
    result = results[ref]
    return placeholders[ref] if isinstance(result, MMRefError) else result
