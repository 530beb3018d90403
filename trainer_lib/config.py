"""Trainer-side settings from the environment (``MMREF_*``, shared names with the server plugin)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from protocol.images import DEFAULT_MAX_IMAGE_PIXELS
from protocol.settings import RootSettings
from protocol.store import DEFAULT_MAX_IMAGE_BYTES

__all__ = ["MaterializeConfig"]


class MaterializeConfig(RootSettings):
    """Settings of :func:`trainer_lib.materialize`; each field reads ``MMREF_<NAME>``.

    Where images are read comes from :class:`protocol.settings.RootSettings` (shared with the server
    plugin; docs/PROTOCOL.md §2.5, docs/SCALING.md §5): ``asset_roots`` (``MMREF_ASSET_ROOTS``,
    ordered folders and object stores, through the node's read cache ``read_cache_dir``) and
    ``asset_root`` (``MMREF_ASSET_ROOT``: v1 refs at their ``file://`` path inside it, else by
    content under it), at least one of the two; :meth:`image_source` opens them once.

    Example::

        cfg = MaterializeConfig()            # SettingError: the bad variable, its value, what is allowed
        batch = materialize(samples, adapter, **cfg.materialize_kwargs())
        m = materialize_micro_batch(packed, spec, cfg)
    """

    model_config = SettingsConfigDict(
        env_prefix="MMREF_", extra="ignore", frozen=True, hide_input_in_errors=True
    )

    missing_policy: Literal["placeholder_zero_loss", "error"] = "placeholder_zero_loss"
    max_workers: int = Field(default=2, ge=1, le=64)
    max_image_bytes: int = Field(default=DEFAULT_MAX_IMAGE_BYTES, ge=1)
    max_image_pixels: int = Field(default=DEFAULT_MAX_IMAGE_PIXELS, ge=1)

    def materialize_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`trainer_lib.materialize` (everything but samples and adapter)."""
        return {
            "asset_root": self.image_source(),
            "policy": self.missing_policy,
            "max_workers": self.max_workers,
            "max_image_bytes": self.max_image_bytes,
            "max_image_pixels": self.max_image_pixels,
        }
