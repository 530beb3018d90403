"""Offloading: an image or a video written into an asset store and its ``mmraw`` ref formatted,
with the grid and placeholder count a family's adapter gives (docs/PROTOCOL.md §1-2)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from protocol.images import image_bytes, load_image
from protocol.refs import ContentRef, RawRefBody, file_uri_to_path, format_content_ref, format_mmraw
from protocol.roots import AssetRoot, AssetRoots, open_root, put_content
from protocol.store import AssetStore
from protocol.structs import RawMMRef

if TYPE_CHECKING:
    from PIL.Image import Image

    from protocol.adapters.base import ImageAdapter
    from protocol.adapters.video import VideoMixin
    from protocol.roots import StoredContent

__all__ = ["RefForm", "content_named_ref", "offload_image", "offload_video", "opened_root", "store_and_ref"]

RefForm = Literal["v1", "v2"]
"""Which ``mmraw`` form :func:`store_and_ref` writes: ``"v1"`` (base64url JSON naming a
``file://`` path) or ``"v2"`` (``mmraw:v2:``, named by content: docs/PROTOCOL.md §1)."""


def store_and_ref(
    adapter: ImageAdapter,
    image: bytes | Image | os.PathLike[str] | str,
    store: AssetStore | AssetRoot | AssetRoots,
    *,
    form: RefForm = "v1",
) -> RawMMRef:
    """Store a raw image and return its ``mmraw`` :class:`RawMMRef` (grid from its decoded size).

    Args:
        image: encoded bytes, a PIL image (stored as PNG) or a path
            (:func:`protocol.images.image_bytes`).
        store: where the bytes go: an :class:`AssetStore`, one root (a local folder or an
            object store: create-if-absent), or :class:`AssetRoots` (its first root).
        form: ``"v1"`` (a ``file://`` path: an :class:`AssetStore` only) or ``"v2"``
            (named by content, resolvable on any machine whose roots hold the bytes). Every
            party resolves both; the default stays ``"v1"``, which resolves where the
            single-machine flow puts it (docs/SCALING.md §6).

    Raises:
        ImageUnreadable, AssetTooLarge: the image cannot be decoded or is too large.
        StoreUnavailable, HashMismatch: see :func:`protocol.roots.put_content`.
        ValueError: ``form="v1"`` with an object store or a root list, or an unknown form.
    """
    if form not in ("v1", "v2"):
        raise ValueError(f"form must be 'v1' or 'v2', got {form!r}")
    if form == "v1" and not isinstance(store, AssetStore):
        raise ValueError("v1 refs name a local file: offload them to an AssetStore, or use form='v2'")
    data = image_bytes(image)
    decoded = load_image(data)
    try:
        grid = adapter.grid_for_size(decoded.width, decoded.height)
    except ValueError as e:  # e.g. smart_resize: aspect ratio > 200; nothing is stored then
        raise adapter.refusal(e, size=decoded.size) from e
    ref, sha256, media_type = _stored_ref(adapter, data, store, grid, form)
    return RawMMRef(
        ref=ref,
        sha256=sha256,
        media_type=media_type,
        grid=list(grid),
        num_placeholders=adapter.num_placeholders(grid),
    )


def _stored_ref(
    adapter: ImageAdapter,
    data: bytes,
    store: AssetStore | AssetRoot | AssetRoots,
    grid: tuple[int, ...],
    form: RefForm,
) -> tuple[str, str, str]:
    """Write ``data`` and format its ref: ``(ref string, full sha256, media type)``."""
    if form == "v2":
        ref, content = content_named_ref(store, data, adapter.family, grid, adapter.fingerprint)
        return ref, content.sha256, content.media_type
    assert isinstance(store, AssetStore)
    stored = store.put_image(data)
    raw = RawRefBody(
        family=adapter.family,
        modality="image",
        mm_hash=stored.mm_hash,
        payload=adapter.payload(grid),
        raw_image_uri=stored.uri,
        fingerprint=adapter.fingerprint,
    )
    return format_mmraw(raw), stored.sha256, stored.media_type


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
    return adapter.offload(image, opened_root(root), form=form)


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
            a family of :data:`~protocol.adapters.video_families.VIDEO_FAMILIES`).
        form: ``"v1"`` (``file://`` path) or ``"v2"`` (named by content).

    Raises:
        VideoUnreadable, AssetTooLarge: see :meth:`VideoMixin.offload_video`.
        UnsupportedFamily: the adapter has no video path.
        StoreUnavailable, HashMismatch, ValueError: see :func:`offload_image`.
    """
    return adapter.offload_video(video, opened_root(root), form=form)


def opened_root(root: str | os.PathLike[str] | AssetRoot | AssetRoots) -> AssetStore | AssetRoot | AssetRoots:
    """``root`` as a store to write to: an opened root as is, a ``file://`` URL or a folder as an
    :class:`AssetStore`, another URL (``s3://...``) through :func:`protocol.roots.open_root`.

    Raises:
        StoreUnavailable, ValueError: see :func:`protocol.roots.open_root`.
    """
    if isinstance(root, AssetRoot | AssetRoots):
        return root
    text = os.fspath(root)
    if text.startswith("file://"):
        return AssetStore(file_uri_to_path(text))
    if "://" in text:
        return open_root(text)
    return AssetStore(root)


def content_named_ref(
    store: AssetStore | AssetRoot | AssetRoots,
    data: bytes,
    family: str,
    grid: Sequence[int],
    fingerprint: str,
) -> tuple[str, StoredContent]:
    """Write ``data`` by content (:func:`protocol.roots.put_content`) and format its ``mmraw:v2:``
    ref (the extension says image or video): ``(ref string, what was stored)``.

    Raises:
        StoreUnavailable, HashMismatch: see :func:`protocol.roots.put_content`.
    """
    content = put_content(store, data)
    body = ContentRef(
        sha256=content.sha256, ext=content.ext, family=family, grid=tuple(grid), fingerprint=fingerprint
    )
    return format_content_ref(body), content
