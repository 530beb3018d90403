"""The door: every vLLM name the plugin uses passes through here, and every vLLM (and
transformers-internal) name the project relies on is a row of one table.

- **The table** (:data:`SURFACE`, :data:`HF_SURFACE`, :data:`STDLIB_SURFACE`): one
  :class:`Touchpoint` per name (a module, class, function, method, attribute or module constant)
  at the module path of vLLM 0.32, with how the project uses it (the positional arguments and
  keyword names it passes), whether it is private (and why no public name serves), the upstream
  file that defines it, and the files that use it; a :class:`Variant` gives its form from a later
  release on, ``since`` the releases a name exists in. Rows: ``rows_plugin.py`` (``vllm_plugin/``),
  ``rows_other.py`` (``protocol/``, scripts, bench, tests, transformers, stdlib).
- **The door** (``door.py``): plugin modules import vLLM only through :func:`load` (a row's name,
  in the installed release's form) and the functions for what is reached other than by import:
  the private names (:func:`mm_fields_config`, :func:`mm_worker`, :func:`invalidation_drain`) and
  the version-keyed branches (:func:`invalidation_drain`, :func:`serving_tokens_keywords`,
  :func:`locate`). No other plugin module spells a vLLM path or tests a vLLM version.

Checked two ways: ``tests/test_vllm_compat.py`` imports every name from the installed vLLM and
binds the project's call shapes to its signatures; ``scripts/vllm_compat.py`` checks the same
table statically (``ast`` only) against any vLLM source tree or wheel, e.g. the newest release,
which cannot be installed here (docs/VLLM-SURFACE.md).

This package imports nothing from vLLM (or transformers) at import time.
"""

from __future__ import annotations

from vllm_plugin.vllm_surface import rows_other as _other
from vllm_plugin.vllm_surface import rows_plugin as _plugin
from vllm_plugin.vllm_surface.door import (
    invalidation_drain,
    load,
    locate,
    mm_fields_config,
    mm_worker,
    served_image_processor,
    serving_tokens_keywords,
    touchpoint,
    vllm_version,
)
from vllm_plugin.vllm_surface.model import CHECKED_VLLM, Kind, Located, Side, Touchpoint, Variant
from vllm_plugin.vllm_surface.rows_other import HF_SURFACE, STDLIB_SURFACE

__all__ = [
    "CHECKED_VLLM",
    "HF_SURFACE",
    "STDLIB_SURFACE",
    "SURFACE",
    "Kind",
    "Located",
    "Side",
    "Touchpoint",
    "Variant",
    "invalidation_drain",
    "load",
    "locate",
    "mm_fields_config",
    "mm_worker",
    "served_image_processor",
    "serving_tokens_keywords",
    "touchpoint",
    "vllm_version",
]

SURFACE: tuple[Touchpoint, ...] = (
    *_plugin.PLUGIN,
    *_other.PROTOCOL,
    *_other.SCRIPTS,
    *_other.BENCH,
    *_other.TESTS,
)
"""Every vLLM name the project relies on (scripts, bench and tests included)."""
