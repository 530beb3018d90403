"""Packed forward benchmark: fwd+bwd tokens/s for packed micro-batches vs one sample per forward
vs padded batches, and peak memory, on a Qwen2-VL model with random weights.

Usage::

    .venv/bin/python bench/packed_forward.py                 # CUDA: Qwen2-VL-2B shapes, bf16
    .venv/bin/python bench/packed_forward.py --tiny          # any machine: tiny Qwen2-VL, smoke run

The batch is RL-like: ``--samples`` samples (default 48), text lengths lognormal (median 900
tokens), 85% with one image of a random grid (16..64 patches per side: 64..1024 placeholder
tokens). Pixels are random (the vision tower's cost does not depend on their values); the
packing, positions, tripwire and forward are the library's own (``pack_samples``,
``packed_inputs``, ``packed_logprobs``).

Rows: packed at caps 16k and 8k (the varlen backend chosen by ``prepare_model_for_packing``;
sdpa on CPU), one sample per forward (same backend), padded batches of 4 through transformers'
standard forward (sdpa with a padding mask), then the largest cap and one sample per forward again
with activation checkpointing (``gradient_checkpointing_enable``: how a 16k cap fits an 80 GB
card with 2B shapes; their speed-up is over each other). Each row reports fwd+bwd seconds for the whole batch,
real tokens per second, its speed-up over one sample per forward, and peak memory
(``torch.cuda.max_memory_allocated``; RSS via getrusage on CPU). Target (issue 8): packed >= 2.5x
one sample per forward on the GPU.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_bytes, machine_facts, print_table, ratio_row
from _models import qwen2_vl_2b_config
from pack import make_ref, qwen_spec

from protocol.structs import MMRefs, TrainingSample
from trainer_lib import packed_inputs, packed_logprobs, prepare_model_for_packing
from trainer_lib.planning.packing import pack_samples

TARGET = 2.5
CHECKPOINTED = "activation checkpointing"
"""Rows with ``gradient_checkpointing_enable()``; their speed-up is over one sample per forward
with it too."""


def build_model(tiny: bool, device: str, dtype: torch.dtype):
    from transformers import AutoModelForImageTextToText, Qwen2VLForConditionalGeneration

    if tiny:
        from make_tiny_models import ensure_tiny_model

        model = AutoModelForImageTextToText.from_pretrained(ensure_tiny_model("qwen2_vl"), dtype=dtype)
    else:
        torch.manual_seed(0)
        with torch.device(device):  # random init where the model runs: minutes on the CPU, seconds on a GPU
            model = Qwen2VLForConditionalGeneration._from_config(qwen2_vl_2b_config(), dtype=dtype)
    return model.to(device).train()


def make_samples(n: int, tok: int, v_start: int, v_end: int, text_vocab: int, scale: float, seed: int):
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        text = int(np.clip(rng.lognormal(np.log(900 * scale), 0.8), 16, 6000 * scale))
        ids = [
            int(t) for t in rng.integers(0, text_vocab, size=text)
        ]  # plain text ids, below every special id
        refs = []
        if rng.random() < 0.85:
            ref = make_ref(rng)
            h, w = ref.grid[1] // 2, ref.grid[2] // 2
            if scale < 1:  # tiny smoke run: small images
                h, w = max(2, int(h * scale)), max(2, int(w * scale))
            ref = msgspec.structs.replace(ref, grid=[1, 2 * h, 2 * w], num_placeholders=h * w)
            refs.append(ref)
            ids = (
                ids[: len(ids) // 2]
                + [v_start]
                + [tok] * ref.num_placeholders
                + [v_end]
                + ids[len(ids) // 2 :]
            )
        m = len(ids)
        samples.append(
            TrainingSample(
                input_ids=ids,
                loss_mask=[False] * (m // 3) + [True] * (m - m // 3),
                advantages=[1.0] * m,
                inference_logprobs=[0.0] * m,
                mm_refs=MMRefs(items=refs) if refs else None,
            )
        )
    return samples


def random_features(grids, dtype, device) -> dict[str, torch.Tensor]:
    rows = sum(t * h * w for t, h, w in grids)
    return {
        "pixel_values": torch.randn(rows, 3 * 2 * 14 * 14, dtype=dtype, device=device),
        "image_grid_thw": torch.tensor(grids, dtype=torch.int64, device=device),
    }


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_packed(model, samples, tok, cap, seq_len, dtype, device) -> float:
    spec = qwen_spec(tok)
    step = pack_samples(samples, spec, seq_len=seq_len, micro_batch_max_tokens=cap)
    start = time.perf_counter()
    for mb in step.micro_batches:
        feats = random_features([list(g) for g in mb.image_grids], dtype, "cpu") if mb.images else {}
        inputs = packed_inputs(mb, feats, model, spec)
        out = packed_logprobs(model, inputs)
        (out.logprobs * out.loss_mask).sum().backward()
    sync(device)
    return time.perf_counter() - start


def run_padded(model, samples, tok, batch, dtype, device) -> float:
    start = time.perf_counter()
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].input_ids))
    for lo in range(0, len(order), batch):
        group = [samples[i] for i in order[lo : lo + batch]]
        longest = max(len(s.input_ids) for s in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        mask = torch.zeros(len(group), longest, dtype=torch.long)
        for k, s in enumerate(group):  # right padding, as transformers' training collators do
            ids[k, : len(s.input_ids)] = torch.tensor(s.input_ids)
            mask[k, : len(s.input_ids)] = 1
        grids = [list(r.grid) for s in group for r in (s.mm_refs.items if s.mm_refs else [])]
        kwargs = random_features(grids, dtype, device) if grids else {}
        ids, mask = ids.to(device), mask.to(device)
        types = (ids == tok).int()  # transformers needs them to compute M-RoPE positions
        out = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=types, use_cache=False, **kwargs)
        logits = out.logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (logp * mask[:, 1:]).sum().backward()
        del out, logits, logp
    sync(device)
    return time.perf_counter() - start


def peak_memory(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen2-VL (smoke run on any machine)")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tiny = args.tiny or device == "cpu"
    scale = 0.1 if tiny else 1.0
    samples_n = args.samples if not tiny else min(args.samples, 12)

    model = build_model(tiny, device, dtype)
    backend = prepare_model_for_packing(model)
    cfg = model.config
    samples = make_samples(
        samples_n, cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
        256 if tiny else 150000, scale, args.seed,
    )  # fmt: skip
    tokens = sum(len(s.input_ids) for s in samples)
    seq_len = max(16384, max(len(s.input_ids) for s in samples))
    caps = (16384, 8192) if not tiny else (2048, 1024)

    rows = []
    configs = [
        (
            f"packed, cap {c}",
            lambda c=c: run_packed(model, samples, cfg.image_token_id, c, seq_len, dtype, device),
        )
        for c in caps
    ]
    configs.append(
        (
            "one sample per forward",
            lambda: run_packed(model, samples, cfg.image_token_id, 1, seq_len, dtype, device),
        )
    )
    padded_backend = "sdpa"
    configs.append((f"padded batches of 4 ({padded_backend})", None))
    for c in (caps[0], 1):  # activation checkpointing: how a trainer fits the largest cap
        name = f"packed, cap {c}" if c > 1 else "one sample per forward"
        configs.append(
            (
                f"{name}, {CHECKPOINTED}",
                lambda c=c: run_packed(model, samples, cfg.image_token_id, c, seq_len, dtype, device),
            )
        )
    run_packed(model, samples[:4], cfg.image_token_id, caps[0], seq_len, dtype, device)  # warm-up
    results: dict[str, tuple[float | None, int | None, str]] = {}
    for name, fn in configs:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model.zero_grad(set_to_none=True)
        if CHECKPOINTED in name:
            model.gradient_checkpointing_enable()
        try:
            if fn is None:
                model.set_attn_implementation(padded_backend)
                seconds = run_padded(model, samples, cfg.image_token_id, 4, dtype, device)
                model.set_attn_implementation(backend)
            else:
                seconds = fn()
            results[name] = (seconds, peak_memory(device), "")
        except torch.OutOfMemoryError:
            results[name] = (None, None, "out of memory")
            model.set_attn_implementation(backend)
        model.gradient_checkpointing_disable()
    for name, (seconds, peak, note) in results.items():
        base = results[
            f"one sample per forward, {CHECKPOINTED}" if CHECKPOINTED in name else "one sample per forward"
        ][0]
        rows.append(
            (
                name,
                f"{seconds:.2f}" if seconds else note,
                f"{tokens / seconds:,.0f}" if seconds else "-",
                f"{base / seconds:.2f}x" if seconds and base else "-",
                fmt_bytes(peak) if peak else "-",
            )
        )
    print_table("machine", ("fact", "value"), [*machine_facts(), ("device", device), ("backend", backend)])
    print_table(
        f"fwd+bwd of {samples_n} samples, {tokens:,} tokens, {dtype} "
        f"({'tiny smoke run' if tiny else 'Qwen2-VL-2B shapes'})",
        ("configuration", "seconds", "tokens/s", "vs one per forward", "peak memory"),
        rows,
    )
    suffix = ""  # the target on the largest cap; with activation checkpointing where only that fits
    if results[f"packed, cap {caps[0]}"][0] is None:
        suffix = f", {CHECKPOINTED}"
    best, base = results[f"packed, cap {caps[0]}{suffix}"][0], results[f"one sample per forward{suffix}"][0]
    if device == "cuda" and best and base:
        print_table(
            "target",
            ("measure", "value", "target", "verdict"),
            [ratio_row(f"packed (cap 16k) vs one sample per forward{suffix}", base / best, TARGET)],
        )
    elif device == "cuda":
        print("\n(the largest cap ran out of memory with and without activation checkpointing)")
    else:
        print("\n(no CUDA: smoke run only; the >= 2.5x target is measured on a GPU)")


if __name__ == "__main__":
    main()
