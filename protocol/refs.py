"""Ref strings: the wire format of the public renderers client (docs/PROTOCOL.md §1).

Two kinds travel in ``GenerateRequest.features.kwargs_data[modality][i]`` slots
(where upstream vLLM puts a base64 msgpack item, or ``None``):

- ``mmraw:<base64url(JSON)>`` (no padding) or the compact form ``mmraw:{...}``.
  JSON = ``{"family", "modality", "mm_hash", "payload", "fingerprint"?, "raw_image_uri"}``.
  ``mm_hash`` is ``sha256(file bytes)[:32]``; ``payload`` is adapter-owned
  (Qwen: ``{"image_grid_thw": [t, h, w]}``).
- ``mmfile:v1:<run_id>:<fingerprint>:<modality>:<mm_hash>``: a processed item
  under ``mm_features/`` of the asset store.

Parsing validates every id against the safe-id rules before anything touches a
filesystem; :func:`file_uri_to_path` turns a ``file://`` URI into a path string
without resolving it (confinement is :mod:`protocol.store`'s job).

Example::

    >>> ref = RawRefBody(family="qwen2_vl", modality="image", mm_hash="ab" * 16,
    ...                  payload={"image_grid_thw": [1, 4, 6]},
    ...                  raw_image_uri="file:///data/run_1/assets/images/abababababababab.jpg")
    >>> parse_ref(format_mmraw(ref)) == ref
    True
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any, Literal
from urllib.parse import unquote, urlparse

import msgspec

from protocol.errors import InvalidRef

__all__ = [
    "FAMILY_RE",
    "FINGERPRINT_RE",
    "MAX_REF_CHARS",
    "MMFILE_PREFIX",
    "MMRAW_PREFIX",
    "MM_HASH_RE",
    "RUN_ID_RE",
    "FileRef",
    "RawRefBody",
    "file_uri_to_path",
    "format_mmfile",
    "format_mmraw",
    "is_ref",
    "parse_ref",
]

RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
FINGERPRINT_RE = re.compile(r"^[a-f0-9]{16,64}$")
MM_HASH_RE = re.compile(r"^[a-f0-9]{16,128}$")
FAMILY_RE = re.compile(r"^[a-z0-9_]{1,32}$")
_MODALITIES = ("image",)
MAX_REF_CHARS = 8192
"""Longest ref string accepted (a real mmraw ref is ~300 characters)."""

MMRAW_PREFIX = "mmraw:"
MMFILE_PREFIX = "mmfile:v1:"


class RawRefBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The JSON body of an ``mmraw:`` ref: where the raw image is and what it should give."""

    family: str
    """Adapter family, e.g. ``"qwen2_vl"`` (``^[a-z0-9_]{1,32}$``)."""
    modality: Literal["image"]
    mm_hash: str
    """``sha256(file bytes)[:32]``, lowercase hex; re-checked against the file."""
    payload: dict[str, Any]
    """Adapter-owned expectations, e.g. Qwen ``{"image_grid_thw": [t, h, w]}`` (patches)."""
    raw_image_uri: str
    """Absolute ``file://`` URI of the raw image under the asset root."""
    fingerprint: str | None = None
    """Layout fingerprint the ref was made for; ``None`` skips the check."""

    def __post_init__(self) -> None:
        _check(FAMILY_RE, self.family, "family")
        _check(MM_HASH_RE, self.mm_hash, "mm_hash")
        if self.fingerprint is not None:
            _check(FINGERPRINT_RE, self.fingerprint, "fingerprint")


class FileRef(msgspec.Struct, frozen=True, kw_only=True):
    """A parsed ``mmfile:v1:`` ref: a processed item in the feature store."""

    run_id: str
    fingerprint: str
    modality: Literal["image"]
    mm_hash: str


def _check(pattern: re.Pattern[str], value: str, name: str) -> None:
    if not pattern.fullmatch(value):  # fullmatch: "$" would accept a trailing newline
        raise ValueError(f"{name} {value[:80]!r} does not match {pattern.pattern}")


_raw_decoder = msgspec.json.Decoder(RawRefBody)
_raw_encoder = msgspec.json.Encoder(order="deterministic")


def is_ref(value: object) -> bool:
    """Whether ``value`` is a string with one of our ref prefixes (cheap, no validation)."""
    return isinstance(value, str) and (value.startswith(MMRAW_PREFIX) or value.startswith(MMFILE_PREFIX))


def parse_ref(ref: str) -> RawRefBody | FileRef:
    """Parse and validate a ref string.

    Returns:
        :class:`RawRefBody` for ``mmraw:`` refs, :class:`FileRef` for ``mmfile:v1:`` refs.

    Raises:
        InvalidRef: not a string, too long, unknown prefix, bad base64/JSON, unknown or
            missing fields, or an id that fails its safe-id pattern.
    """
    if not isinstance(ref, str):
        raise InvalidRef(f"a ref must be a string, got {type(ref).__name__}")
    if len(ref) > MAX_REF_CHARS:
        raise InvalidRef(f"ref is {len(ref)} characters, limit {MAX_REF_CHARS}", ref=ref[:200])
    if ref.startswith(MMRAW_PREFIX):
        return _parse_mmraw(ref)
    if ref.startswith(MMFILE_PREFIX):
        return _parse_mmfile(ref)
    raise InvalidRef(f"unknown ref kind {ref[:16]!r}: expected 'mmraw:' or 'mmfile:v1:'", ref=ref[:200])


def _parse_mmraw(ref: str) -> RawRefBody:
    body = ref[len(MMRAW_PREFIX) :]
    if body.startswith("{"):
        raw = body.encode("utf-8", "surrogatepass")
    else:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", body):
            raise InvalidRef("mmraw body is neither base64url nor JSON", ref=ref)
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (binascii.Error, ValueError) as e:
            raise InvalidRef(f"mmraw body is not valid base64url: {e}", ref=ref) from e
    try:
        return _raw_decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeError, RecursionError) as e:  # deep nesting: RecursionError
        raise InvalidRef(f"mmraw body: {e}", ref=ref) from e


def _parse_mmfile(ref: str) -> FileRef:
    parts = ref[len(MMFILE_PREFIX) :].split(":")
    if len(parts) != 4:
        raise InvalidRef("mmfile ref must be mmfile:v1:<run_id>:<fingerprint>:<modality>:<mm_hash>", ref=ref)
    run_id, fingerprint, modality, mm_hash = parts
    try:
        _check(RUN_ID_RE, run_id, "run_id")
        if run_id in (".", ".."):
            raise ValueError(f"run_id {run_id!r} is not a name")
        _check(FINGERPRINT_RE, fingerprint, "fingerprint")
        _check(MM_HASH_RE, mm_hash, "mm_hash")
        if modality not in _MODALITIES:
            raise ValueError(f"modality {modality[:40]!r} is not one of {_MODALITIES}")
    except ValueError as e:
        raise InvalidRef(f"mmfile ref: {e}", ref=ref) from e
    return FileRef(run_id=run_id, fingerprint=fingerprint, modality="image", mm_hash=mm_hash)


def format_mmraw(body: RawRefBody) -> str:
    """Encode ``body`` as ``mmraw:<base64url(JSON)>`` (deterministic key order, no padding)."""
    data = _raw_encoder.encode(body)
    return MMRAW_PREFIX + base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def format_mmfile(ref: FileRef) -> str:
    """Encode ``ref`` as ``mmfile:v1:<run_id>:<fingerprint>:<modality>:<mm_hash>``."""
    return f"{MMFILE_PREFIX}{ref.run_id}:{ref.fingerprint}:{ref.modality}:{ref.mm_hash}"


def file_uri_to_path(uri: str, *, ref: str | None = None) -> str:
    """Return the filesystem path of an absolute ``file://`` URI (not resolved, not checked).

    Reads the URI back as ``unquote(urlparse(uri).path)`` and requires netloc ``""``
    or ``"localhost"``, an absolute path, no NUL byte, no query or fragment.

    Raises:
        InvalidRef: another scheme (``http:``, ``data:``, ``ftp:``...), a remote host, a
            relative path, or a NUL byte.
    """
    try:
        parsed = urlparse(uri)
    except ValueError as e:  # e.g. "Invalid IPv6 URL" for a stray "["
        raise InvalidRef(f"raw_image_uri does not parse: {e}", ref=ref) from e
    if parsed.scheme != "file":
        raise InvalidRef(f"raw_image_uri must be a file:// URI, got scheme {parsed.scheme!r}", ref=ref)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidRef(f"raw_image_uri names a host {parsed.netloc!r}", ref=ref)
    if parsed.query or parsed.fragment or parsed.params:
        raise InvalidRef("raw_image_uri must not carry a query, params or fragment", ref=ref)
    path = unquote(parsed.path)
    if "\x00" in path:
        raise InvalidRef("raw_image_uri contains a NUL byte", ref=ref)
    if not path.startswith("/"):
        raise InvalidRef(f"raw_image_uri path {path[:80]!r} is not absolute", ref=ref)
    return path
