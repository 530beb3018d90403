"""The values an adapter returns: one image processed, one image read and decoded, one video processed;
and one ref checked against the adapter (what its read paths take, to check a ref once)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from PIL import Image

from protocol.refs import ContentRef, RawRefBody

__all__ = ["CheckedRef", "ProcessedImage", "ProcessedVideo", "RawImage"]


@dataclass(frozen=True)
class CheckedRef:
    """An ``mmraw`` ref, parsed and checked once against the adapter that reads it, with the grid
    the check returned: what the read paths (``ImageAdapter.read_raw`` / ``resolve_raw``,
    ``VideoMixin.read_video`` / ``resolve_video``) take from a caller that checked the ref itself
    (the server's resolver, before it queues any work), so the checks run once per item (issue 45).

    A caller makes one from the adapter's own check, e.g.
    ``CheckedRef(body, adapter.check_ref(body, ref=ref))``; the read paths trust it for its
    modality (:meth:`of`) and still check a bare body.
    """

    body: RawRefBody | ContentRef
    """The parsed ref (:func:`protocol.refs.parse_ref`)."""
    grid: tuple[int, ...]
    """The grid the ref claims, as the check returned it (bounded by the processor's limits)."""

    @staticmethod
    def of(
        body: RawRefBody | ContentRef | CheckedRef,
        modality: Literal["image", "video"],
        check: Callable[..., tuple[int, ...]],
        ref: str | None = None,
    ) -> CheckedRef:
        """``body`` checked once: as given when it is a :class:`CheckedRef` of ``modality``, else
        ``check(body, ref=ref)`` on the bare body (``ImageAdapter.check_ref``,
        ``VideoMixin.check_video_ref``, with their errors)."""
        if isinstance(body, CheckedRef):
            if body.body.modality == modality:
                return body
            body = body.body
        return CheckedRef(body, check(body, ref=ref))


@dataclass(frozen=True)
class ProcessedImage:
    """One image's processed features, exactly as the model consumes them.

    ``tensors`` maps the family's HF field names to tensors for this single image,
    e.g. Qwen-VL ``pixel_values`` float32 ``[t*h*w, C*T*P*P]`` and ``image_grid_thw``
    int64 ``[1, 3]``.
    """

    tensors: Mapping[str, torch.Tensor]
    grid: tuple[int, ...]
    num_placeholders: int
    sha256: str | None = None
    """Full hex sha256 of the raw image bytes, set by
    :meth:`~protocol.adapters.base.ImageAdapter.resolve_raw`."""

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class RawImage:
    """One ``mmraw`` ref read and decoded
    (:meth:`~protocol.adapters.base.ImageAdapter.read_raw`), before any processor."""

    image: Image.Image
    """The decoded RGB image (:func:`protocol.images.load_image`)."""
    data: bytes
    """The bytes read (their sha256 checked against the ref)."""
    sha256: str
    """Full hex sha256 of :attr:`data`."""
    grid: tuple[int, ...]
    """The grid the ref claims (checked against the processor's limits)."""


@dataclass(frozen=True)
class ProcessedVideo:
    """One video's processed features, exactly as the model consumes them (issue 44).

    ``tensors`` maps the family's HF field names to this one video's tensors: Qwen-VL
    ``pixel_values_videos`` ``[t*h*w, C*T*P*P]`` (float32, or uint8 with ``raw_pixels``) and
    ``video_grid_thw`` int64 ``[1, 3]``; Qwen2.5-VL also ``second_per_grid_ts`` float32 ``[1]``
    (seconds per temporal patch: ``temporal_patch_size / sampled fps``).
    """

    tensors: Mapping[str, torch.Tensor]
    grid: tuple[int, ...]
    """``video_grid_thw`` ``(t, h, w)``."""
    num_placeholders: int
    """``<|video_pad|>`` tokens in all (the runs: :func:`protocol.placeholder_counts.video_token_runs`)."""
    frames_indices: tuple[int, ...]
    """The sampled frame indices (what Qwen3-VL's prompt timestamps are computed from)."""
    fps: float
    """The source's frame rate, as the decoder reports it."""
    timestamps: tuple[float, ...] | None = None
    """Qwen3-VL: seconds of each temporal patch (the mean of its first and last frame's time), the
    text before each placeholder run (``<0.3 seconds>``) and vLLM's item field ``timestamps``."""
    sha256: str | None = None
    """Full hex sha256 of the file's bytes."""

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
