"""Trainer-side settings from the environment (``MMREF_*``, shared names with the server plugin)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.images import DEFAULT_MAX_IMAGE_PIXELS
from protocol.store import DEFAULT_MAX_IMAGE_BYTES, existing_asset_root

__all__ = ["MaterializeConfig"]


class MaterializeConfig(BaseSettings):
    """Settings of :func:`trainer_lib.materialize`; each field reads ``MMREF_<NAME>``.

    Example::

        cfg = MaterializeConfig()            # raises pydantic.ValidationError naming the bad variable
        batch = materialize(samples, adapter, **cfg.materialize_kwargs())
        m = materialize_micro_batch(packed, spec, cfg)
    """

    model_config = SettingsConfigDict(env_prefix="MMREF_", extra="ignore", frozen=True)

    asset_root: Path
    """Every image must resolve inside this folder (the output root). Required; must exist."""
    missing_policy: Literal["placeholder_zero_loss", "error"] = "placeholder_zero_loss"
    max_workers: int = Field(default=2, ge=1, le=64)
    max_image_bytes: int = Field(default=DEFAULT_MAX_IMAGE_BYTES, ge=1)
    max_image_pixels: int = Field(default=DEFAULT_MAX_IMAGE_PIXELS, ge=1)

    _absolute_existing_dir = field_validator("asset_root")(existing_asset_root)

    def materialize_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`trainer_lib.materialize` (everything but samples and adapter)."""
        return {
            "asset_root": self.asset_root,
            "policy": self.missing_policy,
            "max_workers": self.max_workers,
            "max_image_bytes": self.max_image_bytes,
            "max_image_pixels": self.max_image_pixels,
        }
