"""Videos of a batch rematerialized from their refs, exactly as the server computes them (issue 44).

:func:`trainer_lib.materialize` hands the refs whose ``RawMMRef.modality`` is ``"video"`` here:
each distinct ref is checked (:meth:`~protocol.adapters.VideoMixin.check_video_ref`: family, the
required video fingerprint, the grid bounded; the ``RawMMRef``'s grid and placeholder count
against it) before any file is read, then resolved once per step on the materialize pool by
:meth:`~protocol.adapters.VideoMixin.resolve_video`, the path the server runs. The features hold
each distinct video once with a ``video_index`` per video slot (``dedup``), or one copy per slot.
A missing or unreadable video is replaced as an image is (zero features of its grid, the sample's
loss zeroed) under ``placeholder_zero_loss``; other errors always raise.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from protocol.adapters import ProcessedVideo, VideoMixin
from protocol.adapters.values import CheckedRef
from protocol.errors import (
    GridMismatch,
    MMRefError,
    PlaceholderMismatch,
    UnsupportedFamily,
)
from protocol.store import ImageSource
from protocol.structs import RawMMRef, TrainingSample
from protocol.videos import frame_limits
from trainer_lib.config import MaterializeOptions
from trainer_lib.pool import run_on_pool
from trainer_lib.sources import raw_body

__all__ = [
    "VIDEO_FEATURES",
    "VideoFeatures",
    "add_videos",
    "materialize_videos",
    "split_video_features",
    "video_refs",
]

VIDEO_FEATURES = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
"""The feature names a family's videos add (``VideoMixin.collate_videos``: the HF processor's)."""


@dataclass
class VideoFeatures:
    """The videos of a batch, in sample order then prompt order."""

    features: dict[str, torch.Tensor]
    """``pixel_values_videos`` ``[sum(t*h*w), C*T*P*P]``, ``video_grid_thw`` int64 ``[N, 3]``
    (Qwen2.5-VL: ``second_per_grid_ts`` float32 ``[N]``); empty without videos."""
    videos_per_sample: list[int]
    video_index: torch.Tensor | None = None
    """int64 ``[N_slots]`` with ``dedup``: slot ``k``'s row of ``video_grid_thw``; else None."""
    failed_samples: set[int] = field(default_factory=set)
    """Samples one of whose videos was replaced by zero features (their loss is to be zeroed)."""
    placeholder_refs: list[str] = field(default_factory=list)
    failed_by_code: dict[str, int] = field(default_factory=dict)
    processed: int = 0
    """Distinct videos read and processed by this call."""


def video_refs(sample: TrainingSample) -> list[RawMMRef]:
    """The sample's video refs, in prompt order."""
    return [r for r in sample.mm_refs.items if r.modality == "video"] if sample.mm_refs else []


def materialize_videos(
    samples: Sequence[TrainingSample],
    adapter: VideoMixin,
    source: ImageSource,
    options: MaterializeOptions,
    *,
    dedup: bool = True,
    resolved: dict[str, Any] | None = None,
) -> VideoFeatures:
    """Features of every video slot of ``samples``.

    Args:
        source: where the videos are read (``sources.image_source`` of ``materialize``'s source).
        options: ``materialize``'s: its pool's workers, its policy (``replace_missing``: zero
            stand-ins for a missing or unreadable video), pixel mode, and the server's limits:
            ``max_video_bytes`` per file, ``max_image_pixels`` per frame
            (:func:`protocol.videos.frame_limits`).
        dedup: each distinct video once plus ``video_index``; False: one copy per slot.
        resolved: the step's :data:`trainer_lib.materialize.Resolved` (ref -> processed video).

    Raises:
        InvalidRef, UnsupportedFamily, FingerprintMismatch, GridMismatch: a ref the adapter
            cannot read, or a ``RawMMRef`` grid other than its ref's.
        PlaceholderMismatch: a ``RawMMRef`` count other than its grid's.
        MMRefError: any read or decode error (``replace_missing``: only those it may not replace).
    """
    if not isinstance(adapter, VideoMixin):
        raise UnsupportedFamily(f"the {adapter.family} adapter has no video path (a video ref in the batch)")
    per_sample = [video_refs(s) for s in samples]
    checked = _checked(per_sample, adapter)
    resolved = {} if resolved is None else resolved
    todo = [(ref, c) for ref, c in checked.items() if ref not in resolved]
    resolve = functools.partial(_resolve, adapter=adapter, source=source, options=options)
    done = dict(zip((ref for ref, _ in todo), run_on_pool(resolve, todo, options.max_workers), strict=True))
    resolved.update(done)
    results = {ref: resolved[ref] for ref in checked}
    out = VideoFeatures(features={}, videos_per_sample=[len(refs) for refs in per_sample])
    out.processed = sum(1 for r in done.values() if not isinstance(r, MMRefError))
    stand_ins = {
        ref: _zeros(adapter, checked[ref].grid) for ref, r in results.items() if isinstance(r, MMRefError)
    }
    for r in results.values():
        if isinstance(r, MMRefError):
            out.failed_by_code[r.code] = out.failed_by_code.get(r.code, 0) + 1
    out.placeholder_refs = list(stand_ins)
    out.failed_samples = {i for i, refs in enumerate(per_sample) if any(r.ref in stand_ins for r in refs)}
    items = {ref: stand_ins.get(ref, r) for ref, r in results.items()}
    if not items:
        return out
    if dedup:
        index = {ref: k for k, ref in enumerate(items)}
        out.features = adapter.collate_videos(list(items.values()))
        out.video_index = torch.tensor([index[r.ref] for refs in per_sample for r in refs], dtype=torch.int64)
    else:
        out.features = adapter.collate_videos([items[r.ref] for refs in per_sample for r in refs])
    return out


def split_video_features(
    features: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(image features, video features)`` of a batch's features (:data:`VIDEO_FEATURES`)."""
    videos = {k: v for k, v in features.items() if k in VIDEO_FEATURES}
    return {k: v for k, v in features.items() if k not in videos}, videos


def add_videos(batch: Any, videos: VideoFeatures) -> None:
    """Merge ``videos`` into a :class:`~trainer_lib.materialize.MaterializedBatch` of the same
    samples: features, ``video_index``, ``videos_per_sample``, counts; the loss of a sample whose
    video was replaced zeroed."""
    batch.features.update(videos.features)
    batch.video_index, batch.videos_per_sample = videos.video_index, videos.videos_per_sample
    batch.placeholder_refs += videos.placeholder_refs
    stats = batch.stats
    stats.processed += videos.processed
    for code, n in videos.failed_by_code.items():
        stats.failed_by_code[code] = stats.failed_by_code.get(code, 0) + n
    for i in sorted(videos.failed_samples):
        sample = batch.samples[i]
        stats.placeholders += sum(1 for r in video_refs(sample) if r.ref in videos.placeholder_refs)
        if any(sample.loss_mask):
            stats.zeroed_samples += 1
            batch.samples[i] = msgspec.structs.replace(sample, loss_mask=[False] * len(sample.loss_mask))


def _checked(per_sample: list[list[RawMMRef]], adapter: VideoMixin) -> dict[str, CheckedRef]:
    """Every distinct video ref checked once (first-seen order: its parsed body and grid, what
    ``resolve_video`` takes without checking again); each slot's ``RawMMRef`` grid and count
    checked against them."""
    out: dict[str, CheckedRef] = {}
    for i, refs in enumerate(per_sample):
        for r in refs:
            if r.ref not in out:
                body = raw_body(r.ref)
                out[r.ref] = CheckedRef(body, adapter.check_video_ref(body, ref=r.ref))
            grid = out[r.ref].grid
            if tuple(r.grid) != grid:
                raise GridMismatch(
                    f"sample {i}: RawMMRef grid {r.grid} != its video ref's {list(grid)}", ref=r.ref
                )
            want = adapter.video_num_placeholders(grid)
            if r.num_placeholders != want:
                raise PlaceholderMismatch(
                    f"sample {i}: video ref claims {r.num_placeholders} placeholders, "
                    f"its grid {r.grid} gives {want}",
                    ref=r.ref,
                )
    return out


def _resolve(
    ref_and_body: tuple[str, CheckedRef],
    *,
    adapter: VideoMixin,
    source: ImageSource,
    options: MaterializeOptions,
) -> ProcessedVideo | MMRefError:
    """``adapter.resolve_video`` of one checked ref (not checked again) within ``options``' limits;
    with ``options.replace_missing``, a replaceable error is returned."""
    ref, body = ref_and_body
    try:
        return adapter.resolve_video(
            body,
            source,
            ref=ref,
            raw_pixels=options.raw_pixels,
            max_bytes=options.max_video_bytes,
            limits=frame_limits(options.max_image_pixels),
        )
    except MMRefError as e:
        if options.replaces(e):
            return e
        raise


def _zeros(adapter: VideoMixin, grid: tuple[int, ...]) -> ProcessedVideo:
    """Zero features of a video grid (float32, the trainer's normalized layout)."""
    vp = adapter.video_processor
    t, h, w = grid
    tensors = {
        "pixel_values_videos": torch.zeros((t * h * w, 3 * vp.temporal_patch_size * vp.patch_size**2)),
        "video_grid_thw": torch.tensor([list(grid)], dtype=torch.int64),
    }
    if adapter._video_family().second_per_grid_ts:
        sampling = adapter.video_sampling
        tensors["second_per_grid_ts"] = torch.tensor(
            [vp.temporal_patch_size / sampling.fps], dtype=torch.float32
        )
    return ProcessedVideo(
        tensors=tensors,
        grid=grid,
        num_placeholders=adapter.video_num_placeholders(grid),
        frames_indices=(),
        fps=0.0,
    )
