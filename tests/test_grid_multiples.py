"""``ImageAdapter.check_grid`` refuses grids whose sides are not multiples of the family's merge size
(``grid_multiples``, read from the processor's own config): every grid the real processors of the
tiny models emit passes (real photos, odd and extreme sizes), and a grid none of them can emit
(``[1, 3, 3]``: 9 patch rows vLLM's vision tower cannot reshape, 2 placeholders by rounding down)
is a typed ``grid_mismatch`` before anything is sized by it, on the server and trainer paths."""

from __future__ import annotations

import copy
import io
import math

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from helpers import ensure_tiny_model, photo_array
from protocol.adapters import QwenVLAdapter, load_adapter, offload_image
from protocol.errors import GridMismatch
from protocol.refs import RawRefBody, format_mmraw, parse_ref
from protocol.structs import MMRefs, RawMMRef, TrainingSample

FAMILIES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "kimi_vl",
    "kimi_k25",
)

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera")
"""scikit-image photos at their own sizes (512x512, 600x400, 451x300, 427x640, 512x512 grey)."""

ODD_SIZES = [
    (29, 31), (31, 29), (1, 1), (2, 3), (15, 29), (17, 17), (27, 29), (4000, 30), (30, 4000),
    (1000, 7), (7, 1000), (899, 14), (14, 899), (1023, 767), (4001, 2999),
]  # fmt: skip
"""(width, height): odd sides, 1x1 padded or resized up, very wide and very tall."""


@pytest.fixture(scope="module", params=FAMILIES)
def adapter(request):
    return load_adapter(ensure_tiny_model(request.param))


def _images():
    for name in PHOTOS:
        yield name, Image.fromarray(photo_array(name)).convert("RGB")
    big = Image.fromarray(photo_array("astronaut")).convert("RGB")
    for size in ODD_SIZES:
        yield f"{size[0]}x{size[1]}", big.resize(size, Image.Resampling.BICUBIC)


def _processed_grids(adapter):
    """``{image name: grid}`` of the real processor's output (sizes it refuses are skipped)."""
    grids = {}
    for name, image in _images():
        try:
            processed = adapter.process(image)
        except ValueError:  # aspect ratio (Qwen > 200) or position embeddings (Kimi-VL)
            continue
        grids[name] = processed.grid
        # the processor's grid, the adapter's prediction and the placeholder count agree
        assert adapter.grid_for_size(*image.size) == processed.grid, name
        assert processed.tensors["pixel_values"].shape[0] == math.prod(processed.grid), name
    return grids


def test_every_grid_the_real_processor_emits_passes(adapter):
    grids = _processed_grids(adapter)
    assert len(grids) >= len(PHOTOS) + len(ODD_SIZES) - 2
    steps = adapter.grid_multiples()
    assert len(steps) == adapter.grid_len and all(s >= 1 for s in steps)
    for name, grid in grids.items():
        assert all(g % s == 0 for g, s in zip(grid, steps, strict=True)), (name, grid, steps)
        assert adapter.check_grid(list(grid), ref=name) == grid
        assert adapter.grid_from_payload(adapter.payload(grid)) == grid
        if adapter.family != "kimi_k25" or adapter.cfg.get("fixed_output_tokens") is None:
            # the count is exact: no rounding down of a partial merge unit
            assert adapter.num_placeholders(grid) * math.prod(steps) == math.prod(grid), name


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.tuples(st.integers(1, 2500), st.integers(1, 2500)))
def test_random_sizes_through_the_real_processor_pass(adapter, size):
    try:
        processed = adapter.process(Image.new("RGB", size, (10, 120, 230)))
    except ValueError:  # a size the processor refuses
        return
    assert adapter.check_grid(list(processed.grid)) == processed.grid


def test_the_multiples_are_the_processors_merge_size(adapter):
    p = adapter.image_processor
    if adapter.family == "kimi_vl":
        assert adapter.grid_multiples() == tuple(p.merge_kernel_size) == (2, 2)
    elif adapter.family == "kimi_k25":
        merge = p.media_proc_cfg["merge_kernel_size"]
        assert adapter.grid_multiples() == (1, merge, merge) == (1, 2, 2)
    else:
        assert adapter.grid_multiples() == (1, p.merge_size, p.merge_size) == (1, 2, 2)


def test_the_multiples_follow_the_processor_config(qwen2_vl_adapter):
    """Read from the processor, not a table: a merge-1 processor takes odd sides."""
    p = copy.deepcopy(qwen2_vl_adapter.image_processor)
    p.merge_size = 1
    merge1 = QwenVLAdapter(p, family="qwen2_vl")
    assert merge1.grid_multiples() == (1, 1, 1)
    assert merge1.check_grid([1, 3, 3]) == (1, 3, 3)
    with pytest.raises(GridMismatch):
        qwen2_vl_adapter.check_grid([1, 3, 3])


def _odd_grids(adapter, grid):
    """Grids next to a real one that no processor of the family emits."""
    steps = adapter.grid_multiples()
    out = [tuple([1] * adapter.grid_len), tuple([3] * adapter.grid_len)]
    for i, s in enumerate(steps):
        if s > 1:
            out.append(tuple(g + 1 if j == i else g for j, g in enumerate(grid)))
            out.append(tuple(g - 1 if j == i else g for j, g in enumerate(grid)))
    out.append(tuple(g + 1 if s > 1 else g for g, s in zip(grid, steps, strict=True)))
    if adapter.grid_len == 3:  # a second frame: an image is one temporal patch
        out.append((2, *grid[1:]))
    return [g for g in dict.fromkeys(out) if g != tuple(grid)]


def test_odd_sides_are_refused_with_the_typed_error(adapter):
    grid = adapter.grid_for_size(600, 400)
    odd = _odd_grids(adapter, grid)
    assert len(odd) >= 5
    for bad in odd:
        with pytest.raises(GridMismatch) as info:
            adapter.check_grid(list(bad), ref="mmraw:odd")
        assert info.value.ref == "mmraw:odd" and info.value.http_status == 422, bad
        assert info.value.code == "grid_mismatch", bad
        assert "exceeds" in info.value.message or "multiple of" in info.value.message, bad
        with pytest.raises(GridMismatch):  # ...and through the ref payload a claim arrives in
            adapter.grid_from_payload(adapter.payload(bad))


def test_a_ref_claiming_an_odd_grid_is_refused_by_check_ref(adapter):
    body = {
        "family": adapter.family,
        "modality": "image",
        "mm_hash": "0123456789abcdef" * 2,
        "payload": adapter.payload([1, 3, 3][-adapter.grid_len :]),
        "raw_image_uri": "file:///data/run_1/assets/images/0123456789abcdef.jpg",
        "fingerprint": adapter.fingerprint,
    }
    ref = format_mmraw(RawRefBody(**body))
    with pytest.raises(GridMismatch) as info:
        adapter.check_ref(parse_ref(ref), ref=ref)
    assert info.value.ref == ref and "multiple of" in info.value.message


@pytest.mark.parametrize("policy", ["placeholder_zero_loss", "error"])
def test_a_missing_image_claiming_an_odd_grid_gets_no_stand_in(tmp_path, qwen2_vl_adapter, policy):
    """The trainer's missing-image policy would size a 9-row zero stand-in for ``[1, 3, 3]`` that
    the merger cannot reshape; the claim is refused first, under both policies."""
    from trainer_lib import MaterializeOptions, materialize

    real = offload_image(_png(), tmp_path, qwen2_vl_adapter)
    body = parse_ref(real.ref)
    claim = {"image_grid_thw": [1, 3, 3]}  # 2 placeholders by rounding down, 9 pixel rows
    forged = format_mmraw(msgspec.structs.replace(body, payload=claim, mm_hash="e" * 32))
    ref = RawMMRef(ref=forged, sha256="e" * 64, media_type="image/png", grid=[1, 3, 3], num_placeholders=2)
    sample = TrainingSample(
        input_ids=[1, 2], loss_mask=[False, True], advantages=[0.0, 0.0], inference_logprobs=[0.0, 0.0],
        mm_refs=MMRefs(items=[ref]),
    )  # fmt: skip
    with pytest.raises(GridMismatch) as info:
        materialize([sample], qwen2_vl_adapter, tmp_path, MaterializeOptions(policy=policy))
    assert info.value.ref == forged and "multiple of [1, 2, 2]" in info.value.message


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(photo_array("coffee")).resize((60, 40)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_the_pil_backend_emits_the_same_multiples(family):
    pil = load_adapter(ensure_tiny_model(family), backend="pil")
    assert pil.backend == "pil" and pil.grid_multiples() == (1, 2, 2)
    grids = _processed_grids(pil)
    assert len(grids) >= len(PHOTOS) + len(ODD_SIZES) - 2
    for grid in grids.values():
        assert pil.check_grid(grid) == grid
