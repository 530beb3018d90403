"""The package layout: every module's ``__all__`` exact, trainer_lib's modules import each other
without a circle, and ``upstream/`` (the table of upstream names) is a leaf below the project.

The ``__all__`` checks cover every module and subpackage of ``upstream/``, ``protocol/``,
``vllm_plugin/`` and ``trainer_lib/``, in the spirit of httpx ``tests/test_exported_members.py``:
every exported name exists, and every public name a module binds at top level is exported (a
package re-exports what it imports from its own modules). The order is ruff's (RUF022, run by
``scripts/test.sh``).
"""

from __future__ import annotations

import ast
import importlib
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

import protocol
import trainer_lib
import upstream
import vllm_plugin
from helpers import REPO, package_modules, public_top_level_names

EXPORTING_MODULES = [
    name for package in (upstream, protocol, vllm_plugin, trainer_lib) for name in package_modules(package)
]
PROJECT = (
    *("protocol", "vllm_plugin", "trainer_lib", "rollout_client", "integrations"),
    *("bench", "scripts", "tests"),
)
"""The project's other top-level folders (and the modules bench, scripts and tests import by name)."""


def test_module_lists_are_the_expected_ones():
    assert {
        "upstream",
        "upstream.door",
        "upstream.model",
        "upstream.rows_hf",
        "upstream.rows_other",
        "upstream.rows_plugin",
        "protocol",
        "protocol.errors",
        "protocol.refs",
        "protocol.structs",
        "protocol.store",
        "protocol.images",
        "protocol.adapters",
        "protocol.adapters.base",
        "protocol.adapters.qwen_vl",
        "protocol.adapters.registry",
        "vllm_plugin",
        "vllm_plugin.api_router",
        "vllm_plugin.plugin",
        "vllm_plugin.protocol",
        "vllm_plugin.resolver",
        "vllm_plugin.serving",
        "trainer_lib",
        "trainer_lib.materialize",
        "trainer_lib.forward",
        "trainer_lib.planning",
        "trainer_lib.planning.plan",
        "trainer_lib.planning.partition",
    } <= set(EXPORTING_MODULES)


@pytest.mark.parametrize("module_name", EXPORTING_MODULES)
def test_dunder_all_names_exist(module_name):
    module = importlib.import_module(module_name)
    exported = module.__all__
    assert isinstance(exported, list) and len(exported) == len(set(exported)), "duplicates in __all__"
    assert [name for name in exported if not hasattr(module, name)] == []


@pytest.mark.parametrize("module_name", EXPORTING_MODULES)
def test_dunder_all_is_complete(module_name):
    module = importlib.import_module(module_name)
    unexported = sorted(public_top_level_names(module_name) - set(module.__all__) - {"__all__"})
    assert unexported == [], (
        f"{module_name} binds public names {unexported} missing from __all__ (export them or rename with '_')"
    )


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in found & known if m != name}


def test_trainer_lib_imports_no_circle():
    """No module imports, even lazily inside a function, a module that imports it back (directly or
    through others). ``trainer_lib/__init__.py`` (the re-exports) is left out: every module is
    below it."""
    files = package_modules(trainer_lib)
    known = set(files) - {"trainer_lib"}
    graph = {name: _imports(name, files[name], known) for name in known}
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as e:
        raise AssertionError(f"import circle in trainer_lib: {' -> '.join(e.args[1])}") from None
    assert set(order) == known


def test_upstream_is_a_leaf():
    """``upstream/`` imports nothing of the project, even lazily inside a function: everyone may
    import it (the table and its door sit below ``protocol/``, ``trainer_lib/`` and the plugin)."""
    local = {p.stem for folder in ("bench", "scripts") for p in (REPO / folder).rglob("*.py")}
    found = {}
    for name, path in package_modules(upstream).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [(node.module or "").split(".")[0]] if not node.level else ["<relative>"]
            else:
                continue
            bad = [r for r in roots if r in PROJECT or r in local or r in ("helpers", "<relative>")]
            if bad:
                found.setdefault(name, []).extend(f"{r} (line {node.lineno})" for r in bad)
    assert found == {}, found
