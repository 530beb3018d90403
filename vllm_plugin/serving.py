"""Resolve refs in a generate request into the ``features`` vLLM's own handler expects.

Differences from upstream ``vllm/entrypoints/scale_out/token_in_token_out/serving.py``
(vLLM 0.32), and nothing else:

- ``features.kwargs_data[modality][i]`` may hold an ``mmraw:`` ref string instead of
  vLLM's base64 item; the request may instead carry top-level ``mm_refs``
  (``RawMMRef`` objects or ref strings, prompt order) and no ``features``.
- Each ref is read from the confined asset root, hash-checked, decoded like vLLM,
  processed by the model's own HF image processor (the instance vLLM itself uses),
  grid-checked, and encoded the way vLLM's ``encode_mm_kwargs_item`` does; the item's hash
  for vLLM's caches is ``"mmref-" + sha256("mmref:v1:" + sha256(image bytes) + ":" + fingerprint +
  ":" + pixel mode)`` (content-bound, never a client uuid). The ``mmref-`` namespace is reserved: a client
  item (inline data, a ``content_parts`` uuid) may not claim such a hash, so nobody can put their
  own pixels into vLLM's caches under a resolved ref's hash; a ``null`` (cache-only) slot may name
  one, since its item is whatever this server resolved. ``mm_metadata`` (which vLLM merges over
  the item; vLLM's render route emits it, so the renderers client sends it back) is dropped at
  those positions: the resolved item is complete.
- Placeholder ranges are located (``mm_refs``) or checked (``features``) against the
  prompt: expanded ``<|image_pad|>`` runs of exactly ``num_placeholders`` each.
- A ``null`` slot whose hash vLLM's processor cache does not hold is a 404, not a 500.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec

from protocol.adapters import ImageAdapter
from protocol.errors import (
    CorruptFeature,
    FingerprintMismatch,
    GridMismatch,
    InvalidRef,
    InvalidRequest,
    NotCached,
    PlaceholderMismatch,
)
from protocol.features import read_feature_item
from protocol.placeholders import check_range, locate_image_runs
from protocol.refs import FileRef, RawRefBody, is_ref, parse_ref
from protocol.store import AssetStore
from protocol.structs import RawMMRef
from vllm_plugin import metrics
from vllm_plugin.cache import ByteBudgetLRU
from vllm_plugin.config import PluginConfig

__all__ = ["MMRefResolver", "ResolvedItem"]

_codecs = threading.local()
ENGINE_HASH_PREFIX = "mmref-"
"""Namespace of the hashes this server gives vLLM for resolved refs (reserved: see the module doc)."""


def _engine_hash(key: str) -> str:
    return ENGINE_HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def _thread_codec() -> tuple[Any, Any]:
    """This thread's vLLM ``MsgpackEncoder``/``MsgpackDecoder`` (not thread-safe for tensors, so
    one per resolver thread instead of vLLM's module-level pair behind a lock)."""
    if not hasattr(_codecs, "encoder"):
        from vllm.multimodal.inputs import MultiModalKwargsItem
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        _codecs.encoder = MsgpackEncoder(size_threshold=2**62)  # all tensors inline, as mm_serde
        _codecs.decoder = MsgpackDecoder(t=MultiModalKwargsItem)
    return _codecs.encoder, _codecs.decoder


def _encode_item(item: Any) -> str:
    """``vllm/.../token_in_token_out/mm_serde.py::encode_mm_kwargs_item`` with this thread's encoder."""
    import pybase64

    (buf,) = _thread_codec()[0].encode(item)
    return pybase64.b64encode(buf).decode("ascii")


def _check_item(data: str) -> None:
    """Decode a client's inline item the way vLLM will (``mm_serde.decode_mm_kwargs_item``).

    Raises:
        InvalidRequest: not base64, not msgpack, or not a ``MultiModalKwargsItem``.
    """
    import pybase64

    try:
        item = _thread_codec()[1].decode(pybase64.b64decode(data, validate=True))
        if not item or not all(hasattr(v, "data") for v in item.values()):
            raise ValueError("no tensor fields")
    except Exception as e:  # untrusted bytes: any failure is the client's
        raise InvalidRequest(
            f"an inline features item is not a valid vLLM item: {type(e).__name__}: {e}"
        ) from e


@dataclass(frozen=True)
class ResolvedItem:
    """One ref, resolved: what goes into a ``features`` slot."""

    engine_hash: str
    """Hash given to vLLM (``mm_hashes``): ``"mmref-"`` + 64 hex."""
    encoded: str
    """vLLM's base64 msgpack ``MultiModalKwargsItem``."""
    grid: tuple[int, ...]
    num_placeholders: int

    @property
    def nbytes(self) -> int:
        return len(self.encoded)


class MMRefResolver:
    """Turns refs into processed vLLM items, cached by ref, single-flight.

    Args:
        adapter: the served family's adapter (wrapping vLLM's own HF image processor).
        config: plugin settings (asset root, limits, cache budget).
        fields_config: ``BatchFeature -> {field: MultiModalFieldConfig}``, the served model's
            own layout declaration (vLLM ``BaseMultiModalProcessor._get_mm_fields_config``).
        device_normalize: the engine's resolved ``mm_device_do_normalize``.
        placeholder_token_id: the model's image placeholder token id.
        processor_cache: vLLM's sender-side processor cache (for ``null`` slots), or None.
    """

    def __init__(
        self,
        adapter: ImageAdapter,
        config: PluginConfig,
        *,
        fields_config: Any,
        device_normalize: bool,
        placeholder_token_id: int,
        processor_cache: Any = None,
    ) -> None:
        self.adapter = adapter
        self.config = config
        self.store = AssetStore(config.asset_root)
        self.fields_config = fields_config
        self.device_normalize = device_normalize
        self.placeholder_token_id = placeholder_token_id
        self.processor_cache = processor_cache
        self.cache: ByteBudgetLRU[ResolvedItem] = ByteBudgetLRU(
            config.cache_budget_bytes, lambda item: item.nbytes
        )
        metrics.register_cache(self.cache)
        self._pool = ThreadPoolExecutor(config.max_workers, thread_name_prefix="mmref-resolve")
        self.pixel_mode = "raw" if device_normalize else "normalized"
        self._layout = functools.lru_cache(maxsize=256)(self._layout)  # type: ignore[method-assign]

    # --- one ref ---------------------------------------------------------------------

    async def resolve(self, ref: str) -> ResolvedItem:
        """Resolve one ref string (cached by the whole ref string).

        Raises:
            MMRefError subclasses: see :meth:`protocol.adapters.ImageAdapter.resolve_raw`.
        """
        key = hashlib.sha256(ref.encode("utf-8", "surrogatepass")).hexdigest()
        cached = self.cache.get(key)  # fast path: no parse, no task (counted as a hit by the cache)
        if cached is not None:
            return cached
        parsed = parse_ref(ref)
        if isinstance(parsed, RawRefBody):
            self.adapter.check_ref(parsed, ref=ref)  # cheap checks before queueing work
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
        return await self.cache.get_or_compute(key, lambda: loop.run_in_executor(self._pool, timed))

    def _resolve_raw_sync(self, body: RawRefBody, ref: str) -> ResolvedItem:
        from transformers import BatchFeature
        from vllm.multimodal.inputs import MultiModalKwargsItems

        processed = self.adapter.resolve_raw(
            body,
            self.store,
            ref=ref,
            device_normalize=self.device_normalize,
            max_bytes=self.config.max_image_bytes,
            max_pixels=self.config.max_image_pixels,
        )
        hf_inputs = BatchFeature(dict(processed.tensors))
        items = MultiModalKwargsItems.from_hf_inputs(hf_inputs, self.fields_config(hf_inputs))
        (item,) = items[self.adapter.vllm_modality]
        # the full sha256 of the bytes read, not the ref's (possibly 16-hex) mm_hash prefix
        engine_hash = _engine_hash(
            f"mmref:v1:{processed.sha256}:{self.adapter.fingerprint}:{self.pixel_mode}"
        )
        encoded = _encode_item(item)
        return ResolvedItem(
            engine_hash=engine_hash,
            encoded=encoded,
            grid=processed.grid,
            num_placeholders=processed.num_placeholders,
        )

    def _resolve_file_sync(self, ref_ids: FileRef, ref: str) -> ResolvedItem:
        """An ``mmfile:v1`` item: envelope, payload sha256 and fingerprint checked, payload decoded
        with vLLM and its grid, placeholder length and pixel mode checked before use."""
        import pybase64

        item_file = read_feature_item(
            self.config.asset_root,
            ref_ids,
            fingerprint=self.adapter.fingerprint,
            ref_string=ref,
            max_bytes=self.config.max_feature_bytes,
        )
        try:
            item = _thread_codec()[1].decode(item_file.payload)
            pixels = item["pixel_values"].data
            grid = tuple(int(g) for g in item[self.adapter.grid_field].data.reshape(-1).tolist())
            if len(grid) != self.adapter.grid_len or min(grid) < 1:
                raise ValueError(f"grid {list(grid)} is not {self.adapter.grid_len} positive ints")
        except Exception as e:  # any decode failure of untrusted bytes is the file's fault
            raise CorruptFeature(
                f"feature payload is not a valid {self.adapter.family} item: {e}", ref=ref
            ) from e
        self._check_layout(item, grid, ref)
        want_dtype = "torch.uint8" if self.device_normalize else "torch.float32"
        if str(pixels.dtype) != want_dtype:
            raise FingerprintMismatch(
                f"feature pixels are {pixels.dtype}; this server ({self.pixel_mode}) feeds {want_dtype}",
                ref=ref,
            )
        expected = self.adapter.num_placeholders(grid)
        if expected != item_file.envelope.placeholder_length:
            raise GridMismatch(
                f"envelope placeholder_length {item_file.envelope.placeholder_length} != {expected} "
                f"from the item's grid {list(grid)}",
                ref=ref,
            )
        engine_hash = _engine_hash(
            f"mmref:v1:file:{item_file.envelope.payload_sha256}:{self.adapter.fingerprint}"
        )
        return ResolvedItem(
            engine_hash=engine_hash,
            encoded=pybase64.b64encode(item_file.payload).decode("ascii"),
            grid=grid,
            num_placeholders=expected,
        )

    def _layout(self, grid: tuple[int, ...]) -> dict[str, tuple[type, tuple[int, ...], Any]]:
        """``{field: (field kind, shape, dtype)}`` of the served model's item for ``grid``, built from
        ``adapter.synthesize_placeholder(grid)`` with the model's own field config (memoized per
        grid in ``__init__``: it depends on nothing else)."""
        from transformers import BatchFeature
        from vllm.multimodal.inputs import MultiModalKwargsItems

        hf_inputs = BatchFeature(dict(self.adapter.synthesize_placeholder(grid).tensors))
        (item,) = MultiModalKwargsItems.from_hf_inputs(hf_inputs, self.fields_config(hf_inputs))[
            self.adapter.vllm_modality
        ]
        return {key: (type(e.field), tuple(e.data.shape), e.data.dtype) for key, e in item.items()}

    def _check_layout(self, item: Any, grid: tuple[int, ...], ref: str) -> None:
        """The item must have exactly the fields, field kinds, shapes and (but for the pixels,
        whose dtype follows the pixel mode) dtypes of :meth:`_layout` for its grid: vLLM does not
        check rows against the grid, and a mismatch would fail inside the engine.

        Raises:
            CorruptFeature: naming the first field that differs.
        """
        expected = self._layout(grid)
        if set(item) != set(expected):
            raise CorruptFeature(f"feature item fields {sorted(item)} != {sorted(expected)}", ref=ref)
        for key, (kind, shape, dtype) in expected.items():
            got = item[key]
            same = tuple(got.data.shape) == shape and type(got.field) is kind
            if not same or (key != "pixel_values" and got.data.dtype != dtype):
                raise CorruptFeature(
                    f"feature item field {key!r} is {type(got.field).__name__} {got.data.dtype}"
                    f"{list(got.data.shape)}; grid {list(grid)} needs {kind.__name__} "
                    f"{dtype}{list(shape)}",
                    ref=ref,
                )

    # --- one request -----------------------------------------------------------------

    async def fill_features(self, body: dict[str, Any]) -> dict[str, Any]:
        """Return a copy of a generate request body with every ref resolved into ``features``.

        Raises:
            InvalidRequest: malformed ``mm_refs``/``features``/``token_ids``.
            MMRefError subclasses: a ref that cannot be used (see :meth:`resolve`).
            PlaceholderMismatch: the prompt's placeholder tokens do not fit the refs.
        """
        body = dict(body)
        for part in body.get("content_parts") or ():
            if isinstance(part, dict) and str(part.get("uuid") or "").startswith(ENGINE_HASH_PREFIX):
                raise InvalidRequest(f"content_parts uuids starting with {ENGINE_HASH_PREFIX!r} are reserved")
        mm_refs = body.pop("mm_refs", None)
        token_ids = body.get("token_ids")
        if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
            raise InvalidRequest("token_ids must be a list of integers")
        features = body.get("features")
        if mm_refs is not None:
            if features is not None:
                raise InvalidRequest("give either mm_refs or features, not both")
            body["features"] = await self._features_from_refs(mm_refs, token_ids)
        elif isinstance(features, dict):
            body["features"] = await self._fill_ref_slots(features, token_ids)
        return body

    async def _features_from_refs(self, mm_refs: Any, token_ids: list[int]) -> dict[str, Any]:
        if not isinstance(mm_refs, list) or not mm_refs:
            raise InvalidRequest("mm_refs must be a non-empty list of refs")
        self._check_ref_count(len(mm_refs))
        entries = [self._ref_entry(r) for r in mm_refs]
        resolved = await asyncio.gather(*(self.resolve(e if isinstance(e, str) else e.ref) for e in entries))
        for entry, item in zip(entries, resolved, strict=True):
            if isinstance(entry, RawMMRef):
                self._check_declared(entry, item)
        counts = [item.num_placeholders for item in resolved]
        ranges = locate_image_runs(token_ids, [], self.placeholder_token_id, counts=counts)
        modality = self.adapter.vllm_modality
        return {
            "mm_hashes": {modality: [item.engine_hash for item in resolved]},
            "mm_placeholders": {modality: [{"offset": o, "length": n} for o, n in ranges]},
            "kwargs_data": {modality: [item.encoded for item in resolved]},
        }

    @staticmethod
    def _ref_entry(raw: Any) -> str | RawMMRef:
        """An ``mm_refs`` entry: a ref string as is, an object converted (once) to a RawMMRef."""
        if isinstance(raw, str):
            return raw
        if isinstance(raw, dict):
            try:
                return msgspec.convert(raw, RawMMRef)
            except msgspec.ValidationError as e:
                raise InvalidRef(f"mm_refs entry is not a RawMMRef: {e}") from e
        raise InvalidRequest(
            f"mm_refs entries must be ref strings or RawMMRef objects, got {type(raw).__name__}"
        )

    def _check_declared(self, declared: RawMMRef, item: ResolvedItem) -> None:
        ref = declared.ref
        if list(item.grid) != list(declared.grid) or item.num_placeholders != declared.num_placeholders:
            raise PlaceholderMismatch(
                f"RawMMRef declares grid {declared.grid} / {declared.num_placeholders} placeholders, "
                f"the image gives {list(item.grid)} / {item.num_placeholders}",
                ref=ref,
            )
        body = parse_ref(ref)
        if isinstance(body, RawRefBody) and not declared.sha256.startswith(body.mm_hash):
            raise InvalidRef("RawMMRef sha256 and the ref's mm_hash disagree", ref=ref)

    async def _fill_ref_slots(self, features: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        from pydantic import ValidationError
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import MultiModalFeatures

        try:  # vLLM's own schema: types, parallel lengths, non-overlapping ranges (refs are str slots)
            MultiModalFeatures.model_validate(features)
        except ValidationError as e:
            raise InvalidRequest(f"invalid features: {e.errors()[0].get('msg', e)}") from e
        hashes = {m: list(v) for m, v in features["mm_hashes"].items()}
        placeholders = {m: [dict(p) for p in v] for m, v in features["mm_placeholders"].items()}
        kwargs_data = features.get("kwargs_data")
        slots = {m: list(v) for m, v in kwargs_data.items()} if kwargs_data else None
        if slots is None:
            slots = {m: [None] * len(v) for m, v in hashes.items()}
        self._check_ref_count(sum(is_ref(x) for v in slots.values() for x in v))
        for modality, modality_slots in slots.items():
            for i, slot in enumerate(modality_slots):
                if (
                    slot is not None
                    and not is_ref(slot)
                    and hashes[modality][i].startswith(ENGINE_HASH_PREFIX)
                ):
                    raise InvalidRequest(
                        f"{modality} item {i}: hashes starting with {ENGINE_HASH_PREFIX!r} are reserved "
                        "for refs this server resolves; send the ref, or a null slot"
                    )
        inline = [x for v in slots.values() for x in v if x is not None and not is_ref(x)]
        inline += [  # metadata at a ref's position is dropped below, never decoded
            x
            for m, v in (features.get("mm_metadata") or {}).items()
            for i, x in enumerate(v)
            if x is not None and not is_ref(slots[m][i]) and not hashes[m][i].startswith(ENGINE_HASH_PREFIX)
        ]
        if inline:  # vLLM decodes them in its handler, where a malformed one is a 500
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(loop.run_in_executor(self._pool, _check_item, x) for x in inline))
        for modality, modality_slots in slots.items():
            jobs = {i: s for i, s in enumerate(modality_slots) if is_ref(s)}
            resolved = await asyncio.gather(*(self.resolve(s) for s in jobs.values()))
            for (i, ref), item in zip(jobs.items(), resolved, strict=True):
                check_range(
                    token_ids,
                    placeholders[modality][i],
                    self.placeholder_token_id,
                    item.num_placeholders,
                    ref,
                )
                modality_slots[i] = item.encoded
                hashes[modality][i] = item.engine_hash
            for i, slot in enumerate(modality_slots):
                if slot is None:
                    self._require_cached(hashes[modality][i])
        metadata = features.get("mm_metadata")
        if metadata:  # vLLM merges it over the item: a resolved ref's item is complete and authoritative
            metadata = {
                m: [None if hashes[m][i].startswith(ENGINE_HASH_PREFIX) else x for i, x in enumerate(v)]
                for m, v in metadata.items()
            }
        if self.adapter.vllm_modality in placeholders:
            total = sum(int(p.get("length", 0)) for p in placeholders[self.adapter.vllm_modality])
            found = sum(1 for t in token_ids if t == self.placeholder_token_id)
            if found != total:
                raise PlaceholderMismatch(
                    f"prompt has {found} image placeholder tokens (id {self.placeholder_token_id}), "
                    f"mm_placeholders cover {total}"
                )
        out = {**features, "mm_hashes": hashes, "mm_placeholders": placeholders, "kwargs_data": slots}
        if metadata:
            out["mm_metadata"] = metadata
        return out

    def _check_ref_count(self, n: int) -> None:
        if n > self.config.max_refs_per_request:
            raise InvalidRequest(
                f"{n} refs in one request; MMREF_MAX_REFS_PER_REQUEST is {self.config.max_refs_per_request}"
            )

    def _require_cached(self, mm_hash: str) -> None:
        cache = self.processor_cache
        if cache is None or not cache.is_cached_item(mm_hash):
            raise NotCached(
                f"cache-only item {mm_hash[:64]!r} is not in this server's processor cache; "
                "send the item or a ref"
            )
