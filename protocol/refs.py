"""Ref strings: the wire format of the public renderers client (docs/PROTOCOL.md §1).

Three kinds travel in ``GenerateRequest.features.kwargs_data[modality][i]`` slots
(where upstream vLLM puts a base64 msgpack item, or ``None``):

- ``mmraw:v2:<sha256><ext>:<family>:<grid>[:<fingerprint>]`` (:class:`ContentRef`): an image
  (or a video: ``.mp4``/``.mov``, :data:`VIDEO_EXTS`) named by its content, not by a place;
  every reader finds it under its own asset roots (:mod:`protocol.roots`). ~130 characters.
- ``mmraw:<base64url(JSON)>`` (no padding) or the compact form ``mmraw:{...}`` (v1,
  :class:`RawRefBody`). JSON = ``{"family", "modality", "mm_hash", "payload", "fingerprint"?,
  "raw_image_uri"}``. ``mm_hash`` is ``sha256(file bytes)[:32]``; ``payload`` is adapter-owned
  (Qwen: ``{"image_grid_thw": [t, h, w]}``); ``raw_image_uri`` an absolute ``file://`` URI.
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
    "IMAGE_EXTS",
    "MAX_CONTENT_REF_CHARS",
    "MAX_GRID_VALUE",
    "MAX_REF_CHARS",
    "MMFILE_PREFIX",
    "MMRAW_PREFIX",
    "MMRAW_V2_PREFIX",
    "MM_HASH_RE",
    "RUN_ID_RE",
    "SHA256_RE",
    "STORE_EXTS",
    "VIDEO_EXTS",
    "ContentRef",
    "FileRef",
    "RawRefBody",
    "asset_key",
    "file_uri_to_path",
    "format_content_ref",
    "format_mmfile",
    "format_mmraw",
    "image_key",
    "is_ref",
    "parse_ref",
]

RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
FINGERPRINT_RE = re.compile(r"^[a-f0-9]{16,64}$")
MM_HASH_RE = re.compile(r"^[a-f0-9]{16,128}$")
FAMILY_RE = re.compile(r"^[a-z0-9_]{1,32}$")
_MODALITIES = ("image",)
"""Modalities of an ``mmfile:v1:`` ref (processed items: images only)."""
MAX_REF_CHARS = 8192
"""Longest ref string accepted (a real mmraw ref is ~300 characters)."""

MMRAW_PREFIX = "mmraw:"
MMFILE_PREFIX = "mmfile:v1:"
MMRAW_V2_PREFIX = "mmraw:v2:"
"""Prefix of a content-named image ref (a v1 ``mmraw:`` body is base64url or JSON: never ``v2:``)."""

SHA256_RE = re.compile(r"^[a-f0-9]{64}$")
IMAGE_EXTS = (".jpg", ".png", ".webp", ".gif", ".img")
"""Store file extensions, as :func:`protocol.images.sniff_media_type` gives them (BMP, TIFF: ``.img``)."""
VIDEO_EXTS = (".mp4", ".mov")
"""Video store extensions, as :func:`protocol.video_header.sniff_video_type` gives them (ISO-BMFF
containers: MP4, QuickTime); stored under ``videos/`` (docs/PROTOCOL.md §2)."""
STORE_EXTS = IMAGE_EXTS + VIDEO_EXTS
"""Every extension a content-named ref may carry."""
MAX_GRID_VALUE = (1 << 20) - 1
"""Largest grid entry a ref may carry (then bounded by the processor's limits)."""
MAX_CONTENT_REF_CHARS = 256
"""Longest ``mmraw:v2:`` ref (the grammar allows at most 9 + 69 + 33 + 32 + 65 = 208 characters)."""
_V2_RE = re.compile(
    r"mmraw:v2:(?P<sha256>[a-f0-9]{64})(?P<ext>\.jpg|\.png|\.webp|\.gif|\.img|\.mp4|\.mov)"
    r":(?P<family>[a-z0-9_]{1,32})"
    r":(?P<grid>[1-9][0-9]{0,6}(?:\.[1-9][0-9]{0,6}){0,3})"
    r"(?::(?P<fingerprint>[a-f0-9]{16,64}))?"
)
"""The whole ``mmraw:v2:`` grammar (``fullmatch``): ASCII only, no leading zeros, 1 to 4 grid entries."""


class RawRefBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The JSON body of an ``mmraw:`` ref: where the raw image (or video) is and what it should give."""

    family: str
    """Adapter family, e.g. ``"qwen2_vl"`` (``^[a-z0-9_]{1,32}$``)."""
    modality: Literal["image", "video"]
    """``"video"``: the file is a clip, resolved through the family's video processor; the
    payload then holds ``video_grid_thw`` (``protocol/adapters/video.py``)."""
    mm_hash: str
    """``sha256(file bytes)[:32]``, lowercase hex; re-checked against the file."""
    payload: dict[str, Any]
    """Adapter-owned expectations, e.g. Qwen ``{"image_grid_thw": [t, h, w]}`` (patches)."""
    raw_image_uri: str
    """Absolute ``file://`` URI of the raw file under the asset root (a video's too: the field
    keeps its name for wire compatibility)."""
    fingerprint: str | None = None
    """Layout fingerprint the ref was made for; ``None`` skips the check."""

    def __post_init__(self) -> None:
        _check(FAMILY_RE, self.family, "family")
        _check(MM_HASH_RE, self.mm_hash, "mm_hash")
        if self.fingerprint is not None:
            _check(FINGERPRINT_RE, self.fingerprint, "fingerprint")


class ContentRef(msgspec.Struct, frozen=True, kw_only=True):
    """A parsed ``mmraw:v2:`` ref: an image or a video named by its content (docs/PROTOCOL.md §1).

    No host, path or bucket: every reader resolves it against its own configured asset roots
    (:class:`protocol.roots.AssetRoots`) at :attr:`key`, and checks the bytes against the full
    :attr:`sha256` before decoding them.

    Raises:
        ValueError: on construction, a field that breaks its rule (the parser turns it into
            :class:`~protocol.errors.InvalidRef`).
    """

    sha256: str
    """Full lowercase hex sha256 of the raw file bytes (64 characters)."""
    ext: str
    """Store extension, one of :data:`STORE_EXTS` (a video's: :data:`VIDEO_EXTS`)."""
    family: str
    """Adapter family, e.g. ``"qwen2_vl"`` (``^[a-z0-9_]{1,32}$``)."""
    grid: tuple[int, ...]
    """The family's grid in patches, e.g. Qwen ``(t, h, w)``, Kimi-VL ``(h, w)``."""
    fingerprint: str | None = None
    """Layout fingerprint the ref was made for; ``None`` skips the check."""

    def __post_init__(self) -> None:
        _check(SHA256_RE, self.sha256, "sha256")
        if self.ext not in STORE_EXTS:
            raise ValueError(f"ext {self.ext[:16]!r} is not one of {STORE_EXTS}")
        _check(FAMILY_RE, self.family, "family")
        if not 1 <= len(self.grid) <= 4 or not all(
            type(g) is int and 1 <= g <= MAX_GRID_VALUE for g in self.grid
        ):
            raise ValueError(f"grid must be 1 to 4 ints in [1, {MAX_GRID_VALUE}], got {self.grid!r:.80}")
        if self.fingerprint is not None:
            _check(FINGERPRINT_RE, self.fingerprint, "fingerprint")

    @property
    def modality(self) -> Literal["image", "video"]:
        """``"video"`` for a :data:`VIDEO_EXTS` extension, else ``"image"``."""
        return "video" if self.ext in VIDEO_EXTS else "image"

    @property
    def mm_hash(self) -> str:
        """The hash the bytes are checked against: the full :attr:`sha256`."""
        return self.sha256

    @property
    def key(self) -> str:
        """The store key, relative to an asset root: ``images/<sha256[:16]><ext>`` (a video:
        ``videos/...``, :func:`asset_key`)."""
        return asset_key(self.sha256, self.ext)


def image_key(sha256: str, ext: str) -> str:
    """The store key of an image (docs/PROTOCOL.md §2): ``images/<sha256[:16]><ext>``.

    Built from validated parts only, so it never leaves a root's folder or prefix.

    Raises:
        ValueError: ``sha256`` is not 64 lowercase hex or ``ext`` not one of :data:`IMAGE_EXTS`.
    """
    _check(SHA256_RE, sha256, "sha256")
    if ext not in IMAGE_EXTS:
        raise ValueError(f"ext {ext[:16]!r} is not one of {IMAGE_EXTS}")
    return f"images/{sha256[:16]}{ext}"


def asset_key(sha256: str, ext: str) -> str:
    """The store key of an image (:func:`image_key`) or a video: ``videos/<sha256[:16]><ext>``
    for an extension of :data:`VIDEO_EXTS`.

    Raises:
        ValueError: ``sha256`` is not 64 lowercase hex or ``ext`` not one of :data:`STORE_EXTS`.
    """
    if ext in VIDEO_EXTS:
        _check(SHA256_RE, sha256, "sha256")
        return f"videos/{sha256[:16]}{ext}"
    return image_key(sha256, ext)


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


def parse_ref(ref: str) -> RawRefBody | ContentRef | FileRef:
    """Parse and validate a ref string.

    Returns:
        :class:`ContentRef` for ``mmraw:v2:`` refs, :class:`RawRefBody` for other ``mmraw:``
        refs (v1), :class:`FileRef` for ``mmfile:v1:`` refs.

    Raises:
        InvalidRef: not a string, too long, unknown prefix, bad base64/JSON, unknown or
            missing fields, an ``mmraw:v2:`` ref off its grammar, or an id that fails its
            safe-id pattern.
    """
    if not isinstance(ref, str):
        raise InvalidRef(f"a ref must be a string, got {type(ref).__name__}")
    if len(ref) > MAX_REF_CHARS:
        raise InvalidRef(f"ref is {len(ref)} characters, limit {MAX_REF_CHARS}", ref=ref[:200])
    if ref.startswith(MMRAW_V2_PREFIX):
        return _parse_v2(ref)
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


def _parse_v2(ref: str) -> ContentRef:
    if len(ref) > MAX_CONTENT_REF_CHARS:
        raise InvalidRef(f"mmraw:v2 ref is {len(ref)} characters, limit {MAX_CONTENT_REF_CHARS}", ref=ref)
    m = _V2_RE.fullmatch(ref)  # explicit ranges ([0-9], not \d): ASCII digits only
    if m is None:
        raise InvalidRef(
            "mmraw:v2 ref must be mmraw:v2:<sha256 64 hex><.jpg|.png|.webp|.gif|.img|.mp4|.mov>:<family>"
            ":<grid as 1-4 ints joined by '.'>[:<fingerprint 16-64 hex>]",
            ref=ref,
        )
    try:
        return ContentRef(
            sha256=m["sha256"],
            ext=m["ext"],
            family=m["family"],
            grid=tuple(int(g) for g in m["grid"].split(".")),
            fingerprint=m["fingerprint"],
        )
    except ValueError as e:  # a grid entry over MAX_GRID_VALUE
        raise InvalidRef(f"mmraw:v2 ref: {e}", ref=ref) from e


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


def format_content_ref(ref: ContentRef) -> str:
    """Encode ``ref`` as ``mmraw:v2:<sha256><ext>:<family>:<g0.g1...>[:<fingerprint>]``
    (``parse_ref`` gives ``ref`` back; at most :data:`MAX_CONTENT_REF_CHARS` characters)."""
    grid = ".".join(str(g) for g in ref.grid)
    tail = f":{ref.fingerprint}" if ref.fingerprint is not None else ""
    return f"{MMRAW_V2_PREFIX}{ref.sha256}{ref.ext}:{ref.family}:{grid}{tail}"


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
