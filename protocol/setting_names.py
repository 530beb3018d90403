"""The names of mmref's ``MMREF_*`` settings, and the one-line refusal of a bad value
(:mod:`protocol.settings` reads them; this module words what goes wrong).

- :class:`SettingError`: one line per failing setting naming the environment variable, its value
  (a URL's credentials replaced by ``***``) and what is allowed, from the field's annotation,
  bounds and ``json_schema_extra["allowed"]``;
- :func:`warn_unknown_variables`: an ``MMREF_*`` variable no part of mmref reads is logged once
  per process with the closest known name (:func:`difflib.get_close_matches`).
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlsplit, urlunsplit

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings
from pydantic_settings import SettingsError as SourceError

__all__ = [
    "NEITHER_ROOT",
    "PARTY_VARIABLES",
    "PREFIX",
    "ROOT_VARIABLES",
    "TOOL_VARIABLES",
    "SettingError",
    "SourceError",
    "known_variables",
    "setting_error",
    "unknown_variables",
    "warn_unknown_variables",
]

PREFIX = "MMREF_"

ROOT_VARIABLES = frozenset(
    {
        "MMREF_ASSET_ROOT",
        "MMREF_ASSET_ROOTS",
        "MMREF_READ_CACHE_DIR",
        "MMREF_READ_CACHE_BYTES",
        "MMREF_STORE_TIMEOUT_S",
        "MMREF_STORE_CONNECT_TIMEOUT_S",
        "MMREF_STORE_MAX_RETRIES",
        "MMREF_STORE_RETRY_TIMEOUT_S",
        "MMREF_STORE_ALLOW_HTTP",
        "MMREF_STORE_HOLD_DOWN_S",
    }
)
"""The fields of :class:`protocol.settings.RootSettings`: where images are read, the node's read
cache and object-store requests (``tests/test_settings.py`` keeps this equal to its fields).
Written out, not read from the class: every settings class warns through this module, which sits
below them all (issue 45: no import circle)."""

PARTY_VARIABLES = frozenset(
    {
        "MMREF_CACHE_BUDGET_BYTES",
        "MMREF_MAX_WORKERS",
        "MMREF_MAX_IMAGE_BYTES",
        "MMREF_MAX_IMAGE_PIXELS",
        "MMREF_MAX_FEATURE_BYTES",
        "MMREF_MAX_VIDEO_BYTES",
        "MMREF_MAX_BODY_BYTES",
        "MMREF_MAX_REFS_PER_REQUEST",
        "MMREF_HOLD_TIMEOUT_S",
        "MMREF_ALLOWED_FAMILIES",
        "MMREF_MISSING_POLICY",
    }
)
"""The plugin's (``PluginConfig``) and the trainer's (``MaterializeConfig``) own settings beyond
:class:`protocol.settings.RootSettings` (``tests/test_settings.py`` keeps this equal to their fields)."""

TOOL_VARIABLES = frozenset(
    {"MMREF_URL", "MMREF_OFFLINE", "MMREF_FUZZ_EXAMPLES", "MMREF_REGENERATE_PINNED_PLANS"}
)
"""Read by the repository's scripts and tests: the README blocks' server URL, the compatibility
check's offline switch, the long fuzzing run's example count, the pinned plans' regeneration."""

NEITHER_ROOT = "neither is set"
"""The reason :class:`protocol.settings.RootSettings` gives when no root is set."""

_log = logging.getLogger(__name__)
_warned: set[str] = set()


class SettingError(ValueError):
    """A bad or missing ``MMREF_*`` value: the message is one line naming the variable, its value
    (a URL's credentials replaced by ``***``) and what is allowed.

    Attributes:
        variables: the variables named.
    """

    def __init__(self, message: str, variables: list[str]) -> None:
        super().__init__(message)
        self.variables = variables


def known_variables() -> frozenset[str]:
    """Every ``MMREF_*`` variable some part of mmref reads."""
    return ROOT_VARIABLES | PARTY_VARIABLES | TOOL_VARIABLES


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One message per ``MMREF_*`` variable of ``environ`` (default: the process's) that no part
    of mmref reads, naming the closest known one (:func:`difflib.get_close_matches`)."""
    env = os.environ if environ is None else environ
    known = known_variables()
    out = []
    for name in sorted(n for n in env if n.upper().startswith(PREFIX) and n.upper() not in known):
        close = difflib.get_close_matches(name.upper(), sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        out.append(f"mmref: {name} is not a setting of mmref and is ignored{hint}")
    return out


def warn_unknown_variables(
    environ: Mapping[str, str] | None = None, log: logging.Logger | None = None
) -> list[str]:
    """Log (WARNING, once per process and name) the messages of :func:`unknown_variables`;
    returns the ones logged now."""
    fresh = [m for m in unknown_variables(environ) if m.split()[1] not in _warned]
    for message in fresh:
        _warned.add(message.split()[1])
        (log or _log).warning("%s", message)
    return fresh


def setting_error(
    cls: type[BaseSettings],
    error: ValidationError | SourceError,
    values: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
) -> SettingError:
    """``error`` of building ``cls`` as one :class:`SettingError` line: per failing setting, the
    variable (or the keyword given), its value and what is allowed."""
    env = os.environ if environ is None else environ
    if isinstance(error, SourceError):  # a complex value (a JSON list) that does not parse as JSON
        m = re.search(r'field "?(\w+)"?', str(error))
        field = m.group(1) if m else ""
        return SettingError(_line(cls, field, "it is not JSON", values, env), [_var(field)])
    parts, names = [], []
    for item in error.errors():
        field = str(item["loc"][0]) if item["loc"] else ""
        reason = str(item.get("msg", "")).removeprefix("Value error, ")
        if not field and not reason.startswith(NEITHER_ROOT):  # the read cache folder could not be made
            parts.append(_line(cls, "read_cache_dir", reason, values, env))
            names.append("MMREF_READ_CACHE_DIR")
            continue
        if not field:  # the model rule: one of the two roots
            parts.append(
                "MMREF_ASSET_ROOT / MMREF_ASSET_ROOTS: neither is set: set MMREF_ASSET_ROOT to an existing "
                f"folder or MMREF_ASSET_ROOTS to {_allowed(cls.model_fields['asset_roots'])}"
            )
            names += ["MMREF_ASSET_ROOT", "MMREF_ASSET_ROOTS"]
            continue
        parts.append(_line(cls, field, reason, values, env))
        names.append(_var(field))
    return SettingError("; ".join(parts), names)


def _var(field: str) -> str:
    return PREFIX + field.upper()


def _line(
    cls: type[BaseSettings], field: str, reason: str, values: Mapping[str, Any], env: Mapping[str, str]
) -> str:
    info = cls.model_fields.get(field)
    allowed = f": allowed: {_allowed(info)}" if info is not None else ""
    reason = reason.replace("\n", " ")
    if field in values:
        return f"mmref setting {field}={_masked(str(values[field]))!r} ({reason}){allowed}"
    value = next((v for k, v in env.items() if k.upper() == _var(field)), None)
    shown = "unset" if value is None else repr(_masked(value))
    return f"mmref setting {_var(field)}={shown} ({reason}){allowed}"


def _allowed(info: FieldInfo) -> str:
    """What a field accepts, from its annotation, bounds and ``json_schema_extra["allowed"]``."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "allowed" in extra:
        return str(extra["allowed"])
    kind = info.annotation
    optional = type(None) in get_args(kind)
    if optional:
        kind = next(a for a in get_args(kind) if a is not type(None))
    bounds = []
    for m in info.metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                bounds.append(f"{op} {getattr(m, attr)}")
    if get_origin(kind) is Literal:
        text = "one of " + ", ".join(repr(a) for a in get_args(kind))
    elif kind is bool:
        text = "true or false (1/0, yes/no, on/off)"
    elif kind is int:
        text = "an integer"
    elif kind is float:
        text = "a number"
    elif kind is Path:
        text = "a folder path"
    elif get_origin(kind) is list:
        text = "a JSON list of strings, e.g. '[\"qwen2_vl\"]'"
    else:
        text = getattr(kind, "__name__", str(kind))
    text += (" " + " and ".join(bounds)) if bounds else ""
    return text + (" (or unset)" if optional and info.default is None else "")


def _masked(value: str) -> str:
    """``value`` with the user:password part of any URL in it replaced by ``***``."""

    def mask(part: str) -> str:
        try:
            split = urlsplit(part.strip())
        except ValueError:
            return part
        if "@" not in split.netloc:
            return part
        return urlunsplit(split._replace(netloc="***@" + split.netloc.rsplit("@", 1)[1]))

    return ",".join(mask(p) for p in value.split(","))
