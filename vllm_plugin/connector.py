"""The media connector ``mmref``: vLLM's own connector, with image refs resolved.

vLLM's chat parser (``vllm/renderers/chat_utils.py``) builds its media connector per request with
media, ``MEDIA_CONNECTOR_REGISTRY.load(envs.VLLM_MEDIA_CONNECTOR, ...)``, in the API-server
process, and hands it every image URL as given (no scheme check before the connector). The plugin
registers :data:`CONNECTOR_NAME` there when vLLM attaches its routes (in every API-server process)
and selects it with ``VLLM_MEDIA_CONNECTOR`` where the operator left that unset (:func:`enable`).

For an ``mmraw:`` / ``mmfile:`` URL, or an image key's URL under one of the server's object-store
roots (``ChatRefs.names``), the connector returns the image the request pinned
(``request_scope.pin``, read and keyed before vLLM parsed the body), or reads it through the plugin
(``ChatRefs.image``); what it returns is what vLLM's connector returns for an image, a
``MediaWithBytes`` of the RGB image and its bytes, so vLLM's processor processes it as a data
URL's. A video ref in a ``video_url`` part is the same (``fetch_video``): the frames and metadata of
vLLM's loader (``ChatRefs.read_video``), as vLLM's connector returns a data URL's video. Every
other URL (http, data, file under ``--allowed-local-media-path``) goes to vLLM's connector
unchanged.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from protocol.errors import MMRefError
from protocol.refs import is_ref
from upstream import load
from vllm_plugin import chat_refs, request_scope

__all__ = ["CONNECTOR_NAME", "enable", "register"]

logger = logging.getLogger("vllm.mmref")

CONNECTOR_NAME = "mmref"
"""The connector's name in vLLM's ``MEDIA_CONNECTOR_REGISTRY`` (``VLLM_MEDIA_CONNECTOR=mmref``)."""
_ENV = "VLLM_MEDIA_CONNECTOR"


_registered: list[type] = []


def register() -> type:
    """Register the connector class under :data:`CONNECTOR_NAME` (once per process); returns it."""
    if not _registered:
        cls = _connector_class(load("MediaConnector"))
        load("MEDIA_CONNECTOR_REGISTRY").register(CONNECTOR_NAME)(cls)
        _registered.append(cls)
    return _registered[0]


def enable() -> bool:
    """Select the connector where ``VLLM_MEDIA_CONNECTOR`` is unset (vLLM reads it per request);
    returns whether vLLM will use it. An operator's other choice is kept (refs in image URLs then
    get that connector's answer) and logged."""
    if os.environ.get(_ENV) is None:
        os.environ[_ENV] = CONNECTOR_NAME
    chosen = load("envs.VLLM_MEDIA_CONNECTOR")
    if chosen != CONNECTOR_NAME:
        logger.warning(
            "mmref: %s=%s: refs in image URLs are off (unset it, or set it to %r)",
            _ENV,
            chosen,
            CONNECTOR_NAME,
        )
    return chosen == CONNECTOR_NAME


def _connector_class(base: type) -> type:
    """A subclass of vLLM's ``MediaConnector`` (built when vLLM is importable: this module imports
    nothing from vLLM at import)."""

    class MMRefMediaConnector(base):  # type: ignore[misc, valid-type]
        """vLLM's connector; image refs come from the plugin (see the module doc)."""

        def fetch_image(self, image_url: str, *, image_mode: str | None = "RGB") -> Any:
            if not _ours(image_url):
                return super().fetch_image(image_url, image_mode=image_mode)
            image = request_scope.pinned(image_url)
            if image is None:
                try:
                    image = _service(image_url).image_sync(image_url)
                except MMRefError as e:
                    request_scope.record_error(e)
                    raise
            return image.media

        async def fetch_image_async(self, image_url: str, *, image_mode: str | None = "RGB") -> Any:
            if not _ours(image_url):
                return await super().fetch_image_async(image_url, image_mode=image_mode)
            image = request_scope.pinned(image_url)
            if image is None:
                try:
                    image = await _service(image_url).image(image_url)
                except MMRefError as e:
                    request_scope.record_error(e)
                    raise
            return image.media

        def fetch_video(
            self, video_url: str, *, image_mode: str | None = "RGB", video_processor: str | None = None
        ) -> Any:
            if not is_ref(video_url):
                return super().fetch_video(video_url, image_mode=image_mode, video_processor=video_processor)
            video = request_scope.pinned(video_url)
            if video is None:
                try:
                    video = _service(video_url).image_sync(video_url, video=True)
                except MMRefError as e:
                    request_scope.record_error(e)
                    raise
            return video.media

        async def fetch_video_async(
            self, video_url: str, *, image_mode: str | None = "RGB", video_processor: str | None = None
        ) -> Any:
            if not is_ref(video_url):
                return await super().fetch_video_async(
                    video_url, image_mode=image_mode, video_processor=video_processor
                )
            video = request_scope.pinned(video_url)
            if video is None:
                try:
                    video = await _service(video_url).image(video_url, video=True)
                except MMRefError as e:
                    request_scope.record_error(e)
                    raise
            return video.media

    return MMRefMediaConnector


def _ours(url: str) -> bool:
    """A ref, or an image key's URL under this server's object-store roots (``ChatRefs.names``)."""
    service = request_scope.active()
    return service.names(url) if service is not None else is_ref(url)


def _service(ref: str) -> chat_refs.ChatRefs:
    """The process's :class:`~vllm_plugin.chat_refs.ChatRefs`.

    Raises:
        InvalidRequest: none (a server without an engine, e.g. vLLM's CPU-only render server).
    """
    service = request_scope.active()
    if service is None:
        from protocol.errors import InvalidRequest

        raise InvalidRequest("this server resolves no refs (no engine)", ref=ref)
    return service
