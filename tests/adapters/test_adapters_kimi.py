"""Kimi-VL and Kimi K2.5 adapters: what only these families have.

The oracle is ``MULTIMODAL_REGISTRY.create_processor(ModelConfig(...))`` (``helpers.oracles``) on
the tiny models of ``scripts/make_tiny_models.py``: vLLM's ``KimiK25MultiModalProcessor`` (which
runs vLLM's ``KimiK25FusedVisionProcessor``; modality ``vision_chunk``) and
``KimiVLMultiModalProcessor`` (which runs the checkpoint's remote processor, here
``KimiVLImageProcessor`` of ``protocol/adapters/kimi_vl.py``, and counts placeholders with its own
arithmetic, ``KimiVLProcessingInfo.get_num_image_tokens``). The contract every family keeps
against it (bit-identical pixels, grids, counts, zero features, fingerprints, offload, for the
tiny models' config) is ``test_adapters_contract.py``. Here: vLLM's defaults for these families,
the released checkpoints' processor config against vLLM, Kimi-VL's pixels against the published
algorithm with PIL/torch primitives (vLLM runs our transcription there, so that check cannot come
from vLLM), the position-embedding and token limits, golden numbers, the fingerprint's fields,
and K2.5's processor on many threads.
"""

from __future__ import annotations

import copy
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import Oracle, chat_ids, check_against_vllm, ensure_tiny_model, image_bytes, make_oracle
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
from protocol.errors import ImageUnreadable
from protocol.images import load_image

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


# --- fixtures (module scope: one vLLM processor per family and mode) ------------------------------


@pytest.fixture(scope="module")
def k25_dir() -> Path:
    return ensure_tiny_model("kimi_k25")


@pytest.fixture(scope="module")
def vl_dir() -> Path:
    return ensure_tiny_model("kimi_vl")


@pytest.fixture(scope="module")
def k25_default(k25_dir) -> Oracle:
    return make_oracle(k25_dir)


@pytest.fixture(scope="module")
def vl_oracle(vl_dir) -> Oracle:
    return make_oracle(vl_dir)


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
    return make_oracle(folder)


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


# --- Kimi K2.5: vLLM's defaults and processor -----------------------------------------------------


def test_k25_vllm_defaults(k25_default, k25_server):
    """vLLM 0.32 serves Kimi K2.5 with its fused processor, raw uint8 pixels, modality vision_chunk."""
    assert type(k25_default.processor.info.image_processor).__name__ == "KimiK25FusedVisionProcessor"
    assert k25_default.normalize is True
    assert k25_default.processor.info.get_supported_mm_limits() == {"vision_chunk": None}
    assert k25_server.vllm_modality == "vision_chunk"
    assert k25_server.backend == "pil"


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


# --- Kimi-VL: vLLM's defaults ---------------------------------------------------------------------


def test_vl_vllm_defaults(vl_oracle, vl_server):
    """vLLM 0.32 forces mm_device_do_normalize off for Kimi-VL (normalized float32 pixels)."""
    assert vl_oracle.normalize is False
    assert vl_server.vllm_modality == "image"
    with pytest.raises(NotImplementedError, match="mm_device_do_normalize"):
        vl_server.process(Image.new("RGB", (28, 28)), raw_pixels=True)


# --- Kimi-VL: the published algorithm -------------------------------------------------------------


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
    from transformers import AutoTokenizer

    prompt = chat_ids(AutoTokenizer.from_pretrained(vl_dir, local_files_only=True), 1)
    check_against_vllm(vl_released_oracle, (server, adapter), image_bytes(*case), prompt, tmp_path)


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


# --- both families: goldens, fingerprints, registry -----------------------------------------------


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


def test_registry_entries(k25_dir):
    assert ADAPTERS["kimi_k25"] is adapter_class("kimi_k25") is KimiK25Adapter
    assert ADAPTERS["kimi_vl"] is adapter_class("kimi_vl") is KimiVLAdapter
    assert (KimiK25Adapter.grid_field, KimiK25Adapter.grid_len) == ("grid_thws", 3)
    assert (KimiVLAdapter.grid_field, KimiVLAdapter.grid_len) == ("image_grid_hws", 2)
    with pytest.raises(ValueError, match="backend"):
        load_adapter(k25_dir, backend="torchvision")


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
