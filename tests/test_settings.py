"""Every entry point reads the ``MMREF_*`` settings one way (issue 49): one line per bad value
naming the variable, its value and what is allowed; a typo warned with the closest known name; an
``s3://`` string opened with ``MMREF_STORE_*`` wherever it is given (``Offloader``,
``offload_image``, ``materialize``), refused at once on a plain-HTTP endpoint without
``MMREF_STORE_ALLOW_HTTP``; a PIL image accepted wherever an image is. The server's launch
(checked before vLLM builds its engine): ``tests/test_readme_settings.py``."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import uuid

import pytest
from PIL import Image

from helpers import REPO, photo_array
from protocol.roots import ObjectRoot, StoreClientConfig, open_root
from protocol.setting_names import PARTY_VARIABLES, ROOT_VARIABLES, TOOL_VARIABLES
from protocol.settings import (
    RootSettings,
    SettingError,
    StoreSettings,
    known_variables,
    unknown_variables,
    warn_unknown_variables,
)
from trainer_lib.config import MaterializeConfig
from vllm_plugin.config import PluginConfig

ENDPOINT = "http://127.0.0.1:9"
TYPO_TESTS = ("test_settings.py", "test_readme_settings.py")
"""The modules that set misspelled variables on purpose."""
DOCUMENTED_TYPOS = {"MMREF_MAX_WORKER", "MMREF_CACHE_BUDGET_BYTE"}
"""Issue 49's examples of a typo, named in docs and docstrings."""


@pytest.fixture
def clean_env(monkeypatch):
    """No ``MMREF_*`` or S3 endpoint variables of the test run leak in."""
    import os

    for name in list(os.environ):
        if name.startswith("MMREF_") or name.startswith("AWS_ENDPOINT"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_the_known_names_are_every_partys_fields_and_every_name_the_repo_uses():
    fields = {f"MMREF_{n.upper()}" for cls in (PluginConfig, MaterializeConfig) for n in cls.model_fields}
    assert known_variables() == fields | TOOL_VARIABLES and PARTY_VARIABLES < fields
    assert ROOT_VARIABLES == {f"MMREF_{n.upper()}" for n in RootSettings.model_fields}  # written out
    used = set()
    for path in [
        *REPO.glob("*.md"),
        *REPO.glob("docs/*.md"),
        *REPO.rglob("*.py"),
        *REPO.glob("scripts/*.sh"),
    ]:
        if not {".venv", ".cache"} & set(path.parts) and path.name not in TYPO_TESTS:
            used |= set(re.findall(r"\bMMREF_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    assert used - DOCUMENTED_TYPOS <= known_variables(), used - DOCUMENTED_TYPOS - known_variables()


def test_a_typo_is_warned_once_with_the_closest_known_name(clean_env, caplog):
    clean_env.setenv("MMREF_MAX_WORKER", "3")
    clean_env.setenv("MMREF_CACHE_BUDGET_BYTE", "1")
    clean_env.setenv("MMREF_ASSET_ROOT", str(REPO))
    assert unknown_variables() == [
        "mmref: MMREF_CACHE_BUDGET_BYTE is not a setting of mmref and is ignored; did you mean "
        "MMREF_CACHE_BUDGET_BYTES?",
        "mmref: MMREF_MAX_WORKER is not a setting of mmref and is ignored; did you mean MMREF_MAX_WORKERS?",
    ]
    with caplog.at_level(logging.WARNING, logger="protocol.setting_names"):
        PluginConfig()
        MaterializeConfig()  # the same process: warned once
    warned = [r.getMessage() for r in caplog.records if "is not a setting" in r.getMessage()]
    assert len(warned) == 2 and "MMREF_MAX_WORKERS?" in warned[1]
    assert warn_unknown_variables() == []
    assert unknown_variables({"MMREF_ZZZZZZZZZZ": "1"}) == [
        "mmref: MMREF_ZZZZZZZZZZ is not a setting of mmref and is ignored"
    ]


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("MMREF_STORE_TIMEOUT_S", "0", "a number > 0"),
        ("MMREF_STORE_TIMEOUT_S", "soon", "a number > 0"),
        ("MMREF_READ_CACHE_BYTES", "-1", "an integer >= 0"),
        ("MMREF_STORE_ALLOW_HTTP", "maybe", "true or false"),
        ("MMREF_STORE_HOLD_DOWN_S", "-1", "a number >= 0"),
        ("MMREF_MAX_BODY_BYTES", "10", "an integer >= 1024 (or unset)"),
        ("MMREF_MAX_WORKERS", "65", "an integer >= 1 and <= 64"),
        ("MMREF_ASSET_ROOTS", "relative/dir", "absolute folders, file://, s3://"),
    ],
)
def test_a_bad_value_is_one_line_naming_variable_value_and_what_is_allowed(clean_env, name, value, allowed):
    clean_env.setenv("MMREF_ASSET_ROOT", str(REPO))
    clean_env.setenv(name, value)
    for cls in (PluginConfig, MaterializeConfig) if name != "MMREF_MAX_BODY_BYTES" else (PluginConfig,):
        with pytest.raises(SettingError) as info:
            cls()
        line = str(info.value)
        assert line.startswith(f"mmref setting {name}={value!r} (") and f"allowed: {allowed}" in line, line
        assert "\n" not in line and "validation error" not in line and info.value.variables == [name]


def test_settings_from_a_mapping_name_its_variables_and_read_nothing_else(clean_env):
    """``from_environ`` (and ``StoreClientConfig.from_env(environ)``): a bad value is the same one
    line naming the variable; the process's own ``MMREF_*`` variables are not read."""
    clean_env.setenv("MMREF_STORE_MAX_RETRIES", "bad")  # the process's: ignored
    assert StoreClientConfig.from_env({"MMREF_STORE_TIMEOUT_S": "3"}).timeout_s == 3
    assert (
        StoreSettings.from_environ({}).store_max_retries
        == StoreSettings.model_fields["store_max_retries"].default
    )
    for call in (StoreClientConfig.from_env, StoreSettings.from_environ):
        with pytest.raises(SettingError) as info:
            call({"MMREF_STORE_TIMEOUT_S": "soon"})
        line = str(info.value)
        assert line.startswith("mmref setting MMREF_STORE_TIMEOUT_S='soon' (") and "a number > 0" in line, (
            line
        )
        assert "MMREF_READ_CACHE_DIR" not in line and info.value.variables == ["MMREF_STORE_TIMEOUT_S"]


def test_a_credential_in_a_root_is_never_echoed(clean_env):
    clean_env.setenv("MMREF_ASSET_ROOTS", f"{REPO},s3://AKIAEXAMPLE:hunter2@bucket/x")
    with pytest.raises(SettingError) as info:
        MaterializeConfig()
    assert "hunter2" not in str(info.value) and "AKIAEXAMPLE" not in str(info.value)
    assert "s3://***@bucket/x" in str(info.value) and "carry no credentials" in str(info.value)


def test_a_plain_http_s3_endpoint_is_refused_at_once_with_the_flag_to_set(clean_env):
    """obstore builds a client for an http:// endpoint without allow_http and then fails every
    request with "builder error": refused when the root is opened, naming the way out."""
    for variable in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_ENDPOINT_URL_S3"):
        clean_env.setenv(variable, ENDPOINT)
        for opening in (lambda: ObjectRoot("s3://bucket/p"), lambda: open_root("s3://bucket/p")):
            with pytest.raises(
                ValueError, match=f"{variable}='{ENDPOINT}' is plain HTTP; set MMREF_STORE_ALLOW_HTTP=1"
            ):
                opening()
        clean_env.delenv(variable)
    with pytest.raises(ValueError, match="endpoint='http://"):
        ObjectRoot("s3://bucket/p", StoreClientConfig(), endpoint=ENDPOINT)
    clean_env.setenv("AWS_ENDPOINT_URL", ENDPOINT)
    clean_env.setenv("MMREF_ASSET_ROOTS", "s3://bucket/p")
    with pytest.raises(SettingError, match=r"MMREF_ASSET_ROOTS='s3://bucket/p' \(.*MMREF_STORE_ALLOW_HTTP=1"):
        PluginConfig()
    clean_env.setenv("MMREF_STORE_ALLOW_HTTP", "1")
    assert ObjectRoot("s3://bucket/p").client.allow_http and PluginConfig().store_client().allow_http
    clean_env.setenv("AWS_ENDPOINT_URL", "https://s3.example.com")
    clean_env.delenv("MMREF_STORE_ALLOW_HTTP")
    assert not ObjectRoot("s3://bucket/p").client.allow_http  # https: nothing to allow


def test_an_object_store_string_takes_the_store_settings(clean_env):
    clean_env.setenv("MMREF_STORE_TIMEOUT_S", "3")
    clean_env.setenv("MMREF_STORE_HOLD_DOWN_S", "0")
    client = open_root("s3://bucket/p").client
    assert (client.timeout_s, client.hold_down_s) == (3.0, 0.0)
    assert StoreClientConfig.from_env() == StoreSettings().store_client() == client
    clean_env.setenv("MMREF_STORE_TIMEOUT_S", "never")
    with pytest.raises(SettingError, match="MMREF_STORE_TIMEOUT_S='never'"):
        open_root("s3://bucket/p")


def test_the_fleet_strings_work_against_a_local_s3(moto_s3, clean_env, qwen2_vl_dir, qwen2_vl_adapter):
    """The README's Fleet client, as written: ``Offloader(model_dir, "s3://...", form="v2")`` with
    the AWS chain set for a local S3 refuses at construction without ``MMREF_STORE_ALLOW_HTTP``
    (before: an opaque "builder error" at the first offload) and works with it; ``offload_image``
    takes a PIL image and the URL; ``materialize`` reads the same URL with the same settings."""
    from protocol.adapters import offload_image
    from protocol.structs import TrainingSample
    from rollout_client import Offloader
    from trainer_lib import MaterializeOptions, materialize

    url = moto_s3.make_bucket(f"settings-{uuid.uuid4().hex[:8]}") + "/mmref"
    for name, value in moto_s3.env().items():
        clean_env.setenv(name, value)
    clean_env.delenv("MMREF_STORE_ALLOW_HTTP")
    with pytest.raises(ValueError, match="set MMREF_STORE_ALLOW_HTTP=1"):
        Offloader(qwen2_vl_dir, url, adapter=qwen2_vl_adapter, form="v2")
    clean_env.setenv("MMREF_STORE_ALLOW_HTTP", "1")
    clean_env.setenv("MMREF_STORE_TIMEOUT_S", "4")
    offloader = Offloader(qwen2_vl_dir, url, adapter=qwen2_vl_adapter, form="v2")
    assert offloader.asset_root.client.timeout_s == 4.0
    photo = Image.fromarray(photo_array("chelsea")).resize((96, 64))
    ref = offloader.offload(photo)
    assert offload_image(photo, url, qwen2_vl_adapter, form="v2") == ref  # PIL: the same PNG bytes
    ids = [1, 259, *[261] * ref.num_placeholders, 260, 2]
    sample = TrainingSample.from_rollout(ids, [5], [-1.0], [ref])
    batch = materialize([sample], qwen2_vl_adapter, url, MaterializeOptions(policy="error"))
    assert batch.stats.processed == 1 and tuple(batch.features["image_grid_thw"][0].tolist()) == tuple(
        ref.grid
    )


def test_offload_image_takes_a_pil_image_as_the_client_does(tmp_path, qwen2_vl_dir, qwen2_vl_adapter):
    from protocol.adapters import offload_image
    from rollout_client import Offloader

    photo = Image.fromarray(photo_array("rocket")).resize((80, 60))
    ref = offload_image(photo, tmp_path, qwen2_vl_adapter, form="v2")
    assert ref == Offloader(qwen2_vl_dir, tmp_path, adapter=qwen2_vl_adapter, form="v2").offload(photo)
    with pytest.raises(TypeError, match="bytes, a PIL image or a path"):
        offload_image(3.5, tmp_path, qwen2_vl_adapter)


def test_the_sweep_reads_the_root_and_warns_as_the_server_does(tmp_path, clean_env):
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "MMREF_ASSET_ROOT": str(tmp_path),
        "MMREF_TLL": "1",
    }
    run = subprocess.run([sys.executable, "-m", "protocol.sweep", "--dry-run"], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0 and "scanned 0 feature files" in run.stdout, run.stderr
    assert "MMREF_TLL is not a setting of mmref" in run.stderr
    del env["MMREF_ASSET_ROOT"]
    run = subprocess.run(
        [sys.executable, "-m", "protocol.sweep"], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and "MMREF_ASSET_ROOT / MMREF_ASSET_ROOTS: neither is set" in run.stderr
