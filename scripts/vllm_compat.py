"""Static check of a vLLM source tree against the project's vLLM surface (``vllm_plugin/vllm_surface.py``).

Reads the source with :mod:`ast` only (never imports it), so it checks releases that cannot be
installed here (the CUDA-only wheels)::

    python scripts/vllm_compat.py                    # the installed vLLM's source
    python scripts/vllm_compat.py --vllm 0.33.0      # pip download --no-deps into .cache/vllm/
    python scripts/vllm_compat.py --source DIR|WHEEL # a source tree (holding vllm/) or a wheel
    python scripts/vllm_compat.py --vllm 0.33.0 --no-variants   # the 0.32 form, as the code is today

For every touchpoint of :data:`~vllm_plugin.vllm_surface.SURFACE` it looks the name up at its module
path for the tree's version (the touchpoint's :class:`~vllm_plugin.vllm_surface.Variant` for that
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
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_plugin.vllm_surface import CHECKED_VLLM, SURFACE, Touchpoint  # noqa: E402

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
    "main",
    "source_for_version",
    "source_from_wheel",
]

CACHE_DIR = REPO / ".cache" / "vllm"
"""Downloaded wheels (``wheels/``) and their extracted ``.py`` files (``src/<version>/``); gitignored."""

_FuncDef = ast.FunctionDef | ast.AsyncFunctionDef
_EXTERNAL_FIELD_BASES = frozenset({"BaseModel", "OpenAIBaseModel", "Struct"})
"""External bases whose subclasses take their annotated fields as keywords."""


# --- the source tree -------------------------------------------------------------------------------


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
        opaque = [e for e in external if e.rsplit(".", 1)[-1] not in _EXTERNAL_FIELD_BASES]
        return Found(module, None, owner=cls, external_bases=tuple(opaque)) if opaque else None

    def _bases(
        self, module: str, cls: ast.ClassDef, external: list[str]
    ) -> Iterator[tuple[str, ast.ClassDef]]:
        for base in cls.bases:
            expr = base.value if isinstance(base, ast.Subscript) else base
            dotted = _dotted(expr)
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
            decorated = decorated or bool(_decorators(node) & {"dataclass", "config"})
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


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        inner = _dotted(expr.value)
        return f"{inner}.{expr.attr}" if inner else None
    return None


def _decorators(node: ast.AST) -> set[str]:
    names = set()
    for dec in getattr(node, "decorator_list", ()):
        target = dec.func if isinstance(dec, ast.Call) else dec
        dotted = _dotted(target)
        if dotted:
            names.add(dotted.rsplit(".", 1)[-1])
    return names


def _is_overload(node: ast.AST) -> bool:
    return "overload" in _decorators(node)


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
    if isinstance(value, ast.Call) and (_dotted(value.func) or "").rsplit(".", 1)[-1] in ("Field", "field"):
        keys = {k.arg for k in value.keywords}
        if keys & {"default", "default_factory"}:
            return False
        return not value.args or (isinstance(value.args[0], ast.Constant) and value.args[0].value is Ellipsis)
    return False


# --- signatures -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signature:
    """What a callable takes, read from its ``def`` (or a class's fields)."""

    positional: tuple[str, ...]
    """Positional parameters in order (``self`` dropped), positional-only ones included."""
    positional_only: int
    keyword_only: tuple[str, ...]
    required: frozenset[str]
    var_positional: bool
    var_keyword: bool
    source: str
    """Where it was read: ``file:line`` (or ``fields of X``)."""

    def describe(self) -> str:
        parts = list(self.positional)
        if self.var_positional:
            parts.append("*args")
        elif self.keyword_only:
            parts.append("*")
        parts.extend(self.keyword_only)
        if self.var_keyword:
            parts.append("**kwargs")
        return f"({', '.join(parts)})"


def _function_signature(node: _FuncDef, *, method: bool, source: str) -> Signature:
    args = node.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    posonly = len(args.posonlyargs)
    if method and "staticmethod" not in _decorators(node) and positional:
        positional, posonly = positional[1:], max(posonly - 1, 0)
    n_defaults = len(args.defaults)
    required = set(positional[: len(positional) - n_defaults] if n_defaults else positional)
    required |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None}
    return Signature(
        tuple(positional),
        posonly,
        tuple(a.arg for a in args.kwonlyargs),
        frozenset(required),
        args.vararg is not None,
        args.kwarg is not None,
        source,
    )


def _line(tree: SourceTree, module: str, node: ast.AST | None) -> str:
    line = getattr(node, "lineno", None)
    return f"{tree.relpath(module)}:{line}" if line else tree.relpath(module)


def signature_of(tree: SourceTree, found: Found) -> Signature | str:
    """The call signature of what ``found`` names, or a reason it cannot be read (then any call passes)."""
    node = found.node
    if isinstance(node, _FuncDef):
        # (a @contextmanager's wrapper takes the function's own arguments)
        return _function_signature(
            node, method=found.owner is not None, source=_line(tree, found.module, node)
        )
    if not isinstance(node, ast.ClassDef):
        return "not a def or class"
    init = tree._class_member(found.module, node, "__init__", set())
    if init is not None and isinstance(init.node, _FuncDef):
        return _function_signature(init.node, method=True, source=_line(tree, init.module, init.node))
    fields, external, decorated = tree.fields(found.module, node)
    external_names = {e.rsplit(".", 1)[-1] for e in external}
    opaque = sorted(e for e in external if e.rsplit(".", 1)[-1] not in _EXTERNAL_FIELD_BASES)
    if opaque and not decorated:
        return f"its __init__ is {opaque[0]}'s"
    pydantic = bool(external_names & {"BaseModel", "OpenAIBaseModel"})
    if not (decorated or pydantic or external_names & _EXTERNAL_FIELD_BASES):
        fields = {}  # a plain class: object.__init__ takes nothing
    public = {k: v for k, v in fields.items() if not k.startswith("_")}
    return Signature(
        () if pydantic else tuple(public),
        0,
        tuple(public) if pydantic else (),
        frozenset(k for k, req in public.items() if req),
        False,
        False,
        f"fields of {node.name} ({_line(tree, found.module, node)})",
    )


def fit(
    sig: Signature,
    tp_positional: int | None,
    names: Sequence[str],
    keywords: Sequence[str],
    named: Sequence[str] = (),
) -> list[str]:
    """What keeps the project's call from binding to ``sig`` (empty: it binds).

    Args:
        tp_positional: positional arguments passed (None: the name is not called).
        names: the parameter names those positions must have.
        keywords: keyword names passed.
        named: keywords that must be named parameters (not taken by ``**kwargs``).
    """
    problems = []
    npos = tp_positional or 0
    if npos > len(sig.positional) and not sig.var_positional:
        problems.append(f"takes {len(sig.positional)} positional, the project passes {npos}")
    for i, name in enumerate(names):
        if i < len(sig.positional) and sig.positional[i] != name:
            problems.append(f"positional {i} is {sig.positional[i]!r}, the project means {name!r}")
    bound = set(sig.positional[:npos])
    keyword_params = set(sig.positional[sig.positional_only :]) | set(sig.keyword_only)
    for kw in keywords:
        if kw not in keyword_params and not sig.var_keyword:
            problems.append(f"no keyword {kw!r}")
        elif kw in bound:
            problems.append(f"{kw!r} given twice")
    for kw in named:
        if kw not in keyword_params:
            problems.append(f"{kw!r} is not a named parameter (**kwargs would swallow it)")
    missing = sorted(sig.required - bound - set(keywords))
    if missing and tp_positional is not None:
        problems.append(f"requires {', '.join(missing)} (not passed)")
    return problems


# --- the check --------------------------------------------------------------------------------------


@dataclass
class Result:
    """One touchpoint's status in one tree."""

    touchpoint: Touchpoint
    status: str
    ok: bool
    where: str = ""
    """``module:qualname`` it was looked up or found at."""
    defined_in: str = ""
    detail: str = ""
    notes: list[str] = field(default_factory=list)


def check_touchpoint(tree: SourceTree, tp: Touchpoint, version: str | None) -> Result:
    """Check one touchpoint in ``tree`` for ``version`` (None: its 0.32 form only)."""
    if not tp.exists_in(version):
        return Result(tp, "SKIP", True, tp.id, "", f"used with vLLM {tp.since} only")
    at = tp.at(version)
    variant = at.variant
    where = f"{at.module}:{at.qualname}" + (f".{tp.attr}" if tp.attr else "")
    found = tree.lookup(at.module, at.qualname)
    if found is None:
        return _not_found(tree, tp, at.module, at.qualname, where)
    if tp.kind == "assigned":
        if not _assigns(found.node, tp.attr):
            return _fail(tp, "MISSING", where, f"{at.qualname} no longer assigns .{tp.attr}", tree, found)
    if found.node is None and found.owner is not None:  # in an external base: cannot be read
        result = Result(tp, "OK", True, where, _line(tree, found.module, found.owner))
        result.notes.append(f"from external base {', '.join(found.external_bases)} (not checked)")
        return _with_variant(result, variant, moved=at.module != tp.module or at.qualname != tp.qualname)
    detail = ""
    if tp.positional is not None or tp.keywords or at.keywords or tp.positional_names:
        sig = signature_of(tree, found)
        if isinstance(sig, Signature):
            problems = fit(sig, tp.positional, tp.positional_names, at.keywords, tp.named)
            if problems:
                base_fits = variant is not None and not fit(
                    sig, tp.positional, tp.positional_names, tp.keywords, tp.named
                )
                status = "CHANGED"
                text = "; ".join(problems) + f" {sig.describe()} at {sig.source}"
                if base_fits:
                    text += " (the variant's keywords do not fit, the 0.32 ones do)"
                return _fail(tp, status, where, text, tree, found)
            detail = sig.describe()
        else:
            detail = sig
    result = Result(tp, "OK", True, where, _line(tree, found.module, found.node), detail)
    return _with_variant(result, variant, moved=at.module != tp.module or at.qualname != tp.qualname)


def _with_variant(result: Result, variant: object, *, moved: bool) -> Result:
    if variant is None:
        return result
    result.status = "MOVED" if moved else "CHANGED"
    note = getattr(variant, "note", "")
    versions = getattr(variant, "versions", "")
    result.notes.append(f"variant {versions}" + (f": {note}" if note else ""))
    return result


def _fail(
    tp: Touchpoint, status: str, where: str, detail: str, tree: SourceTree, found: Found | None
) -> Result:
    result = Result(
        tp, status, tp.optional, where, _line(tree, found.module, found.node) if found else "", detail
    )
    if tp.optional:
        result.notes.append("optional: read with a fallback")
    return result


def _not_found(tree: SourceTree, tp: Touchpoint, module: str, qualname: str, where: str) -> Result:
    """MOVED (with where it is now) or MISSING."""
    head, _, rest = qualname.partition(".")
    candidates = []
    if head:
        for other in tree.modules_defining(head):
            if other == module:
                continue
            found = tree.lookup(other, qualname)
            if found is not None and (found.node is not None or not rest):
                candidates.append(f"{other}:{qualname}")
    elif tp.kind == "module":
        leaf = module.rsplit(".", 1)[-1]
        candidates = [
            ".".join(p.relative_to(tree.root).with_suffix("").parts)
            for p in (tree.root / "vllm").rglob(f"{leaf}.py")
        ]
    if candidates:
        detail = "not at " + where + "; found at " + ", ".join(sorted(candidates)[:3]) + " (add a Variant)"
        return _fail(tp, "MOVED", where, detail, tree, None)
    if tree.parse(module) is None:
        return _fail(tp, "MISSING", where, f"no module {module}", tree, None)
    return _fail(tp, "MISSING", where, f"{module} has no {qualname or 'such name'}", tree, None)


def _assigns(node: ast.AST | None, attr: str) -> bool:
    for sub in ast.walk(node) if node is not None else ():
        targets = (
            sub.targets
            if isinstance(sub, ast.Assign)
            else [sub.target]
            if isinstance(sub, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Attribute) and t.attr == attr for t in targets):
            return True
    return False


def check(
    tree: SourceTree,
    touchpoints: Sequence[Touchpoint] = SURFACE,
    *,
    version: str | None = None,
    variants: bool = True,
) -> list[Result]:
    """Check ``touchpoints`` (vLLM's only) in ``tree`` for its version (or ``version``).

    Args:
        variants: apply the version's variants (False: every touchpoint in its 0.32 form, i.e. what
            code that does not route through ``vllm_surface`` meets).
    """
    version = version or tree.version()
    use = version if variants else None
    return [check_touchpoint(tree, tp, use) for tp in touchpoints if tp.package == "vllm"]


def format_report(results: Sequence[Result], title: str) -> str:
    """The per-version table: status, pass/FAIL, touchpoint, where found, detail."""
    lines = [title, f"{'STATUS':<8} {'RESULT':<6} {'TOUCHPOINT':<58} DETAIL"]
    for r in results:
        tp = r.touchpoint
        name = f"{tp.module}:{tp.qualname}" + (f".{tp.attr}" if tp.attr else "")
        detail = r.detail
        if r.status == "MOVED" and r.ok:
            detail = f"-> {r.where}" + (f" {detail}" if detail else "")
        notes = "; ".join(r.notes)
        text = " ".join(
            x
            for x in (detail, f"[{r.defined_in}]" if r.defined_in else "", f"({notes})" if notes else "")
            if x
        )
        lines.append(f"{r.status:<8} {'pass' if r.ok else 'FAIL':<6} {name:<58} {text}")
    statuses = ("OK", "MOVED", "CHANGED", "MISSING", "SKIP")
    counts = {s: sum(1 for r in results if r.status == s) for s in statuses}
    failures = sum(1 for r in results if not r.ok)
    lines.append(
        f"{len(results)} touchpoints: "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + f"; {failures} failure{'s' if failures != 1 else ''}"
    )
    return "\n".join(lines)


# --- the inventory (docs/VLLM-SURFACE.md) --------------------------------------------------------------

INVENTORY_BEGIN = "<!-- BEGIN GENERATED: python scripts/vllm_compat.py --markdown -->"
INVENTORY_END = "<!-- END GENERATED -->"
_SIDE_TITLES = {
    "plugin": "vllm_plugin/ (the endpoint plugin)",
    "protocol": "protocol/ (adapters shared with the trainer)",
    "scripts": "scripts/",
    "bench": "bench/",
    "tests": "tests/ (oracles and fixtures)",
    "trainer": "trainer_lib/",
}


def call_shape(tp: Touchpoint) -> str:
    """How the project uses a touchpoint, for the inventory: ``(3: a, b, c; kw=, kw=)`` or a use."""
    if tp.kind == "assigned":
        return f"read `{tp.reached_as or tp.attr}`"
    if tp.positional is None and not tp.keywords:
        return {"class": "isinstance / subclass / import", "module": "import / run"}.get(tp.kind, "read")
    positional = f"{tp.positional or 0} positional"
    if tp.positional_names:
        positional += f" ({', '.join(tp.positional_names)})"
    keywords = ", ".join(f"{k}=" for k in tp.keywords)
    named = f"; named: {', '.join(tp.named)}" if tp.named else ""
    return "call: " + positional + (f"; {keywords}" if keywords else "") + named


def status_text(result: Result) -> str:
    """A touchpoint's status in a newer release, for the inventory."""
    if not result.ok:
        return f"**{result.status}**: {result.detail}"
    if result.status == "OK":
        return "same"
    if result.status == "SKIP":
        return "not used"
    note = "; ".join(result.notes)
    if result.status == "MOVED":
        return f"moved: `{result.where}` ({note})"
    return f"signature changed ({note})"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_inventory(base: Sequence[Result], newer: Sequence[Result] | None, newer_version: str) -> str:
    """The generated part of ``docs/VLLM-SURFACE.md``: one table per side of the project.

    Args:
        base: the check of the installed release (0.32): where each name is defined.
        newer: the check of ``newer_version`` (None: not available).
    """
    by_key = {r.touchpoint.key: r for r in newer or ()}
    out: list[str] = []
    for side, title in _SIDE_TITLES.items():
        rows = [r for r in base if r.touchpoint.side == side]
        if not rows:
            continue
        out += [
            f"### {title}",
            "",
            "| name (`module:qualname`, 0.32) | kind | used in | defined in (0.32) | private "
            f"| project's use | {newer_version} |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            tp = r.touchpoint
            name = f"`{tp.module}:{tp.qualname}`" + (f" `.{tp.attr}`" if tp.attr else "")
            if tp.reached_as:
                name += f"<br>as `{tp.reached_as}`"
            private = f"yes: {tp.why}" if tp.private else ("optional" if tp.optional else "")
            newer_status = status_text(by_key[tp.key]) if tp.key in by_key else "not checked"
            defined_in = r.defined_in
            if r.status == "SKIP":  # not in the installed release: where the newer one has it
                newer_at = by_key[tp.key].defined_in if tp.key in by_key else tp.upstream
                defined_in = f"({tp.since}) {newer_at}"
            cells = [
                name,
                tp.kind,
                "<br>".join(tp.used_in),
                defined_in,
                private,
                call_shape(tp),
                newer_status,
            ]
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def markdown_other(touchpoints: Sequence[Touchpoint]) -> str:
    """The transformers and stdlib rows (checked at run time against what is installed)."""
    out = [
        "| name (`module:qualname`) | kind | used in | defined in | private | project's use |",
        "|---|---|---|---|---|---|",
    ]
    for tp in touchpoints:
        name = f"`{tp.module}:{tp.qualname}`" + (f"<br>as `{tp.reached_as}`" if tp.reached_as else "")
        private = f"yes: {tp.why}" if tp.private else ""
        cells = [name, tp.kind, "<br>".join(tp.used_in), tp.upstream, private, call_shape(tp)]
        out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def generated_inventory(newer_version: str, *, download: bool = True) -> str:
    """The whole generated section of ``docs/VLLM-SURFACE.md`` (markers included).

    Raises:
        FileNotFoundError, RuntimeError: the newer release's source is not at hand.
    """
    from vllm_plugin.vllm_surface import HF_SURFACE, STDLIB_SURFACE

    installed = SourceTree(installed_source())
    newer = SourceTree(source_for_version(newer_version, download=download))
    base = check(installed, variants=False)
    parts = [
        INVENTORY_BEGIN,
        "",
        f"## vLLM names (checked: {installed.version()} installed, {newer_version} from its wheel)",
        "",
        markdown_inventory(base, check(newer), newer_version),
        "## transformers-internal names (checked against the installed transformers)",
        "",
        markdown_other(HF_SURFACE),
        "## Standard-library private names",
        "",
        markdown_other(STDLIB_SURFACE),
        INVENTORY_END,
    ]
    return "\n".join(parts)


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
    form = "0.32 form only" if args.no_variants else "with the table's variants"
    print(format_report(shown, f"vLLM {version or '?'} ({tree.root}; {form})"))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
