"""The adapter contract: one family's image processing behind one small interface (docs/PROTOCOL.md §5).

An adapter wraps the model's own HF image processor (never a re-implementation)
and knows the family's tensor names, grid shape and placeholder arithmetic. The
server plugin and the trainer library both resolve refs through
:meth:`ImageAdapter.resolve_raw`, so the two sides compute pixels by one code path.

Imports torch and transformers (unlike the rest of :mod:`protocol`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from PIL import Image

from protocol.adapters.offload import RefForm, store_and_ref
from protocol.adapters.values import CheckedRef, ProcessedImage, RawImage
from protocol.errors import (
    FingerprintMismatch,
    GridMismatch,
    ImageUnreadable,
    InvalidRef,
    UnsupportedFamily,
)
from protocol.fingerprint import layout_fingerprint
from protocol.images import DEFAULT_MAX_IMAGE_PIXELS, load_image
from protocol.refs import ContentRef, RawRefBody
from protocol.roots import AssetRoot, AssetRoots
from protocol.store import DEFAULT_MAX_IMAGE_BYTES, AssetStore, ImageSource
from protocol.structs import RawMMRef

__all__ = ["ImageAdapter", "ProcessedImage", "RawImage", "RefForm"]


class ImageAdapter(ABC):
    """Base class of the per-family adapters.

    Args:
        image_processor: the model's HF image processor instance (the server passes the
            one vLLM itself uses, the trainer loads it from the model folder).
        family: the HF ``model_type`` this adapter serves, e.g. ``"qwen2_vl"``.
        device: where the processor computes (torchvision backend only); part of the
            fingerprint, since CPU and CUDA pixels differ by a few uint8 steps.
    """

    model_types: ClassVar[tuple[str, ...]]
    """HF ``model_type`` values this adapter class serves (the registry's keys)."""
    grid_field: ClassVar[str]
    """Name of the grid tensor and of the grid key in the ref payload."""
    rope: ClassVar[str]
    """How the family's language model takes positions: ``"mrope"`` (``position_ids [4, 1, L]``,
    rows 1-3 from transformers' ``get_rope_index``; the trainer packs these) or ``"1d"`` (plain
    RoPE ``[1, L]``). Every family sets it (tested against the registry)."""
    vllm_modality: ClassVar[str] = "image"
    """The modality key vLLM files this family's items under (Kimi K2.5: ``"vision_chunk"``);
    refs themselves always say ``"image"``."""
    serial_processing: ClassVar[bool] = False
    """Whether the processor must run on one thread at a time in a process (Kimi K2.5)."""

    def __init__(self, image_processor: Any, *, family: str, device: str = "cpu") -> None:
        if family not in self.model_types:
            raise UnsupportedFamily(f"{type(self).__name__} serves {list(self.model_types)}, not {family!r}")
        self.image_processor = image_processor
        self.family = family
        self.device = device
        self.fingerprint = layout_fingerprint(
            family=family,
            processor_class=type(image_processor).__name__,
            backend=self.backend,
            device=device,
            fields=self.fingerprint_fields(),
        )

    @property
    def backend(self) -> str:
        """``"torchvision"`` or ``"pil"``: which transformers backend computes pixels."""
        from transformers.image_processing_backends import TorchvisionBackend

        return "torchvision" if isinstance(self.image_processor, TorchvisionBackend) else "pil"

    @classmethod
    def load_image_processor(cls, model_dir: str | os.PathLike[str], *, backend: str | None = None) -> Any:
        """The image processor vLLM would use for a local model folder (no hub access).

        Default: transformers' ``AutoImageProcessor`` with ``backend`` (None: transformers' default,
        torchvision when installed, which is also what vLLM uses). Families whose processor
        transformers cannot load the way vLLM serves it override this.
        """
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(model_dir, backend=backend, local_files_only=True)

    # --- family specifics -------------------------------------------------------------

    @abstractmethod
    def fingerprint_fields(self) -> dict[str, Any]:
        """Every processor field that changes pixels or grids."""

    @abstractmethod
    def grid_for_size(self, width: int, height: int) -> tuple[int, ...]:
        """The grid the processor will produce for an RGB image of this size (pixels)."""

    @abstractmethod
    def num_placeholders(self, grid: Sequence[int]) -> int:
        """Placeholder tokens one image with this grid takes in the prompt."""

    @abstractmethod
    def grid_limits(self) -> tuple[tuple[int, ...], int]:
        """``(per-axis maxima, most patches)``: an upper bound on every grid the processor can
        produce, from its own size limits (what :meth:`check_grid` enforces)."""

    @abstractmethod
    def grid_multiples(self) -> tuple[int, ...]:
        """What each grid entry must be a multiple of, one per entry, read from the processor's own
        config (its merge size: the vision tower merges ``merge x merge`` patches into one token, so
        the processor pads or resizes every side to a multiple of it). :meth:`check_grid` refuses
        any other grid: vLLM's vision tower cannot reshape one (an error inside the engine) and
        :meth:`num_placeholders` would round its count down."""

    @abstractmethod
    def process(self, image: Image.Image, *, raw_pixels: bool = False) -> ProcessedImage:
        """Run the HF image processor on one RGB image.

        Args:
            raw_pixels: produce what vLLM's processor produces when
                ``mm_device_do_normalize`` is on (no rescale/normalize; the model
                normalizes on device). The trainer always uses False.
        """

    @abstractmethod
    def pixel_shape(self, grid: Sequence[int]) -> tuple[int, ...]:
        """The shape of one image's ``pixel_values`` for ``grid``: its patches first (the rows
        :meth:`collate` concatenates), then one patch's layout (Qwen-VL ``(t*h*w, C*T*P*P)``)."""

    def zero_features(self, grid: Sequence[int]) -> ProcessedImage:
        """Zero features for ``grid`` (missing-image policy, pad images): float32 pixels of
        :meth:`pixel_shape` (the trainer's normalized layout) and the grid, int64 ``[1, len(grid)]``."""
        return self._processed(
            torch.zeros(self.pixel_shape(grid), dtype=torch.float32),
            torch.tensor([[int(g) for g in grid]], dtype=torch.int64),
        )

    @abstractmethod
    def placeholder_token_id(self, hf_config: Any) -> int:
        """The image placeholder token id (e.g. ``<|image_pad|>``) from the model's HF config."""

    # --- shared behaviour -------------------------------------------------------------

    def _processed(self, pixel_values: torch.Tensor, grid_tensor: torch.Tensor) -> ProcessedImage:
        """One image's :class:`ProcessedImage` from its pixels and its ``[1, grid_len]`` int grid
        tensor (stored under :attr:`grid_field`, as the HF processor names it)."""
        grid = tuple(int(g) for g in grid_tensor[0])
        return ProcessedImage(
            tensors={"pixel_values": pixel_values, self.grid_field: grid_tensor},
            grid=grid,
            num_placeholders=self.num_placeholders(grid),
        )

    def payload(self, grid: Sequence[int]) -> dict[str, list[int]]:
        """The adapter-owned ref payload for ``grid``."""
        return {self.grid_field: [int(g) for g in grid]}

    def grid_from_payload(self, payload: Mapping[str, Any], *, ref: str | None = None) -> tuple[int, ...]:
        """Read and validate the grid a ref payload claims (bounded by :meth:`check_grid`).

        Raises:
            InvalidRef: missing/extra keys or a grid that is not positive ints of the right length.
            GridMismatch: a grid larger than the processor can produce.
        """
        grid = payload.get(self.grid_field) if set(payload) == {self.grid_field} else None
        if (
            not isinstance(grid, list)
            or len(grid) != self.grid_len
            or not all(type(g) is int and 0 < g < 1 << 20 for g in grid)
        ):
            raise InvalidRef(
                f"{self.family} payload must be {{{self.grid_field!r}: [{self.grid_len} positive ints]}}, "
                f"got {str(dict(payload))[:120]}",
                ref=ref,
            )
        return self.check_grid(grid, ref=ref)

    def check_grid(
        self, grid: Sequence[int], *, ref: str | None = None, bounded: bool = True
    ) -> tuple[int, ...]:
        """Bound a claimed grid before anything is sized by it (a stand-in image, an item layout).

        Every grid the processor can produce passes (its per-axis maxima and patch total from
        :meth:`grid_limits`, each entry a multiple of :meth:`grid_multiples`); a forged
        ``[1, 2048, 2048]`` does not, so no tensor is ever allocated for it, nor does a
        ``[1, 3, 3]`` no merge-2 processor emits (the engine's vision tower cannot reshape it).

        Args:
            bounded: also hold it to :meth:`grid_limits` (False: an item that carries its own
                pixel rows, nothing sized from the claim; a client may render with larger
                processor limits, as vLLM's own render route lets it).

        Returns:
            The grid as a tuple of ints.

        Raises:
            GridMismatch: wrong length, an entry < 1, an axis or the patch total over the limits,
                an entry that is not a multiple of the family's merge size.
        """
        axes, most = self.grid_limits()
        values = tuple(grid)
        if len(values) != self.grid_len or not all(type(g) is int and g >= 1 for g in values):
            raise GridMismatch(f"{self.grid_field} must be {self.grid_len} positive ints", ref=ref)
        patches = math.prod(values)
        if bounded and (any(g > m for g, m in zip(values, axes, strict=True)) or patches > most):
            raise GridMismatch(
                f"{self.grid_field} {list(values)} ({patches} patches) exceeds what the {self.family} "
                f"processor can produce (per axis at most {list(axes)}, {most} patches in all)",
                ref=ref,
            )
        steps = self.grid_multiples()
        if any(g % s for g, s in zip(values, steps, strict=True)):
            raise GridMismatch(
                f"{self.grid_field} {list(values)} is not a grid the {self.family} processor can "
                f"produce: each entry must be a multiple of {list(steps)} (the merge size)",
                ref=ref,
            )
        return values

    grid_len: ClassVar[int] = 3
    """Entries in one image's grid (Qwen ``[t, h, w]``: 3; Kimi-VL ``[h, w]``: 2)."""

    def check_ref(self, body: RawRefBody | ContentRef, *, ref: str | None = None) -> tuple[int, ...]:
        """Check a ref's family and fingerprint against this adapter; return its claimed grid.

        Raises:
            UnsupportedFamily: the ref is for another family.
            FingerprintMismatch: the ref names a fingerprint other than this adapter's.
            InvalidRef: a video ref, the payload does not parse (v1), or a v2 grid of the wrong length.
            GridMismatch: a grid larger than the processor can produce.
        """
        if body.modality != "image":  # a video ref: VideoMixin.check_video_ref
            raise InvalidRef(f"a {body.modality} ref where an image is expected", ref=ref)
        if body.family != self.family:
            raise UnsupportedFamily(
                f"ref family {body.family!r} is not the adapter's family {self.family!r}", ref=ref
            )
        if body.fingerprint is not None and body.fingerprint != self.fingerprint:
            raise FingerprintMismatch(
                f"ref fingerprint {body.fingerprint} != {self.family} layout fingerprint "
                f"{self.fingerprint} (processor, backend, device or library versions differ)",
                ref=ref,
            )
        if isinstance(body, ContentRef):
            if len(body.grid) != self.grid_len:
                raise InvalidRef(
                    f"{self.family} refs carry a grid of {self.grid_len} ints, got {list(body.grid)}", ref=ref
                )
            return self.check_grid(body.grid, ref=ref)
        return self.grid_from_payload(body.payload, ref=ref)

    def read_raw(
        self,
        body: RawRefBody | ContentRef | CheckedRef,
        store: ImageSource,
        *,
        max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        ref: str | None = None,
    ) -> RawImage:
        """The read half of :meth:`resolve_raw`: the ref's checks, the confined read, the hash
        check and the vLLM-style decode, no processor (the chat route's connector hands the image
        to vLLM's own processor). A :class:`~protocol.adapters.values.CheckedRef` of an image is
        not checked again (its caller ran :meth:`check_ref`).

        Raises:
            UnsupportedFamily, FingerprintMismatch, InvalidRef, GridMismatch: see :meth:`check_ref`.
            AssetOutsideRoot, AssetNotFound, AssetTooLarge, HashMismatch, StoreUnavailable: see
                :meth:`resolve_raw`.
            ImageUnreadable, AssetTooLarge: see :func:`protocol.images.load_image`.
        """
        checked = CheckedRef.of(body, "image", self.check_ref, ref)
        data, sha256 = store.read_image(checked.body, max_bytes=max_bytes, ref=ref)
        image = load_image(data, max_pixels=max_pixels, ref=ref)
        return RawImage(image=image, data=data, sha256=sha256, grid=checked.grid)

    def check_decoded_grid(self, raw: RawImage, *, ref: str | None = None) -> None:
        """Check the grid the processor will give ``raw.image`` (from its size,
        :meth:`grid_for_size`) against the ref's claim, before any processing.

        Raises:
            ImageUnreadable: the processor's size rules refuse the image (e.g. aspect ratio > 200).
            GridMismatch: the ref claims another grid.
        """
        try:
            grid = tuple(self.grid_for_size(*raw.image.size))
        except ValueError as e:
            raise self.refusal(e, ref=ref, size=raw.image.size) from e
        self._check_claim(raw.grid, grid, ref)

    def resolve_raw(
        self,
        body: RawRefBody | ContentRef | CheckedRef,
        store: ImageSource,
        *,
        ref: str | None = None,
        raw_pixels: bool = False,
        max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> ProcessedImage:
        """Resolve an ``mmraw`` ref: confined read, hash check, vLLM-style decode, processor, grid check.

        This is the one path both the server and the trainer take (:meth:`read_raw`, then the
        processor). ``store`` is one :class:`AssetStore` (v1 refs by path, v2 refs by key under
        it) or the party's :class:`protocol.roots.AssetRoots` (every form, by content across the
        roots). ``body`` may be a :class:`~protocol.adapters.values.CheckedRef` (checked once,
        by its caller: :meth:`read_raw`).

        Raises:
            UnsupportedFamily, FingerprintMismatch, InvalidRef: see :meth:`check_ref`.
            AssetOutsideRoot, AssetNotFound, AssetTooLarge, HashMismatch: see
                :meth:`protocol.store.AssetStore.read_hashed`.
            StoreUnavailable: see :meth:`protocol.roots.AssetRoots.read_image`.
            ImageUnreadable, AssetTooLarge: see :func:`protocol.images.load_image`.
            GridMismatch: the processor's grid differs from the ref's payload.
        """
        raw = self.read_raw(body, store, ref=ref, max_bytes=max_bytes, max_pixels=max_pixels)
        processed = self._run_processor(raw.image, ref=ref, raw_pixels=raw_pixels)
        self._check_claim(raw.grid, processed.grid, ref)
        return dataclasses.replace(processed, sha256=raw.sha256)

    def process_bytes(
        self,
        data: bytes,
        sha256: str,
        *,
        ref: str | None = None,
        raw_pixels: bool = False,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> ProcessedImage:
        """The pixel path of :meth:`resolve_raw` on bytes already read and checked (``sha256``:
        their full hex digest): vLLM-style decode, then the processor. No claim is checked.

        Raises:
            ImageUnreadable, AssetTooLarge: see :func:`protocol.images.load_image`; the processor
                refused the image (e.g. an aspect ratio above 200).
        """
        image = load_image(data, max_pixels=max_pixels, ref=ref)
        processed = self._run_processor(image, ref=ref, raw_pixels=raw_pixels)
        return dataclasses.replace(processed, sha256=sha256)

    def _run_processor(self, image: Image.Image, *, ref: str | None, raw_pixels: bool) -> ProcessedImage:
        """:meth:`process`, a processor's ``ValueError`` (e.g. smart_resize: aspect ratio > 200)
        raised as :class:`ImageUnreadable` naming the family."""
        try:
            return self.process(image, raw_pixels=raw_pixels)
        except ValueError as e:
            raise self.refusal(e, ref=ref, size=image.size) from e

    def refusal(
        self, error: ValueError, *, ref: str | None = None, size: tuple[int, int] | None = None
    ) -> ImageUnreadable:
        """The processor's refusal of an image (its size rules, e.g. aspect ratio > 200), typed:
        the :class:`ImageUnreadable` to raise, naming the family and, given ``size`` (width,
        height in px), the image's size."""
        what = f"a {size[0]}x{size[1]} image" if size else "the image"
        return ImageUnreadable(f"{self.family} processor refused {what}: {error}", ref=ref)

    def _check_claim(self, claimed: Sequence[int], grid: Sequence[int], ref: str | None) -> None:
        """GridMismatch unless the processor's ``grid`` is the one the ref claims."""
        if tuple(grid) != tuple(claimed):
            raise GridMismatch(
                f"ref claims {self.grid_field} {list(claimed)}, processor gives {list(grid)}", ref=ref
            )

    def offload(
        self,
        image: bytes | Image.Image | os.PathLike[str] | str,
        store: AssetStore | AssetRoot | AssetRoots,
        *,
        form: RefForm = "v1",
    ) -> RawMMRef:
        """Store a raw image and return its ``mmraw`` ref:
        :func:`protocol.adapters.offload.store_and_ref` with this adapter (arguments, errors)."""
        return store_and_ref(self, image, store, form=form)

    def collate(self, items: Sequence[ProcessedImage]) -> dict[str, torch.Tensor]:
        """Concatenate per-image tensors along dim 0, in order (the model's batched input).

        Returns:
            The family's field names to tensors, e.g. Qwen-VL ``pixel_values`` float32
            ``[sum(t*h*w), C*T*P*P]`` and ``image_grid_thw`` int64 ``[N, 3]``.

        Raises:
            ValueError: no items (there is no empty batch of the family's tensors).
        """
        if not items:
            raise ValueError("collate() needs at least one image")
        return {k: torch.cat([it.tensors[k] for it in items]) for k in items[0].tensors}
