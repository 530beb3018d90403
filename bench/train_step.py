"""A trainer step, dedup vs per slot: materialize + packed forward + backward of RL groups sharing
their photo, on the tiny models (CPU) or, given ``--device cuda``, on a GPU (docs/PACKING.md §7).

A step is ``--groups`` RL groups of ``--group-size`` samples (default 4 x 8); each group's samples
share one real photo (1024x768 JPEG, processed at the model's own size limits) and a prompt, and
differ in their completions (24-96 tokens). The step is packed once (``pack_samples``, cap
``--cap``: samples sharing an image kept in one micro-batch where the cap allows) and run twice per
round, interleaved (a warm-up round first):

- **dedup** (the default of every trainer path): ``materialize_micro_batch`` with one ``resolved``
  dict for the step (each distinct image decoded once), each distinct image's pixels once per
  micro-batch, the vision tower once per distinct image (``mm_encoder_outputs``);
- **per slot** (``dedup=False``): one pixel copy and one vision-tower pass per image slot.

Per step: seconds of materialize and of forward + backward (a GRPO-style token loss; the gradients
are zeroed, no optimizer step), images decoded, vision-tower rows (patches) and distinct images
encoded vs image slots; medians over ``--repeat`` rounds. Also printed: max |dlogprob| and the
relative gradient difference between the two (float32 noise on CPU; on CUDA the model runs in
bfloat16, as the varlen kernels require).

Usage: ``.venv/bin/python bench/train_step.py [--families qwen2_vl,qwen3_vl,qwen3_5] [--repeat 5]
[--device cpu|cuda] [--real-size]`` (``--real-size``: qwen2_vl only, the bench model with the
released image limits: 999 placeholder tokens per photo).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from _common import machine_facts, print_table, unique_photos

CAP, REAL_SIZE_CAP = 2048, 16384
"""Micro-batch caps: a tiny-model group (8 x ~120 tokens) fits one micro-batch of 2k; a real-size
one (8 x ~1.1k) one of 16k (CPU attention over a packed row costs O(L^2): a larger cap only adds
the language side's time)."""


def build_step(model_dir: Path, groups: int, group_size: int, store: Path, device: str, dtype=torch.float32):
    """The model (``dtype``, packing-ready, on ``device``), its spec and config, and the step's samples."""
    from transformers import AutoModelForImageTextToText

    from protocol.adapters import load_adapter, offload_image
    from protocol.placeholders import expand_image_placeholders
    from protocol.structs import MMRefs, TrainingSample
    from trainer_lib import MaterializeConfig, PackingSpec, prepare_model_for_packing

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(device)
    backend = prepare_model_for_packing(model)
    adapter = load_adapter(model_dir)
    spec = PackingSpec.from_adapter(adapter, model, pad_token_id=0)
    tok, gen = spec.placeholder_token_id, torch.Generator().manual_seed(0)
    samples = []
    for photo in unique_photos(groups):
        ref = offload_image(photo, store, adapter)
        prompt = expand_image_placeholders([1, 2, tok, 3, 4, 5], [ref], tok)
        for _ in range(group_size):
            n = int(torch.randint(24, 97, (1,), generator=gen))
            completion = torch.randint(10, 200, (n,), generator=gen).tolist()
            ids, p = prompt + completion, len(prompt)
            samples.append(
                TrainingSample(
                    input_ids=ids,
                    loss_mask=[False] * p + [True] * n,
                    advantages=[0.0] * p + [1.0] * n,
                    inference_logprobs=[0.0] * len(ids),
                    mm_refs=MMRefs(items=[ref]),
                )
            )
    return model, backend, spec, MaterializeConfig(asset_root=store), samples


def run_step(model, spec, config, micro_batches, dedup: bool) -> dict:
    """One step: materialize (one ``resolved`` dict) + forward + backward per micro-batch."""
    from trainer_lib import materialize_micro_batch, packed_inputs, packed_logprobs

    rows: list[int] = []
    hook = model.model.visual.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[0]))
    resolved: dict = {}
    t_mat = t_fwd = 0.0
    decoded = encoded = slots = 0
    logprobs = []
    model.zero_grad(set_to_none=True)
    try:
        for mb in micro_batches:
            t0 = time.perf_counter()
            m = materialize_micro_batch(mb, spec, config, dedup=dedup, resolved=resolved)
            inputs = packed_inputs(
                m.packed, m.features, model, spec, image_index=m.image_index, video_index=m.video_index
            )
            t1 = time.perf_counter()
            out = packed_logprobs(model, inputs)
            loss = -(out.logprobs * out.loss_mask).sum() / max(int(out.loss_mask.sum()), 1)
            loss.backward()
            if next(model.parameters()).is_cuda:
                torch.cuda.synchronize()
            t_mat, t_fwd = t_mat + t1 - t0, t_fwd + time.perf_counter() - t1
            decoded += m.stats.processed
            encoded += len(m.features.get("image_grid_thw", ()))
            slots += len(mb.images)
            logprobs.append(out.logprobs.detach().cpu())
    finally:
        hook.remove()
    grads = torch.cat([p.grad.flatten().cpu() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return {
        "materialize": t_mat,
        "fwd_bwd": t_fwd,
        "decoded": decoded,
        "encoded": encoded,
        "slots": slots,
        "rows": sum(rows),
        "logprobs": torch.cat(logprobs),
        "grads": grads,
    }


def bench_family(name: str, model_dir: Path, args) -> list[tuple]:
    from trainer_lib import pack_samples

    store = Path(tempfile.mkdtemp(prefix="mmref-bench-step-")) / "run_1" / "assets"
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32  # varlen: 16-bit
    model, backend, spec, config, samples = build_step(
        model_dir, args.groups, args.group_size, store, args.device, dtype
    )
    packed = pack_samples(samples, spec, seq_len=args.cap)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for rnd in range(args.repeat + 1):  # round 0: warm-up
        for dedup in (True, False):
            result = run_step(model, spec, config, packed.micro_batches, dedup)
            if rnd:
                runs[dedup].append(result)
    d, s = runs[True][-1], runs[False][-1]
    dlp = (d["logprobs"] - s["logprobs"]).abs().max().item()
    dgrad = ((d["grads"] - s["grads"]).norm() / s["grads"].norm()).item()

    def med(dedup: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs[dedup])

    rows = []
    for dedup, label in ((True, "dedup (default)"), (False, "per slot")):
        r = runs[dedup][-1]
        mat, fwd = med(dedup, "materialize") * 1000, med(dedup, "fwd_bwd") * 1000
        rows.append((
            name, label, f"{packed.num_micro_batches}", f"{mat:.0f}", f"{fwd:.0f}", f"{mat + fwd:.0f}",
            f"{r['decoded']}", f"{r['encoded']} / {r['slots']}", f"{r['rows']}",
        ))  # fmt: skip
    speed = (med(False, "materialize") + med(False, "fwd_bwd")) / (
        med(True, "materialize") + med(True, "fwd_bwd")
    )
    fwd = med(False, "fwd_bwd") / med(True, "fwd_bwd")
    rows.append((name, "per slot / dedup", "", "", f"{fwd:.2f}x", f"{speed:.2f}x", "", "", ""))
    equal = f"dedup vs per slot: max abs dlogprob {dlp:.1e}, grad rel. diff {dgrad:.1e}"
    rows.append((name, equal, *[""] * 7))
    print(f"[train_step] {name}: {backend}, {len(samples)} samples, done", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="qwen2_vl,qwen3_vl,qwen3_5")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--real-size", action="store_true", help="qwen2_vl at the released image limits")
    parser.add_argument(
        "--cap", type=int, help=f"micro-batch cap (default {CAP}; {REAL_SIZE_CAP} with --real-size)"
    )
    args = parser.parse_args()
    args.cap = args.cap or (REAL_SIZE_CAP if args.real_size else CAP)
    from make_tiny_models import ensure_tiny_model

    print_table("machine", ("fact", "value"), machine_facts())
    if args.real_size:
        from _models import ensure_bench_model

        models = [("qwen2_vl (real-size images)", ensure_bench_model())]
    else:
        models = [(f, ensure_tiny_model(f)) for f in args.families.split(",")]
    rows = []
    for name, path in models:
        try:
            rows += bench_family(name, path, args)
        except Exception as exc:  # one family's failure (a kernel refusing this GPU) keeps the others' rows
            rows.append((name, f"error: {type(exc).__name__}: {str(exc)[:160]}", *[""] * 7))
            print(f"[train_step] {name}: {type(exc).__name__}: {exc}", flush=True)
    header = ("model", "path", "micro-batches", "materialize ms", "fwd+bwd ms", "step ms")
    header += ("images decoded", "distinct images encoded / image slots", "vision-tower rows")
    print_table(
        f"one step: {args.groups} groups x {args.group_size} samples sharing a photo, cap {args.cap}, "
        f"{args.device} ({'bf16' if args.device.startswith('cuda') else 'fp32'}); medians of {args.repeat} "
        "interleaved rounds",
        header,
        rows,
    )


if __name__ == "__main__":
    main()
