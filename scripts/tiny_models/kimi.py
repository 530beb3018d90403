"""Tiny Kimi families (docs/KIMI.md): config, tokenizer, processor config; no weights.

transformers 5.19 writes Kimi K2.5 weights under names vLLM cannot load, so vLLM serves these
folders with ``load_format="dummy"`` (random weights of its own). Their text model is a 2-layer
dense MLA DeepSeek (latent 512 + rope 64: the only shape vLLM's CPU MLA kernel takes).

- ``kimi_k25`` (Kimi K2.5) needs no remote code (vLLM ships its processor).
- ``kimi_vl`` (Kimi-VL): its HF processor is remote code, so the folder carries
  ``processing_kimi_vl.py`` / ``image_processing_kimi_vl.py`` (the image processor is
  ``protocol.adapters.kimi_vl.KimiVLImageProcessor``, so mmref must be importable) and loads
  with ``trust_remote_code`` only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiny_models.common import HALF, VOCAB_SIZE, build_tokenizer

# Kimi's special tokens (Moonshot's tiktoken vocabulary has them at 163xxx), ids 256.. in order.
KIMI_SPECIAL_TOKENS: tuple[str, ...] = (
    "[BOS]",
    "[EOS]",
    "[PAD]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_begin|>",  # Kimi K2.5 opens an image with it
    "<|media_start|>",  # Kimi-VL opens an image with it
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
)
KIMI_TOKEN_IDS: dict[str, int] = {token: 256 + i for i, token in enumerate(KIMI_SPECIAL_TOKENS)}

# Kimi's chat format, one ``<|media_pad|>`` per image (vLLM expands it); ``{media}`` is the
# family's image-opening token, as in vLLM's ``get_placeholder_str`` for each model.
KIMI_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>{% endif %}"
    "<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|{media}|>image<|media_content|><|media_pad|><|media_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def _kimi_text_config(model_type: str) -> dict[str, Any]:
    """A 2-layer dense DeepSeek MLA text model (``first_k_dense_replace`` = all layers: no MoE).

    ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = 576 is the only latent size vLLM's CPU MLA
    kernel supports (``vllm/v1/attention/backends/mla/cpu_mla.py``).
    """
    return {
        "model_type": model_type,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 2,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "rope_theta": 50000.0,
        "max_position_embeddings": 4096,
        "bos_token_id": KIMI_TOKEN_IDS["[BOS]"],
        "eos_token_id": KIMI_TOKEN_IDS["<|im_end|>"],
        "pad_token_id": KIMI_TOKEN_IDS["[PAD]"],
    }


_KIMI_VISION = {
    "patch_size": 14,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "merge_kernel_size": [2, 2],
}
# Image budget: 1024 patches (256 merged tokens) per image, 64 patches per side for Kimi K2.5.
KIMI_PATCH_LIMIT = 1024

KIMI_SPECS: dict[str, dict[str, Any]] = {
    "kimi_k25": {
        "config": {
            "model_type": "kimi_k25",
            "architectures": ["KimiK25ForConditionalGeneration"],
            "text_config": _kimi_text_config("deepseek_v3"),
            "vision_config": {**_KIMI_VISION, "pos_emb_height": 64, "pos_emb_width": 64, "pos_emb_time": 4},
            "image_token_id": KIMI_TOKEN_IDS["<|media_pad|>"],
            "video_token_id": KIMI_TOKEN_IDS["<|kimi_k25_video_placeholder|>"],
            "vision_start_token_id": KIMI_TOKEN_IDS["<|media_begin|>"],
            "vision_end_token_id": KIMI_TOKEN_IDS["<|media_end|>"],
            "use_unified_vision_chunk": True,
            "video_placeholder": "<|kimi_k25_video_placeholder|>",
            "bos_token_id": KIMI_TOKEN_IDS["[BOS]"],
            "eos_token_id": KIMI_TOKEN_IDS["<|im_end|>"],
            "pad_token_id": KIMI_TOKEN_IDS["[PAD]"],
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        },
        # vLLM's KimiK25FusedVisionProcessor reads this section (Moonshot's field names).
        "preprocessor": {
            "media_proc_cfg": {
                "patch_size": 14,
                "merge_kernel_size": 2,
                "in_patch_limit": KIMI_PATCH_LIMIT,
                "patch_limit_on_one_side": 64,
                "fixed_output_tokens": None,
                "image_mean": HALF,
                "image_std": HALF,
                "in_patch_limit_each_frame": KIMI_PATCH_LIMIT,
                "in_patch_limit_video": None,
                "sample_fps": 2.0,
                "max_num_frames_each_video": None,
                "temporal_merge_kernel_size": 4,
                "timestamp_mode": "hh:mm:ss.fff",
            },
        },
        "media_token": "media_begin",
    },
    "kimi_vl": {
        "config": {
            "model_type": "kimi_vl",
            "architectures": ["KimiVLForConditionalGeneration"],
            "text_config": _kimi_text_config("deepseek_v2"),
            "vision_config": {**_KIMI_VISION, "init_pos_emb_height": 64, "init_pos_emb_width": 64},
            "media_placeholder_token_id": KIMI_TOKEN_IDS["<|media_pad|>"],
            "bos_token_id": KIMI_TOKEN_IDS["[BOS]"],
            "eos_token_id": KIMI_TOKEN_IDS["<|im_end|>"],
            "pad_token_id": KIMI_TOKEN_IDS["[PAD]"],
            "torch_dtype": "float32",
        },
        # Field names of Moonshot's KimiVLImageProcessor (pad_input as in the released checkpoints).
        "preprocessor": {
            "image_processor_type": "KimiVLImageProcessor",
            "processor_class": "KimiVLProcessor",
            "auto_map": {
                "AutoImageProcessor": "image_processing_kimi_vl.KimiVLImageProcessor",
                "AutoProcessor": "processing_kimi_vl.KimiVLProcessor",
            },
            "patch_size": 14,
            "pad_input": True,
            "in_token_limit": KIMI_PATCH_LIMIT,
            "merge_kernel_size": [2, 2],
            "image_mean": HALF,
            "image_std": HALF,
        },
        "media_token": "media_start",
    },
}

# The remote code of the tiny Kimi-VL folder (a real checkpoint ships Moonshot's).
KIMI_VL_REMOTE_CODE: dict[str, str] = {
    "image_processing_kimi_vl.py": (
        '"""Kimi-VL image processor: mmref\'s transcription of Moonshot\'s (protocol.adapters.kimi_vl)."""\n'
        "\n"
        "from protocol.adapters.kimi_vl import KimiVLImageProcessor\n"
        "\n"
        '__all__ = ["KimiVLImageProcessor"]\n'
    ),
    "processing_kimi_vl.py": '''"""Kimi-VL processor: images processed, each <|media_pad|> expanded."""

from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin


class KimiVLProcessor(ProcessorMixin):
    attributes = ["image_processor", "tokenizer"]
    image_processor_class = "AutoImageProcessor"
    tokenizer_class = "AutoTokenizer"

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = "<|media_pad|>"
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    def __call__(self, images=None, text=None, return_tensors=None, **kwargs):
        image_inputs = {}
        if images is not None:
            image_inputs = self.image_processor.preprocess(images, return_tensors=return_tensors)
        if text is None:
            return BatchFeature(data=dict(image_inputs), tensor_type=return_tensors)
        text = [text] if isinstance(text, str) else list(text)
        if images is not None:
            kh, kw = self.image_processor.merge_kernel_size
            counts = [(int(h) // kh) * (int(w) // kw) for h, w in image_inputs["image_grid_hws"].tolist()]
            for i, t in enumerate(text):
                parts = t.split(self.image_token)
                text[i] = parts[0] + "".join(self.image_token * counts.pop(0) + p for p in parts[1:])
        text_inputs = self.tokenizer(text, **kwargs)
        return BatchFeature(data={**text_inputs, **image_inputs}, tensor_type=return_tensors)
''',
}


def recipe(family: str) -> dict[str, Any]:
    """Everything besides version, family and seed that determines ``family``'s directory."""
    return {
        "spec": KIMI_SPECS[family],
        "special_tokens": KIMI_SPECIAL_TOKENS,
        "chat_template": KIMI_CHAT_TEMPLATE,
        "remote_code": KIMI_VL_REMOTE_CODE if family == "kimi_vl" else None,
    }


def write_model(family: str, out_dir: Path) -> None:
    """Write a Kimi model directory (config, tokenizer, processor config; no weights) into ``out_dir``."""
    spec = KIMI_SPECS[family]
    (out_dir / "config.json").write_text(json.dumps(spec["config"], indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(json.dumps(spec["preprocessor"], indent=2) + "\n")
    tokenizer = build_tokenizer(
        KIMI_SPECIAL_TOKENS,
        eos_token="<|im_end|>",
        pad_token="[PAD]",
        chat_template=KIMI_CHAT_TEMPLATE.replace("{media}", spec["media_token"]),
    )
    tokenizer.save_pretrained(out_dir)
    if family == "kimi_vl":
        for name, code in KIMI_VL_REMOTE_CODE.items():
            (out_dir / name).write_text(code)
        tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
        tokenizer_config["auto_map"] = {"AutoProcessor": "processing_kimi_vl.KimiVLProcessor"}
        tokenizer_config["processor_class"] = "KimiVLProcessor"
        (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
