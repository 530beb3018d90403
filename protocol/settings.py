"""Where a party reads images, as settings (``MMREF_*``): the part of the plugin's and the
trainer's configuration that builds their :class:`~protocol.roots.AssetRoots` (docs/SCALING.md §5).

A subclass sets ``model_config`` (``env_prefix="MMREF_"``) and adds its own fields; this class adds
``asset_root``, ``asset_roots``, the node's read cache and the object-store request settings, and
:meth:`RootSettings.image_source`, which opens the roots once.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from protocol.roots import AssetRoots, StoreClientConfig, parse_roots_spec
from protocol.store import existing_asset_root

__all__ = ["RootSettings"]


class RootSettings(BaseSettings):
    """Asset roots, the read cache and object-store requests; each field reads ``MMREF_<NAME>``.

    At least one of ``asset_root`` and ``asset_roots`` is required. Without ``asset_roots`` the
    one folder ``asset_root`` is also the only root of v2 refs.

    Raises:
        pydantic.ValidationError: a bad value, naming the setting (a root that does not open
            included: :func:`protocol.roots.open_root`).
    """

    model_config = SettingsConfigDict(hide_input_in_errors=True)
    """Errors name the setting, never echo its value (a root URL could carry a credential, which is
    then refused: the refusal must not log it)."""

    asset_root: Path | None = None
    """``MMREF_ASSET_ROOT``: v1 refs resolve inside this folder (by path, or by content for a
    copied store) and ``mmfile`` feature files are read under it; must exist when set."""
    asset_roots: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """``MMREF_ASSET_ROOTS``: ordered roots (absolute folders, ``file://``, ``s3://``, ``gs://``,
    ``az://``, ``http(s)://``), comma-separated or a JSON list (:func:`protocol.roots.parse_roots_spec`)."""
    read_cache_dir: Path | None = None
    """The node's read-through cache of object-store reads (local disk); unset: no cache."""
    read_cache_bytes: int = Field(default=8 << 30, ge=0)
    """The cache's byte cap (LRU beyond); 0: no cache."""
    store_timeout_s: float = Field(default=10.0, gt=0)
    """One object-store request, connect to last byte (seconds)."""
    store_connect_timeout_s: float = Field(default=2.0, gt=0)
    store_max_retries: int = Field(default=2, ge=0)
    """Retries of 5xx, connection errors and timeouts."""
    store_retry_timeout_s: float = Field(default=30.0, gt=0)
    """No retry starts later than this (seconds)."""
    store_allow_http: bool = False
    """Plain-HTTP object-store endpoints (a local S3)."""
    store_hold_down_s: float = Field(default=5.0, ge=0)
    """After a request finds an object-store root unreachable, its reads fail at once for this
    long (seconds; 0: never)."""

    @field_validator("asset_root")
    @classmethod
    def _absolute_existing_dir(cls, value: Path | None) -> Path | None:
        return None if value is None else existing_asset_root(value)

    @field_validator("asset_roots", mode="before")
    @classmethod
    def _roots_spec(cls, value: Any) -> Any:
        return parse_roots_spec(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _somewhere_to_read(self) -> RootSettings:
        if self.asset_root is None and not self.asset_roots:
            raise ValueError("asset_root / asset_roots: set MMREF_ASSET_ROOT (a folder) or MMREF_ASSET_ROOTS")
        self.image_source()  # a root that does not open stops start-up here, naming the setting
        return self

    def store_client(self) -> StoreClientConfig:
        """The object-store request settings (``store_*``)."""
        return StoreClientConfig(
            timeout_s=self.store_timeout_s,
            connect_timeout_s=self.store_connect_timeout_s,
            max_retries=self.store_max_retries,
            retry_timeout_s=self.store_retry_timeout_s,
            allow_http=self.store_allow_http,
            hold_down_s=self.store_hold_down_s,
        )

    def root_urls(self) -> list[str]:
        """The roots in order: ``asset_roots``, or ``[asset_root]`` without them."""
        return list(self.asset_roots) or [str(self.asset_root)]

    @functools.cached_property
    def _source(self) -> AssetRoots:
        return AssetRoots.from_urls(
            self.root_urls(),
            client=self.store_client(),
            cache_dir=self.read_cache_dir,
            cache_bytes=self.read_cache_bytes,
            legacy_root=self.asset_root,
        )

    def image_source(self) -> AssetRoots:
        """The roots, the read cache and ``asset_root`` for v1 refs, opened when the settings are
        validated and kept (one object-store client per root, one cache). Build the settings in
        the process that reads: obstore starts its own runtime, which a ``fork`` does not carry.

        Raises:
            ValueError: a root that does not open, naming ``MMREF_ASSET_ROOTS`` (see
                :func:`protocol.roots.open_root`), or a read cache folder that cannot be made.
        """
        try:
            return self._source
        except (ValueError, OSError) as e:
            raise ValueError(f"MMREF_ASSET_ROOTS / MMREF_READ_CACHE_DIR: {e}") from e
