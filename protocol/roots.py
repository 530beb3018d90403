"""Asset roots: where every party finds an image by its content (docs/PROTOCOL.md §2.5).

A content-named ref (``mmraw:v2:``, :class:`protocol.refs.ContentRef`) carries no place. Each
party (rollout worker, server replica, trainer rank) resolves it against its own ordered list of
asset roots, ``MMREF_ASSET_ROOTS``: local folders (absolute paths or ``file://`` URIs) and object
store URLs (``s3://bucket/prefix``, ``gs://``, ``az://``, ``http(s)://``, through obstore, the
Python bindings of the Rust ``object_store`` crate). Every root holds the store layout of
docs/PROTOCOL.md §2 (``images/<sha256[:16]><ext>``), so today's stores serve v2 refs unchanged.

Resolution (:meth:`AssetRoots.read_image`), in order:

1. the node's read-through cache (:class:`protocol.read_cache.ReadCache`), when configured;
2. each root in turn: the first holding bytes whose sha256 is the ref's wins (bytes from an
   object store then go to the cache); a missing key, an unreachable root (connection refused,
   timeout after obstore's retries, permission denied; a local file that cannot be opened:
   permission denied, too many open files) or other bytes -> the next root;
3. nothing found: :class:`StoreUnavailable` (503) if a root could not be asked, else
   :class:`HashMismatch` (409) if a root held other bytes, else :class:`AssetNotFound` (404).
   The message counts the roots tried and their kind, never a path or URL (docs/SECURITY.md);
   which roots, and why each failed, go to this module's log.

A file over ``max_bytes`` (:class:`AssetTooLarge`, from the object's size before its body is
read) or a local path leading out of its root (:class:`AssetOutsideRoot`) raises at once.

Confinement holds for every backend: keys are built from a validated sha256 and an extension of
a fixed set (:func:`protocol.refs.image_key`), then placed under the root's folder (confined,
``O_NOFOLLOW`` reads of :class:`AssetStore`) or prefix; no ref names a bucket, host or prefix.
Credentials come only from the provider's standard chain (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``
environment variables, instance metadata, web identity): a root URL carrying credentials is
refused, so neither refs nor log lines ever hold one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from protocol.errors import (
    AssetNotFound,
    AssetOutsideRoot,
    HashMismatch,
    StoreUnavailable,
)
from protocol.images import sniff_media_type
from protocol.read_cache import ReadCache
from protocol.refs import ContentRef, RawRefBody, asset_key, file_uri_to_path
from protocol.root_stores import (
    OBJECT_SCHEMES,
    AssetRoot,
    LocalRoot,
    ObjectRoot,
    StoreClientConfig,
    open_root,
)
from protocol.store import DEFAULT_MAX_IMAGE_BYTES, AssetStore, atomic_write, check_sha256
from protocol.store_settings import NodeStoreSettings
from protocol.video_header import sniff_video_type

__all__ = [
    "OBJECT_SCHEMES",
    "ROOTS_ENV",
    "AssetRoot",
    "AssetRoots",
    "LocalRoot",
    "ObjectRoot",
    "StoreClientConfig",
    "StoredContent",
    "open_root",
    "parse_roots_spec",
    "put_content",
]

ROOTS_ENV = "MMREF_ASSET_ROOTS"
"""Environment variable: the ordered roots, comma-separated or a JSON list of strings."""

_log = logging.getLogger(__name__)

_V1_TAIL_RE = re.compile(
    r"(?:/(?P<run>run_[A-Za-z0-9_.-]+)/assets)?/(?P<dir>images|videos)/"
    r"(?P<name>[a-f0-9]{16}(?:\.jpg|\.png|\.webp|\.gif|\.img|\.mp4|\.mov))\Z"
)


@dataclass(frozen=True)
class StoredContent:
    """An image or a video written to (or found in) a root by :func:`put_content`."""

    sha256: str
    """Full lowercase hex sha256 of the bytes."""
    ext: str
    """Store extension (``.jpg`` ...)."""
    media_type: str
    nbytes: int
    key: str
    """``images/<sha256[:16]><ext>`` (a video: ``videos/...``), relative to the root."""
    root: str
    """The root written to (its URL or path: never a credential)."""
    written: bool
    """False when the root already held the image."""


def parse_roots_spec(value: str) -> list[str]:
    """``MMREF_ASSET_ROOTS``: a JSON list of strings, or comma-separated entries (blank ones dropped).

    Raises:
        ValueError: a JSON value that is not a list of strings.
    """
    text = value.strip()
    if text.startswith("["):
        items = json.loads(text)
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"{ROOTS_ENV} as JSON must be a list of strings")
        return [i.strip() for i in items if i.strip()]
    return [part.strip() for part in text.split(",") if part.strip()]


def put_content(target: AssetStore | AssetRoot | AssetRoots, data: bytes) -> StoredContent:
    """Store raw image bytes at ``images/<sha256[:16]><ext>`` of ``target`` (an
    :class:`AssetRoots` writes to its first root); idempotent and safe when writers race. An
    MP4/QuickTime file (:func:`protocol.video_header.sniff_video_type`) goes to
    ``videos/<sha256[:16]><ext>`` (nothing decoded: offloading checks a video first).

    Raises:
        ImageUnreadable: the bytes are neither a video container nor an allowed image format.
        HashMismatch: an object store holds another object under the key (see :meth:`ObjectRoot.put`).
        StoreUnavailable: the object store could not be asked.
        ValueError: an :class:`AssetRoots` without roots.
    """
    media_type, ext = sniff_video_type(data) or sniff_media_type(data)
    digest = hashlib.sha256(data).hexdigest()
    key = asset_key(digest, ext)
    if isinstance(target, AssetRoots):
        if not target.roots:
            raise ValueError("no asset roots to write to")
        target = target.roots[0]
    if isinstance(target, AssetStore):
        written, name = atomic_write(target.root / key, data), str(target.root)
    else:
        written, name = target.put(key, data), target.url
    return StoredContent(digest, ext, media_type, len(data), key, name, written)


class AssetRoots:
    """The ordered roots one party resolves images against, with an optional read-through cache
    and, for v1 refs, the party's ``MMREF_ASSET_ROOT`` (:class:`protocol.store.ImageSource`).

    Args:
        roots: tried in order.
        cache: the node's read-through cache of object-store reads (None: no cache).
        legacy_root: ``MMREF_ASSET_ROOT``: v1 refs are first read as today, at their ``file://``
            path confined to this folder.
    """

    def __init__(
        self,
        roots: Sequence[AssetRoot],
        *,
        cache: ReadCache | None = None,
        legacy_root: str | os.PathLike[str] | None = None,
    ) -> None:
        self.roots = list(roots)
        self.cache = cache
        self.legacy = AssetStore(legacy_root) if legacy_root is not None else None

    @classmethod
    def from_urls(
        cls,
        urls: Sequence[str | os.PathLike[str]],
        *,
        client: StoreClientConfig | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_bytes: int = 0,
        legacy_root: str | os.PathLike[str] | None = None,
    ) -> AssetRoots:
        """Roots from their configured forms (:func:`open_root`); a cache when ``cache_dir`` is
        given and ``cache_bytes > 0``.

        Raises:
            ValueError: see :func:`open_root` and :class:`ReadCache`.
        """
        cache = ReadCache(cache_dir, cache_bytes) if cache_dir is not None and cache_bytes > 0 else None
        return cls([open_root(u, client) for u in urls], cache=cache, legacy_root=legacy_root)

    @classmethod
    def from_settings(
        cls,
        settings: NodeStoreSettings,
        urls: Sequence[str | os.PathLike[str]],
        *,
        legacy_root: str | os.PathLike[str] | None = None,
    ) -> AssetRoots:
        """``urls`` opened in order with ``settings``: ``store_*`` for object stores, the node's
        read cache (``read_cache_dir``, ``read_cache_bytes``); ``legacy_root`` for v1 refs.

        Raises:
            ValueError, OSError: see :meth:`from_urls`.
        """
        return cls.from_urls(
            urls,
            client=settings.store_client(),
            cache_dir=settings.read_cache_dir,
            cache_bytes=settings.read_cache_bytes,
            legacy_root=legacy_root,
        )

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, legacy_root: str | os.PathLike[str] | None = None
    ) -> AssetRoots:
        """``MMREF_ASSET_ROOTS`` (none: no roots), ``MMREF_READ_CACHE_DIR``,
        ``MMREF_READ_CACHE_BYTES`` and ``MMREF_STORE_*``, read as every party reads them
        (:class:`protocol.store_settings.NodeStoreSettings`, the fields of
        :class:`protocol.settings.StoreSettings`).

        Raises:
            protocol.setting_names.SettingError: a setting that does not parse.
            ValueError: a root that does not open, see :meth:`from_urls`.
        """
        env = os.environ if environ is None else environ
        urls = parse_roots_spec(env.get(ROOTS_ENV, ""))
        return cls.from_settings(NodeStoreSettings.read(environ), urls, legacy_root=legacy_root)

    def describe(self) -> list[str]:
        """The roots as configured, in order (for start-up logs: no credential is ever in them)."""
        return [r.url for r in self.roots]

    def put_image(self, data: bytes) -> StoredContent:
        """:func:`put_content` into the first root."""
        return put_content(self, data)

    def read_image(
        self,
        body: RawRefBody | ContentRef,
        *,
        max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        ref: str | None = None,
    ) -> tuple[bytes, str]:
        """The bytes an ``mmraw`` ref names, found by content, and their full hex sha256.

        v2 (:class:`ContentRef`): the cache, then each root at ``images/<sha256[:16]><ext>``
        (module docstring). v1 (:class:`RawRefBody`): at its ``file://`` path under
        ``legacy_root`` as today; if that path is outside the root or missing, by content: a
        path ending ``[run_<id>/assets/]images/<mm_hash[:16]><ext>`` is looked up under
        ``legacy_root`` (that tail) and under each root (``images/...``), bytes checked against
        ``mm_hash``. A copied or re-mounted store keeps serving the refs made before the move.

        Raises:
            StoreUnavailable: no root had the image and one could not be asked (retryable).
            HashMismatch: no root had the image and one held other bytes under its key.
            AssetNotFound: no root holds the key.
            AssetOutsideRoot: a v1 path outside ``legacy_root`` that no root holds by content;
                a local path leading out of its root.
            AssetTooLarge: an object over ``max_bytes``.
            InvalidRef: a v1 URI that is not an absolute local ``file://`` URI.
        """
        if isinstance(body, ContentRef):
            return self.read_content(body.sha256, body.ext, max_bytes=max_bytes, ref=ref)
        path = file_uri_to_path(body.raw_image_uri, ref=ref)
        first_error: AssetOutsideRoot | AssetNotFound | None = None
        if self.legacy is not None:
            try:
                return self.legacy.read_path_hashed(path, body.mm_hash, max_bytes=max_bytes, ref=ref)
            except (AssetOutsideRoot, AssetNotFound) as e:
                first_error = e
        return self._first_holding(
            self._relocations(path, body.mm_hash), body.mm_hash, max_bytes, ref, first_error
        )

    def read_content(
        self, sha256: str, ext: str, *, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES, ref: str | None = None
    ) -> tuple[bytes, str]:
        """The bytes whose full hex sha256 is ``sha256``, stored as ``images/<sha256[:16]><ext>``:
        the cache, then each root in order (what a v2 ref reads; also a content-named cache
        handle of the server, which carries the same two parts).

        Raises:
            ValueError: ``sha256`` not 64 lowercase hex, or ``ext`` not a store extension.
            StoreUnavailable, HashMismatch, AssetNotFound, AssetTooLarge, AssetOutsideRoot: see
                :meth:`read_image`.
        """
        key = asset_key(sha256, ext)
        if self.cache is not None:
            cached = self.cache.get(sha256, max_bytes=max_bytes)
            if cached is not None:
                return cached, sha256
        return self._first_holding([(r, key) for r in self.roots], sha256, max_bytes, ref, None)

    def _relocations(self, path: str, mm_hash: str) -> list[tuple[AssetRoot, str]]:
        """Where a v1 ref's file may be now: its ``[run_<id>/assets/]images/<name>`` tail under the
        legacy root, ``images/<name>`` under every root (name = the ref's ``mm_hash[:16]`` + ext)."""
        m = _V1_TAIL_RE.search(path)
        if m is None or not m["name"].startswith(mm_hash[:16]):
            return []
        key = f"{m['dir']}/{m['name']}"
        out: list[tuple[AssetRoot, str]] = []
        if self.legacy is not None:
            legacy = LocalRoot(self.legacy.root)
            if m["run"]:
                out.append((legacy, f"{m['run']}/assets/{key}"))
            out.append((legacy, key))
        return out + [(r, key) for r in self.roots]

    def _first_holding(
        self,
        candidates: list[tuple[AssetRoot, str]],
        mm_hash: str,
        max_bytes: int,
        ref: str | None,
        first_error: AssetOutsideRoot | AssetNotFound | None,
    ) -> tuple[bytes, str]:
        """The first candidate ``(root, key)`` holding bytes that hash to ``mm_hash``, else the
        refusal of the module docstring's step 3. Refusals count the roots tried and say of which
        kind; which roots, and why each failed, goes to this module's log (never to a client)."""
        unavailable: set[str] = set()  # root URLs: a root may be tried under two keys (v1)
        retry_after: list[float] = []
        mismatched: set[str] = set()
        for root, key in candidates:
            try:
                data = root.get(key, max_bytes=max_bytes, ref=ref)
            except AssetNotFound:
                _log.debug("image %s: asset root %s has no %s", mm_hash, root.url, key)
                continue
            except StoreUnavailable as e:
                _log.warning("image %s: asset root %s could not be asked: %s", mm_hash, root.url, e.message)
                unavailable.add(root.url)
                retry_after += [e.retry_after_s] if e.retry_after_s else []
                continue
            try:
                digest = check_sha256(data, mm_hash, ref=ref)
            except HashMismatch:
                _log.warning("image %s: asset root %s holds other bytes under %s", mm_hash, root.url, key)
                mismatched.add(root.url)
                continue
            if self.cache is not None and not root.local and len(mm_hash) == 64:
                try:
                    self.cache.put(digest, data)
                except OSError:  # a full or read-only cache disk: serve without caching
                    pass
            return data, digest
        tried = _describe_tried(candidates)
        if unavailable:
            raise StoreUnavailable(
                f"image {mm_hash} not found in the reachable roots; {len(unavailable)} of the {tried} "
                "could not be asked",
                ref=ref,
                retry_after_s=min(retry_after) if retry_after else None,
            )
        if mismatched:
            raise HashMismatch(
                f"no root holds bytes hashing to {mm_hash}; other bytes in {len(mismatched)} of the {tried}",
                ref=ref,
            )
        if first_error is not None:
            raise first_error
        where = f"none of the {tried}" if candidates else "no root: no asset roots configured"
        raise AssetNotFound(f"image {mm_hash} is in {where}", ref=ref)


def _describe_tried(candidates: Sequence[tuple[AssetRoot, str]]) -> str:
    """How many distinct roots ``candidates`` names, and of which kind, e.g. ``"2 roots tried (1
    local folder, 1 object store)"``: never a path or URL (docs/SECURITY.md)."""
    roots = {r.url: r for r, _ in candidates}.values()
    local = sum(1 for r in roots if r.local)
    kinds = [(local, "local folder"), (len(roots) - local, "object store")]
    parts = ", ".join(f"{n} {kind}{'s' if n != 1 else ''}" for n, kind in kinds if n)
    return f"{len(roots)} root{'s' if len(roots) != 1 else ''} tried ({parts})"
