"""Trainer-side settings from the environment (``MMREF_*``, shared names with the server plugin)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from protocol.images import DEFAULT_MAX_IMAGE_PIXELS
from protocol.roots import AssetRoots, StoreClientConfig, parse_roots_spec
from protocol.store import DEFAULT_MAX_IMAGE_BYTES, existing_asset_root

__all__ = ["MaterializeConfig"]


class MaterializeConfig(BaseSettings):
    """Settings of :func:`trainer_lib.materialize`; each field reads ``MMREF_<NAME>``.

    Where images are read (docs/PROTOCOL.md §2.5, docs/SCALING.md §5): ``asset_roots``
    (``MMREF_ASSET_ROOTS``, ordered folders and object stores, through the node's read cache
    ``read_cache_dir``), and ``asset_root`` (``MMREF_ASSET_ROOT``: v1 refs at their ``file://``
    path inside it, else by content under it). At least one of the two is required.

    Example::

        cfg = MaterializeConfig()            # raises pydantic.ValidationError naming the bad variable
        batch = materialize(samples, adapter, **cfg.materialize_kwargs())
        m = materialize_micro_batch(packed, spec, cfg)
    """

    model_config = SettingsConfigDict(env_prefix="MMREF_", extra="ignore", frozen=True)

    asset_root: Path | None = None
    """v1 refs resolve inside this folder (the output root), by path or by content (a copied
    store); must exist when set. Without ``asset_roots`` it is also the one root of v2 refs."""
    asset_roots: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Ordered roots (absolute folders, ``file://``, ``s3://``, ``gs://``, ``az://``,
    ``http(s)://``), comma-separated or a JSON list (:func:`protocol.roots.parse_roots_spec`)."""
    read_cache_dir: Path | None = None
    """The node's read-through cache of object-store reads (local disk); unset: no cache."""
    read_cache_bytes: int = Field(default=8 << 30, ge=0)
    """The cache's byte cap (LRU beyond); 0: no cache."""
    store_timeout_s: float = Field(default=10.0, gt=0)
    store_connect_timeout_s: float = Field(default=2.0, gt=0)
    store_max_retries: int = Field(default=2, ge=0)
    store_retry_timeout_s: float = Field(default=30.0, gt=0)
    store_allow_http: bool = False
    """Object-store requests (:class:`protocol.roots.StoreClientConfig`): one request's timeout,
    the connect timeout, retries of 5xx / connection errors / timeouts, no retry after this many
    seconds, plain-HTTP endpoints (a local S3)."""
    missing_policy: Literal["placeholder_zero_loss", "error"] = "placeholder_zero_loss"
    max_workers: int = Field(default=2, ge=1, le=64)
    max_image_bytes: int = Field(default=DEFAULT_MAX_IMAGE_BYTES, ge=1)
    max_image_pixels: int = Field(default=DEFAULT_MAX_IMAGE_PIXELS, ge=1)

    @field_validator("asset_root")
    @classmethod
    def _absolute_existing_dir(cls, value: Path | None) -> Path | None:
        return None if value is None else existing_asset_root(value)

    @field_validator("asset_roots", mode="before")
    @classmethod
    def _roots_spec(cls, value: Any) -> Any:
        return parse_roots_spec(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _somewhere_to_read(self) -> MaterializeConfig:
        if self.asset_root is None and not self.asset_roots:
            raise ValueError("set MMREF_ASSET_ROOTS (ordered roots) or MMREF_ASSET_ROOT (a folder)")
        try:
            self.image_source()  # roots that do not open fail here, naming the root
        except ValueError as e:
            raise ValueError(f"MMREF_ASSET_ROOTS / MMREF_READ_CACHE_DIR: {e}") from e
        return self

    def store_client(self) -> StoreClientConfig:
        """The object-store request settings (``store_*``)."""
        return StoreClientConfig(
            timeout_s=self.store_timeout_s,
            connect_timeout_s=self.store_connect_timeout_s,
            max_retries=self.store_max_retries,
            retry_timeout_s=self.store_retry_timeout_s,
            allow_http=self.store_allow_http,
        )

    @functools.cached_property
    def _source(self) -> AssetRoots:
        roots = self.asset_roots or [str(self.asset_root)]
        return AssetRoots.from_urls(
            roots,
            client=self.store_client(),
            cache_dir=self.read_cache_dir,
            cache_bytes=self.read_cache_bytes,
            legacy_root=self.asset_root,
        )

    def image_source(self) -> AssetRoots:
        """Where :func:`trainer_lib.materialize` reads: ``asset_roots`` (or ``[asset_root]``) in
        order, the read cache, ``asset_root`` for v1 refs. Built once per config (one object-store
        client per root, one cache).

        Raises:
            ValueError: a root that does not open (see :func:`protocol.roots.open_root`).
        """
        return self._source

    def materialize_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`trainer_lib.materialize` (everything but samples and adapter)."""
        return {
            "asset_root": self.image_source(),
            "policy": self.missing_policy,
            "max_workers": self.max_workers,
            "max_image_bytes": self.max_image_bytes,
            "max_image_pixels": self.max_image_pixels,
        }
