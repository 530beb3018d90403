"""Plugin settings from the environment (``MMREF_*``), validated when the server starts."""

from __future__ import annotations

from pydantic import Field

from protocol.features import DEFAULT_MAX_FEATURE_BYTES
from protocol.images import DEFAULT_MAX_IMAGE_PIXELS
from protocol.settings import RootSettings
from protocol.store import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_VIDEO_BYTES

__all__ = ["PluginConfig"]


class PluginConfig(RootSettings):
    """Settings of the mmref endpoint plugin; each field reads ``MMREF_<NAME>``.

    Where images are read (:class:`~protocol.settings.RootSettings`): ``asset_roots``
    (``MMREF_ASSET_ROOTS``: ordered folders and object stores, through the node's read cache
    ``read_cache_dir``; ``store_*``: object-store timeouts and retries) and ``asset_root``
    (``MMREF_ASSET_ROOT``: v1 refs at their ``file://`` path inside it, ``mmfile`` feature files).
    At least one of the two. The roots are opened by the plugin's ``init_state``
    (:meth:`~protocol.settings.RootSettings.image_source`), after vLLM started its processes.

    Raises:
        protocol.settings.SettingError: one line naming the bad variable, its value and what is
            allowed (checked before the engine starts: ``vllm_plugin/preflight.py``).
    """

    cache_budget_bytes: int = Field(default=2 << 30, ge=0)
    """Bytes of resolved items (their tensors) the resolve cache keeps (LRU beyond)."""
    max_workers: int = Field(default=2, ge=1, le=64)
    """Threads that read and process images."""
    max_image_bytes: int = Field(default=DEFAULT_MAX_IMAGE_BYTES, ge=1)
    max_image_pixels: int = Field(default=DEFAULT_MAX_IMAGE_PIXELS, ge=1)
    max_video_bytes: int = Field(default=DEFAULT_MAX_VIDEO_BYTES, ge=1)
    """Largest video file a video ref may name (its frames: ``max_image_pixels`` each, and
    ``protocol.videos.DEFAULT_VIDEO_LIMITS``' frame count, duration and decoded bytes)."""
    max_feature_bytes: int = Field(default=DEFAULT_MAX_FEATURE_BYTES, ge=1)
    """Largest ``mmfile`` feature file read."""
    max_body_bytes: int | None = Field(default=None, ge=1024)
    """Largest request body accepted (413 beyond, logged). Default: derived at start-up from the
    served model so that every body stock vLLM serves is admitted
    (:func:`vllm_plugin.startup.default_body_limit`); the server log states the value."""
    max_refs_per_request: int = Field(default=64, ge=1)
    """Most refs one request may carry (each costs a file read and a processor run)."""
    hold_timeout_s: float = Field(default=300.0, gt=0, le=86400)
    """A weight-update hold's lease (seconds): a hold (``/mmref/v1/weights/hold``, vLLM's
    ``/pause`` or ``/sleep``) not released within it is released and logged, so that a lost client
    never freezes generation (``vllm_plugin/updates.py``)."""
    allowed_families: list[str] | None = None
    """If set (a JSON list, e.g. ``'["qwen2_vl"]'``), the served model's family must be among them."""
