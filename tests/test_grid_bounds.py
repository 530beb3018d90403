"""``ImageAdapter.check_grid``: a claimed grid is bounded by the processor's own limits before any
tensor is sized by it; every grid the processor can produce passes."""

from __future__ import annotations

import resource

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import ensure_tiny_model
from protocol.adapters import load_adapter
from protocol.errors import GridMismatch

FAMILIES = ("qwen2_vl", "qwen3_vl", "kimi_vl", "kimi_k25")


@pytest.fixture(scope="module", params=FAMILIES)
def adapter(request):
    return load_adapter(ensure_tiny_model(request.param))


sizes = st.tuples(st.integers(1, 20000), st.integers(1, 20000))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=sizes)
def test_every_grid_the_processor_produces_passes(adapter, size):
    width, height = size
    try:
        grid = adapter.grid_for_size(width, height)
    except ValueError:  # the processor refuses this size (aspect ratio, position embeddings)
        return
    assert adapter.check_grid(list(grid)) == tuple(grid)


def test_the_processors_largest_images_pass(adapter):
    axes, _ = adapter.grid_limits()
    for width, height in [(20000, 20000), (20000, 200), (200, 20000), (8000, 6000)]:
        try:
            grid = adapter.grid_for_size(width, height)
        except ValueError:
            continue
        assert adapter.check_grid(grid) == tuple(grid)
        assert all(g <= a for g, a in zip(grid, axes, strict=True))


@pytest.mark.parametrize("scale", [2, 64])
def test_forged_grids_are_refused_before_allocation(adapter, scale):
    axes, most = adapter.grid_limits()
    forged = [*axes[:-1], axes[-1] * scale]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(GridMismatch) as info:
        adapter.check_grid(forged, ref="mmraw:forged")
    assert info.value.ref == "mmraw:forged" and info.value.http_status == 422
    assert str(most) in str(info.value)
    # ...and through the ref payload, which is how a claimed grid arrives
    with pytest.raises(GridMismatch):
        adapter.grid_from_payload({adapter.grid_field: forged})
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: nothing sized


@pytest.mark.parametrize("bad", [[], [0, 1, 1], [1, -2, 4], [1.0, 2, 2], [1, 2, 2, 2]])
def test_malformed_grids_are_refused(adapter, bad):
    with pytest.raises(GridMismatch):
        adapter.check_grid(bad)


@pytest.mark.parametrize("in_token_limit", [4096, 16384])
def test_kimi_vl_grids_at_released_token_limits_pass(in_token_limit):
    """The released Kimi-VL checkpoints' ``in_token_limit`` (4096; 16384 for the 2506 Thinking
    model), at aspect ratios where the resize, computed from whole patches, overshoots the limit
    (an 8070 x 193 photo: 5136 patches at 4096, once refused as over 5119)."""
    import copy

    from protocol.adapters.kimi_vl import KimiVLAdapter

    base = load_adapter(ensure_tiny_model("kimi_vl"))
    processor = copy.copy(base.image_processor)
    processor.in_token_limit = in_token_limit
    adapter = KimiVLAdapter(processor, family="kimi_vl")
    sizes = [(8070, 193), (5428, 181), (5146, 657), (7000, 700), (4000, 3000), (7150, 300), (300, 7150)]
    over = 0
    for width, height in sizes:
        try:
            grid = adapter.grid_for_size(width, height)
        except ValueError:  # "Exceed pos emb": the processor itself refuses it
            continue
        assert adapter.check_grid(grid) == tuple(grid), (width, height, grid)
        over += grid[0] * grid[1] > in_token_limit
    assert over  # some of them past the limit: what the old bound refused
