"""Per-family adapters behind one registry (docs/PROTOCOL.md §5). Imports torch and transformers.

``protocol`` itself stays torch-free; import this subpackage where processing happens.
"""

from __future__ import annotations

import os

from protocol.adapters.base import ImageAdapter, ProcessedImage
from protocol.adapters.kimi_k25 import KimiK25Adapter
from protocol.adapters.kimi_vl import KimiVLAdapter, KimiVLImageProcessor
from protocol.adapters.qwen3_5 import Qwen35Adapter
from protocol.adapters.qwen3_vl_moe import Qwen3VLMoeAdapter
from protocol.adapters.qwen_vl import QwenVLAdapter
from protocol.adapters.registry import ADAPTERS, adapter_class, load_adapter, supported_families
from protocol.store import AssetStore
from protocol.structs import RawMMRef

__all__ = [
    "ADAPTERS",
    "ImageAdapter",
    "KimiK25Adapter",
    "KimiVLAdapter",
    "KimiVLImageProcessor",
    "ProcessedImage",
    "Qwen3VLMoeAdapter",
    "Qwen35Adapter",
    "QwenVLAdapter",
    "adapter_class",
    "load_adapter",
    "offload_image",
    "supported_families",
]


def offload_image(
    image: bytes | os.PathLike[str] | str, root: str | os.PathLike[str], adapter: ImageAdapter
) -> RawMMRef:
    """Write ``image`` into the asset store at ``root`` and return its ``mmraw`` ref.

    Atomic and idempotent (the same bytes give the same file and the same ref). The
    adapter supplies the grid and placeholder count the server will check.
    """
    return adapter.offload(image, AssetStore(root))
