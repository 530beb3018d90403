"""The node's read cache and object-store request settings (``MMREF_READ_CACHE_*``,
``MMREF_STORE_*``), read one way, below the roots that use them (docs/SCALING.md §5).

:class:`NodeStoreSettings` reads the variables (pydantic-settings; a bad value raises the one-line
:class:`~protocol.setting_names.SettingError`); :class:`StoreClientConfig` is what an object-store
root is handed (obstore's client and retry configuration). :mod:`protocol.root_stores` and
:mod:`protocol.roots` read the environment through this module (``StoreClientConfig.from_env``,
``AssetRoots.from_env``); :mod:`protocol.settings` builds on it: ``StoreSettings`` (these fields,
and ``open_roots``) and ``RootSettings`` (+ where images are read), the base of the plugin's and
the trainer's configs. The layering is one-way (issue 45): settings -> roots -> root_stores -> here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.setting_names import PREFIX, SourceError, setting_error, warn_unknown_variables

__all__ = ["NodeStoreSettings", "StoreClientConfig"]

_NO_VARIABLE = "\0"
"""An environment prefix no variable has: the settings :meth:`NodeStoreSettings.from_environ`
builds read nothing of the process's environment."""


@dataclass(frozen=True)
class StoreClientConfig:
    """Timeouts and retries of object-store requests, handed to obstore's client and retry
    configuration (one request: connect to last body byte).

    A read from one root gives up within :meth:`deadline_s` seconds: at most ``max_retries + 1``
    attempts of ``timeout_s`` each, with backoffs of at most 1 s between them, and no new attempt
    after ``retry_timeout_s``.
    """

    timeout_s: float = 10.0
    """Whole request, connect to last body byte (seconds): ``MMREF_STORE_TIMEOUT_S``."""
    connect_timeout_s: float = 2.0
    """Connect phase (seconds): ``MMREF_STORE_CONNECT_TIMEOUT_S``."""
    max_retries: int = 2
    """Retries of a failed request (5xx, connection errors, timeouts): ``MMREF_STORE_MAX_RETRIES``."""
    retry_timeout_s: float = 30.0
    """No retry starts later than this after the first attempt (seconds): ``MMREF_STORE_RETRY_TIMEOUT_S``."""
    allow_http: bool = False
    """Plain-HTTP endpoints (a local S3 such as moto or MinIO; ``http://`` roots always allow it):
    ``MMREF_STORE_ALLOW_HTTP``."""
    hold_down_s: float = 5.0
    """After a request finds the root unreachable (refused, timed out, a 5xx) and the root
    answered no other request since it began, its reads and writes fail at once
    (:class:`~protocol.errors.StoreUnavailable`) for this long (seconds), then it is asked again:
    the requests queued behind a down or slow root end now instead of each paying
    :meth:`deadline_s` in the worker pool they share with every other request. 0: never held
    down. ``MMREF_STORE_HOLD_DOWN_S``."""

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and self.connect_timeout_s > 0 and self.retry_timeout_s > 0):
            raise ValueError("store timeouts must be > 0 seconds")
        if self.hold_down_s < 0:
            raise ValueError(f"hold_down_s must be >= 0, got {self.hold_down_s}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")

    def deadline_s(self) -> float:
        """Upper bound (seconds) on one read from one root, retries and backoffs included."""
        attempts = self.max_retries + 1
        return min(attempts * self.timeout_s + self.max_retries * 1.0, self.retry_timeout_s + self.timeout_s)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreClientConfig:
        """``MMREF_STORE_*`` (unset: the defaults above), read as every party reads them
        (:class:`NodeStoreSettings`, the fields of :class:`protocol.settings.StoreSettings`).

        Raises:
            SettingError: a value that does not parse or is out of range.
        """
        return NodeStoreSettings.read(environ).store_client()

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> StoreClientConfig:
        """The ``store_<name>`` entries of ``values`` (settings' fields) as ``<name>``; an absent
        one takes its default above.

        Raises:
            ValueError: a value out of range (see ``__post_init__``).
        """
        names = (f.name for f in dataclasses.fields(cls))
        return cls(**{n: values[f"store_{n}"] for n in names if f"store_{n}" in values})

    def obstore_options(self, *, allow_http: bool = False) -> dict[str, Any]:
        """``client_options`` and ``retry_config`` keyword arguments of ``obstore.store.from_url``."""
        return {
            "client_options": {
                "timeout": timedelta(seconds=self.timeout_s),
                "connect_timeout": timedelta(seconds=self.connect_timeout_s),
                "allow_http": self.allow_http or allow_http,
            },
            "retry_config": {
                "max_retries": self.max_retries,
                "retry_timeout": timedelta(seconds=self.retry_timeout_s),
                "backoff": {
                    "init_backoff": timedelta(milliseconds=100),
                    "max_backoff": timedelta(seconds=1),
                    "base": 2,
                },
            },
        }


class NodeStoreSettings(BaseSettings):
    """The node's read cache and object-store requests; each field reads ``MMREF_<NAME>``.

    :class:`protocol.settings.StoreSettings` is this class and ``open_roots``; the roots'
    modules read these fields through this class (they sit below :mod:`protocol.settings`).

    Raises:
        SettingError: a bad value, one line naming the variable, its value and what is allowed
            (:mod:`protocol.setting_names`); the constructor also logs unknown ``MMREF_*``
            variables once per process (:func:`~protocol.setting_names.warn_unknown_variables`).
    """

    model_config = SettingsConfigDict(
        env_prefix=PREFIX, extra="ignore", frozen=True, hide_input_in_errors=True, env_ignore_empty=True
    )
    """An empty variable is unset (``MMREF_ASSET_ROOT="$OUTPUT_ROOT"`` with ``OUTPUT_ROOT`` unset is
    no root, not the current folder). Errors never echo a value through pydantic (a root URL could
    carry a credential): :class:`SettingError` writes the value itself, credentials masked."""

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

    def __init__(self, _environ: Mapping[str, str] | None = None, **values: Any) -> None:
        warn_unknown_variables()
        try:
            if _environ is None:
                super().__init__(**values)
            else:  # from_environ: the values came from _environ; no variable of the process is read
                super().__init__(**values, _env_prefix=_NO_VARIABLE)
        except (ValidationError, SourceError) as e:
            raise setting_error(type(self), e, {} if _environ is not None else values, _environ) from None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> NodeStoreSettings:
        """The settings from ``environ`` instead of the process environment (tests; other
        ``MMREF_*`` variables of the process are not read).

        Raises:
            SettingError: as the constructor.
        """
        n = len(PREFIX)
        values = {k[n:].lower(): v for k, v in environ.items() if k.startswith(PREFIX) and v != ""}
        values = {k: v for k, v in values.items() if k in cls.model_fields}
        return cls(environ, **values)

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> NodeStoreSettings:
        """The settings of ``environ`` (:meth:`from_environ`), or of the process (the
        constructor) when None.

        Raises:
            SettingError: as the constructor.
        """
        return cls() if environ is None else cls.from_environ(environ)

    def store_client(self) -> StoreClientConfig:
        """The object-store request settings (``store_*``)."""
        return StoreClientConfig.from_settings(dict(self))
