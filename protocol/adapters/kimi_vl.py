"""Kimi-VL (``kimi_vl``): Moonshot's image processor, written once here, and its adapter.

No library ships Kimi-VL's image processor: the checkpoints carry it as remote code
(``moonshotai/Kimi-VL-A3B-Instruct``: ``image_processing_kimi_vl.py``, class
``KimiVLImageProcessor``, loaded with ``trust_remote_code``); vLLM 0.32 vendors the model
(``vllm/model_executor/models/kimi_vl.py``) but not the processor (it calls the remote one
through ``AutoProcessor``), and transformers 5.19 has no ``kimi_vl``. So
:class:`KimiVLImageProcessor` below follows that remote ``KimiVLImageProcessor`` step for step,
on the same primitives (the pixels come from PIL and torchvision, not from arithmetic of ours):

1. ``rescale``: if ``(w // patch) * (h // patch) > in_token_limit``, scale both sides by
   ``sqrt(in_token_limit / ((w // patch) * (h // patch)))``, truncate with ``int()`` and resize
   with ``PIL.Image.resize(..., BICUBIC)``. Then, with ``pad_input``, pad right/bottom with zeros
   (``torchvision.transforms.functional.pad``) to a multiple of ``merge_kernel_size * patch``;
   without it, ``center_crop`` to a multiple of ``patch``. Finally, a side of ``>= 512`` patches
   raises ``ValueError("Exceed pos emb")`` (MoonViT's position-embedding limit).
2. ``to_tensor`` (``TF.to_tensor``: float32 in [0, 1]) and ``normalize``
   (``TF.normalize(image_mean, image_std)``).
3. ``patchify``: ``[C, H, W] -> [H/p * W/p, C, p, p]`` in row-major patch order,
   ``grid_hw = (H/p, W/p)``.

vLLM's own arithmetic for the placeholder count (``KimiVLProcessingInfo.get_num_image_tokens``)
assumes the padding branch; the tests compare every grid against it and every pixel against the
published algorithm. Layout (vLLM ``KimiVLMultiModalProcessor._get_mm_fields_config``):

- ``pixel_values``: float32 ``[h*w, 3, patch, patch]`` (vLLM's field: flat, sized by ``h*w``)
- ``image_grid_hws``: int64 ``[1, 2]`` = ``[h, w]`` in patches (vLLM's field: batched)
- placeholders: ``(h // kh) * (w // kw)`` ``<|media_pad|>`` tokens (``h*w // 4`` for the 2x2
  merge kernel); token id ``hf_config.media_placeholder_token_id``.

Kimi-VL has no ``mm_device_do_normalize`` support in vLLM 0.32 (the flag is forced off), so
pixels are always normalized float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, make_flat_list_of_images
from transformers.utils import TensorType

from protocol.adapters.base import ImageAdapter, ProcessedImage

__all__ = [
    "POS_EMB_LIMIT",
    "KimiVLAdapter",
    "KimiVLImageProcessor",
    "kimi_vl_target_size",
    "processor_target_size",
]

POS_EMB_LIMIT = 512
"""MoonViT's position-embedding limit: a side of this many patches or more is refused."""


def kimi_vl_target_size(
    width: int,
    height: int,
    *,
    patch_size: int,
    merge_kernel_size: Sequence[int],
    in_token_limit: int,
    pad_input: bool,
) -> tuple[tuple[int, int] | None, tuple[int, int]]:
    """Sizes the Kimi-VL processor produces for a ``width`` x ``height`` image (pixels).

    Returns:
        ``(resized, final)``: ``resized`` is the ``(w, h)`` the image is first resized to
        (``None`` when it fits ``in_token_limit``), ``final`` the ``(w, h)`` after padding (or
        cropping) that is cut into patches.

    Raises:
        ValueError: ``"Exceed pos emb"`` when a side reaches :data:`POS_EMB_LIMIT` patches, as
            the original processor raises.
    """
    w, h = width, height
    resized = None
    patches = (w // patch_size) * (h // patch_size)
    if patches > in_token_limit:
        scale = math.sqrt(in_token_limit / patches)
        w, h = int(w * scale), int(h * scale)
        resized = (w, h)
    if pad_input:
        unit_h, unit_w = merge_kernel_size[0] * patch_size, merge_kernel_size[1] * patch_size
        w, h = w + (unit_w - w % unit_w) % unit_w, h + (unit_h - h % unit_h) % unit_h
    else:
        w, h = w - w % patch_size, h - h % patch_size
    if w // patch_size >= POS_EMB_LIMIT or h // patch_size >= POS_EMB_LIMIT:
        raise ValueError("Exceed pos emb")
    return resized, (w, h)


def processor_target_size(
    processor: Any, width: int, height: int
) -> tuple[tuple[int, int] | None, tuple[int, int]]:
    """:func:`kimi_vl_target_size` with ``processor``'s fields (``patch_size``,
    ``merge_kernel_size``, ``in_token_limit``, ``pad_input``): any Kimi-VL image processor, ours or
    the remote-code one vLLM loads on a server."""
    return kimi_vl_target_size(
        width,
        height,
        patch_size=processor.patch_size,
        merge_kernel_size=processor.merge_kernel_size,
        in_token_limit=processor.in_token_limit,
        pad_input=processor.pad_input,
    )


class KimiVLImageProcessor(BaseImageProcessor):
    """Kimi-VL's image processor (``image_processing_kimi_vl.KimiVLImageProcessor``), see the module doc.

    Loads from a Kimi-VL ``preprocessor_config.json`` with ``from_pretrained`` like the
    original (same field names and defaults: ``patch_size`` 14, ``pad_input`` False, CLIP
    mean/std, ``in_token_limit`` 4096, ``merge_kernel_size`` [2, 2]; the released checkpoints
    set ``pad_input`` True and mean/std 0.5).
    """

    model_type = "kimi_vl"
    model_input_names: ClassVar[list[str]] = ["pixel_values", "image_grid_hws"]

    def __init__(
        self,
        patch_size: int = 14,
        pad_input: bool = False,
        image_mean: Sequence[float] = tuple(OPENAI_CLIP_MEAN),
        image_std: Sequence[float] = tuple(OPENAI_CLIP_STD),
        in_token_limit: int = 4096,
        merge_kernel_size: Sequence[int] = (2, 2),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.patch_size = patch_size
        self.pad_input = pad_input
        self.image_mean = list(image_mean)
        self.image_std = list(image_std)
        self.in_token_limit = in_token_limit
        self.merge_kernel_size = list(merge_kernel_size)

    def target_size(self, width: int, height: int) -> tuple[tuple[int, int] | None, tuple[int, int]]:
        """:func:`kimi_vl_target_size` with this processor's fields."""
        return processor_target_size(self, width, height)

    def fit(self, image: Image.Image) -> Image.Image:
        """Step 1 of the module doc: token-limit resize, then pad (or crop) to the patch grid."""
        from torchvision.transforms import functional as TF

        resized, (w, h) = self.target_size(*image.size)
        if resized is not None:
            image = image.resize(resized, Image.Resampling.BICUBIC)
        if self.pad_input:
            pad_w, pad_h = w - image.width, h - image.height
            image = TF.pad(image, [0, 0, pad_w, pad_h])
        else:
            image = TF.center_crop(image, [h, w])
        return image

    def patchify(self, image: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """``[C, H, W] -> ([H/p * W/p, C, p, p], (H/p, W/p))``."""
        p = self.patch_size
        c, h, w = image.shape
        patches = image.reshape(c, h // p, p, w // p, p).permute(1, 3, 0, 2, 4)
        return patches.contiguous().view(-1, c, p, p), (h // p, w // p)

    def preprocess(
        self, images: Any, return_tensors: str | TensorType | None = None, **kwargs: Any
    ) -> BatchFeature:
        """Process PIL images into ``pixel_values`` and ``image_grid_hws`` (the original's output).

        Raises:
            ValueError: ``"Exceed pos emb"`` (see :func:`kimi_vl_target_size`); unknown keyword
                arguments (the original takes none).
        """
        from torchvision.transforms import functional as TF

        if kwargs:
            raise ValueError(f"KimiVLImageProcessor.preprocess takes no options, got {sorted(kwargs)}")
        pixel_values, grids = [], []
        for image in make_flat_list_of_images(images):
            if not isinstance(image, Image.Image):
                raise ValueError(f"KimiVLImageProcessor expects PIL images, got {type(image).__name__}")
            tensor = TF.to_tensor(self.fit(image).convert("RGB"))
            tensor = TF.normalize(tensor, self.image_mean, self.image_std)
            patches, grid = self.patchify(tensor)
            pixel_values.append(patches)
            grids.append(grid)
        data = {"pixel_values": torch.cat(pixel_values), "image_grid_hws": np.array(grids)}
        return BatchFeature(data=data, tensor_type=return_tensors)


_PIXEL_FIELDS = ("patch_size", "pad_input", "image_mean", "image_std", "in_token_limit", "merge_kernel_size")


class KimiVLAdapter(ImageAdapter):
    """Adapter for ``kimi_vl``.

    Wraps a Kimi-VL image processor: on a server the instance vLLM loaded from the checkpoint
    (its remote code), in a trainer :class:`KimiVLImageProcessor` (see
    :meth:`load_image_processor`). Both are called through ``preprocess(images,
    return_tensors)``, the interface vLLM's ``KimiVLProcessor`` uses.

    Raises:
        ValueError: the processor has ``pad_input`` False: vLLM 0.32 counts Kimi-VL placeholders
            for padded images only, so features and prompt would disagree.
    """

    model_types: ClassVar[tuple[str, ...]] = ("kimi_vl",)
    grid_field: ClassVar[str] = "image_grid_hws"
    grid_len: ClassVar[int] = 2
    rope: ClassVar[str] = "1d"
    vllm_modality: ClassVar[str] = "image"
    """The modality key vLLM uses for this family's items (``mm_hashes``, ``mm_placeholders``)."""

    def __init__(self, image_processor: Any, *, family: str, device: str = "cpu") -> None:
        if not image_processor.pad_input:
            raise ValueError(
                "Kimi-VL processor with pad_input=False: vLLM 0.32 "
                "(KimiVLProcessingInfo.get_num_image_tokens) counts placeholders for padded images only"
            )
        super().__init__(image_processor, family=family, device=device)

    def fingerprint_fields(self) -> dict[str, Any]:
        p = self.image_processor
        fields = {name: getattr(p, name) for name in _PIXEL_FIELDS}
        fields["image_mean"] = [float(v) for v in p.image_mean]
        fields["image_std"] = [float(v) for v in p.image_std]
        fields["merge_kernel_size"] = [int(v) for v in p.merge_kernel_size]
        fields["resample"] = "bicubic"  # fixed in the algorithm (PIL BICUBIC), named for the record
        return fields

    def grid_for_size(self, width: int, height: int) -> tuple[int, int]:
        """``(h, w)`` in patches for an image of this size.

        Raises:
            ValueError: ``"Exceed pos emb"`` (a side of 512 patches or more after padding).
        """
        _, (w, h) = processor_target_size(self.image_processor, width, height)
        return (h // self.image_processor.patch_size, w // self.image_processor.patch_size)

    def num_placeholders(self, grid: Sequence[int]) -> int:
        h, w = grid
        kh, kw = self.image_processor.merge_kernel_size
        return (h // kh) * (w // kw)

    def grid_multiples(self) -> tuple[int, int]:
        """``(kh, kw)`` = the processor's ``merge_kernel_size``: with ``pad_input`` (required, see
        the class doc) :func:`kimi_vl_target_size` pads each side to a multiple of
        ``merge_kernel_size * patch_size`` pixels, so ``h`` is a multiple of ``kh``, ``w`` of ``kw``."""
        kh, kw = (int(k) for k in self.image_processor.merge_kernel_size)
        return (kh, kw)

    def grid_limits(self) -> tuple[tuple[int, int], int]:
        """Sides below :data:`POS_EMB_LIMIT` patches, and at most
        ``L + (1 + kh) * side + (1 + kw) * side + kh * kw`` patches in all (``L`` =
        ``in_token_limit``, ``side`` = 511, ``(kh, kw)`` the merge kernel).

        Why (:func:`kimi_vl_target_size`): an image of ``a x b`` whole patches over ``L`` is scaled
        by ``s = sqrt(L / (a b))``, so its sides become ``u < (a + 1) s`` and ``v < (b + 1) s``
        patches and ``u v < L + b s^2 + a s^2 + s^2 < L + u + v + 1`` (``s < 1``); padding then adds
        fewer than ``kw`` and ``kh`` patches to them, so ``W H < u v + kh u + kw v + kh kw``, with
        ``u, v <= side``. (The resize is computed from whole patches: the scaled image can hold more
        than ``L`` of them, e.g. 5136 at ``L`` = 4096 for an 8070 x 193 photo.)"""
        p = self.image_processor
        side = POS_EMB_LIMIT - 1
        kh, kw = (int(k) for k in p.merge_kernel_size) if p.pad_input else (1, 1)
        most = p.in_token_limit + (1 + kh) * side + (1 + kw) * side + kh * kw
        return (side, side), most

    def process(self, image: Image.Image, *, raw_pixels: bool = False) -> ProcessedImage:
        """Run the processor on one RGB image.

        Raises:
            NotImplementedError: ``raw_pixels`` (vLLM 0.32 forces ``mm_device_do_normalize``
                off for Kimi-VL; its pixels are always normalized).
            ValueError: ``"Exceed pos emb"``.
        """
        if raw_pixels:
            raise NotImplementedError(
                "Kimi-VL has no mm_device_do_normalize in vLLM 0.32: pixels are always normalized"
            )
        out = self.image_processor.preprocess([image], return_tensors="pt")
        return self._processed(out["pixel_values"], out["image_grid_hws"])

    def pixel_shape(self, grid: Sequence[int]) -> tuple[int, ...]:
        """``(h*w, 3, P, P)``."""
        p = self.image_processor.patch_size
        h, w = (int(g) for g in grid)
        return (h * w, 3, p, p)

    def placeholder_token_id(self, hf_config: Any) -> int:
        """``media_placeholder_token_id`` (``<|media_pad|>``), as vLLM's ``KimiVLProcessingInfo`` reads it."""
        return int(hf_config.media_placeholder_token_id)

    @classmethod
    def load_image_processor(cls, model_dir: Any, *, backend: str | None = None) -> KimiVLImageProcessor:
        """:class:`KimiVLImageProcessor` from a model folder's ``preprocessor_config.json`` (no remote code).

        Raises:
            ValueError: a ``backend`` (Kimi-VL has one processor).
        """
        if backend is not None:
            raise ValueError(f"kimi_vl has one processor backend; backend={backend!r} is not an option")
        return KimiVLImageProcessor.from_pretrained(model_dir, local_files_only=True)
