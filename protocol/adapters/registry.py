"""One table from HF ``model_type`` to adapter class, and the loaders built on it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from protocol.adapters.base import ImageAdapter
from protocol.adapters.kimi_k25 import KimiK25Adapter
from protocol.adapters.kimi_vl import KimiVLAdapter
from protocol.adapters.qwen3_5 import Qwen35Adapter
from protocol.adapters.qwen3_vl_moe import Qwen3VLMoeAdapter
from protocol.adapters.qwen_vl import QwenVLAdapter
from protocol.adapters.video import VideoMixin
from protocol.adapters.video_families import VIDEO_FAMILIES
from protocol.errors import UnsupportedFamily

__all__ = ["ADAPTERS", "adapter_class", "load_adapter", "supported_families"]

ADAPTERS: dict[str, type[ImageAdapter]] = {
    "qwen2_vl": QwenVLAdapter,
    "qwen2_5_vl": QwenVLAdapter,
    "qwen3_vl": QwenVLAdapter,
    "qwen3_vl_moe": Qwen3VLMoeAdapter,
    "qwen3_5": Qwen35Adapter,
    "qwen3_5_moe": Qwen35Adapter,  # also Qwen3.6-35B-A3B
    "kimi_vl": KimiVLAdapter,  # vLLM's KimiVLConfig.model_type (vllm/transformers_utils/configs/kimi_vl.py)
    "kimi_k25": KimiK25Adapter,  # transformers' Kimi_K25Config.model_type
}


def supported_families() -> list[str]:
    """Sorted HF ``model_type`` values that have an adapter."""
    return sorted(ADAPTERS)


def adapter_class(model_type: str) -> type[ImageAdapter]:
    """The adapter class for an HF ``model_type``.

    Raises:
        UnsupportedFamily: no adapter; the message lists the supported types.
    """
    try:
        return ADAPTERS[model_type]
    except KeyError:
        raise UnsupportedFamily(
            f"no adapter for model_type {model_type!r}; supported: {supported_families()}"
        ) from None


def load_adapter(
    model: str | os.PathLike[str],
    *,
    backend: str | None = None,
    device: str = "cpu",
    image_processor: Any = None,
) -> ImageAdapter:
    """Build the adapter for a local HF model folder (its ``config.json`` ``model_type``).

    Args:
        model: local model folder (no hub access).
        backend: ``"torchvision"`` | ``"pil"`` | None (transformers' default, torchvision when
            installed, which is also what vLLM uses). Kimi families have one processor each
            (Kimi-VL: :class:`~protocol.adapters.kimi_vl.KimiVLImageProcessor`; Kimi K2.5: vLLM's
            ``KimiK25FusedVisionProcessor``) and take None only.
        device: processor device (torchvision backend).
        image_processor: use this processor instance instead of loading one (the server
            passes vLLM's own).

    A family of :data:`~protocol.adapters.video_families.VIDEO_FAMILIES` also gets the folder's video
    processor (``attach_video``: vLLM's loader defaults).

    Raises:
        UnsupportedFamily: the model type has no adapter.
        FileNotFoundError: no ``config.json`` in ``model``.
        ValueError: a ``backend`` for a Kimi family.
    """
    config = json.loads((Path(model) / "config.json").read_text())
    model_type = config.get("model_type", "")
    cls = adapter_class(model_type)
    if image_processor is None:
        image_processor = cls.load_image_processor(model, backend=backend)
    adapter = cls(image_processor, family=model_type, device=device)
    if isinstance(adapter, VideoMixin) and model_type in VIDEO_FAMILIES:  # issue 44
        adapter.attach_video(adapter.load_video_processor(model))
    return adapter
