"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: one adapter, transformers' ``Qwen2VLImageProcessor``
(videos: :class:`~protocol.adapters.video.VideoMixin`, the model's video processor).

All three families use transformers' ``Qwen2VLImageProcessor`` (torchvision backend)
or ``Qwen2VLImageProcessorPil`` (PIL backend) with different configs (Qwen2/2.5: patch
14, CLIP mean/std; Qwen3: patch 16, mean/std 0.5). Layout (transformers
``image_processing_qwen2_vl.py``; vLLM ``qwen2_vl.py::_create_qwen2vl_field_factory``):

- ``pixel_values``: float32 ``[t*h*w, C * temporal_patch_size * patch_size**2]``
- ``image_grid_thw``: int64 ``[1, 3]`` = ``[t, h, w]`` in patches
- placeholders: ``t*h*w // merge_size**2`` ``<|image_pad|>`` tokens per image.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from protocol.adapters.base import ImageAdapter, ProcessedImage
from protocol.adapters.pixel_fields import QWEN_PIXEL_FIELDS, processor_fields
from protocol.adapters.video import VideoMixin

__all__ = ["MAX_RATIO", "QwenVLAdapter"]

MAX_RATIO = 200
"""``smart_resize`` refuses images whose aspect ratio exceeds this (transformers
``image_processing_pil_qwen2_vl.py``)."""


class QwenVLAdapter(VideoMixin, ImageAdapter):
    """Adapter for ``qwen2_vl``, ``qwen2_5_vl`` and ``qwen3_vl``."""

    model_types: ClassVar[tuple[str, ...]] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
    grid_field: ClassVar[str] = "image_grid_thw"
    rope: ClassVar[str] = "mrope"

    def fingerprint_fields(self) -> dict[str, Any]:
        return processor_fields(self.image_processor, QWEN_PIXEL_FIELDS)

    def grid_for_size(self, width: int, height: int) -> tuple[int, int, int]:
        """``[1, h, w]`` from transformers' ``smart_resize`` (factor = patch * merge).

        Raises:
            ValueError: aspect ratio above 200 (from ``smart_resize``).
        """
        p = self.image_processor
        rh, rw = smart_resize(
            height,
            width,
            factor=p.patch_size * p.merge_size,
            min_pixels=p.size["shortest_edge"],
            max_pixels=p.size["longest_edge"],
        )
        return (1, rh // p.patch_size, rw // p.patch_size)

    def num_placeholders(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return t * h * w // self.image_processor.merge_size**2

    def grid_multiples(self) -> tuple[int, int, int]:
        """``(1, merge_size, merge_size)``: ``smart_resize`` makes both sides multiples of
        ``patch_size * merge_size`` and ``patchify`` reshapes each side by ``merge_size``
        (transformers ``image_processing_qwen2_vl.py``), so ``h`` and ``w`` are multiples of
        ``merge_size``. ``t`` is 1 for an image (``_preprocess`` emits ``[1, grid_h, grid_w]``: the
        one frame is repeated ``temporal_patch_size`` times inside each patch, not along ``t``);
        :meth:`grid_limits` pins it to 1."""
        m = int(self.image_processor.merge_size)
        return (1, m, m)

    def grid_limits(self) -> tuple[tuple[int, int, int], int]:
        """One frame (an image is one temporal patch); sides and pixels as transformers'
        ``smart_resize`` can produce them: at most max pixels (``size["longest_edge"]``), except
        where it forces a side up to one factor (``patch * merge``) at an aspect ratio of up to
        :data:`MAX_RATIO`, or rounds up to reach min pixels (``size["shortest_edge"]``)."""
        p = self.image_processor
        side, most = self.side_limits(p.size["shortest_edge"], p.size["longest_edge"], p)
        return (1, side, side), most

    @staticmethod
    def side_limits(lo: int, hi: int, p: Any) -> tuple[int, int]:
        """``(patches per side, patches per frame)`` at most, for min/max pixels ``lo``/``hi`` and
        processor ``p``'s patch and merge sizes (see :meth:`grid_limits`)."""
        f = p.patch_size * p.merge_size
        long_px = max(hi // f, math.isqrt(MAX_RATIO * hi) + 1, math.isqrt(MAX_RATIO * lo) + 1 + f)
        forced = f * (math.isqrt(MAX_RATIO * hi) + 1)  # one side forced up to f
        rounded_up = lo + f * (long_px + math.isqrt(lo) + 1) + f * f  # ceil() of both sides
        most_px = max(hi, forced, rounded_up)
        return long_px // p.patch_size, most_px // p.patch_size**2

    def process(self, image: Image.Image, *, raw_pixels: bool = False) -> ProcessedImage:
        kwargs: dict[str, Any] = {"return_tensors": "pt"}
        if raw_pixels:  # what vLLM's MultiModalConfig.merge_mm_processor_kwargs passes
            kwargs.update(do_rescale=False, do_normalize=False)
        if self.backend == "torchvision":
            kwargs["device"] = self.device
        out = self.image_processor(images=[image], **kwargs)
        return self._processed(out["pixel_values"], out["image_grid_thw"])

    def pixel_shape(self, grid: Sequence[int]) -> tuple[int, ...]:
        """``(t*h*w, 3*T*P*P)`` (T: temporal patch size)."""
        p = self.image_processor
        t, h, w = (int(g) for g in grid)
        return (t * h * w, 3 * p.temporal_patch_size * p.patch_size**2)

    def placeholder_token_id(self, hf_config: Any) -> int:
        return int(hf_config.image_token_id)
