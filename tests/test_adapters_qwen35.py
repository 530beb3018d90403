"""Qwen3.5, Qwen3.5-MoE and Qwen3-VL-MoE adapters against vLLM's own engine-free multimodal processor.

Same oracle as ``test_adapters_qwen.py`` (``MULTIMODAL_REGISTRY.create_processor``): for each
family and both pixel modes the adapter, built the way the server builds it (wrapping vLLM's
image processor) and the way the trainer builds it (``load_adapter``), gives bit-identical
``pixel_values``, the same grid and placeholder count, and ids expanded exactly as vLLM expands
them; the trainer-side HF processor (``Qwen3VLProcessor``) marks the same image positions in
``mm_token_type_ids`` that the packing derives from the refs.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from helpers import ensure_tiny_model
from protocol.adapters import (
    Qwen3VLMoeAdapter,
    Qwen35Adapter,
    QwenVLAdapter,
    adapter_class,
    load_adapter,
    offload_image,
)
from protocol.errors import GridMismatch, UnsupportedFamily
from protocol.images import load_image
from protocol.placeholders import expand_image_placeholders, locate_image_runs
from protocol.refs import RawRefBody, format_mmraw, parse_ref
from test_adapters_qwen import (
    CASE_IDS,
    GOLDEN_ASTRONAUT,
    GOLDEN_SIZES,
    GRID_SIZES,
    IMAGE_CASES,
    IMAGE_PAD,
    Oracle,
    chat_ids,
    image_bytes,
    make_oracle,
)

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")
ADAPTER_CLASS = {"qwen3_5": Qwen35Adapter, "qwen3_5_moe": Qwen35Adapter, "qwen3_vl_moe": Qwen3VLMoeAdapter}
ARCHITECTURE = {  # transformers' and vLLM's class for each model type
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}
# The tiny models share Qwen3-VL's tiny image processor config (patch 16, merge 2, mean/std 0.5,
# 4..64 merged tokens), so transformers' smart_resize gives them Qwen3-VL's golden grids.
GOLDEN = "qwen3_vl"


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family) -> Path:
    return ensure_tiny_model(family)


@pytest.fixture(scope="module")
def default_oracle(model_dir) -> Oracle:
    return make_oracle(model_dir, None)


@pytest.fixture(scope="module", params=[True, False], ids=["raw", "normalized"])
def oracle(request, model_dir) -> Oracle:
    return make_oracle(model_dir, request.param)


@pytest.fixture(scope="module")
def server_adapter(family, default_oracle) -> QwenVLAdapter:
    """Built like the plugin's ``init_state``: wraps vLLM's own image processor."""
    from upstream import served_image_processor

    return adapter_class(family)(served_image_processor(default_oracle.processor), family=family)


@pytest.fixture(scope="module")
def trainer_adapter(model_dir) -> QwenVLAdapter:
    return load_adapter(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def image_token_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids(IMAGE_PAD)


# --- registry and what vLLM resolves ------------------------------------------------------------


def test_registry_rows(family, model_dir, trainer_adapter):
    cls = ADAPTER_CLASS[family]
    assert adapter_class(family) is cls and type(trainer_adapter) is cls
    assert issubclass(cls, QwenVLAdapter) and family in cls.model_types
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE[family]]
    # The class attribute states what the checkpoint's own layer_types say.
    layer_types = config["text_config"].get("layer_types", [])
    assert cls.linear_attention == ("linear_attention" in layer_types)
    if cls.linear_attention:
        assert set(layer_types) == {"linear_attention", "full_attention"}  # both kinds present
    with pytest.raises(UnsupportedFamily):
        cls(trainer_adapter.image_processor, family="qwen3_vl")


def test_vllm_serves_the_family_through_qwen3_vls_processor(family, default_oracle, trainer_adapter):
    mc = default_oracle.model_config
    assert mc.architectures == [ARCHITECTURE[family]]
    hf_processor = default_oracle.processor.info.get_hf_processor()
    assert type(hf_processor).__name__ == "Qwen3VLProcessor"
    assert type(hf_processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(trainer_adapter.image_processor) is type(hf_processor.image_processor)
    assert default_oracle.normalize is True  # mm_device_do_normalize on by default: raw pixels
    assert trainer_adapter.placeholder_token_id(mc.hf_config) == mc.hf_config.image_token_id


def test_tokenizer_class_and_ids(family, model_dir, tokenizer, default_oracle):
    """transformers (and vLLM) build Qwen3_5Tokenizer for qwen3_5*: same ids as the saved file."""
    from transformers import PreTrainedTokenizerFast

    want = "Qwen3_5Tokenizer" if family.startswith("qwen3_5") else "TokenizersBackend"
    assert type(tokenizer).__name__ == want
    assert type(default_oracle.processor.info.get_tokenizer()).__name__.endswith(want)
    from_file = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this? 42 cats.<|im_end|>\n"
    assert tokenizer(text)["input_ids"] == from_file(text)["input_ids"]


# --- equality with vLLM's processor --------------------------------------------------------------


@pytest.mark.parametrize("case", IMAGE_CASES, ids=CASE_IDS)
def test_process_matches_vllm(case, family, oracle, trainer_adapter, tokenizer, image_token_id, tmp_path):
    data = image_bytes(*case)
    image = load_image(data)
    prompt = chat_ids(tokenizer, 1)
    out = oracle.run(prompt, [image])
    item = out["mm_kwargs"]["image"][0]
    want_pixels, want_grid = item["pixel_values"].data, item["image_grid_thw"].data
    placeholder = out["mm_placeholders"]["image"][0]
    assert want_pixels.dtype == (torch.uint8 if oracle.normalize else torch.float32)

    from upstream import served_image_processor

    server = adapter_class(family)(served_image_processor(oracle.processor), family=family)
    for adapter in (server, trainer_adapter):
        got = adapter.process(image, raw_pixels=oracle.normalize)
        pixels = got.tensors["pixel_values"]
        assert pixels.dtype == want_pixels.dtype and pixels.shape == want_pixels.shape
        assert torch.equal(pixels, want_pixels)
        assert got.tensors["image_grid_thw"].tolist() == [want_grid.tolist()]
        assert got.num_placeholders == placeholder.length
        assert adapter.grid_for_size(image.width, image.height) == got.grid

    ref = offload_image(data, tmp_path, trainer_adapter)
    assert ref.grid == want_grid.tolist() and ref.num_placeholders == placeholder.length
    expanded = expand_image_placeholders(prompt, [ref], image_token_id)
    assert expanded == list(out["prompt_token_ids"])
    assert locate_image_runs(expanded, [], image_token_id, counts=[ref.num_placeholders]) == [
        (placeholder.offset, placeholder.length)
    ]


def test_two_images_in_one_prompt_match_vllm(
    default_oracle, trainer_adapter, tokenizer, image_token_id, tmp_path
):
    datas = [image_bytes("chelsea"), image_bytes("rocket")]
    images = [load_image(d) for d in datas]
    prompt = chat_ids(tokenizer, 2)
    out = default_oracle.run(prompt, images)
    refs = [offload_image(d, tmp_path, trainer_adapter) for d in datas]
    for i, image in enumerate(images):
        got = trainer_adapter.process(image, raw_pixels=True)
        assert torch.equal(got.tensors["pixel_values"], out["mm_kwargs"]["image"][i]["pixel_values"].data)
    expanded = expand_image_placeholders(prompt, refs, image_token_id)
    assert expanded == list(out["prompt_token_ids"])
    assert locate_image_runs(expanded, [], image_token_id, counts=[r.num_placeholders for r in refs]) == [
        (p.offset, p.length) for p in out["mm_placeholders"]["image"]
    ]


def test_mm_token_type_ids_match_the_hf_processor(
    model_dir, trainer_adapter, tokenizer, image_token_id, tmp_path
):
    """transformers' get_rope_index needs mm_token_type_ids for these models; the trainer-side HF
    processor's ids and image marks equal what refs + placeholder arithmetic give."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    assert type(processor).__name__ == "Qwen3VLProcessor"
    datas = [image_bytes("astronaut"), image_bytes("coffee")]
    refs = [offload_image(d, tmp_path, trainer_adapter) for d in datas]
    prompt = chat_ids(tokenizer, 2)
    out = processor(
        text=[tokenizer.decode(prompt)], images=[load_image(d) for d in datas], return_tensors="pt"
    )
    expanded = expand_image_placeholders(prompt, refs, image_token_id)
    assert out["input_ids"][0].tolist() == expanded
    types = [0] * len(expanded)
    for start, length in locate_image_runs(
        expanded, [], image_token_id, counts=[r.num_placeholders for r in refs]
    ):
        types[start : start + length] = [1] * length
    assert out["mm_token_type_ids"][0].tolist() == types
    assert out["image_grid_thw"].tolist() == [r.grid for r in refs]


# --- golden numbers, grids, placeholders ---------------------------------------------------------


def test_golden_astronaut_and_sizes(trainer_adapter, server_adapter):
    grid, placeholders, shape = GOLDEN_ASTRONAUT[GOLDEN]
    for adapter in (trainer_adapter, server_adapter):
        got = adapter.process(load_image(image_bytes("astronaut")))
        assert got.grid == grid and got.num_placeholders == placeholders
        assert tuple(got.tensors["pixel_values"].shape) == shape
    for (w, h), want in GOLDEN_SIZES[GOLDEN].items():
        assert trainer_adapter.grid_for_size(w, h) == want, (w, h)


def test_grid_for_size_equals_processed_grid_and_passes_check_grid(trainer_adapter):
    for w, h in GRID_SIZES:
        processed = trainer_adapter.process(Image.new("RGB", (w, h), (10, 120, 230)))
        assert trainer_adapter.grid_for_size(w, h) == processed.grid, (w, h)
        assert trainer_adapter.check_grid(list(processed.grid)) == processed.grid
    axes, most = trainer_adapter.grid_limits()
    with pytest.raises(GridMismatch):
        trainer_adapter.check_grid([1, axes[1] + 1, 2])
    with pytest.raises(GridMismatch):
        trainer_adapter.check_grid([1, 2048, 2048])
    assert most < 2048 * 2048


@settings(max_examples=30, deadline=None)
@given(w=st.integers(1, 6000), h=st.integers(1, 6000))
def test_num_placeholders_equals_vllm_token_count(server_adapter, default_oracle, w, h):
    if max(w, h) / min(w, h) > 200:
        return
    want = default_oracle.processor.info.get_num_image_tokens(
        image_width=w, image_height=h, image_processor=default_oracle.image_processor, mm_kwargs={}
    )
    assert server_adapter.num_placeholders(server_adapter.grid_for_size(w, h)) == want


@pytest.mark.parametrize("case", IMAGE_CASES[:4], ids=CASE_IDS[:4])
def test_zero_features_matches_process(trainer_adapter, case):
    processed = trainer_adapter.process(load_image(image_bytes(*case)))
    synthetic = trainer_adapter.zero_features(processed.grid)
    for name, tensor in processed.tensors.items():
        assert synthetic.tensors[name].shape == tensor.shape and synthetic.tensors[name].dtype == tensor.dtype
    assert not synthetic.tensors["pixel_values"].any()
    assert torch.equal(synthetic.tensors["image_grid_thw"], processed.tensors["image_grid_thw"])
    assert synthetic.num_placeholders == processed.num_placeholders


# --- fingerprints and refs -----------------------------------------------------------------------


def test_fingerprint_server_equals_trainer(server_adapter, trainer_adapter):
    assert server_adapter.backend == trainer_adapter.backend == "torchvision"
    assert server_adapter.fingerprint == trainer_adapter.fingerprint


def test_fingerprints_differ_between_families_with_the_same_processor_config():
    """Qwen3-VL and these three share the tiny image processor config; the family is in the fingerprint."""
    adapters = {f: load_adapter(ensure_tiny_model(f)) for f in (*FAMILIES, "qwen3_vl")}
    assert len({a.fingerprint_fields().__repr__() for a in adapters.values()}) == 1
    assert len({a.fingerprint for a in adapters.values()}) == len(adapters)


def test_a_qwen3_vl_ref_is_refused_by_the_moe_adapter(trainer_adapter, family):
    """Same pixels, other family: refs never cross families."""
    body = RawRefBody(
        family="qwen3_vl",
        modality="image",
        mm_hash="0123456789abcdef" * 2,
        payload={"image_grid_thw": [1, 16, 16]},
        raw_image_uri="file:///data/run_1/assets/images/0123456789abcdef.jpg",
    )
    with pytest.raises(UnsupportedFamily):
        trainer_adapter.check_ref(parse_ref(format_mmraw(body)), ref="r")
    own = parse_ref(format_mmraw(msgspec.structs.replace(body, family=family)))
    assert trainer_adapter.check_ref(own) == (1, 16, 16)
