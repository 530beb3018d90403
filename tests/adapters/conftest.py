"""Fixtures of the Qwen adapter tests (``test_adapters_qwen.py``, ``test_adapters_qwen35.py``),
one of each per family: a module defines ``family`` (parametrized over its families) and gets the
rest from here. The contract test (``test_adapters_contract.py``) and the Kimi tests build theirs."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import Oracle, ensure_tiny_model, make_oracle
from protocol.adapters import QwenVLAdapter, load_adapter


@pytest.fixture(scope="module")
def model_dir(family) -> Path:
    return ensure_tiny_model(family)


@pytest.fixture(scope="module")
def default_oracle(model_dir) -> Oracle:
    """vLLM's processor as a server builds it with default flags."""
    return make_oracle(model_dir)


@pytest.fixture(scope="module")
def trainer_adapter(model_dir) -> QwenVLAdapter:
    """``load_adapter(model_dir)``, as a trainer builds it."""
    return load_adapter(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def image_token_id(tokenizer, default_oracle) -> int:
    """``<|image_pad|>``: the token vLLM's config names the image token."""
    token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert default_oracle.model_config.hf_config.image_token_id == token_id
    return token_id
