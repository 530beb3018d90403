"""``content_parts`` of a generate request: what vLLM would crash or hang on, refused first; refs.

vLLM renders ``content_parts`` (OpenAI-style parts: text, image URLs) itself, with its media
connector; the plugin adds two refusals (``serving.py`` module doc): a uuid in the plugin's
reserved namespace, and a ``file://`` URL vLLM's loader would answer with a 500 or block on.
An ``image_url`` part whose URL is a ref is read, checked and keyed as on the chat route
(:func:`bind_content_refs`, ``chat_refs.py``), under the request's weight version.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from protocol.errors import AssetNotFound, InvalidRequest
from vllm_plugin import request_scope
from vllm_plugin.weights import NAMESPACE

__all__ = ["bind_content_refs", "check_content_parts"]


def check_content_parts(parts: list[dict[str, Any]], local_media: Path | None) -> None:
    """Refuse reserved uuids and unusable ``file://`` URLs.

    Args:
        parts: the request's ``content_parts``.
        local_media: vLLM's ``--allowed-local-media-path``, resolved (None: no local files).

    Raises:
        InvalidRequest: a uuid starting with ``mmref-``; a ``file://`` URL where the server loads
            no local files, or naming something other than a regular file.
        AssetNotFound: a ``file://`` URL under the allowed path naming no readable file.
    """
    for part in parts:
        if str(part.get("uuid") or "").startswith(NAMESPACE):
            raise InvalidRequest(f"content_parts uuids starting with {NAMESPACE!r} are reserved")
        url = part.get("url")
        if isinstance(url, str) and url[:5].lower() == "file:":
            _check_local_file(url, local_media)


def _check_local_file(url: str, local_media: Path | None) -> None:
    """vLLM's ``MediaConnector._load_file_url`` reads the file in a worker thread without a
    timeout: a FIFO blocks it for good, a device streams forever. Refuse anything but a regular
    file under ``--allowed-local-media-path`` (vLLM's own check refuses paths outside it)."""
    from urllib.request import url2pathname

    from urllib3.util import parse_url

    if local_media is None:  # stock: a 500 from vLLM's RuntimeError
        raise InvalidRequest("this server loads no local files (started without --allowed-local-media-path)")
    try:
        spec = parse_url(url)
        path = Path(url2pathname((spec.netloc or "") + (spec.path or ""))).resolve()
    except ValueError:
        return  # unparsable: vLLM refuses it (400) as it does without the plugin
    if local_media not in path.parents:
        return  # vLLM refuses paths outside --allowed-local-media-path (400)
    try:
        mode = os.stat(path).st_mode
    except OSError as e:  # stock: a 500 from the FileNotFoundError
        raise AssetNotFound("a content_parts file:// URL names no readable file") from e
    if not stat.S_ISREG(mode):
        raise InvalidRequest("a content_parts file:// URL names something other than a regular file")


async def bind_content_refs(parts: list[dict[str, Any]], weight_version: str) -> None:
    """Read, check and key every ``image_url`` part whose URL is the plugin's (a ref, or an image
    key's URL under the server's object-store roots: ``ChatRefs.names``, as on the chat route),
    setting its ``uuid``, and pin the images for the media connector; run after
    :func:`check_content_parts` (whose reserved-uuid rule the keys would break). Nothing where refs
    in image URLs are off.

    Raises:
        MMRefError: as ``chat_refs.ChatRefs.bind``.
    """
    service = request_scope.active()
    if service is None:
        return
    found = [(p, p["url"]) for p in parts if p.get("type") == "image_url" and service.names(p.get("url"))]
    if found:
        request_scope.pin(await service.bind(found, weight_version))
