"""Typed errors shared by the server plugin and the trainer library.

Every error carries a stable machine-readable ``code`` (the server returns it in
``{"error": {"code", "message", "ref"}}``), the HTTP status the server maps it
to, and the offending ``ref`` (or value). Each subclasses the builtin it
resembles, so ``except FileNotFoundError`` keeps working for callers that do
not know this module::

    MMRefError(Exception)                                    -      -
    ├── InvalidRequest(MMRefError, ValueError)               400    invalid_request
    ├── InvalidRef(MMRefError, ValueError)                   400    invalid_ref
    ├── UnsupportedFamily(MMRefError, ValueError)            400    unsupported_family
    ├── AssetOutsideRoot(MMRefError, PermissionError)        403    outside_root
    ├── AssetNotFound(MMRefError, FileNotFoundError)         404    asset_not_found
    ├── NotCached(MMRefError, LookupError)                   404    not_cached
    ├── HashMismatch(MMRefError, ValueError)                 409    hash_mismatch
    ├── FingerprintMismatch(MMRefError, ValueError)          409    fingerprint_mismatch
    ├── AssetTooLarge(MMRefError, ValueError)                413    asset_too_large
    ├── ImageUnreadable(MMRefError, ValueError)              422    image_unreadable
    ├── VideoUnreadable(MMRefError, ValueError)              422    video_unreadable
    ├── CorruptFeature(MMRefError, ValueError)               422    corrupt_feature
    ├── GridMismatch(MMRefError, ValueError)                 422    grid_mismatch
    ├── PlaceholderMismatch(MMRefError, ValueError)          422    placeholder_mismatch
    ├── SeedUnsupported(MMRefError, ValueError)              400    seed_unsupported
    ├── UpdateConflict(MMRefError, RuntimeError)             409    update_conflict
    ├── DrainTimeout(MMRefError, TimeoutError)               503    drain_timeout
    └── StoreUnavailable(MMRefError, ConnectionError)        503    store_unavailable
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

__all__ = [
    "AssetNotFound",
    "AssetOutsideRoot",
    "AssetTooLarge",
    "CorruptFeature",
    "DrainTimeout",
    "FingerprintMismatch",
    "GridMismatch",
    "HashMismatch",
    "ImageUnreadable",
    "InvalidRef",
    "InvalidRequest",
    "MMRefError",
    "NotCached",
    "PlaceholderMismatch",
    "SeedUnsupported",
    "StoreUnavailable",
    "UnsupportedFamily",
    "UpdateConflict",
    "VideoUnreadable",
    "all_error_types",
    "error_from_body",
]


class MMRefError(Exception):
    """Base class: a ref, an asset or a request that cannot be used as given.

    Args:
        message: human-readable explanation, naming the offending values.
        ref: the ref string (or value) the error is about, if any. Long refs are
            kept whole here; the HTTP layer truncates what it echoes.
    """

    code: ClassVar[str] = "mmref_error"
    http_status: ClassVar[int] = 400

    def __init__(self, message: str, *, ref: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.ref = ref

    def __reduce__(self):  # keep ``ref`` across pickling (process pools, torch.distributed)
        return (_rebuild, (type(self), self.message, self.ref))


def _rebuild(cls: type[MMRefError], message: str, ref: str | None) -> MMRefError:
    return cls(message, ref=ref)


class InvalidRequest(MMRefError, ValueError):
    """The request body is malformed (bad JSON/msgpack, wrong types, inconsistent fields)."""

    code = "invalid_request"
    http_status = 400


class InvalidRef(MMRefError, ValueError):
    """A ref string or one of its ids does not parse or fails the safe-id rules (docs/PROTOCOL.md §1)."""

    code = "invalid_ref"
    http_status = 400


class UnsupportedFamily(MMRefError, ValueError):
    """The ref's family (or a model's ``model_type``) has no adapter here, or is not served."""

    code = "unsupported_family"
    http_status = 400


class AssetOutsideRoot(MMRefError, PermissionError):
    """The ref points outside the configured asset root (after resolving symlinks)."""

    code = "outside_root"
    http_status = 403


class AssetNotFound(MMRefError, FileNotFoundError):
    """The referenced image or feature file does not exist."""

    code = "asset_not_found"
    http_status = 404


class NotCached(MMRefError, LookupError):
    """A cache-only item (``kwargs_data`` slot ``null``) whose hash the server does not hold."""

    code = "not_cached"
    http_status = 404


class HashMismatch(MMRefError, ValueError):
    """The file's sha256 does not match the hash the ref claims."""

    code = "hash_mismatch"
    http_status = 409


class FingerprintMismatch(MMRefError, ValueError):
    """The ref was made for another processor layout (fingerprint) than the one in use."""

    code = "fingerprint_mismatch"
    http_status = 409


class AssetTooLarge(MMRefError, ValueError):
    """The file or the decoded image exceeds a configured size or pixel limit."""

    code = "asset_too_large"
    http_status = 413


class ImageUnreadable(MMRefError, ValueError):
    """The bytes are not a decodable image (truncated, corrupt, unknown format)."""

    code = "image_unreadable"
    http_status = 422


class VideoUnreadable(MMRefError, ValueError):
    """The bytes are not a decodable video (truncated, corrupt, a container or codec outside the
    allow-list, no video track, zero frames, a sampled frame that does not decode), or the
    family's video processor refuses its frames (``protocol/videos.py``)."""

    code = "video_unreadable"
    http_status = 422


class CorruptFeature(MMRefError, ValueError):
    """A feature file (``mmfile`` ref) is truncated, not a v1 envelope, disagrees with its ref,
    or its payload does not decode to an item of the served family."""

    code = "corrupt_feature"
    http_status = 422


class GridMismatch(MMRefError, ValueError):
    """The grid the ref claims differs from the grid the processor produces."""

    code = "grid_mismatch"
    http_status = 422


class PlaceholderMismatch(MMRefError, ValueError):
    """The prompt's placeholder tokens do not match the refs' placeholder counts."""

    code = "placeholder_mismatch"
    http_status = 422


class SeedUnsupported(MMRefError, ValueError):
    """A seeded request this server cannot run without risking its engine (vLLM CPU servers whose
    prefills may be split: ``vllm_plugin/seeds.py``)."""

    code = "seed_unsupported"
    http_status = 400


class UpdateConflict(MMRefError, RuntimeError):
    """A weight-update call that does not fit the server's state: a hold while another holds the
    server, a release without a hold, or either while a hold or an update still drains or an
    update reloads (``vllm_plugin/updates.py``)."""

    code = "update_conflict"
    http_status = 409


class DrainTimeout(MMRefError, TimeoutError):
    """Requests admitted before a weight update did not finish within its timeout; nothing was
    changed and the server admits requests again (retryable)."""

    code = "drain_timeout"
    http_status = 503


class StoreUnavailable(MMRefError, ConnectionError):
    """No asset root held the image and at least one could not be asked: an object store that
    refused the connection, timed out (``MMREF_STORE_TIMEOUT_S``, retries included) or denied the
    request, or a local file that could not be opened (permission denied, too many open files, an
    I/O error: ``protocol/store.py``) (``protocol/roots.py``). The image may exist: retryable,
    never replaced by a placeholder.

    Args:
        retry_after_s: seconds before asking the root again can change the answer (the root is
            held down that long, ``MMREF_STORE_HOLD_DOWN_S``): the server's ``Retry-After``.
    """

    code = "store_unavailable"
    http_status = 503

    def __init__(self, message: str, *, ref: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message, ref=ref)
        self.retry_after_s = retry_after_s


def all_error_types() -> list[type[MMRefError]]:
    """Every concrete error class, in declaration order (codes are unique; tested)."""
    return [
        InvalidRequest,
        InvalidRef,
        UnsupportedFamily,
        AssetOutsideRoot,
        AssetNotFound,
        NotCached,
        HashMismatch,
        FingerprintMismatch,
        AssetTooLarge,
        ImageUnreadable,
        VideoUnreadable,
        CorruptFeature,
        GridMismatch,
        PlaceholderMismatch,
        SeedUnsupported,
        UpdateConflict,
        DrainTimeout,
        StoreUnavailable,
    ]


def error_from_body(body: Any) -> MMRefError | None:
    """The typed error of a plugin refusal, rebuilt from its HTTP body (docs/PROTOCOL.md §6).

    Args:
        body: the decoded JSON body of an error answer, ``{"error": {"message", "code",
            "mmref_code", "ref", ...}}``.

    Returns:
        An instance of the class whose ``code`` is ``error.mmref_code`` (its message and ``ref``
        from the body); a plain :class:`MMRefError` for a code this version does not know; None
        where the body has no ``mmref_code`` (stock vLLM's own refusal, or not an error body).
    """
    error = body.get("error") if isinstance(body, Mapping) else None
    code = error.get("mmref_code") if isinstance(error, Mapping) else None
    if not isinstance(code, str):
        return None
    message = error.get("message")
    message = message if isinstance(message, str) else code
    ref = error.get("ref")
    ref = ref if isinstance(ref, str) else None
    by_code = {cls.code: cls for cls in all_error_types()}
    cls = by_code.get(code, MMRefError)
    return cls(message, ref=ref)
