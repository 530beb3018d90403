"""A request's images, checked and resolved into what vLLM's engine gets: a :class:`Resolution`,
returned by :class:`FeatureForm` for each of the two request forms.

- ``mm_refs`` (prompt order, :meth:`FeatureForm.from_refs`): each ref resolved (``resolver.py``),
  its placeholder run located in the prompt (``protocol.placeholders.locate_image_runs``; video
  refs, Qwen2.5-VL, under ``"video"`` with the video token's runs);
- ``features`` (:meth:`FeatureForm.check`): each position of the served modality a ref
  (resolved), an inline item (decoded and checked as vLLM will merge it), or a ``null`` slot (the
  engine's cache, or a content-named handle resolved from the roots), every range as long as its
  item (``feature_positions.py``'s :class:`~vllm_plugin.feature_positions.PositionChecks`); video
  positions (Qwen2.5-VL) video refs only, resolved here (docs/ARCHITECTURE.md).

A resolved ref's slot is left ``null`` in the features vLLM reads; its item travels as a
:class:`~vllm_plugin.serving_tokens.ResolvedSlot` and enters the engine input at the hand-off.
Every engine hash is bound to the weight version the form was called with (``weights.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, NamedTuple

from protocol.adapters import VIDEO_FAMILIES
from protocol.errors import InvalidRef, InvalidRequest, PlaceholderMismatch
from protocol.placeholder_ranges import check_range
from protocol.placeholders import locate_image_runs
from protocol.refs import ContentRef, RawRefBody, is_ref
from protocol.structs import RawMMRef
from upstream import load
from vllm_plugin.engine_items import RecordedItem
from vllm_plugin.feature_positions import PositionChecks, positions
from vllm_plugin.items import CheckedItem
from vllm_plugin.resolver import ResolvedItem
from vllm_plugin.serving_tokens import ResolvedSlot
from vllm_plugin.weights import engine_hash

__all__ = ["FeatureForm", "Resolution"]


@dataclass(frozen=True)
class Resolution:
    """A request's images, resolved and checked, bound to one weight version."""

    features: Any
    """vLLM's ``MultiModalFeatures`` for the request (resolved refs' slots ``null``), or the
    request's own where it has none to resolve (None: no images)."""
    sent: tuple[tuple[str, RecordedItem], ...]
    """The items the request gives the engine with data, by engine hash (``engine_items.py``)."""
    slots: tuple[ResolvedSlot, ...]
    """The resolved refs, by position: their items enter the engine input at the hand-off."""
    version: str
    """The weight version its engine hashes are bound to."""


class FeatureForm:
    """Resolves and checks the images of generate requests for the served model.

    Args:
        positions: the served modality's ``features`` positions, each checked; its resolver
            (which owns the adapter, the settings, the item layout and the pool), engine items
            (what the engine may hold, for ``null`` slots) and placeholder token id serve both forms.
        video_token_id: the model's video placeholder token id (None: no videos on this route).
    """

    def __init__(self, positions: PositionChecks, *, video_token_id: int | None = None) -> None:
        self.positions = positions
        self.resolver = positions.resolver
        self.adapter = positions.adapter
        self.engine_items = positions.engine_items
        self.placeholder_token_id = positions.placeholder_token_id
        self.video_token_id = video_token_id
        self.max_refs = self.resolver.config.max_refs_per_request

    def check_ref_count(self, n: int) -> None:
        """Bound the refs (and image handles) one request may make the server read.

        Raises:
            InvalidRequest: more than ``MMREF_MAX_REFS_PER_REQUEST``.
        """
        if n > self.max_refs:
            raise InvalidRequest(
                f"{n} refs (or image handles) in one request; MMREF_MAX_REFS_PER_REQUEST is {self.max_refs}"
            )

    async def from_refs(
        self, mm_refs: list[str | RawMMRef], token_ids: list[int], version: str
    ) -> Resolution:
        """The ``mm_refs`` form: every ref resolved, its run located in ``token_ids``.

        Raises:
            InvalidRequest: too many refs. PlaceholderMismatch: the prompt's runs do not fit the
            items, or a ``RawMMRef`` declares another grid. InvalidRef: a declared sha256 that is
            not the ref's. MMRefError subclasses: a ref that cannot be used (``resolver.py``).
        """
        self.check_ref_count(len(mm_refs))
        resolved = await asyncio.gather(
            *(self.resolver.resolve(e if isinstance(e, str) else e.ref) for e in mm_refs)
        )
        for entry, item in zip(mm_refs, resolved, strict=True):
            if isinstance(entry, RawMMRef):
                _check_declared(entry, item)
        groups = self._by_modality(resolved)
        hashes: dict[str, list[str]] = {}
        ranges: dict[str, list[dict[str, int]]] = {}
        sent, slots = [], []
        for m, (token_id, items) in groups.items():
            counts = [item.num_placeholders for item in items]
            runs = locate_image_runs(token_ids, [], token_id, counts=counts)
            hashes[m] = [engine_hash(item.content_key, version) for item in items]
            ranges[m] = [{"offset": o, "length": n} for o, n in runs]
            sent += [(h, _recorded(item)) for h, item in zip(hashes[m], items, strict=True)]
            slots += [ResolvedSlot(m, i, hashes[m][i], item.item) for i, item in enumerate(items)]
        features = load("MultiModalFeatures")(
            mm_hashes=hashes,
            mm_placeholders=ranges,
            kwargs_data={m: [None] * len(h) for m, h in hashes.items()},
        )
        return Resolution(features, tuple(sent), tuple(slots), version)

    def _by_modality(self, resolved: list[ResolvedItem]) -> dict[str, tuple[int, list[ResolvedItem]]]:
        """``{vLLM modality: (placeholder token id, items in prompt order)}``: images under the
        served modality, videos under ``"video"`` (each modality's runs are located apart).

        Raises:
            InvalidRequest: a video where the route cannot place it: no video token, or a family
                whose video placeholders are one run per frame between timestamp tokens (Qwen3-VL;
                vLLM 0.32's ``PlaceholderRangeInfo`` has no ``is_embed`` mask to say so).
        """
        images = [item for item in resolved if item.content_key.kind != "video"]
        videos = [item for item in resolved if item.content_key.kind == "video"]
        groups = (
            {self.adapter.vllm_modality: (self.placeholder_token_id, images)} if images or not videos else {}
        )
        if videos:
            if not self._places_videos():
                raise InvalidRequest(
                    f"{self.adapter.family} video refs go in chat video_url parts: this route's placeholder "
                    "ranges (offset, length) cannot express a video's runs between timestamp tokens"
                )
            groups["video"] = (self.video_token_id, videos)  # type: ignore[assignment]
        return groups

    def _places_videos(self) -> bool:
        """Whether this route can place the served family's videos: a video token, and one run per
        video (Qwen2.5-VL; not Qwen3-VL's runs between timestamp tokens)."""
        spec = VIDEO_FAMILIES.get(self.adapter.family)
        return spec is not None and not spec.per_frame_runs and self.video_token_id is not None

    async def check(self, features: Any, token_ids: list[int], version: str) -> Resolution:
        """The ``features`` form: every position checked, refs and content-named handles resolved.

        Raises:
            InvalidRequest: another modality, too many reads; a position's refusals
            (``feature_positions.PositionChecks``: ``check_reserved``, ``check_all``).
            PlaceholderMismatch, NotCached, MMRefError subclasses: see ``check_all``;
            :meth:`_video_slots`.
        """
        m = self.adapter.vllm_modality
        other = sorted(set(features.mm_hashes) - ({m, "video"} if self._places_videos() else {m}))
        if other:
            raise InvalidRequest(f"features modalities {other[:4]} are not served; this server takes {m!r}")
        videos = await self._video_slots(features, token_ids, version)
        hashes = list(features.mm_hashes.get(m, ()))
        if not hashes and videos is None:
            return Resolution(features, (), (), version)  # no items: vLLM's answer as is
        if not hashes:
            return _with_videos(features, Resolution(None, (), (), version), videos, None)
        found = positions(features, m, hashes)
        self.check_ref_count(self.positions.reads(found))
        self.positions.check_reserved(found)
        results = await self.positions.check_all(found, token_ids, version)
        kwargs, metadata = [p.slot for p in found], [p.metadata for p in found]
        sent, slots = [], []
        for i, result in enumerate(results):
            if isinstance(result, ResolvedItem):
                kwargs[i], hashes[i], metadata[i] = None, engine_hash(result.content_key, version), None
                slots.append(ResolvedSlot(m, i, hashes[i], result.item))
            if isinstance(result, ResolvedItem | CheckedItem):
                sent.append((hashes[i], _recorded(result)))
        checked = load("MultiModalFeatures")(
            mm_hashes={m: hashes},
            mm_placeholders={m: [p.placeholder for p in found]},
            kwargs_data={m: kwargs} if features.kwargs_data is not None else None,
            mm_metadata={m: metadata} if features.mm_metadata is not None else None,
        )
        resolution = Resolution(checked, tuple(sent), tuple(slots), version)
        return resolution if videos is None else _with_videos(features, resolution, videos, m)

    async def _video_slots(self, features: Any, token_ids: list[int], version: str) -> _Videos | None:
        """The ``"video"`` positions of ``features``: each a video ref slot (resolved, its range
        checked against the video token's run), for a family whose video is one run (Qwen2.5-VL).

        Raises:
            InvalidRequest: videos where this route cannot place them (see :meth:`_by_modality`),
                a video position that is not a ref (an inline item or a ``null`` slot: not yet).
            PlaceholderMismatch: a range that is not the video's run. MMRefError: the ref.
        """
        hashes = list(features.mm_hashes.get("video", ()))
        if not hashes:
            return None
        found = positions(features, "video", hashes)
        refs = [p.slot for p in found if p.slot is not None and is_ref(p.slot)]
        if len(refs) != len(found):
            raise InvalidRequest(
                "video positions take video refs only (inline items and null slots: not yet)"
            )
        self.check_ref_count(len(refs))
        items = await asyncio.gather(*(self.resolver.resolve(ref) for ref in refs))
        token_id = self._video_token(items)
        for p, ref, item in zip(found, refs, items, strict=True):
            check_range(token_ids, p.placeholder.model_dump(), token_id, item.num_placeholders, ref)
        new = [engine_hash(item.content_key, version) for item in items]
        return _Videos(new, [p.placeholder for p in found], list(items))

    def _video_token(self, items: list[ResolvedItem]) -> int:
        """The video token of a family whose videos this route places (see :meth:`_by_modality`)."""
        groups = self._by_modality(items)
        if "video" not in groups:
            raise InvalidRequest('a "video" position takes a video ref (this one names an image)')
        return groups["video"][0]


class _Videos(NamedTuple):
    """A request's resolved ``"video"`` positions."""

    hashes: list[str]
    placeholders: list[Any]
    items: list[ResolvedItem]


def _with_videos(features: Any, resolution: Resolution, videos: _Videos, m: str | None) -> Resolution:
    """``resolution`` (the served modality's positions; ``m`` None: none) with the videos added."""
    checked = resolution.features
    hashes = {m: list(checked.mm_hashes[m])} if m is not None else {}
    ranges = {m: list(checked.mm_placeholders[m])} if m is not None else {}
    kwargs = {m: list(checked.kwargs_data[m])} if m is not None and checked.kwargs_data is not None else {}
    hashes["video"], ranges["video"], kwargs["video"] = (
        videos.hashes,
        videos.placeholders,
        [None] * len(videos.hashes),
    )
    metadata = None
    if features.mm_metadata is not None:
        metadata = {**(checked.mm_metadata if m is not None else {}), "video": [None] * len(videos.hashes)}
    merged = load("MultiModalFeatures")(
        mm_hashes=hashes, mm_placeholders=ranges, kwargs_data=kwargs, mm_metadata=metadata
    )
    sent = (*resolution.sent, *((h, _recorded(i)) for h, i in zip(videos.hashes, videos.items, strict=True)))
    slots = (
        *resolution.slots,
        *(
            ResolvedSlot("video", i, h, it.item)
            for i, (h, it) in enumerate(zip(videos.hashes, videos.items, strict=True))
        ),
    )
    return Resolution(merged, sent, slots, resolution.version)


def _recorded(item: ResolvedItem | CheckedItem) -> RecordedItem:
    """The one place a sent item's record is made (its feature count, for later ``null`` slots)."""
    return RecordedItem(item.num_placeholders)


def _check_declared(declared: RawMMRef, item: ResolvedItem) -> None:
    """A ``RawMMRef``'s declared grid, placeholder count and sha256 must agree with its ref."""
    ref = declared.ref
    if list(item.grid) != list(declared.grid) or item.num_placeholders != declared.num_placeholders:
        raise PlaceholderMismatch(
            f"RawMMRef declares grid {declared.grid} / {declared.num_placeholders} placeholders, "
            f"the image gives {list(item.grid)} / {item.num_placeholders}",
            ref=ref,
        )
    body = item.body  # the ref as the resolver parsed it
    if isinstance(body, RawRefBody) and not declared.sha256.startswith(body.mm_hash):
        raise InvalidRef("RawMMRef sha256 and the ref's mm_hash disagree", ref=ref)
    if isinstance(body, ContentRef) and declared.sha256 != body.sha256:
        raise InvalidRef("RawMMRef sha256 and the v2 ref's sha256 disagree", ref=ref)
