"""What checking an inline item costs the route, beside what decoding it already costs (docs/PERFORMANCE.md).

One real photo at 1024x768 through the real-size bench model (grid ``[1, 54, 74]``: 3996 patches
of 1176 values; ``bench/_models.py``), as vLLM's own processor emits it in each pixel mode (uint8
with vLLM's device normalization, float32 normalized otherwise). Measured side by side, medians
of repeated runs in one process:

- decoding the item from its wire form (base64 msgpack: what the route does with any inline item,
  ``items.decode_item``);
- the whole layout check (``ItemLayout.check``: fields, dtypes, rows against the grid);
- the value check alone (``PixelRange.check``: dtype, ``torch.aminmax`` over every value).

Target: the value check <= 1x the decode of the same item (both read every value once; a float32
item's check is ``torch.aminmax``, bound by memory bandwidth, as the base64 decode is).

Usage: ``.venv/bin/python bench/item_check.py [--repeat 30]``
"""

from __future__ import annotations

import argparse

from _common import fmt_ms, photo_jpeg, print_facts, print_table, ratio_row, timeit, vllm_processor
from _models import ensure_bench_model

TARGET = 1.0


def items(model_dir):
    """``{mode: (item, wire form)}`` for one 1024x768 photo, and the item layout."""
    import io

    from PIL import Image
    from transformers import BatchFeature

    from protocol.adapters import load_adapter
    from upstream import load, mm_fields_config
    from vllm_plugin.items import ItemLayout, encode_item

    adapter = load_adapter(model_dir)
    _, processor = vllm_processor(model_dir, raw_pixels=True)
    layout = ItemLayout(adapter, mm_fields_config(processor))
    from_hf_inputs = load("MultiModalKwargsItems.from_hf_inputs")
    image = Image.open(io.BytesIO(photo_jpeg("coffee"))).convert("RGB")
    out = {}
    for mode, raw in (("uint8 (device normalization)", True), ("float32 (normalized)", False)):
        tensors = BatchFeature(dict(adapter.process(image, raw_pixels=raw).tensors))
        (item,) = from_hf_inputs(tensors, layout.fields_config(tensors))["image"]
        out[mode] = (item, encode_item(item))
    return out, layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    print_facts()
    from protocol.errors import InvalidRequest
    from vllm_plugin.items import decode_item

    by_mode, layout = items(ensure_bench_model())
    rows, targets = [], []
    for mode, (item, wire) in by_mode.items():
        pixels = item["pixel_values"].data
        decode = timeit(lambda w=wire: decode_item(w, InvalidRequest, "item"), repeat=args.repeat)
        check = timeit(lambda i=item: layout.check(i, InvalidRequest, "item"), repeat=args.repeat)
        values = timeit(
            lambda p=pixels: layout.pixel_range.check(p, InvalidRequest, "item", None), repeat=args.repeat
        )
        shape = f"{list(pixels.shape)} {pixels.dtype}"
        rows.append((mode, shape, fmt_ms(decode.median), fmt_ms(check.median), fmt_ms(values.median)))
        targets.append(
            ratio_row(
                f"value check / decode, {mode}", values.median / decode.median, TARGET, higher_is_better=False
            )
        )
    print_table(
        "one 1024x768 photo as an inline item (medians)",
        ("pixel mode", "pixel_values", "decode (base64 msgpack)", "layout check", "value check"),
        rows,
    )
    print_table("targets", ("measure", "value", "target", "verdict"), targets)


if __name__ == "__main__":
    main()
