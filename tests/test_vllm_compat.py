"""The upstream table against vLLM's releases: every row imported from the installed vLLM, the
project's call shapes bound to its signatures (a failure names the row); and the compatibility
check (``scripts/vllm_compat.py``, ``ast`` only) of the table against the installed vLLM's source
and the newest release's, read from its wheel without installing it.

The newest release's wheel is fetched with ``pip download vllm==<newest> --no-deps`` into the
gitignored ``.cache/vllm/`` (only its ``*.py`` files are extracted) on the first run. A failed
download FAILS these tests: CI must not pass without checking the newest release. Set
``MMREF_OFFLINE=1`` to skip them where there is no network (README: running the tests).
Run with ``-s`` to see the checker's table for both releases."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from vllm_compat import (
    INVENTORY_BEGIN,
    INVENTORY_END,
    Result,
    SourceTree,
    check,
    format_report,
    generated_inventory,
    installed_source,
    report_title,
    source_for_version,
)

from helpers import REPO
from upstream import CHECKED_VLLM, HF_SURFACE, STDLIB_SURFACE, SURFACE, Touchpoint, vllm_version
from vllm_plugin.preflight import SUPPORTED_VLLM

NEWEST = CHECKED_VLLM[-1]
ALL = (*SURFACE, *HF_SURFACE, *STDLIB_SURFACE)


@pytest.fixture(scope="module")
def installed_tree() -> SourceTree:
    return SourceTree(installed_source())


@pytest.fixture(scope="module")
def newest_tree() -> SourceTree:
    try:
        root = source_for_version(NEWEST)
    except (RuntimeError, OSError) as e:
        if os.environ.get("MMREF_OFFLINE") == "1":
            pytest.skip(f"MMREF_OFFLINE=1 and vllm=={NEWEST} is not in .cache/vllm/wheels: {e}")
        pytest.fail(f"vllm=={NEWEST} wheel could not be had (set MMREF_OFFLINE=1 to skip offline): {e}")
    return SourceTree(root)


@pytest.fixture(scope="module")
def installed_results(installed_tree) -> list[Result]:
    return check(installed_tree)


@pytest.fixture(scope="module")
def newest_results(newest_tree) -> list[Result]:
    return check(newest_tree)


def _failures(results: list[Result]) -> list[str]:
    return [f"{r.status} {r.touchpoint.key}: {r.detail}" for r in results if not r.ok]


def test_installed_release_passes_the_static_check(installed_tree, installed_results):
    assert installed_tree.version() == vllm_version()
    results = installed_results
    assert not _failures(results)
    # no variant applies to the installed release; rows of later releases only are skipped
    assert {r.status for r in results} == {"OK", "SKIP"}
    assert {r.touchpoint.key for r in results if r.status == "SKIP"} == {
        tp.key for tp in SURFACE if not tp.exists_in(vllm_version())
    }


def test_newest_release_passes_with_the_tables_variants(newest_tree, newest_results):
    assert newest_tree.version() == NEWEST
    results = newest_results
    assert not _failures(results)
    assert "SKIP" not in {r.status for r in results}


def test_the_checkers_table_for_both_releases(installed_tree, installed_results, newest_tree, newest_results):
    """What the check prints for each release (``pytest -s`` shows it; docs/VLLM-SURFACE.md
    quotes it)."""
    for tree, results in ((installed_tree, installed_results), (newest_tree, newest_results)):
        report = format_report(results, report_title(tree, tree.version()))
        print("\n" + report)
        assert report.endswith("; 0 failures")


def test_a_variant_exists_exactly_for_each_break_of_the_newest_release(newest_tree):
    """Without the variants (the 0.32 form, as unrouted code meets it) exactly the touchpoints
    that have a variant fail: none is stale, none is missing."""
    broken = {r.touchpoint.key for r in check(newest_tree, variants=False) if not r.ok}
    with_variant = {tp.key for tp in SURFACE if tp.variant_for(NEWEST) is not None}
    assert broken == with_variant


def test_the_tables_upstream_files_are_where_the_names_are_defined(installed_results, newest_results):
    """Each row's ``upstream`` is its file in 0.32 (in the first release that has it, for a
    later release's row)."""
    newest = {r.touchpoint.key: r for r in newest_results}
    for r in installed_results:
        defined_in = newest[r.touchpoint.key].defined_in if r.status == "SKIP" else r.defined_in
        assert defined_in.split(":")[0] == r.touchpoint.upstream, r.touchpoint.key


def test_the_inventory_doc_is_generated_from_the_table(newest_tree):
    text = (REPO / "docs" / "VLLM-SURFACE.md").read_text()
    start, end = text.index(INVENTORY_BEGIN), text.index(INVENTORY_END) + len(INVENTORY_END)
    assert text[start:end] == generated_inventory(NEWEST, download=False), (
        "docs/VLLM-SURFACE.md is stale: python scripts/vllm_compat.py --markdown"
    )


def test_the_declared_range_is_exactly_the_checked_minor_releases():
    supported = SpecifierSet(SUPPORTED_VLLM)
    minors = sorted({Version(v).release[:2] for v in CHECKED_VLLM})
    for major, minor in minors:
        assert supported.contains(f"{major}.{minor}.0") and supported.contains(f"{major}.{minor}.99")
    below = (minors[0][0], minors[0][1] - 1)
    above = (minors[-1][0], minors[-1][1] + 1)
    assert not supported.contains(f"{below[0]}.{below[1]}.99"), "range reaches below the checked releases"
    assert not supported.contains(f"{above[0]}.{above[1]}.0"), "range reaches above the checked releases"
    assert [(a, b + 1) for a, b in minors[:-1]] == minors[1:], "a minor release in the range is unchecked"


# --- the installed vLLM, imported ------------------------------------------------------------------


def _runtime_problems(tp: Touchpoint) -> list[str]:
    """Import ``tp`` from the installed release and bind the project's call shape to its signature."""
    version = vllm_version() if tp.package == "vllm" else None
    where = tp.at(version)
    module = importlib.import_module(where.module)
    if tp.kind == "module":
        return []
    parts = where.qualname.split(".")
    if tp.kind == "assigned":
        func = getattr(module, parts[0])
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        ok = any(
            isinstance(t, ast.Attribute) and t.attr == tp.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign)
            for t in n.targets
        )
        return [] if ok else [f"{where.qualname} assigns no .{tp.attr}"]
    owner: Any = module
    for part in parts[:-1]:
        owner = getattr(owner, part)
    name = parts[-1]
    if tp.kind == "attribute" and isinstance(owner, type):
        return [] if _class_has(owner, name) else [f"{owner.__name__} has no attribute {name!r}"]
    if not hasattr(owner, name):
        return [f"{where.module} has no {where.qualname}"]
    if tp.positional is None and not where.keywords:
        return []
    return _binding_problems(tp, where.keywords, owner, name)


def _binding_problems(tp: Touchpoint, keywords: tuple[str, ...], owner: Any, name: str) -> list[str]:
    call, drop_self = _callable(owner, name)
    sig = inspect.signature(call)
    params = list(sig.parameters.values())[1 if drop_self else 0 :]
    problems = []
    for i, want in enumerate(tp.positional_names):
        if i >= len(params) or params[i].name != want:
            problems.append(f"positional {i} is not {want!r}: {sig}")
    for kw in tp.named:
        param = sig.parameters.get(kw)
        if param is None or param.kind is param.VAR_KEYWORD:
            problems.append(f"{kw!r} is not a named parameter: {sig}")
    args = [None] * ((tp.positional or 0) + (1 if drop_self else 0))
    try:
        sig.bind(*args, **dict.fromkeys(keywords))
    except TypeError as e:
        problems.append(f"the project's call does not bind to {sig}: {e}")
    return problems


def _callable(owner: Any, name: str) -> tuple[Callable[..., Any], bool]:
    """What a call of ``owner.name`` runs, and whether its first parameter is ``self``."""
    if not isinstance(owner, type):
        return getattr(owner, name), False
    raw = inspect.getattr_static(owner, name)
    if isinstance(raw, staticmethod):
        return raw.__func__, False
    if isinstance(raw, classmethod) or (name != "__init__" and isinstance(raw, type)):
        return getattr(owner, name), False
    if name == "__init__":
        return owner.__init__, True
    return raw, True


def _class_has(cls: type, name: str) -> bool:
    """A class attribute, a (dataclass, pydantic) field, or a ``self.name = ...`` in a method."""
    if hasattr(cls, name):
        return True
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}) or name in getattr(klass, "model_fields", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{re.escape(name)}\s*(:[^=]+)?=", source):
            return True
    return False


@pytest.mark.parametrize("tp", ALL, ids=[tp.key for tp in ALL])
def test_each_name_imports_from_the_installed_release(tp):
    if tp.package == "vllm" and not tp.exists_in(vllm_version()):  # a later release's name: absent here
        assert _runtime_problems(tp), f"{tp.key} exists in vLLM {vllm_version()}: its `since` is wrong"
        return
    problems = _runtime_problems(tp)
    assert not problems, f"{tp.key} ({tp.module}:{tp.qualname}): " + "; ".join(problems)


@pytest.mark.parametrize(
    "tp",
    [tp for tp in (*HF_SURFACE, *STDLIB_SURFACE) if tp.kind in ("class", "function", "method")],
    ids=lambda tp: tp.key,
)
def test_transformers_names_are_defined_where_the_table_says(tp):
    """(vLLM's: by the static check above, which also sees constants and attributes.)"""
    obj: Any = importlib.import_module(tp.module)
    for part in tp.qualname.split("."):
        obj = getattr(obj, part)
    path = Path(inspect.getsourcefile(inspect.unwrap(obj)) or "")
    assert path.as_posix().endswith("/" + tp.upstream), f"{tp.key}: defined in {path}"
