"""Where :func:`trainer_lib.materialize` reads images, and which refs it may read (docs/PROTOCOL.md §2.5).

:func:`image_source` turns the trainer's setting (a folder, one :class:`AssetStore`, or the
ordered :class:`protocol.roots.AssetRoots` of ``MMREF_ASSET_ROOTS``) into the
:class:`protocol.store.ImageSource` that ``ImageAdapter.resolve_raw`` reads; :func:`describe_source`
names what it reads, for messages and logs; :func:`checked_refs` checks a batch's refs against the
adapter and the prompts before any file is read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from protocol.adapters import ImageAdapter
from protocol.errors import GridMismatch, InvalidRef
from protocol.placeholder_counts import check_no_typed_images, check_placeholder_counts
from protocol.placeholders import locate_image_runs
from protocol.refs import ContentRef, FileRef, RawRefBody, parse_ref
from protocol.roots import AssetRoots, LocalRoot
from protocol.store import AssetStore, ImageSource
from protocol.structs import RawMMRef, TrainingSample

__all__ = ["checked_refs", "describe_source", "image_source", "raw_body"]


def image_source(asset_root: str | os.PathLike[str] | ImageSource) -> ImageSource:
    """``asset_root`` as an :class:`ImageSource`: an ``AssetRoots`` or ``AssetStore`` as given; an
    object-store URL (``s3://bucket/prefix``) as that one root with the node's read cache and
    ``MMREF_STORE_*``, as every party reads them (:class:`protocol.settings.StoreSettings`); a
    folder as ``AssetRoots([folder], legacy_root=folder)`` (v1 refs by path, else by content under
    it, a store copied or mounted elsewhere; v2 refs at ``images/<sha256[:16]><ext>`` under it).

    Raises:
        ValueError, protocol.settings.SettingError: a URL or a setting that does not open.
    """
    if hasattr(asset_root, "read_image"):
        return asset_root  # type: ignore[return-value]
    if isinstance(asset_root, str) and "://" in asset_root and not asset_root.startswith("file://"):
        from protocol.settings import StoreSettings

        return StoreSettings().open_roots([asset_root])
    folder = Path(asset_root).resolve()  # type: ignore[arg-type]
    return AssetRoots([LocalRoot(folder)], legacy_root=folder)


def describe_source(source: ImageSource) -> list[str]:
    """The folders and URLs ``source`` reads, in order (never a credential: root URLs carry none)."""
    if isinstance(source, AssetRoots):
        legacy = [str(source.legacy.root)] if source.legacy is not None else []
        return list(dict.fromkeys([*legacy, *source.describe()]))
    if isinstance(source, AssetStore):
        return [str(source.root)]
    return [type(source).__name__]


def checked_refs(
    samples: Sequence[TrainingSample], adapter: ImageAdapter, placeholder_token_id: int | None
) -> tuple[list[list[str]], dict[str, RawRefBody | ContentRef], dict[str, tuple[int, ...]]]:
    """Before any file is read: each sample's image ref strings (videos are
    :mod:`trainer_lib.materialize_video`'s), every distinct ref's parsed body
    (first-seen order) and its grid (family, fingerprint and payload checked, the grid bounded by
    ``adapter.check_ref``); every sample checked against them.

    Raises:
        InvalidRef, UnsupportedFamily, FingerprintMismatch: a ref the adapter cannot read.
        GridMismatch: a ``RawMMRef`` grid other than its ref's, or a grid the processor cannot make.
        PlaceholderMismatch: a count other than the grid's, or (with ``placeholder_token_id``) a
            prompt whose image runs do not fit the refs.
    """
    per_sample = [[r.ref for r in _images(s)] for s in samples]
    bodies = {ref: raw_body(ref) for refs in per_sample for ref in refs}
    grids = {ref: adapter.check_ref(body, ref=ref) for ref, body in bodies.items()}
    for i, sample in enumerate(samples):
        _check_sample(i, sample, adapter, grids, placeholder_token_id)
    return per_sample, bodies, grids


def _check_sample(
    index: int,
    sample: TrainingSample,
    adapter: ImageAdapter,
    grids: dict[str, tuple[int, ...]],
    placeholder_token_id: int | None,
) -> None:
    """Each ``RawMMRef``'s grid is its ref string's, its count is the grid's; with a placeholder id,
    the prompt's image runs fit the refs (:func:`protocol.placeholders.locate_image_runs`), as
    packing checks them (:func:`~trainer_lib.planning.packing.analyze_entry`): a sample without
    refs may hold the placeholder id as text (a stray placeholder) but no image-typed token."""
    refs = _images(sample)
    for r in refs:
        if tuple(r.grid) != grids[r.ref]:
            raise GridMismatch(
                f"sample {index}: RawMMRef grid {r.grid} != its ref's grid {list(grids[r.ref])}", ref=r.ref
            )
    check_placeholder_counts(refs, adapter.num_placeholders, sample=index)
    if placeholder_token_id is None:
        return
    type_ids = sample.mm_refs.mm_token_type_ids if sample.mm_refs else None
    if not refs:  # video positions (typed 2) are materialize_video's to check
        check_no_typed_images(None if type_ids is None else [int(t == 1) for t in type_ids], sample=index)
        return
    locate_image_runs(sample.input_ids, refs, placeholder_token_id, mm_token_type_ids=type_ids, sample=index)


def _images(sample: TrainingSample) -> list[RawMMRef]:
    """The sample's image refs (its videos: :mod:`trainer_lib.materialize_video`)."""
    return [r for r in sample.mm_refs.items if r.modality == "image"] if sample.mm_refs else []


def raw_body(ref: str) -> RawRefBody | ContentRef:
    """A raw image ref's parsed body (v1 ``mmraw:`` or v2 ``mmraw:v2:``).

    Raises:
        InvalidRef: a ref that does not parse, or an ``mmfile:v1`` feature ref."""
    parsed = parse_ref(ref)
    if isinstance(parsed, FileRef):
        raise InvalidRef("mmfile:v1 refs are not materialized by this version yet", ref=ref)
    return parsed
