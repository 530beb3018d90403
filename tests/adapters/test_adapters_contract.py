"""The adapter contract, the same tests over every family, against vLLM's own engine-free processor.

The oracle is ``MULTIMODAL_REGISTRY.create_processor(ModelConfig(...))`` (``helpers.oracles``):
the very processor a vLLM server runs on a chat with images. For each family and each pixel mode
vLLM serves it in (``mm_device_do_normalize`` on: raw uint8 pixels; off: normalized float32;
Kimi-VL only the latter) the adapter, built the way the plugin builds it (around the image
processor vLLM runs, ``upstream.served_image_processor``) and the way a trainer builds it
(``load_adapter(model_dir)``), gives bit-identical pixels, the same grid, the same placeholder
count and range, and a prompt expanded exactly like vLLM expands it; its grid arithmetic, zero
features, fingerprint and offload keep their promises. What only one family has (golden numbers,
its processor's own algorithm, its refusals) is in ``test_adapters_{qwen,qwen35,kimi}.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from helpers import (
    KIMI_GRID_SIZES,
    QWEN_GRID_SIZES,
    chat_ids,
    check_against_vllm,
    ensure_tiny_model,
    image_bytes,
    make_oracle,
)
from protocol.adapters import ADAPTERS, adapter_class, load_adapter, offload_image
from protocol.errors import InvalidRef
from protocol.images import load_image
from protocol.placeholders import expand_image_placeholders, locate_image_runs
from protocol.refs import RawRefBody, format_mmraw, parse_ref
from protocol.store import AssetStore

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")
KIMI = ("kimi_k25", "kimi_vl")
FAMILIES = (*QWEN, *KIMI)
MODES = {f: ("raw", "normalized") for f in FAMILIES} | {"kimi_vl": ("normalized",)}
"""The pixel modes vLLM 0.32 serves each family in (it forces ``mm_device_do_normalize`` off for
Kimi-VL)."""
FAMILY_MODES = [(f, m) for f in FAMILIES for m in MODES[f]]

# (photo, size (w, h) or None as shipped): real photos, extreme shapes. The Kimi tiny models allow
# 1024 patches per image (Kimi K2.5 also 64 a side): 600x400, 640x427, 4000x3000 and 462x462 are
# above the limit, 448x448 sits on it; Qwen refuses an aspect ratio over 200 (2000x5).
QWEN_CASES = [
    ("astronaut", None),  # 512x512
    ("coffee", None),  # 600x400
    ("chelsea", None),  # 451x300
    ("rocket", None),  # 640x427
    ("rocket", (1000, 30)),
    ("coffee", (30, 1000)),
    ("chelsea", (17, 17)),
    ("astronaut", (4000, 3000)),
]
KIMI_CASES = [
    *QWEN_CASES,
    ("coffee", (448, 448)),
    ("chelsea", (462, 462)),
    ("astronaut", (2000, 5)),
    ("rocket", (1, 1)),
]
IMAGE_CASES = {f: QWEN_CASES for f in QWEN} | {f: KIMI_CASES for f in KIMI}

GRID_SIZES = {f: QWEN_GRID_SIZES for f in QWEN} | {f: KIMI_GRID_SIZES for f in KIMI}

OFFLOAD_CASES = [("chelsea", None), ("rocket", (1000, 30)), ("coffee", (17, 17))]


def case_id(case) -> str:
    name, size = case
    return name if size is None else f"{name}-{size[0]}x{size[1]}"


def by_family(table: dict, ids=str) -> list:
    """``pytest.param(family, item)`` for every family and every item of its row in ``table``."""
    return [pytest.param(f, item, id=f"{f}-{ids(item)}") for f in FAMILIES for item in table[f]]


# --- fixtures: one vLLM processor per family and mode, built on first use, freed with the module ---


class Built(dict):
    """``key -> value`` built by ``make(key)`` on first use."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = self.make(key)
        return self[key]


@pytest.fixture(scope="module")
def oracles() -> Built:
    """``(family, mode) -> Oracle``; mode ``"default"``: the flags a server starts with."""
    normalize = {"default": None, "raw": True, "normalized": False}
    return Built(lambda key: make_oracle(ensure_tiny_model(key[0]), normalize[key[1]]))


@pytest.fixture(scope="module")
def trainer_adapters() -> Built:
    """``family -> adapter``: ``load_adapter(model_dir)``, as a trainer builds it."""
    return Built(lambda family: load_adapter(ensure_tiny_model(family)))


@pytest.fixture(scope="module")
def tokenizers() -> Built:
    from transformers import AutoTokenizer

    return Built(
        lambda family: AutoTokenizer.from_pretrained(ensure_tiny_model(family), local_files_only=True)
    )


def server_adapter(family: str, oracle):
    """Built like ``vllm_plugin``'s ``init_state``: around the image processor vLLM runs."""
    return adapter_class(family)(oracle.image_processor, family=family)


# --- equality with vLLM's processor ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "mode", "case"),
    [pytest.param(f, m, c, id=f"{f}-{m}-{case_id(c)}") for f, m in FAMILY_MODES for c in IMAGE_CASES[f]],
)
def test_process_matches_vllm(family, mode, case, oracles, trainer_adapters, tokenizers, tmp_path):
    """One image through vLLM's processor and through each adapter: pixels (bit for bit), grid,
    placeholder count and range, the expanded prompt."""
    oracle, trainer = oracles[family, mode], trainer_adapters[family]
    adapters = (server_adapter(family, oracle), trainer)
    check_against_vllm(oracle, adapters, image_bytes(*case), chat_ids(tokenizers[family], 1), tmp_path)


@pytest.mark.parametrize(("family", "mode"), FAMILY_MODES, ids=[f"{f}-{m}" for f, m in FAMILY_MODES])
def test_several_images_in_one_prompt_match_vllm(
    family, mode, oracles, trainer_adapters, tokenizers, tmp_path
):
    datas = [image_bytes(n) for n in ("astronaut", "chelsea", "rocket")]
    datas.insert(1, image_bytes("coffee", (1000, 30)))
    oracle, trainer = oracles[family, mode], trainer_adapters[family]
    images = [load_image(d) for d in datas]
    prompt = chat_ids(tokenizers[family], len(images))
    out = oracle.run(prompt, images)
    refs = [offload_image(d, tmp_path, trainer) for d in datas]
    placeholders = out["mm_placeholders"][trainer.vllm_modality]
    for i, image in enumerate(images):
        item = out["mm_kwargs"][trainer.vllm_modality][i]
        got = trainer.process(image, raw_pixels=oracle.normalize)
        assert torch.equal(got.tensors["pixel_values"], item["pixel_values"].data), i
        assert refs[i].grid == item[trainer.grid_field].data.tolist()
        assert refs[i].num_placeholders == placeholders[i].length
    token_id = trainer.placeholder_token_id(oracle.model_config.hf_config)
    expanded = expand_image_placeholders(prompt, refs, token_id)
    assert expanded == list(out["prompt_token_ids"])
    counts = [r.num_placeholders for r in refs]
    assert locate_image_runs(expanded, [], token_id, counts=counts) == [
        (p.offset, p.length) for p in placeholders
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_placeholder_token_id_is_the_one_vllm_expands(family, oracles, trainer_adapters, tokenizers):
    """The token vLLM expands into an image's range; the tokenizer's pad token of the family."""
    oracle = oracles[family, "default"]
    prompt = chat_ids(tokenizers[family], 1)
    out = oracle.run(prompt, [load_image(image_bytes("chelsea"))])
    (placeholder,) = out["mm_placeholders"][oracle.modality]
    want = out["prompt_token_ids"][placeholder.offset]
    pad = "<|media_pad|>" if family in KIMI else "<|image_pad|>"
    assert tokenizers[family].convert_tokens_to_ids(pad) == want
    assert prompt.count(want) == 1
    for adapter in (server_adapter(family, oracle), trainer_adapters[family]):
        assert adapter.placeholder_token_id(oracle.model_config.hf_config) == want


# --- grids and placeholder counts ------------------------------------------------------------------


def vllm_count(oracle, w: int, h: int) -> int:
    """vLLM's own placeholder count for a ``w x h`` image (no pixels processed)."""
    info = oracle.processor.info
    if oracle.modality == "vision_chunk":  # Kimi K2.5: reads the image's size only
        return info.media_tokens_calculator({"type": "image", "image": Image.new("1", (w, h))})
    if oracle.model_config.hf_config.model_type == "kimi_vl":
        return info.get_num_image_tokens(image_width=w, image_height=h)
    return info.get_num_image_tokens(
        image_width=w, image_height=h, image_processor=oracle.image_processor, mm_kwargs={}
    )


@pytest.mark.parametrize(("family", "size"), by_family(GRID_SIZES, ids=lambda s: f"{s[0]}x{s[1]}"))
def test_grid_for_size_equals_processed_grid(family, size, oracles, trainer_adapters):
    """The grid predicted from the size alone is the processor's, passes ``check_grid``, and
    counts vLLM's placeholders; one pixel row per patch."""
    adapter = trainer_adapters[family]
    processed = adapter.process(Image.new("RGB", size, (10, 120, 230)))
    assert adapter.grid_for_size(*size) == processed.grid
    assert adapter.check_grid(list(processed.grid)) == processed.grid
    assert adapter.num_placeholders(processed.grid) == processed.num_placeholders
    assert processed.num_placeholders == vllm_count(oracles[family, "default"], *size)
    assert processed.tensors["pixel_values"].shape[0] == math.prod(processed.grid)


@pytest.mark.parametrize("family", FAMILIES)
def test_num_placeholders_equals_vllm_count(family, oracles, trainer_adapters):
    """For any size up to 6000 px: the adapter's count is vLLM's, or both refuse the size."""
    oracle = oracles[family, "default"]
    adapter = server_adapter(family, oracle)

    @settings(max_examples=200, deadline=None)
    @given(w=st.integers(1, 6000), h=st.integers(1, 6000))
    def check(w, h):
        try:
            want = vllm_count(oracle, w, h)
        except ValueError as e:
            with pytest.raises(ValueError, match="aspect ratio"):
                adapter.grid_for_size(w, h)
            assert "aspect ratio" in str(e)
            return
        assert adapter.num_placeholders(adapter.grid_for_size(w, h)) == want

    check()


@pytest.mark.parametrize(("family", "case"), by_family({f: c[:7] for f, c in IMAGE_CASES.items()}, case_id))
def test_zero_features_matches_process(family, case, trainer_adapters):
    """Zero features for a grid: the tensors ``process`` gives for it, in shape and dtype, zero pixels."""
    adapter = trainer_adapters[family]
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


# --- fingerprints, registry ------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_fingerprint_server_equals_trainer_and_is_stable(family, oracles, trainer_adapters):
    trainer = trainer_adapters[family]
    server = server_adapter(family, oracles[family, "default"])
    assert server.backend == trainer.backend == ("pil" if family in KIMI else "torchvision")
    again = load_adapter(ensure_tiny_model(family))
    assert server.fingerprint == trainer.fingerprint == again.fingerprint
    assert len(trainer.fingerprint) == 32 and int(trainer.fingerprint, 16) >= 0
    body = RawRefBody(
        family=family,
        modality="image",
        mm_hash="a" * 32,
        payload={trainer.grid_field: [1] * trainer.grid_len},
        raw_image_uri="file:///x.png",
        fingerprint=trainer.fingerprint,
    )
    assert parse_ref(format_mmraw(body)).fingerprint == trainer.fingerprint  # valid under the ref rules


@pytest.mark.parametrize("family", FAMILIES)
def test_fingerprint_differs_for_device(family, trainer_adapters):
    adapter = trainer_adapters[family]
    cuda = type(adapter)(adapter.image_processor, family=family, device="cuda")
    assert cuda.fingerprint != adapter.fingerprint


def test_fingerprints_differ_between_families(trainer_adapters):
    fingerprints = {f: trainer_adapters[f].fingerprint for f in FAMILIES}
    assert len(set(fingerprints.values())) == len(FAMILIES), fingerprints


@pytest.mark.parametrize("family", FAMILIES)
def test_registry_row_is_the_model_type_vllm_reads(family, oracles, trainer_adapters):
    cls = type(trainer_adapters[family])
    assert ADAPTERS[family] is adapter_class(family) is cls
    assert oracles[family, "default"].model_config.hf_config.model_type == family
    assert family in cls.model_types


# --- offload --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "case"), by_family(dict.fromkeys(FAMILIES, OFFLOAD_CASES), case_id))
def test_offload_is_idempotent_and_resolves_to_the_processed_tensors(
    family, case, trainer_adapters, tmp_path
):
    adapter = trainer_adapters[family]
    data = image_bytes(*case)
    first = offload_image(data, tmp_path, adapter)
    second = offload_image(data, tmp_path, adapter)
    assert first.ref == second.ref and first == second
    assert len(list((tmp_path / "images").iterdir())) == 1

    processed = adapter.process(load_image(data))
    assert first.grid == list(processed.grid) and len(first.grid) == adapter.grid_len
    assert first.num_placeholders == processed.num_placeholders
    assert first.media_type == "image/jpeg"

    body = parse_ref(first.ref)
    assert isinstance(body, RawRefBody)
    assert (body.family, body.fingerprint) == (family, adapter.fingerprint)
    assert body.payload == {adapter.grid_field: list(processed.grid)}
    assert first.sha256.startswith(body.mm_hash)

    resolved = adapter.resolve_raw(body, AssetStore(tmp_path), ref=first.ref)
    for name, tensor in processed.tensors.items():
        assert torch.equal(resolved.tensors[name], tensor), name
    other_key = "grid_thws" if adapter.grid_field != "grid_thws" else "image_grid_thw"
    fields = {f: getattr(body, f) for f in body.__struct_fields__}
    bad = RawRefBody(**{**fields, "payload": {other_key: first.grid}})
    with pytest.raises(InvalidRef):
        adapter.check_ref(parse_ref(format_mmraw(bad)))
