"""Videos by reference (issue 44, part 1): the decoder, the store, the adapters, the trainer's pixels.

The oracle is vLLM 0.32 itself, in process, no server: its chat-route loader
(``VideoMediaIO`` with the loader registered for the model's video processor) on the clip's bytes,
then ``MULTIMODAL_REGISTRY.create_processor(ModelConfig(...))`` on the loaded frames, as
``tests/test_adapters_qwen.py`` does for images. The clip by ref, resolved by an adapter built the
way the server builds it (vLLM's own processors) and the way the trainer builds it
(``load_adapter``), must give the same tensors (max |diff| 0), grid and placeholder count.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from video_clips import clip_bytes, with_box_field

from helpers import ensure_tiny_model, photo_bytes
from protocol.adapters import VIDEO_FAMILIES, adapter_class, load_adapter, offload_image, offload_video
from protocol.errors import (
    AssetNotFound,
    AssetTooLarge,
    FingerprintMismatch,
    InvalidRef,
    UnsupportedFamily,
    VideoUnreadable,
)
from protocol.refs import ContentRef, format_content_ref, parse_ref
from protocol.store import AssetStore
from protocol.structs import TrainingSample
from protocol.video_header import read_video_header
from protocol.videos import VideoLimits, VideoSampling, load_video, sample_indices
from trainer_lib import MaterializeOptions, materialize

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
CLIPS = [("astronaut", 8, 2), ("coffee", 30, 1), ("chelsea", 3, 3), ("rocket", 25, 4)]


# --- the oracle: vLLM's loader and processor, in process -----------------------------------------


@functools.cache
def vllm_processor(family: str, normalize: bool) -> tuple[Any, Any]:
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    mc = ModelConfig(
        model=str(ensure_tiny_model(family)),
        dtype="float32",
        max_model_len=4096,
        limit_mm_per_prompt={"image": 1, "video": 2},
        mm_device_do_normalize=normalize,
    )
    return mc, MULTIMODAL_REGISTRY.create_processor(mc)


def vllm_load(family: str, data: bytes) -> tuple[np.ndarray, dict[str, Any]]:
    """The chat route's ``fetch_video``: ``VideoMediaIO`` with the loader of the model's video processor."""
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.media.video import VideoMediaIO
    from vllm.multimodal.video import get_video_loader_backend_for_processor

    _, proc = vllm_processor(family, True)
    name = type(proc.info.get_hf_processor().video_processor).__name__
    io = VideoMediaIO(
        ImageMediaIO(image_mode="RGB"), video_backend=get_video_loader_backend_for_processor(name)
    )
    return io.load_bytes(data).media


def vllm_run(family: str, normalize: bool, data: bytes) -> dict[str, Any]:
    from transformers import AutoTokenizer

    mc, proc = vllm_processor(family, normalize)
    tok = AutoTokenizer.from_pretrained(ensure_tiny_model(family), local_files_only=True)
    content = [{"type": "video"}, {"type": "text", "text": "Describe it."}]
    ids = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True
    )
    items = proc.info.parse_mm_data({"video": [vllm_load(family, data)]})
    kwargs = mc.multimodal_config.merge_mm_processor_kwargs({})
    return proc(list(ids["input_ids"]), items, hf_processor_mm_kwargs=kwargs)


@functools.cache
def trainer_adapter(family: str):
    return load_adapter(ensure_tiny_model(family))


def server_adapter(family: str, normalize: bool):
    """Built from vLLM's own processors, as the plugin builds image adapters."""
    _, proc = vllm_processor(family, normalize)
    hf = proc.info.get_hf_processor()
    adapter = adapter_class(family)(hf.image_processor, family=family)
    adapter.attach_video(hf.video_processor)
    return adapter


# --- the decoder ---------------------------------------------------------------------------------


def test_clip_is_deterministic_and_declares_its_frames():
    data = clip_bytes.__wrapped__()  # not the cached one: a second write
    assert data == clip_bytes()
    header = read_video_header(data)
    assert (header.width, header.height, header.frames, header.duration_s) == (160, 120, 16, 2.0)


@pytest.mark.parametrize("loader", ["qwen2_vl", "qwen3_vl"])
def test_sample_indices_match_vllm_loaders(loader):
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY
    from vllm.multimodal.video_decoders import VideoSourceMetadata, VideoTargetMetadata

    cls = VIDEO_LOADER_REGISTRY.load(loader)
    target = VideoTargetMetadata(num_frames=32, fps=2, max_duration=300)  # VideoMediaIO's defaults
    for total in [*range(2, 130), 451, 1000, 3001, 40000]:
        for fps in (1.0, 7.5, 24.0, 29.97, 30.0, 60.0) + ((0.0,) if loader == "qwen3_vl" else ()):
            want = cls.compute_frames_index_to_sample(
                VideoSourceMetadata(total, fps, total / fps if fps else 0), target
            )
            assert sample_indices(VideoSampling(loader), total, fps) == want, (total, fps)


@pytest.mark.parametrize(
    ("loader", "total", "fps", "match"),
    [
        ("qwen2_vl", 10, 0.0, "known source fps"),  # vLLM raises ValueError
        ("qwen2_vl", 1, 24.0, "no qwen2_vl temporal patch of 2"),  # vLLM divides by zero
        ("qwen3_vl", 0, 24.0, "no frames"),
    ],
)
def test_sample_indices_refusals_are_video_unreadable(loader, total, fps, match):
    with pytest.raises(VideoUnreadable, match=match):
        sample_indices(VideoSampling(loader), total, fps)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("clip", CLIPS, ids=[f"{c[0]}-{c[1]}fps-{c[2]}s" for c in CLIPS])
def test_frames_and_metadata_equal_vllm_loader(family, clip):
    data = clip_bytes(clip[0], fps=clip[1], seconds=clip[2])
    frames, meta = vllm_load(family, data)
    ours = load_video(data, trainer_adapter(family).video_sampling)
    assert frames.dtype == ours.frames.dtype == np.uint8
    assert np.array_equal(frames, ours.frames)
    assert ours.hf_metadata() == meta


# --- by ref: the adapters against vLLM's processor -----------------------------------------------


@pytest.mark.parametrize("normalize", [True, False], ids=["raw", "normalized"])
@pytest.mark.parametrize("form", ["v1", "v2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_clip_by_ref_equals_vllm_processor(family, form, normalize, tmp_path):
    data = clip_bytes()
    out = vllm_run(family, normalize, data)
    want = out["mm_kwargs"]["video"][0]
    placeholder = out["mm_placeholders"]["video"][0]
    ref = offload_video(data, tmp_path, trainer_adapter(family), form=form)
    assert ref.modality == "video" and ref.media_type == "video/mp4"
    assert ref.grid == want["video_grid_thw"].data.tolist()
    body = parse_ref(ref.ref)
    assert body.modality == "video" and body.fingerprint == trainer_adapter(family).video_fingerprint
    for adapter in (server_adapter(family, normalize), trainer_adapter(family)):
        assert adapter.video_fingerprint == trainer_adapter(family).video_fingerprint
        got = adapter.resolve_video(body, AssetStore(tmp_path), ref=ref.ref, raw_pixels=normalize)
        assert set(got.tensors) | ({"timestamps"} if got.timestamps else set()) == set(want.keys())
        if got.timestamps is not None:  # Qwen3-VL's item carries them as a list
            assert list(got.timestamps) == want["timestamps"].data
        for name, tensor in got.tensors.items():
            expected = want[name].data
            if name != "pixel_values_videos":  # vLLM's batched fields drop the leading 1
                tensor = tensor.reshape(expected.shape)
            assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, name
            assert (tensor.double() - expected.double()).abs().max().item() == 0, name
        assert got.grid == tuple(ref.grid) and got.sha256 == ref.sha256
    embedded = placeholder.length if placeholder.is_embed is None else int(placeholder.is_embed.sum())
    assert ref.num_placeholders == embedded
    runs = trainer_adapter(family).video_token_runs(ref.grid)
    if VIDEO_FAMILIES[family].per_frame_runs:  # one run per temporal patch, after its timestamp text
        mask = placeholder.is_embed.to(torch.int8).tolist()
        found = [len(r) for r in "".join(map(str, mask)).split("0") if r]
        assert runs == found == [ref.grid[1] * ref.grid[2] // 4] * ref.grid[0]
    else:
        assert runs == [placeholder.length]


def test_second_per_grid_ts_is_temporal_patch_over_sampled_fps(tmp_path):
    adapter = trainer_adapter("qwen2_5_vl")
    ref = offload_video(clip_bytes(), tmp_path, adapter)
    got = adapter.resolve_video(parse_ref(ref.ref), AssetStore(tmp_path))
    # 16 frames at 8 fps, 4 sampled: sampled fps 2, temporal patch 2 -> 1.0 s per grid step
    assert got.tensors["second_per_grid_ts"].tolist() == [1.0] and got.frames_indices == (0, 4, 8, 12)


def test_a_checked_video_ref_is_not_checked_again_and_an_image_claim_is(monkeypatch, tmp_path):
    """``CheckedRef`` (issue 45): the server's resolver checks a ref once, before it queues the
    read; the read path takes that claim as is, checks a bare body, and checks a ref claimed for
    the other modality (refused as before)."""
    import msgspec

    from protocol.adapters.values import CheckedRef

    adapter, store = trainer_adapter("qwen2_5_vl"), AssetStore(tmp_path)
    ref = offload_video(clip_bytes(), tmp_path, adapter)
    body = parse_ref(ref.ref)
    checked = CheckedRef(body, adapter.check_video_ref(body, ref=ref.ref))
    calls: list[str | None] = []
    real = adapter.check_video_ref
    monkeypatch.setattr(
        adapter, "check_video_ref", lambda b, *, ref=None: calls.append(ref) or real(b, ref=ref)
    )
    got = adapter.resolve_video(checked, store, ref=ref.ref)
    assert calls == [] and got.grid == tuple(ref.grid)
    assert adapter.resolve_video(body, store, ref=ref.ref).grid == got.grid and calls == [ref.ref]
    image_claim = CheckedRef(msgspec.structs.replace(body, modality="image"), tuple(ref.grid))
    with pytest.raises(InvalidRef, match="an image ref where a video is expected"):
        adapter.resolve_video(image_claim, store, ref=ref.ref)


def test_offload_is_idempotent_and_content_addressed(tmp_path):
    adapter = trainer_adapter("qwen3_vl")
    a = offload_video(clip_bytes(), tmp_path, adapter, form="v2")
    b = offload_video(clip_bytes(), tmp_path, adapter, form="v2")
    assert a == b
    assert (tmp_path / "videos" / f"{a.sha256[:16]}.mp4").read_bytes() == clip_bytes()
    assert not (tmp_path / "images").exists()


# --- refusals --------------------------------------------------------------------------------------


def _zeroed_mdat(data: bytes) -> bytes:
    at = data.index(b"mdat") + 200
    return data[:at] + bytes(len(data) - at - 3000) + data[-3000:]


BAD_VIDEOS = {
    "truncated": lambda d: d[: len(d) // 2],
    "header-only": lambda d: d[:64],
    "zeroed-frames": _zeroed_mdat,
    "a-jpeg": lambda d: photo_bytes("coffee"),
    "empty": lambda d: b"",
    "no-moov": lambda d: d[: d.index(b"moov") - 4],
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", sorted(BAD_VIDEOS))
def test_bad_clip_is_video_unreadable_and_nothing_stored(family, case, tmp_path):
    bad = BAD_VIDEOS[case](clip_bytes())
    with pytest.raises(VideoUnreadable) as e:
        offload_video(bad, tmp_path, trainer_adapter(family), form="v2")
    assert e.value.code == "video_unreadable" and e.value.http_status == 422
    assert not (tmp_path / "videos").exists()


@pytest.mark.parametrize("case", ["header-only", "no-moov", "truncated", "zeroed-frames"])
def test_bad_clip_behind_a_ref_is_video_unreadable(case, tmp_path):
    """A ref made for the good clip, its file replaced by bad bytes of the same hash: impossible;
    so the bad bytes are stored under their own hash and a ref forged for them."""
    adapter = trainer_adapter("qwen2_5_vl")
    good = offload_video(clip_bytes(), tmp_path, adapter, form="v2")
    bad = BAD_VIDEOS[case](clip_bytes())
    stored = AssetStore(tmp_path).put_video(bad)
    body = ContentRef(
        sha256=stored.sha256,
        ext=".mp4",
        family="qwen2_5_vl",
        grid=tuple(good.grid),
        fingerprint=adapter.video_fingerprint,
    )
    with pytest.raises(VideoUnreadable):
        adapter.resolve_video(body, AssetStore(tmp_path), ref=format_content_ref(body))


HUGE_HEADERS = {  # (box, offset in its body, struct format, values): a crafted header
    "frames": (b"stsz", 8, ">I", (1_000_000_000,)),
    "tkhd-size": (b"tkhd", 76, ">II", (60000 << 16, 60000 << 16)),
    "stsd-size": (b"stsd", 40, ">HH", (65535, 65535)),
    "duration": (b"mdhd", 16, ">I", (0xFFFFFFFF,)),
}


@pytest.mark.parametrize("case", sorted(HUGE_HEADERS))
def test_over_limit_header_is_refused_before_decoding(case, monkeypatch, tmp_path):
    import cv2

    data = with_box_field(clip_bytes(), *HUGE_HEADERS[case])

    def no_decoder(*args, **kwargs):
        raise AssertionError("the decoder was reached")

    monkeypatch.setattr(cv2, "VideoCapture", no_decoder)
    with pytest.raises(AssetTooLarge) as e:
        load_video(data, VideoSampling("qwen3_vl"))
    assert e.value.http_status == 413
    with pytest.raises(AssetTooLarge):
        offload_video(data, tmp_path, trainer_adapter("qwen3_vl"))


def test_limits_are_configurable():
    data = clip_bytes()
    with pytest.raises(AssetTooLarge, match="pixels"):
        load_video(data, VideoSampling("qwen3_vl"), limits=VideoLimits(max_pixels=160 * 119))
    with pytest.raises(AssetTooLarge, match="frames"):
        load_video(data, VideoSampling("qwen3_vl"), limits=VideoLimits(max_frames=15))
    with pytest.raises(AssetTooLarge, match="bytes"):
        load_video(
            data, VideoSampling("qwen3_vl"), limits=VideoLimits(max_decoded_bytes=4 * 160 * 120 * 3 - 1)
        )
    assert load_video(data, VideoSampling("qwen3_vl"), limits=VideoLimits(max_frames=16)).frames.shape[0] == 4


def test_video_refs_need_their_fingerprint_and_their_path(tmp_path):
    adapter = trainer_adapter("qwen3_vl")
    ref = offload_video(clip_bytes(), tmp_path, adapter, form="v2")
    body = parse_ref(ref.ref)
    bare = ContentRef(sha256=body.sha256, ext=body.ext, family=body.family, grid=body.grid)
    with pytest.raises(InvalidRef, match="fingerprint"):
        adapter.check_video_ref(bare)
    other = ContentRef(
        sha256=body.sha256, ext=body.ext, family=body.family, grid=body.grid, fingerprint="0" * 32
    )
    with pytest.raises(FingerprintMismatch):
        adapter.check_video_ref(other)
    with pytest.raises(InvalidRef, match="where an image is expected"):
        adapter.check_ref(body)  # the image path
    image = offload_image(photo_bytes("coffee"), tmp_path, adapter, form="v2")
    with pytest.raises(InvalidRef, match="where a video is expected"):
        adapter.check_video_ref(parse_ref(image.ref))
    with pytest.raises(UnsupportedFamily):
        load_adapter(ensure_tiny_model("qwen2_vl")).check_video_ref(body)


def test_video_fingerprint_names_the_sampling_and_differs_from_images():
    adapter = trainer_adapter("qwen2_5_vl")
    other = load_adapter(ensure_tiny_model("qwen2_5_vl"))
    other.attach_video(other.video_processor, VideoSampling("qwen2_vl", fps=1.0))
    assert adapter.video_fingerprint != other.video_fingerprint
    assert adapter.video_fingerprint != adapter.fingerprint
    assert adapter.video_fingerprint != trainer_adapter("qwen3_vl").video_fingerprint
    # Qwen3.5 runs Qwen3-VL's video processor class with its own config: its own fingerprint
    assert trainer_adapter("qwen3_5").video_fingerprint not in (
        trainer_adapter("qwen3_vl").video_fingerprint,
        trainer_adapter("qwen3_5").fingerprint,
    )


# --- the trainer ---------------------------------------------------------------------------------


def _sample(refs) -> TrainingSample:
    n = sum(r.num_placeholders for r in refs) + 4
    return TrainingSample.from_rollout(list(range(1, n - 1)), [7, 8], [-0.5, -0.25], images=refs)


@pytest.mark.parametrize("family", FAMILIES)
def test_materialize_returns_video_features_deduplicated(family, tmp_path):
    adapter = trainer_adapter(family)
    a = offload_video(clip_bytes(), tmp_path, adapter)
    b = offload_video(clip_bytes("coffee", fps=30, seconds=1), tmp_path, adapter, form="v2")
    image = offload_image(photo_bytes("rocket"), tmp_path, adapter)
    samples = [_sample([a]), _sample([image, a]), _sample([b, a])]
    resolved: dict = {}
    batch = materialize(samples, adapter, tmp_path, resolved=resolved)
    store = AssetStore(tmp_path)
    want = adapter.collate_videos([adapter.resolve_video(parse_ref(r.ref), store) for r in (a, b)])
    assert batch.features.keys() >= {"pixel_values", "image_grid_thw", *want}
    for name, tensor in want.items():
        assert torch.equal(batch.features[name], tensor), name
    assert batch.video_index.tolist() == [0, 0, 1, 0]
    assert batch.videos_per_sample == [1, 1, 2] and batch.images_per_sample == [0, 1, 0]
    assert batch.stats.processed == 3  # one image, two distinct videos
    again = materialize(samples, adapter, tmp_path, resolved=resolved)
    assert again.stats.processed == 0 and torch.equal(
        again.features["pixel_values_videos"], want["pixel_values_videos"]
    )
    flat = materialize(samples, adapter, tmp_path, dedup=False)
    assert flat.video_index is None and flat.features["video_grid_thw"].shape[0] == 4


def test_materialize_replaces_a_missing_video_and_zeroes_its_loss(tmp_path):
    adapter = trainer_adapter("qwen2_5_vl")
    a = offload_video(clip_bytes(), tmp_path, adapter, form="v2")
    b = offload_video(clip_bytes("chelsea", fps=3, seconds=3), tmp_path, adapter, form="v2")
    (tmp_path / "videos" / f"{b.sha256[:16]}.mp4").unlink()
    batch = materialize([_sample([a]), _sample([b])], adapter, tmp_path)
    assert batch.placeholder_refs == [b.ref] and batch.stats.failed_by_code == {"asset_not_found": 1}
    assert any(batch.samples[0].loss_mask) and not any(batch.samples[1].loss_mask)
    rows = batch.features["video_grid_thw"].prod(dim=1).tolist()
    assert not batch.features["pixel_values_videos"][rows[0] :].any()
    with pytest.raises(AssetNotFound):
        materialize([_sample([b])], adapter, tmp_path, MaterializeOptions(policy="error"))


def test_materialize_checks_video_counts_before_reading(tmp_path):
    import msgspec

    adapter = trainer_adapter("qwen3_vl")
    a = offload_video(clip_bytes(), tmp_path, adapter)
    wrong = msgspec.structs.replace(a, num_placeholders=a.num_placeholders + 1)
    sample = TrainingSample.from_rollout([1] * 50, [2], [-1.0], images=[wrong])
    from protocol.errors import PlaceholderMismatch

    with pytest.raises(PlaceholderMismatch):
        materialize([sample], adapter, Path(tmp_path) / "nowhere")  # refused before any read


def test_materialize_reads_videos_within_the_servers_limits(tmp_path):
    """The trainer applies the server's video limits from its options: ``max_video_bytes`` per
    file, ``max_image_pixels`` per frame (``protocol.videos.frame_limits``, as the plugin does with
    ``MMREF_MAX_IMAGE_PIXELS``); over either, the clip is ``AssetTooLarge``, or a zero-loss
    stand-in under the default policy."""
    from protocol.errors import AssetTooLarge
    from protocol.video_header import read_video_header

    adapter = trainer_adapter("qwen2_5_vl")
    data = clip_bytes()
    header = read_video_header(data)
    a = offload_video(data, tmp_path, adapter)
    assert materialize([_sample([a])], adapter, tmp_path).stats.failed_by_code == {}
    for tight in (
        {"max_image_pixels": header.width * header.height - 1},
        {"max_video_bytes": len(data) - 1},
    ):
        with pytest.raises(AssetTooLarge):
            materialize([_sample([a])], adapter, tmp_path, MaterializeOptions(policy="error", **tight))
        batch = materialize([_sample([a])], adapter, tmp_path, MaterializeOptions(**tight))
        assert batch.placeholder_refs == [a.ref] and not any(batch.samples[0].loss_mask), tight


def test_materialize_checks_each_distinct_ref_once(monkeypatch, tmp_path):
    """One check per distinct ref per batch (issue 45): ``checked_refs`` checks the image refs and
    ``materialize_videos`` the video refs, and the read paths take the ``CheckedRef`` without
    checking it again."""
    adapter = load_adapter(ensure_tiny_model("qwen2_5_vl"))
    a = offload_video(clip_bytes(), tmp_path, adapter)
    image = offload_image(photo_bytes("rocket"), tmp_path, adapter)
    calls: dict[str, list] = {"check_ref": [], "check_video_ref": []}
    for name, seen in calls.items():
        check = getattr(adapter, name)
        monkeypatch.setattr(
            adapter, name, lambda body, *, ref=None, _c=check, _s=seen: _s.append(ref) or _c(body, ref=ref)
        )
    materialize([_sample([image, a]), _sample([a]), _sample([image])], adapter, tmp_path)
    assert calls == {"check_ref": [image.ref], "check_video_ref": [a.ref]}
