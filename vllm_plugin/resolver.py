"""One ref in, one processed vLLM item out: the confined read, the checks and the cache.

- ``mmraw:`` refs: read from the confined asset root, sha256-checked, decoded like vLLM, processed
  by the model's own HF image processor (the instance vLLM itself uses, under vLLM's own torch
  thread setting), grid-checked, and built into vLLM's ``MultiModalKwargsItem`` with the model's
  field config, exactly as vLLM's processor builds it.
- ``mmfile:v1:`` refs: envelope, payload sha256 and fingerprint checked, payload decoded with
  vLLM's decoder and checked against the served model's item layout and pixel mode.
- The item stays a ``MultiModalKwargsItem`` in this process: it reaches vLLM's engine input as is
  (``serving_tokens.py``), never through vLLM's base64/msgpack wire format.
- A grid a ref or a feature file claims is bounded by the served processor's limits
  (``ImageAdapter.check_grid``) before anything is sized from it.
- A resolved item's content key is ``"mmref:v1:" + sha256(image bytes) + ":" + fingerprint + ":" +
  pixel mode`` (``"mmref:v1:file:" + payload sha256 + ":" + fingerprint`` for feature files):
  content- and processing-bound, never a client uuid; ``weights.engine_hash`` binds it to the
  weight version for vLLM's caches.
- Results are cached by the sha256 of the whole ref string (byte-bounded LRU, single-flight,
  failures never cached).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from protocol.adapters import ImageAdapter
from protocol.errors import CorruptFeature, FingerprintMismatch, GridMismatch
from protocol.features import read_feature_item
from protocol.refs import FileRef, RawRefBody, parse_ref
from protocol.store import AssetStore
from vllm_plugin import metrics
from vllm_plugin.cache import ByteBudgetLRU
from vllm_plugin.config import PluginConfig
from vllm_plugin.items import ItemLayout, decode_item
from vllm_plugin.vllm_surface import load

__all__ = ["MMRefResolver", "ResolvedItem"]


@dataclass(frozen=True)
class ResolvedItem:
    """One ref, resolved: what takes a ``features`` slot of the engine input."""

    content_key: str
    """What the item's engine hash binds besides the weight version (``weights.engine_hash``)."""
    item: Any
    """vLLM's ``MultiModalKwargsItem`` (shared by every request that uses the ref: never mutated)."""
    grid: tuple[int, ...]
    num_placeholders: int

    @property
    def nbytes(self) -> int:
        """Bytes the resolve cache counts: the item's tensors."""
        return sum(elem.data.nbytes for elem in self.item.values())


class MMRefResolver:
    """Turns refs into processed vLLM items, cached by ref, single-flight.

    Args:
        adapter: the served family's adapter (wrapping vLLM's own HF image processor).
        config: plugin settings (asset root, limits, cache budget).
        layout: the served model's item layout (built from its field config).
        device_normalize: the engine's resolved ``mm_device_do_normalize``.
    """

    def __init__(
        self,
        adapter: ImageAdapter,
        config: PluginConfig,
        *,
        layout: ItemLayout,
        device_normalize: bool,
    ) -> None:
        self.adapter = adapter
        self.config = config
        self.layout = layout
        self.store = AssetStore(config.asset_root)
        self.device_normalize = device_normalize
        self.pixel_mode = "raw" if device_normalize else "normalized"
        self.cache: ByteBudgetLRU[ResolvedItem] = ByteBudgetLRU(
            config.cache_budget_bytes, lambda item: item.nbytes
        )
        metrics.register_cache(self.cache)
        self.pool = ThreadPoolExecutor(config.max_workers, thread_name_prefix="mmref-resolve")
        """Worker threads for file reads, processing and item decoding (never the event loop)."""

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
        if isinstance(parsed, RawRefBody):
            self.adapter.check_ref(parsed, ref=ref)  # cheap checks (grid bound too) before queueing work
            work, kind = self._resolve_raw_sync, "mmraw"
        else:
            work, kind = self._resolve_file_sync, "mmfile"

        def timed() -> ResolvedItem:
            start = time.perf_counter()
            item = work(parsed, ref)
            metrics.RESOLVE_SECONDS.labels(kind).observe(time.perf_counter() - start)
            if kind == "mmraw":
                metrics.IMAGES_MATERIALIZED.inc()
            return item

        loop = asyncio.get_running_loop()
        return await self.cache.get_or_compute(key, lambda: loop.run_in_executor(self.pool, timed))

    def _resolve_raw_sync(self, body: RawRefBody, ref: str) -> ResolvedItem:
        from transformers import BatchFeature

        with load("set_default_torch_num_threads")():  # as vLLM's renderer runs its processor
            processed = self.adapter.resolve_raw(
                body,
                self.store,
                ref=ref,
                device_normalize=self.device_normalize,
                max_bytes=self.config.max_image_bytes,
                max_pixels=self.config.max_image_pixels,
            )
        hf_inputs = BatchFeature(dict(processed.tensors))
        items = load("MultiModalKwargsItems.from_hf_inputs")(hf_inputs, self.layout.fields_config(hf_inputs))
        (item,) = items[self.adapter.vllm_modality]
        return ResolvedItem(
            # the full sha256 of the bytes read, not the ref's (possibly 16-hex) mm_hash prefix
            content_key=f"mmref:v1:{processed.sha256}:{self.adapter.fingerprint}:{self.pixel_mode}",
            item=item,
            grid=processed.grid,
            num_placeholders=processed.num_placeholders,
        )

    def _resolve_file_sync(self, ref_ids: FileRef, ref: str) -> ResolvedItem:
        """An ``mmfile:v1`` item: envelope, payload sha256 and fingerprint checked, payload decoded
        with vLLM, its grid bounded, its layout, placeholder length and pixel mode checked."""
        item_file = read_feature_item(
            self.config.asset_root,
            ref_ids,
            fingerprint=self.adapter.fingerprint,
            ref_string=ref,
            max_bytes=self.config.max_feature_bytes,
        )
        what = f"feature payload ({self.adapter.family})"
        item = decode_item(item_file.payload, CorruptFeature, what, ref)
        self.adapter.check_grid(self.layout.grid_of(item, CorruptFeature, what, ref), ref=ref)
        checked = self.layout.check(item, CorruptFeature, what, ref)
        want_dtype = "torch.uint8" if self.device_normalize else "torch.float32"
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
            content_key=f"mmref:v1:file:{item_file.envelope.payload_sha256}:{self.adapter.fingerprint}",
            item=item,
            grid=checked.grid,
            num_placeholders=checked.num_placeholders,
        )
