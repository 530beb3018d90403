"""One ref in, one processed vLLM item out: the read from the asset roots, the checks and the cache.

- ``mmraw:`` refs (v1, and content-named ``mmraw:v2:``): read through the server's asset roots
  (:meth:`protocol.settings.RootSettings.image_source`: ``MMREF_ASSET_ROOTS`` in order, the node's
  read cache; v1 refs at their ``file://`` path confined to ``MMREF_ASSET_ROOT`` first),
  sha256-checked, decoded like vLLM, processed by the model's own HF image processor (the instance
  vLLM itself uses, under vLLM's own torch thread setting), grid-checked, and built into vLLM's
  ``MultiModalKwargsItem`` with the model's field config, exactly as vLLM's processor builds it.
- content-named cache handles (:meth:`MMRefResolver.resolve_handle`): an image engine hash this
  replica's engine does not hold, resolved from the same roots by the content it names (the same
  pixel path, ``ImageAdapter.process_bytes``; no grid is claimed, the request's range is checked).
- video refs (``mmraw`` with ``modality="video"``, issue 44): ``VideoMixin.resolve_video`` (the
  header limits before decoding, vLLM's loader frames, the family's HF video processor, the grid
  checked), built into vLLM's ``"video"`` item; keyed by an opaque video engine hash (no handle).
- ``mmfile:v1:`` refs: envelope, payload sha256 and fingerprint checked, payload decoded with
  vLLM's decoder and checked against the served model's item layout and pixel mode.
- The item stays a ``MultiModalKwargsItem`` in this process: it reaches vLLM's engine input as is
  (``serving_tokens.py``), never through vLLM's base64/msgpack wire format.
- A grid a ref or a feature file claims is bounded by the served processor's limits
  (``ImageAdapter.check_grid``) before anything is sized from it.
- A resolved item's content key (``weights.ContentKey``): the full sha256 of the image bytes read
  and their store extension (or the feature payload's sha256), the fingerprint and the pixel mode;
  content- and processing-bound, never a client uuid; ``weights.engine_hash`` binds it to the
  weight version for vLLM's caches.
- Results are cached by the sha256 of the whole ref string (handles: by their content; byte-bounded
  LRU, single-flight, failures never cached).
- Each ref is parsed and checked once (issue 45): :meth:`MMRefResolver.resolve` parses it, checks
  it against the adapter before queueing any work, and hands the adapter's read path the
  :class:`~protocol.adapters.values.CheckedRef` (not checked again there); the resolved item keeps
  the parsed ref (:attr:`ResolvedItem.body`) for the checks of the request that named it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from protocol.adapters import ImageAdapter, ProcessedImage, VideoMixin
from protocol.adapters.values import CheckedRef
from protocol.errors import (
    CorruptFeature,
    FingerprintMismatch,
    GridMismatch,
    InvalidRef,
    MMRefError,
    UnsupportedFamily,
)
from protocol.features import read_feature_item
from protocol.images import sniff_media_type
from protocol.refs import ContentRef, FileRef, RawRefBody, parse_ref
from protocol.roots import AssetRoots
from protocol.videos import frame_limits
from upstream import load
from vllm_plugin import metrics
from vllm_plugin.cache import ByteBudgetLRU
from vllm_plugin.config import PluginConfig
from vllm_plugin.items import ItemLayout, decode_item
from vllm_plugin.weights import ContentKey

__all__ = ["ExtRecorder", "MMRefResolver", "ResolvedItem"]


@dataclass(frozen=True)
class ResolvedItem:
    """One ref, resolved: what takes a ``features`` slot of the engine input."""

    content_key: ContentKey
    """What the item's engine hash binds besides the weight version (``weights.engine_hash``)."""
    item: Any
    """vLLM's ``MultiModalKwargsItem`` (shared by every request that uses the ref: never mutated)."""
    grid: tuple[int, ...]
    num_placeholders: int
    body: RawRefBody | ContentRef | FileRef | None = None
    """The ref as parsed once (None: a content-named handle): what a ``RawMMRef``'s declared
    sha256 is checked against (``resolution.py``), never parsed again."""

    @property
    def nbytes(self) -> int:
        """Bytes the resolve cache counts: the item's tensors."""
        return sum(elem.data.nbytes for elem in self.item.values())


class MMRefResolver:
    """Turns refs into processed vLLM items, cached by ref, single-flight.

    Args:
        adapter: the served family's adapter (wrapping vLLM's own HF image processor).
        config: plugin settings (asset roots, limits, cache budget); its roots are opened here
            (object-store clients: build the resolver in the process that serves, after vLLM's
            processes started).
        layout: the served model's item layout (built from its field config).
        raw_pixels: the engine's resolved ``mm_device_do_normalize``.
        pool: where the work runs (default: a pool of ``config.max_workers`` threads of its own).

    Raises:
        ValueError: a root that does not open (:meth:`~protocol.settings.RootSettings.image_source`).
    """

    def __init__(
        self,
        adapter: ImageAdapter,
        config: PluginConfig,
        *,
        layout: ItemLayout,
        raw_pixels: bool,
        pool: Executor | None = None,
    ) -> None:
        self.adapter = adapter
        self.config = config
        self.layout = layout
        self.store: AssetRoots = config.image_source()
        self.raw_pixels = raw_pixels
        self.pixel_mode = "raw" if raw_pixels else "normalized"
        self.cache: ByteBudgetLRU[ResolvedItem] = ByteBudgetLRU(
            config.cache_budget_bytes, lambda item: item.nbytes
        )
        metrics.register_cache(self.cache)
        self.pool: Executor = (
            pool
            if pool is not None
            else ThreadPoolExecutor(config.max_workers, thread_name_prefix="mmref-resolve")
        )
        """Worker threads for file reads, processing and item decoding (never the event loop): the
        plugin's own, or the one given (vLLM's multimodal worker for an adapter with
        ``serial_processing``)."""

    async def resolve(self, ref: str) -> ResolvedItem:
        """Resolve one ref string (cached by the whole ref string).

        Raises:
            MMRefError subclasses: see :meth:`protocol.adapters.ImageAdapter.resolve_raw` (a
                claimed grid above the processor's limits is a :class:`GridMismatch` before any
                work, :meth:`~protocol.adapters.ImageAdapter.check_grid`).
        """
        key = hashlib.sha256(ref.encode("utf-8", "surrogatepass")).hexdigest()
        cached = self.cache.get(key)  # fast path: no parse, no task (counted as a hit by the cache)
        if cached is not None:
            return cached
        parsed = parse_ref(ref)
        # the cheap checks (grid bound too) before queueing work, once: the read path takes them
        if isinstance(parsed, RawRefBody | ContentRef) and parsed.modality == "video":
            video = self._video_adapter(ref)
            checked = CheckedRef(parsed, video.check_video_ref(parsed, ref=ref))
            return await self._compute(key, "video", lambda: self._resolve_video_sync(video, checked, ref))
        if isinstance(parsed, RawRefBody | ContentRef):
            checked = CheckedRef(parsed, self.adapter.check_ref(parsed, ref=ref))
            return await self._compute(key, "mmraw", lambda: self._resolve_raw_sync(checked, ref))
        return await self._compute(key, "mmfile", lambda: self._resolve_file_sync(parsed, ref))

    async def resolve_handle(self, sha256: str, ext: str, handle: str) -> ResolvedItem:
        """Resolve the image a content-named engine hash names (``weights.parse_handle``) from this
        server's roots: the bytes whose sha256 is ``sha256`` at ``images/<sha256[:16]><ext>``,
        processed as a ref's (cached by content; no grid is claimed: the caller checks the
        request's placeholder range against the item).

        Raises:
            StoreUnavailable, AssetNotFound, HashMismatch, AssetTooLarge: see
                :meth:`protocol.roots.AssetRoots.read_content` (errors name ``handle``).
            ImageUnreadable: see :meth:`protocol.adapters.ImageAdapter.process_bytes`.
        """

        def work() -> ResolvedItem:
            limit = self.config.max_image_bytes
            data, digest = self.store.read_content(sha256, ext, max_bytes=limit, ref=handle)
            return self._raw_item(self._pixels(self.adapter.process_bytes, data, digest, ref=handle), ext)

        return await self._compute(f"handle:{sha256}{ext}", "handle", work)

    async def _compute(self, key: str, kind: str, work: Callable[[], ResolvedItem]) -> ResolvedItem:
        """``work`` in the worker pool, timed and counted, through the cache (single-flight)."""

        def timed() -> ResolvedItem:
            start = time.perf_counter()
            item = work()
            metrics.RESOLVE_SECONDS.labels(kind).observe(time.perf_counter() - start)
            if kind != "mmfile":
                metrics.IMAGES_MATERIALIZED.inc()
            return item

        loop = asyncio.get_running_loop()
        return await self.cache.get_or_compute(key, lambda: loop.run_in_executor(self.pool, timed))

    def _resolve_raw_sync(self, checked: CheckedRef, ref: str) -> ResolvedItem:
        source = ExtRecorder(self.store)
        limit = self.config.max_image_bytes
        processed = self._pixels(self.adapter.resolve_raw, checked, source, ref=ref, max_bytes=limit)
        return self._raw_item(processed, source.ext, checked.body)

    def _video_adapter(self, ref: str) -> VideoMixin:
        """The adapter, where it serves videos (Qwen2.5-VL, Qwen3-VL: ``VideoMixin.attach_video``).

        Raises:
            UnsupportedFamily: the served family has no video path.
        """
        if not isinstance(self.adapter, VideoMixin) or self.adapter.video_processor is None:
            raise UnsupportedFamily(f"videos are not served for {self.adapter.family!r}", ref=ref)
        return self.adapter

    def _resolve_video_sync(self, adapter: VideoMixin, checked: CheckedRef, ref: str) -> ResolvedItem:
        """A video ref: ``VideoMixin.resolve_video`` (the limits before decoding: the file's bytes,
        ``MMREF_MAX_IMAGE_PIXELS`` per frame, ``DEFAULT_VIDEO_LIMITS``' frames, duration and
        decoded bytes) in this server's pixel mode, built into vLLM's ``"video"`` item."""
        from transformers import BatchFeature

        limits = frame_limits(self.config.max_image_pixels)
        with load("set_default_torch_num_threads")():
            processed = adapter.resolve_video(
                checked,
                self.store,
                ref=ref,
                raw_pixels=self.raw_pixels,
                max_bytes=self.config.max_video_bytes,
                limits=limits,
            )
        hf_inputs = BatchFeature(dict(processed.tensors))
        (item,) = load("MultiModalKwargsItems.from_hf_inputs")(
            hf_inputs, self.layout.fields_config(hf_inputs)
        )["video"]
        body = checked.body
        ext = body.ext if isinstance(body, ContentRef) else PurePosixPath(body.raw_image_uri or "").suffix
        key = ContentKey("video", processed.sha256, ext, str(adapter.video_fingerprint), self.pixel_mode)
        return ResolvedItem(key, item, processed.grid, processed.num_placeholders, body)

    def _pixels(self, path: Callable[..., ProcessedImage], *args: Any, **kwargs: Any) -> ProcessedImage:
        """An adapter's pixel path (``resolve_raw``, ``process_bytes``) with this server's pixel
        mode and pixel limit, under vLLM's torch thread setting (as vLLM's renderer runs its
        processor)."""
        with load("set_default_torch_num_threads")():
            return path(
                *args,
                raw_pixels=self.raw_pixels,
                max_pixels=self.config.max_image_pixels,
                **kwargs,
            )

    def _raw_item(
        self, processed: ProcessedImage, ext: str, body: RawRefBody | ContentRef | None = None
    ) -> ResolvedItem:
        """vLLM's item for a processed image whose bytes are stored as ``images/<sha256[:16]><ext>``
        (``body``: the ref it was read for, parsed once; None for a content-named handle)."""
        from transformers import BatchFeature

        hf_inputs = BatchFeature(dict(processed.tensors))
        items = load("MultiModalKwargsItems.from_hf_inputs")(hf_inputs, self.layout.fields_config(hf_inputs))
        (item,) = items[self.adapter.vllm_modality]
        return ResolvedItem(
            # the full sha256 of the bytes read, not the ref's (possibly 16-hex) mm_hash prefix
            content_key=ContentKey("image", processed.sha256, ext, self.adapter.fingerprint, self.pixel_mode),
            item=item,
            grid=processed.grid,
            num_placeholders=processed.num_placeholders,
            body=body,
        )

    def _resolve_file_sync(self, ref_ids: FileRef, ref: str) -> ResolvedItem:
        """An ``mmfile:v1`` item: envelope, payload sha256 and fingerprint checked, payload decoded
        with vLLM, its grid bounded, its layout, placeholder length and pixel mode checked."""
        if self.config.asset_root is None:
            raise InvalidRef("mmfile refs are read under MMREF_ASSET_ROOT: this server has none", ref=ref)
        item_file = read_feature_item(
            self.config.asset_root,
            ref_ids,
            fingerprint=self.adapter.fingerprint,
            ref_string=ref,
            max_bytes=self.config.max_feature_bytes,
        )
        what = f"feature payload ({self.adapter.family})"
        item = decode_item(item_file.payload, CorruptFeature, what, ref)
        self.adapter.check_grid(self.layout.grid_of(item, CorruptFeature, what, ref), ref=ref)  # bounded
        checked = self.layout.check(item, CorruptFeature, what, ref)
        want_dtype = "torch.uint8" if self.raw_pixels else "torch.float32"
        pixels = item["pixel_values"].data
        if str(pixels.dtype) != want_dtype:
            raise FingerprintMismatch(
                f"feature pixels are {pixels.dtype}; this server ({self.pixel_mode}) feeds {want_dtype}",
                ref=ref,
            )
        if checked.num_placeholders != item_file.envelope.placeholder_length:
            raise GridMismatch(
                f"envelope placeholder_length {item_file.envelope.placeholder_length} != "
                f"{checked.num_placeholders} from the item's grid {list(checked.grid)}",
                ref=ref,
            )
        return ResolvedItem(
            content_key=ContentKey(
                "feature", item_file.envelope.payload_sha256, "", self.adapter.fingerprint, self.pixel_mode
            ),
            item=item,
            grid=checked.grid,
            num_placeholders=checked.num_placeholders,
            body=ref_ids,
        )


class ExtRecorder:
    """An ``ImageSource`` over the server's roots that keeps the store extension of the image it
    read: a v2 ref's own, or, for a v1 ref, the one its bytes are stored under
    (``protocol.images.sniff_media_type``; ``.img`` for bytes no allowed format opens, which the
    decode then refuses)."""

    def __init__(self, source: AssetRoots) -> None:
        self.source = source
        self.ext = ".img"

    def read_image(
        self, body: RawRefBody | ContentRef, *, max_bytes: int, ref: str | None = None
    ) -> tuple[bytes, str]:
        data, digest = self.source.read_image(body, max_bytes=max_bytes, ref=ref)
        if isinstance(body, ContentRef):
            self.ext = body.ext
        else:
            try:
                self.ext = sniff_media_type(data)[1]
            except MMRefError:
                self.ext = ".img"
        return data, digest
