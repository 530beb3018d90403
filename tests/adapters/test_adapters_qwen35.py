"""Qwen3.5, Qwen3.5-MoE and Qwen3-VL-MoE adapters: what only these families have.

The contract every family keeps against vLLM's own processor (``helpers.oracles``: bit-identical
pixels in both modes, grids, counts, zero features, fingerprints, offload) is
``test_adapters_contract.py``; their golden grids (Qwen3-VL's) are ``test_adapters_qwen.py``'s.
Here: the registry rows and what vLLM resolves for them (Qwen3-VL's processor), their tokenizer,
the trainer-side HF processor (``Qwen3VLProcessor``) marking the same image positions in
``mm_token_type_ids`` that the packing derives from the refs, the grid limits, refs that
never cross families, and Qwen3.5's video path (Qwen3-VL's video processor and loader, a
fingerprint naming the video processor's settings; ``tests/test_video.py`` holds its tensors to
vLLM's).
"""

from __future__ import annotations

import json

import msgspec
import pytest

from helpers import chat_ids, ensure_tiny_model, image_bytes
from protocol.adapters import (
    VIDEO_FAMILIES,
    Qwen3VLMoeAdapter,
    Qwen35Adapter,
    QwenVLAdapter,
    adapter_class,
    load_adapter,
    offload_image,
)
from protocol.adapters.video_processing import VIDEO_FIELDS
from protocol.errors import GridMismatch, UnsupportedFamily
from protocol.images import load_image
from protocol.placeholders import expand_image_placeholders, locate_image_runs
from protocol.refs import RawRefBody, format_mmraw, parse_ref

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")
ADAPTER_CLASS = {"qwen3_5": Qwen35Adapter, "qwen3_5_moe": Qwen35Adapter, "qwen3_vl_moe": Qwen3VLMoeAdapter}
ARCHITECTURE = {  # transformers' and vLLM's class for each model type
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    """The family of ``conftest.py``'s fixtures (``model_dir``, ``trainer_adapter``...)."""
    return request.param


# --- registry and what vLLM resolves --------------------------------------------------------------


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


# --- the trainer-side HF processor ----------------------------------------------------------------


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


# --- grids ----------------------------------------------------------------------------------------


def test_check_grid_refuses_grids_over_the_limits(trainer_adapter):
    """(Every processed grid passes: the contract's grid test.)"""
    axes, most = trainer_adapter.grid_limits()
    with pytest.raises(GridMismatch):
        trainer_adapter.check_grid([1, axes[1] + 1, 2])
    with pytest.raises(GridMismatch):
        trainer_adapter.check_grid([1, 2048, 2048])
    assert most < 2048 * 2048


# --- fingerprints and refs ------------------------------------------------------------------------


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


# --- videos ---------------------------------------------------------------------------------------


def test_qwen35_videos_take_qwen3_vls_path_and_name_its_settings(family, default_oracle, trainer_adapter):
    """Qwen3.5 and Qwen3.5-MoE: vLLM's processor holds transformers' ``Qwen3VLVideoProcessor`` and loads its
    clips with the loader registered for it (``qwen3_vl``); the adapter's video fingerprint hashes
    that processor's frame- and pixel-deciding fields, so a change of any of them is another
    fingerprint. Qwen3-VL-MoE has no video path yet: refused, typed."""
    import copy

    from vllm.multimodal.video import get_video_loader_backend_for_processor

    if family not in VIDEO_FAMILIES:
        assert trainer_adapter.video_fingerprint is None
        with pytest.raises(UnsupportedFamily, match="not supported"):
            trainer_adapter.video_token_runs([2, 4, 4])
        return
    served = default_oracle.processor.info.get_hf_processor().video_processor
    assert type(served).__name__ == type(trainer_adapter.video_processor).__name__ == "Qwen3VLVideoProcessor"
    assert get_video_loader_backend_for_processor(type(served).__name__) == VIDEO_FAMILIES[family].loader
    assert trainer_adapter.video_sampling.loader == "qwen3_vl"
    assert trainer_adapter.video_fingerprint not in (None, trainer_adapter.fingerprint)
    assert trainer_adapter.video_token_runs([2, 4, 6]) == [6, 6]  # one run per temporal patch
    for name, value in (
        ("fps", 1),
        ("max_frames", 64),
        ("size", {"shortest_edge": 4096, "longest_edge": 8192}),
    ):
        assert name in VIDEO_FIELDS
        other = load_adapter(ensure_tiny_model(family))
        changed = copy.deepcopy(other.video_processor)
        setattr(changed, name, value)
        other.attach_video(changed)
        assert other.video_fingerprint != trainer_adapter.video_fingerprint, name
