"""The positions of a ``features`` request of the served modality, each checked: the one job of
:class:`PositionChecks`, which :class:`~vllm_plugin.resolution.FeatureForm` calls for that form.

A position is a ref (resolved, :mod:`vllm_plugin.resolver`), an inline item (decoded and merged as
vLLM will, then checked against the served layout, :mod:`vllm_plugin.items`) or a ``null`` slot
(the engine's cache, or a content-named image hash resolved from the roots); every stated range
must be as long as its item (:mod:`protocol.placeholder_ranges`). The read bound and the reserved
``mmref-`` namespace are checked over all positions first.
"""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

from protocol.errors import InvalidRequest, NotCached
from protocol.placeholder_ranges import check_length, check_range
from protocol.refs import is_ref
from upstream import load
from vllm_plugin.engine_items import EngineItems
from vllm_plugin.items import CheckedItem, decode_item
from vllm_plugin.resolver import MMRefResolver, ResolvedItem
from vllm_plugin.weights import ENGINE_HASH_PREFIX, binding_digest, parse_handle

__all__ = ["Position", "PositionChecks", "positions"]


class Position(NamedTuple):
    """One ``features`` position of one modality."""

    index: int
    mm_hash: str
    slot: str | None
    """The ``kwargs_data`` entry: a ref string, an inline item, or None (a ``null`` slot)."""
    metadata: str | None
    """The ``mm_metadata`` entry (an encoder-cache transfer's metadata-only item), or None."""
    placeholder: Any
    """vLLM's ``PlaceholderRangeInfo`` (``offset``, ``length``)."""


def positions(features: Any, modality: str, hashes: list[str]) -> list[Position]:
    """The positions of ``modality`` in vLLM's ``MultiModalFeatures``, ``hashes`` its
    ``mm_hashes`` (absent ``kwargs_data`` or ``mm_metadata``: None slots)."""
    ranges = list(features.mm_placeholders.get(modality, ()))
    kwargs = list((features.kwargs_data or {}).get(modality) or [None] * len(hashes))
    metadata = list((features.mm_metadata or {}).get(modality) or [None] * len(hashes))
    return [Position(i, *parts) for i, parts in enumerate(zip(hashes, kwargs, metadata, ranges, strict=True))]


class _Call(NamedTuple):
    """What every check of one request reads."""

    token_ids: list[int]
    version: str


class PositionChecks:
    """Checks the served modality's ``features`` positions of generate requests.

    Args:
        resolver: resolves refs and handles (and owns the adapter, the item layout and the pool).
        engine_items: what the engine may hold, for ``null`` slots.
        placeholder_token_id: the model's image placeholder token id.
        ec_transfer: whether the server has an encoder-cache connector (metadata-only items).
    """

    def __init__(
        self,
        resolver: MMRefResolver,
        engine_items: EngineItems,
        *,
        placeholder_token_id: int,
        ec_transfer: bool,
    ) -> None:
        self.resolver = resolver
        self.adapter = resolver.adapter
        self.engine_items = engine_items
        self.placeholder_token_id = placeholder_token_id
        self.ec_transfer = ec_transfer

    @staticmethod
    def reads(found: list[Position]) -> int:
        """The reads ``found`` may make the server do: each ref slot, and each null slot naming an
        image (a content-named hash), costs one (the caller bounds it)."""
        return sum(
            is_ref(p.slot) if p.slot is not None else parse_handle(p.mm_hash) is not None for p in found
        )

    def check_reserved(self, found: list[Position]) -> None:
        """An item the server does not resolve may not claim an ``mmref-`` hash.

        Raises:
            InvalidRequest: an inline (or metadata-only) item under a reserved hash.
        """
        for p in found:
            if not (p.slot is not None and is_ref(p.slot)) and p.mm_hash.startswith(ENGINE_HASH_PREFIX):
                if p.slot is not None or p.metadata is not None:
                    raise InvalidRequest(
                        f"{self._where(p)}: hashes starting with {ENGINE_HASH_PREFIX!r} are reserved for "
                        "refs this server resolves; send the ref, or a null slot"
                    )

    async def check_all(
        self, found: list[Position], token_ids: list[int], version: str
    ) -> list[ResolvedItem | CheckedItem | None]:
        """Every position checked concurrently (null slots: the engine's record settled first,
        vLLM >= 0.33), by position: a resolved ref or handle, a checked inline item, or None (an
        item the engine holds).

        Raises:
            InvalidRequest, PlaceholderMismatch, NotCached, MMRefError subclasses: see
                :meth:`_check`.
        """
        if any(p.slot is None and p.metadata is None for p in found):
            await self.engine_items.settle()
        call = _Call(token_ids, version)
        return list(await asyncio.gather(*(self._check(call, p) for p in found)))

    async def _check(self, call: _Call, p: Position) -> ResolvedItem | CheckedItem | None:
        """One position: a ref (resolved), an inline item (checked), a ``null`` slot.

        Raises:
            InvalidRequest: a video ref here, a metadata-only item without an encoder-cache
                connector, an inline item that is not the model's.
            PlaceholderMismatch: a range that is not the item's. NotCached: see :meth:`_null_slot`.
            MMRefError subclasses: a ref that cannot be used (``resolver.py``).
        """
        if p.slot is not None and is_ref(p.slot):
            item = await self.resolver.resolve(p.slot)
            if item.content_key.kind == "video":
                raise InvalidRequest(f'{self._where(p)}: a video ref goes in a "video" position')
            self._check_range(call, p, item.num_placeholders, p.slot)
            return item
        if p.slot is None and p.metadata is None:
            return await self._null_slot(call, p)
        if p.slot is None and not self.ec_transfer:
            raise InvalidRequest(
                f"{self._where(p)}: a metadata-only item needs an encoder-cache connector on the server"
            )
        loop = asyncio.get_running_loop()
        checked = await loop.run_in_executor(self.resolver.pool, self._check_inline, p)
        check_length(p.placeholder.model_dump(), checked.num_placeholders, self._where(p))
        return checked

    async def _null_slot(self, call: _Call, p: Position) -> ResolvedItem | None:
        """A ``null`` slot: served from the engine's cache (None), or, for a content-named image
        hash (``weights.parse_handle``) bound to this server's fingerprint, pixel mode and the
        call's version that the engine does not hold, resolved from the roots as a ref is.

        Raises:
            NotCached: a content-named hash under another binding (other weights, fingerprint or
                pixel mode: no item this server computes can be it), or any other hash the engine
                does not hold.
            PlaceholderMismatch: the slot's range is not the item's length.
            MMRefError subclasses: the handle's image cannot be resolved (``resolver.resolve_handle``).
        """
        handle = parse_handle(p.mm_hash)
        if handle is not None:
            binding = binding_digest(self.adapter.fingerprint, self.resolver.pixel_mode, call.version)
            if handle.binding != binding:
                raise NotCached(
                    f"{self._where(p)}: hash {p.mm_hash[:120]!r} was minted under other weights or another "
                    f"layout (this server: version {call.version!r}, fingerprint {self.adapter.fingerprint}, "
                    f"{self.resolver.pixel_mode} pixels); send the ref"
                )
        known, recorded = self.engine_items.lookup(p.mm_hash)
        if not known and handle is not None:
            item = await self.resolver.resolve_handle(handle.sha256, handle.ext, p.mm_hash)
            self._check_range(call, p, item.num_placeholders, p.mm_hash)
            return item
        if not known:
            raise NotCached(
                f"{self._where(p)}: the engine holds no item under hash {p.mm_hash[:80]!r} "
                f"({self.engine_items.mode.value} cache); send the item or its ref"
            )
        if recorded is None:  # a ref's item whose request runs, or one vLLM's own processor sent
            items = self.engine_items
            recorded = items.length_of(p.mm_hash) or await items.recorded_by_vllm(p.mm_hash)
        if recorded is not None:
            check_length(p.placeholder.model_dump(), recorded.num_placeholders, self._where(p))
        return None

    def _check_inline(self, p: Position) -> CheckedItem:
        """Decode an inline item and its ``mm_metadata`` as vLLM will, merge them as vLLM merges
        them (``mm_features.merge_mm_kwargs_items``), check the result (worker thread)."""
        where = self._where(p)
        item = decode_item(p.slot, InvalidRequest, f"{where} (kwargs_data)") if p.slot is not None else None
        meta = (
            decode_item(p.metadata, InvalidRequest, f"{where} (mm_metadata)")
            if p.metadata is not None
            else None
        )
        merged = load("MultiModalKwargsItem")({**(item or {}), **(meta or {})})
        if item is None:  # metadata-only (encoder-cache transfer): only its grid and range are checked
            grid = self.resolver.layout.grid_of(merged, InvalidRequest, where)
            return CheckedItem(grid, self.adapter.num_placeholders(grid))
        return self.resolver.layout.check(merged, InvalidRequest, where)

    def _check_range(self, call: _Call, p: Position, expected: int, ref: str) -> None:
        check_range(call.token_ids, p.placeholder.model_dump(), self.placeholder_token_id, expected, ref)

    def _where(self, p: Position) -> str:
        """The position, as error messages name it (e.g. ``"image item 2"``)."""
        return f"{self.adapter.vllm_modality} item {p.index}"
