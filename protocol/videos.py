"""Decode a video's sampled frames exactly the way vLLM 0.32 does before its HF processor runs.

vLLM's chat route loads a ``video_url`` with ``VideoMediaIO`` (``vllm/multimodal/media/video.py``):
the loader is the one registered for the model's HF video processor
(``vllm/multimodal/video.py``: ``Qwen2VLVideoProcessor`` -> ``"qwen2_vl"``,
``Qwen3VLVideoProcessor`` -> ``"qwen3_vl"``; ``VLLM_VIDEO_LOADER_BACKEND``, default ``"opencv"``,
for the others), and every one of them decodes with OpenCV (``cv2.VideoCapture`` over the bytes,
FFmpeg inside: ``vllm/multimodal/video_decoders/opencv.py``). This module does the same with the
same library, so the server and the trainer see the frames vLLM would:

1. limits on the declared header (:func:`protocol.video_header.read_video_header`: frame size,
   frame count, duration) before FFmpeg sees a byte, then on what OpenCV reports;
2. the frame indices of the family's vLLM loader, computed by vLLM itself (through the upstream
   table: ``VIDEO_LOADER_REGISTRY.load(loader).compute_frames_index_to_sample`` on what
   ``OpenCVVideoBackendMixin.get_video_metadata`` reports, after the loader's ``_prepare_source``);
3. a sequential ``grab`` to the last index, ``retrieve`` of each sampled frame, BGR -> RGB
   (``OpenCVVideoBackendMixin._read_frames_no_recovery``); a sampled frame that does not decode
   is refused (vLLM logs it and carries on with fewer frames: a truncated clip is an error here).

What is ours: the header limits, the stream held alive through ``release`` (vLLM's
``open_video_capture`` does not hold it), and the strict read. The test suite compares indices,
frames and metadata with vLLM's own loaders (``tests/test_video.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from io import BytesIO
from typing import Any, Literal

import numpy as np

from protocol.errors import AssetTooLarge, MMRefError, VideoUnreadable
from protocol.images import DEFAULT_MAX_IMAGE_PIXELS
from protocol.video_header import read_video_header
from upstream import load, video_source

__all__ = [
    "DEFAULT_VIDEO_LIMITS",
    "DecodedVideo",
    "LoaderName",
    "VideoLimits",
    "VideoSampling",
    "decoder_identity",
    "frame_limits",
    "load_video",
    "sample_indices",
]

LoaderName = Literal["qwen2_vl", "qwen3_vl"]
"""vLLM 0.32's video loaders this module mirrors (``VIDEO_LOADER_REGISTRY`` names)."""


@dataclass(frozen=True)
class VideoLimits:
    """What a video may declare and decode to; checked on the header, before decoding."""

    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Pixels per frame (vLLM's ``check_frame_pixel_limit``: ``VLLM_MAX_IMAGE_PIXELS``)."""
    max_frames: int = 108_000
    """Frames the container may declare (an hour at 30 fps)."""
    max_duration_s: float = 3600.0
    """Declared duration, seconds."""
    max_decoded_bytes: int = 1 << 30
    """Bytes of the sampled RGB frames (``frames x height x width x 3``), before they are decoded."""


DEFAULT_VIDEO_LIMITS = VideoLimits()
"""The limits every party applies unless configured otherwise."""


def frame_limits(max_image_pixels: int) -> VideoLimits:
    """:data:`DEFAULT_VIDEO_LIMITS` with the image pixel cap applied to every frame, as vLLM's
    ``check_frame_pixel_limit`` applies ``VLLM_MAX_IMAGE_PIXELS``: the server (``MMREF_MAX_IMAGE_PIXELS``)
    and the trainer (``MaterializeOptions.max_image_pixels``) read videos under the same limits."""
    return dataclasses.replace(DEFAULT_VIDEO_LIMITS, max_pixels=max_image_pixels)


@dataclass(frozen=True)
class VideoSampling:
    """Which frames a loader takes: vLLM 0.32's loader defaults for the family (the loader's
    ``load_bytes`` keyword defaults and ``kwargs.get`` fallbacks; ``--media-io-kwargs`` can change
    them on a server, and then the ref's fingerprint no longer matches)."""

    loader: LoaderName
    fps: float = 2.0
    """Target frames per second (both loaders' ``fps=2`` default)."""
    min_frames: int = 4
    max_frames: int = 768
    temporal_patch_size: int = 2
    """Qwen2-VL's loader floors the frame count to a multiple of it (``kwargs.get(..., 2)``)."""

    def fields(self) -> dict[str, Any]:
        """The fields, for a fingerprint."""
        return {
            "loader": self.loader,
            "fps": self.fps,
            "min_frames": self.min_frames,
            "max_frames": self.max_frames,
            "temporal_patch_size": self.temporal_patch_size,
        }


@dataclass(frozen=True)
class DecodedVideo:
    """A video's sampled frames and the metadata vLLM's loader gives with them."""

    frames: np.ndarray
    """uint8 ``[N, H, W, 3]`` RGB, the sampled frames in order."""
    total_frames: int
    """Frames of the whole video (OpenCV's count, corrected for a hidden lead-in as vLLM does)."""
    fps: float
    """The source's frame rate (0.0 when unknown: the Qwen3-VL loader then assumes 24)."""
    duration_s: float
    """``total_frames / fps`` (0.0 when ``fps`` is 0)."""
    indices: tuple[int, ...]
    """The sampled frame indices (``frames_indices``)."""

    def hf_metadata(self) -> dict[str, Any]:
        """vLLM's metadata dict (``VideoLoader.create_hf_metadata``): ``total_num_frames``, ``fps``,
        ``duration``, ``video_backend``, ``frames_indices``, ``do_sample_frames``."""
        return {
            "total_num_frames": self.total_frames,
            "fps": self.fps,
            "duration": self.duration_s,
            "video_backend": "opencv",
            "frames_indices": list(self.indices),
            "do_sample_frames": len(self.indices) == self.total_frames,
        }


def decoder_identity() -> dict[str, str]:
    """The decoder that computes frames, for fingerprints: OpenCV's version and its FFmpeg
    (``opencv-python-headless`` bundles both; vLLM 0.32 requires ``>=4.13.0``)."""
    import cv2

    try:
        wheel = importlib_metadata.version("opencv-python-headless")
    except importlib_metadata.PackageNotFoundError:
        wheel = "absent"
    api = load("OpenCVVideoBackendMixin.get_cv2_video_api")()
    name = "none" if api is None else cv2.videoio_registry.getBackendName(api)
    return {"decoder": "opencv", "opencv": cv2.__version__, "wheel": wheel, "api": name}


def sample_indices(sampling: VideoSampling, total: int, fps: float) -> list[int]:
    """The frame indices the family's vLLM loader takes from a video of ``total`` frames at ``fps``
    (0.0: unknown): vLLM's own ``compute_frames_index_to_sample``.

    Raises:
        VideoUnreadable: no frames, or (Qwen2-VL's loader) an unknown source fps or fewer frames
            than a temporal patch.
    """
    source = load("VideoSourceMetadata")(total, fps, total / fps if fps > 0 else 0.0)
    return _indices(sampling, source, None)


def _loader(sampling: VideoSampling) -> Any:
    """vLLM's loader registered under ``sampling.loader`` (``VIDEO_LOADER_REGISTRY.load``)."""
    return load("VIDEO_LOADER_REGISTRY").load(sampling.loader)


def _indices(sampling: VideoSampling, source: Any, ref: str | None) -> list[int]:
    """``loader.compute_frames_index_to_sample(source, target, **sampling kwargs)`` on a
    ``VideoSourceMetadata``, as vLLM's decoder calls it; its refusals as VideoUnreadable."""
    if source.total_frames_num < 1:
        raise VideoUnreadable("the video has no frames", ref=ref)
    # VideoMediaIO's num_frames and max_duration are ignored by both Qwen loaders
    target = load("VideoTargetMetadata")(num_frames=-1, fps=sampling.fps, max_duration=300)
    try:
        indices = _loader(sampling).compute_frames_index_to_sample(
            source,
            target,
            min_frames=sampling.min_frames,
            max_frames=sampling.max_frames,
            temporal_patch_size=sampling.temporal_patch_size,
        )
    except ZeroDivisionError as e:  # Qwen2-VL's loader: no temporal patch fits (a 1-frame clip)
        raise VideoUnreadable(
            f"a {source.total_frames_num}-frame video gives no {sampling.loader} temporal patch "
            f"of {sampling.temporal_patch_size}",
            ref=ref,
        ) from e
    except ValueError as e:  # Qwen2-VL's loader: an unknown source fps
        raise VideoUnreadable(str(e), ref=ref) from e
    return [int(i) for i in indices]


def load_video(
    data: bytes,
    sampling: VideoSampling,
    *,
    limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
    ref: str | None = None,
) -> DecodedVideo:
    """Decode the frames ``sampling`` takes from ``data``, as vLLM's loader does.

    Args:
        data: the file's bytes (MP4 or QuickTime).
        sampling: the family's loader settings.
        limits: checked on the declared header, then on OpenCV's view, before decoding.
        ref: the ref named in errors.

    Raises:
        VideoUnreadable: see :func:`protocol.video_header.read_video_header`; OpenCV cannot open
            it; a sampled frame does not decode (truncated or corrupt).
        AssetTooLarge: a frame size, frame count, duration or sampled-frame bytes over ``limits``.
    """
    header = read_video_header(data, ref=ref)
    _check_limits(header.width, header.height, header.frames, header.duration_s, limits, ref)
    try:
        return _decode(data, sampling, limits, ref)
    except (MMRefError, MemoryError):
        raise
    except Exception as e:  # cv2.error, ValueError, ...: whatever the decoder raises
        raise VideoUnreadable(f"cannot decode video ({len(data)} bytes): {e}", ref=ref) from e


def _check_limits(
    width: int, height: int, frames: int, duration_s: float, limits: VideoLimits, ref: str | None
) -> None:
    """AssetTooLarge for a declared size over ``limits``; VideoUnreadable for an empty one."""
    if width < 1 or height < 1 or frames < 1:
        raise VideoUnreadable(f"the video declares {width}x{height} pixels and {frames} frames", ref=ref)
    if limits.max_pixels > 0 and width * height > limits.max_pixels:
        raise AssetTooLarge(
            f"video frames are {width}x{height} = {width * height} pixels, limit {limits.max_pixels}", ref=ref
        )
    if frames > limits.max_frames:
        raise AssetTooLarge(f"video declares {frames} frames, limit {limits.max_frames}", ref=ref)
    if not duration_s <= limits.max_duration_s:
        raise AssetTooLarge(
            f"video declares {duration_s:.1f} s, limit {limits.max_duration_s:.1f} s", ref=ref
        )


def _decode(data: bytes, sampling: VideoSampling, limits: VideoLimits, ref: str | None) -> DecodedVideo:
    """Open with OpenCV, check its view against ``limits``, sample, read the sampled frames."""
    import cv2

    stream = BytesIO(data)  # held until the capture is released: OpenCV reads it through to the end
    cap = cv2.VideoCapture(stream, load("OpenCVVideoBackendMixin.get_cv2_video_api")(), [])
    try:
        if not cap.isOpened():
            raise VideoUnreadable("OpenCV could not open the video stream", ref=ref)
        width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        reported = load("OpenCVVideoBackendMixin.get_video_metadata")(cap)
        _check_limits(width, height, reported.total_frames_num, reported.duration, limits, ref)
        source = video_source(_loader(sampling), reported)  # Qwen3-VL: an unknown fps is 24
        indices = _indices(sampling, source, ref)
        if len(indices) * width * height * 3 > limits.max_decoded_bytes:
            raise AssetTooLarge(
                f"{len(indices)} sampled {width}x{height} frames exceed {limits.max_decoded_bytes} bytes",
                ref=ref,
            )
        frames = _read(cap, indices, width, height, ref)
    finally:
        cap.release()
    kept = tuple(sorted(set(indices)))  # vLLM's valid_frame_indices: each index read once
    return DecodedVideo(
        frames=frames,
        total_frames=source.total_frames_num,
        fps=float(source.original_fps),
        duration_s=float(source.duration),
        indices=kept,
    )


def _read(cap: Any, indices: list[int], width: int, height: int, ref: str | None) -> np.ndarray:
    """``_read_frames_no_recovery``: grab every frame up to the last index, retrieve the sampled
    ones as RGB. Raises VideoUnreadable where one does not decode."""
    import cv2

    wanted = sorted(set(indices))
    frames = np.empty((len(wanted), height, width, 3), dtype=np.uint8)
    k = 0
    for idx in range(wanted[-1] + 1):
        if not cap.grab():
            raise VideoUnreadable(f"frame {idx} of the video does not decode (truncated or corrupt)", ref=ref)
        if idx == wanted[k]:
            ok, frame = cap.retrieve()
            if not ok or frame is None or frame.shape != (height, width, 3):
                raise VideoUnreadable(f"frame {idx} of the video does not decode", ref=ref)
            frames[k] = cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
            k += 1
    return frames
