"""Qwen3.5 and Qwen3.5-MoE (Qwen3.6 checkpoints share both architectures): Qwen3-VL's image path.

transformers 5.19 maps ``qwen3_5`` and ``qwen3_5_moe`` to ``Qwen3VLProcessor``
(``models/auto/processing_auto.py``) whose image processor is ``Qwen2VLImageProcessor`` with
Qwen3-VL's config (patch 16, merge 2, mean/std 0.5); vLLM 0.32 serves both through
``Qwen3VLMultiModalProcessor`` (``model_executor/models/qwen3_5.py``), with ``pixel_values``
flat by grid product, ``image_grid_thw`` per image, ``t*h*w // merge**2`` ``<|image_pad|>``
tokens per image and ``mm_device_do_normalize`` on by default. Every pixel fact therefore lives in
:class:`~protocol.adapters.qwen_vl.QwenVLAdapter`; this class only names the families. Videos take
Qwen3-VL's path too (``Qwen3VLVideoProcessor``, vLLM's ``qwen3_vl`` loader, one placeholder run per
temporal patch after its timestamp: :data:`~protocol.adapters.video_families.VIDEO_FAMILIES`).
"""

from __future__ import annotations

from typing import ClassVar

from protocol.adapters.qwen_vl import QwenVLAdapter

__all__ = ["Qwen35Adapter"]


class Qwen35Adapter(QwenVLAdapter):
    """Adapter for ``qwen3_5`` (``Qwen3_5ForConditionalGeneration``) and ``qwen3_5_moe``
    (``Qwen3_5MoeForConditionalGeneration``)."""

    model_types: ClassVar[tuple[str, ...]] = ("qwen3_5", "qwen3_5_moe")
    linear_attention: ClassVar[bool] = True
    """The text model mixes Gated DeltaNet (``linear_attention``) layers with full attention
    (``text_config.layer_types``): their conv and recurrent state flow across packed samples
    unless run per segment (:mod:`trainer_lib.linear_attention`)."""
