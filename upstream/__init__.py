"""The upstream table and its door, below the whole project: every vLLM (and transformers-internal,
and private standard-library) name the project relies on is a row of one table, and every module
outside this package reaches vLLM only through it.

A leaf: it imports nothing of the project (``protocol/``, ``trainer_lib/``, ``vllm_plugin/``,
``bench/`` and ``scripts/`` all import it; ``tests/test_layout.py`` checks), and nothing from vLLM
(or transformers) at import time.

- **The table** (:data:`SURFACE`, :data:`HF_SURFACE`, :data:`STDLIB_SURFACE`): one
  :class:`Touchpoint` per name (a module, class, function, method, attribute or module constant)
  at the module path of vLLM 0.32, with how the project uses it (the positional arguments and
  keyword names it passes), whether it is private (and why no public name serves), the upstream
  file that defines it, and the files that use it; a :class:`Variant` gives its form from a later
  release on, ``since`` the releases a name exists in. Rows: ``rows_plugin.py`` (``vllm_plugin/``),
  ``rows_other.py`` (``protocol/``, scripts, bench, tests; stdlib), ``rows_hf.py`` (transformers).
- **The door** (``door.py``): code outside this package imports vLLM only through :func:`load` (a
  row's name, in the installed release's form) and the functions for what is reached other than
  by import: the private names (:func:`mm_fields_config`, :func:`mm_worker`,
  :func:`invalidation_drain`, :func:`video_source`), the reads that differ by model
  (:func:`served_image_processor`, :func:`served_video_processor`) and the version-keyed
  branches (:func:`invalidation_drain`, :func:`serving_tokens_keywords`, :func:`locate`). No
  other module of the library, bench or scripts spells a vLLM import or tests a vLLM version
  (``tests/test_vllm_surface.py``).

Checked two ways: ``tests/test_vllm_compat.py`` imports every name from the installed vLLM and
binds the project's call shapes to its signatures; ``scripts/vllm_compat.py`` checks the same
table statically (``ast`` only) against any vLLM source tree or wheel, e.g. the newest release,
which cannot be installed here (docs/VLLM-SURFACE.md).
"""

from __future__ import annotations

from upstream import rows_other as _other
from upstream import rows_plugin as _plugin
from upstream.door import (
    invalidation_drain,
    load,
    locate,
    mm_fields_config,
    mm_worker,
    served_image_processor,
    served_video_processor,
    serving_tokens_keywords,
    touchpoint,
    video_source,
    vllm_version,
)
from upstream.model import CHECKED_VLLM, Kind, Located, Side, Touchpoint, Variant
from upstream.rows_hf import HF_SURFACE
from upstream.rows_other import STDLIB_SURFACE

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
    "served_video_processor",
    "serving_tokens_keywords",
    "touchpoint",
    "video_source",
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
