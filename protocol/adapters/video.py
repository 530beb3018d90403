"""Videos through a family's own HF video processor (issue 44): Qwen2.5-VL, Qwen3-VL and Qwen3.5.

:class:`VideoMixin` gives an adapter a second processor, the model's video processor
(transformers' ``Qwen2VLVideoProcessor`` for Qwen2.5-VL, ``Qwen3VLVideoProcessor`` for Qwen3-VL and
Qwen3.5, loaded with ``AutoVideoProcessor`` or handed over by the server from vLLM), and the one video path
both sides run, as :meth:`~protocol.adapters.base.ImageAdapter.resolve_raw` is for images:

    ref -> check_video_ref (family, fingerprint required, grid bounded)
        -> store read (confined, sha256) -> protocol.videos.load_video (header limits, the
           family's vLLM loader indices, OpenCV frames)
        -> process_video: the HF video processor called as vLLM 0.32 calls it
           (``vllm/model_executor/models/qwen2_5_vl.py::_get_hf_mm_inputs``,
           ``qwen3_vl.py::_call_hf_processor``) -> grid checked against the ref's claim

A video ref always names its fingerprint (:attr:`VideoMixin.video_fingerprint`): the video
processor's pixel fields, the loader's sampling (:class:`protocol.videos.VideoSampling`) and the
decoder (:func:`protocol.videos.decoder_identity`), so the server and the trainer sample the same
frames and the same prompt timestamps or refuse (409 ``fingerprint_mismatch``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from protocol.adapters.offload import RefForm, content_named_ref
from protocol.adapters.values import CheckedRef, ProcessedVideo
from protocol.adapters.video_families import VideoFamily, video_family
from protocol.adapters.video_processing import (
    call_video_processor,
    qwen3_vl_timestamps,
    video_fingerprint_fields,
)
from protocol.errors import FingerprintMismatch, GridMismatch, InvalidRef, UnsupportedFamily, VideoUnreadable
from protocol.fingerprint import layout_fingerprint, library_versions
from protocol.placeholder_counts import video_token_runs
from protocol.refs import ContentRef, RawRefBody, format_mmraw
from protocol.roots import AssetRoot, AssetRoots
from protocol.store import DEFAULT_MAX_VIDEO_BYTES, AssetStore, ImageSource
from protocol.structs import RawMMRef
from protocol.video_header import sniff_video_type
from protocol.videos import (
    DEFAULT_VIDEO_LIMITS,
    DecodedVideo,
    VideoLimits,
    VideoSampling,
    load_video,
)

__all__ = ["VideoMixin"]


class VideoMixin:
    """Video support for an adapter class (mixed into :class:`~protocol.adapters.QwenVLAdapter`).

    Off until :meth:`attach_video` gives it the model's video processor
    (:func:`~protocol.adapters.load_adapter` does for a family of
    :data:`~protocol.adapters.video_families.VIDEO_FAMILIES`).
    """

    family: str
    device: str
    video_processor: Any = None
    """The model's HF video processor; None: this adapter refuses videos."""
    video_sampling: VideoSampling | None = None
    video_fingerprint: str | None = None
    """The fingerprint every video ref of this adapter names (set by :meth:`attach_video`)."""
    video_grid_field: ClassVar[str] = "video_grid_thw"

    @classmethod
    def load_video_processor(cls, model_dir: str | os.PathLike[str]) -> Any:
        """The model folder's video processor (transformers' ``AutoVideoProcessor``, no hub access)."""
        from transformers import AutoVideoProcessor

        return AutoVideoProcessor.from_pretrained(model_dir, local_files_only=True)

    def attach_video(self, video_processor: Any, sampling: VideoSampling | None = None) -> None:
        """Resolve videos with ``video_processor`` and ``sampling`` (default: vLLM 0.32's loader
        defaults for the family).

        Raises:
            UnsupportedFamily: the family has no video path here (not in
                :data:`~protocol.adapters.video_families.VIDEO_FAMILIES`).
        """
        spec = self._video_family()
        self.video_processor = video_processor
        self.video_sampling = sampling or VideoSampling(loader=spec.loader)  # type: ignore[arg-type]
        self.video_fingerprint = layout_fingerprint(
            family=self.family,
            processor_class=type(video_processor).__name__,
            backend="torchvision",
            device=self.device,
            fields=video_fingerprint_fields(video_processor, self.video_sampling),
            versions=library_versions(),
        )

    def _video_family(self) -> VideoFamily:
        return video_family(self.family)

    def _video_processor(self) -> Any:
        if self.video_processor is None:
            self._video_family()
            raise UnsupportedFamily(f"this {self.family} adapter has no video processor (attach_video)")
        return self.video_processor

    # --- grids and placeholders -------------------------------------------------------

    def video_token_id(self, hf_config: Any) -> int:
        """The video placeholder token id (``<|video_pad|>``) from the model's HF config
        (``config.video_token_id``, what transformers' ``get_placeholder_mask`` scatters video rows
        into), as :meth:`placeholder_token_id` gives the image one.

        Raises:
            UnsupportedFamily: no video path for this family or no video processor attached.
        """
        self._video_processor()
        return int(hf_config.video_token_id)

    def video_num_placeholders(self, grid: Sequence[int]) -> int:
        """``<|video_pad|>`` tokens of a video with this ``[t, h, w]`` grid."""
        return sum(self.video_token_runs(grid))

    def video_token_runs(self, grid: Sequence[int]) -> list[int]:
        """The video's placeholder runs in prompt order
        (:func:`protocol.placeholder_counts.video_token_runs`)."""
        spec = self._video_family()
        merge = int(self._video_processor().merge_size)
        return video_token_runs(grid, merge, per_frame=spec.per_frame_runs)

    def video_grid_limits(self) -> tuple[tuple[int, int, int], int]:
        """``((t, h, w) maxima, most patches)`` the video processor can produce: ``t`` from the
        loader's ``max_frames`` (at most 768), each frame bounded as an image of the video
        processor's ``size`` (:meth:`side_limits`)."""
        vp = self._video_processor()
        frames = min(self.video_sampling.max_frames, 768)  # type: ignore[union-attr]
        t = -(-frames // int(vp.temporal_patch_size))
        side, per_frame = self.side_limits(vp.size["shortest_edge"], vp.size["longest_edge"], vp)  # type: ignore[attr-defined]
        return (t, side, side), t * per_frame

    def check_video_grid(self, grid: Sequence[int], *, ref: str | None = None) -> tuple[int, ...]:
        """Bound a video grid claim before anything is sized by it (as ``check_grid`` for images).

        Raises:
            GridMismatch: not 3 positive ints, over :meth:`video_grid_limits`, or ``h``/``w`` not
                multiples of the merge size.
        """
        values = tuple(grid)
        if len(values) != 3 or not all(type(g) is int and g >= 1 for g in values):
            raise GridMismatch(f"video_grid_thw must be 3 positive ints, got {list(values)[:4]}", ref=ref)
        axes, most = self.video_grid_limits()
        patches = values[0] * values[1] * values[2]
        if any(g > m for g, m in zip(values, axes, strict=True)) or patches > most:
            raise GridMismatch(
                f"video_grid_thw {list(values)} ({patches} patches) exceeds what the {self.family} video "
                f"processor can produce (per axis at most {list(axes)}, {most} patches in all)",
                ref=ref,
            )
        merge = int(self._video_processor().merge_size)
        if values[1] % merge or values[2] % merge:
            raise GridMismatch(
                f"video_grid_thw {list(values)}: h and w must be multiples of {merge}", ref=ref
            )
        return values

    def check_video_ref(self, body: RawRefBody | ContentRef, *, ref: str | None = None) -> tuple[int, ...]:
        """Check a video ref against this adapter; return its claimed ``(t, h, w)``.

        Raises:
            InvalidRef: not a video ref, no fingerprint, a v1 payload other than
                ``{"video_grid_thw": [t, h, w]}``.
            UnsupportedFamily: another family, or no video path for this one.
            FingerprintMismatch: the ref names another video fingerprint.
            GridMismatch: see :meth:`check_video_grid`.
        """
        if body.modality != "video":
            raise InvalidRef("an image ref where a video is expected", ref=ref)
        if body.family != self.family:
            raise UnsupportedFamily(
                f"ref family {body.family!r} is not the adapter's {self.family!r}", ref=ref
            )
        self._video_processor()
        if body.fingerprint is None:
            raise InvalidRef("a video ref must name its fingerprint (it decides the frames)", ref=ref)
        if body.fingerprint != self.video_fingerprint:
            raise FingerprintMismatch(
                f"ref fingerprint {body.fingerprint} != {self.family} video fingerprint "
                f"{self.video_fingerprint} "
                "(video processor, frame sampling, decoder or library versions differ)",
                ref=ref,
            )
        if isinstance(body, ContentRef):
            return self.check_video_grid(list(body.grid), ref=ref)
        grid = (
            body.payload.get(self.video_grid_field) if set(body.payload) == {self.video_grid_field} else None
        )
        if not isinstance(grid, list):
            raise InvalidRef(
                f"video payload must be {{'video_grid_thw': [t, h, w]}}, got {str(body.payload)[:120]}",
                ref=ref,
            )
        return self.check_video_grid(grid, ref=ref)

    # --- the pixel path ---------------------------------------------------------------

    def resolve_video(
        self,
        body: RawRefBody | ContentRef | CheckedRef,
        store: ImageSource,
        *,
        ref: str | None = None,
        raw_pixels: bool = False,
        max_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
        limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
    ) -> ProcessedVideo:
        """Resolve a video ref: checks, confined read and sha256, decode, the HF video processor,
        grid check. The one video path of the server and the trainer. A video's
        :class:`~protocol.adapters.values.CheckedRef` is not checked again (its caller ran
        :meth:`check_video_ref`).

        Raises:
            InvalidRef, UnsupportedFamily, FingerprintMismatch, GridMismatch: see :meth:`check_video_ref`.
            AssetOutsideRoot, AssetNotFound, AssetTooLarge, HashMismatch, StoreUnavailable: the read.
            VideoUnreadable, AssetTooLarge: see :func:`protocol.videos.load_video`; the processor
                refused the frames.
            GridMismatch: the processor's grid differs from the ref's claim.
        """
        claimed, decoded, _, sha256 = self.read_video(
            body, store, ref=ref, max_bytes=max_bytes, limits=limits
        )
        processed = self.process_video(decoded, raw_pixels=raw_pixels, ref=ref)
        if processed.grid != claimed:
            raise GridMismatch(
                f"ref claims video_grid_thw {list(claimed)}, processor gives {list(processed.grid)}", ref=ref
            )
        return dataclasses.replace(processed, sha256=sha256)

    def read_video(
        self,
        body: RawRefBody | ContentRef | CheckedRef,
        store: ImageSource,
        *,
        ref: str | None = None,
        max_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
        limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
    ) -> tuple[tuple[int, ...], DecodedVideo, bytes, str]:
        """The first half of :meth:`resolve_video`: ref checks, confined read and sha256, decode.
        Returns ``(claimed grid, decoded frames, the file's bytes, their full sha256)`` (the chat
        route hands the frames to vLLM's own processor).

        Raises:
            See :meth:`resolve_video` (all but the processor's refusals and the grid comparison).
        """
        checked = CheckedRef.of(body, "video", self.check_video_ref, ref)
        data, sha256 = store.read_image(checked.body, max_bytes=max_bytes, ref=ref)
        decoded = load_video(data, self.video_sampling, limits=limits, ref=ref)  # type: ignore[arg-type]
        return checked.grid, decoded, data, sha256

    def process_video(
        self, video: DecodedVideo, *, raw_pixels: bool = False, ref: str | None = None
    ) -> ProcessedVideo:
        """Run the HF video processor on decoded frames, as vLLM 0.32 calls it
        (:func:`protocol.adapters.video_processing.call_video_processor`), with the grid, the
        placeholder count and (per-frame-runs families) Qwen3-VL's per-patch timestamps.

        Args:
            raw_pixels: vLLM's raw uint8 pixels (``mm_device_do_normalize``; the trainer: False).

        Raises:
            VideoUnreadable: the processor refuses the frames (e.g. aspect ratio above 200).
        """
        spec, vp = self._video_family(), self._video_processor()
        try:
            tensors = call_video_processor(vp, spec, video, raw_pixels=raw_pixels)
        except ValueError as e:
            raise VideoUnreadable(f"{self.family} video processor refused the frames: {e}", ref=ref) from e
        grid = tuple(int(g) for g in tensors["video_grid_thw"][0])
        stamps = qwen3_vl_timestamps(video, int(vp.temporal_patch_size)) if spec.per_frame_runs else None
        return ProcessedVideo(
            tensors=tensors,
            grid=grid,
            num_placeholders=self.video_num_placeholders(grid),
            frames_indices=video.indices,
            fps=video.fps,
            timestamps=stamps,
        )

    def offload_video(
        self,
        video: bytes | os.PathLike[str] | str,
        store: AssetStore | AssetRoot | AssetRoots,
        *,
        form: RefForm = "v1",
        limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
    ) -> RawMMRef:
        """Decode and process ``video`` once (its grid is the processor's), store it, return its ref.

        Args:
            video: the file's bytes or a path to it.
            store: as :func:`protocol.adapters.offload.store_and_ref`.
            form: ``"v1"`` (a ``file://`` path: an :class:`AssetStore` only) or ``"v2"``.

        Raises:
            VideoUnreadable, AssetTooLarge: the video cannot be decoded or is over ``limits``;
                nothing is stored then.
            StoreUnavailable, HashMismatch: see :func:`protocol.roots.put_content`.
            ValueError: ``form="v1"`` without an :class:`AssetStore`, or an unknown form.
        """
        if form not in ("v1", "v2"):
            raise ValueError(f"form must be 'v1' or 'v2', got {form!r}")
        if form == "v1" and not isinstance(store, AssetStore):
            raise ValueError("v1 refs name a local file: offload them to an AssetStore, or use form='v2'")
        data = video if isinstance(video, bytes) else Path(video).read_bytes()
        media_type = (sniff_video_type(data) or ("", ""))[0]
        processed = self.process_video(load_video(data, self.video_sampling, limits=limits))  # type: ignore[arg-type]
        ref, sha256 = self._stored_video_ref(data, store, processed.grid, form)
        return RawMMRef(
            ref=ref,
            modality="video",
            sha256=sha256,
            media_type=media_type,
            grid=list(processed.grid),
            num_placeholders=processed.num_placeholders,
        )

    def _stored_video_ref(
        self, data: bytes, store: AssetStore | AssetRoot | AssetRoots, grid: tuple[int, ...], form: RefForm
    ) -> tuple[str, str]:
        """Write ``data`` and format its video ref: ``(ref string, full sha256)``."""
        if form == "v2":
            ref, content = content_named_ref(store, data, self.family, grid, self.video_fingerprint)
            return ref, content.sha256
        assert isinstance(store, AssetStore)
        stored = store.put_video(data)
        raw = RawRefBody(
            family=self.family,
            modality="video",
            mm_hash=stored.mm_hash,
            payload={self.video_grid_field: list(grid)},
            raw_image_uri=stored.uri,
            fingerprint=self.video_fingerprint,
        )
        return format_mmraw(raw), stored.sha256

    def collate_videos(self, items: Sequence[ProcessedVideo]) -> dict[str, torch.Tensor]:
        """Concatenate per-video tensors along dim 0, in order: ``pixel_values_videos``
        ``[sum(t*h*w), C*T*P*P]``, ``video_grid_thw`` int64 ``[N, 3]`` (and ``second_per_grid_ts``
        float32 ``[N]``).

        Raises:
            ValueError: no items.
        """
        if not items:
            raise ValueError("collate_videos() needs at least one video")
        return {k: torch.cat([it.tensors[k] for it in items]) for k in items[0].tensors}
