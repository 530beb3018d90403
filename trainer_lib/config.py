"""How :func:`trainer_lib.materialize` reads a batch: :class:`MaterializeOptions` (a value) and
:class:`MaterializeConfig`, the trainer-side settings from the environment (``MMREF_*``, shared
names with the server plugin) that give it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from protocol.errors import (
    AssetNotFound,
    AssetTooLarge,
    HashMismatch,
    ImageUnreadable,
    MMRefError,
    VideoUnreadable,
)
from protocol.images import DEFAULT_MAX_IMAGE_PIXELS
from protocol.settings import RootSettings
from protocol.store import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_VIDEO_BYTES

__all__ = [
    "DEFAULT_MATERIALIZE_OPTIONS",
    "REPLACEABLE",
    "MaterializeConfig",
    "MaterializeOptions",
    "MissingPolicy",
]

REPLACEABLE = (AssetNotFound, ImageUnreadable, VideoUnreadable, HashMismatch, AssetTooLarge)
"""Errors about an image or video file itself, which a zero stand-in may replace. Others (outside
the roots, invalid ref, wrong family or fingerprint, grid mismatch) mean the batch is wrong, not
the file, and ``StoreUnavailable`` means the file may exist: they always raise."""

MissingPolicy = Literal["placeholder_zero_loss", "error"]
"""What a missing or unreadable image or video becomes: zero features of its grid and the sample's
loss zeroed, or the error."""


@dataclass(frozen=True, kw_only=True)
class MaterializeOptions:
    """How :func:`trainer_lib.materialize` reads and processes a batch's images and videos (where
    it reads them is its ``source`` argument). Checked when made.

    Example: ``MaterializeOptions(policy="error", max_workers=4)``; from the ``MMREF_*``
    variables: ``MaterializeConfig().options()``.

    Raises:
        ValueError: an unknown ``policy`` or ``max_workers < 1``.
    """

    policy: MissingPolicy = "placeholder_zero_loss"
    """``"placeholder_zero_loss"``: a missing or unreadable image (or video) becomes zero features
    of its grid and its sample's whole loss mask is zeroed; ``"error"``: it raises."""
    max_workers: int = 2
    """Threads reading and processing distinct images (at least 1): a pool the process keeps across
    calls, one per size (:mod:`trainer_lib.pool`)."""
    raw_pixels: bool = False
    """vLLM's raw (un-normalized) pixels instead of the normalized pixels an HF model takes (to
    compare with a server running ``mm_device_do_normalize``; ``PackingSpec.raw_pixels``)."""
    placeholder_token_id: int | None = None
    """If given, each sample's image runs are located and split by its refs' counts
    (:func:`protocol.placeholders.locate_image_runs`, as packing does): a misaligned sample raises
    instead of training on shifted features."""
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    """Bytes an image file may have: the server's limit."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Pixels (``width * height``) an image, or each frame of a video, may decode to: the server's
    limit (:func:`protocol.videos.frame_limits`)."""
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES
    """Bytes a video file may have: the server's limit (``MMREF_MAX_VIDEO_BYTES``)."""

    def __post_init__(self) -> None:
        if self.policy not in ("placeholder_zero_loss", "error"):
            raise ValueError(f"policy must be 'placeholder_zero_loss' or 'error', got {self.policy!r}")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")

    @property
    def replace_missing(self) -> bool:
        """Zero stand-ins for a missing or unreadable image or video (``placeholder_zero_loss``)."""
        return self.policy == "placeholder_zero_loss"

    def replaces(self, error: MMRefError) -> bool:
        """Whether a zero stand-in takes the place of the image or video that raised ``error``:
        under ``placeholder_zero_loss``, for an error about the file itself (:data:`REPLACEABLE`)."""
        return self.replace_missing and isinstance(error, REPLACEABLE)


DEFAULT_MATERIALIZE_OPTIONS = MaterializeOptions()
"""``materialize``'s options when none are given (frozen: one value every call may share)."""


class MaterializeConfig(RootSettings):
    """Settings of :func:`trainer_lib.materialize`; each field reads ``MMREF_<NAME>``.

    Where images are read comes from :class:`protocol.settings.RootSettings` (shared with the server
    plugin; docs/PROTOCOL.md §2.5, docs/SCALING.md §5): ``asset_roots`` (``MMREF_ASSET_ROOTS``,
    ordered folders and object stores, through the node's read cache ``read_cache_dir``) and
    ``asset_root`` (``MMREF_ASSET_ROOT``: v1 refs at their ``file://`` path inside it, else by
    content under it), at least one of the two; :meth:`image_source` opens them once. How they are
    read is :meth:`options`.

    Example::

        cfg = MaterializeConfig()            # SettingError: the bad variable, its value, what is allowed
        batch = materialize(samples, adapter, cfg.image_source(), cfg.options())
        m = materialize_micro_batch(packed, spec, cfg)
    """

    model_config = SettingsConfigDict(
        env_prefix="MMREF_", extra="ignore", frozen=True, hide_input_in_errors=True
    )

    missing_policy: MissingPolicy = "placeholder_zero_loss"
    max_workers: int = Field(default=2, ge=1, le=64)
    max_image_bytes: int = Field(default=DEFAULT_MAX_IMAGE_BYTES, ge=1)
    max_image_pixels: int = Field(default=DEFAULT_MAX_IMAGE_PIXELS, ge=1)
    max_video_bytes: int = Field(default=DEFAULT_MAX_VIDEO_BYTES, ge=1)

    def options(
        self, *, raw_pixels: bool = False, placeholder_token_id: int | None = None
    ) -> MaterializeOptions:
        """These settings as :func:`trainer_lib.materialize`'s options; the pixel mode and the
        placeholder check are the model's (``PackingSpec.raw_pixels``,
        ``PackingSpec.placeholder_token_id``), not the environment's."""
        return MaterializeOptions(
            policy=self.missing_policy,
            max_workers=self.max_workers,
            raw_pixels=raw_pixels,
            placeholder_token_id=placeholder_token_id,
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
            max_video_bytes=self.max_video_bytes,
        )
