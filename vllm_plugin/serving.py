"""The generate request, checked and resolved into what vLLM's own ``ServingTokens`` serves.

Differences from upstream ``vllm/entrypoints/scale_out/token_in_token_out/serving.py`` (vLLM
0.32), and nothing else (the request then goes to vLLM's own ``serve_tokens``):

- **Refs.** ``mm_refs`` (prompt order) become ``features``; a ``kwargs_data`` slot holding a ref
  string becomes the resolved item (``resolver.py``), its hash the ``mmref-`` engine hash, its
  ``mm_metadata`` dropped (the resolved item is complete). The item never takes vLLM's wire format:
  the slot is left empty in ``features`` and the item enters vLLM's engine input as a
  ``MultiModalKwargsItem`` (or a cache handle) when the request is handed to the engine
  (:class:`~vllm_plugin.serving_tokens.ResolvedSlot`, ``serving_tokens.py``, which lists every
  difference from upstream's ``ServingTokens``). The ``mmref-`` namespace is reserved: an inline
  item or a ``content_parts`` uuid may not claim it.
- **Weights.** Engine hashes and the ``cache_salt`` are bound to the weight version the engine
  reports at :meth:`MMRefServing.prepare` (``weights.py``).
- **Checks vLLM does not make, on what reaches the engine** (each a 4xx where stock would crash
  the engine, answer 500 or answer silently wrong; stock's answer everywhere else):
  ``features`` modality keys must be the served one; every item's placeholder range must be as
  long as the item's features (inline items and ``mm_metadata`` merged over them as vLLM merges
  them, ``null`` slots whose item this route sent, refs; a ref's range must also cover placeholder
  tokens only); inline items must have the served model's layout (``items.py``); a ``null`` slot
  the engine certainly lacks is a 404 (``engine_items.py``); a prompt with placeholder tokens and
  no image at all is a 422; a ``content_parts`` ``file://`` URL is refused when the server loads no
  local files, and under ``--allowed-local-media-path`` when it names no file (stock: 500) or
  something other than a regular file (a FIFO blocks vLLM's loader thread for good); on a vLLM
  CPU server, a seeded request whose prefill may be split is a 400 (``seeds.py``: it kills the
  engine).
- Placeholder tokens outside every range (e.g. a literal ``<|image_pad|>`` in user text beside a
  correctly ranged image) pass: vLLM merges embeddings by the ranges, not by token id.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.errors import InvalidRequest, NotCached, PlaceholderMismatch
from protocol.placeholders import check_range, locate_image_runs
from protocol.refs import ContentRef, RawRefBody, is_ref, parse_ref
from protocol.structs import RawMMRef
from vllm_plugin.content_parts import bind_content_refs, check_content_parts
from vllm_plugin.engine_items import EngineItems, RecordedItem
from vllm_plugin.items import CheckedItem, decode_item, encode_item
from vllm_plugin.protocol import MMRefGenerateRequest, parse_request
from vllm_plugin.resolver import MMRefResolver, ResolvedItem
from vllm_plugin.seeds import SplitRule
from vllm_plugin.serving_tokens import ResolvedSlot, pending_items
from vllm_plugin.vllm_surface import load
from vllm_plugin.weights import (
    ENGINE_HASH_PREFIX,
    binding_digest,
    engine_hash,
    parse_handle,
    served_by,
    version_salt,
)

logger = logging.getLogger("vllm.mmref")

__all__ = ["MMRefServing", "Prepared"]


@dataclass(frozen=True)
class Prepared:
    """A request ready for vLLM's ``serve_tokens``."""

    request: MMRefGenerateRequest
    """The request vLLM serves: ``features`` with the resolved refs' slots empty (``null``), the
    ``cache_salt`` bound to the weight version."""
    sent: list[tuple[str, RecordedItem]]
    """The items it gives the engine with data (``engine_items.py``)."""
    slots: tuple[ResolvedSlot, ...]
    """The resolved refs, by position: their items enter the engine input at the hand-off."""
    version: str
    """The weight version its engine hashes and ``cache_salt`` are bound to (``weights.py``)."""


class MMRefServing:
    """Checks and resolves generate requests for the served model.

    Args:
        resolver: resolves refs (and owns the adapter, the item layout and the worker pool).
        engine_items: what the engine may hold, for ``null`` slots.
        placeholder_token_id: the model's image placeholder token id.
        serving_tokens: vLLM's ``ServingTokens`` (``app.state.serving_tokens``).
        weight_version: returns the engine's current weight version (``weights.VersionReader``).
        allowed_local_media_path: vLLM's ``--allowed-local-media-path`` (None: no local files).
        ec_transfer: whether the server has an encoder-cache connector (metadata-only items).
        max_body_bytes: the request body limit (``MMREF_MAX_BODY_BYTES`` or its derived default).
        split_rule: seeded requests this server refuses (``seeds.py``; None: none).
    """

    def __init__(
        self,
        resolver: MMRefResolver,
        engine_items: EngineItems,
        *,
        placeholder_token_id: int,
        serving_tokens: Any,
        allowed_local_media_path: str | None,
        ec_transfer: bool,
        max_body_bytes: int,
        weight_version: Callable[[], Awaitable[str]],
        split_rule: SplitRule | None = None,
    ) -> None:
        self.resolver = resolver
        self.adapter = resolver.adapter
        self.config = resolver.config
        self.engine_items = engine_items
        self.placeholder_token_id = placeholder_token_id
        self.serving_tokens = serving_tokens
        self.local_media = Path(allowed_local_media_path).resolve() if allowed_local_media_path else None
        self.ec_transfer = ec_transfer
        self.max_body_bytes = max_body_bytes
        self.weight_version = weight_version
        self.split_rule = split_rule

    async def serve(self, body: Any, raw_request: Any) -> tuple[Any, str]:
        """A generate request's life: validated, prepared (:meth:`prepare`), served by vLLM's
        ``serve_tokens`` with the resolved items handed to the engine (``serving_tokens.py``), the
        items it carried recorded, and generated once more, under the version then current, if
        vLLM's ``weight_versions`` show it was not generated under the version it was bound to
        (non-streamed answers; ``weights.served_by``).

        Returns:
            ``(result, version)``: vLLM's ``ErrorResponse``, its response, or its stream, and the
            weight version the request was bound to.

        Raises:
            RequestValidationError: stock's refusal of the body (``protocol.parse_request``).
            MMRefError: the plugin's refusals (see :meth:`prepare`).
        """
        error_response, response = load("ErrorResponse"), load("GenerateResponseBase")
        for attempt in (1, 2):
            prepared = await self.prepare(parse_request(body))  # parsed again: vLLM mutates requests
            with pending_items(prepared.slots):
                result = await self.serving_tokens.serve_tokens(prepared.request, raw_request)
            if isinstance(result, error_response):
                break
            self.record(prepared.sent)
            if not isinstance(result, response) or served_by(result, prepared.version):
                break
            if attempt == 1:
                logger.info("mmref: not generated under weights %r alone; generating again", prepared.version)
        return result, prepared.version

    async def resolved_features(self, body: Any) -> tuple[dict[str, Any], str]:
        """A generate request's ``features`` as the engine would get them (``/inference/v1/resolve``):
        ``kwargs_data`` items are vLLM's base64 msgpack encoding (made in the worker pool) of the
        exact tensors the generate route feeds the model; no sampling parameters needed.

        Returns:
            ``({"features", "fingerprint", "pixel_mode"}, version)``.

        Raises:
            RequestValidationError, MMRefError: as :meth:`serve`.
        """
        if isinstance(body, dict):
            body.setdefault("sampling_params", {})
        prepared = await self.prepare(parse_request(body))
        features = prepared.request.features
        dumped = features.model_dump() if features is not None else None
        if prepared.slots:
            loop = asyncio.get_running_loop()
            pool = self.resolver.pool
            encoded = await asyncio.gather(
                *(loop.run_in_executor(pool, encode_item, s.item) for s in prepared.slots)
            )
            for slot, data in zip(prepared.slots, encoded, strict=True):
                dumped["kwargs_data"][slot.modality][slot.index] = data
        content = {
            "features": dumped,
            "fingerprint": self.adapter.fingerprint,
            "pixel_mode": self.resolver.pixel_mode,
        }
        return content, prepared.version

    async def prepare(self, request: MMRefGenerateRequest) -> Prepared:
        """Resolve refs and run the checks above, bound to the engine's current weight version.

        Raises:
            InvalidRequest, PlaceholderMismatch, NotCached: see the module doc.
            SeedUnsupported: a seeded request that could kill the engine (``seeds.py``).
            MMRefError subclasses: a ref that cannot be used (``resolver.py``).
        """
        token_ids = request.token_ids
        if self.split_rule is not None:
            self.split_rule.check_generate(request, self.placeholder_token_id)
        version = await self.weight_version()
        if request.content_parts:
            check_content_parts(request.content_parts, self.local_media)
            await bind_content_refs(request.content_parts, version)
        sent: list[tuple[str, RecordedItem]] = []
        slots: list[ResolvedSlot] = []
        features = request.features
        if request.mm_refs is not None:
            features = await self._features_from_refs(request.mm_refs, token_ids, sent, slots, version)
        elif features is not None:
            features = await self._check_features(features, token_ids, sent, slots, version)
        if not request.content_parts and not (features and any(features.mm_hashes.values())):
            self._refuse_unclaimed(token_ids)
        salt = version_salt(request.cache_salt, version)
        served = request.model_copy(update={"features": features, "mm_refs": None, "cache_salt": salt})
        return Prepared(served, sent, tuple(slots), version)

    def record(self, sent: list[tuple[str, RecordedItem]]) -> None:
        """The engine accepted a request: mirror its receiver cache for the items it carried."""
        for mm_hash, item in sent:
            self.engine_items.sent(mm_hash, item)

    # --- checks ------------------------------------------------------------------------

    def _refuse_unclaimed(self, token_ids: list[int]) -> None:
        found = token_ids.count(self.placeholder_token_id)
        if found:
            raise PlaceholderMismatch(
                f"prompt has {found} image placeholder tokens (id {self.placeholder_token_id}) and the "
                "request carries no image (mm_refs, features or content_parts; vLLM ignores unknown keys)"
            )

    def _check_ref_count(self, n: int) -> None:
        if n > self.config.max_refs_per_request:
            raise InvalidRequest(
                f"{n} refs (or image handles) in one request; MMREF_MAX_REFS_PER_REQUEST is "
                f"{self.config.max_refs_per_request}"
            )

    # --- the two request forms -----------------------------------------------------------

    async def _features_from_refs(
        self,
        mm_refs: list[str | RawMMRef],
        token_ids: list[int],
        sent: list[tuple[str, RecordedItem]],
        slots: list[ResolvedSlot],
        version: str,
    ) -> Any:
        self._check_ref_count(len(mm_refs))
        resolved = await asyncio.gather(
            *(self.resolver.resolve(e if isinstance(e, str) else e.ref) for e in mm_refs)
        )
        for entry, item in zip(mm_refs, resolved, strict=True):
            if isinstance(entry, RawMMRef):
                _check_declared(entry, item)
        counts = [item.num_placeholders for item in resolved]
        ranges = locate_image_runs(token_ids, [], self.placeholder_token_id, counts=counts)
        hashes = [engine_hash(item.content_key, version) for item in resolved]
        sent.extend((h, _recorded(item)) for h, item in zip(hashes, resolved, strict=True))
        m = self.adapter.vllm_modality
        slots.extend(ResolvedSlot(m, i, hashes[i], item.item) for i, item in enumerate(resolved))
        return load("MultiModalFeatures")(
            mm_hashes={m: hashes},
            mm_placeholders={m: [{"offset": o, "length": n} for o, n in ranges]},
            kwargs_data={m: [None] * len(resolved)},
        )

    async def _check_features(
        self, features: Any, token_ids: list[int], sent: list, slots: list[ResolvedSlot], version: str
    ) -> Any:
        m = self.adapter.vllm_modality
        other = sorted(set(features.mm_hashes) - {m})
        if other:
            raise InvalidRequest(f"features modalities {other[:4]} are not served; this server takes {m!r}")
        hashes = list(features.mm_hashes.get(m, ()))
        if not hashes:
            return features  # no items: vLLM's answer as is
        ranges = list(features.mm_placeholders.get(m, ()))
        kwargs = list((features.kwargs_data or {}).get(m) or [None] * len(hashes))
        metadata = list((features.mm_metadata or {}).get(m) or [None] * len(hashes))
        # each ref slot, and each null slot naming an image (it may be read and processed), costs a read
        reads = [
            is_ref(s) if s is not None else parse_handle(h) is not None
            for h, s in zip(hashes, kwargs, strict=True)
        ]
        self._check_ref_count(sum(reads))
        for i, (mm_hash, slot) in enumerate(zip(hashes, kwargs, strict=True)):
            if not (slot is not None and is_ref(slot)) and mm_hash.startswith(ENGINE_HASH_PREFIX):
                if slot is not None or metadata[i] is not None:
                    raise InvalidRequest(
                        f"{m} item {i}: hashes starting with {ENGINE_HASH_PREFIX!r} are reserved for refs "
                        "this server resolves; send the ref, or a null slot"
                    )
        if any(kwargs[i] is None and metadata[i] is None for i in range(len(hashes))):
            await self.engine_items.settle()  # null slots: P0 current first (vLLM >= 0.33)
        jobs = [
            self._check_slot(i, hashes[i], kwargs[i], metadata[i], ranges[i], token_ids, version)
            for i in range(len(hashes))
        ]
        results = await asyncio.gather(*jobs)
        for i, result in enumerate(results):
            if isinstance(result, ResolvedItem):
                kwargs[i], hashes[i], metadata[i] = None, engine_hash(result.content_key, version), None
                sent.append((hashes[i], _recorded(result)))
                slots.append(ResolvedSlot(m, i, hashes[i], result.item))
            elif isinstance(result, CheckedItem):
                sent.append((hashes[i], RecordedItem(result.num_placeholders)))
        return load("MultiModalFeatures")(
            mm_hashes={m: hashes},
            mm_placeholders={m: ranges},
            kwargs_data={m: kwargs} if features.kwargs_data is not None else None,
            mm_metadata={m: metadata} if features.mm_metadata is not None else None,
        )

    async def _check_slot(
        self,
        i: int,
        mm_hash: str,
        slot: str | None,
        metadata: str | None,
        placeholder: Any,
        token_ids: list[int],
        version: str,
    ) -> ResolvedItem | CheckedItem | None:
        """One ``features`` position: a ref (resolved), an inline item (checked), a ``null`` slot."""
        where = f"{self.adapter.vllm_modality} item {i}"
        if slot is not None and is_ref(slot):
            item = await self.resolver.resolve(slot)
            check_range(
                token_ids, placeholder.model_dump(), self.placeholder_token_id, item.num_placeholders, slot
            )
            return item
        if slot is None and metadata is None:
            return await self._null_slot(where, mm_hash, placeholder, token_ids, version)
        if slot is None and not self.ec_transfer:
            raise InvalidRequest(
                f"{where}: a metadata-only item needs an encoder-cache connector on the server"
            )
        loop = asyncio.get_running_loop()
        checked = await loop.run_in_executor(self.resolver.pool, self._check_inline, where, slot, metadata)
        self._check_length(where, placeholder, checked.num_placeholders)
        return checked

    async def _null_slot(
        self, where: str, mm_hash: str, placeholder: Any, token_ids: list[int], version: str
    ) -> ResolvedItem | None:
        """A ``null`` slot: served from the engine's cache (None), or, for a content-named image
        hash (``weights.parse_handle``) bound to this server's fingerprint, pixel mode and current
        version that the engine does not hold, resolved from the roots as a ref is.

        Raises:
            NotCached: a content-named hash under another binding (other weights, fingerprint or
                pixel mode: no item this server computes can be it), or any other hash the engine
                does not hold.
            PlaceholderMismatch: the slot's range is not the item's length.
            MMRefError subclasses: the handle's image cannot be resolved (``resolver.resolve_handle``).
        """
        handle = parse_handle(mm_hash)
        if handle is not None:
            binding = binding_digest(self.adapter.fingerprint, self.resolver.pixel_mode, version)
            if handle.binding != binding:
                raise NotCached(
                    f"{where}: hash {mm_hash[:120]!r} was minted under other weights or another layout "
                    f"(this server: version {version!r}, fingerprint {self.adapter.fingerprint}, "
                    f"{self.resolver.pixel_mode} pixels); send the ref"
                )
        known, recorded = self.engine_items.lookup(mm_hash)
        if not known and handle is not None:
            item = await self.resolver.resolve_handle(handle.sha256, handle.ext, mm_hash)
            check_range(
                token_ids, placeholder.model_dump(), self.placeholder_token_id, item.num_placeholders, mm_hash
            )
            return item
        if not known:
            raise NotCached(
                f"{where}: the engine holds no item under hash {mm_hash[:80]!r} "
                f"({self.engine_items.mode.value} cache); send the item or its ref"
            )
        if recorded is None:  # an item vLLM's own processor sent: its record in P0
            recorded = await self.engine_items.recorded_by_vllm(mm_hash)
        if recorded is not None:
            self._check_length(where, placeholder, recorded.num_placeholders)
        return None

    def _check_inline(self, where: str, slot: str | None, metadata: str | None) -> CheckedItem:
        """Decode an inline item and its ``mm_metadata`` as vLLM will, merge them as vLLM merges
        them (``mm_features.merge_mm_kwargs_items``), check the result (worker thread)."""
        item = decode_item(slot, InvalidRequest, f"{where} (kwargs_data)") if slot is not None else None
        meta = (
            decode_item(metadata, InvalidRequest, f"{where} (mm_metadata)") if metadata is not None else None
        )
        merged = load("MultiModalKwargsItem")({**(item or {}), **(meta or {})})
        if item is None:  # metadata-only (encoder-cache transfer): only its grid and range are checked
            grid = self.resolver.layout.grid_of(merged, InvalidRequest, where)
            return CheckedItem(grid, self.adapter.num_placeholders(grid))
        return self.resolver.layout.check(merged, InvalidRequest, where)

    @staticmethod
    def _check_length(where: str, placeholder: Any, expected: int) -> None:
        if placeholder.length != expected:
            raise PlaceholderMismatch(
                f"{where}: placeholder range at {placeholder.offset} has length {placeholder.length}; "
                f"the item has {expected} features"
            )


def _recorded(item: ResolvedItem) -> RecordedItem:
    return RecordedItem(item.num_placeholders)


def _check_declared(declared: RawMMRef, item: ResolvedItem) -> None:
    """A ``RawMMRef``'s declared grid, placeholder count and sha256 must agree with its ref."""
    from protocol.errors import InvalidRef

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
    if isinstance(body, ContentRef) and declared.sha256 != body.sha256:
        raise InvalidRef("RawMMRef sha256 and the v2 ref's sha256 disagree", ref=ref)
