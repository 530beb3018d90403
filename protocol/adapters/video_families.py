"""The families whose videos this version resolves, in one table keyed by HF ``model_type``.

Each row says how vLLM 0.32 serves the family's videos: which video loader its video processor is
registered for (``VIDEO_LOADER_REGISTRY`` in ``vllm/multimodal/video.py``), how its placeholders
run in the prompt, and whether its model takes ``second_per_grid_ts``.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import UnsupportedFamily

__all__ = ["VIDEO_FAMILIES", "VideoFamily", "video_family"]


@dataclass(frozen=True)
class VideoFamily:
    """How vLLM 0.32 serves one family's videos."""

    loader: str
    """The vLLM video loader registered for its video processor (:data:`protocol.videos.LoaderName`)."""
    per_frame_runs: bool
    """Placeholders as one run per temporal patch, each after a timestamp (Qwen3-VL, Qwen3.5)."""
    second_per_grid_ts: bool
    """The model takes ``second_per_grid_ts`` (Qwen2.5-VL's MRoPE time axis)."""


_QWEN3_VL = VideoFamily(loader="qwen3_vl", per_frame_runs=True, second_per_grid_ts=False)

VIDEO_FAMILIES: dict[str, VideoFamily] = {
    "qwen2_5_vl": VideoFamily(loader="qwen2_vl", per_frame_runs=False, second_per_grid_ts=True),
    "qwen3_vl": _QWEN3_VL,
    # vLLM 0.32 serves Qwen3.5 and Qwen3.5-MoE with Qwen3-VL's processor (model_executor/models/
    # qwen3_5.py registers Qwen3VLMultiModalProcessor for both), transformers gives them
    # Qwen3VLVideoProcessor: Qwen3-VL's video path.
    "qwen3_5": _QWEN3_VL,
    "qwen3_5_moe": _QWEN3_VL,  # also Qwen3.6-35B-A3B; the same registration (Qwen3_5MoeProcessingInfo)
}
"""Families whose videos this version resolves (Qwen2-VL and Qwen3-VL-MoE: not yet)."""


def video_family(family: str) -> VideoFamily:
    """The row of ``family``.

    Raises:
        UnsupportedFamily: no video path for ``family`` here; the message lists the supported ones.
    """
    spec = VIDEO_FAMILIES.get(family)
    if spec is None:
        raise UnsupportedFamily(
            f"videos are not supported for {family!r} yet; supported: {sorted(VIDEO_FAMILIES)}"
        )
    return spec
