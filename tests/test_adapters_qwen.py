"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL adapter against vLLM's own engine-free multimodal processor.

The oracle is ``MULTIMODAL_REGISTRY.create_processor(ModelConfig(...))``: the very processor a
vLLM server runs on a chat with images. For each family and for both pixel modes
(``mm_device_do_normalize`` on: raw uint8 pixels, vLLM's default for these families; off:
normalized float32) our adapter, built the way the server builds it (wrapping vLLM's image
processor) and the way the trainer builds it (``load_adapter(model_dir)``), must give
bit-identical ``pixel_values``, the same grid, the same placeholder count, and a prompt expanded
exactly like vLLM expands it.
"""

from __future__ import annotations

import copy
import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from helpers import ensure_tiny_model, photo_bytes
from protocol.adapters import (
    ADAPTERS,
    QwenVLAdapter,
    adapter_class,
    load_adapter,
    offload_image,
    supported_families,
)
from protocol.errors import FingerprintMismatch, ImageUnreadable, InvalidRef, UnsupportedFamily
from protocol.images import load_image
from protocol.placeholders import expand_image_placeholders, locate_image_runs
from protocol.refs import RawRefBody, format_mmraw, parse_ref
from protocol.store import AssetStore

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
IMAGE_PAD = "<|image_pad|>"

# (photo, size (w, h) or None for the photo as shipped): real photos and extreme shapes.
IMAGE_CASES = [
    ("astronaut", None),  # 512x512
    ("coffee", None),  # 600x400
    ("chelsea", None),  # 451x300
    ("rocket", None),  # 640x427
    ("rocket", (1000, 30)),
    ("coffee", (30, 1000)),
    ("chelsea", (17, 17)),
    ("astronaut", (4000, 3000)),
]
CASE_IDS = [name if size is None else f"{name}-{size[0]}x{size[1]}" for name, size in IMAGE_CASES]

# Sizes (w, h) for grid_for_size vs the processor: tiny, square, extreme (aspect 200 is the limit).
GRID_SIZES = [
    (1, 1), (2, 3), (3, 2), (17, 17), (28, 28), (31, 29), (56, 56), (100, 1), (1, 100),
    (224, 224), (225, 223), (300, 451), (451, 300), (512, 512), (600, 400), (640, 427),
    (1000, 30), (30, 1000), (1023, 767), (1280, 720), (720, 1280), (2000, 10), (10, 2000),
    (4000, 20), (20, 4000), (1999, 1501),
]  # fmt: skip

# Facts of transformers' smart_resize with each tiny model's preprocessor config (printed once,
# then pinned, like transformers' own tests pin [1, 70, 70]). Qwen2/2.5: patch 14, merge 2,
# pixels 3136..50176; Qwen3: patch 16, merge 2, pixels 4096..65536.
GOLDEN_ASTRONAUT = {  # family: (grid, placeholders, pixel_values shape)
    "qwen2_vl": ((1, 16, 16), 64, (256, 1176)),
    "qwen2_5_vl": ((1, 16, 16), 64, (256, 1176)),
    "qwen3_vl": ((1, 16, 16), 64, (256, 1536)),
}
QWEN2_SIZES = {  # (w, h): grid; Qwen2-VL and Qwen2.5-VL share the processor config
    (600, 400): (1, 12, 18),
    (1000, 30): (1, 2, 72),
    (30, 1000): (1, 72, 2),
    (17, 17): (1, 4, 4),
    (4000, 3000): (1, 12, 18),
    (4000, 20): (1, 2, 226),
}
GOLDEN_SIZES = {  # family: {(w, h): grid}
    "qwen2_vl": QWEN2_SIZES,
    "qwen2_5_vl": QWEN2_SIZES,
    "qwen3_vl": {
        (600, 400): (1, 12, 18),
        (1000, 30): (1, 2, 62),
        (30, 1000): (1, 62, 2),
        (17, 17): (1, 4, 4),
        (4000, 3000): (1, 12, 18),
        (4000, 20): (1, 2, 226),
    },
}


@functools.cache
def image_bytes(name: str, size: tuple[int, int] | None = None) -> bytes:
    return photo_bytes(name, size=size)


def png_bytes(width: int, height: int, color: tuple[int, int, int] = (200, 40, 90)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class Oracle:
    """vLLM's multimodal processor for one model and one ``mm_device_do_normalize`` setting."""

    model_config: Any
    processor: Any
    normalize: bool

    @property
    def image_processor(self) -> Any:
        return self.processor.info.get_hf_processor().image_processor

    def run(self, prompt_ids: list[int], images: list[Image.Image]) -> dict[str, Any]:
        items = self.processor.info.parse_mm_data({"image": images})
        kwargs = self.model_config.multimodal_config.merge_mm_processor_kwargs({})
        return self.processor(prompt_ids, items, hf_processor_mm_kwargs=kwargs)


def make_oracle(model_dir: Path, normalize: bool | None) -> Oracle:
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    kwargs = {} if normalize is None else {"mm_device_do_normalize": normalize}
    mc = ModelConfig(
        model=str(model_dir),
        dtype="float32",
        max_model_len=2048,
        limit_mm_per_prompt={"image": 4, "video": 0},
        **kwargs,
    )
    return Oracle(
        mc, MULTIMODAL_REGISTRY.create_processor(mc), bool(mc.multimodal_config.mm_device_do_normalize)
    )


# --- fixtures (module scope: one vLLM processor per family and mode) ---------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family) -> Path:
    return ensure_tiny_model(family)


@pytest.fixture(scope="module")
def default_oracle(model_dir) -> Oracle:
    """vLLM's processor as a server builds it with default flags."""
    return make_oracle(model_dir, None)


@pytest.fixture(scope="module", params=[True, False], ids=["raw", "normalized"])
def oracle(request, model_dir) -> Oracle:
    return make_oracle(model_dir, request.param)


@pytest.fixture(scope="module")
def server_adapter(family, default_oracle) -> QwenVLAdapter:
    """Built like ``vllm_plugin.plugin.MMRefEndpointPlugin.init_state``: wraps vLLM's image processor."""
    return adapter_class(family)(default_oracle.image_processor, family=family)


@pytest.fixture(scope="module")
def trainer_adapter(model_dir) -> QwenVLAdapter:
    return load_adapter(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def image_token_id(tokenizer, default_oracle) -> int:
    token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert default_oracle.model_config.hf_config.image_token_id == token_id
    return token_id


def chat_ids(tokenizer, n_images: int, text: str = "Describe these.") -> list[int]:
    """Chat-template prompt ids with one ``<|image_pad|>`` per image (what vLLM expands)."""
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True
    )
    return list(encoded["input_ids"])


# --- equality with vLLM's processor ------------------------------------------------------------


def test_vllm_default_is_raw_pixels(default_oracle):
    """These families default to raw pixels in vLLM (the double-normalization pitfall)."""
    assert default_oracle.normalize is True


def test_placeholder_token_id(server_adapter, trainer_adapter, default_oracle, image_token_id):
    hf_config = default_oracle.model_config.hf_config
    assert server_adapter.placeholder_token_id(hf_config) == image_token_id
    assert trainer_adapter.placeholder_token_id(hf_config) == image_token_id


@pytest.mark.parametrize("case", IMAGE_CASES, ids=CASE_IDS)
def test_process_matches_vllm(case, family, oracle, trainer_adapter, tokenizer, image_token_id, tmp_path):
    data = image_bytes(*case)
    image = load_image(data)
    prompt = chat_ids(tokenizer, 1)
    out = oracle.run(prompt, [image])
    item = out["mm_kwargs"]["image"][0]
    want_pixels = item["pixel_values"].data
    want_grid = item["image_grid_thw"].data
    placeholder = out["mm_placeholders"]["image"][0]
    assert want_pixels.dtype == (torch.uint8 if oracle.normalize else torch.float32)

    server = adapter_class(family)(oracle.image_processor, family=family)
    for adapter in (server, trainer_adapter):
        got = adapter.process(image, raw_pixels=oracle.normalize)
        pixels = got.tensors["pixel_values"]
        assert pixels.dtype == want_pixels.dtype
        assert pixels.shape == want_pixels.shape
        assert torch.equal(pixels, want_pixels), (
            f"max |diff| {(pixels.double() - want_pixels.double()).abs().max()}"
        )
        assert got.tensors["image_grid_thw"].dtype == want_grid.dtype
        assert got.tensors["image_grid_thw"].tolist() == [want_grid.tolist()]
        assert list(got.grid) == want_grid.tolist()
        assert got.num_placeholders == placeholder.length
        assert adapter.grid_for_size(image.width, image.height) == got.grid

    ref = offload_image(data, tmp_path, trainer_adapter)
    assert ref.grid == want_grid.tolist()
    assert ref.num_placeholders == placeholder.length
    expanded = expand_image_placeholders(prompt, [ref], image_token_id)
    assert expanded == list(out["prompt_token_ids"])
    assert locate_image_runs(expanded, [], image_token_id, counts=[ref.num_placeholders]) == [
        (placeholder.offset, placeholder.length)
    ]


def test_four_images_in_one_prompt_match_vllm(oracle, trainer_adapter, tokenizer, image_token_id, tmp_path):
    names = ("astronaut", "coffee", "chelsea", "rocket")
    datas = [image_bytes(n) for n in names]
    images = [load_image(d) for d in datas]
    prompt = chat_ids(tokenizer, len(images))
    out = oracle.run(prompt, images)
    refs = [offload_image(d, tmp_path, trainer_adapter) for d in datas]
    placeholders = out["mm_placeholders"]["image"]

    for i, image in enumerate(images):
        item = out["mm_kwargs"]["image"][i]
        got = trainer_adapter.process(image, raw_pixels=oracle.normalize)
        assert torch.equal(got.tensors["pixel_values"], item["pixel_values"].data), names[i]
        assert refs[i].grid == item["image_grid_thw"].data.tolist()
        assert refs[i].num_placeholders == placeholders[i].length

    expanded = expand_image_placeholders(prompt, refs, image_token_id)
    assert expanded == list(out["prompt_token_ids"])
    counts = [r.num_placeholders for r in refs]
    assert locate_image_runs(expanded, [], image_token_id, counts=counts) == [
        (p.offset, p.length) for p in placeholders
    ]


def test_adjacent_images_match_vllm(default_oracle, trainer_adapter, image_token_id, tmp_path):
    """Two images whose placeholders touch form one run; split by grid-derived counts like vLLM."""
    datas = [image_bytes("astronaut"), image_bytes("coffee")]
    images = [load_image(d) for d in datas]
    prompt = [72, 105, 259, image_token_id, image_token_id, 260, 33]  # "Hi" <vs> pad pad <ve> "!"
    out = default_oracle.run(prompt, images)
    refs = [offload_image(d, tmp_path, trainer_adapter) for d in datas]
    expanded = expand_image_placeholders(prompt, refs, image_token_id)
    assert expanded == list(out["prompt_token_ids"])
    ranges = locate_image_runs(expanded, [], image_token_id, counts=[r.num_placeholders for r in refs])
    assert ranges == [(p.offset, p.length) for p in out["mm_placeholders"]["image"]]
    assert ranges[0][0] + ranges[0][1] == ranges[1][0]  # one run, two images


# --- golden numbers ----------------------------------------------------------------------------


def test_golden_astronaut(family, trainer_adapter, server_adapter):
    grid, placeholders, shape = GOLDEN_ASTRONAUT[family]
    for adapter in (trainer_adapter, server_adapter):
        got = adapter.process(load_image(image_bytes("astronaut")))
        assert got.grid == grid
        assert got.num_placeholders == placeholders
        assert tuple(got.tensors["pixel_values"].shape) == shape
        assert got.tensors["image_grid_thw"].tolist() == [list(grid)]
        assert adapter.grid_for_size(512, 512) == grid


def test_golden_sizes(family, trainer_adapter):
    for (w, h), grid in GOLDEN_SIZES[family].items():
        assert trainer_adapter.grid_for_size(w, h) == grid, (w, h)


# --- grids ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_grid_for_size_equals_processed_grid(model_dir, backend):
    adapter = load_adapter(model_dir, backend=backend)
    assert adapter.backend == backend
    mismatches = []
    for w, h in GRID_SIZES:
        processed = adapter.process(Image.new("RGB", (w, h), (10, 120, 230)))
        predicted = adapter.grid_for_size(w, h)
        if processed.grid != predicted or processed.num_placeholders != adapter.num_placeholders(predicted):
            mismatches.append(((w, h), predicted, processed.grid))
    assert not mismatches


@settings(max_examples=60, deadline=None)
@given(w=st.integers(1, 6000), h=st.integers(1, 6000))
def test_num_placeholders_equals_vllm_token_count(server_adapter, default_oracle, w, h):
    if max(w, h) / min(w, h) > 200:
        with pytest.raises(ValueError, match="aspect ratio"):
            server_adapter.grid_for_size(w, h)
        return
    want = default_oracle.processor.info.get_num_image_tokens(
        image_width=w, image_height=h, image_processor=default_oracle.image_processor, mm_kwargs={}
    )
    assert server_adapter.num_placeholders(server_adapter.grid_for_size(w, h)) == want


@pytest.mark.parametrize("size", [(4020, 20), (20, 4020), (2010, 10)])
def test_aspect_ratio_over_200_is_refused(trainer_adapter, size, tmp_path):
    w, h = size
    with pytest.raises(ValueError, match="aspect ratio"):
        trainer_adapter.grid_for_size(w, h)
    with pytest.raises(ValueError, match="aspect ratio"):
        trainer_adapter.process(Image.new("RGB", size))

    store = AssetStore(tmp_path)
    stored = store.put_image(png_bytes(w, h))
    body = RawRefBody(
        family=trainer_adapter.family,
        modality="image",
        mm_hash=stored.mm_hash,
        payload={"image_grid_thw": [1, 2, 226]},
        raw_image_uri=stored.uri,
        fingerprint=trainer_adapter.fingerprint,
    )
    ref = format_mmraw(body)
    with pytest.raises(ImageUnreadable) as info:
        trainer_adapter.resolve_raw(parse_ref(ref), store, ref=ref)
    assert info.value.ref == ref
    assert info.value.message.startswith(f"{trainer_adapter.family} processor refused a {w}x{h} image: ")
    assert "aspect ratio" in info.value.message


def test_offload_refuses_aspect_ratio_over_200_with_typed_error(trainer_adapter, tmp_path):
    """offload() documents ImageUnreadable for images it cannot use, as resolve_raw() raises."""
    with pytest.raises(ImageUnreadable) as info:
        offload_image(png_bytes(4020, 20), tmp_path, trainer_adapter)
    # the same wording as resolve_raw's (ImageAdapter.refusal): family, size, the processor's reason
    assert info.value.message.startswith(f"{trainer_adapter.family} processor refused a 4020x20 image: ")
    assert "aspect ratio" in info.value.message
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing stored


# --- fingerprints -----------------------------------------------------------------------------


def test_fingerprint_server_equals_trainer_and_is_stable(model_dir, server_adapter, trainer_adapter):
    assert server_adapter.backend == trainer_adapter.backend == "torchvision"
    assert server_adapter.fingerprint == trainer_adapter.fingerprint
    again = load_adapter(model_dir)
    assert again.fingerprint == trainer_adapter.fingerprint
    assert len(trainer_adapter.fingerprint) == 32
    assert parse_ref(
        format_mmraw(
            RawRefBody(
                family=trainer_adapter.family,
                modality="image",
                mm_hash="a" * 32,
                payload={"image_grid_thw": [1, 4, 4]},
                raw_image_uri="file:///x.png",
                fingerprint=trainer_adapter.fingerprint,
            )
        )
    )  # a valid fingerprint under the ref rules


def test_fingerprint_differs_for_pil_backend(model_dir, trainer_adapter):
    pil = load_adapter(model_dir, backend="pil")
    assert pil.backend == "pil"
    assert pil.fingerprint != trainer_adapter.fingerprint


def test_fingerprint_differs_for_device(family, trainer_adapter):
    cuda = adapter_class(family)(trainer_adapter.image_processor, family=family, device="cuda")
    assert cuda.fingerprint != trainer_adapter.fingerprint


def test_fingerprints_differ_between_families():
    fingerprints = {f: load_adapter(ensure_tiny_model(f)).fingerprint for f in FAMILIES}
    assert len(set(fingerprints.values())) == len(FAMILIES), fingerprints


def test_fingerprint_differs_for_max_pixels(model_dir, trainer_adapter):
    from transformers import AutoImageProcessor

    base = trainer_adapter.image_processor
    bigger = AutoImageProcessor.from_pretrained(
        model_dir,
        local_files_only=True,
        size={"shortest_edge": base.size["shortest_edge"], "longest_edge": 4 * base.size["longest_edge"]},
    )
    adapter = load_adapter(model_dir, image_processor=bigger)
    assert adapter.fingerprint != trainer_adapter.fingerprint
    # ... and the field really changes the grid (so the fingerprint must name it).
    assert adapter.grid_for_size(512, 512) != trainer_adapter.grid_for_size(512, 512)
    assert adapter.process(load_image(image_bytes("astronaut"))).grid == adapter.grid_for_size(512, 512)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("image_mean", [0.1, 0.2, 0.3]),
        ("image_std", [0.9, 0.8, 0.7]),
        ("resample", 2),  # bilinear instead of bicubic
        ("rescale_factor", 1 / 127.5),
        ("do_normalize", False),
        ("merge_size", 1),
        ("temporal_patch_size", 1),
    ],
)
def test_fingerprint_differs_for_pixel_field(family, trainer_adapter, field, value):
    processor = copy.deepcopy(trainer_adapter.image_processor)
    setattr(processor, field, value)
    changed = adapter_class(family)(processor, family=family)
    assert changed.fingerprint != trainer_adapter.fingerprint


# --- placeholders for missing images ----------------------------------------------------------


@pytest.mark.parametrize("case", IMAGE_CASES[:7], ids=CASE_IDS[:7])
def test_zero_features_matches_process(trainer_adapter, case):
    processed = trainer_adapter.process(load_image(image_bytes(*case)))
    synthetic = trainer_adapter.zero_features(processed.grid)
    assert set(synthetic.tensors) == set(processed.tensors)
    for name, tensor in processed.tensors.items():
        assert synthetic.tensors[name].shape == tensor.shape, name
        assert synthetic.tensors[name].dtype == tensor.dtype, name
    assert not synthetic.tensors["pixel_values"].any()
    assert torch.equal(synthetic.tensors["image_grid_thw"], processed.tensors["image_grid_thw"])
    assert synthetic.grid == processed.grid
    assert synthetic.num_placeholders == processed.num_placeholders
    assert synthetic.nbytes == processed.nbytes


# --- registry and ref checks ------------------------------------------------------------------


def test_registry_table():
    assert set(FAMILIES) <= set(supported_families()) and supported_families() == sorted(ADAPTERS)
    for f in FAMILIES:
        assert adapter_class(f) is QwenVLAdapter
        assert ADAPTERS[f] is QwenVLAdapter


def test_unknown_model_type_lists_supported():
    with pytest.raises(UnsupportedFamily) as info:
        adapter_class("llava")
    for f in FAMILIES:
        assert f in str(info.value)
    assert "llava" in str(info.value)


def test_load_adapter_unknown_model_type(model_dir, tmp_path):
    config = json.loads((model_dir / "config.json").read_text())
    config["model_type"] = "kosmos2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedFamily, match="qwen2_vl"):
        load_adapter(tmp_path)


def test_adapter_refuses_family_it_does_not_serve(trainer_adapter):
    with pytest.raises(UnsupportedFamily):
        QwenVLAdapter(trainer_adapter.image_processor, family="kimi_vl")


def _body(adapter, **changes) -> RawRefBody:
    fields = {
        "family": adapter.family,
        "modality": "image",
        "mm_hash": "0123456789abcdef" * 2,
        "payload": {"image_grid_thw": [1, 16, 16]},
        "raw_image_uri": "file:///data/run_1/assets/images/0123456789abcdef.jpg",
        "fingerprint": adapter.fingerprint,
        **changes,
    }
    # Through the wire format, as a server or trainer receives it.
    return parse_ref(format_mmraw(RawRefBody(**fields)))


def test_check_ref_accepts_own_refs(trainer_adapter):
    assert trainer_adapter.check_ref(_body(trainer_adapter)) == (1, 16, 16)
    assert trainer_adapter.check_ref(_body(trainer_adapter, fingerprint=None)) == (1, 16, 16)


def test_check_ref_rejects_other_family(family, trainer_adapter):
    for other in FAMILIES:
        if other != family:
            with pytest.raises(UnsupportedFamily) as info:
                trainer_adapter.check_ref(_body(trainer_adapter, family=other), ref="r1")
            assert info.value.ref == "r1"


def test_check_ref_rejects_other_fingerprint(trainer_adapter):
    other = "f" * 32
    with pytest.raises(FingerprintMismatch) as info:
        trainer_adapter.check_ref(_body(trainer_adapter, fingerprint=other), ref="r2")
    assert other in str(info.value)
    assert info.value.ref == "r2"
    pil = load_adapter(ensure_tiny_model(trainer_adapter.family), backend="pil")
    with pytest.raises(FingerprintMismatch):
        trainer_adapter.check_ref(_body(pil))


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"image_grid_thw": [1, 16, 16], "pixel_values": [0.0]},  # extra key
        {"grid_thws": [1, 16, 16]},  # another family's key
        {"image_grid_thw": [16, 16]},  # wrong length
        {"image_grid_thw": [1, 1, 16, 16]},
        {"image_grid_thw": []},
        {"image_grid_thw": [1.0, 16, 16]},  # non-int
        {"image_grid_thw": ["1", "16", "16"]},
        {"image_grid_thw": [True, 16, 16]},  # bool is not an int here
        {"image_grid_thw": [1, 0, 16]},  # zero
        {"image_grid_thw": [1, 16, -16]},  # negative
        {"image_grid_thw": [1, 16, 1 << 20]},  # absurd
        {"image_grid_thw": None},
        {"image_grid_thw": "1,16,16"},
        {"image_grid_thw": {"t": 1, "h": 16, "w": 16}},
    ],
)
def test_check_ref_rejects_malformed_payload(trainer_adapter, payload):
    with pytest.raises(InvalidRef) as info:
        trainer_adapter.check_ref(_body(trainer_adapter, payload=payload), ref="r3")
    assert info.value.ref == "r3"


# --- offload ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [("chelsea", None), ("rocket", (1000, 30)), ("coffee", (17, 17))])
def test_offload_is_idempotent_and_matches_processing(trainer_adapter, case, tmp_path):
    data = image_bytes(*case)
    first = offload_image(data, tmp_path, trainer_adapter)
    second = offload_image(data, tmp_path, trainer_adapter)
    assert first.ref == second.ref
    assert first == second
    assert len(list((tmp_path / "images").iterdir())) == 1

    processed = trainer_adapter.process(load_image(data))
    assert first.grid == list(processed.grid)
    assert first.num_placeholders == processed.num_placeholders
    assert first.media_type == "image/jpeg"

    body = parse_ref(first.ref)
    assert isinstance(body, RawRefBody)
    assert body.family == trainer_adapter.family
    assert body.fingerprint == trainer_adapter.fingerprint
    assert body.payload == {"image_grid_thw": list(processed.grid)}
    assert first.sha256.startswith(body.mm_hash)

    resolved = trainer_adapter.resolve_raw(body, AssetStore(tmp_path), ref=first.ref)
    for name, tensor in processed.tensors.items():
        assert torch.equal(resolved.tensors[name], tensor), name
