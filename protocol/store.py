"""The content-addressed asset store on shared disk (docs/PROTOCOL.md, "Asset store").

Layout under an absolute ``<asset_root>`` (``<output_root>/run_<RUN_ID>/assets``)::

    images/<sha256(file bytes)[:16]><ext>     raw bytes as received; .jpg .png .webp .gif, else .img
    videos/<sha256(file bytes)[:16]><ext>     a video's bytes as received; .mp4 .mov
    mm_features/v1/vllm-mmitem/<fingerprint>/<modality>/<mm_hash[:2]>/<mm_hash>.msgpack

Writers are idempotent and atomic (:func:`atomic_write`): a file that already holds the very
bytes is kept and its mtime refreshed, anything else there (a truncated or replaced file) is
replaced through a temp file in the same folder and ``os.replace``. Readers confine every path
to the root after resolving symlinks and check the content hash. docs/PROTOCOL.md has the
whole contract.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from protocol.errors import (
    AssetNotFound,
    AssetOutsideRoot,
    AssetTooLarge,
    HashMismatch,
    InvalidRef,
    MMRefError,
    StoreUnavailable,
    VideoUnreadable,
)
from protocol.images import sniff_media_type
from protocol.refs import MM_HASH_RE, ContentRef, RawRefBody, asset_key, file_uri_to_path
from protocol.video_header import sniff_video_type

__all__ = [
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_VIDEO_BYTES",
    "TEMP_PREFIX",
    "AssetStore",
    "ImageSource",
    "StoredImage",
    "atomic_write",
    "check_sha256",
    "existing_asset_root",
    "temp_file",
]

DEFAULT_MAX_IMAGE_BYTES = 64 * 1024 * 1024
"""Largest image file read (bytes); larger files raise :class:`AssetTooLarge`."""
DEFAULT_MAX_VIDEO_BYTES = 256 * 1024 * 1024
"""Largest video file read (bytes); larger files raise :class:`AssetTooLarge` before a byte is read."""
TEMP_PREFIX = ".tmp-"
"""Name prefix of a writer's temp file (in the target's folder, renamed over the target when whole)."""
_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ENXIO, errno.ENODEV})
"""``open`` errors of a confined path that was removed, or replaced by a socket or a device."""
_DENIED_ERRNOS = frozenset({errno.EACCES, errno.EPERM})


class ImageSource(Protocol):
    """Where :meth:`protocol.adapters.ImageAdapter.resolve_raw` reads an image's bytes: one
    :class:`AssetStore`, or the ordered roots of :class:`protocol.roots.AssetRoots`."""

    def read_image(
        self, body: RawRefBody | ContentRef, *, max_bytes: int = ..., ref: str | None = None
    ) -> tuple[bytes, str]:
        """The bytes an ``mmraw`` ref names and their full hex sha256, checked against the ref."""
        ...


def check_sha256(data: bytes, mm_hash: str, *, ref: str | None = None) -> str:
    """The full hex sha256 of ``data``, which must start with ``mm_hash`` (a v1 32-hex prefix, or
    a v2 ref's whole 64-hex sha256).

    Raises:
        HashMismatch: the bytes hash to something else.
    """
    digest = hashlib.sha256(data).hexdigest()
    if len(mm_hash) > len(digest) or not digest.startswith(mm_hash):
        raise HashMismatch(f"file sha256 {digest[: len(mm_hash)]} != ref hash {mm_hash}", ref=ref)
    return digest


@dataclass(frozen=True)
class StoredImage:
    """An image (or a video: :meth:`AssetStore.put_video`) written to (or found in) the store."""

    sha256: str
    """Full lowercase hex sha256 of the file bytes."""
    path: Path
    """Absolute path of the file."""
    media_type: str
    """E.g. ``"image/jpeg"``, sniffed from the header."""
    nbytes: int

    @property
    def uri(self) -> str:
        """Absolute ``file://`` URI (``Path.resolve().as_uri()``)."""
        return self.path.as_uri()

    @property
    def mm_hash(self) -> str:
        """``sha256[:32]``, the hash an ``mmraw`` ref carries."""
        return self.sha256[:32]


def existing_asset_root(value: str | os.PathLike[str]) -> Path:
    """``MMREF_ASSET_ROOT`` as an absolute, resolved path (settings validator of server and trainer).

    Raises:
        ValueError: not an existing folder.
    """
    resolved = Path(value).resolve()
    if not resolved.is_dir():
        raise ValueError(f"MMREF_ASSET_ROOT {str(value)!r} is not an existing folder")
    return resolved


def atomic_write(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` atomically, unless the file there already holds exactly ``data``.

    What is found is verified, never trusted: a regular file with the same bytes only gets its
    mtime refreshed (idempotent writers; the feature sweep's TTL counts from the last write), while
    a truncated, replaced or corrupted file, a symlink or anything else at ``path`` is replaced by a
    temp file in the same folder and ``os.replace`` (readers see the old file or the new one).

    Returns:
        True when the file was (re)written, False when it already held ``data``.
    """
    if _holds(path, data):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with temp_file(path.parent, data, path.suffix) as tmp:
        os.replace(tmp, path)
    return True


@contextlib.contextmanager
def temp_file(folder: Path, data: bytes, suffix: str = "") -> Iterator[str]:
    """A new file in ``folder`` (``TEMP_PREFIX`` + random name + ``suffix``) holding ``data``,
    for the caller to ``os.replace`` into place; removed on exit if it is still there.

    Created with ``O_EXCL | O_NOFOLLOW`` and mode ``0o666 & ~umask`` (not mkstemp's 0600: the
    server may run as another user); the sweep removes a crashed writer's leftovers by the prefix.
    """
    tmp = str(folder / f"{TEMP_PREFIX}{secrets.token_hex(8)}{suffix}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _holds(path: Path, data: bytes) -> bool:
    """Whether ``path`` is a regular file (not a symlink) holding exactly ``data``; if so its mtime
    is refreshed through the open descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # absent, a symlink (ELOOP), unreadable
        return False
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size != len(data) or f.read(len(data) + 1) != data:
            return False
        os.utime(f.fileno())
    return True


class AssetStore:
    """One asset root: writes images, confines and verifies reads.

    Args:
        root: the asset root; made absolute with ``Path.resolve()`` (a relative
            output dir never yields a relative ``file://`` URI).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()

    @property
    def images_dir(self) -> Path:
        return self.root / "images"

    def put_image(self, image: bytes | os.PathLike[str] | str) -> StoredImage:
        """Store raw image bytes (or a file's bytes) under ``images/``; idempotent and atomic.

        Raises:
            ImageUnreadable: the bytes are not an allowed image format.
        """
        data = image if isinstance(image, bytes) else Path(image).read_bytes()
        media_type, ext = sniff_media_type(data)
        digest = hashlib.sha256(data).hexdigest()
        path = self.images_dir / f"{digest[:16]}{ext}"
        atomic_write(path, data)
        return StoredImage(sha256=digest, path=path, media_type=media_type, nbytes=len(data))

    def put_video(self, video: bytes | os.PathLike[str] | str) -> StoredImage:
        """Store a video's bytes (or a file's bytes) under ``videos/``; idempotent and atomic.
        Nothing is decoded (offloading reads the header and decodes first).

        Raises:
            VideoUnreadable: not an MP4/QuickTime file (no ``ftyp`` box).
        """
        data = video if isinstance(video, bytes) else Path(video).read_bytes()
        sniffed = sniff_video_type(data)
        if sniffed is None:
            raise VideoUnreadable(f"not an MP4/QuickTime file ({len(data)} bytes): no ftyp box")
        digest = hashlib.sha256(data).hexdigest()
        path = self.root / asset_key(digest, sniffed[1])
        atomic_write(path, data)
        return StoredImage(sha256=digest, path=path, media_type=sniffed[0], nbytes=len(data))

    def confine(
        self, path: str | os.PathLike[str], *, ref: str | None = None, name: str | None = None
    ) -> Path:
        """Resolve ``path`` (symlinks included) and require it to stay inside the root.

        Args:
            name: how messages name the path (default: ``path`` as given, the ref's own); a
                root's reads pass the key, so no message names the root.

        Raises:
            AssetOutsideRoot: the resolved path is outside the root.
            AssetNotFound: the path does not exist.
        """
        shown = _shown(path, name)
        try:
            resolved = Path(os.path.realpath(path))
            outside = resolved != self.root and self.root not in resolved.parents
            exists = not outside and resolved.is_file()
        except (OSError, ValueError) as e:  # ENAMETOOLONG, ELOOP, ...
            raise AssetNotFound(f"no file at {shown}: {e.strerror or e}", ref=ref) from e
        if outside:
            raise AssetOutsideRoot(f"{shown} resolves outside the asset root", ref=ref)
        if not exists:
            raise AssetNotFound(f"no file at {shown}", ref=ref)
        return resolved

    def read_confined(
        self, path: str | os.PathLike[str], *, max_bytes: int, ref: str | None = None, name: str | None = None
    ) -> bytes:
        """Read a regular file inside the root, at most ``max_bytes``.

        :meth:`confine` first; then ``open(O_NOFOLLOW | O_NONBLOCK)`` on the resolved path and
        ``fstat`` of the open descriptor: a symlink, FIFO or device swapped in after the check is
        refused instead of followed or blocked on, and the size limit holds for what is read.

        Args:
            name: how messages name the path (see :meth:`confine`).

        Raises:
            AssetOutsideRoot, AssetNotFound: see :meth:`confine`; also a path that changed
                into a symlink (outside) or into something that is not a regular file (not found).
            StoreUnavailable: the file cannot be opened: permission denied (``EACCES``,
                ``EPERM``: :class:`protocol.roots.AssetRoots` tries the next root), too many open
                files, an I/O error (retryable).
            AssetTooLarge: the file exceeds ``max_bytes``.
        """
        resolved = self.confine(path, ref=ref, name=name)
        shown = _shown(path, name)
        try:
            fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise _open_error(e, shown, ref) from e
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise AssetNotFound(f"{shown} is not a regular file", ref=ref)
            if st.st_size > max_bytes:
                raise AssetTooLarge(f"file is {st.st_size} bytes, limit {max_bytes}", ref=ref)
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:  # grew after fstat
            raise AssetTooLarge(f"file is over {max_bytes} bytes", ref=ref)
        return data

    def read_hashed(
        self,
        uri: str,
        mm_hash: str,
        *,
        max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        ref: str | None = None,
    ) -> tuple[bytes, str]:
        """Read the file a ``file://`` URI names, confined to the root, and check its hash.

        Returns:
            The bytes and their full hex sha256 (computed once, for the check and the caller).

        Args:
            uri: absolute ``file://`` URI.
            mm_hash: expected lowercase hex prefix of ``sha256(bytes)`` (16..64 chars).
            max_bytes: refuse larger files before reading them.

        Raises:
            InvalidRef: not an absolute local ``file://`` URI.
            AssetOutsideRoot, AssetNotFound: see :meth:`confine`.
            StoreUnavailable: see :meth:`read_confined`.
            AssetTooLarge: the file exceeds ``max_bytes``.
            HashMismatch: the bytes do not hash to ``mm_hash``.
        """
        if not MM_HASH_RE.fullmatch(mm_hash):
            raise InvalidRef(f"mm_hash {mm_hash[:80]!r} does not match {MM_HASH_RE.pattern}", ref=ref)
        return self.read_path_hashed(file_uri_to_path(uri, ref=ref), mm_hash, max_bytes=max_bytes, ref=ref)

    def read_path_hashed(
        self, path: str, mm_hash: str, *, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES, ref: str | None = None
    ) -> tuple[bytes, str]:
        """:meth:`read_hashed` for a ref already parsed: ``path`` read from its URI once
        (:func:`~protocol.refs.file_uri_to_path`) and ``mm_hash`` checked when the ref was
        (:class:`~protocol.refs.RawRefBody`), so neither is checked again (issue 45). Returns the
        bytes and their full hex sha256.

        Raises:
            AssetOutsideRoot, AssetNotFound, StoreUnavailable, AssetTooLarge, HashMismatch: see
                :meth:`read_hashed`.
        """
        data = self.read_confined(path, max_bytes=max_bytes, ref=ref)
        return data, check_sha256(data, mm_hash, ref=ref)

    def read_image(
        self,
        body: RawRefBody | ContentRef,
        *,
        max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        ref: str | None = None,
    ) -> tuple[bytes, str]:
        """The bytes an ``mmraw`` ref names (:class:`ImageSource`): a v1 ref's ``file://`` URI
        (:meth:`read_hashed`), or a v2 ref's key ``images/<sha256[:16]><ext>`` under this root.

        Returns:
            The bytes and their full hex sha256.

        Raises:
            InvalidRef, AssetOutsideRoot, AssetNotFound, AssetTooLarge, HashMismatch: see
                :meth:`read_hashed` (a v2 ref's messages name its key, never the root).
            StoreUnavailable: see :meth:`read_confined`.
        """
        if isinstance(body, ContentRef):
            data = self.read_confined(self.root / body.key, max_bytes=max_bytes, ref=ref, name=body.key)
            return data, check_sha256(data, body.sha256, ref=ref)
        path = file_uri_to_path(body.raw_image_uri, ref=ref)
        return self.read_path_hashed(path, body.mm_hash, max_bytes=max_bytes, ref=ref)


def _shown(path: str | os.PathLike[str], name: str | None) -> str:
    """How a message names a path: ``name``, else the path as given (the ref's own), never the
    root nor where it resolves to; at most 200 characters, quoted."""
    return repr((str(path) if name is None else name)[:200])


def _open_error(e: OSError, shown: str, ref: str | None) -> MMRefError:
    """The typed error of an ``os.open`` of a confined path that failed with ``e``.

    ``ELOOP`` (a symlink swapped in after :meth:`AssetStore.confine`; ``O_NOFOLLOW``):
    :class:`AssetOutsideRoot`. Removed, or replaced by a socket or device: :class:`AssetNotFound`.
    Permission denied, and anything else (``EMFILE``, ``ENFILE``, ``EIO``...): the file may be
    there but cannot be read now, :class:`StoreUnavailable` (503, retryable; the next root is tried).
    """
    if e.errno == errno.ELOOP:
        return AssetOutsideRoot(f"{shown} changed into a symlink while being opened", ref=ref)
    if e.errno in _GONE_ERRNOS:
        return AssetNotFound(f"no file at {shown}", ref=ref)
    if e.errno in _DENIED_ERRNOS:
        return StoreUnavailable(f"{shown} cannot be read: permission denied", ref=ref)
    return StoreUnavailable(f"{shown} cannot be opened now: {e.strerror or e}", ref=ref)
