"""Images as rollout code holds them (bytes, PIL images, paths), offloaded once per content.

:class:`Offloader` turns an image into its ``mmraw`` :class:`~protocol.structs.RawMMRef`: the
bytes' sha256 is looked up first, and only a content it has not seen goes through
:func:`protocol.adapters.offload_image` (decode for the grid, atomic write into the asset store).
The adapter runs the model's HF image processor config and imports torch, so it is loaded on the
first offload, not at import. A video (MP4/QuickTime bytes or a path) goes the same way through
:meth:`Offloader.offload_video` (:func:`protocol.adapters.offload_video`: decoded and processed
once for its grid, then stored under ``videos/``), cached apart from images.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

from protocol.images import image_bytes
from protocol.structs import RawMMRef

if TYPE_CHECKING:
    from PIL.Image import Image

    from protocol.adapters import ImageAdapter, RefForm
    from protocol.roots import AssetRoot, AssetRoots

__all__ = ["ImageInput", "OffloadStats", "Offloader", "VideoInput", "image_bytes", "video_bytes"]

ImageInput = Union[bytes, bytearray, memoryview, "Image", str, os.PathLike]
"""An image as rollout code holds it: encoded bytes (JPEG, PNG, WebP, GIF, BMP, TIFF), a PIL
image (stored as lossless PNG), or a path to an image file."""

VideoInput = bytes | bytearray | memoryview | str | os.PathLike
"""A video as rollout code holds it: MP4/QuickTime bytes or a path to the file."""


def video_bytes(video: VideoInput) -> bytes:
    """The file's bytes: ``video`` itself (bytes-like) or the file at that path.

    Raises:
        TypeError: neither bytes nor a path.
        OSError: the path cannot be read.
    """
    if isinstance(video, bytes | bytearray | memoryview):
        return bytes(video)
    if isinstance(video, str | os.PathLike):
        return Path(video).read_bytes()
    raise TypeError(f"a video must be bytes or a path, got {type(video).__name__}")


@dataclass
class OffloadStats:
    """Counters of one :class:`Offloader`."""

    offloaded: int = 0
    """Images and videos written (or found already written) through ``offload_image`` / ``offload_video``."""
    hits: int = 0
    """Images and videos whose content this offloader had already offloaded (nothing decoded or written)."""


class Offloader:
    """Puts images into the asset store at ``asset_root``, once per content (sha256 of the bytes).

    Thread-safe. The ref of a content stays cached (LRU, ``cache_size`` entries: a ref is ~350
    bytes) for the offloader's life; the store itself is idempotent too, so a miss after an
    eviction writes nothing new.

    Args:
        model_dir: the served model's folder (its image processor config gives grids).
        asset_root: the run's asset store, e.g. ``<output_root>/run_1/assets``, inside the server's
            ``MMREF_ASSET_ROOT`` and readable by the trainer; or, for a fleet, an object-store URL
            (``s3://bucket/prefix``: opened here with ``MMREF_STORE_*``, as every party opens
            one, :func:`protocol.roots.open_root`), an opened root or
            :class:`protocol.roots.AssetRoots` (its first root), with ``form="v2"``.
        form: the refs' form (:func:`protocol.adapters.offload_image`): ``"v1"`` (a ``file://``
            path; a local folder only) or ``"v2"`` (named by content: every party finds the bytes
            under its own roots).
        adapter: an adapter already loaded (default: :func:`protocol.adapters.load_adapter` of
            ``model_dir`` on first use).
        cache_size: refs kept by content.

    Raises:
        ValueError: an object-store URL that does not open (e.g. an ``s3://`` root whose endpoint
            is plain HTTP without ``MMREF_STORE_ALLOW_HTTP``), naming what to set.
        protocol.settings.SettingError: a bad ``MMREF_STORE_*`` value.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        asset_root: str | os.PathLike[str] | AssetRoot | AssetRoots,
        *,
        adapter: ImageAdapter | None = None,
        cache_size: int = 65536,
        form: RefForm = "v1",
    ) -> None:
        self.model_dir = Path(model_dir)
        url = isinstance(asset_root, str) and "://" in asset_root
        local = isinstance(asset_root, os.PathLike) or (isinstance(asset_root, str) and not url)
        if url:
            from protocol.roots import open_root

            asset_root = open_root(asset_root)  # no request yet: a bad setting fails here, not at offload
        self.asset_root = Path(asset_root) if local else asset_root
        self.form: RefForm = form
        self._adapter = adapter
        self._cache: OrderedDict[str, RawMMRef] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = OffloadStats()

    @property
    def adapter(self) -> ImageAdapter:
        """The model family's adapter (loaded on first use: imports torch and transformers)."""
        with self._lock:
            if self._adapter is None:
                from protocol.adapters import load_adapter

                self._adapter = load_adapter(self.model_dir)
            return self._adapter

    def offload(self, image: ImageInput) -> RawMMRef:
        """The image's ref; decoded and written only if this content was not offloaded before.

        Raises:
            ImageUnreadable, AssetTooLarge: see :func:`protocol.adapters.offload_image`.
            TypeError, OSError: see :func:`image_bytes`.
        """
        data = image_bytes(image)
        key = hashlib.sha256(data).hexdigest()
        if (ref := self._cached(key)) is not None:
            return ref
        from protocol.adapters import offload_image

        return self._remember(key, offload_image(data, self.asset_root, self.adapter, form=self.form))

    def offload_video(self, video: VideoInput) -> RawMMRef:
        """The video's ref (``modality="video"``); decoded, processed and written only if this
        content was not offloaded before (as a video: the cache keys videos apart from images).

        Raises:
            VideoUnreadable, AssetTooLarge, UnsupportedFamily: see
                :func:`protocol.adapters.offload_video`.
            TypeError, OSError: see :func:`video_bytes`.
        """
        data = video_bytes(video)
        key = "video:" + hashlib.sha256(data).hexdigest()
        if (ref := self._cached(key)) is not None:
            return ref
        from protocol.adapters import offload_video

        return self._remember(key, offload_video(data, self.asset_root, self.adapter, form=self.form))

    def _cached(self, key: str) -> RawMMRef | None:
        """The ref offloaded under ``key`` before (counted as a hit, kept most recent), or None."""
        with self._lock:
            ref = self._cache.get(key)
            if ref is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
            return ref

    def _remember(self, key: str, ref: RawMMRef) -> RawMMRef:
        with self._lock:
            self._cache[key] = ref
            self.stats.offloaded += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return ref

    def lookup(self, sha256: str) -> RawMMRef | None:
        """The ref of an already offloaded image, by the full hex sha256 of its bytes (a video's:
        ``"video:" + sha256``)."""
        with self._lock:
            return self._cache.get(sha256)
