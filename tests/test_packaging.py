"""pyproject.toml builds a clean wheel: no setuptools deprecation, the metadata and packages users get."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from helpers import REPO

PACKAGES = ("upstream", "protocol", "trainer_lib", "vllm_plugin", "rollout_client", "integrations")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """``pip wheel`` of a copy of the project (the venv's setuptools, no network): (build log, wheel)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (path,) = out.glob("mmref-*.whl")
    return build.stdout + build.stderr, zipfile.ZipFile(path)


def test_the_build_raises_no_deprecation(wheel):
    log, _ = wheel
    assert "Warning" not in log and "deprecated" not in log, log[-3000:]


def test_wheel_metadata_and_contents(wheel):
    _, whl = wheel
    metadata = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "Requires-Dist: msgspec>=0.21" in metadata  # structs.replace runs __post_init__
    entry_points = whl.read(next(n for n in whl.namelist() if n.endswith("entry_points.txt"))).decode()
    assert "[vllm.endpoint_plugins]" in entry_points
    assert "mmref = vllm_plugin.plugin:MMRefEndpointPlugin" in entry_points
    packages = {n.split("/")[0] for n in whl.namelist() if n.endswith(".py")}
    assert packages == set(PACKAGES)
    assert (
        "protocol/adapters/registry.py" in whl.namelist() and "trainer_lib/planning/plan.py" in whl.namelist()
    )
    assert "upstream/door.py" in whl.namelist() and "upstream/rows_plugin.py" in whl.namelist()


def test_install_script_pins_the_verl_range_integrations_verl_imports_under():
    """``scripts/install.sh verl`` installs verl with --no-deps at ``integrations.verl.SUPPORTED``
    (read from the source: verl need not be installed)."""
    import ast
    import re

    tree = ast.parse((REPO / "integrations" / "verl" / "__init__.py").read_text())
    supported = next(
        n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "SUPPORTED" for t in n.targets)
    )
    script = (REPO / "scripts" / "install.sh").read_text()
    assert re.search(r'^VERL_SPEC="verl(.+?)"', script, re.M).group(1) == supported
    assert script.count('--no-deps "$VERL_SPEC"') == 2  # the CUDA and the CPU branch
