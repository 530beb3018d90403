"""The vLLM surface (``vllm_plugin/vllm_surface.py``) against the installed vLLM (imported), its
source and the newest release's (``scripts/vllm_compat.py``, ``ast`` only), and the checker itself
against small fake source trees (so a break is reported, by name)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
    check_touchpoint,
    generated_inventory,
    installed_source,
    main,
    source_for_version,
)

from helpers import REPO
from vllm_plugin.plugin import SUPPORTED_VLLM
from vllm_plugin.vllm_surface import (
    CHECKED_VLLM,
    HF_SURFACE,
    STDLIB_SURFACE,
    SURFACE,
    Touchpoint,
    Variant,
    installed_vllm_version,
    load,
    locate,
    touchpoint,
)

ALL = (*SURFACE, *HF_SURFACE, *STDLIB_SURFACE)
NEWEST = CHECKED_VLLM[-1]
SCANNED = ("vllm_plugin", "protocol", "trainer_lib", "scripts", "bench", "tests")
"""Where the project's code lives (every vLLM or transformers-internal import must be in a table)."""
SELF = {"vllm_plugin/vllm_surface.py", "scripts/vllm_compat.py", "tests/test_vllm_compat.py"}


# --- the table ---------------------------------------------------------------------------------------


def test_keys_are_unique_and_private_names_say_why():
    keys = [tp.key for tp in ALL]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    for tp in ALL:
        private = any(p.startswith("_") and not p.endswith("__") for p in tp.qualname.split("."))
        assert tp.private == private, tp.key
        assert bool(tp.why) == tp.private, f"{tp.key}: a private name needs a why (and only one)"
        assert tp.kind != "assigned" or tp.attr, tp.key


def test_every_user_file_exists():
    for tp in ALL:
        for where in tp.used_in:
            assert (REPO / where.split(":")[0]).is_file(), f"{tp.key}: {where}"


def _imports(prefix: str) -> dict[tuple[str, str], list[str]]:
    """``{(module, name): [file:line]}`` for every import from ``prefix`` in the project's code
    (``name`` empty for ``import module``; ``importorskip``/``import_module`` calls too)."""
    found: dict[tuple[str, str], list[str]] = {}
    for root in SCANNED:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel in SELF:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                pairs: list[tuple[str, str]] = []
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == prefix:
                    pairs = [(node.module, a.name) for a in node.names]
                elif isinstance(node, ast.Import):
                    pairs = [(a.name, "") for a in node.names if a.name.split(".")[0] == prefix]
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("importorskip", "import_module")
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).split(".")[0] == prefix
                ):
                    pairs = [(str(node.args[0].value), "")]
                for pair in pairs:
                    found.setdefault(pair, []).append(f"{rel}:{node.lineno}")
    return found


def _covered(table: tuple[Touchpoint, ...], module: str, name: str) -> bool:
    for tp in table:
        if name and tp.module == module and tp.qualname.split(".")[0] == name:
            return True
        if tp.module == (f"{module}.{name}" if name else module) or (
            not name and tp.module.startswith(module)
        ):
            return True
    return False


def test_every_vllm_import_of_the_project_is_in_the_table():
    missing = {k: v for k, v in _imports("vllm").items() if not _covered(SURFACE, *k)}
    assert not missing, f"vLLM names used but not in vllm_plugin/vllm_surface.py: {missing}"


def test_every_transformers_internal_import_is_in_the_table():
    imports = _imports("transformers")
    internal = {k: v for k, v in imports.items() if k[0] != "transformers"}
    missing = {k: v for k, v in internal.items() if not _covered(HF_SURFACE, *k)}
    assert not missing, f"transformers-internal names used but not in HF_SURFACE: {missing}"


def test_every_vllm_module_run_by_name_is_in_the_table():
    """``python -m vllm....`` and similar module names in strings."""
    names = set()
    for root in SCANNED:
        for path in (REPO / root).rglob("*.py"):
            if str(path.relative_to(REPO)) in SELF:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if re.fullmatch(r"vllm(\.[a-z_0-9]+)+", node.value):
                        names.add(node.value)
    modules = {n for n in names if SourceTree(installed_source()).module_file(n)}
    assert modules, "the scan found no module names: it is broken"
    assert modules <= {tp.module for tp in SURFACE}, modules - {tp.module for tp in SURFACE}


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


def test_locate_is_the_version_keyed_branch():
    assert locate("cli_env_setup", "0.32.0").module == "vllm.entrypoints.serve.utils.api_utils"
    assert locate("cli_env_setup", "0.33.0").module == "vllm.entrypoints.common.startup"
    assert locate("cli_env_setup", "0.33.2rc1+cu130").module == "vllm.entrypoints.common.startup"
    assert "online_derenderer" not in locate("ServingTokens.__init__", "0.32.0").keywords
    assert "online_derenderer" in locate("ServingTokens.__init__", "0.33.0").keywords
    with pytest.raises(KeyError, match="no vLLM surface touchpoint 'nope'"):
        touchpoint("nope")


# --- (a) the installed vLLM, imported ------------------------------------------------------------------


def _runtime_problems(tp: Touchpoint) -> list[str]:
    """Import ``tp`` from the installed release and bind the project's call shape to its signature."""
    version = installed_vllm_version() if tp.package == "vllm" else None
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
        sig.bind(*args, **dict.fromkeys(where.keywords))
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
    problems = _runtime_problems(tp)
    assert not problems, f"{tp.key} ({tp.module}:{tp.qualname}): " + "; ".join(problems)


@pytest.mark.parametrize(
    "tp",
    [tp for tp in (*HF_SURFACE, *STDLIB_SURFACE) if tp.kind in ("class", "function", "method")],
    ids=lambda tp: tp.key,
)
def test_transformers_names_are_defined_where_the_table_says(tp):
    """(vLLM's: by the static check below, which also sees constants and attributes.)"""
    obj: Any = importlib.import_module(tp.module)
    for part in tp.qualname.split("."):
        obj = getattr(obj, part)
    path = Path(inspect.getsourcefile(inspect.unwrap(obj)) or "")
    assert path.as_posix().endswith("/" + tp.upstream), f"{tp.key}: defined in {path}"


def test_vllms_multimodal_worker_is_one_thread_of_a_plain_executor():
    """What ``startup.engine_items`` checks (``_max_workers``) means what it assumes."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        assert pool._max_workers == 1


def test_load_imports_through_the_table():
    assert load("cli_env_setup").__name__ == "cli_env_setup"
    assert load("ServingTokens.__init__").__qualname__ == "ServingTokens.__init__"
    with pytest.raises(ValueError, match="assigned"):
        load("state.online_renderer")


# --- (b), (c) the static checker on the installed and the newest release's source -----------------------


@pytest.fixture(scope="module")
def installed_tree() -> SourceTree:
    return SourceTree(installed_source())


def _failures(results: list[Result]) -> list[str]:
    return [f"{r.status} {r.touchpoint.key}: {r.detail}" for r in results if not r.ok]


def test_installed_release_passes_the_static_check(installed_tree):
    assert installed_tree.version() == installed_vllm_version()
    results = check(installed_tree)
    assert not _failures(results)
    assert {r.status for r in results} == {"OK"}  # no variant applies to the installed release


def test_the_tables_upstream_files_are_where_the_names_are_defined(installed_tree):
    for r in check(installed_tree):
        assert r.defined_in.split(":")[0] == r.touchpoint.upstream, r.touchpoint.key


@pytest.fixture(scope="module")
def newest_tree() -> SourceTree:
    try:
        root = source_for_version(NEWEST)
    except (RuntimeError, OSError) as e:  # no network here and no cached wheel
        pytest.skip(f"vllm=={NEWEST} wheel neither in .cache/vllm/wheels nor downloadable: {e}")
    return SourceTree(root)


def test_newest_release_passes_with_the_tables_variants(newest_tree):
    assert newest_tree.version() == NEWEST
    assert not _failures(check(newest_tree))


def test_a_variant_exists_exactly_for_each_break_of_the_newest_release(newest_tree):
    """Without the variants (the 0.32 form, as unrouted code meets it) exactly the touchpoints
    that have a variant fail: none is stale, none is missing."""
    broken = {r.touchpoint.key for r in check(newest_tree, variants=False) if not r.ok}
    with_variant = {tp.key for tp in SURFACE if tp.variant_for(NEWEST) is not None}
    assert broken == with_variant


def test_the_inventory_doc_is_generated_from_the_table(newest_tree):
    text = (REPO / "docs" / "VLLM-SURFACE.md").read_text()
    start, end = text.index(INVENTORY_BEGIN), text.index(INVENTORY_END) + len(INVENTORY_END)
    assert text[start:end] == generated_inventory(NEWEST, download=False), (
        "docs/VLLM-SURFACE.md is stale: python scripts/vllm_compat.py --markdown"
    )


# --- the checker on fake trees --------------------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str], version: str = "9.9.0") -> SourceTree:
    files = {"vllm/__init__.py": "", "vllm/_version.py": f"__version__ = version = '{version}'\n", **files}
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return SourceTree(tmp_path)


def _tp(ref: str, kind: Any = "function", **fields: Any) -> Touchpoint:
    module, _, qualname = ref.partition(":")
    return Touchpoint(ref, module, qualname, kind, "", ("tests/test_vllm_compat.py",), "tests", **fields)


FAKE = {
    "vllm/a/__init__.py": "from .b import Thing, make\nfrom vllm.c import *\n",
    "vllm/a/b.py": """
        from typing import TYPE_CHECKING
        from pydantic import BaseModel
        if TYPE_CHECKING:
            FLAG: bool = False
        class Base:
            def __init__(self, x, y=1, *, z=None, **kwargs):
                self.attr = x
            def run(self, item, /, *, fast=False):
                pass
        class Thing(Base):
            def only(self, a, *, b, c=0):
                pass
        class Request(BaseModel):
            token_ids: list[int]
            salt: str | None = None
        def make(a, b=2):
            pass
        def init_state(state):
            state.renderer = object()
    """,
    "vllm/c.py": "def star(q):\n    pass\n",
    "vllm/d.py": "def moved(a):\n    pass\n",
}


@pytest.mark.parametrize(
    ("touch", "status", "ok", "detail"),
    [
        (_tp("vllm.a:make", positional=1, keywords=("b",)), "OK", True, "(a, b)"),
        (_tp("vllm.a:star", positional=1), "OK", True, "(q)"),  # through `from vllm.c import *`
        (_tp("vllm.a.b:FLAG", "constant"), "OK", True, ""),  # annotated under TYPE_CHECKING
        (_tp("vllm.a:Thing", "class", positional=1, keywords=("z", "anything")), "OK", True, "**kwargs"),
        (_tp("vllm.a:Thing.attr", "attribute"), "OK", True, ""),  # self.attr in the base's __init__
        (_tp("vllm.a:Thing.run", "method", positional=1, keywords=("fast",)), "OK", True, "(item, *, fast)"),
        (_tp("vllm.a:Thing.nope", "attribute"), "MISSING", False, "has no Thing.nope"),
        (_tp("vllm.a:gone"), "MISSING", False, "vllm.a has no gone"),
        (_tp("vllm.nowhere:thing"), "MISSING", False, "no module vllm.nowhere"),
        (_tp("vllm.a:moved", positional=1), "MOVED", False, "found at vllm.d:moved"),
        (_tp("vllm.a:moved", positional=1, variants=(Variant(">=9", module="vllm.d"),)), "MOVED", True, ""),
        (_tp("vllm.a:make", keywords=("c",)), "CHANGED", False, "no keyword 'c'"),
        (_tp("vllm.a:make", positional=3), "CHANGED", False, "takes 2 positional, the project passes 3"),
        (_tp("vllm.a:Thing.only", "method", positional=1), "CHANGED", False, "requires b"),
        (_tp("vllm.a:Thing.run", "method", keywords=("item",)), "CHANGED", False, "no keyword 'item'"),
        (
            _tp("vllm.a:Thing", "class", positional=1, keywords=("w",), named=("w",)),
            "CHANGED",
            False,
            "swallow",
        ),
        (_tp("vllm.a:make", positional=1, positional_names=("b",)), "CHANGED", False, "positional 0 is 'a'"),
        (
            _tp("vllm.a:Thing.only", "method", positional=1, variants=(Variant(">=9", keywords=("b",)),)),
            "CHANGED",
            True,
            "",
        ),
        (
            _tp("vllm.a.b:Request", "class", positional=0, keywords=("token_ids",)),
            "OK",
            True,
            "(*, token_ids",
        ),
        (
            _tp("vllm.a.b:Request", "class", positional=0, keywords=("salt",)),
            "CHANGED",
            False,
            "requires token",
        ),
        (_tp("vllm.a.b:Request.salt", "attribute"), "OK", True, ""),
        (_tp("vllm.a.b:Request.gone", "attribute"), "MISSING", False, ""),  # no excuse in pydantic's base
        (_tp("vllm.a.b:init_state", "assigned", attr="renderer"), "OK", True, ""),
        (_tp("vllm.a.b:init_state", "assigned", attr="other"), "MISSING", False, "no longer assigns .other"),
        (_tp("vllm.a:gone", optional=True), "MISSING", True, ""),
    ],
    ids=lambda v: v.key if isinstance(v, Touchpoint) else None,
)
def test_checker_reports_each_kind_of_break(tmp_path, touch, status, ok, detail):
    result = check_touchpoint(_tree(tmp_path, FAKE), touch, "9.9.0")
    assert (result.status, result.ok) == (status, ok), result
    assert detail in result.detail


def test_checker_resolves_re_exports_to_the_defining_file(tmp_path):
    result = check_touchpoint(_tree(tmp_path, FAKE), _tp("vllm.a:Thing", "class"), None)
    assert result.defined_in.startswith("vllm/a/b.py:")


def test_cli_fails_naming_what_is_missing(tmp_path, capsys):
    tree = _tree(tmp_path, {"vllm/envs.py": "VLLM_ALLOW_INSECURE_SERIALIZATION = False\n"})
    assert main(["--source", str(tree.root)]) == 1
    out = capsys.readouterr().out
    assert "OK       pass   vllm.envs:VLLM_ALLOW_INSECURE_SERIALIZATION" in out
    assert re.search(
        r"MISSING  FAIL   vllm\.entrypoints\.scale_out\.token_in_token_out\.serving:ServingTokens ", out
    )
    assert f"{len([t for t in SURFACE if t.package == 'vllm'])} touchpoints: 1 OK" in out


def test_cli_passes_on_the_installed_release(capsys):
    assert main([]) == 0
    assert "0 failures" in capsys.readouterr().out


def test_the_checker_imports_no_vllm_it_checks(tmp_path):
    """Checking a tree never imports from it (a CUDA-only wheel cannot be imported here)."""
    before = set(sys.modules)
    check(_tree(tmp_path, FAKE), (_tp("vllm.a:make", positional=1),))
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] == "vllm"}
