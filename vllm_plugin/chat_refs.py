"""Refs where vLLM takes an image URL: ``/v1/chat/completions`` and every route whose content
parts vLLM's chat parser reads (the render route, responses, pooling...), and the generate route's
``content_parts``.

A client puts the ref string itself in the part's URL
(``{"type": "image_url", "image_url": {"url": "mmraw:v2:..."}}``), or the URL of an image key under
one of the server's object-store roots (``<root>/images/<sha256[:16]><ext>``, e.g.
``s3://bucket/mmref/images/0123456789abcdef.jpg``: :meth:`ChatRefs.names`). Before vLLM reads such
a part:

- **the read** (:meth:`ChatRefs.image`): the adapter's read path, the one the token route and the
  trainer take (``ImageAdapter.read_raw``: family, fingerprint and grid bound checked, confined
  read, sha256 of the bytes, byte and pixel limits, vLLM's decode), then the grid the processor
  will give checked against the ref's (``check_decoded_grid``); an object-store URL is read from
  its root only (no other bucket or prefix), its bytes checked against the 16-hex sha256 prefix its
  key names, then the same limits and decode (no family or grid claim to check, as for a data
  URL); cached by the whole ref string
  (byte-bounded LRU, single-flight, failures never cached): a repeated ref is a lookup;
- **the key** (:meth:`ChatRefs.uuid`): the part's ``uuid``, which vLLM uses in place of its content
  hash in every cache (processor, encoder, prefix; ``ProcessorInputs.get_mm_hashes``, which hashes
  it with ``media_io_kwargs`` or ``mm_processor_kwargs`` where given), set by the plugin, never
  by the client:
  ``weights.engine_hash`` of the image's content key (sha256 of the bytes read, store extension,
  fingerprint, ``"chat:"`` + pixel mode) and the weight version, so no embedding crosses a weight
  version. Its binding names the chat route (:data:`CHAT_MODE`): the chat route's items (vLLM's
  processing) never share an entry with the token route's, and a chat uuid is no handle there;
- **the pin** (``request_scope.pin``): the decoded images are held for the rest of the request in a context
  variable, and the connector (``connector.py``) hands vLLM's parser the very image whose bytes
  named the uuid.

Where a route's body hides a ref from :func:`ref_parts` (e.g. a source URL vLLM converts to an image
part itself), the connector reads it through :meth:`ChatRefs.image` and vLLM keys it by its bytes,
as a data URL; its refusal is recorded (``request_scope.record_error``) for the admission middleware to
answer as the plugin's typed 4xx.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocol.adapters import VideoMixin
from protocol.errors import AssetOutsideRoot, GridMismatch, InvalidRef, InvalidRequest, UnsupportedFamily
from protocol.images import load_image
from protocol.refs import IMAGE_EXTS, ContentRef, FileRef, is_ref, parse_ref
from protocol.store import check_sha256
from protocol.video_header import sniff_video_type
from protocol.videos import frame_limits
from upstream import load
from vllm_plugin import request_scope
from vllm_plugin.cache import ByteBudgetLRU
from vllm_plugin.resolver import ExtRecorder
from vllm_plugin.weights import NAMESPACE, ContentKey, engine_hash

if TYPE_CHECKING:
    from protocol.roots import AssetRoot
    from vllm_plugin.resolver import MMRefResolver

__all__ = [
    "CHAT_MODE",
    "NEEDLES",
    "ChatImage",
    "ChatRefs",
    "bind_body",
    "needles",
    "object_key",
    "ref_parts",
]

CHAT_MODE = "chat:"
"""Prefix of the pixel mode in a chat image's binding: vLLM's processing, not the token route's."""

_IO_CONFIG = {"image_mode": "RGB", "decoder": "mmref"}
"""The decode settings a ref's image carries (``MediaWithBytes.io_config``): where vLLM keys the
image by its bytes (no uuid), never the key of a data URL of the same bytes, which vLLM's own
decoder (``--media-io-kwargs``) may have decoded otherwise."""


@dataclass(frozen=True)
class ChatImage:
    """One image ref read and decoded for vLLM's chat parser."""

    media: Any
    """vLLM's ``MediaWithBytes``: the RGB image and the bytes read, what vLLM's connector returns."""
    content_key: ContentKey
    """What the part's uuid binds besides the weight version."""
    nbytes: int
    """Bytes held: the decoded pixels and the encoded bytes."""


class ChatRefs:
    """Reads, checks, decodes and keys the image refs of content parts (see the module doc).

    Args:
        resolver: the plugin's resolver: its adapter, store, limits and worker threads.
    """

    def __init__(self, resolver: MMRefResolver) -> None:
        self.adapter = resolver.adapter
        self.store = resolver.store
        self.config = resolver.config
        self.pool = resolver.pool
        self.pixel_mode = resolver.pixel_mode
        self.cache: ByteBudgetLRU[ChatImage] = ByteBudgetLRU(
            resolver.config.cache_budget_bytes, lambda image: image.nbytes
        )
        self.needles = NEEDLES + tuple(r.url.encode() for r in self.store.roots if not r.local)
        """:data:`NEEDLES` and the object-store roots' URLs (an image key's URL names one)."""

    def names(self, url: Any) -> bool:
        """Whether an image URL is the plugin's: a ref string, or an image key's URL under one of
        this server's object-store roots (:func:`object_key`)."""
        return is_ref(url) or (isinstance(url, str) and object_key(self.store.roots, url) is not None)

    def read(self, ref: str) -> ChatImage:
        """Read, check and decode one ref (or object-store URL), uncached (blocking: I/O, decode).

        Raises:
            InvalidRef: an ``mmfile`` ref (processed features, not an image) or a malformed ref.
            MMRefError subclasses: see ``ImageAdapter.read_raw`` and ``check_decoded_grid``;
                :meth:`read_object_url`.
        """
        if not is_ref(ref):
            return self.read_object_url(ref)
        parsed = parse_ref(ref)
        if isinstance(parsed, FileRef):
            raise InvalidRef(
                "an mmfile ref holds processed features, not an image: image URLs take mmraw refs "
                "(send mmfile refs to /inference/v1/generate)",
                ref=ref,
            )
        source = ExtRecorder(self.store)
        raw = self.adapter.read_raw(
            parsed,
            source,
            ref=ref,
            max_bytes=self.config.max_image_bytes,
            max_pixels=self.config.max_image_pixels,
        )
        self.adapter.check_decoded_grid(raw, ref=ref)
        return self._chat_image(raw.image, raw.data, raw.sha256, source.ext)

    def read_object_url(self, url: str) -> ChatImage:
        """The image at an object-store URL under one of the roots: that root only, the bytes
        checked against the sha256 prefix the key names, the byte and pixel limits, vLLM's decode.

        Raises:
            AssetOutsideRoot: the URL names no image key under a configured object-store root.
            AssetNotFound, StoreUnavailable, AssetTooLarge: see ``protocol.roots.AssetRoot.get``.
            HashMismatch: the bytes do not hash to the key's prefix.
            ImageUnreadable, AssetTooLarge: see ``protocol.images.load_image``.
        """
        found = object_key(self.store.roots, url)
        if found is None:
            raise AssetOutsideRoot(
                "the URL names no image key under this server's object-store roots", ref=url
            )
        root, key = found
        data = root.get(key, max_bytes=self.config.max_image_bytes, ref=url)
        sha256 = check_sha256(data, key[len("images/") : len("images/") + 16], ref=url)
        image = load_image(data, max_pixels=self.config.max_image_pixels, ref=url)
        return self._chat_image(image, data, sha256, key[key.rindex(".") :])

    def _chat_image(self, image: Any, data: bytes, sha256: str, ext: str) -> ChatImage:
        """What vLLM's connector returns for ``image`` (decoded from ``data``: vLLM's
        ``MediaWithBytes``), keyed by its content under the chat binding (:data:`CHAT_MODE`)."""
        key = ContentKey("image", sha256, ext, self.adapter.fingerprint, CHAT_MODE + self.pixel_mode)
        nbytes = image.size[0] * image.size[1] * len(image.getbands()) + len(data)
        return ChatImage(load("MediaWithBytes")(image, data, dict(_IO_CONFIG)), key, nbytes)

    def read_video(self, ref: str) -> ChatImage:
        """Read, check and decode one video ref, uncached (blocking), into what vLLM's connector
        returns for a video URL: ``MediaWithBytes((frames, metadata), bytes)``, the frames and
        metadata of vLLM's loader (``protocol.videos.load_video``). The family's video processor
        runs once here (raw pixels) so that the grid vLLM will compute is checked against the
        ref's before vLLM sees the frames.

        Raises:
            InvalidRef: not an ``mmraw`` video ref (an object-store URL, an ``mmfile`` ref, an
                image ref).
            UnsupportedFamily: the served family has no video path.
            MMRefError subclasses: see ``VideoMixin.read_video`` (limits before decoding: bytes,
                frame size, frames, duration, decoded bytes); GridMismatch: another grid.
        """
        parsed = parse_ref(ref) if is_ref(ref) else None
        if parsed is None or isinstance(parsed, FileRef):
            raise InvalidRef("a video URL takes an mmraw video ref", ref=ref)
        adapter = self.adapter
        if not isinstance(adapter, VideoMixin):
            raise UnsupportedFamily(f"videos are not supported for {adapter.family!r}", ref=ref)
        limits = frame_limits(self.config.max_image_pixels)
        claimed, decoded, data, sha256 = adapter.read_video(
            parsed, self.store, ref=ref, max_bytes=self.config.max_video_bytes, limits=limits
        )
        grid = adapter.process_video(decoded, raw_pixels=True, ref=ref).grid
        if grid != claimed:
            raise GridMismatch(
                f"ref claims video_grid_thw {list(claimed)}, processor gives {list(grid)}", ref=ref
            )
        ext = parsed.ext if isinstance(parsed, ContentRef) else (sniff_video_type(data) or ("", ".mp4"))[1]
        mode = CHAT_MODE + self.pixel_mode
        key = ContentKey("video", sha256, ext, str(adapter.video_fingerprint), mode)
        media = load("MediaWithBytes")((decoded.frames, decoded.hf_metadata()), data, {"decoder": "mmref"})
        return ChatImage(media, key, decoded.frames.nbytes + len(data))

    async def image(self, ref: str, *, video: bool = False) -> ChatImage:
        """:meth:`read` (``video``: :meth:`read_video`), cached by the whole ref string,
        single-flight, in the worker threads."""
        loop = asyncio.get_running_loop()
        read = self.read_video if video else self.read
        return await self.cache.get_or_compute(
            _cache_key(ref, video), lambda: loop.run_in_executor(self.pool, read, ref)
        )

    def image_sync(self, ref: str, *, video: bool = False) -> ChatImage:
        """:meth:`image` for a caller without an event loop (vLLM's synchronous parser)."""
        key = _cache_key(ref, video)
        cached = self.cache.get(key)
        if cached is None:
            cached = self.read_video(ref) if video else self.read(ref)
            self.cache.put(key, cached)
        return cached

    @staticmethod
    def uuid(image: ChatImage, weight_version: str) -> str:
        """The part's uuid: an image engine hash (``mmref-<sha256><ext>-<binding>``,
        ``weights.engine_hash``), bound to the content, the chat binding and the weight version."""
        return engine_hash(image.content_key, weight_version)

    async def bind(
        self, parts: list[tuple[dict[str, Any], str]], weight_version: str
    ) -> dict[str, ChatImage]:
        """Read every ref of ``parts`` (``(part, ref)`` pairs, :func:`ref_parts`) and set each part's
        uuid; returns the images by ref, to :func:`pin`.

        Raises:
            InvalidRequest: more refs than ``MMREF_MAX_REFS_PER_REQUEST``.
            MMRefError: the first ref in prompt order that cannot be used.
        """
        limit = self.config.max_refs_per_request
        if len(parts) > limit:
            raise InvalidRequest(f"{len(parts)} refs in one request; MMREF_MAX_REFS_PER_REQUEST is {limit}")
        wanted = list(dict.fromkeys((ref, "video_url" in part) for part, ref in parts))
        results = await asyncio.gather(
            *(self.image(ref, video=video) for ref, video in wanted), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        images: dict[tuple[str, bool], ChatImage] = dict(zip(wanted, results, strict=True))  # type: ignore[arg-type]
        for part, ref in parts:
            part["uuid"] = self.uuid(images[ref, "video_url" in part], weight_version)
        return {ref: image for (ref, _), image in images.items()}


def _cache_key(ref: str, video: bool = False) -> str:
    return hashlib.sha256((("video:" if video else "") + ref).encode("utf-8", "surrogatepass")).hexdigest()


_IMAGE_KEY_RE = re.compile(r"images/[a-f0-9]{16}(?:" + "|".join(re.escape(e) for e in IMAGE_EXTS) + ")")


def object_key(roots: Sequence[AssetRoot], url: str) -> tuple[AssetRoot, str] | None:
    """``(root, key)`` where ``url`` is ``<root url>/images/<16 hex><ext>`` for an object-store
    root of ``roots`` (exactly: no other prefix, no ``..``, no query); None for any other URL."""
    for root in roots:
        prefix = root.url.rstrip("/") + "/"
        if not root.local and url.startswith(prefix) and _IMAGE_KEY_RE.fullmatch(url[len(prefix) :]):
            return root, url[len(prefix) :]
    return None


def ref_parts(body: Any, names: Callable[[Any], bool] = is_ref) -> list[tuple[dict[str, Any], str]]:
    """The content parts of a decoded JSON body whose image URL ``names`` claims (a ref string by
    default; :meth:`ChatRefs.names`), in document order: every object with an ``image_url`` that is
    such a string or an object whose ``url`` is one (chat's ``image_url`` parts, responses'
    ``input_image`` parts, the bare ``{"image_url": ...}`` form), and every ``video_url`` whose
    URL is a ref (chat's ``video_url`` parts: a video ref; ``"video_url" in part`` tells them apart).

    Raises:
        InvalidRequest: a ``uuid`` in the plugin's reserved ``mmref-`` namespace anywhere in the body
            (only the plugin keys items there).
    """
    found: list[tuple[dict[str, Any], str]] = []
    stack: list[Any] = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(reversed(node))
            continue
        if not isinstance(node, dict):
            continue
        if "uuid" in node and str(node["uuid"]).startswith(NAMESPACE):
            raise InvalidRequest(f"content part uuids starting with {NAMESPACE!r} are reserved")
        url = node.get("image_url", node.get("video_url"))
        if isinstance(url, dict):
            url = url.get("url")
        if names(url) and ("image_url" in node or is_ref(url)):  # a video URL: refs only
            found.append((node, url))
        stack.extend(reversed([v for v in node.values() if isinstance(v, (dict, list))]))
    return found


# --- JSON bodies of vLLM's routes (the admission middleware) ---------------------------------------------

NEEDLES = (b"mmraw:", b"mmfile:", NAMESPACE.encode(), b"\\u", b"\\/")
"""Bytes without which a JSON body can carry no ref and no reserved uuid (``\\u``, ``\\/``: escaped
ones)."""


def needles() -> tuple[bytes, ...]:
    """The bytes a JSON body must hold to be parsed: the active service's :attr:`ChatRefs.needles`,
    else :data:`NEEDLES`."""
    service = request_scope.active()
    return NEEDLES if service is None else service.needles


async def bind_body(body: Any, service: ChatRefs | None, versions: Callable[[], Awaitable[str]]) -> bool:
    """Key and pin the image refs of a decoded body (see the module doc); returns whether it
    changed (never where ``service`` is None: refs in image URLs are off, reserved uuids still
    refused).

    Raises:
        InvalidRequest: a reserved uuid; ``mm_processor_kwargs`` beside refs (vLLM would process the
            ref's image with them: the trainer, which processes it with the model's own settings,
            could not reproduce the pixels).
        MMRefError: a ref that cannot be used (see :meth:`ChatRefs.bind`).
    """
    parts = ref_parts(body, service.names if service is not None else is_ref)
    if not parts or service is None:
        return False
    if isinstance(body, dict) and body.get("mm_processor_kwargs"):
        raise InvalidRequest(
            "mm_processor_kwargs do not apply to refs: the trainer processes a ref's image with the model's "
            "own settings (put such settings in the model's preprocessor_config.json)"
        )
    request_scope.pin(await service.bind(parts, await versions()))
    return True
