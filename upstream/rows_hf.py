"""transformers' rows: every transformers name outside its top-level API that the project relies on
(the trainer's through ``trainer_lib/hf_surface.py``, the adapters', the tests'). Files only in
``used_in``: line numbers drift."""

from __future__ import annotations

from upstream.model import Touchpoint, row

__all__ = ["HF_SURFACE"]

# fmt: off
HF_SURFACE: tuple[Touchpoint, ...] = (
    row("transformers.configuration_utils:PreTrainedConfig._attn_implementation", "attribute",
        "transformers/configuration_utils.py", "trainer_lib/hf_surface.py",
        key="PretrainedConfig._attn_implementation", private=True,
        why=(
            "the attention backend a model runs with; transformers has a setter (set_attn_implementation) "
            "but no public getter"
        )),
    row("transformers.modeling_utils:PreTrainedModel.set_attn_implementation", "method",
        "transformers/modeling_utils.py", "trainer_lib/hf_surface.py", positional=1),
    row("transformers:AttentionInterface.register", "method", "transformers/utils/generic.py",
        "trainer_lib/hf_surface.py", positional=2),
    row("transformers.masking_utils:AttentionMaskInterface", "class", "transformers/masking_utils.py",
        "trainer_lib/hf_surface.py"),
    row("transformers.masking_utils:flash_attention_mask", "function", "transformers/masking_utils.py",
        "trainer_lib/hf_surface.py"),
    row("transformers.integrations.sdpa_attention:sdpa_attention_forward", "function",
        "transformers/integrations/sdpa_attention.py", "trainer_lib/hf_surface.py", positional=5,
        keywords=("dropout", "scaling", "is_causal")),
    row("transformers.models.qwen3_5.modeling_qwen3_5:causal_conv1d_fn", "function",
        "transformers/models/qwen3_5/modeling_qwen3_5.py", "trainer_lib/hf_surface.py",
        reached_as="inspect.unwrap(sys.modules[layer_cls.__module__].causal_conv1d_fn)", positional=4),
    row("transformers.models.qwen3_5.modeling_qwen3_5:torch_chunk_gated_delta_rule", "function",
        "transformers/models/qwen3_5/modeling_qwen3_5.py", "trainer_lib/hf_surface.py",
        reached_as="inspect.unwrap(sys.modules[layer_cls.__module__].torch_chunk_gated_delta_rule)",
        positional=3,
        keywords=("g", "beta", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel")),
    row("transformers.models.auto.modeling_auto:MODEL_MAPPING", "constant",
        "transformers/models/auto/modeling_auto.py", "trainer_lib/hf_surface.py",
        "tests/test_forward.py"),
    row("transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VLModel.get_rope_index", "method",
        "transformers/models/qwen2_vl/modeling_qwen2_vl.py", "trainer_lib/positions.py",
        reached_as="MODEL_MAPPING[type(config)].get_rope_index bound to a config shim"),
    row("transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VLModel.get_vision_position_ids", "method",
        "transformers/models/qwen2_vl/modeling_qwen2_vl.py", "trainer_lib/positions.py"),
    row("transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VLModel.get_image_features", "method",
        "transformers/models/qwen2_vl/modeling_qwen2_vl.py", "trainer_lib/hf_surface.py", positional=2,
        keywords=("return_dict",)),
    row("transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VLModel.get_video_features", "method",
        "transformers/models/qwen2_vl/modeling_qwen2_vl.py", "trainer_lib/hf_surface.py", positional=2,
        keywords=("return_dict",)),
    row("transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VLModel.forward", "method",
        "transformers/models/qwen2_vl/modeling_qwen2_vl.py", "trainer_lib/forward.py",
        reached_as="model.model(..., mm_encoder_outputs={...}, cu_seq_lens_q=..., ...)", positional=0,
        keywords=("input_ids", "position_ids", "attention_mask", "use_cache", "pixel_values",
                  "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_encoder_outputs"),
        named=("mm_encoder_outputs",)),
    row("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:smart_resize", "function",
        "transformers/models/qwen2_vl/image_processing_pil_qwen2_vl.py", "protocol/adapters/qwen_vl.py"),
    row("transformers.image_processing_backends:TorchvisionBackend", "class",
        "transformers/image_processing_backends.py", "protocol/adapters/base.py"),
    row("transformers.image_processing_utils:BaseImageProcessor", "class",
        "transformers/image_processing_utils.py", "protocol/adapters/kimi_vl.py"),
    row("transformers.image_processing_utils:BatchFeature", "class", "transformers/image_processing_base.py",
        "protocol/adapters/kimi_vl.py", key="image_processing_utils.BatchFeature"),
    row("transformers.image_utils:make_flat_list_of_images", "function", "transformers/image_utils.py",
        "protocol/adapters/kimi_vl.py"),
    row("transformers.image_utils:OPENAI_CLIP_MEAN", "constant", "transformers/utils/constants.py",
        "protocol/adapters/kimi_vl.py"),
    row("transformers.image_utils:OPENAI_CLIP_STD", "constant", "transformers/utils/constants.py",
        "protocol/adapters/kimi_vl.py"),
    row("transformers.utils:TensorType", "class", "transformers/utils/generic.py",
        "protocol/adapters/kimi_vl.py"),
    row("transformers.models.kimi_k25.image_processing_kimi_k25:Kimi_K25ImageProcessor", "class",
        "transformers/models/kimi_k25/image_processing_kimi_k25.py", "tests/adapters/test_adapters_kimi.py"),
    row("transformers.models.qwen3_vl.processing_qwen3_vl:Qwen3VLProcessor._calculate_timestamps", "method",
        "transformers/models/qwen3_vl/processing_qwen3_vl.py", "protocol/adapters/video_processing.py",
        key="Qwen3VLProcessor._calculate_timestamps", private=True,
        reached_as="called unbound with None as self (it reads nothing of its instance)",
        why=(
            "Qwen3-VL's per-patch timestamps, which become prompt tokens; vLLM's Qwen3-VL processor "
            "calls its own copy of it, transformers has no public function"
        )),
    row("transformers.video_utils:VideoMetadata", "class", "transformers/video_utils.py",
        "protocol/adapters/video_processing.py"),
    row("transformers.convert_slow_tokenizer:bytes_to_unicode", "function",
        "transformers/convert_slow_tokenizer.py", "scripts/tiny_models/common.py", positional=0),
)
"""transformers names outside its top-level API (``from transformers import X`` names are not
listed), checked against the installed transformers by ``tests/test_vllm_compat.py``."""
# fmt: on
