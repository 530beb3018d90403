"""TTL sweep of the feature store: removes expired ``mm_features`` files, never images (docs/PROTOCOL.md).

Feature files are regenerable; images are the source of truth and are never touched. Removal is
``os.unlink`` of whole files, so a reader that already opened a file keeps reading it; a reader
that arrives later gets ``AssetNotFound`` (404 ``asset_not_found`` on the server) and the client
re-sends the item or an ``mmraw`` ref. Folders are kept: a writer may be about to use them.
Writers refresh the mtime of an existing file (idempotent writes), so a file in use stays fresh.
A writer's temp file (``.tmp-*``) is removed only once it is older than :data:`TEMP_GRACE_S` (and
the TTL): a sweep with ``--ttl 0`` never pulls one from under a write in progress.

CLI: ``.venv/bin/python -m protocol.sweep [OUTPUT_OR_ASSET_ROOT] [--ttl 1800] [--dry-run]`` (the
root defaults to ``MMREF_ASSET_ROOT``, read as the server reads it; unknown ``MMREF_*`` variables
are warned about, a bad value stops it with one line: :mod:`protocol.settings`).
"""

from __future__ import annotations

import argparse
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from protocol.features import FEATURES_SUBDIR
from protocol.store import TEMP_PREFIX

__all__ = ["DEFAULT_TTL_S", "TEMP_GRACE_S", "SweepReport", "sweep_features"]

DEFAULT_TTL_S = 1800.0
"""Seconds since a feature file's last write (or refresh) after which it expires."""
TEMP_GRACE_S = 600.0
"""A writer's temp file younger than this is being written: never removed, whatever the TTL."""


@dataclass
class SweepReport:
    """What one :func:`sweep_features` call found and removed (or would remove, with ``dry_run``)."""

    scanned: int = 0
    """Feature files and temp files looked at."""
    removed: int = 0
    removed_bytes: int = 0
    kept: int = 0
    """Files still fresh, or not regular files (a symlink is never followed nor removed)."""
    removed_paths: list[Path] = field(default_factory=list)


def _feature_roots(root: Path) -> list[Path]:
    """Every ``<assets>/mm_features/v1/vllm-mmitem`` under ``root`` (an asset root or an output root).

    A base is kept only when each step below ``root`` (``run_X``, ``assets``, ``mm_features``,
    ``v1``, ``vllm-mmitem``) is a real folder, not a symlink: a writer of the store who plants
    ``vllm-mmitem -> /elsewhere`` or ``run_X -> /elsewhere`` gets nothing outside swept.
    """
    if _real_dirs(root, FEATURES_SUBDIR):
        return [root / FEATURES_SUBDIR]
    try:
        with os.scandir(root) as entries:
            names = sorted(e.name for e in entries if e.name.startswith("run_"))
    except OSError:  # not a folder, unreadable
        return []
    rels = [Path(name) / "assets" / FEATURES_SUBDIR for name in names]
    return [root / rel for rel in rels if _real_dirs(root, rel)]


def _real_dirs(root: Path, rel: Path) -> bool:
    """Whether every path from ``root / rel.parts[0]`` down to ``root / rel`` is a folder and none
    is a symlink (``lstat`` of each step; ``root`` itself, the operator's argument, may be one)."""
    path = root
    for part in rel.parts:
        path = path / part
        try:
            st = path.lstat()
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode):  # a symlink's lstat is S_ISLNK, never S_ISDIR
            return False
    return True


def sweep_features(
    root: str | os.PathLike[str],
    *,
    ttl_s: float = DEFAULT_TTL_S,
    now: float | None = None,
    dry_run: bool = False,
) -> SweepReport:
    """Remove feature files (and abandoned temp files) whose mtime is older than ``ttl_s``.

    Args:
        root: an asset root (``run_X/assets``) or an output root holding ``run_*/assets``.
        ttl_s: seconds since last write/refresh after which a file expires.
        now: the current time (``time.time()``), for tests.
        dry_run: report what would be removed without removing it.

    Never follows symlinks and never looks outside ``mm_features/v1/vllm-mmitem``. A temp file
    is removed only when older than ``max(ttl_s, TEMP_GRACE_S)``.

    Raises:
        ValueError: a negative ``ttl_s``.
    """
    if ttl_s < 0:
        raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
    now = time.time() if now is None else now
    report = SweepReport()
    for base in _feature_roots(Path(root)):
        for dirpath, _dirnames, filenames in os.walk(base, followlinks=False):
            for name in filenames:
                path = Path(dirpath) / name
                temp = name.startswith(TEMP_PREFIX)
                if not (temp or name.endswith(".msgpack")):
                    continue
                try:
                    st = path.lstat()
                except FileNotFoundError:
                    continue
                report.scanned += 1
                # lstat: a symlink (or anything but a regular file) is kept, never followed
                expiry = max(ttl_s, TEMP_GRACE_S) if temp else ttl_s
                if now - st.st_mtime <= expiry or not stat.S_ISREG(st.st_mode):
                    report.kept += 1
                    continue
                if not dry_run:
                    try:
                        path.unlink()
                    except FileNotFoundError:
                        continue
                report.removed += 1
                report.removed_bytes += st.st_size
                report.removed_paths.append(path)
    return report


def main(argv: list[str] | None = None) -> None:
    import logging

    from protocol.settings import RootSettings, SettingError, warn_unknown_variables

    parser = argparse.ArgumentParser(description="Remove expired mm_features files (never images).")
    parser.add_argument(
        "root", type=Path, nargs="?", help="an asset root or an output root holding run_*/assets "
        "(default: MMREF_ASSET_ROOT)"
    )  # fmt: skip
    parser.add_argument("--ttl", type=float, default=DEFAULT_TTL_S, help="seconds (default 1800)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")
    warn_unknown_variables()
    root = args.root
    if root is None:
        try:
            root = RootSettings().asset_root
        except SettingError as e:
            parser.error(str(e))
        if root is None:
            parser.error("no root given and MMREF_ASSET_ROOT is unset (MMREF_ASSET_ROOTS are not swept)")
    report = sweep_features(root, ttl_s=args.ttl, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    print(
        f"scanned {report.scanned} feature files; {verb} {report.removed} "
        f"({report.removed_bytes} bytes); kept {report.kept}"
    )


if __name__ == "__main__":
    main()
