"""The compatibility check of one touchpoint in one source tree (``scripts/vllm_compat.py``): where
the name is, and whether the project's call binds to what the tree declares.

Statuses: ``OK``, ``MOVED``, ``CHANGED``, ``MISSING``, ``SKIP`` (see ``scripts/vllm_compat.py``).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_compat_source import EXTERNAL_FIELD_BASES, Found, SourceTree, decorators

from upstream import SURFACE, Touchpoint

__all__ = ["Result", "Signature", "check", "check_touchpoint", "fit", "format_report", "signature_of"]

_FuncDef = ast.FunctionDef | ast.AsyncFunctionDef

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
    if method and "staticmethod" not in decorators(node) and positional:
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
    opaque = sorted(e for e in external if e.rsplit(".", 1)[-1] not in EXTERNAL_FIELD_BASES)
    if opaque and not decorated:
        return f"its __init__ is {opaque[0]}'s"
    pydantic = bool(external_names & {"BaseModel", "OpenAIBaseModel"})
    if not (decorated or pydantic or external_names & EXTERNAL_FIELD_BASES):
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
            code that does not route through ``upstream`` meets).
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
