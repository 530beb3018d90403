"""trainer_lib.collate.FeatureWriter: the collate of distinct images written as each is processed
equals ``adapter.collate`` of the same images, on real photos and the real processors."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import ensure_tiny_model, photo_bytes
from protocol.adapters import load_adapter
from protocol.images import load_image
from trainer_lib.collate import FeatureWriter

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


@pytest.fixture(scope="module", params=["qwen2_vl", "kimi_vl"])
def adapter(request):
    return load_adapter(ensure_tiny_model(request.param))


def images(adapter, **kwargs):
    """Real photos at several sizes (distinct grids), processed by the family's processor."""
    sizes = [(200, 150), (120, 90), (64, 160), (96, 96)]
    out = []
    for name, size in zip(PHOTOS, sizes, strict=True):
        out.append(adapter.process(load_image(photo_bytes(name, size=size)), **kwargs))
    assert len({item.grid for item in out}) == len(out)
    return out


def test_written_from_threads_in_any_order_equals_collate(adapter):
    items = images(adapter)
    writer = FeatureWriter(adapter, {k: item.grid for k, item in enumerate(items)})
    with ThreadPoolExecutor(2) as pool:  # put in reverse order from two threads
        list(pool.map(lambda k: writer.put(k, items[k]), reversed(range(len(items)))))
    got, want = writer.features(), adapter.collate(items)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def test_zero_features_beside_raw_pixels_promote_as_cat(qwen2_vl_adapter):
    """uint8 pixels (vLLM's ``mm_device_do_normalize`` layout) then float32 zero features, as
    ``materialize`` puts them (failed refs last): float32 out, as ``torch.cat`` gives."""
    raw = images(qwen2_vl_adapter, raw_pixels=True)[:2]
    zeros = qwen2_vl_adapter.zero_features((1, 4, 6))
    items = [*raw, zeros]
    assert raw[0].tensors["pixel_values"].dtype == torch.uint8
    writer = FeatureWriter(qwen2_vl_adapter, {k: item.grid for k, item in enumerate(items)})
    for k, item in enumerate(items):
        writer.put(k, item)
    got, want = writer.features(), qwen2_vl_adapter.collate(items)
    assert got["pixel_values"].dtype == want["pixel_values"].dtype == torch.float32
    assert torch.equal(got["pixel_values"], want["pixel_values"])


def test_refusals(qwen2_vl_adapter):
    a, b = images(qwen2_vl_adapter)[:2]
    writer = FeatureWriter(qwen2_vl_adapter, {0: a.grid, 1: b.grid})
    with pytest.raises(ValueError, match="its grid gives"):
        writer.put(0, b)  # another grid's rows
    writer.put(0, a)
    with pytest.raises(ValueError, match=r"images \[1\] were not put"):
        writer.features()
    with pytest.raises(ValueError, match="fields"):
        writer.put(
            1, type(b)(tensors={"pixel_values": b.tensors["pixel_values"]}, grid=b.grid, num_placeholders=0)
        )
    raw = images(qwen2_vl_adapter, raw_pixels=True)[1]  # uint8 outputs, then float32 pixels
    narrow = FeatureWriter(qwen2_vl_adapter, {0: raw.grid, 1: b.grid})
    narrow.put(0, raw)
    with pytest.raises(ValueError, match="would be cast"):
        narrow.put(1, b)
