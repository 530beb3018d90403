"""Typed settings (pydantic-settings, ``MMREF_*``) for the plugin and the trainer; bad ones stop start-up."""

from __future__ import annotations

import json

import pytest

from helpers import start_server
from protocol.settings import SettingError
from trainer_lib.config import MaterializeConfig, MaterializeOptions
from vllm_plugin.config import PluginConfig


def test_plugin_config_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MMREF_ASSET_ROOT", str(tmp_path / "." / ""))
    monkeypatch.setenv("MMREF_CACHE_BUDGET_BYTES", "1048576")
    monkeypatch.setenv("MMREF_ALLOWED_FAMILIES", '["qwen2_vl", "qwen3_vl"]')
    monkeypatch.setenv("MMREF_MAX_IMAGE_PIXELS", "1000000")
    cfg = PluginConfig()
    assert cfg.asset_root == tmp_path.resolve() and cfg.asset_root.is_absolute()
    assert cfg.cache_budget_bytes == 1 << 20 and cfg.allowed_families == ["qwen2_vl", "qwen3_vl"]
    assert cfg.max_image_pixels == 1_000_000 and cfg.max_workers == 2


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("MMREF_ASSET_ROOT", "/nonexistent/mmref", "allowed: an existing folder"),
        ("MMREF_CACHE_BUDGET_BYTES", "-1", "allowed: an integer >= 0"),
        ("MMREF_MAX_WORKERS", "0", "allowed: an integer >= 1 and <= 64"),
        ("MMREF_MAX_IMAGE_PIXELS", "lots", "allowed: an integer >= 1"),
        ("MMREF_ALLOWED_FAMILIES", "qwen2_vl", "allowed: a JSON list of strings"),
    ],
)
def test_plugin_config_errors_name_the_setting(monkeypatch, tmp_path, name, value, match):
    """One line: the variable, its value and what is allowed (not pydantic's report of a field)."""
    monkeypatch.setenv("MMREF_ASSET_ROOT", str(tmp_path))
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError, match=match) as info:
        PluginConfig()
    message = str(info.value)
    assert f"{name}={value!r}" in message and "\n" not in message and info.value.variables == [name]


def test_plugin_config_requires_an_asset_root(monkeypatch):
    monkeypatch.delenv("MMREF_ASSET_ROOT", raising=False)
    with pytest.raises(SettingError, match="MMREF_ASSET_ROOT / MMREF_ASSET_ROOTS: neither is set"):
        PluginConfig()
    monkeypatch.setenv("MMREF_ASSET_ROOT", "")  # "$OUTPUT_ROOT" with OUTPUT_ROOT unset: no root
    with pytest.raises(SettingError, match="neither is set"):
        PluginConfig()


def test_plugin_config_asset_roots(monkeypatch, tmp_path):
    monkeypatch.delenv("MMREF_ASSET_ROOT", raising=False)
    monkeypatch.setenv("MMREF_ASSET_ROOTS", f"{tmp_path / 'a'}, {tmp_path / 'b'}")
    monkeypatch.setenv("MMREF_STORE_TIMEOUT_S", "3")
    monkeypatch.setenv("MMREF_STORE_ALLOW_HTTP", "1")
    cfg = PluginConfig()
    assert cfg.asset_root is None and cfg.asset_roots == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert cfg.image_source().describe() == cfg.asset_roots and cfg.image_source() is cfg.image_source()
    assert cfg.store_client().timeout_s == 3 and cfg.store_client().allow_http
    monkeypatch.setenv("MMREF_ASSET_ROOTS", json.dumps(["s3://bucket/x", "https://cdn.example/mmref"]))
    assert PluginConfig().asset_roots == ["s3://bucket/x", "https://cdn.example/mmref"]
    monkeypatch.delenv("MMREF_ASSET_ROOTS")
    monkeypatch.setenv("MMREF_ASSET_ROOT", str(tmp_path))
    assert PluginConfig().image_source().describe() == [str(tmp_path)]  # the folder is the one root


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("relative/path", "not an absolute path"),
        ("s3://user:secret@bucket/x", "no credentials"),
        ("ftp://host/x", "scheme"),
    ],
)
def test_plugin_config_refuses_bad_roots_naming_the_setting(monkeypatch, tmp_path, value, match):
    monkeypatch.setenv("MMREF_ASSET_ROOT", str(tmp_path))
    monkeypatch.setenv("MMREF_ASSET_ROOTS", value)
    with pytest.raises(SettingError, match=match) as info:
        PluginConfig()
    assert "MMREF_ASSET_ROOTS=" in str(info.value) and "secret" not in str(info.value)


def test_materialize_config(monkeypatch, tmp_path):
    monkeypatch.setenv("MMREF_ASSET_ROOT", str(tmp_path))
    monkeypatch.setenv("MMREF_MISSING_POLICY", "error")
    monkeypatch.setenv("MMREF_MAX_WORKERS", "4")
    monkeypatch.setenv("MMREF_MAX_IMAGE_PIXELS", "1000")
    monkeypatch.setenv("MMREF_MAX_VIDEO_BYTES", "5000")
    config = MaterializeConfig()
    assert config.options() == MaterializeOptions(
        policy="error", max_workers=4, max_image_pixels=1000, max_video_bytes=5000
    )
    # the pixel mode and the placeholder check are the model's (PackingSpec), given by the caller
    options = config.options(raw_pixels=True, placeholder_token_id=7)
    assert options.raw_pixels and options.placeholder_token_id == 7 and options.max_workers == 4
    source = config.image_source()  # the roots materialize reads: the folder, v1 refs by path under it
    assert source.describe() == [str(tmp_path)] and source.legacy.root == tmp_path
    monkeypatch.setenv("MMREF_MISSING_POLICY", "ignore")
    with pytest.raises(
        SettingError, match=r"MMREF_MISSING_POLICY='ignore'.*one of 'placeholder_zero_loss', 'error'"
    ):
        MaterializeConfig()


def test_materialize_config_asset_roots(monkeypatch, tmp_path):
    """MMREF_ASSET_ROOTS (comma-separated or JSON), the read cache and the store client settings,
    the plugin's names; MMREF_ASSET_ROOT optional once roots are given, one of the two required."""
    monkeypatch.delenv("MMREF_ASSET_ROOT", raising=False)
    with pytest.raises(SettingError, match="MMREF_ASSET_ROOTS"):
        MaterializeConfig()
    (tmp_path / "a").mkdir()
    monkeypatch.setenv("MMREF_ASSET_ROOTS", f"{tmp_path}/a, file://{tmp_path}/b")
    monkeypatch.setenv("MMREF_READ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MMREF_READ_CACHE_BYTES", "1048576")
    for name, value in (("TIMEOUT_S", "3"), ("CONNECT_TIMEOUT_S", "1"), ("MAX_RETRIES", "0"),
                        ("RETRY_TIMEOUT_S", "5"), ("ALLOW_HTTP", "true")):  # fmt: skip
        monkeypatch.setenv(f"MMREF_STORE_{name}", value)
    config = MaterializeConfig()
    assert config.asset_root is None and config.asset_roots == [f"{tmp_path}/a", f"file://{tmp_path}/b"]
    source = config.image_source()
    assert source is config.image_source() and source.legacy is None  # built once per config
    assert (
        source.describe() == [str(tmp_path / "a"), str(tmp_path / "b")] and source.cache.max_bytes == 1 << 20
    )
    client = config.store_client()
    assert (client.timeout_s, client.connect_timeout_s, client.max_retries) == (3.0, 1.0, 0)
    assert client.retry_timeout_s == 5.0 and client.allow_http
    monkeypatch.setenv("MMREF_ASSET_ROOTS", f'["{tmp_path}/a"]')
    monkeypatch.setenv("MMREF_ASSET_ROOT", str(tmp_path))
    config = MaterializeConfig()
    assert (
        config.image_source().describe() == [str(tmp_path / "a")]
        and config.image_source().legacy.root == tmp_path
    )
    for bad in ("relative/path", "s3://user:secret@bucket/x", "ftp://host/x"):
        monkeypatch.setenv("MMREF_ASSET_ROOTS", bad)
        with pytest.raises(SettingError, match="MMREF_ASSET_ROOTS="):
            MaterializeConfig()
    monkeypatch.setenv("MMREF_ASSET_ROOTS", "")
    monkeypatch.setenv("MMREF_STORE_MAX_RETRIES", "-1")
    with pytest.raises(SettingError, match="MMREF_STORE_MAX_RETRIES='-1'"):
        MaterializeConfig()


@pytest.mark.server
@pytest.mark.timeout(600)
def test_server_refuses_to_start_with_bad_settings(qwen2_vl_dir, tmp_path):
    """vLLM swallows plugin *load* errors; ours surface in init_state and stop the server."""
    with pytest.raises(RuntimeError) as info:
        start_server(
            qwen2_vl_dir,
            tmp_path,
            tmp_path / "server.log",
            extra_env={"MMREF_ASSET_ROOT": str(tmp_path / "missing"), "MMREF_MAX_WORKERS": "0"},
        )
    message = str(info.value)
    assert "exited" in message and "MMREF_ASSET_ROOT=" in message and "MMREF_MAX_WORKERS='0'" in message


@pytest.mark.server
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("extra_args", "extra_env", "match"),
    [
        (
            ("--mm-processor-kwargs", '{"max_pixels": 200704}'),
            {},
            "does not apply --mm-processor-kwargs ['max_pixels']",
        ),
        ((), {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}, "refuses VLLM_ALLOW_INSECURE_SERIALIZATION=1"),
    ],
)
def test_server_refuses_settings_that_make_refs_unsafe_or_wrong(
    qwen2_vl_dir, tmp_path, extra_args, extra_env, match
):
    """Processor kwargs the plugin cannot apply, and pickling decoders, stop the server at start-up."""
    with pytest.raises(RuntimeError) as info:
        start_server(
            qwen2_vl_dir, tmp_path, tmp_path / "server.log", extra_args=extra_args, extra_env=extra_env
        )
    assert match in str(info.value)
