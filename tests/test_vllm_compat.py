"""The compatibility check (``scripts/vllm_compat.py``, ``ast`` only): the door's table against the
installed vLLM's source and the newest release's, read from its wheel without installing it.

The newest release's wheel is fetched with ``pip download vllm==<newest> --no-deps`` into the
gitignored ``.cache/vllm/`` (only its ``*.py`` files are extracted) on the first run. A failed
download FAILS these tests: CI must not pass without checking the newest release. Set
``MMREF_OFFLINE=1`` to skip them where there is no network (README: running the tests).
Run with ``-s`` to see the checker's table for both releases."""

from __future__ import annotations

import os

import pytest
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
from upstream import CHECKED_VLLM, SURFACE, vllm_version

NEWEST = CHECKED_VLLM[-1]


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
