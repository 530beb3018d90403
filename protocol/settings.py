"""Every party's ``MMREF_*`` settings, read one way (docs/SCALING.md §5, README "Settings").

:class:`StoreSettings` (the node's read cache and object-store requests) and :class:`RootSettings`
(``+`` where images are read) are the base of the plugin's ``PluginConfig`` and the trainer's
``MaterializeConfig``; an object-store URL given as a string anywhere (``Offloader``,
``offload_image``, ``materialize``) is opened with :func:`store_client`, the same
``MMREF_STORE_*`` values. Whichever party reads them:

- a bad or missing value raises :class:`SettingError`: one line naming the environment variable,
  its value and what is allowed (never pydantic's multi-line report naming a field);
- an ``MMREF_*`` variable no part of mmref reads is logged once per process, with the closest
  known name (:func:`warn_unknown_variables`: ``MMREF_MAX_WORKER`` -> ``MMREF_MAX_WORKERS``).

The fields of :class:`StoreSettings` are read in :mod:`protocol.store_settings`
(``NodeStoreSettings``), below the roots that use them; this module, above the roots, opens them
(``open_roots``, ``RootSettings``): the imports run one way (issue 45). The names and the
wording of refusals live in :mod:`protocol.setting_names`. The server checks
its settings in its launcher process before vLLM builds anything (``vllm_plugin.preflight``, a
``vllm.general_plugins`` entry point).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import NoDecode

from protocol.roots import AssetRoots, StoreClientConfig, open_root, parse_roots_spec
from protocol.setting_names import (
    NEITHER_ROOT,
    PREFIX,
    SettingError,
    known_variables,
    unknown_variables,
    warn_unknown_variables,
)
from protocol.store import existing_asset_root
from protocol.store_settings import NodeStoreSettings

__all__ = [
    "PREFIX",
    "RootSettings",
    "SettingError",
    "StoreSettings",
    "known_variables",
    "store_client",
    "unknown_variables",
    "warn_unknown_variables",
]


class StoreSettings(NodeStoreSettings):
    """The node's read cache and object-store requests (the fields of
    :class:`~protocol.store_settings.NodeStoreSettings`, each reading ``MMREF_<NAME>``), and the
    roots they open (:meth:`open_roots`).

    Raises:
        SettingError: a bad value (see the module doc); the constructor also logs unknown
            ``MMREF_*`` variables once per process (:func:`warn_unknown_variables`).
    """

    def open_roots(self, urls: list[str], legacy_root: str | os.PathLike[str] | None = None) -> AssetRoots:
        """``urls`` opened in order with these settings (:meth:`AssetRoots.from_settings`):
        ``store_*`` for object stores, the node's read cache (``read_cache_dir``,
        ``read_cache_bytes``); ``legacy_root`` for v1 refs.

        Raises:
            ValueError, OSError: see :meth:`AssetRoots.from_urls`.
        """
        return AssetRoots.from_settings(self, urls, legacy_root=legacy_root)


class RootSettings(StoreSettings):
    """Asset roots, the read cache and object-store requests; each field reads ``MMREF_<NAME>``.

    At least one of ``asset_root`` and ``asset_roots`` is required. Without ``asset_roots`` the
    one folder ``asset_root`` is also the only root of v2 refs. The roots are opened when the
    settings are validated (an object-store client per root: no request, no thread yet).

    Raises:
        SettingError: a bad or missing value (a root that does not open included:
            :func:`protocol.roots.open_root`; an ``s3://`` root whose endpoint is plain HTTP
            without ``MMREF_STORE_ALLOW_HTTP``).
    """

    asset_root: Path | None = Field(default=None, json_schema_extra={"allowed": "an existing folder"})
    """``MMREF_ASSET_ROOT``: v1 refs resolve inside this folder (by path, or by content for a
    copied store) and ``mmfile`` feature files are read under it; must exist when set."""
    asset_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        json_schema_extra={
            "allowed": "absolute folders, file://, s3://, gs://, az:// or http(s):// URLs without "
            "credentials, comma-separated or a JSON list"
        },
    )
    """``MMREF_ASSET_ROOTS``: ordered roots (absolute folders, ``file://``, ``s3://``, ``gs://``,
    ``az://``, ``http(s)://``), comma-separated or a JSON list (:func:`protocol.roots.parse_roots_spec`)."""

    @field_validator("asset_root")
    @classmethod
    def _absolute_existing_dir(cls, value: Path | None) -> Path | None:
        return None if value is None else existing_asset_root(value)

    @field_validator("asset_roots", mode="before")
    @classmethod
    def _roots_spec(cls, value: Any) -> Any:
        return parse_roots_spec(value) if isinstance(value, str) else value

    @field_validator("asset_roots")
    @classmethod
    def _roots_open(cls, value: list[str], info: ValidationInfo) -> list[str]:
        """Each root opens (:func:`protocol.roots.open_root`, with the ``store_*`` values given):
        a URL off the rules, or an ``s3://`` root on a plain-HTTP endpoint without
        ``MMREF_STORE_ALLOW_HTTP``, is refused here, naming ``MMREF_ASSET_ROOTS``."""
        client = StoreClientConfig.from_settings(info.data)
        for url in value:
            open_root(url, client)
        return value

    @model_validator(mode="after")
    def _somewhere_to_read(self) -> RootSettings:
        if self.asset_root is None and not self.asset_roots:
            raise ValueError(NEITHER_ROOT)
        try:
            self.image_source()  # the read cache folder is made here
        except ValueError as e:
            raise ValueError(f"read cache: {e.__cause__ or e}") from e
        return self

    def root_urls(self) -> list[str]:
        """The roots in order: ``asset_roots``, or ``[asset_root]`` without them."""
        return list(self.asset_roots) or [str(self.asset_root)]

    @functools.cached_property
    def _source(self) -> AssetRoots:
        return self.open_roots(self.root_urls(), self.asset_root)

    def image_source(self) -> AssetRoots:
        """The roots, the read cache and ``asset_root`` for v1 refs, opened when the settings are
        validated and kept (one object-store client per root, one cache). Requests start
        obstore's runtime in the process that makes them (a ``fork`` does not carry it).

        Raises:
            ValueError: a root that does not open, naming ``MMREF_ASSET_ROOTS`` (see
                :func:`protocol.roots.open_root`), or a read cache folder that cannot be made.
        """
        try:
            return self._source
        except (ValueError, OSError) as e:
            raise ValueError(f"MMREF_ASSET_ROOTS / MMREF_READ_CACHE_DIR: {e}") from e


def store_client() -> StoreClientConfig:
    """``MMREF_STORE_*`` of this process, read as every party reads them (:class:`StoreSettings`).

    Raises:
        SettingError: a bad value.
    """
    return StoreSettings().store_client()
