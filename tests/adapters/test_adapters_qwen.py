"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL adapter: what only these families have.

The contract every family keeps against vLLM's own processor (bit-identical pixels in both
modes, grids, counts, zero features, fingerprints, offload) is ``test_adapters_contract.py``.
Here: vLLM's default pixel mode for them, adjacent images, golden numbers of transformers'
``smart_resize``, the PIL backend, the aspect-ratio limit, the fingerprint's fields, the
registry's refusals and the ref checks.
"""

from __future__ import annotations

import copy
import io
import json

import pytest
from PIL import Image

from helpers import QWEN_GRID_SIZES, ensure_tiny_model, image_bytes, make_oracle
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

# Facts of transformers' smart_resize with each tiny model's preprocessor config (printed once,
# then pinned, like transformers' own tests pin [1, 70, 70]). Qwen2/2.5: patch 14, merge 2,
# pixels 3136..50176; Qwen3: patch 16, merge 2, pixels 4096..65536.
GOLDEN_ASTRONAUT = {  # family: (grid, placeholders, pixel_values shape)
    "qwen2_vl": ((1, 16, 16), 64, (256, 1176)),
    "qwen2_5_vl": ((1, 16, 16), 64, (256, 1176)),
    "qwen3_vl": ((1, 16, 16), 64, (256, 1536)),
}
QWEN3_SHARED = ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")
"""Their tiny models share Qwen3-VL's tiny image processor config (patch 16, merge 2, mean/std 0.5,
4..64 merged tokens), so transformers' smart_resize gives them Qwen3-VL's golden grids."""
GOLDEN_ASTRONAUT |= dict.fromkeys(QWEN3_SHARED, GOLDEN_ASTRONAUT["qwen3_vl"])
SIZE_GRIDS = {  # (w, h): (grid of Qwen2-VL and Qwen2.5-VL, which share the config; grid of Qwen3-VL)
    (600, 400): ((1, 12, 18), (1, 12, 18)),
    (1000, 30): ((1, 2, 72), (1, 2, 62)),
    (30, 1000): ((1, 72, 2), (1, 62, 2)),
    (17, 17): ((1, 4, 4), (1, 4, 4)),
    (4000, 3000): ((1, 12, 18), (1, 12, 18)),
    (4000, 20): ((1, 2, 226), (1, 2, 226)),
}
GOLDEN_SIZES = {  # family: {(w, h): grid}
    family: {size: grids[k] for size, grids in SIZE_GRIDS.items()}
    for family, k in (("qwen2_vl", 0), ("qwen2_5_vl", 0), ("qwen3_vl", 1))
}
GOLDEN_SIZES |= dict.fromkeys(QWEN3_SHARED, GOLDEN_SIZES["qwen3_vl"])


def png_bytes(width: int, height: int, color: tuple[int, int, int] = (200, 40, 90)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


# --- fixtures (the others: conftest.py) -----------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    """The family of ``conftest.py``'s fixtures (``model_dir``, ``trainer_adapter``...)."""
    return request.param


# --- equality with vLLM's processor ---------------------------------------------------------------


def test_vllm_default_is_raw_pixels(default_oracle):
    """These families default to raw pixels in vLLM (the double-normalization pitfall)."""
    assert default_oracle.normalize is True


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


# --- golden numbers -------------------------------------------------------------------------------


@pytest.mark.parametrize("golden_family", list(GOLDEN_ASTRONAUT))
def test_golden_astronaut(golden_family):
    """Trainer's and server's adapter (Qwen3.5 and the MoE variants too)."""
    grid, placeholders, shape = GOLDEN_ASTRONAUT[golden_family]
    model_dir = ensure_tiny_model(golden_family)
    server = adapter_class(golden_family)(make_oracle(model_dir).image_processor, family=golden_family)
    for adapter in (load_adapter(model_dir), server):
        got = adapter.process(load_image(image_bytes("astronaut")))
        assert got.grid == grid
        assert got.num_placeholders == placeholders
        assert tuple(got.tensors["pixel_values"].shape) == shape
        assert got.tensors["image_grid_thw"].tolist() == [list(grid)]
        assert adapter.grid_for_size(512, 512) == grid


@pytest.mark.parametrize("golden_family", list(GOLDEN_SIZES))
def test_golden_sizes(golden_family):
    adapter = load_adapter(ensure_tiny_model(golden_family))
    for (w, h), grid in GOLDEN_SIZES[golden_family].items():
        assert adapter.grid_for_size(w, h) == grid, (w, h)


# --- grids ----------------------------------------------------------------------------------------


def test_grid_for_size_equals_processed_grid_with_the_pil_backend(model_dir):
    """The contract checks the default (torchvision) backend; PIL's resize gives the same grids."""
    adapter = load_adapter(model_dir, backend="pil")
    assert adapter.backend == "pil"
    mismatches = []
    for w, h in QWEN_GRID_SIZES:
        processed = adapter.process(Image.new("RGB", (w, h), (10, 120, 230)))
        predicted = adapter.grid_for_size(w, h)
        if processed.grid != predicted or processed.num_placeholders != adapter.num_placeholders(predicted):
            mismatches.append(((w, h), predicted, processed.grid))
    assert not mismatches


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


# --- fingerprints ---------------------------------------------------------------------------------


def test_fingerprint_differs_for_pil_backend(model_dir, trainer_adapter):
    pil = load_adapter(model_dir, backend="pil")
    assert pil.backend == "pil"
    assert pil.fingerprint != trainer_adapter.fingerprint


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


# --- registry and ref checks ----------------------------------------------------------------------


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
