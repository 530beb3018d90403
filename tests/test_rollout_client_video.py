"""rollout_client with video messages, without a server (issue 44, part 4): a clip offloaded once by
content, the prompt's placeholders expanded as the HF processor expands them for the same frames
(the image's and the video's, one message holding both), the video placeholder suppressed beside
the image's, Qwen3-VL's and Qwen3.5's per-frame video refused with the route that takes it."""

from __future__ import annotations

import io

import pytest
from video_clips import clip_bytes

from helpers import ensure_tiny_model, photo_bytes
from protocol.errors import PlaceholderMismatch
from rollout_client import ChatTemplate, Offloader, PromptBuilder, RolloutClient
from rollout_client.conversation import expand_placeholders

TEXT = "Compare the picture with the video."


@pytest.fixture(scope="module")
def model_dir():
    return ensure_tiny_model("qwen2_5_vl")


@pytest.fixture(scope="module")
def builder(model_dir, tmp_path_factory):
    return PromptBuilder(ChatTemplate(model_dir), Offloader(model_dir, tmp_path_factory.mktemp("assets")))


def _message(image: bytes, video: bytes) -> list[dict]:
    content = [
        {"type": "image", "image": image},
        {"type": "video", "video": video},
        {"type": "text", "text": TEXT},
    ]
    return [{"role": "user", "content": content}]


def test_prompt_is_the_hf_processors_expansion_of_the_same_frames(builder, model_dir):
    """One message with a photo and a clip: the client's prompt ids equal what Qwen2.5-VL's own
    HF processor builds from the template's text, the photo and the clip's frames (decoded as the
    server decodes them), and the refs come in prompt order."""
    from PIL import Image
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    from protocol.videos import load_video

    image, video = photo_bytes("coffee", size=(96, 72)), clip_bytes()
    prepared = builder.first_turn(_message(image, video))
    assert [r.modality for r in prepared.images] == ["image", "video"]

    processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    text = builder.template.render(_message(image, video), add_generation_prompt=True)
    decoded = load_video(video, builder.offloader.adapter.video_sampling)
    meta = {k: v for k, v in decoded.hf_metadata().items() if k != "do_sample_frames"}
    pil = Image.open(io.BytesIO(image)).convert("RGB")
    out = processor(
        text=[text],
        images=[pil],
        videos=[decoded.frames],
        video_metadata=[VideoMetadata(**meta)],
        return_tensors="pt",
    )
    assert prepared.prompt_ids == out["input_ids"][0].tolist()
    assert list(prepared.images[1].grid) == out["video_grid_thw"][0].tolist()
    video_id = builder.video_token_id
    assert prepared.prompt_ids.count(video_id) == prepared.images[1].num_placeholders > 1


def test_a_clip_is_offloaded_once_and_kept_apart_from_images(builder):
    offloader = builder.offloader
    video = clip_bytes("chelsea")
    before = offloader.stats.offloaded, offloader.stats.hits
    first = builder.first_turn([{"role": "user", "content": [{"type": "video", "video": video}]}])
    again = builder.first_turn([{"role": "user", "content": [{"type": "video", "video": video}]}])
    assert first == again
    assert (offloader.stats.offloaded, offloader.stats.hits) == (before[0] + 1, before[1] + 1)
    (ref,) = first.images
    assert ref.modality == "video" and offloader.lookup("video:" + ref.sha256) == ref


def test_counts_are_checked_per_modality(builder):
    prepared = builder.first_turn(_message(photo_bytes("coffee", size=(56, 56)), clip_bytes()))
    image_id, video_id = builder.placeholder_token_id, builder.video_token_id
    one_each = [1, image_id, 2, video_id, 3]
    assert len(expand_placeholders(one_each, prepared.images, image_id, video_id)) == 3 + sum(
        r.num_placeholders for r in prepared.images
    )
    with pytest.raises(PlaceholderMismatch, match="video"):
        expand_placeholders([1, image_id, 2], prepared.images, image_id, video_id)
    with pytest.raises(PlaceholderMismatch, match="no video token"):
        expand_placeholders(one_each, prepared.images, image_id, None)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_the_client_suppresses_the_video_placeholder_too(family, tmp_path):
    client = RolloutClient("http://127.0.0.1:9", ensure_tiny_model(family), tmp_path)
    try:
        ids = client.suppressed_token_ids()
    finally:
        client.close()
    assert client.builder.placeholder_token_id in ids and client.builder.video_token_id in ids


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_a_per_frame_video_is_refused_naming_the_chat_route(family, tmp_path):
    """Qwen3-VL's and Qwen3.5's video placeholders are one run per frame between timestamp text,
    which the token route cannot take: refused before any request, naming ``video_url``."""
    model = ensure_tiny_model(family)
    builder = PromptBuilder(ChatTemplate(model), Offloader(model, tmp_path))
    with pytest.raises(ValueError, match="video_url"):
        builder.first_turn([{"role": "user", "content": [{"type": "video", "video": clip_bytes()}]}])
