"""The upstream table (``upstream/``) against the repository: the table is complete and true to it
(every vLLM and transformers-internal import, every ``load`` of a name and every read of a private
vLLM attribute has a row listing its file; every row's files use it), and no code outside
``upstream/`` but the tests imports vLLM. The table against vLLM's releases (imported, and read
statically): ``test_vllm_compat.py``; the door's functions: ``test_upstream_door.py``."""

from __future__ import annotations

import ast
import functools
import inspect
import re
import subprocess
import sys

from vllm_compat import SourceTree, installed_source

from helpers import REPO
from upstream import HF_SURFACE, STDLIB_SURFACE, SURFACE, Touchpoint

ALL = (*SURFACE, *HF_SURFACE, *STDLIB_SURFACE)
CODE = ("vllm_plugin", "protocol", "trainer_lib", "rollout_client", "integrations", "scripts", "bench")
"""Every folder of code outside ``upstream/`` and the tests: none imports vLLM."""
SCANNED = (*CODE, "tests")
"""Where the project's code lives (every vLLM or transformers-internal import must be in a table)."""
SELF = frozenset(
    {
        "scripts/vllm_compat.py",
        "scripts/vllm_compat_check.py",
        "scripts/vllm_compat_inventory.py",
        "scripts/vllm_compat_source.py",
        "tests/test_vllm_surface.py",
        "tests/test_vllm_compat_checker.py",
        "tests/test_upstream_door.py",
    }
)
"""The checker and the table's tests (their strings name vLLM modules of fake trees, and keys as
test data)."""
DOOR = "upstream"


# --- the table ---------------------------------------------------------------------------------------


def test_keys_are_unique_and_private_names_say_why():
    keys = [tp.key for tp in ALL]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    for tp in ALL:
        private = any(p.startswith("_") and not p.endswith("__") for p in tp.qualname.split("."))
        assert tp.private == private, tp.key
        assert bool(tp.why) == tp.private, f"{tp.key}: a private name needs a why (and only one)"
        assert tp.kind != "assigned" or tp.attr, tp.key


def test_the_plugins_private_names_are_reached_through_named_door_functions():
    """A private (or version-keyed) name the plugin uses has a function of the door, whose docstring
    names the upstream file."""
    import upstream as door

    for tp in (*SURFACE, *STDLIB_SURFACE):
        if (tp.side == "plugin" and (tp.private or tp.since)) or tp.package == "stdlib":
            func = getattr(door, tp.accessor, None)
            assert callable(func), f"{tp.key}: no door function {tp.accessor!r}"
            doc = inspect.getdoc(func) or ""
            assert tp.qualname.rsplit(".", 1)[-1] in doc and tp.upstream in doc, tp.key


def test_every_user_file_exists_and_mentions_the_name():
    """``used_in`` lists files only; each must really use the row (its name, accessor or spelling)."""
    wrong = []
    for tp in ALL:
        for where in tp.used_in:
            path = REPO / where
            if not path.is_file():
                wrong.append(f"{tp.key}: {where} does not exist")
            elif not any(re.search(rf"(?<!\w){re.escape(m)}(?!\w)", path.read_text()) for m in tp.mentions):
                wrong.append(f"{tp.key}: {where} mentions none of {tp.mentions}")
    assert not wrong, "\n".join(wrong)


def _imports(
    prefix: str, roots: tuple[str, ...] = SCANNED, skip: frozenset[str] = SELF
) -> dict[tuple[str, str], list[str]]:
    """``{(module, name): [file:line]}`` for every import from ``prefix`` in the project's code
    (``name`` empty for ``import module``; ``importorskip``/``import_module`` calls too)."""
    found: dict[tuple[str, str], list[str]] = {}
    for root in roots:
        paths = [REPO / root] if root.endswith(".py") else sorted((REPO / root).rglob("*.py"))
        for path in paths:
            rel = str(path.relative_to(REPO))
            if rel in skip:
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
    assert not missing, f"vLLM names used but not in upstream/: {missing}"


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
            rel = str(path.relative_to(REPO))
            if rel in SELF or rel.startswith(DOOR):  # the table itself
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if re.fullmatch(r"vllm(\.[a-z_0-9]+)+", node.value):
                        names.add(node.value)
    modules = {n for n in names if SourceTree(installed_source()).module_file(n)}
    assert modules, "the scan found no module names: it is broken"
    assert modules <= {tp.module for tp in SURFACE}, modules - {tp.module for tp in SURFACE}


def _files(roots: tuple[str, ...]) -> list[str]:
    return [str(p.relative_to(REPO)) for root in roots for p in sorted((REPO / root).rglob("*.py"))]


def test_nothing_outside_upstream_but_the_tests_imports_vllm():
    """The library (``protocol/``, ``trainer_lib/``, ``vllm_plugin/``, ``rollout_client/``,
    ``integrations/``), ``bench/`` and ``scripts/`` (the checker included) reach vLLM through
    ``upstream`` only: no ``import vllm``, ``from vllm``, ``import_module("vllm...")``."""
    code = tuple(p for p in _files(CODE) if not p.startswith(DOOR))
    assert len(code) > 100, "the scan found few files: it is broken"
    assert _imports("vllm", code, skip=frozenset()) == {}


_BY_KEY = ("load", "locate", "touchpoint")
"""The door's functions that take a row's key."""


def _loaded_keys(path: str) -> list[tuple[str, int]]:
    """``(key, line)`` of every ``load("key")`` (``locate``, ``touchpoint``) call of a file that
    imports these from ``upstream``."""
    tree = ast.parse((REPO / path).read_text())
    names = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == DOOR
        for a in n.names
        if a.name in _BY_KEY
    }
    return [
        (n.args[0].value, n.lineno)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in names
        and n.args
        and isinstance(n.args[0], ast.Constant)
        and isinstance(n.args[0].value, str)
    ]


def test_every_load_names_a_row_that_lists_its_file():
    """``load("key")`` anywhere (library, bench, scripts, tests) names a row, and the row's
    ``used_in`` lists the file: the table is the list of every name the project loads, by file."""
    by_key = {tp.key: tp for tp in ALL}
    wrong, seen = [], 0
    for path in (p for p in _files(SCANNED) if p not in SELF):
        for key, line in _loaded_keys(path):
            seen += 1
            if key not in by_key:
                wrong.append(f"{path}:{line}: load({key!r}): no such row")
            elif path not in by_key[key].used_in:
                wrong.append(f"{path}:{line}: load({key!r}): the row's used_in does not list the file")
    assert seen > 40, "the scan found few loads: it is broken"
    assert not wrong, "\n".join(wrong)


@functools.cache
def _vllm_private_names() -> frozenset[str]:
    """Every private name the installed vLLM's source defines (``def _x``, ``self._x = ...``, a
    module- or class-level ``_x = ...``), read as text."""
    assigned = r"\s*(?::[^=\n]+)?=(?!=)"  # `= ...` or `: type = ...`, not `==`
    pattern = re.compile(rf"def\s+(_\w+)|self\.(_\w+){assigned}|^\s*(_\w+){assigned}", re.M)
    names = set()
    for path in (installed_source() / "vllm").rglob("*.py"):
        for match in pattern.finditer(path.read_text(errors="replace")):
            names.add(next(g for g in match.groups() if g))
    return frozenset(n for n in names if not n.endswith("__"))


def _defined_names(paths: list[str]) -> set[str]:
    """The names the project defines itself: defs, classes, assigned names, ``self._x = ...``."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse((REPO / path).read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return names


def _private_reads(path: str) -> dict[str, int]:
    """``{name: line}`` of the private attributes a file reads on other objects (``obj._x``,
    ``getattr(obj, "_x", ...)``): not on ``self``/``cls``, not on a name imported from outside vLLM."""
    tree = ast.parse((REPO / path).read_text())
    foreign = {
        a.asname or a.name.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        and ((n.module or "") if isinstance(n, ast.ImportFrom) else "").split(".")[0] != "vllm"
        for a in n.names
        if not a.name.startswith("vllm")
    } | {"self", "cls"}
    reads: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            obj, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            obj, name = node.args[0], node.args[1].value
        else:
            continue
        private = name.startswith("_") and not name.endswith("__")
        if private and not (isinstance(obj, ast.Name) and obj.id in foreign):
            reads.setdefault(name, node.lineno)
    return reads


def test_every_private_vllm_read_is_a_row_that_lists_its_file():
    """A read of a private name vLLM defines (``proc._get_mm_fields_config``,
    ``getattr(renderer, "_mm_executor")``), anywhere, is a private row whose ``used_in`` lists the
    file; outside ``upstream/`` and the tests it is a vLLM name's only through the door's accessor
    (so no such read at all). Names the project defines itself are not told apart and pass."""
    paths = [p for p in _files((DOOR, *SCANNED)) if p not in SELF]
    vllm_names, own = _vllm_private_names(), _defined_names(paths)
    rows: dict[str, list[Touchpoint]] = {}
    for tp in ALL:
        if tp.private:
            rows.setdefault(tp.attr or tp.qualname.rsplit(".", 1)[-1], []).append(tp)
    wrong, seen = [], 0
    for path in paths:
        for name, line in _private_reads(path).items():
            if name not in vllm_names or name in own:
                continue
            seen += 1
            listing = [tp for tp in rows.get(name, ()) if path in tp.used_in]
            if not listing:
                wrong.append(f"{path}:{line}: reads {name}, and no private row lists the file")
            elif not path.startswith((DOOR, "tests/")) and any(tp.package == "vllm" for tp in listing):
                wrong.append(f"{path}:{line}: reads vLLM's private {name}: call its upstream accessor")
    assert seen >= 4, "the scan found few private reads (the door has 4): it is broken"
    assert not wrong, "\n".join(wrong)


def test_the_trainer_reaches_transformers_internals_only_through_its_door():
    """No module of ``trainer_lib/`` but ``hf_surface.py`` imports a transformers-internal name (a
    module below ``transformers``) or names a private transformers attribute."""
    trainer = [str(p.relative_to(REPO)) for p in sorted((REPO / "trainer_lib").rglob("*.py"))]
    outside = tuple(p for p in trainer if p != "trainer_lib/hf_surface.py")
    internal = {k: v for k, v in _imports("transformers", outside).items() if k[0] != "transformers"}
    assert internal == {}, internal
    private = {tp.qualname.rsplit(".", 1)[-1] for tp in HF_SURFACE if tp.private}
    for path in outside:
        tree = ast.parse((REPO / path).read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not names & private, (path, names & private)


def test_protocol_takes_nothing_from_the_plugin():
    assert _imports("vllm_plugin", ("protocol",)) == {}


def test_importing_the_plugin_entry_point_imports_no_vllm():
    """vLLM swallows a plugin's import errors: ``plugin.py`` (and the door) import vLLM only when called."""
    code = "import sys, vllm_plugin.plugin, upstream; print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'transformers', 'torch')))"  # noqa: E501
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
