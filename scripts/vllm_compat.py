"""Static check of a vLLM source tree against the project's vLLM surface (``upstream/``).

Reads the source with :mod:`ast` only (never imports it), so it checks releases that cannot be
installed here (the CUDA-only wheels)::

    python scripts/vllm_compat.py                    # the installed vLLM's source
    python scripts/vllm_compat.py --vllm 0.33.0      # pip download --no-deps into .cache/vllm/
    python scripts/vllm_compat.py --source DIR|WHEEL # a source tree (holding vllm/) or a wheel
    python scripts/vllm_compat.py --vllm 0.33.0 --no-variants   # the 0.32 form, as the code is today

For every touchpoint of :data:`~upstream.SURFACE` it looks the name up at its module
path for the tree's version (the touchpoint's :class:`~upstream.Variant` for that
version, if any), following ``from X import Y`` re-exports, module-level assignments, class bases
and ``self.x = ...`` in methods, then checks that the callable takes the positional count and the
keywords the project passes (``**kwargs`` takes any keyword) and that nothing it requires is left out.

Each touchpoint gets one status:

- ``OK``: where the 0.32 form says, and the call fits.
- ``MOVED``: at a variant's path (passes), or found elsewhere only (fails: the table needs a variant).
- ``CHANGED``: the call fits only with a variant's keywords (passes), or does not fit (fails).
- ``MISSING``: found nowhere (fails).
- ``SKIP``: a row the project uses from a later release on only (``since``; passes).

Exit status 1 if any touchpoint fails, 2 if the source could not be had (no wheel, no network).

Modules: ``vllm_compat_source.py`` (the tree), ``vllm_compat_check.py`` (one touchpoint's check),
``vllm_compat_inventory.py`` (the generated part of docs/VLLM-SURFACE.md); this one gets a tree
(a release's wheel) and is the command line.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _path in (str(REPO), str(REPO / "scripts")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from vllm_compat_check import Result, check, check_touchpoint, format_report  # noqa: E402
from vllm_compat_inventory import INVENTORY_BEGIN, INVENTORY_END  # noqa: E402
from vllm_compat_inventory import generated_inventory as _generated_inventory  # noqa: E402
from vllm_compat_source import Found, SourceTree  # noqa: E402

from upstream import CHECKED_VLLM  # noqa: E402

__all__ = [
    "CACHE_DIR",
    "INVENTORY_BEGIN",
    "INVENTORY_END",
    "Found",
    "Result",
    "SourceTree",
    "check",
    "check_touchpoint",
    "format_report",
    "generated_inventory",
    "installed_source",
    "main",
    "report_title",
    "source_for_version",
    "source_from_wheel",
]

CACHE_DIR = REPO / ".cache" / "vllm"
"""Downloaded wheels (``wheels/``) and their extracted ``.py`` files (``src/<version>/``); gitignored."""


def generated_inventory(newer_version: str, *, download: bool = True) -> str:
    """The generated section of ``docs/VLLM-SURFACE.md``: the installed release and ``newer_version``.

    Raises:
        FileNotFoundError, RuntimeError: the newer release's source is not at hand.
    """
    installed = SourceTree(installed_source())
    newer = SourceTree(source_for_version(newer_version, download=download))
    return _generated_inventory(installed, newer, newer_version)


# --- getting a tree -------------------------------------------------------------------------------


def source_from_wheel(wheel: Path, dest: Path | None = None) -> Path:
    """Extract a wheel's ``vllm/**.py`` (only) into ``dest`` (default ``.cache/vllm/src/<wheel stem>``)."""
    dest = dest or CACHE_DIR / "src" / wheel.stem
    marker = dest / ".complete"
    if marker.is_file():
        return dest
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                zf.extract(name, dest)
    marker.write_text(wheel.name)
    return dest


def source_for_version(version: str, *, download: bool = True) -> Path:
    """The source of ``vllm==version``: its wheel from the cache or ``pip download --no-deps``.

    Raises:
        FileNotFoundError: not cached and ``download`` is False.
        RuntimeError: pip could not download it (no network, no such release).
    """
    wheels = CACHE_DIR / "wheels"
    found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    if not found:
        if not download:
            raise FileNotFoundError(f"no vllm-{version} wheel in {wheels}")
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
               "-d", str(wheels), f"vllm=={version}"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"pip download vllm=={version} failed: {proc.stderr.strip()[-500:]}")
    return source_from_wheel(found[-1])


def installed_source() -> Path:
    """The installed vLLM's source folder (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("vLLM is not installed")
    return Path(next(iter(spec.submodule_search_locations))).parent


def report_title(tree: SourceTree, version: str | None, *, variants: bool = True) -> str:
    """``vLLM <version> (<where the source is>; <form>)``: a repository path, or the installed package."""
    root = tree.root.resolve()
    where = str(root.relative_to(REPO)) if root.is_relative_to(REPO) else "the installed package"
    form = "with the table's variants" if variants else "0.32 form only"
    return f"vLLM {version or '?'} ({where}; {form})"


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module doc); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--vllm", metavar="VERSION", help="a released vLLM (pip download --no-deps, cached)")
    group.add_argument("--source", type=Path, help="a source tree holding vllm/, or a wheel")
    parser.add_argument("--no-variants", action="store_true", help="check the 0.32 form only")
    parser.add_argument("--failures-only", action="store_true", help="print only the failing rows")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the generated inventory of docs/VLLM-SURFACE.md (installed vLLM and --vllm, "
        f"default {CHECKED_VLLM[-1]})",
    )
    args = parser.parse_args(argv)
    if args.markdown:
        print(generated_inventory(args.vllm or CHECKED_VLLM[-1]))
        return 0
    if args.vllm:
        try:
            root = source_for_version(args.vllm)
        except RuntimeError as e:
            print(f"vllm_compat: {e}", file=sys.stderr)
            return 2
    elif args.source is not None and args.source.suffix == ".whl":
        root = source_from_wheel(args.source)
    else:
        root = args.source or installed_source()
    tree = SourceTree(root)
    version = tree.version() or args.vllm
    results = check(tree, version=version, variants=not args.no_variants)
    shown = [r for r in results if not r.ok] if args.failures_only else results
    print(format_report(shown, report_title(tree, version, variants=not args.no_variants)))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
