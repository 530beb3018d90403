"""``scripts/vllm_compat.py`` itself, on small fake source trees: each kind of break is reported,
by name, and checking a tree never imports it."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from vllm_compat import SourceTree, check, check_touchpoint, main

from upstream import SURFACE, Touchpoint, Variant


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


def test_a_row_of_a_later_release_is_skipped_before_it(tmp_path):
    tree = _tree(tmp_path, FAKE)
    later = _tp("vllm.a:gone", since=">=9.9")
    assert check_touchpoint(tree, later, "9.8.0").status == "SKIP"
    assert check_touchpoint(tree, later, None).status == "SKIP"  # the 0.32 form
    result = check_touchpoint(tree, later, "9.9.0")
    assert (result.status, result.ok) == ("MISSING", False)
