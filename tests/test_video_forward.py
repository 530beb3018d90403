"""Video segments in the trainer's packed forward (issue 44, part 3) on tiny Qwen2.5-VL / Qwen3-VL /
Qwen3.5 (its Gated DeltaNet layers run per segment, so no state crosses from a video sample into the next).

The reference is transformers' own unpacked forward of each sample
(``model(input_ids, pixel_values_videos, video_grid_thw, second_per_grid_ts, pixel_values,
image_grid_thw, mm_token_type_ids)``: the model computes its own MRoPE positions, the video's time
axis included), so the packed positions (``get_rope_index`` per sample with the video grids and
``second_per_grid_ts``), the video token typing, the feature order and the deduplicated video
encode are all checked against code that is not ours. fp32, CPU.
"""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch
import torch.nn.functional as F
from video_clips import clip_bytes

from helpers import IM_END, IM_START, PAD, V_END, V_START, Family, forward_backward
from protocol.adapters import offload_video
from protocol.errors import PlaceholderMismatch
from protocol.structs import MMRefs, TrainingSample, decode_microbatch, encode
from trainer_lib import PackingSpec, materialize
from trainer_lib.forward import packed_logprobs
from trainer_lib.linear_attention import PER_SEGMENT_TORCH
from trainer_lib.materialize import materialize_micro_batch
from trainer_lib.model_inputs import check_placeholders_match_features, packed_inputs
from trainer_lib.planning.packing import pack_samples, rebuild_micro_batch
from trainer_lib.positions import build_position_ids
from trainer_lib.prepare import prepare_model_for_packing

TOL = 1e-5
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")


class VideoFamily(Family):
    """A tiny model with its photos (:class:`helpers.Family`) and two clips offloaded beside them."""

    def __init__(self, name: str, root) -> None:
        super().__init__(name, root)
        assert prepare_model_for_packing(self.model) == "sdpa"  # the CPU backend, as the trainer sets it
        self.video_tok = self.adapter.video_token_id(self.model.config)
        self.clips = {
            "astronaut": offload_video(clip_bytes(), root, self.adapter),
            "coffee": offload_video(clip_bytes("coffee", fps=30, seconds=1), root, self.adapter, form="v2"),
        }


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("vfwd") / "assets"
    return {name: VideoFamily(name, root) for name in FAMILIES}


def _text(s: str) -> list[int]:
    return list(s.encode())


def video_chat(fam: VideoFamily, media, prompt: str, answer: str, *, typed: bool = False) -> TrainingSample:
    """A Qwen-style chat with images and videos in ``media`` order, each in its vision markers.
    A Qwen3-VL video is one ``<t.t seconds><vision_start> pads <vision_end>`` block per temporal
    patch (text timestamps; any text does for the forward). ``typed``: ``mm_token_type_ids`` set
    (0 text, 1 image, 2 video)."""
    ids, types = [IM_START, *_text("user\n")], []
    for ref in media:
        video = ref.modality == "video"
        runs = fam.adapter.video_token_runs(ref.grid) if video else [ref.num_placeholders]
        for k, n in enumerate(runs):
            if len(runs) > 1:
                ids += _text(f"<{k}.0 seconds>")
            ids += [V_START] + [fam.video_tok if video else fam.tok] * n + [V_END]
    ids += [*_text(prompt), IM_END, IM_START, *_text("assistant\n")]
    completion = [*_text(answer), IM_END]
    ids += completion
    types = [2 if t == fam.video_tok else 1 if t == fam.tok else 0 for t in ids]
    n = len(ids)
    return TrainingSample(
        input_ids=ids,
        loss_mask=[False] * (n - len(completion)) + [True] * len(completion),
        advantages=[0.25] * n,
        inference_logprobs=[0.0] * n,
        mm_refs=MMRefs(items=list(media), mm_token_type_ids=types if typed else None) if media else None,
    )


def reference_logprobs(fam: VideoFamily, sample: TrainingSample) -> torch.Tensor:
    """transformers' own unpacked forward of one sample (it builds its own positions)."""
    ids = torch.tensor([sample.input_ids])
    kwargs = {}
    if sample.mm_refs:
        kwargs = dict(materialize([sample], fam.adapter, fam.root, dedup=False).features)
        kwargs["mm_token_type_ids"] = ((ids == fam.tok).int() + 2 * (ids == fam.video_tok).int()).int()
    logits = fam.model(input_ids=ids, use_cache=False, **kwargs).logits[0].float()
    lp = F.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp])


def samples(fam: VideoFamily) -> list[TrainingSample]:
    """A video sample, an image sample, a text sample, an image + video sample (typed) and a
    second sample of the first video (the RL group's shared clip)."""
    r, c = fam.refs, fam.clips
    return [
        video_chat(fam, [c["astronaut"]], "What happens?", "It pans."),
        video_chat(fam, [r["rocket"]], "Name it", "rocket"),
        video_chat(fam, [], "Say hi.", "Hi there"),
        video_chat(fam, [r["chelsea"], c["coffee"]], "Both?", "cat; cup", typed=True),
        video_chat(fam, [c["astronaut"]], "Again?", "Still panning."),
    ]


def run(fam: VideoFamily, mb, *, dedup: bool = True):
    m = materialize_micro_batch(mb, fam.spec, fam.config, dedup=dedup)
    inputs = packed_inputs(
        m.packed, m.features, fam.model, fam.spec, image_index=m.image_index, video_index=m.video_index
    )
    return m, inputs, packed_logprobs(fam.model, inputs)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_video_forward_matches_one_sample_at_a_time(families, family):
    fam = families[family]
    batch = samples(fam)
    assert fam.spec.video_token_id == fam.model.config.video_token_id
    (mb,) = pack_samples(batch, fam.spec, seq_len=4096).micro_batches
    assert [im.is_video for im in mb.images] == [True, False, False, True, True]
    types = torch.tensor(mb.mm_token_type_ids)
    ids = torch.tensor(mb.micro_batch.input_ids)
    assert torch.equal(types == 2, ids == fam.video_tok) and torch.equal(types == 1, ids == fam.tok)
    with torch.no_grad():
        ref = torch.cat([reference_logprobs(fam, s) for s in batch])
        for dedup in (True, False):
            m, inputs, out = run(fam, mb, dedup=dedup)
            worst = (out.logprobs - ref).abs().max().item()
            print(f"\n{family} dedup={dedup}: packed vs one-at-a-time max |dlogprob| = {worst:.2e}")
            assert worst <= TOL
            # Qwen3.5(-MoE)'s Gated DeltaNet layers run per segment: no state crosses into the next sample
            assert out.linear_attention == (PER_SEGMENT_TORCH if family.startswith("qwen3_5") else None)
    # dedup: the shared clip's pixels once (two distinct clips for three video slots)
    m, inputs, _ = run(fam, mb)
    assert m.video_index.tolist() == [0, 1, 0]
    assert m.features["video_grid_thw"].tolist() == [
        list(fam.clips["astronaut"].grid),
        list(fam.clips["coffee"].grid),
    ]
    assert inputs.video_grid_thw.shape == (2, 3) and inputs.video_index.tolist() == [0, 1, 0]


def test_the_time_axis_is_second_per_grid_ts(families):
    """Qwen2.5-VL's video positions step by ``tokens_per_second * second_per_grid_ts`` per temporal
    patch (transformers' get_rope_index): positions built with another spacing give other logprobs,
    and a micro-batch with videos and no second_per_grid_ts is refused."""
    fam = families["qwen2_5_vl"]
    sample = video_chat(fam, [fam.clips["astronaut"]], "What happens?", "It pans.")
    (mb,) = pack_samples([sample], fam.spec, seq_len=4096).micro_batches
    m, inputs, out = run(fam, mb)
    seconds = m.features["second_per_grid_ts"]
    assert seconds.tolist() == [1.0]  # 16 frames at 8 fps, 4 sampled: 2 fps, temporal patch 2
    (video,) = mb.images
    temporal = inputs.position_ids[1, 0, video.start : video.start + video.length]
    per_frame = video.length // video.grid[0]
    step = fam.model.config.vision_config.tokens_per_second * seconds.item()
    assert temporal[per_frame] - temporal[0] == step == 2.0
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        build_position_ids(m.packed, fam.model)
    wrong = build_position_ids(m.packed, fam.model, second_per_grid_ts=torch.tensor([0.5]))
    assert not torch.equal(wrong, inputs.position_ids)
    with torch.no_grad():
        ref = reference_logprobs(fam, sample)
        other = packed_logprobs(fam.model, dataclasses.replace(inputs, position_ids=wrong))
    assert (out.logprobs - ref).abs().max().item() <= TOL
    assert (other.logprobs - ref).abs().max().item() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_video_micro_batch_crosses_the_wire(families, family):
    fam = families[family]
    (mb,) = pack_samples(samples(fam), fam.spec, seq_len=4096).micro_batches
    back = rebuild_micro_batch(decode_microbatch(encode(mb.micro_batch)), fam.spec)
    assert back.micro_batch == mb.micro_batch and back.images == mb.images
    assert 2 in back.mm_token_type_ids and back.micro_batch.images_per_sample == [1, 1, 0, 2, 1]


def test_video_packing_refusals(families):
    fam = families["qwen2_5_vl"]
    clip = fam.clips["astronaut"]
    good = video_chat(fam, [clip], "What happens?", "It pans.")
    # a video ref needs the spec's video token
    bare = PackingSpec(placeholder_token_id=fam.tok, pad_token_id=PAD, adapter=fam.adapter)
    with pytest.raises(ValueError, match="video token id"):
        pack_samples([good], bare, seq_len=4096)
    # one video token short of the ref's count
    ids = list(good.input_ids)
    ids[ids.index(fam.video_tok)] = ord("x")
    short = msgspec.structs.replace(good, input_ids=ids)
    with pytest.raises(PlaceholderMismatch):
        pack_samples([short], fam.spec, seq_len=4096)
    # a text sample holding the video token as text never shares a micro-batch with pixels
    text = video_chat(fam, [], "literal <|video_pad|>", "ok")
    stray = msgspec.structs.replace(text, input_ids=[*text.input_ids[:3], fam.video_tok, *text.input_ids[4:]])
    step = pack_samples([good, stray], fam.spec, seq_len=4096)
    assert step.num_micro_batches == 2


def test_video_tripwire_names_the_video_token(families):
    fam = families["qwen2_5_vl"]
    (mb,) = pack_samples(samples(fam), fam.spec, seq_len=4096).micro_batches
    m = materialize_micro_batch(mb, fam.spec, fam.config)
    with pytest.raises(ValueError, match=r"pass video_index=m\.video_index"):
        packed_inputs(m.packed, m.features, fam.model, fam.spec, image_index=m.image_index)
    features = {k: v for k, v in m.features.items() if "video" not in k and k != "second_per_grid_ts"}
    with pytest.raises(ValueError, match="3 videos in the micro-batch but no features"):
        packed_inputs(m.packed, features, fam.model, fam.spec, image_index=m.image_index)
    ids = torch.tensor(mb.micro_batch.input_ids)
    ids[int((ids == fam.video_tok).nonzero()[0])] = ord("x")  # one video token short
    grids = {"image_grid_thw": m.features["video_grid_thw"][m.video_index]}
    count = fam.adapter.video_num_placeholders
    with pytest.raises(
        ValueError, match=f"video placeholder token id {fam.video_tok}: .* but .* feature rows"
    ):
        check_placeholders_match_features(ids, fam.video_tok, grids, num_placeholders=count, kind=2)
    types = torch.tensor(mb.mm_token_type_ids)
    with pytest.raises(ValueError, match="video-typed positions"):
        check_placeholders_match_features(
            torch.tensor(mb.micro_batch.input_ids),
            fam.video_tok,
            grids,
            mm_token_type_ids=torch.where(types == 2, 1, types),
            num_placeholders=count,
            kind=2,
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shared_clip_is_encoded_once_and_gradients_equal_the_per_slot_path(families, family):
    """The RL group's clip (two video slots) runs the vision tower once under dedup; logprobs and
    every gradient equal the per-slot path (fp32)."""
    fam = families[family]
    (mb,) = pack_samples(samples(fam), fam.spec, seq_len=4096).micro_batches
    dedup = materialize_micro_batch(mb, fam.spec, fam.config)
    per_slot = materialize_micro_batch(mb, fam.spec, fam.config, dedup=False)
    lp_dedup, g_dedup, rows_dedup = forward_backward(fam, dedup)
    lp_slot, g_slot, rows_slot = forward_backward(fam, per_slot)
    videos = dedup.features["pixel_values_videos"].shape[0]
    assert rows_dedup == [dedup.features["pixel_values"].shape[0], videos]  # images once, videos once
    assert rows_slot[1] == per_slot.features["pixel_values_videos"].shape[0] > videos
    assert (lp_dedup - lp_slot).abs().max().item() <= TOL
    assert g_dedup.keys() == g_slot.keys() and any("visual" in n for n in g_dedup)
    worst = max(((g_dedup[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in g_slot.items())
    assert worst <= 1e-5, worst


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_varlen_packed_video_matches_one_sample_at_a_time(families, family):
    """bf16 on CUDA with the varlen backend: the packed micro-batch with videos vs each sample
    packed alone (as ``tests/test_forward.py`` checks images; not yet run on a GPU)."""
    from transformers import AutoModelForImageTextToText

    fam = families[family]
    model = AutoModelForImageTextToText.from_pretrained(fam.dir, dtype=torch.bfloat16).cuda().eval()
    backend = prepare_model_for_packing(model)
    batch = samples(fam)

    def logprobs(mb) -> torch.Tensor:
        m = materialize_micro_batch(mb, fam.spec, fam.config)
        inputs = packed_inputs(
            m.packed, m.features, model, fam.spec, image_index=m.image_index, video_index=m.video_index
        )
        return packed_logprobs(model, inputs).logprobs

    with torch.no_grad():
        (mb,) = pack_samples(batch, fam.spec, seq_len=4096).micro_batches
        packed = logprobs(mb)
        alone = [logprobs(pack_samples([s], fam.spec, seq_len=4096).micro_batches[0]) for s in batch]
    worst = (packed - torch.cat(alone)).abs().max().item()
    print(
        f"\n{family} {backend} bf16 on {torch.cuda.get_device_name()}: packed vs alone max |d| = {worst:.2e}"
    )
    assert worst == 0.0  # as measured for images on a lent H100 (bit-identical)
