"""``vllm_plugin.items``: vLLM's item wire format and the layout check, with the tiny Qwen2-VL's
own vLLM field config (no server): every malformed item is refused with the caller's error, no
allocation for a claimed grid, and a broken vLLM install is never a client error."""

from __future__ import annotations

import sys
import threading

import psutil
import pytest
import torch
from PIL import Image

from helpers import photo_array
from protocol.errors import CorruptFeature, InvalidRequest

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def photo_item(qwen2_vl_adapter, layout):
    """The item vLLM builds for a real photo (raw uint8 pixels, as a default server feeds)."""
    from transformers import BatchFeature
    from vllm.multimodal.inputs import MultiModalKwargsItems

    image = Image.fromarray(photo_array("coffee")).resize((200, 140))
    tensors = BatchFeature(dict(qwen2_vl_adapter.process(image, raw_pixels=True).tensors))
    (item,) = MultiModalKwargsItems.from_hf_inputs(tensors, layout.fields_config(tensors))["image"]
    return item


def replaced(item, key: str, data=None, field=None):
    elem = item[key]
    return type(item)(
        {**item, key: type(elem)(data=elem.data if data is None else data, field=field or elem.field)}
    )


def test_a_real_item_passes_with_its_grid_and_count(layout, photo_item, qwen2_vl_adapter):
    checked = layout.check(photo_item, InvalidRequest, "item")
    grid = tuple(photo_item["image_grid_thw"].data.tolist())
    assert checked.grid == grid and checked.num_placeholders == qwen2_vl_adapter.num_placeholders(grid)
    assert photo_item["pixel_values"].data.dtype == torch.uint8
    # the float32 item of the same image has the same layout (pixel dtype follows the pixel mode)
    floats = replaced(photo_item, "pixel_values", photo_item["pixel_values"].data.float())
    assert layout.check(floats, InvalidRequest, "item").grid == grid


def test_malformed_items_are_refused_with_the_callers_error(layout, photo_item):
    from vllm.multimodal.inputs import MultiModalBatchedField

    pixels = photo_item["pixel_values"].data
    grid = photo_item["image_grid_thw"].data
    t, h, w = grid.tolist()
    cases = {
        "fewer rows than the grid": replaced(photo_item, "pixel_values", pixels[:-4]),
        "more rows than the grid": replaced(photo_item, "pixel_values", torch.cat([pixels, pixels[:4]])),
        "grid claims more patches": replaced(photo_item, "image_grid_thw", torch.tensor([t, h, w + 2])),
        "grid of two numbers": replaced(photo_item, "image_grid_thw", torch.tensor([h, w])),
        "grid of zeros": replaced(photo_item, "image_grid_thw", torch.tensor([0, h, w])),
        "grid as int32": replaced(photo_item, "image_grid_thw", grid.to(torch.int32)),
        "rows one value short": replaced(photo_item, "pixel_values", pixels[:, :-1]),
        "pixels as a batched field": replaced(photo_item, "pixel_values", field=MultiModalBatchedField()),
        "an extra field": type(photo_item)({**photo_item, "image_embeds": photo_item["pixel_values"]}),
        "a missing field": type(photo_item)({"pixel_values": photo_item["pixel_values"]}),
    }
    for name, item in cases.items():
        with pytest.raises(CorruptFeature, match=r"^payload") as info:
            layout.check(item, CorruptFeature, "payload", "mmfile:v1:x")
        assert info.value.ref == "mmfile:v1:x", name
        assert " at 0x" not in info.value.message, name


def test_a_claimed_grid_allocates_nothing(layout, photo_item):
    """A few rows claiming a 512x512-patch grid (1.2 GB of float32 pixels if sized) are refused
    without the process growing: the check slices the item's own tensors."""
    rss = psutil.Process().memory_info().rss
    forged = replaced(photo_item, "image_grid_thw", torch.tensor([1, 512, 512]))
    with pytest.raises(InvalidRequest, match="its grid needs 262144"):
        layout.check(forged, InvalidRequest, "item")
    assert psutil.Process().memory_info().rss - rss < 64 << 20


def test_an_inline_item_is_held_to_its_rows_and_merge_size_not_to_the_default_limits(layout, photo_item):
    """vLLM's render route takes ``mm_processor_kwargs`` (a larger pixel budget): an inline item
    carries its own rows, so its grid may pass the processor's default limits (here 936 patches,
    over 480) as long as the rows fill it and its sides are multiples of the merge size."""
    from protocol.errors import GridMismatch

    row = photo_item["pixel_values"].data[:1]
    big = replaced(
        replaced(photo_item, "image_grid_thw", torch.tensor([1, 26, 36])), "pixel_values", row.repeat(936, 1)
    )
    checked = layout.check(big, InvalidRequest, "item")
    assert checked.grid == (1, 26, 36) and checked.num_placeholders == 234
    odd = replaced(
        replaced(big, "image_grid_thw", torch.tensor([1, 27, 36])), "pixel_values", row.repeat(972, 1)
    )
    with pytest.raises(GridMismatch, match="multiple of"):
        layout.check(odd, InvalidRequest, "item")


def test_decode_round_trip_and_refusals(photo_item):
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

    from vllm_plugin.items import decode_item, encode_item

    encoded = encode_item(photo_item)
    assert torch.equal(decode_mm_kwargs_item(encoded)["pixel_values"].data, photo_item["pixel_values"].data)
    assert torch.equal(
        decode_item(encoded, InvalidRequest, "x")["pixel_values"].data, photo_item["pixel_values"].data
    )
    for bad in ("!!not base64!!", "AAAA", "", "kQ=="):
        with pytest.raises(InvalidRequest, match=r"^slot 3 is not a valid vLLM item"):
            decode_item(bad, InvalidRequest, "slot 3")


def test_a_broken_vllm_install_is_not_a_client_error(monkeypatch, photo_item):
    """The codec is imported outside the client-error handler: an ImportError stays an ImportError
    (a 500 from vLLM's handler), never a 400 blaming the request (house issue 12)."""
    from vllm_plugin.items import decode_item, encode_item

    encoded = encode_item(photo_item)
    monkeypatch.setitem(sys.modules, "vllm.v1.serial_utils", None)  # the import now fails for real
    outcome: list[BaseException | None] = []

    def in_a_fresh_thread() -> None:  # the codec is per thread: a new thread imports it again
        try:
            decode_item(encoded, InvalidRequest, "slot")
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=in_a_fresh_thread)
    thread.start()
    thread.join()
    assert isinstance(outcome[0], ImportError) and not isinstance(outcome[0], InvalidRequest)


def test_pixel_values_the_processor_never_emits_are_refused(layout, photo_item, qwen2_vl_adapter):
    """The value check (``items.PixelRange``): uint8, or float32 finite and within the processor's
    output range (measured by processing black and white images) or vLLM's raw 0-255; every other
    dtype, NaN, inf and huge values are refused before anything reaches the engine."""
    from PIL import Image

    low, high = layout.pixel_range.low, layout.pixel_range.high
    normalized = qwen2_vl_adapter.process(Image.fromarray(photo_array("coffee")).resize((200, 140))).tensors
    assert low <= float(normalized["pixel_values"].min()) and float(normalized["pixel_values"].max()) <= 3
    assert low < -1.5 and high == pytest.approx(255.001)  # CLIP mean/std: (0 - 0.48) / 0.27
    pixels = photo_item["pixel_values"].data
    accepted = {
        "uint8": pixels,
        "raw float32": pixels.float(),
        "normalized float32": normalized["pixel_values"],
        "the lowest normalized value": pixels.float().fill_(low + 1e-4),
    }
    for data in accepted.values():
        layout.check(replaced(photo_item, "pixel_values", data), InvalidRequest, "item")
    floats = pixels.float()
    refused = {
        "NaN": (floats.clone().fill_(float("nan")), "span"),
        "one NaN": (torch.cat([floats[:-1], floats[-1:].fill_(float("nan"))]), "span"),
        "+inf": (floats.clone().fill_(float("inf")), "span"),
        "-inf": (floats.clone().fill_(float("-inf")), "span"),
        "3e38": (floats.clone().fill_(3e38), "span"),
        "below the normalized range": (floats.clone().fill_(low - 0.01), "span"),
        "above 255": (floats.clone().fill_(255.5), "span"),
        "float64": (floats.double(), "float64"),
        "float16": (floats.half(), "float16"),
        "bfloat16": (floats.bfloat16(), "bfloat16"),
        "bool": (pixels > 100, "bool"),
        "complex64": (floats.to(torch.complex64), "complex64"),
        "int8": (pixels.to(torch.int8), "int8"),
        "int64": (pixels.long(), "int64"),
    }
    for name, (data, says) in refused.items():
        with pytest.raises(CorruptFeature) as info:
            layout.check(replaced(photo_item, "pixel_values", data), CorruptFeature, "payload")
        assert says in info.value.message, name


def test_flat_fields_need_int_dims_and_slices(layout, photo_item):
    """vLLM's decoder takes any msgpack values for a flat field's ``dim`` and slices and slices
    with them inside the engine (an empty 500); the check refuses them first."""
    from vllm.multimodal.inputs import MultiModalFlatField

    field = photo_item["pixel_values"].field
    rows = int(photo_item["pixel_values"].data.shape[0])
    cases = {
        "string slices": MultiModalFlatField(slices=[[slice("0", str(rows), None)]], dim=0),
        "float slices": MultiModalFlatField(slices=[[slice(0.0, float(rows), None)]], dim=0),
        "a step": MultiModalFlatField(slices=[[slice(0, rows, 2)]], dim=0),
        "a string dim": MultiModalFlatField(slices=field.slices, dim="0"),
        "a float dim": MultiModalFlatField(slices=field.slices, dim=0.0),
        "a dim past the tensor": MultiModalFlatField(slices=field.slices, dim=5),
    }
    for name, bad in cases.items():
        with pytest.raises(InvalidRequest) as info:
            layout.check(replaced(photo_item, "pixel_values", field=bad), InvalidRequest, "item")
        assert "dim or slices are not ints" in info.value.message, name
    ints = MultiModalFlatField(slices=[[slice(0, rows, None)]], dim=0)
    layout.check(replaced(photo_item, "pixel_values", field=ints), InvalidRequest, "item")
