"""Fixtures of the in-process plugin tests (no server): vLLM's own processor for the tiny
Qwen2-VL and the item layout built from its field config, as ``startup.build_resolver`` builds it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def mm_processor(qwen2_vl_dir):
    """vLLM's own multimodal processor for the tiny model (what a server's renderer holds)."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    config = ModelConfig(
        model=str(qwen2_vl_dir), dtype="float32", max_model_len=2048, limit_mm_per_prompt={"image": 4}
    )
    return MULTIMODAL_REGISTRY.create_processor(config)


@pytest.fixture(scope="session")
def layout(qwen2_vl_adapter, mm_processor):
    """The served model's item layout (``vllm_plugin.items.ItemLayout``)."""
    from vllm_plugin.items import ItemLayout

    return ItemLayout(qwen2_vl_adapter, lambda hf: mm_processor._get_mm_fields_config(hf, {}))
