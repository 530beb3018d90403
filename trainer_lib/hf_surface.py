"""The trainer's door to transformers' internals: every name the trainer reaches beyond the model
API (``from_pretrained``, ``forward``, ``config``), one function each, naming the upstream file
and what the trainer relies on; the private ones say why no public name serves.

The trainer imports these names only from here (``tests/test_vllm_surface.py`` checks it); their
rows (``HF_SURFACE`` in ``upstream/``, the project's one list of upstream names)
are imported and signature-checked against the installed transformers. transformers is imported
when a function is called, not at import.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "attn_implementation",
    "gated_delta_rule_kernels",
    "image_features",
    "model_class",
    "register_attention",
    "sdpa_attention_forward",
    "set_attn_implementation",
    "takes_encoder_outputs",
    "video_features",
]


def attn_implementation(config: Any) -> str:
    """The attention backend the text model runs with: ``config.get_text_config()._attn_implementation``
    (``transformers/configuration_utils.py``). Private: transformers has a setter
    (:func:`set_attn_implementation`) and no public getter."""
    return config.get_text_config()._attn_implementation


def set_attn_implementation(model: Any, backend: str) -> None:
    """``PreTrainedModel.set_attn_implementation`` (``transformers/modeling_utils.py``)."""
    model.set_attn_implementation(backend)


def register_attention(name: str, fn: Callable[..., Any]) -> None:
    """Register an attention function under ``name``: ``AttentionInterface.register`` and
    ``AttentionMaskInterface.register(name, flash_attention_mask)`` (``transformers/utils/generic.py``,
    ``transformers/masking_utils.py``): the model then builds no dense mask for it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, flash_attention_mask)


def sdpa_attention_forward(*args: Any, **kwargs: Any) -> Any:
    """transformers' SDPA attention function (``transformers/integrations/sdpa_attention.py``),
    called as a model's attention layer calls it: ``(module, query, key, value, attention_mask,
    dropout=, scaling=, is_causal=)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

    return sdpa(*args, **kwargs)


def gated_delta_rule_kernels(layer_cls: type) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(causal_conv1d_fn, torch_chunk_gated_delta_rule)`` of a Gated DeltaNet layer's modeling
    module (``transformers/models/qwen3_5/modeling_qwen3_5.py`` and its MoE twin), unwrapped
    (``inspect.unwrap`` skips transformers' kernel dispatch, which would pick ``fla`` or
    ``causal_conv1d`` wherever they import, whether or not they can run). Module-level helpers, not
    an API: the trainer runs them per packed segment because the layer's own forward carries state
    across segments."""
    modeling = sys.modules[layer_cls.__module__]
    return inspect.unwrap(modeling.causal_conv1d_fn), inspect.unwrap(modeling.torch_chunk_gated_delta_rule)


def model_class(config: Any) -> type:
    """The base model class transformers maps a config to (``MODEL_MAPPING``,
    ``transformers/models/auto/modeling_auto.py``): whose ``get_rope_index`` and
    ``get_vision_position_ids`` the trainer binds to a config without building weights."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    return MODEL_MAPPING[type(config)]


def image_features(model: Any, pixel_values: Any, image_grid_thw: Any) -> Any:
    """``model.model.get_image_features(pixel_values, image_grid_thw, return_dict=True)``
    (``transformers/models/qwen2_vl/modeling_qwen2_vl.py`` and the Qwen-VL families after it): the
    vision tower's output, ``pooler_output`` a tuple of per-image embeddings."""
    return model.model.get_image_features(pixel_values, image_grid_thw, return_dict=True)


def video_features(model: Any, pixel_values_videos: Any, video_grid_thw: Any) -> Any:
    """``model.model.get_video_features(pixel_values_videos, video_grid_thw, return_dict=True)``
    (``transformers/models/qwen2_vl/modeling_qwen2_vl.py``, same in Qwen2.5-VL and Qwen3-VL): the
    vision tower on a video's frames, ``pooler_output`` a tuple of per-video embeddings."""
    return model.model.get_video_features(pixel_values_videos, video_grid_thw, return_dict=True)


def takes_encoder_outputs(model: Any) -> bool:
    """Whether ``model.model.forward`` takes precomputed image embeddings (``mm_encoder_outputs``,
    ``transformers/models/qwen2_vl/modeling_qwen2_vl.py``): transformers 5.19 has it in all six
    families that pack; 5.17's Qwen3.5 / Qwen3.5-MoE forwards do not (seen on a lent GPU machine)."""
    return "mm_encoder_outputs" in inspect.signature(model.model.forward).parameters
