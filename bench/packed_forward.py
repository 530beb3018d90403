"""Packed forward benchmark: fwd+bwd tokens/s, MFU and peak memory of packed micro-batches vs one
sample per forward, with today's LM head and activation checkpointing beside the head before
issue 43; and the LM head's own peak memory at 32k tokens.

Usage::

    .venv/bin/python bench/packed_forward.py                 # CUDA: Qwen2-VL-2B shapes, bf16
    .venv/bin/python bench/packed_forward.py --tiny          # any machine: tiny Qwen2-VL, fp32

The batch is RL-like: ``--samples`` samples (default 48), text lengths lognormal (median 900
tokens), 85% with one image of a random grid (16..64 patches per side: 64..1024 placeholder
tokens). Pixels are random (the vision tower's cost does not depend on their values); the
packing, positions, tripwire and forward are the library's own (``pack_samples``,
``packed_inputs``, ``packed_logprobs``).

Rows (``--rows`` picks some, by index): packed at the caps (32k, 16k; 8k for the old head) and one
sample per forward, each with a head and a checkpointing setting: ``chunked`` is today's
``trainer_lib.logprob_head`` (each chunk's logits recomputed in the backward), ``pre-43`` the head
before it (4096-token chunks, float32 logits kept for the backward; ``bench/_lm_head.py``);
checkpointing is ``prepare_model_for_packing(activation_checkpointing=)``. Each row: fwd+bwd
seconds for the whole batch, real tokens per second, its speed-up over one sample per forward with
the same head and checkpointing, MFU, and peak memory (``torch.cuda.max_memory_allocated``; on CPU
the peak bytes of the tensors the pass created, ``bench/_lm_head.LiveBytes``, in a second pass).
Each row is printed as it finishes (a step timeout keeps the rows done).

MFU = the batch's model FLOPs / seconds / the card's peak: FLOPs from
``trainer_lib.CostModel.from_config`` (language model with LM head, vision tower; forward x 3 for
forward + backward; the recomputation of checkpointing and of the head's logits is not counted,
as MFU's convention has it), peak = dense bf16 of the card (H100/H200 SXM 989 TFLOP/s, H100 PCIe
756, A100 312: NVIDIA's data sheets) or ``--peak-tflops``; n/a otherwise (no CPU peak is stated:
a shared 2-core VM's float32 peak is not known).

The LM-head table runs each head alone on random hidden states of 32,768 tokens (the model's
hidden size and vocabulary) and prints the peak bytes of one forward + backward; target (issue
43): today's head <= 1/8 of the pre-43 head's. Target (issue 8): packed >= 2.5x one sample per
forward on the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import msgspec
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_bytes, machine_facts, print_table, ratio_row
from _lm_head import head_peaks, old_token_logprobs, peak_bytes
from _models import qwen2_vl_2b_config
from pack import make_ref, qwen_spec

import trainer_lib.forward as forward_module
from protocol.structs import MMRefs, TrainingSample
from trainer_lib import CostModel, packed_inputs, packed_logprobs, prepare_model_for_packing
from trainer_lib.planning.packing import pack_samples

TARGET = 2.5
HEAD_TARGET = 1 / 8
HEAD_TOKENS = 32768
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4, "A100": 312.0}
"""Dense bf16 TFLOP/s by card name (NVIDIA data sheets), longest match first."""
CHUNKED, PRE43 = "chunked", "pre-43"


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
        ids = [int(t) for t in rng.integers(0, text_vocab, size=text)]  # below every special id
        refs = []
        if rng.random() < 0.85:
            ref = make_ref(rng)
            h, w = ref.grid[1] // 2, ref.grid[2] // 2
            if scale < 1:  # tiny smoke run: small images
                h, w = max(2, int(h * scale)), max(2, int(w * scale))
            ref = msgspec.structs.replace(ref, grid=[1, 2 * h, 2 * w], num_placeholders=h * w)
            refs.append(ref)
            half = len(ids) // 2
            ids = ids[:half] + [v_start] + [tok] * ref.num_placeholders + [v_end] + ids[half:]
        m = len(ids)
        samples.append(
            TrainingSample(
                input_ids=ids, loss_mask=[False] * (m // 3) + [True] * (m - m // 3), advantages=[1.0] * m,
                inference_logprobs=[0.0] * m, mm_refs=MMRefs(items=refs) if refs else None,
            )
        )  # fmt: skip
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
    """fwd+bwd of every micro-batch at ``cap`` (1: one sample per forward); seconds."""
    spec = qwen_spec(tok)
    step = pack_samples(samples, spec, seq_len=seq_len, micro_batch_max_tokens=cap)
    start = time.perf_counter()
    for mb in step.micro_batches:
        feats = random_features([list(g) for g in mb.image_grids], dtype, "cpu") if mb.images else {}
        out = packed_logprobs(model, packed_inputs(mb, feats, model, spec))
        mask = out.loss_mask
        ((out.logprobs * mask).sum() - 0.01 * (out.entropy * mask).sum()).backward()
    sync(device)
    return time.perf_counter() - start


def batch_flops(model, samples) -> float:
    """Model FLOPs of one forward + backward of every sample (3x the cost model's forward)."""
    cost = CostModel.from_config(model.config)
    fwd = sum(
        cost.language(len(s.input_ids)) + cost.vision([r.num_placeholders for r in s.mm_refs.items])
        if s.mm_refs
        else cost.language(len(s.input_ids))
        for s in samples
    )
    return 3 * fwd


def peak_flops(device: str, override: float | None) -> tuple[float | None, str]:
    """(FLOP/s, where it comes from): ``--peak-tflops``, the card's data sheet, or None."""
    if override:
        return override * 1e12, f"--peak-tflops {override}"
    if device != "cuda":
        return None, "n/a: no stated CPU peak (a shared VM's float32 peak is not known)"
    name = torch.cuda.get_device_name()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key] * 1e12, f"{name}: {PEAK_TFLOPS[key]} dense bf16 TFLOP/s (data sheet)"
    return None, f"n/a: no peak known for {name} (pass --peak-tflops)"


def configs(caps: tuple[int, int, int]) -> list[tuple[str, int, str, bool]]:
    """``(name, cap, head, checkpointing)``, most wanted first (a step timeout keeps the rows done)."""
    big, mid, small = caps
    return [
        (f"packed, cap {big}", big, CHUNKED, True),
        (f"packed, cap {mid}", mid, CHUNKED, True),
        ("one sample per forward", 1, CHUNKED, True),
        (f"packed, cap {mid}", mid, CHUNKED, False),
        ("one sample per forward", 1, CHUNKED, False),
        (f"packed, cap {mid}", mid, PRE43, False),
        (f"packed, cap {small}", small, PRE43, False),
        ("one sample per forward", 1, PRE43, False),
    ]


def measure(run: Callable[[], float], model, head: str, ckpt: bool, device: str) -> tuple[float, int]:
    """Seconds and peak bytes of one configuration (CPU: the peak in a second, tracked pass)."""
    backend = prepare_model_for_packing(model, activation_checkpointing=ckpt)
    assert backend
    old = mock.patch.object(
        forward_module, "token_logprobs", lambda *a, **k: old_token_logprobs(*a, **k, recompute=ckpt)
    )
    with old if head == PRE43 else contextlib.nullcontext():
        gc.collect()
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        seconds = run()
        if device == "cuda":
            return seconds, torch.cuda.max_memory_allocated()
        model.zero_grad(set_to_none=True)
        with peak_bytes(device) as peak:
            run()
        return seconds, peak[0]


def row_cells(name, head, ckpt, result, base, tokens, flops, peak_fl) -> tuple[str, ...]:
    """One table row; ``result`` is ``(seconds, peak bytes)`` or an error note."""
    label = (name, head, "on" if ckpt else "off")
    if isinstance(result, str):
        return (*label, result, "-", "-", "-", "-")
    seconds, peak = result
    mfu = f"{100 * flops / seconds / peak_fl:.1f}%" if peak_fl else "n/a"
    speedup = f"{base / seconds:.2f}x" if base else "-"
    return (*label, f"{seconds:.2f}", f"{tokens / seconds:,.0f}", speedup, mfu, fmt_bytes(peak))


def run_rows(model, samples, rows, device, dtype) -> dict[tuple[str, str, bool], object]:
    """Every configuration, each printed as it finishes; ``{(name, head, ckpt): result}``."""
    tok = model.config.image_token_id
    seq_len = max(max(c for _, c, _, _ in rows), max(len(s.input_ids) for s in samples))
    results: dict[tuple[str, str, bool], object] = {}
    for name, cap, head, ckpt in rows:

        def run(cap: int = cap) -> float:
            return run_packed(model, samples, tok, cap, seq_len, dtype, device)

        try:
            results[(name, head, ckpt)] = measure(run, model, head, ckpt, device)
        except torch.OutOfMemoryError:
            results[(name, head, ckpt)] = "out of memory"
        print(f"[row] {name}, head {head}, checkpointing {ckpt}: {results[(name, head, ckpt)]}", flush=True)
    return results


def print_head_table(model, device: str, dtype: torch.dtype) -> float:
    """The LM heads alone at :data:`HEAD_TOKENS` tokens; returns today's / the pre-43 default."""
    text = model.config.get_text_config()
    rows = head_peaks(text.hidden_size, text.vocab_size, HEAD_TOKENS, dtype, device)
    base = rows[0][1]
    print_table(
        f"LM head alone: fwd+bwd of {HEAD_TOKENS:,} tokens, hidden {text.hidden_size}, vocab "
        f"{text.vocab_size:,}, {dtype}, peak bytes allocated",
        ("head", "peak memory", "vs pre-43 head"),
        [(name, fmt_bytes(b), f"{b / base:.3f}") for name, b in rows],
    )
    return rows[-1][1] / base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen2-VL (smoke run on any machine)")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", default="", help="comma-separated row indices to run (default: all)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, for MFU")
    parser.add_argument("--no-head-table", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = args.tiny or device == "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    scale = 0.1 if tiny else 1.0
    model = build_model(tiny, device, dtype)
    cfg = model.config
    samples = make_samples(
        args.samples if not tiny else min(args.samples, 12), cfg.image_token_id, cfg.vision_start_token_id,
        cfg.vision_end_token_id, 256 if tiny else 150000, scale, args.seed,
    )  # fmt: skip
    tokens = sum(len(s.input_ids) for s in samples)
    rows = configs((4096, 2048, 1024) if tiny else (32768, 16384, 8192))
    if args.rows:
        rows = [rows[int(i)] for i in args.rows.split(",")]
    backend = prepare_model_for_packing(model)
    print_table("machine", ("fact", "value"), [*machine_facts(), ("device", device), ("backend", backend)])
    ratio = None if args.no_head_table else print_head_table(model, device, dtype)
    run_packed(model, samples[:4], cfg.image_token_id, rows[0][1], 32768, dtype, device)  # warm-up
    results = run_rows(model, samples, rows, device, dtype)
    peak_fl, peak_note = peak_flops(device, args.peak_tflops)
    flops = batch_flops(model, samples)
    table = []
    for name, _, head, ckpt in rows:
        base = results.get(("one sample per forward", head, ckpt))
        base_s = base[0] if isinstance(base, tuple) else None
        table.append(row_cells(name, head, ckpt, results[(name, head, ckpt)], base_s, tokens, flops, peak_fl))
    print_table(
        f"fwd+bwd of {len(samples)} samples, {tokens:,} tokens, {flops:.3g} model FLOPs, {dtype} "
        f"({'tiny smoke run' if tiny else 'Qwen2-VL-2B shapes'}); MFU peak: {peak_note}",
        ("configuration", "head", "checkpointing", "seconds", "tokens/s", "vs one per forward", "MFU",
         "peak memory"),
        table,
    )  # fmt: skip
    print_targets(results, rows, ratio, device)


def print_targets(results, rows, head_ratio: float | None, device: str) -> None:
    targets = []
    if head_ratio is not None:
        label = f"LM head peak at {HEAD_TOKENS:,} tokens, chunked vs pre-43"
        detail = f" ({head_ratio:.3f})"
        targets.append(ratio_row(label, head_ratio, HEAD_TARGET, higher_is_better=False, detail=detail))
    base = results.get(("one sample per forward", CHUNKED, True))
    for name, _, head, ckpt in rows[:2]:
        got = results.get((name, head, ckpt))
        if device == "cuda" and isinstance(got, tuple) and isinstance(base, tuple):
            label = f"{name} vs one sample per forward (chunked head, checkpointing)"
            targets.append(ratio_row(label, base[0] / got[0], TARGET))
    if device != "cuda":
        print("\n(no CUDA: the >= 2.5x target is measured on a GPU)")
    if targets:
        print_table("targets", ("measure", "value", "target", "verdict"), targets)


if __name__ == "__main__":
    main()
