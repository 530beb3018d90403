"""The package layout: trainer_lib's modules import each other without a circle."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import trainer_lib


def _module_files(package) -> dict[str, Path]:
    """Module name -> file, subpackages included (a package under its own name)."""
    root = Path(package.__file__).resolve().parent
    out = {}
    for path in root.rglob("*.py"):
        parts = (package.__name__, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


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
    files = _module_files(trainer_lib)
    known = set(files) - {"trainer_lib"}
    graph = {name: _imports(name, files[name], known) for name in known}
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as e:
        raise AssertionError(f"import circle in trainer_lib: {' -> '.join(e.args[1])}") from None
    assert set(order) == known
