"""Per-family adapters behind one registry (docs/PROTOCOL.md §5). Imports torch and transformers.

``protocol`` itself stays torch-free; import this subpackage where processing happens.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from protocol.adapters.base import ImageAdapter, ProcessedImage, RefForm
from protocol.adapters.kimi_k25 import KimiK25Adapter
from protocol.adapters.kimi_vl import KimiVLAdapter, KimiVLImageProcessor
from protocol.adapters.qwen3_5 import Qwen35Adapter
from protocol.adapters.qwen3_vl_moe import Qwen3VLMoeAdapter
from protocol.adapters.qwen_vl import QwenVLAdapter
from protocol.adapters.registry import ADAPTERS, adapter_class, load_adapter, supported_families
from protocol.adapters.values import ProcessedVideo
from protocol.adapters.video import VIDEO_FAMILIES, VideoMixin
from protocol.refs import file_uri_to_path
from protocol.roots import AssetRoot, AssetRoots, open_root
from protocol.store import AssetStore
from protocol.structs import RawMMRef

if TYPE_CHECKING:
    from PIL.Image import Image

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
    "VideoMixin",
    "adapter_class",
    "load_adapter",
    "offload_image",
    "offload_video",
    "supported_families",
]


def offload_image(
    image: bytes | Image | os.PathLike[str] | str,
    root: str | os.PathLike[str] | AssetRoot | AssetRoots,
    adapter: ImageAdapter,
    *,
    form: RefForm = "v1",
) -> RawMMRef:
    """Write ``image`` into the asset store at ``root`` and return its ``mmraw`` ref.

    Atomic and idempotent (the same bytes give the same file and the same ref). The
    adapter supplies the grid and placeholder count the server will check.

    Args:
        image: encoded bytes, a PIL image (stored as lossless PNG) or a path to an image file.
        root: a local folder (v1 and v2), an object-store URL such as ``s3://bucket/prefix``
            (v2 only: create-if-absent; opened with ``MMREF_STORE_*``,
            :meth:`~protocol.roots.StoreClientConfig.from_env`), an opened root, or
            :class:`AssetRoots` (its first root).
        form: ``"v1"`` (``file://`` path) or ``"v2"`` (named by content); see
            :meth:`ImageAdapter.offload`.

    Raises:
        ImageUnreadable, AssetTooLarge, StoreUnavailable, HashMismatch, ValueError: see
            :meth:`ImageAdapter.offload` and :func:`protocol.roots.open_root`.
    """
    if isinstance(root, AssetRoot | AssetRoots):
        return adapter.offload(image, root, form=form)
    text = os.fspath(root)
    if text.startswith("file://"):
        return adapter.offload(image, AssetStore(file_uri_to_path(text)), form=form)
    if "://" in text:
        return adapter.offload(image, open_root(text), form=form)
    return adapter.offload(image, AssetStore(root), form=form)


def offload_video(
    video: bytes | os.PathLike[str] | str,
    root: str | os.PathLike[str] | AssetRoot | AssetRoots,
    adapter: VideoMixin,
    *,
    form: RefForm = "v1",
) -> RawMMRef:
    """Write a video (MP4/QuickTime bytes or a path) into the asset store at ``root`` and return its
    ``mmraw`` ref (``modality="video"``), beside :func:`offload_image` (issue 44).

    The clip is decoded and processed once, as the server and the trainer will (its grid is the
    processor's), before anything is stored; the ref names the adapter's video fingerprint (the
    video processor's settings, the frame sampling, the decoder). Stored at
    ``videos/<sha256[:16]><ext>``: atomic, idempotent, content-addressed as images are.

    Args:
        root: as :func:`offload_image` (a folder, ``file://``, an object-store URL: v2 only, a root,
            :class:`AssetRoots`).
        adapter: a family's adapter with its video processor (:func:`load_adapter` attaches it for
            a family of :data:`VIDEO_FAMILIES`).
        form: ``"v1"`` (``file://`` path) or ``"v2"`` (named by content).

    Raises:
        VideoUnreadable, AssetTooLarge: see :meth:`VideoMixin.offload_video`.
        UnsupportedFamily: the adapter has no video path.
        StoreUnavailable, HashMismatch, ValueError: see :func:`offload_image`.
    """
    if isinstance(root, AssetRoot | AssetRoots):
        return adapter.offload_video(video, root, form=form)
    text = os.fspath(root)
    if text.startswith("file://"):
        return adapter.offload_video(video, AssetStore(file_uri_to_path(text)), form=form)
    if "://" in text:
        return adapter.offload_video(video, open_root(text), form=form)
    return adapter.offload_video(video, AssetStore(root), form=form)
