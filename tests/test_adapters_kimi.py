"""Kimi-VL and Kimi K2.5 adapters against vLLM's own engine-free multimodal processors.

The oracle is ``MULTIMODAL_REGISTRY.create_processor(ModelConfig(...))`` on the tiny models of
``scripts/make_tiny_models.py``: vLLM's ``KimiK25MultiModalProcessor`` (which runs vLLM's
``KimiK25FusedVisionProcessor``; modality ``vision_chunk``) and ``KimiVLMultiModalProcessor``
(which runs the checkpoint's remote processor, here ``KimiVLImageProcessor`` of
``protocol/adapters/kimi_vl.py``, and counts placeholders with its own arithmetic,
``KimiVLProcessingInfo.get_num_image_tokens``). Every image gives bit-identical pixels, the same
grid, the same placeholder range and the same expanded prompt from our adapters, built the way
the server builds them (around vLLM's processor instance) and the way a trainer does
(``load_adapter``). Kimi-VL's pixels are also checked against the published algorithm with
PIL/torch primitives (vLLM runs our transcription there, so that check cannot come from vLLM).
"""

from __future__ import annotations

import copy
import functools
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from helpers import ensure_tiny_model, photo_bytes
from protocol.adapters import (
    ADAPTERS,
    KimiK25Adapter,
    KimiVLAdapter,
    KimiVLImageProcessor,
    adapter_class,
    load_adapter,
    offload_image,
)
from protocol.adapters.kimi_vl import kimi_vl_target_size
from protocol.errors import ImageUnreadable, InvalidRef
from protocol.images import load_image
from protocol.placeholders import expand_image_placeholders, locate_image_runs
from protocol.refs import RawRefBody, format_mmraw, parse_ref
from protocol.store import AssetStore

MEDIA_PAD = "<|media_pad|>"

# (photo, size (w, h) or None as shipped). The tiny models allow 1024 patches per image (Kimi K2.5
# also 64 patches a side): 600x400, 640x427, 4000x3000 and 462x462 are above the limit, 448x448
# sits exactly on it; the rest are tiny or extreme aspect ratios.
IMAGE_CASES = [
    ("astronaut", None),  # 512x512
    ("coffee", None),  # 600x400
    ("chelsea", None),  # 451x300
    ("rocket", None),  # 640x427
    ("astronaut", (4000, 3000)),
    ("coffee", (448, 448)),
    ("chelsea", (462, 462)),
    ("rocket", (1000, 30)),
    ("coffee", (30, 1000)),
    ("astronaut", (2000, 5)),
    ("chelsea", (17, 17)),
    ("rocket", (1, 1)),
]
CASE_IDS = [name if size is None else f"{name}-{size[0]}x{size[1]}" for name, size in IMAGE_CASES]

# More sizes (w, h) for grid_for_size vs the processed grid (synthetic images).
GRID_SIZES = [
    (1, 1), (2, 3), (13, 13), (14, 14), (15, 29), (28, 28), (29, 27), (100, 1), (1, 100),
    (224, 224), (225, 223), (300, 451), (447, 449), (463, 461), (600, 400), (896, 14),
    (897, 14), (14, 897), (1023, 767), (1280, 720), (720, 1280), (3000, 7), (7, 3000), (4000, 20),
]  # fmt: skip

# Kimi-VL with the released checkpoints' config (moonshotai/Kimi-VL-A3B-Instruct
# preprocessor_config.json: patch 14, merge [2, 2], in_token_limit 4096, pad_input true):
# (w, h) -> grid [h, w] in patches; vLLM's get_num_image_tokens gives h*w // 4 for each (tested).
GOLDEN_KIMI_VL_RELEASED = {
    (512, 512): (38, 38),  # 36*36 = 1296 patches: no resize; 512 -> 532 px padded
    (896, 896): (64, 64),  # 64*64 = 4096 = the limit: no resize
    (910, 910): (64, 64),  # 65*65 = 4225 > 4096: scaled to 896x896
    (1920, 1080): (48, 86),  # scaled to 1196x672, padded to 1204x672
    (4000, 3000): (56, 74),  # scaled to 1036x777, padded to 1036x784: 1036 tokens (> 4096 // 4)
    (2000, 5): (2, 144),  # 142*0 = 0 patches: no resize; padded to 2016x28
}
# Tiny models (1024-patch limit; Kimi K2.5 also 64 patches a side): photo -> (grid, placeholders,
# pixel_values shape). 512x512 has 36*36 = 1296 patches: scaled by sqrt(1024/1296) to 455x455,
# padded to 476x476. 1000x30: Kimi K2.5 caps the side at 64 patches (896 px), Kimi-VL does not.
GOLDEN_K25 = {
    ("astronaut", None): ((1, 34, 34), 289, (1156, 3, 14, 14)),
    ("coffee", None): ((1, 28, 40), 280, (1120, 3, 14, 14)),
    ("astronaut", (4000, 3000)): ((1, 28, 38), 266, (1064, 3, 14, 14)),
    ("rocket", (1000, 30)): ((1, 2, 64), 32, (128, 3, 14, 14)),
}
GOLDEN_VL = {
    ("astronaut", None): ((34, 34), 289, (1156, 3, 14, 14)),
    ("coffee", None): ((28, 40), 280, (1120, 3, 14, 14)),
    ("astronaut", (4000, 3000)): ((28, 38), 266, (1064, 3, 14, 14)),
    ("rocket", (1000, 30)): ((4, 72), 72, (288, 3, 14, 14)),
}


@functools.cache
def image_bytes(name: str, size: tuple[int, int] | None = None) -> bytes:
    return photo_bytes(name, size=size)


@dataclass
class Oracle:
    """vLLM's multimodal processor for one model and one ``mm_device_do_normalize`` setting."""

    model_config: Any
    processor: Any
    normalize: bool
    modality: str

    def run(self, prompt_ids: list[int], images: list[Image.Image]) -> dict[str, Any]:
        if self.modality == "vision_chunk":
            data = {"vision_chunk": [{"type": "image", "image": im, "uuid": None} for im in images]}
        else:
            data = {"image": images}
        items = self.processor.info.parse_mm_data(data)
        kwargs = self.model_config.multimodal_config.merge_mm_processor_kwargs({})
        return self.processor(prompt_ids, items, hf_processor_mm_kwargs=kwargs)


def make_oracle(model_dir: Path, normalize: bool | None, modality: str) -> Oracle:
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    kwargs = {} if normalize is None else {"mm_device_do_normalize": normalize}
    mc = ModelConfig(
        model=str(model_dir),
        dtype="float32",
        max_model_len=4096,
        trust_remote_code=modality == "image",  # Kimi-VL's HF processor is remote code
        **kwargs,
    )
    processor = MULTIMODAL_REGISTRY.create_processor(mc)
    return Oracle(mc, processor, bool(mc.multimodal_config.mm_device_do_normalize), modality)


# --- fixtures (module scope: one vLLM processor per family and mode) ---------------------------


@pytest.fixture(scope="module")
def k25_dir() -> Path:
    return ensure_tiny_model("kimi_k25")


@pytest.fixture(scope="module")
def vl_dir() -> Path:
    return ensure_tiny_model("kimi_vl")


@pytest.fixture(scope="module")
def k25_default(k25_dir) -> Oracle:
    return make_oracle(k25_dir, None, "vision_chunk")


@pytest.fixture(scope="module")
def k25_normalized(k25_dir) -> Oracle:
    return make_oracle(k25_dir, False, "vision_chunk")


@pytest.fixture(scope="module")
def vl_oracle(vl_dir) -> Oracle:
    return make_oracle(vl_dir, None, "image")


@pytest.fixture(scope="module")
def vl_released_oracle(vl_dir, tmp_path_factory) -> Oracle:
    """vLLM's Kimi-VL processor on the released checkpoints' processor config (in_token_limit 4096)."""
    folder = tmp_path_factory.mktemp("kimi_vl_released")
    for item in vl_dir.iterdir():
        if item.is_file():
            shutil.copy(item, folder / item.name)
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config.update(in_token_limit=4096, pad_input=True, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    return make_oracle(folder, None, "image")


@pytest.fixture(scope="module")
def k25_server(k25_default) -> KimiK25Adapter:
    """Built like the plugin builds it: around the image processor vLLM itself uses."""
    return KimiK25Adapter(k25_default.processor.info.image_processor, family="kimi_k25")


@pytest.fixture(scope="module")
def vl_server(vl_oracle) -> KimiVLAdapter:
    return KimiVLAdapter(vl_oracle.processor.info.get_hf_processor().image_processor, family="kimi_vl")


@pytest.fixture(scope="module")
def k25_trainer(k25_dir) -> KimiK25Adapter:
    return load_adapter(k25_dir)


@pytest.fixture(scope="module")
def vl_trainer(vl_dir) -> KimiVLAdapter:
    return load_adapter(vl_dir)


def chat_ids(model_dir: Path, n_images: int) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": "Describe."}]
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True
    )
    return list(encoded["input_ids"])


def check_against_vllm(
    oracle: Oracle, adapters, data: bytes, model_dir: Path, token_id: int, tmp_path
) -> None:
    """One image through vLLM's processor and through each adapter: everything must be equal."""
    image = load_image(data)
    prompt = chat_ids(model_dir, 1)
    out = oracle.run(prompt, [image])
    assert set(out["mm_kwargs"]) == {adapters[0].vllm_modality}
    (item,) = out["mm_kwargs"][adapters[0].vllm_modality]
    (placeholder,) = out["mm_placeholders"][adapters[0].vllm_modality]
    grid_field = adapters[0].grid_field
    want_pixels, want_grid = item["pixel_values"].data, item[grid_field].data
    assert want_pixels.dtype == (torch.uint8 if oracle.normalize else torch.float32)

    for adapter in adapters:
        got = adapter.process(image, raw_pixels=oracle.normalize)
        pixels = got.tensors["pixel_values"]
        assert pixels.dtype == want_pixels.dtype
        assert pixels.shape == want_pixels.shape
        assert torch.equal(pixels, want_pixels), (
            f"max |diff| {(pixels.double() - want_pixels.double()).abs().max()}"
        )
        assert got.tensors[grid_field].dtype == want_grid.dtype == torch.int64
        assert got.tensors[grid_field].tolist() == [want_grid.tolist()]
        assert list(got.grid) == want_grid.tolist()
        assert got.num_placeholders == placeholder.length
        assert adapter.grid_for_size(image.width, image.height) == got.grid

    ref = offload_image(data, tmp_path, adapters[-1])
    assert ref.grid == want_grid.tolist()
    assert ref.num_placeholders == placeholder.length
    expanded = expand_image_placeholders(prompt, [ref], token_id)
    assert expanded == list(out["prompt_token_ids"])
    assert locate_image_runs(expanded, [], token_id, counts=[ref.num_placeholders]) == [
        (placeholder.offset, placeholder.length)
    ]


# --- Kimi K2.5: equality with vLLM's processor ---------------------------------------------------


def test_k25_vllm_defaults(k25_default, k25_server):
    """vLLM 0.32 serves Kimi K2.5 with its fused processor, raw uint8 pixels, modality vision_chunk."""
    assert type(k25_default.processor.info.image_processor).__name__ == "KimiK25FusedVisionProcessor"
    assert k25_default.normalize is True
    assert k25_default.processor.info.get_supported_mm_limits() == {"vision_chunk": None}
    assert k25_server.vllm_modality == "vision_chunk"
    assert k25_server.backend == "pil"


@pytest.mark.parametrize("case", IMAGE_CASES, ids=CASE_IDS)
@pytest.mark.parametrize("mode", ["raw", "normalized"])
def test_k25_process_matches_vllm(
    case, mode, k25_default, k25_normalized, k25_server, k25_trainer, k25_dir, tmp_path
):  # fmt: skip
    oracle = k25_default if mode == "raw" else k25_normalized
    token_id = k25_default.processor.info.media_token_id
    check_against_vllm(oracle, (k25_server, k25_trainer), image_bytes(*case), k25_dir, token_id, tmp_path)


def test_k25_three_images_in_one_prompt(k25_default, k25_trainer, k25_dir, tmp_path):
    datas = [image_bytes("astronaut"), image_bytes("coffee", (1000, 30)), image_bytes("chelsea")]
    images = [load_image(d) for d in datas]
    prompt = chat_ids(k25_dir, len(images))
    out = k25_default.run(prompt, images)
    refs = [offload_image(d, tmp_path, k25_trainer) for d in datas]
    token_id = k25_trainer.placeholder_token_id(k25_default.model_config.hf_config)
    placeholders = out["mm_placeholders"]["vision_chunk"]
    for i, image in enumerate(images):
        item = out["mm_kwargs"]["vision_chunk"][i]
        got = k25_trainer.process(image, raw_pixels=True)
        assert torch.equal(got.tensors["pixel_values"], item["pixel_values"].data)
        assert refs[i].grid == item["grid_thws"].data.tolist()
        assert refs[i].num_placeholders == placeholders[i].length
    expanded = expand_image_placeholders(prompt, refs, token_id)
    assert expanded == list(out["prompt_token_ids"])
    counts = [r.num_placeholders for r in refs]
    ranges = locate_image_runs(expanded, [], token_id, counts=counts)
    assert ranges == [(p.offset, p.length) for p in placeholders]


@pytest.mark.parametrize("size", GRID_SIZES, ids=[f"{w}x{h}" for w, h in GRID_SIZES])
def test_k25_grid_for_size_equals_processed_grid(k25_default, k25_trainer, size):
    image = Image.new("RGB", size, (10, 120, 230))
    processed = k25_trainer.process(image)
    assert k25_trainer.grid_for_size(*size) == processed.grid
    assert processed.tensors["pixel_values"].shape[0] == processed.grid[1] * processed.grid[2]
    want = k25_default.processor.info.media_tokens_calculator({"type": "image", "image": image})
    assert k25_trainer.num_placeholders(processed.grid) == want


def test_k25_placeholder_token_id(k25_default, k25_server, k25_trainer, k25_dir):
    from transformers import AutoTokenizer

    token_id = AutoTokenizer.from_pretrained(k25_dir, local_files_only=True).convert_tokens_to_ids(MEDIA_PAD)
    assert k25_default.processor.info.media_token_id == token_id
    for adapter in (k25_server, k25_trainer):
        assert adapter.placeholder_token_id(k25_default.model_config.hf_config) == token_id


def test_k25_refuses_transformers_processor():
    """transformers' Kimi_K25ImageProcessor computes other pixels than vLLM serves: refused."""
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

    with pytest.raises(TypeError, match="KimiK25FusedVisionProcessor"):
        KimiK25Adapter(Kimi_K25ImageProcessor(), family="kimi_k25")


def test_k25_fixed_output_tokens(k25_trainer):
    processor = copy.deepcopy(k25_trainer.image_processor)
    processor.media_proc_cfg["fixed_output_tokens"] = 7
    adapter = KimiK25Adapter(processor, family="kimi_k25")
    assert adapter.num_placeholders((1, 36, 36)) == 7
    assert processor.media_tokens_calculator({"type": "image", "image": Image.new("RGB", (512, 512))}) == 7
    assert adapter.fingerprint != k25_trainer.fingerprint


# --- Kimi-VL: equality with vLLM's processor -------------------------------------------------------


def test_vl_vllm_defaults(vl_oracle, vl_server):
    """vLLM 0.32 forces mm_device_do_normalize off for Kimi-VL (normalized float32 pixels)."""
    assert vl_oracle.normalize is False
    assert vl_server.vllm_modality == "image"
    with pytest.raises(NotImplementedError, match="mm_device_do_normalize"):
        vl_server.process(Image.new("RGB", (28, 28)), raw_pixels=True)


@pytest.mark.parametrize("case", IMAGE_CASES, ids=CASE_IDS)
def test_vl_process_matches_vllm(case, vl_oracle, vl_server, vl_trainer, vl_dir, tmp_path):
    token_id = vl_oracle.processor.info.image_token_id
    check_against_vllm(vl_oracle, (vl_server, vl_trainer), image_bytes(*case), vl_dir, token_id, tmp_path)


@settings(max_examples=200, deadline=None)
@given(w=st.integers(1, 6000), h=st.integers(1, 6000))
def test_vl_num_placeholders_equals_vllm_arithmetic(vl_server, vl_oracle, w, h):
    """vLLM's own count (KimiVLProcessingInfo.get_num_image_tokens) for any size up to 6000 px."""
    want = vl_oracle.processor.info.get_num_image_tokens(image_width=w, image_height=h)
    assert vl_server.num_placeholders(vl_server.grid_for_size(w, h)) == want


@pytest.mark.parametrize("size", GRID_SIZES, ids=[f"{w}x{h}" for w, h in GRID_SIZES])
def test_vl_grid_for_size_equals_processed_grid(vl_trainer, size):
    processed = vl_trainer.process(Image.new("RGB", size, (10, 120, 230)))
    assert vl_trainer.grid_for_size(*size) == processed.grid
    assert processed.tensors["pixel_values"].shape[0] == processed.grid[0] * processed.grid[1]


def test_vl_placeholder_token_id(vl_oracle, vl_server, vl_trainer, vl_dir):
    from transformers import AutoTokenizer

    token_id = AutoTokenizer.from_pretrained(vl_dir, local_files_only=True).convert_tokens_to_ids(MEDIA_PAD)
    assert vl_oracle.processor.info.image_token_id == token_id
    for adapter in (vl_server, vl_trainer):
        assert adapter.placeholder_token_id(vl_oracle.model_config.hf_config) == token_id


# --- Kimi-VL: the published algorithm ------------------------------------------------------------


def released_vl_processor() -> KimiVLImageProcessor:
    return KimiVLImageProcessor(
        patch_size=14, pad_input=True, image_mean=[0.5] * 3, image_std=[0.5] * 3, in_token_limit=4096
    )


def unpatchify(pixel_values: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``[h*w, 3, p, p] -> [3, h*p, w*p]`` (inverse of row-major patch order)."""
    h, w = grid
    p = pixel_values.shape[-1]
    return pixel_values.view(h, w, 3, p, p).permute(2, 0, 3, 1, 4).reshape(3, h * p, w * p)


def photo_array_of(image: Image.Image) -> np.ndarray:
    return np.asarray(image, dtype=np.uint8)


def normalized(array: np.ndarray) -> torch.Tensor:
    """``TF.normalize(TF.to_tensor(x), 0.5, 0.5)`` written out: ``(x / 255 - 0.5) / 0.5`` in float32."""
    return (torch.from_numpy(array.copy()).permute(2, 0, 1).to(torch.float32).div(255) - 0.5) / 0.5


@pytest.mark.parametrize("size", [None, (100, 37), (17, 17)])
def test_vl_pixels_follow_published_algorithm_unresized(vl_trainer, size):
    """Under the limit: the image itself, zero-padded right/bottom to 28 px, normalized, patchified."""
    data = image_bytes("chelsea", size)
    image = load_image(data)
    got = vl_trainer.process(image)
    h, w = got.grid
    canvas = Image.new("RGB", (w * 14, h * 14), (0, 0, 0))
    canvas.paste(image, (0, 0))
    assert (w * 14 - image.width) in range(28) and (h * 14 - image.height) in range(28)
    assert torch.equal(unpatchify(got.tensors["pixel_values"], got.grid), normalized(photo_array_of(canvas)))


def test_vl_pixels_follow_published_algorithm_resized(vl_trainer):
    """Over the limit: PIL bicubic to int(side * sqrt(limit / patches)), then zero padding."""
    image = load_image(image_bytes("astronaut", (4000, 3000)))
    got = vl_trainer.process(image)
    patches = (4000 // 14) * (3000 // 14)
    scale = (1024 / patches) ** 0.5
    resized = image.resize((int(4000 * scale), int(3000 * scale)), Image.Resampling.BICUBIC)
    assert resized.size == (518, 388)
    full = unpatchify(got.tensors["pixel_values"], got.grid)
    assert full.shape == (3, 28 * 14, 38 * 14)
    assert torch.equal(full[:, :388, :518], normalized(photo_array_of(resized)))
    assert torch.equal(full[:, 388:, :], torch.full_like(full[:, 388:, :], -1.0))  # padding: (0 - .5) / .5
    assert torch.equal(full[:, :, 518:], torch.full_like(full[:, :, 518:], -1.0))


@pytest.mark.parametrize(("size", "grid"), GOLDEN_KIMI_VL_RELEASED.items(), ids=str)
def test_vl_released_config_golden_grids(vl_released_oracle, size, grid):
    adapter = KimiVLAdapter(released_vl_processor(), family="kimi_vl")
    assert adapter.grid_for_size(*size) == grid
    assert adapter.num_placeholders(grid) == grid[0] * grid[1] // 4
    info = vl_released_oracle.processor.info
    assert info.get_hf_processor().image_processor.in_token_limit == 4096
    assert info.get_num_image_tokens(image_width=size[0], image_height=size[1]) == adapter.num_placeholders(
        grid
    )
    if size[0] * size[1] <= 2000 * 2000:
        assert adapter.process(Image.new("RGB", size)).grid == grid


@pytest.mark.parametrize("case", [("astronaut", (1920, 1080)), ("coffee", None)], ids=str)
def test_vl_released_config_matches_vllm(case, vl_released_oracle, vl_dir, tmp_path):
    adapter = KimiVLAdapter(released_vl_processor(), family="kimi_vl")
    server = KimiVLAdapter(
        vl_released_oracle.processor.info.get_hf_processor().image_processor, family="kimi_vl"
    )
    assert server.fingerprint == adapter.fingerprint
    token_id = vl_released_oracle.processor.info.image_token_id
    check_against_vllm(vl_released_oracle, (server, adapter), image_bytes(*case), vl_dir, token_id, tmp_path)


@pytest.mark.parametrize("size", [(7200, 20), (20, 7200), (7154, 14)])
def test_vl_exceed_pos_emb(vl_trainer, size):
    """A side of >= 512 patches after padding raises the original's error (7168 px at patch 14)."""
    with pytest.raises(ValueError, match=r"^Exceed pos emb$"):
        vl_trainer.grid_for_size(*size)
    with pytest.raises(ValueError, match=r"^Exceed pos emb$"):
        vl_trainer.process(Image.new("RGB", size))


def test_vl_exceed_pos_emb_is_a_typed_error_for_refs(vl_trainer, tmp_path):
    buf = io.BytesIO()
    Image.new("RGB", (7200, 20), (9, 9, 9)).save(buf, format="PNG")
    with pytest.raises(ImageUnreadable, match="Exceed pos emb"):
        offload_image(buf.getvalue(), tmp_path, vl_trainer)
    assert not (tmp_path / "images").exists() or not any((tmp_path / "images").iterdir())


def test_vl_just_below_pos_emb_limit(vl_trainer):
    assert vl_trainer.grid_for_size(7140, 20) == (2, 510)  # 510 patches, already a multiple of 28 px
    assert vl_trainer.grid_for_size(20, 7140) == (510, 2)
    with pytest.raises(ValueError, match=r"^Exceed pos emb$"):
        vl_trainer.grid_for_size(7141, 20)  # padded to 7168 px = 512 patches


def test_vl_in_token_limit_boundary():
    """Exactly at the limit no resize happens; one patch row/column more scales down."""
    kw = {"patch_size": 14, "merge_kernel_size": [2, 2], "in_token_limit": 1024, "pad_input": True}
    assert kimi_vl_target_size(448, 448, **kw) == (None, (448, 448))  # 32 * 32 = 1024
    assert kimi_vl_target_size(462, 448, **kw) == ((454, 441), (476, 448))  # 33 * 32 = 1056 > 1024
    assert kimi_vl_target_size(461, 461, **kw) == (None, (476, 476))  # still 32 * 32 patches


def test_vl_crop_branch_and_refusal():
    """pad_input=False center-crops to patch multiples (the original's other branch); adapters refuse it."""
    processor = KimiVLImageProcessor(pad_input=False, in_token_limit=1024)
    image = load_image(image_bytes("chelsea"))  # 451x300
    out = processor.preprocess([image], return_tensors="pt")
    assert out["image_grid_hws"].tolist() == [[21, 32]]  # 448x294
    # torchvision's center_crop rounds the offsets: round(3 / 2) = 2 (half to even), round(6 / 2) = 3.
    cropped = image.crop((2, 3, 2 + 448, 3 + 294))
    want = torch.from_numpy(photo_array_of(cropped).copy()).permute(2, 0, 1).float().div(255)
    mean = torch.tensor(processor.image_mean).view(3, 1, 1)
    std = torch.tensor(processor.image_std).view(3, 1, 1)
    assert torch.equal(unpatchify(out["pixel_values"], (21, 32)), (want - mean) / std)
    with pytest.raises(ValueError, match="pad_input=False"):
        KimiVLAdapter(processor, family="kimi_vl")


# --- both families: goldens, placeholders, fingerprints, registry ----------------------------------


@pytest.mark.parametrize("case", list(GOLDEN_K25), ids=str)
def test_golden_k25(k25_trainer, case):
    grid, placeholders, shape = GOLDEN_K25[case]
    got = k25_trainer.process(load_image(image_bytes(*case)))
    assert (got.grid, got.num_placeholders, tuple(got.tensors["pixel_values"].shape)) == (
        grid,
        placeholders,
        shape,
    )


@pytest.mark.parametrize("case", list(GOLDEN_VL), ids=str)
def test_golden_vl(vl_trainer, case):
    grid, placeholders, shape = GOLDEN_VL[case]
    got = vl_trainer.process(load_image(image_bytes(*case)))
    assert (got.grid, got.num_placeholders, tuple(got.tensors["pixel_values"].shape)) == (
        grid,
        placeholders,
        shape,
    )


@pytest.mark.parametrize("family", ["kimi_k25", "kimi_vl"])
@pytest.mark.parametrize("case", IMAGE_CASES[:8:2], ids=CASE_IDS[:8:2])
def test_zero_features_matches_process(family, case, k25_trainer, vl_trainer):
    adapter = k25_trainer if family == "kimi_k25" else vl_trainer
    processed = adapter.process(load_image(image_bytes(*case)))
    synthetic = adapter.zero_features(processed.grid)
    assert set(synthetic.tensors) == set(processed.tensors) == {"pixel_values", adapter.grid_field}
    for name, tensor in processed.tensors.items():
        assert synthetic.tensors[name].shape == tensor.shape, name
        assert synthetic.tensors[name].dtype == tensor.dtype, name
    assert not synthetic.tensors["pixel_values"].any()
    assert torch.equal(synthetic.tensors[adapter.grid_field], processed.tensors[adapter.grid_field])
    assert (synthetic.grid, synthetic.num_placeholders) == (processed.grid, processed.num_placeholders)
    assert synthetic.nbytes == processed.nbytes


def test_fingerprints_stable_equal_and_distinct(
    k25_server, k25_trainer, vl_server, vl_trainer, k25_dir, vl_dir
):
    assert k25_server.fingerprint == k25_trainer.fingerprint == load_adapter(k25_dir).fingerprint
    assert vl_server.fingerprint == vl_trainer.fingerprint == load_adapter(vl_dir).fingerprint
    qwen = load_adapter(ensure_tiny_model("qwen2_vl")).fingerprint
    assert len({k25_trainer.fingerprint, vl_trainer.fingerprint, qwen}) == 3
    for fp in (k25_trainer.fingerprint, vl_trainer.fingerprint):
        assert len(fp) == 32 and int(fp, 16) >= 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("in_patch_limit", 4096), ("patch_limit_on_one_side", 512), ("image_mean", [0.4, 0.5, 0.6])],
)
def test_k25_fingerprint_names_pixel_fields(k25_trainer, field, value):
    processor = copy.deepcopy(k25_trainer.image_processor)
    processor.media_proc_cfg[field] = value
    assert KimiK25Adapter(processor, family="kimi_k25").fingerprint != k25_trainer.fingerprint


@pytest.mark.parametrize(("field", "value"), [("in_token_limit", 4096), ("image_std", [0.3, 0.3, 0.3])])
def test_vl_fingerprint_names_pixel_fields(vl_trainer, field, value):
    processor = copy.deepcopy(vl_trainer.image_processor)
    setattr(processor, field, value)
    assert KimiVLAdapter(processor, family="kimi_vl").fingerprint != vl_trainer.fingerprint


def test_fingerprint_differs_for_device(k25_trainer, vl_trainer):
    for adapter in (k25_trainer, vl_trainer):
        other = type(adapter)(adapter.image_processor, family=adapter.family, device="cuda")
        assert other.fingerprint != adapter.fingerprint


def test_registry_entries(k25_dir):
    assert ADAPTERS["kimi_k25"] is adapter_class("kimi_k25") is KimiK25Adapter
    assert ADAPTERS["kimi_vl"] is adapter_class("kimi_vl") is KimiVLAdapter
    assert (KimiK25Adapter.grid_field, KimiK25Adapter.grid_len) == ("grid_thws", 3)
    assert (KimiVLAdapter.grid_field, KimiVLAdapter.grid_len) == ("image_grid_hws", 2)
    with pytest.raises(ValueError, match="backend"):
        load_adapter(k25_dir, backend="torchvision")


def test_model_types_are_the_ones_vllm_reads(k25_default, vl_oracle):
    assert k25_default.model_config.hf_config.model_type in KimiK25Adapter.model_types
    assert vl_oracle.model_config.hf_config.model_type in KimiVLAdapter.model_types


@pytest.mark.parametrize("family", ["kimi_k25", "kimi_vl"])
def test_offload_and_resolve_roundtrip(family, k25_trainer, vl_trainer, tmp_path):
    adapter = k25_trainer if family == "kimi_k25" else vl_trainer
    data = image_bytes("coffee", (1000, 30))
    ref = offload_image(data, tmp_path, adapter)
    body = parse_ref(ref.ref)
    assert body.payload == {adapter.grid_field: ref.grid}
    assert len(ref.grid) == adapter.grid_len
    resolved = adapter.resolve_raw(body, AssetStore(tmp_path), ref=ref.ref)
    processed = adapter.process(load_image(data))
    for name, tensor in processed.tensors.items():
        assert torch.equal(resolved.tensors[name], tensor), name
    bad = RawRefBody(**{**_fields(body), "payload": {"image_grid_thw": [1, 2, 72]}})
    with pytest.raises(InvalidRef):
        adapter.check_ref(parse_ref(format_mmraw(bad)))


def _fields(body: RawRefBody) -> dict[str, Any]:
    return {f: getattr(body, f) for f in body.__struct_fields__}


def test_k25_processing_on_many_threads_does_not_abort_the_process(k25_dir):
    """vLLM's fused K2.5 processor runs a parallel numba kernel that aborts the whole process when
    two threads enter it at once (numba's workqueue layer: "Concurrent access has been
    detected"); the plugin's resolver and the trainer's materialize process on pools, so the
    adapter serializes ``preprocess`` on the instance (vLLM's own calls included). Four threads in
    a child process (the abort would take pytest down with it): once rc -6."""
    import subprocess
    import sys
    import textwrap

    from helpers import REPO

    code = textwrap.dedent(
        f"""
        import sys, threading
        sys.path.insert(0, {str(REPO / "tests")!r})
        from helpers import photo_bytes
        from protocol.adapters import load_adapter
        from protocol.images import load_image
        adapter = load_adapter({str(k25_dir)!r})
        names = ("astronaut", "coffee", "chelsea", "rocket")
        images = [load_image(photo_bytes(n, size=(448, 448))) for n in names]
        adapter.process(images[0])
        errors = []
        def work(i):
            try:
                for _ in range(8):
                    adapter.process(images[i])
            except BaseException as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print("errors", errors)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "errors []" in out.stdout, (out.returncode, out.stderr[-2000:])
