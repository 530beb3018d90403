"""The ``features`` request form's checks: each position a ref (resolved), an inline item (decoded
and checked as vLLM will merge it), or a ``null`` slot (the engine's cache, or a content-named
handle resolved from the roots), every range as long as its item (docs/ARCHITECTURE.md).

:class:`FeatureChecks` is a mixin of :class:`~vllm_plugin.serving.MMRefServing`: it reads the
serving object's ``adapter``, ``config``, ``resolver``, ``engine_items``, ``ec_transfer`` and
``placeholder_token_id``; its ref-count bound serves both request forms.
"""

from __future__ import annotations

import asyncio
from typing import Any

from protocol.errors import InvalidRequest, NotCached, PlaceholderMismatch
from protocol.placeholders import check_range
from protocol.refs import is_ref
from vllm_plugin.engine_items import RecordedItem
from vllm_plugin.items import CheckedItem, decode_item
from vllm_plugin.resolver import ResolvedItem
from vllm_plugin.serving_tokens import ResolvedSlot
from vllm_plugin.vllm_surface import load
from vllm_plugin.weights import ENGINE_HASH_PREFIX, binding_digest, engine_hash, parse_handle

__all__ = ["FeatureChecks"]


class FeatureChecks:
    """``MMRefServing``'s checks of a request's ``features`` (see the module doc)."""

    adapter: Any
    config: Any
    resolver: Any
    engine_items: Any
    ec_transfer: bool
    placeholder_token_id: int

    def _check_ref_count(self, n: int) -> None:
        if n > self.config.max_refs_per_request:
            raise InvalidRequest(
                f"{n} refs (or image handles) in one request; MMREF_MAX_REFS_PER_REQUEST is "
                f"{self.config.max_refs_per_request}"
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
                sent.append((hashes[i], RecordedItem(result.num_placeholders)))
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
        if recorded is None:  # a ref's item whose request runs, or one vLLM's own processor sent
            items = self.engine_items
            recorded = items.length_of(mm_hash) or await items.recorded_by_vllm(mm_hash)
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
