"""The HF video processor, called as vLLM 0.32 calls it, and the fields of its fingerprint.

What :class:`~protocol.adapters.video.VideoMixin` runs on decoded frames: transformers'
``Qwen2VLVideoProcessor`` (Qwen2.5-VL) or ``Qwen3VLVideoProcessor`` (Qwen3-VL, Qwen3.5) with the
loader's ``VideoMetadata`` (``vllm/model_executor/models/qwen2_5_vl.py::_get_hf_mm_inputs``,
``qwen3_vl.py::_call_hf_processor``), and the one processor-level fact computed beside it per
family: Qwen2.5-VL's ``second_per_grid_ts``, Qwen3-VL's per-patch timestamps.
"""

from __future__ import annotations

from typing import Any

import torch

from protocol.adapters.pixel_fields import QWEN_PIXEL_FIELDS, processor_fields
from protocol.adapters.video_families import VideoFamily
from protocol.videos import DecodedVideo, VideoSampling, decoder_identity

__all__ = ["VIDEO_FIELDS", "call_video_processor", "qwen3_vl_timestamps", "video_fingerprint_fields"]

VIDEO_FIELDS = (
    *QWEN_PIXEL_FIELDS,
    "do_sample_frames",
    "fps",
    "num_frames",
    "min_frames",
    "max_frames",
    "cap_pixels_per_frame",
    "max_video_tokens",
)
"""Video processor fields that change frames, pixels or grids (fingerprinted): the image
processor's pixel fields, then the frame-sampling ones."""


def video_fingerprint_fields(video_processor: Any, sampling: VideoSampling) -> dict[str, Any]:
    """What a video fingerprint hashes beside the family and versions: :data:`VIDEO_FIELDS` of
    ``video_processor``, the loader's ``sampling`` and the decoder
    (:func:`protocol.videos.decoder_identity`)."""
    fields = processor_fields(video_processor, VIDEO_FIELDS)
    fields["sampling"] = sampling.fields()
    fields["decoder"] = decoder_identity()
    return fields


def qwen3_vl_timestamps(video: DecodedVideo, temporal_patch_size: int) -> tuple[float, ...]:
    """Qwen3-VL's per-patch timestamps: transformers' ``Qwen3VLProcessor._calculate_timestamps``
    (a method that reads nothing of its instance) on the sampled indices at the source fps, as
    vLLM's ``Qwen3VLProcessingInfo._get_video_second_idx`` calls its copy of it."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    fps = video.fps if video.fps > 0 else 24.0  # vLLM's Qwen3-VL loader: an unknown fps is 24
    return tuple(Qwen3VLProcessor._calculate_timestamps(None, list(video.indices), fps, temporal_patch_size))


def call_video_processor(
    video_processor: Any, spec: VideoFamily, video: DecodedVideo, *, raw_pixels: bool
) -> dict[str, torch.Tensor]:
    """Run ``video_processor`` on one decoded clip as vLLM 0.32 does: the frames with their loader
    metadata (``VideoMetadata``, ``do_sample_frames`` left out); a per-frame-runs family (Qwen3-VL)
    with ``do_sample_frames`` from the loader (``len(frames) == total``); Qwen2.5-VL's
    ``second_per_grid_ts = temporal_patch_size / sampled_fps`` (``Qwen2_5_VLProcessor._process_videos``).

    Args:
        raw_pixels: vLLM's raw uint8 pixels (``mm_device_do_normalize``; the trainer: False).

    Returns:
        ``pixel_values_videos`` ``[t*h*w, C*T*P*P]``, ``video_grid_thw`` int64 ``[1, 3]`` (and
        ``second_per_grid_ts`` float32 ``[1]``).

    Raises:
        ValueError: the processor refuses the frames (e.g. aspect ratio above 200).
    """
    from transformers.video_utils import VideoMetadata

    meta = video.hf_metadata()
    kwargs: dict[str, Any] = {"return_tensors": "pt", "return_metadata": True}
    if raw_pixels:
        kwargs.update(do_rescale=False, do_normalize=False)
    if spec.per_frame_runs:
        kwargs["do_sample_frames"] = meta["do_sample_frames"]
    md = VideoMetadata(**{k: v for k, v in meta.items() if k != "do_sample_frames"})
    out = video_processor(videos=[video.frames], video_metadata=[md], **kwargs)
    tensors = {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": out["video_grid_thw"]}
    if spec.second_per_grid_ts:
        sampled = out["video_metadata"][0].sampled_fps
        tensors["second_per_grid_ts"] = torch.tensor(
            [video_processor.temporal_patch_size / sampled], dtype=torch.float32
        )
    return tensors
