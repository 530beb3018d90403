"""Request bytes: an image as an ``mmraw`` ref vs a base64 data URL vs vLLM's processed item.

For each real photo (scikit-image, resized to 1024x768, JPEG q90) it measures, side by side:

- the image part of a request: the ``mmraw`` ref string (what sits in ``mm_refs`` or in a
  ``features.kwargs_data`` slot), the ``RawMMRef`` object the demo sends, the base64 data URL
  (and its OpenAI ``image_url`` content part), and vLLM's processed-pixel ``kwargs_data`` item
  for the same image (what upstream token-in/token-out clients send after ``/render``; vLLM
  RFC #46722), in both pixel modes of the server;
- whole requests for one image: ``/inference/v1/generate`` with ``mm_refs``,
  ``/v1/chat/completions`` with a data URL, and upstream ``/inference/v1/generate`` with
  ``features.kwargs_data``: bytes of the JSON body httpx sends.

Target: ref <= 1/1000 of the data URL. Processor: the real Qwen2-VL limits (``bench/_models.py``).

Usage: ``.venv/bin/python bench/request_bytes.py`` (about 15 s; no server needed).
"""

from __future__ import annotations

import base64
import statistics

import msgspec
from _common import (
    COLOR_PHOTOS,
    SIZE,
    bench_asset_root,
    fmt_bytes,
    photo_jpeg,
    print_facts,
    print_table,
    verdict,
    vllm_processor,
    wire_bytes,
)
from _models import ensure_bench_model

TARGET = 1 / 1000
TEXT = "Describe the picture."
SAMPLING = {"temperature": 1.0, "max_tokens": 256, "logprobs": 0}


def main() -> None:
    from transformers import AutoTokenizer

    from protocol.adapters import load_adapter, offload_image
    from protocol.placeholders import expand_image_placeholders
    from protocol.refs import parse_ref
    from upstream import load

    extract_mm_features = load("extract_mm_features")

    model = ensure_bench_model()
    adapter = load_adapter(model)
    asset_root = bench_asset_root()
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
    chat_ids = list(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    processors = {mode: vllm_processor(model, raw_pixels=mode == "raw") for mode in ("raw", "normalized")}

    print_facts(adapter.backend)
    per_photo = []
    full = None
    for name in COLOR_PHOTOS:
        jpeg = photo_jpeg(name)
        ref = offload_image(jpeg, asset_root, adapter)
        ref_obj = msgspec.json.encode(msgspec.to_builtins(ref))
        compact = "mmraw:" + msgspec.json.encode(parse_ref(ref.ref)).decode()  # also accepted by parse_ref
        assert parse_ref(compact) == parse_ref(ref.ref)
        url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
        part = {"type": "image_url", "image_url": {"url": url}}
        items = {}
        features = {}
        for mode, (mc, proc) in processors.items():
            from protocol.images import load_image

            mm_items = proc.info.parse_mm_data({"image": [load_image(jpeg)]})
            out = proc(
                chat_ids, mm_items, hf_processor_mm_kwargs=mc.multimodal_config.merge_mm_processor_kwargs({})
            )
            feats = extract_mm_features(out)
            features[mode] = (out["prompt_token_ids"], feats)
            items[mode] = feats.kwargs_data["image"][0]
        row = {
            "photo": name,
            "jpeg": len(jpeg),
            "ref": len(ref.ref),
            "compact": len(compact),
            "ref_obj": len(ref_obj),
            "url": len(url),
            "part": wire_bytes(part),
            "raw": len(items["raw"]),
            "norm": len(items["normalized"]),
            "grid": ref.grid,
            "n": ref.num_placeholders,
        }
        per_photo.append(row)
        if full is None:  # whole requests, first photo
            prompt = expand_image_placeholders(chat_ids, [ref], pad_id)
            assert prompt == list(features["raw"][0]), "our expansion differs from vLLM's"
            refs_req = {"token_ids": prompt, "mm_refs": [ref.ref], "sampling_params": SAMPLING}
            refs_obj_req = {**refs_req, "mm_refs": [msgspec.to_builtins(ref)]}
            chat_req = {
                "model": str(model),
                "messages": [{"role": "user", "content": [part, {"type": "text", "text": TEXT}]}],
                "temperature": 1.0,
                "max_tokens": 256,
                "logprobs": True,
            }
            upstream = {
                mode: {
                    "token_ids": list(ids),
                    "features": feats.model_dump(exclude_none=True),
                    "sampling_params": SAMPLING,
                }
                for mode, (ids, feats) in features.items()
            }
            text_only = {"token_ids": prompt, "sampling_params": SAMPLING}
            full = {
                "name": name,
                "refs": wire_bytes(refs_req),
                "refs_obj": wire_bytes(refs_obj_req),
                "chat": wire_bytes(chat_req),
                "raw": wire_bytes(upstream["raw"]),
                "norm": wire_bytes(upstream["normalized"]),
                "tokens_only": wire_bytes(text_only),
                "refs_msgpack": len(msgspec.msgpack.encode(refs_req)),
                "n_tokens": len(prompt),
            }

    print_table(
        f"image part of a request, per photo ({SIZE[0]}x{SIZE[1]} JPEG q90, grid [1,54,74], "
        "999 placeholders)",
        (
            "photo",
            "JPEG",
            "data URL",
            "mmraw ref",
            "ref / data URL",
            "compact ref",
            "RawMMRef JSON",
            "kwargs_data uint8",
            "kwargs_data float32",
            "ref / kwargs uint8",
        ),
        [
            (
                r["photo"],
                r["jpeg"],
                r["url"],
                r["ref"],
                f"1/{r['url'] / r['ref']:.0f}",
                r["compact"],
                r["ref_obj"],
                r["raw"],
                r["norm"],
                f"1/{r['raw'] / r['ref']:.0f}",
            )
            for r in per_photo
        ],
    )

    ratios = [r["ref"] / r["url"] for r in per_photo]
    obj_ratios = [r["ref_obj"] / r["part"] for r in per_photo]
    med, worst = statistics.median(ratios), max(ratios)
    need = min(r["url"] for r in per_photo) // 1000
    print_table(
        "targets",
        ("measure", "value", "target", "verdict"),
        [
            (
                "ref string / data URL, median photo",
                f"1/{1 / med:.0f}",
                "<= 1/1000",
                verdict(med, TARGET, higher_is_better=False),
            ),
            (
                "ref string / data URL, worst photo",
                f"1/{1 / worst:.0f}",
                "<= 1/1000",
                verdict(worst, TARGET, higher_is_better=False),
            ),
            (
                "compact mmraw:{json} ref / data URL, median photo",
                f"1/{statistics.median(r['url'] / r['compact'] for r in per_photo):.0f}",
                "<= 1/1000",
                verdict(
                    statistics.median(r["compact"] / r["url"] for r in per_photo),
                    TARGET,
                    higher_is_better=False,
                ),
            ),
            (
                "RawMMRef object / image_url content part, median",
                f"1/{1 / statistics.median(obj_ratios):.0f}",
                "(info)",
                "",
            ),
            (
                "ref string / kwargs_data uint8 item, median",
                f"1/{statistics.median(r['raw'] / r['ref'] for r in per_photo):.0f}",
                "(info)",
                "",
            ),
            (
                "ref string / kwargs_data float32 item, median",
                f"1/{statistics.median(r['norm'] / r['ref'] for r in per_photo):.0f}",
                "(info)",
                "",
            ),
        ],
    )
    print(
        f"\nA ref of at most {need} characters would meet 1/1000 for every photo here "
        f"(smallest data URL {min(r['url'] for r in per_photo)} B); "
        f"the ref is {per_photo[0]['ref']} characters."
    )
    _ref_breakdown(per_photo[0], asset_root, adapter)

    f = full
    print_table(
        f"whole request bodies, one image ({f['name']}), {f['n_tokens']} prompt tokens after expansion",
        ("request", "bytes", "vs refs request"),
        [
            ("/inference/v1/generate, mm_refs = [ref string] (mmref)", f["refs"], "1.0x"),
            (
                "  same, msgpack body (Content-Type: application/msgpack)",
                f["refs_msgpack"],
                f"{f['refs_msgpack'] / f['refs']:.2f}x",
            ),
            (
                "/inference/v1/generate, mm_refs = [RawMMRef] (mmref)",
                f["refs_obj"],
                f"{f['refs_obj'] / f['refs']:.2f}x",
            ),
            (
                "  of which token_ids + sampling_params alone",
                f["tokens_only"],
                f"{f['tokens_only'] / f['refs']:.2f}x",
            ),
            ("/v1/chat/completions, data URL", f["chat"], f"{f['chat'] / f['refs']:.1f}x"),
            (
                "/inference/v1/generate, kwargs_data uint8 (upstream)",
                f["raw"],
                f"{f['raw'] / f['refs']:.0f}x",
            ),
            (
                "/inference/v1/generate, kwargs_data float32 (upstream)",
                f["norm"],
                f"{f['norm'] / f['refs']:.0f}x",
            ),
        ],
    )
    print(
        f"\n(uint8 = vLLM's default mm_device_do_normalize; float32 = --no-mm-device-do-normalize. "
        f"kwargs_data uint8 {fmt_bytes(per_photo[0]['raw'])}, float32 {fmt_bytes(per_photo[0]['norm'])}.)"
    )


def _ref_breakdown(row: dict, asset_root, adapter) -> None:
    """Where the ref's characters go (base64url of a JSON body)."""
    import json

    from protocol.adapters import offload_image
    from protocol.refs import parse_ref

    body = parse_ref(offload_image(photo_jpeg(row["photo"]), asset_root, adapter).ref)
    js = json.loads(msgspec.json.encode(body))
    parts = [(k, len(json.dumps({k: v}, separators=(",", ":"))) - 2) for k, v in js.items()]
    total = sum(n for _, n in parts) + len(parts) - 1 + 2
    print_table(
        "where the ref's characters go (JSON body, then base64url x4/3, plus 'mmraw:')",
        ("field", "JSON chars", "ref chars (x4/3)"),
        [*((k, n, round(n * 4 / 3)) for k, n in parts), ("total JSON", total, f"{row['ref']} with prefix")],
    )


if __name__ == "__main__":
    main()
