"""The vLLM source tree the compatibility check reads (``scripts/vllm_compat.py``): modules parsed
with :mod:`ast` on demand, never imported; names looked up through re-exports, module-level
assignments, ``TYPE_CHECKING`` blocks, class bases and ``self.x = ...`` in methods."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EXTERNAL_FIELD_BASES", "Found", "SourceTree", "decorators", "dotted_name"]

_FuncDef = ast.FunctionDef | ast.AsyncFunctionDef
EXTERNAL_FIELD_BASES = frozenset({"BaseModel", "OpenAIBaseModel", "Struct"})
"""External bases whose subclasses take their annotated fields as keywords."""


@dataclass(frozen=True)
class Found:
    """A name found in the tree: the module it is defined in and its node."""

    module: str
    node: ast.AST | None
    """ClassDef, FunctionDef, an assignment, or None for a module."""
    owner: ast.ClassDef | None = None
    """The class a member was found in (methods drop ``self``)."""
    external_bases: tuple[str, ...] = ()
    """Bases outside the tree the lookup could not follow."""

    @property
    def kind(self) -> str:
        if self.node is None:
            return "module"
        if isinstance(self.node, ast.ClassDef):
            return "class"
        if isinstance(self.node, _FuncDef):
            return "method" if self.owner is not None else "function"
        return "attribute"


class SourceTree:
    """A vLLM source tree: ``root/vllm/...py``, parsed on demand (never imported).

    Args:
        root: the folder holding the ``vllm`` package (or the package folder itself).
    """

    def __init__(self, root: Path) -> None:
        root = Path(root)
        if (root / "__init__.py").is_file() and root.name == "vllm":
            root = root.parent
        if not (root / "vllm" / "__init__.py").is_file():
            raise FileNotFoundError(f"{root} holds no vllm/__init__.py")
        self.root = root
        self._modules: dict[str, ast.Module | None] = {}
        self._defining: dict[str, list[str]] = {}

    def version(self) -> str | None:
        """``__version__`` from ``vllm/_version.py`` (written at build time), or None."""
        path = self.root / "vllm" / "_version.py"
        if not path.is_file():
            return None
        match = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", path.read_text())
        return match.group(1) if match else None

    def module_file(self, module: str) -> Path | None:
        """The file of a ``vllm`` module (other packages are outside the tree, even when installed
        beside it: the installed tree and a wheel's give the same answers)."""
        if module != "vllm" and not module.startswith("vllm."):
            return None
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def relpath(self, module: str) -> str:
        path = self.module_file(module)
        return str(path.relative_to(self.root)) if path else module

    def parse(self, module: str) -> ast.Module | None:
        if module not in self._modules:
            path = self.module_file(module)
            self._modules[module] = ast.parse(path.read_text(), str(path)) if path else None
        return self._modules[module]

    # --- lookups --------------------------------------------------------------------------------

    def lookup(self, module: str, qualname: str) -> Found | None:
        """``module:qualname`` (``Class.member`` paths included), or None."""
        if self.parse(module) is None:
            return None
        if not qualname:
            return Found(module, None)
        head, *rest = qualname.split(".")
        found = self._binding(module, head, set())
        for part in rest:
            if found is None:
                return None
            found = self._member(found, part)
        return found

    def _binding(self, module: str, name: str, seen: set[tuple[str, str]]) -> Found | None:
        """A module-level name: a def or class, an import (followed), or an assignment."""
        if (module, name) in seen:
            return None
        seen.add((module, name))
        tree = self.parse(module)
        if tree is None:
            return None
        value: Found | None = None
        for node in _module_level(tree.body):
            if isinstance(node, ast.ClassDef | _FuncDef) and node.name == name:
                if not _is_overload(node):
                    return Found(module, node)
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, node, self.module_file(module))
                for alias in node.names:
                    if alias.name == "*":
                        found = self._binding(source, name, seen)
                        if found is not None:
                            return found
                    elif (alias.asname or alias.name) == name:
                        if self.module_file(f"{source}.{alias.name}"):
                            return Found(f"{source}.{alias.name}", None)
                        found = self._binding(source, alias.name, seen)
                        if found is not None:
                            return found
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name and self.module_file(alias.name):
                        return Found(alias.name, None)
            elif value is None and name in _assigned_names(node):
                value = Found(module, node)
        if value is not None:
            return value
        if self.module_file(f"{module}.{name}"):  # a submodule
            return Found(f"{module}.{name}", None)
        return self._lazy_attr(module, tree, name, seen)

    def _lazy_attr(
        self, module: str, tree: ast.Module, name: str, seen: set[tuple[str, str]]
    ) -> Found | None:
        """``__getattr__`` re-exports through a ``{"name": "module:attr"}`` table (``vllm/__init__.py``)."""
        for node in ast.walk(tree):
            if not isinstance(node, ast.Dict):
                continue
            for key, val in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == name
                    and isinstance(val, ast.Constant)
                    and isinstance(val.value, str)
                    and ":" in val.value
                ):
                    target, attr = val.value.split(":", 1)
                    return self._binding(target, attr, seen)
        return None

    def _member(self, found: Found, name: str) -> Found | None:
        """An attribute of a class (its MRO within the tree), or of a module."""
        if found.node is None:
            return self._binding(found.module, name, set())
        if not isinstance(found.node, ast.ClassDef):
            return None
        return self._class_member(found.module, found.node, name, set())

    def _class_member(self, module: str, cls: ast.ClassDef, name: str, seen: set[int]) -> Found | None:
        if id(cls) in seen:
            return None
        seen.add(id(cls))
        direct = _direct_member(cls, name)
        if direct is not None:
            return Found(module, direct, owner=cls)
        external: list[str] = []
        for base_module, base in self._bases(module, cls, external):
            found = self._class_member(base_module, base, name, seen)
            if found is not None:
                return found
        # not found in the tree: perhaps in an external base (not for pydantic or msgspec bases,
        # whose members the tree declares as annotated fields)
        opaque = [e for e in external if e.rsplit(".", 1)[-1] not in EXTERNAL_FIELD_BASES]
        return Found(module, None, owner=cls, external_bases=tuple(opaque)) if opaque else None

    def _bases(
        self, module: str, cls: ast.ClassDef, external: list[str]
    ) -> Iterator[tuple[str, ast.ClassDef]]:
        for base in cls.bases:
            expr = base.value if isinstance(base, ast.Subscript) else base
            dotted = dotted_name(expr)
            if dotted is None or dotted in ("object", "Generic", "Protocol", "ABC"):
                continue
            head, *rest = dotted.split(".")
            found = self._binding(module, head, set())
            for part in rest:
                found = self._member(found, part) if found is not None else None
            if found is not None and isinstance(found.node, ast.ClassDef):
                yield found.module, found.node
            else:
                external.append(dotted)

    def fields(self, module: str, cls: ast.ClassDef) -> tuple[dict[str, bool], list[str], bool]:
        """Annotated fields over the class's MRO in the tree (``{name: required}``), the external
        bases met, and whether a class of the MRO is a dataclass (``@dataclass``, vLLM's ``@config``)."""
        out: dict[str, bool] = {}
        external: list[str] = []
        decorated = False
        chain: list[tuple[str, ast.ClassDef]] = [(module, cls)]
        seen: set[int] = set()
        while chain:
            mod, node = chain.pop(0)
            if id(node) in seen:
                continue
            seen.add(id(node))
            decorated = decorated or bool(decorators(node) & {"dataclass", "config"})
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    if _is_classvar(stmt.annotation) or stmt.target.id in out:
                        continue
                    if _init_false(stmt.value):
                        continue
                    out[stmt.target.id] = _required(stmt.value)
            chain.extend(self._bases(mod, node, external))
        return out, external, decorated

    def modules_defining(self, name: str) -> list[str]:
        """Modules of the tree with a top-level class, def or assignment ``name`` (a text search
        first, then a parse of the files that match)."""
        if name not in self._defining:
            pattern = re.compile(
                rf"^(?:(?:async\s+)?def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", re.MULTILINE
            )
            found = []
            for path in sorted((self.root / "vllm").rglob("*.py")):
                if not pattern.search(path.read_text(errors="replace")):
                    continue
                module = ".".join(path.relative_to(self.root).with_suffix("").parts).removesuffix(".__init__")
                tree = self.parse(module)
                if tree is not None and any(
                    (isinstance(n, ast.ClassDef | _FuncDef) and n.name == name) or name in _assigned_names(n)
                    for n in tree.body
                ):
                    found.append(module)
            self._defining[name] = found
        return self._defining[name]


def _module_level(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements at module level, descending into ``if``/``try``/``with`` blocks."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _module_level(node.body)
            for handler in node.handlers:
                yield from _module_level(handler.body)
            yield from _module_level(node.orelse)
            yield from _module_level(node.finalbody)
        elif isinstance(node, ast.With):
            yield from _module_level(node.body)


def _assigned_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _absolute(module: str, node: ast.ImportFrom, path: Path | None) -> str:
    if not node.level:
        return node.module or ""
    package = module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def dotted_name(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        inner = dotted_name(expr.value)
        return f"{inner}.{expr.attr}" if inner else None
    return None


def decorators(node: ast.AST) -> set[str]:
    names = set()
    for dec in getattr(node, "decorator_list", ()):
        target = dec.func if isinstance(dec, ast.Call) else dec
        dotted = dotted_name(target)
        if dotted:
            names.add(dotted.rsplit(".", 1)[-1])
    return names


def _is_overload(node: ast.AST) -> bool:
    return "overload" in decorators(node)


def _direct_member(cls: ast.ClassDef, name: str) -> ast.AST | None:
    """A member defined by the class itself: def (last non-overload), class field or ``self.name``."""
    member: ast.AST | None = None
    for stmt in cls.body:
        if isinstance(stmt, _FuncDef | ast.ClassDef) and stmt.name == name and not _is_overload(stmt):
            member = stmt
        elif member is None and name in _assigned_names(stmt):
            member = stmt
    if member is not None:
        return member
    for stmt in cls.body:
        if isinstance(stmt, _FuncDef):
            for node in ast.walk(stmt):
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [node.target]
                    if isinstance(node, ast.AnnAssign | ast.AugAssign)
                    else []
                )
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and target.attr == name
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        return node
    return None


def _is_classvar(annotation: ast.expr) -> bool:
    return "ClassVar" in ast.unparse(annotation)


def _init_false(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Call) and any(
        k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
        for k in value.keywords
    )


def _required(value: ast.expr | None) -> bool:
    """Whether a field with this default expression must be passed."""
    if value is None:
        return True
    if isinstance(value, ast.Call) and (dotted_name(value.func) or "").rsplit(".", 1)[-1] in (
        "Field",
        "field",
    ):
        keys = {k.arg for k in value.keywords}
        if keys & {"default", "default_factory"}:
            return False
        return not value.args or (isinstance(value.args[0], ast.Constant) and value.args[0].value is Ellipsis)
    return False
