"""Kimi K2.5 (``kimi_k25``): the adapter around the image processor vLLM itself serves with.

vLLM 0.32 (``vllm/model_executor/models/kimi_k25.py::KimiK25ProcessingInfo``) loads
``KimiK25FusedVisionProcessor`` (``vllm/transformers_utils/processors/kimi_k25_vision_fused.py``,
PIL bicubic resize, zero padding, a per-channel uint8 -> float32 lookup table, numba) whenever
numba is installed, and Moonshot's remote ``KimiK25VisionProcessor`` otherwise; both read the
``media_proc_cfg`` section of ``preprocessor_config.json`` and share one interface
(``preprocess(medias, return_tensors, do_rescale, do_normalize)``, ``get_resize_config``).
This adapter calls that interface on the instance it is given and never re-implements it.
transformers' ``Kimi_K25ImageProcessor`` (torchvision, key ``image_grid_thw``) computes other
pixels (up to 2 uint8 steps apart after a resize) and is refused: serve and train with the same
processor, and the fingerprint (processor class, ``media_proc_cfg`` image fields, vLLM and numpy
versions) tells them apart.

Layout (``KimiK25MultiModalProcessor._get_mm_fields_config``):

- ``pixel_values``: ``[t*h*w, 3, patch, patch]``; float32 normalized, or **uint8** raw pixels
  when ``mm_device_do_normalize`` is on (vLLM's default for Kimi K2.5: the model normalizes)
- ``grid_thws``: int64 ``[1, 3]`` = ``[t, h, w]`` in patches, ``t = 1`` for an image
- placeholders: ``(h // merge) * (w // merge)`` ``<|media_pad|>`` tokens (``media_tokens_calculator``),
  or ``fixed_output_tokens`` when the config sets it.

What vLLM does differently from the other families: the modality is ``vision_chunk`` (images and
video chunks share it; :attr:`KimiK25Adapter.vllm_modality`), and the chat template holds ONE
``<|media_pad|>`` per image that vLLM's prompt update expands to the full count. In vLLM 0.32 the
placeholder range of an image in the processed prompt (and so in the render route's ``features``)
covers the whole expanded run, ``(h//2)*(w//2)`` tokens, not 1 (measured; see docs/KIMI.md).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from importlib import metadata
from typing import Any, ClassVar, NamedTuple

from PIL import Image

from protocol.adapters.base import ImageAdapter, ProcessedImage
from upstream import load

__all__ = ["KimiK25Adapter"]

_IMAGE_FIELDS = (
    "patch_size",
    "merge_kernel_size",
    "in_patch_limit",
    "patch_limit_on_one_side",
    "fixed_output_tokens",
    "image_mean",
    "image_std",
)


_PREPROCESS_LOCK = threading.Lock()
"""Held by every :meth:`KimiK25Adapter.process` in this process (see ``serial_processing``)."""


class _Size(NamedTuple):
    """Stands in for a PIL image where the processor only reads ``.size`` (``get_resize_config``)."""

    size: tuple[int, int]


class KimiK25Adapter(ImageAdapter):
    """Adapter for ``kimi_k25``.

    Args:
        image_processor: a processor with Kimi's media interface (``media_proc_cfg``,
            ``preprocess(medias, ...)``, ``get_resize_config``): the one vLLM built
            (``mm_processor.info.image_processor``) or :meth:`load_image_processor`.

    Raises:
        TypeError: the processor lacks that interface (e.g. transformers' ``Kimi_K25ImageProcessor``).
    """

    model_types: ClassVar[tuple[str, ...]] = ("kimi_k25",)
    grid_field: ClassVar[str] = "grid_thws"
    grid_len: ClassVar[int] = 3
    rope: ClassVar[str] = "1d"
    vllm_modality: ClassVar[str] = "vision_chunk"
    """The modality key vLLM 0.32 uses for Kimi K2.5 items (``mm_hashes``, ``mm_placeholders``,
    ``kwargs_data``); a ref's own ``modality`` stays ``"image"``."""
    serial_processing: ClassVar[bool] = True
    """vLLM's fused processor runs a parallel numba kernel under numba's ``workqueue`` threading
    layer (``vllm/utils/jit_monitor.py``), which aborts the whole process when two threads enter
    it at once ("Concurrent access has been detected"). vLLM keeps to one thread (its renderer's
    single-worker ``_mm_executor``, ``vllm/renderers/base.py``); :meth:`process` holds one lock
    per process, and the plugin runs this family's work on vLLM's own worker."""

    def __init__(self, image_processor: Any, *, family: str, device: str = "cpu") -> None:
        if not isinstance(getattr(image_processor, "media_proc_cfg", None), dict) or not hasattr(
            image_processor, "get_resize_config"
        ):
            raise TypeError(
                f"{type(image_processor).__name__} is not a Kimi media processor (media_proc_cfg, "
                "preprocess(medias), get_resize_config): use the one vLLM serves with, "
                "KimiK25FusedVisionProcessor (load_image_processor)"
            )
        super().__init__(image_processor, family=family, device=device)

    @property
    def cfg(self) -> dict[str, Any]:
        """The processor's ``media_proc_cfg``."""
        return self.image_processor.media_proc_cfg

    def fingerprint_fields(self) -> dict[str, Any]:
        cfg = self.cfg
        fields: dict[str, Any] = {name: cfg.get(name) for name in _IMAGE_FIELDS}
        fields["image_mean"] = [float(v) for v in cfg["image_mean"]]
        fields["image_std"] = [float(v) for v in cfg["image_std"]]
        fields["resample"] = "bicubic"  # fixed in the processor (PIL BICUBIC), named for the record
        # The processor's code lives in vLLM (or the checkpoint) and normalizes with numpy.
        package = type(self.image_processor).__module__.split(".", 1)[0]
        fields["processor_package"] = package
        fields["processor_package_version"] = str(getattr(sys.modules.get(package), "__version__", "unknown"))
        fields["numpy"] = metadata.version("numpy")
        return fields

    def grid_for_size(self, width: int, height: int) -> tuple[int, int, int]:
        """``(1, h, w)`` from the processor's own ``get_resize_config`` (its ``navit_resize_image``)."""
        cfg = self.image_processor.get_resize_config({"type": "image", "image": _Size((width, height))})
        p = self.cfg["patch_size"]
        return (
            1,
            (cfg["new_height"] + cfg["pad_height"]) // p,
            (cfg["new_width"] + cfg["pad_width"]) // p,
        )

    def num_placeholders(self, grid: Sequence[int]) -> int:
        """``media_tokens_calculator`` for an image: ``(h // merge) * (w // merge)`` or the fixed count."""
        fixed = self.cfg.get("fixed_output_tokens")
        if fixed is not None:
            return int(fixed)
        _, h, w = grid
        merge = int(self.cfg["merge_kernel_size"])
        return (h // merge) * (w // merge)

    def grid_multiples(self) -> tuple[int, int, int]:
        """``(1, merge, merge)``, ``merge`` = ``media_proc_cfg["merge_kernel_size"]``: the
        processor's ``navit_resize_image`` pads each side to a multiple of ``merge_kernel_size *
        patch_size`` pixels (``pad_width``/``pad_height``), so ``h`` and ``w`` are multiples of
        ``merge``; ``t`` is 1 for an image (``preprocess``: one frame), pinned by :meth:`grid_limits`."""
        merge = int(self.cfg["merge_kernel_size"])
        return (1, merge, merge)

    def grid_limits(self) -> tuple[tuple[int, int, int], int]:
        """One frame; sides of at most ``patch_limit_on_one_side`` patches plus the padding to a
        merge unit; ``in_patch_limit`` patches, with slack for ``navit_resize_image`` measuring
        the limit in whole patches (``width // patch_size``), up to 2x for a side under 2 patches."""
        merge = int(self.cfg["merge_kernel_size"])
        side = int(self.cfg["patch_limit_on_one_side"]) + merge - 1
        return (1, side, side), 2 * int(self.cfg["in_patch_limit"]) + 2 * (merge - 1) * side

    def process(self, image: Image.Image, *, raw_pixels: bool = False) -> ProcessedImage:
        """Run the processor on one RGB image as vLLM's ``KimiK25Processor`` does.

        Args:
            raw_pixels: what vLLM passes with ``mm_device_do_normalize`` on
                (``do_rescale=False, do_normalize=False``): uint8 pixels.
        """
        with _PREPROCESS_LOCK:  # one thread at a time in its numba kernel (``serial_processing``)
            out = self.image_processor.preprocess(
                [{"type": "image", "image": image}],
                return_tensors="pt",
                do_rescale=not raw_pixels,
                do_normalize=not raw_pixels,
            )
        return self._processed(out["pixel_values"], out["grid_thws"])

    def pixel_shape(self, grid: Sequence[int]) -> tuple[int, ...]:
        """``(t*h*w, 3, P, P)``."""
        p = int(self.cfg["patch_size"])
        t, h, w = (int(g) for g in grid)
        return (t * h * w, 3, p, p)

    def placeholder_token_id(self, hf_config: Any) -> int:
        """``image_token_id`` (``<|media_pad|>``; vLLM rewrites it from the tokenizer if they disagree)."""
        return int(hf_config.image_token_id)

    @classmethod
    def load_image_processor(cls, model_dir: Any, *, backend: str | None = None) -> Any:
        """vLLM's ``KimiK25FusedVisionProcessor`` from a model folder, as vLLM loads it (needs vLLM, numba).
        Both vLLM names come through the upstream table (``upstream.load``), in the installed
        release's form.

        Raises:
            ImportError: vLLM or numba is missing (vLLM would then run the checkpoint's remote
                ``KimiK25VisionProcessor``, which computes other pixels).
            ValueError: a ``backend`` (vLLM's fused processor is the only one).
        """
        if backend is not None:
            raise ValueError(f"kimi_k25 has one processor backend; backend={backend!r} is not an option")
        if not load("is_numba_available")():
            raise ImportError("numba is required: without it vLLM uses the remote KimiK25VisionProcessor")
        processor = load("KimiK25FusedVisionProcessor")
        return processor.from_pretrained(str(model_dir), local_files_only=True)
