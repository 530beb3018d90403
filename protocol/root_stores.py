"""One asset root: a local folder or an object-store prefix through obstore (docs/PROTOCOL.md
§2.5), with the object-store client's settings (:class:`StoreClientConfig`, read from the
environment in :mod:`protocol.store_settings`, below this module). :mod:`protocol.roots` orders
the roots and resolves refs.

A root's keys are built from a validated sha256 and an extension of a fixed set
(:func:`protocol.refs.image_key`), then placed under its folder (confined, ``O_NOFOLLOW`` reads of
:class:`~protocol.store.AssetStore`) or prefix. An object-store URL carrying credentials is refused:
credentials come only from the provider's standard chain.
"""

from __future__ import annotations

import os
import re
import time
from abc import ABC, abstractmethod
from pathlib import Path
from urllib.parse import urlparse

from protocol.errors import AssetNotFound, AssetTooLarge, HashMismatch, InvalidRef, StoreUnavailable
from protocol.refs import file_uri_to_path
from protocol.store import AssetStore, atomic_write
from protocol.store_settings import StoreClientConfig

__all__ = [
    "OBJECT_SCHEMES",
    "S3_ENDPOINT_VARIABLES",
    "AssetRoot",
    "LocalRoot",
    "ObjectRoot",
    "StoreClientConfig",
    "open_root",
]

OBJECT_SCHEMES = ("s3", "gs", "az", "http", "https")
"""URL schemes of object-store roots (anything else but ``file`` and a plain path is refused)."""

_HOST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,253}[A-Za-z0-9])?(?::[0-9]{1,5})?")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9_.=-]{1,255}")


class AssetRoot(ABC):
    """One root of the ordered list: a local folder or an object-store prefix."""

    url: str
    """How the root is named in messages and logs (as configured: never a credential)."""
    local: bool
    """Whether reads are local disk (not put into the read-through cache)."""

    @abstractmethod
    def get(self, key: str, *, max_bytes: int, ref: str | None = None) -> bytes:
        """The bytes under ``key`` (not hash-checked here). Messages of the errors raised at
        once (:class:`AssetTooLarge`, :class:`AssetOutsideRoot`) name the key, never the root;
        a :class:`StoreUnavailable`'s may name it (for logs: :mod:`protocol.roots` never passes
        it on).

        Raises:
            AssetNotFound: no object under ``key``.
            StoreUnavailable: the root could not be asked (object stores).
            AssetTooLarge: the object is over ``max_bytes`` (known before its body is read).
            AssetOutsideRoot: a local path that leads out of the root.
        """

    @abstractmethod
    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` unless the root already holds it (create-if-absent).

        Returns:
            True when written, False when the key already held ``data``.

        Raises:
            HashMismatch: the key holds an object of another size (another content).
            StoreUnavailable: the root could not be asked.
        """


class LocalRoot(AssetRoot):
    """A local folder (or a network mount) holding the store layout; reads go through
    :meth:`AssetStore.read_confined` (realpath confinement, ``O_NOFOLLOW``, ``fstat`` size cap).
    A folder that does not exist holds nothing."""

    local = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not Path(path).is_absolute():
            raise ValueError(f"asset root {str(path)[:200]!r} is not an absolute path")
        self.store = AssetStore(path)
        self.url = str(self.store.root)

    def get(self, key: str, *, max_bytes: int, ref: str | None = None) -> bytes:
        """See :meth:`AssetRoot.get`; messages name ``key``, never the folder. Also
        :class:`StoreUnavailable` for a file that cannot be opened (permission denied, too many
        open files: :meth:`AssetStore.read_confined`)."""
        return self.store.read_confined(self.store.root / key, max_bytes=max_bytes, ref=ref, name=key)

    def put(self, key: str, data: bytes) -> bool:
        return atomic_write(self.store.root / key, data)


class ObjectRoot(AssetRoot):
    """An object-store prefix (``s3://bucket/prefix``, ``gs://``, ``az://``, ``http(s)://``)
    through obstore, with :class:`StoreClientConfig` timeouts and retries.

    Args:
        url: the root URL: no credentials, query or fragment; bucket/host and ``/``-separated
            prefix segments of ``[A-Za-z0-9_.=-]`` (not ``.`` or ``..``).
        client: timeouts and retries (default: ``MMREF_STORE_*`` of this process,
            :meth:`StoreClientConfig.from_env`).
        endpoint: the S3 endpoint URL, when not the chain's (``AWS_ENDPOINT_URL``): a local S3
            such as MinIO or moto. Not a credential; credentials come only from the chain.

    Raises:
        ValueError: a URL off these rules, or one obstore cannot open (e.g. ``az://`` without
            ``AZURE_STORAGE_ACCOUNT_NAME``), or obstore not installed (the ``fleet`` extra,
            Python >= 3.11); an ``s3://`` root whose endpoint is plain HTTP while the client
            does not allow it (obstore would build the client and fail every request with
            "builder error").
    """

    local = False

    def __init__(
        self, url: str, client: StoreClientConfig | None = None, *, endpoint: str | None = None
    ) -> None:
        _check_object_url(url)
        try:
            from obstore.store import from_url
        except ImportError as e:
            raise ValueError(
                f"asset root {url!r} needs obstore: install mmref[fleet] (Python >= 3.11)"
            ) from e
        self.url = url
        self.client = client or StoreClientConfig.from_env()
        _check_plain_http(url, self.client, endpoint)
        options = self.client.obstore_options(allow_http=urlparse(url).scheme == "http")
        if endpoint is not None:
            options["endpoint"] = endpoint
        try:
            self._store = from_url(url, **options)
        except Exception as e:  # obstore's GenericError / ValueError: configuration
            raise ValueError(f"asset root {url!r} cannot be opened: {_first_line(e)}") from e
        self._down_until = 0.0
        """``time.monotonic()`` until which the root is held down (``client.hold_down_s``)."""
        self._last_ok = float("-inf")
        """``time.monotonic()`` of the last request the root answered."""

    def _unavailable(
        self, what: str, e: Exception, started: float, ref: str | None = None
    ) -> StoreUnavailable:
        """The error of a request (begun at ``started``) that could not ask the root; holds the
        root down unless the root answered another request since (one slow or failing object is
        not a root down) or only this object was denied."""
        from obstore.exceptions import PermissionDeniedError

        held = not isinstance(e, PermissionDeniedError) and self._last_ok < started
        if held:
            self._down_until = time.monotonic() + self.client.hold_down_s
        return StoreUnavailable(
            f"{self.url} unavailable for {what}: {_first_line(e)}",
            ref=ref,
            retry_after_s=self.client.hold_down_s if held and self.client.hold_down_s > 0 else None,
        )

    def _check_up(self, what: str, ref: str | None = None) -> None:
        """Raises StoreUnavailable at once while the root is held down."""
        left = self._down_until - time.monotonic()
        if left > 0:
            raise StoreUnavailable(
                f"{self.url} unavailable for {what}: held down {left:.1f} s more after a failed request",
                ref=ref,
                retry_after_s=left,
            )

    def get(self, key: str, *, max_bytes: int, ref: str | None = None) -> bytes:
        import obstore

        self._check_up(key, ref)
        started = time.monotonic()
        try:
            result = obstore.get(self._store, key)
            size = int(result.meta["size"])
            if size > max_bytes:
                raise AssetTooLarge(f"object {key} is {size} bytes, limit {max_bytes}", ref=ref)
            data = bytes(result.bytes())
        except FileNotFoundError as e:
            self._last_ok = time.monotonic()  # the root answered
            raise AssetNotFound(f"no object {key} in an object-store root", ref=ref) from e
        except AssetTooLarge:
            self._last_ok = time.monotonic()
            raise
        except Exception as e:  # obstore BaseError (timeouts, refused, 5xx, denied), OSError
            raise self._unavailable(key, e, started, ref) from e
        self._last_ok = time.monotonic()
        if len(data) > max_bytes:  # the body disagreed with its declared size
            raise AssetTooLarge(f"object {key} is over {max_bytes} bytes", ref=ref)
        return data

    def _size(self, key: str) -> int | None:
        import obstore

        self._check_up(key)
        started = time.monotonic()
        try:
            size = int(obstore.head(self._store, key)["size"])
        except FileNotFoundError:
            self._last_ok = time.monotonic()
            return None
        except Exception as e:
            raise self._unavailable(key, e, started) from e
        self._last_ok = time.monotonic()
        return size

    def put(self, key: str, data: bytes) -> bool:
        """HEAD first (a duplicate image uploads nothing), then a conditional PUT
        (``If-None-Match: *``, single request, no multipart); a racer's ``AlreadyExists`` is
        success once the object's size is the same. Content is checked on every read."""
        import obstore
        from obstore.exceptions import AlreadyExistsError

        existing = self._size(key)
        started = time.monotonic()
        if existing is None:
            try:
                obstore.put(self._store, key, data, mode="create", use_multipart=False)
                return True
            except AlreadyExistsError:
                existing = self._size(key)
            except Exception as e:
                raise self._unavailable(f"put {key}", e, started) from e
        if existing is not None and existing != len(data):
            raise HashMismatch(
                f"{self.url}/{key} holds {existing} bytes, this image is {len(data)}: another object "
                "under this content key (remove it to store this image)"
            )
        return False


def _first_line(e: BaseException) -> str:
    """An error's first line, at most 300 characters (obstore appends a multi-line debug dump)."""
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


S3_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
"""Where obstore's S3 client reads an endpoint from the environment (each checked, 0.12.1)."""


def _check_plain_http(url: str, client: StoreClientConfig, endpoint: str | None) -> None:
    """Refuse an ``s3://`` root whose endpoint (``endpoint``, else the environment's) is
    ``http://`` unless ``client.allow_http``, naming the endpoint and the setting that allows it."""
    if client.allow_http or urlparse(url).scheme != "s3":
        return
    given = [("endpoint", endpoint)] if endpoint else [(n, os.environ.get(n)) for n in S3_ENDPOINT_VARIABLES]
    for name, value in given:
        if value and value.strip().lower().startswith("http://"):
            raise ValueError(
                f"asset root {url!r}: its S3 endpoint {name}={value.strip()[:200]!r} is plain HTTP; "
                "set MMREF_STORE_ALLOW_HTTP=1 to allow it (a local S3 such as moto or MinIO)"
            )


def _check_object_url(url: str) -> None:
    try:
        parsed = urlparse(url)
    except ValueError as e:
        raise ValueError(f"asset root {url[:200]!r} does not parse: {e}") from e
    if parsed.scheme not in OBJECT_SCHEMES:
        raise ValueError(f"asset root scheme {parsed.scheme!r} is not one of {OBJECT_SCHEMES}")
    if "@" in parsed.netloc or parsed.username or parsed.password:
        raise ValueError(
            "asset root URLs carry no credentials: use the provider's environment or config chain"
        )
    if parsed.query or parsed.fragment or parsed.params:
        raise ValueError(f"asset root {url[:200]!r} must not carry a query, params or fragment")
    if not _HOST_RE.fullmatch(parsed.netloc):
        raise ValueError(f"asset root {url[:200]!r}: bucket or host {parsed.netloc[:80]!r} is not a name")
    segments = [s for s in parsed.path.split("/") if s]
    if any(not _SEGMENT_RE.fullmatch(s) or s in (".", "..") for s in segments):
        raise ValueError(f"asset root {url[:200]!r}: prefix segments are [A-Za-z0-9_.=-]+, not . or ..")


def open_root(spec: str | os.PathLike[str], client: StoreClientConfig | None = None) -> AssetRoot:
    """One root from its configured form: an absolute path, a ``file://`` URI or an object-store URL.

    Raises:
        ValueError: a relative path, an unknown scheme, or an object-store URL off the rules of
            :class:`ObjectRoot`.
    """
    text = os.fspath(spec)
    if "://" not in text:
        return LocalRoot(text)
    if text.startswith("file://"):
        try:
            return LocalRoot(file_uri_to_path(text))
        except InvalidRef as e:
            raise ValueError(f"asset root {text[:200]!r}: {e.message}") from e
    return ObjectRoot(text, client)
