"""The package layout: every module's ``__all__`` exact, every package's modules import each other
without a circle, ``upstream/`` (the table of upstream names) is a leaf below the project, and no
library function is over 60 lines of code or 6 parameters (issue 45).

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

import integrations
import protocol
import rollout_client
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
LIBRARY = (upstream, protocol, vllm_plugin, trainer_lib, rollout_client, integrations)
"""The packages users import (bench/, scripts/ and tests/ are not held to the size limits)."""
MAX_PARAMETERS = 6
MAX_LINES = 60
IMPOSED_SIGNATURES = {
    "trainer_lib.attention._varlen_attention_forward": "transformers' AttentionInterface signature",
    "trainer_lib.logprob_head.forward": "torch.autograd.Function.forward: one argument per input",
    "protocol.adapters.kimi_vl.__init__": "an HF image processor's config fields (from_pretrained passes)",
    "integrations.trl.trainer.__init__": "TRL's GRPOTrainer.__init__, which the subclass accepts unchanged",
    "integrations.trl.trainer._get_per_token_logps_and_entropies": "the GRPOTrainer method it overrides",
    "integrations.verl.weights.__init__": "verl builds a checkpoint engine from its YAML engine_kwargs",
    "rollout_client.core.__init__": "an HTTP client's keyword settings, all defaulted (httpx.Client: 20)",
}
"""Functions whose parameters a library or a usual surface fixes (``module.function``), with the
reason (docs/DESIGN-DECISIONS.md, "Issue 45: the size limits")."""


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
    """The package's modules ``name`` imports anywhere in its file (function-level imports too; not
    those under ``if TYPE_CHECKING:``, which never run)."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in found & known if m != name}


@pytest.mark.parametrize("package", LIBRARY, ids=lambda p: p.__name__)
def test_package_imports_no_circle(package):
    """No module imports, even lazily inside a function, a module that imports it back (directly or
    through others). The package's ``__init__.py`` (the re-exports) is left out: every module is
    below it; so is ``vllm_plugin.plugin``, the entry point vLLM loads, which imports the modules it
    wires and is imported by none of them."""
    files = package_modules(package)
    known = set(files) - {package.__name__, "vllm_plugin.plugin"}
    graph = {name: _imports(name, files[name], known) for name in known}
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as e:
        raise AssertionError(f"import circle in {package.__name__}: {' -> '.join(e.args[1])}") from None
    assert set(order) == known


def _functions(package) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method of ``package``'s modules as ``(module.name, node)``."""
    found = []
    for module, path in package_modules(package).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((f"{module}.{node.name}", node))
    return found


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters a caller can pass (``self``/``cls`` not counted; ``*args``/``**kwargs`` one each)."""
    a = node.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
    return len(names) - (1 if names and names[0].arg in ("self", "cls") else 0)


def _lines_of_code(node: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> int:
    """Non-blank, non-comment lines of the body, the docstring left out."""
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if not body:
        return 0
    lines = source[body[0].lineno - 1 : node.end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def _numba_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


@pytest.mark.parametrize("package", LIBRARY, ids=lambda p: p.__name__)
def test_no_function_over_the_size_limits(package):
    """At most 60 lines of code and 6 parameters per library function; numba kernels (their arrays
    travel as one NamedTuple, but scalars stay separate) and :data:`IMPOSED_SIGNATURES` excepted."""
    too_many, too_long = [], []
    for name, node in _functions(package):
        source = Path(importlib.import_module(name.rsplit(".", 1)[0]).__file__).read_text().splitlines()
        if _parameters(node) > MAX_PARAMETERS and not _numba_kernel(node) and name not in IMPOSED_SIGNATURES:
            too_many.append(f"{name} ({_parameters(node)})")
        if _lines_of_code(node, source) > MAX_LINES:
            too_long.append(f"{name} ({_lines_of_code(node, source)} lines)")
    assert too_many == [], f"over {MAX_PARAMETERS} parameters: {too_many}"
    assert too_long == [], f"over {MAX_LINES} lines of code: {too_long}"


def test_every_imposed_signature_exists():
    names = {name for package in LIBRARY for name, _ in _functions(package)}
    assert set(IMPOSED_SIGNATURES) <= names, set(IMPOSED_SIGNATURES) - names


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
