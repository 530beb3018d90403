"""Measure what a packed micro-batch costs on the GPU and check ``trainer_lib.CostModel`` against it.

Usage::

    .venv/bin/python bench/cost_model.py          # CUDA: Qwen2-VL-2B shapes, random bf16 weights
    .venv/bin/python bench/cost_model.py --tiny   # any machine: tiny Qwen2-VL, smoke run

Micro-batches of chosen shapes run fwd+bwd through the library's packed path (``pack_samples``,
``packed_inputs``, ``packed_logprobs``, varlen attention): text-only ones of ``T`` tokens cut into
samples of ``l`` tokens, and ones whose samples carry images of ``v`` placeholder tokens. A least-
squares fit of the best-of-``--repeats`` times gives seconds per micro-batch ::

    t = c0 + a * T + b * sum(l^2) + a_v * V + b_v * sum(v^2)

(``V``: image tokens; ``c0``: the fixed cost of one micro-batch). Printed: every shape's time and
the fit's error; the coefficients next to ``CostModel.from_config``'s FLOP coefficients as ratios
to the per-token term (``b/a``, ``a_v/a``, ``b_v/a``: FLOPs are not seconds, ratios are
comparable); and both models' shares of a step on ``bench/pack.py``'s mix.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_facts, print_table
from _models import qwen2_vl_2b_config
from pack import make_ref, make_step, qwen_spec
from packed_forward import build_model, random_features, sync

from protocol.structs import MMRefs, TrainingSample
from trainer_lib import packed_inputs, packed_logprobs, prepare_model_for_packing
from trainer_lib.planning.cost import CostModel
from trainer_lib.planning.packing import pack_samples

TEXT = [(16384, 16384), (8192, 8192), (4096, 4096), (16384, 4096), (16384, 1024), (16384, 256), (8192, 512)]
"""(micro-batch tokens T, sample length l) of the text-only shapes."""
VISION = [(4, 1, 1024), (4, 1, 256), (4, 1, 64), (4, 4, 256), (4, 2, 1024), (8, 1, 256)]
"""(samples of 2048 tokens, images per sample, placeholder tokens per image) of the image shapes."""


def sample(length: int, images: int, v: int, ids_of: tuple[int, int, int, int], rng) -> TrainingSample:
    """``length`` tokens, the first ones ``images`` runs of ``v`` placeholders (square grids),
    each between ``<vision_start>`` and ``<vision_end>``; ``ids_of``: (placeholder, vision start,
    vision end, text vocabulary)."""
    tok, start, end, vocab = ids_of
    side = round(v**0.5)
    grid = {"grid": [1, 2 * side, 2 * side], "num_placeholders": side * side}
    refs = [msgspec.structs.replace(make_ref(rng), **grid) for _ in range(images)]
    ids: list[int] = []
    for _ in refs:
        ids += [start] + [tok] * side * side + [end]
    ids += [int(t) for t in rng.integers(3, vocab, size=length - len(ids))]
    return TrainingSample(
        input_ids=ids, loss_mask=[False] + [True] * (length - 1), advantages=[1.0] * length,
        inference_logprobs=[0.0] * length, mm_refs=MMRefs(items=refs) if refs else None,
    )  # fmt: skip


def shapes(ids_of: tuple[int, int, int, int], scale: float, seed: int) -> list[tuple[str, list]]:
    """The measured micro-batches: (label, samples); ``scale`` shrinks them for the tiny model."""
    rng = np.random.default_rng(seed)
    out = []
    for t, length in TEXT:
        t, length = max(16, int(t * scale)), max(16, int(length * scale))
        samples = [sample(length, 0, 0, ids_of, rng) for _ in range(t // length)]
        out.append((f"text: {t // length} x {length} tokens", samples))
    for n, images, v in VISION:
        v = max(4, int(v * scale))
        length = max(int(2048 * scale), images * (v + 2) + 16)
        label = f"images: {n} x {length} tokens, {images} x {v} image tokens each"
        out.append((label, [sample(length, images, v, ids_of, rng) for _ in range(n)]))
    return out


def terms(samples: list[TrainingSample]) -> list[float]:
    """``[1, T, sum(l^2), V, sum(v^2)]`` of one micro-batch."""
    lengths = [len(s.input_ids) for s in samples]
    images = [r.num_placeholders for s in samples for r in (s.mm_refs.items if s.mm_refs else ())]
    return [1.0, sum(lengths), sum(n * n for n in lengths), sum(images), sum(v * v for v in images)]


def time_one(model, samples, tok: int, dtype, device: str, repeats: int) -> float:
    """Best fwd+bwd seconds of one micro-batch (inputs built beforehand)."""
    spec = qwen_spec(tok)
    (mb,) = pack_samples(samples, spec, seq_len=1 << 20).micro_batches
    feats = random_features([list(g) for g in mb.image_grids], dtype, "cpu") if mb.images else {}
    inputs = packed_inputs(mb, feats, model, spec)
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        sync(device)
        start = time.perf_counter()
        out = packed_logprobs(model, inputs)
        (out.logprobs * out.loss_mask).sum().backward()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def shares(coeffs: list[float], samples: list[TrainingSample]) -> list[float]:
    """Share of ``a*T``, ``b*sum(l^2)``, ``a_v*V``, ``b_v*sum(v^2)`` over a step's samples."""
    totals = np.sum([terms([s]) for s in samples], axis=0)[1:] * np.asarray(coeffs)
    return list(totals / totals.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen2-VL (smoke run on any machine)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = args.tiny or device == "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(tiny, device, dtype)
    # no activation checkpointing (the library's default since issue 43): the seconds fitted stay
    # those of one forward + backward, as in the runs recorded in docs/PACKING.md
    backend = prepare_model_for_packing(model, activation_checkpointing=False)
    cfg = model.config
    tok = cfg.image_token_id
    ids_of = (tok, cfg.vision_start_token_id, cfg.vision_end_token_id, 250 if tiny else 150000)
    rows, x, y = [], [], []
    for label, samples in shapes(ids_of, 1 / 16 if tiny else 1.0, args.seed):
        try:
            seconds = time_one(model, samples, tok, dtype, device, args.repeats)
        except torch.OutOfMemoryError:  # a shape past the card's memory: reported, left out of the fit
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            rows.append([label, "out of memory", "-"])
            print(f"[cost_model] {label}: out of memory", flush=True)
            continue
        rows.append([label, f"{seconds * 1000:.1f}"])
        print(f"[cost_model] {label}: {seconds * 1000:.1f} ms", flush=True)  # progress, if cut short
        x.append(terms(samples))
        y.append(seconds)
    x_arr, y_arr = np.asarray(x), np.asarray(y)
    scale = x_arr.max(axis=0)  # columns of very different sizes: fit on scaled columns
    fit = np.linalg.lstsq(x_arr / scale, y_arr, rcond=None)[0] / scale
    for row, pred in zip((r for r in rows if len(r) == 2), x_arr @ fit, strict=True):
        row.append(f"{pred * 1000:.1f}")
    print_table("machine", ("fact", "value"), [*machine_facts(), ("device", device), ("backend", backend)])
    name = "tiny Qwen2-VL" if tiny else "Qwen2-VL-2B shapes"
    print_table(f"fwd+bwd per micro-batch, {name}, {dtype}", ("shape", "ms", "fit ms"), rows)
    c0, a, b, av, bv = fit
    flops = CostModel.from_config(model.config if tiny else qwen2_vl_2b_config())
    fl = [flops.llm_per_token, flops.llm_per_token_sq, flops.vision_per_token, flops.vision_per_token_sq]
    ratio = [
        ("per micro-batch (c0)", f"{c0 * 1000:.2f} ms", "-"),
        ("per token (a)", f"{a * 1e6:.3f} us", "1"),
        ("per token^2 (b), as b/a", f"{b / a:.3e}", f"{fl[1] / fl[0]:.3e}"),
        ("per image token (a_v), as a_v/a", f"{av / a:.3f}", f"{fl[2] / fl[0]:.3f}"),
        ("per image token^2 (b_v), as b_v/a", f"{bv / a:.3e}", f"{fl[3] / fl[0]:.3e}"),
    ]
    print_table(
        "measured seconds vs FLOP model (as ratios to the per-token term)",
        ("term", "measured", "FLOPs"),
        ratio,
    )
    print(  # a fit below 0 is noise: printed as 0
        "\nA cost model in this card's seconds, for plan_step(cost_model=...) (docs/PACKING.md §3.4):\n"
        "    CostModel(llm_per_token={:.4g}, llm_per_token_sq={:.4g}, vision_per_token={:.4g}, "
        "vision_per_token_sq={:.4g}, seconds_per_unit=1.0)".format(*(max(c, 0.0) for c in (a, b, av, bv)))
    )
    mix = make_step(np.random.default_rng(args.seed))
    names = ("language linear (T)", "language attention (l^2)", "vision linear (V)", "vision attention (v^2)")
    measured, counted = shares([a, b, av, bv], mix), shares(fl, mix)
    share_rows = [(n, f"{m:.1%}", f"{c:.1%}") for n, m, c in zip(names, measured, counted, strict=True)]
    print_table("share of a step on bench/pack.py's mix", ("term", "measured time", "FLOPs"), share_rows)


if __name__ == "__main__":
    main()
