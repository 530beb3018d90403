"""The package layout as data: a package's modules and the public names a module binds
(``tests/test_layout.py``)."""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

__all__ = ["package_modules", "public_top_level_names"]


def package_modules(package: types.ModuleType) -> dict[str, Path]:
    """Every module of ``package`` (subpackages included, ``protocol.adapters.base``...) -> its file;
    a package under its own name, its file ``__init__.py``."""
    root = Path(package.__file__).resolve().parent
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (package.__name__, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return dict(sorted(out.items()))


def public_top_level_names(module_name: str) -> set[str]:
    """Public names a module binds at top level: defs, classes, assignments; in a package's
    ``__init__`` also what it imports from its own modules (re-exports).

    Read from the source so imported helpers (``re``, ``Path``...) do not count, but constants do.
    """
    module = importlib.import_module(module_name)
    path = Path(module.__file__)
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom) and is_package:
            own = node.level > 0 or (node.module or "").startswith(module_name + ".")
            names.update((a.asname or a.name) for a in node.names if own)
    names.discard("main")  # a module's CLI entry point (``python -m protocol.sweep``) is not API
    names.discard("logger")  # a module's logger is not API
    return {n for n in names if not n.startswith("_")}
