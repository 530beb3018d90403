"""Qwen3-VL-MoE (e.g. Qwen3-VL-30B-A3B): Qwen3-VL's vision tower and image path, MoE text model.

transformers 5.19 and vLLM 0.32 process its images exactly as Qwen3-VL's
(``Qwen3VLProcessor``, ``Qwen2VLImageProcessor``; vLLM ``Qwen3VLMoeProcessingInfo`` subclasses
``Qwen3VLProcessingInfo`` in ``model_executor/models/qwen3_vl_moe.py``), so every pixel fact
lives in :class:`~protocol.adapters.qwen_vl.QwenVLAdapter`; this class only names the family.
"""

from __future__ import annotations

from typing import ClassVar

from protocol.adapters.qwen_vl import QwenVLAdapter

__all__ = ["Qwen3VLMoeAdapter"]


class Qwen3VLMoeAdapter(QwenVLAdapter):
    """Adapter for ``qwen3_vl_moe`` (``Qwen3VLMoeForConditionalGeneration``)."""

    model_types: ClassVar[tuple[str, ...]] = ("qwen3_vl_moe",)
    linear_attention: ClassVar[bool] = False
    """Full attention in every text layer: packs like Qwen3-VL."""
