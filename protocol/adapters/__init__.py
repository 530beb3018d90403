"""Per-family adapters behind one registry (docs/PROTOCOL.md §5). Imports torch and transformers.

``protocol`` itself stays torch-free; import this subpackage where processing happens.
"""

from __future__ import annotations

from protocol.adapters.base import ImageAdapter, ProcessedImage, RefForm
from protocol.adapters.kimi_k25 import KimiK25Adapter
from protocol.adapters.kimi_vl import KimiVLAdapter, KimiVLImageProcessor
from protocol.adapters.offload import offload_image, offload_video
from protocol.adapters.qwen3_5 import Qwen35Adapter
from protocol.adapters.qwen3_vl_moe import Qwen3VLMoeAdapter
from protocol.adapters.qwen_vl import QwenVLAdapter
from protocol.adapters.registry import ADAPTERS, adapter_class, load_adapter, supported_families
from protocol.adapters.values import ProcessedVideo
from protocol.adapters.video import VideoMixin
from protocol.adapters.video_families import VIDEO_FAMILIES, VideoFamily

__all__ = [
    "ADAPTERS",
    "VIDEO_FAMILIES",
    "ImageAdapter",
    "KimiK25Adapter",
    "KimiVLAdapter",
    "KimiVLImageProcessor",
    "ProcessedImage",
    "ProcessedVideo",
    "Qwen3VLMoeAdapter",
    "Qwen35Adapter",
    "QwenVLAdapter",
    "RefForm",
    "VideoFamily",
    "VideoMixin",
    "adapter_class",
    "load_adapter",
    "offload_image",
    "offload_video",
    "supported_families",
]
