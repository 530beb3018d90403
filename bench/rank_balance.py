"""Ranks balanced by compute, in seconds: one data-parallel step's micro-batches timed on one GPU,
plan by plan (docs/PACKING.md, "GPU measurements").

Usage::

    .venv/bin/python bench/rank_balance.py                 # CUDA: Qwen2-VL-2B shapes, bf16
    .venv/bin/python bench/rank_balance.py --tiny          # any machine: tiny Qwen2-VL, smoke run

One mini-batch of ``bench/pack.py``'s mix (``--prompts`` x 16 rollouts sharing their prompt's
images; default 16 x 16 = 256 samples) is planned for ``--dp`` ranks (default 8) at cap ``--cap``
(default 16k) by each plan of ``--plans``: ``tokens`` (issue 13's token-balanced plan),
``compute`` (``plan_step``'s default since issue 29), ``verl`` (Karmarkar-Karp rank shares,
``bench/_baselines.py``), and the compute plan with the opt-in search: ``descent``
(``Refinement(anneal_steps=0)``), ``anneal`` (``Refinement(anneal_steps=1_000_000,
plan_time_budget_s=math.inf)``) and ``budget`` (``Refinement()``: both within the default time
budget), as ``bench/pack.py``.
Every micro-batch of every rank then runs forward + backward on the one GPU (the library's path:
``packed_inputs`` with each distinct image once and its ``image_index``, ``packed_logprobs``, a
token loss), timed alone (``torch.cuda.synchronize`` around it), in ``--rounds`` interleaved
rounds (default 2), each micro-batch's best round kept: on an H100 single runs showed stalls of
0.2-1.0 s on ~0.8 s micro-batches, at random, in either plan (a run that includes a ``cudaMalloc``
retry is named). Pixels are random (the tower's cost does not depend on their values), and the
model keeps activation checkpointing on (``gradient_checkpointing_enable``: a 16k-token
micro-batch of the 2B shapes does not fit in 80 GB without it).

Per plan: micro-batch slots per rank; **step seconds** = the sum over slots of the slowest rank's
seconds (with data parallelism every rank waits for it at the slot's synchronisation);
**measured wait** = 1 - all ranks' seconds / (dp x step seconds); the plan's predicted idle
(``StepPlan.sync_idle``: in tokens, and in FLOPs with the Qwen2-VL-2B cost model, pads counted as
idle); distinct images encoded / image slots. Measured at the micro-batch syncs only: FSDP also
syncs inside a micro-batch (the tower, then each layer), which only the prediction models.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _baselines import plan_verl
from _common import machine_facts, print_table
from _pack_targets import ANNEAL_STEPS
from pack import ROLLOUTS, SEQ_LEN, TOK, V_END, V_START, make_step, qwen_spec
from packed_forward import build_model, random_features

from trainer_lib import packed_inputs, packed_logprobs, prepare_model_for_packing
from trainer_lib.planning.cost import CostModel
from trainer_lib.planning.plan import encoded_image_tokens, plan_step
from trainer_lib.planning.ranks import StepShape
from trainer_lib.planning.refine import Refinement

PLANS = {
    "tokens": lambda samples, spec, shape, cm: plan_step(
        samples, spec, shape, cost_model=cm, balance="tokens"
    ),
    "compute": lambda samples, spec, shape, cm: plan_step(
        samples, spec, shape, cost_model=cm, balance="compute"
    ),
    "verl": lambda samples, spec, shape, cm: plan_verl(samples, spec, shape),
    "descent": lambda samples, spec, shape, cm: plan_step(
        samples, spec, shape, cost_model=cm, refine=Refinement(anneal_steps=0)
    ),
    "anneal": lambda samples, spec, shape, cm: plan_step(
        samples,
        spec,
        shape,
        cost_model=cm,
        refine=Refinement(anneal_steps=ANNEAL_STEPS, plan_time_budget_s=math.inf),
    ),
    "budget": lambda samples, spec, shape, cm: plan_step(
        samples, spec, shape, cost_model=cm, refine=Refinement()
    ),
}


def step_samples(config, prompts: int, scale: float, seed: int):
    """One mini-batch of the mix with the model's own image ids (the mix uses the tiny model's)."""
    ids = {
        TOK: config.image_token_id,
        V_START: config.vision_start_token_id,
        V_END: config.vision_end_token_id,
    }
    samples = make_step(np.random.default_rng(seed), prompts=prompts, scale=scale)
    return [msgspec.structs.replace(s, input_ids=[ids.get(t, t) for t in s.input_ids]) for s in samples]


def features(mb, dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Random pixels for each distinct image of ``mb`` once (synthetic pads each their own) and the
    ``image_index`` of every image slot, as ``materialize_micro_batch(dedup=True)`` lays them out."""
    if not mb.images:
        return {}, None
    keys = [im.ref.sha256 if im.ref is not None else id(im) for im in mb.images]
    first = {}  # each distinct image's first slot, in first-seen order: its row
    for key, im in zip(keys, mb.images, strict=True):
        first.setdefault(key, im)
    row = {key: n for n, key in enumerate(first)}
    grids = [list(im.grid) for im in first.values()]
    return random_features(grids, dtype, "cpu"), torch.tensor([row[k] for k in keys], dtype=torch.int64)


def time_micro_batch(model, spec, mb, dtype, device: str) -> float:
    """Seconds of one micro-batch's forward + backward (inputs built before the clock starts)."""
    feats, index = features(mb, dtype)
    inputs = packed_inputs(mb, feats, model, spec, image_index=index)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = packed_logprobs(model, inputs)
    (-(out.logprobs * out.loss_mask).sum() / max(int(out.loss_mask.sum()), 1)).backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _alloc_retries(device: str) -> int:
    """``cudaMalloc`` retries so far (the allocator emptied its cache to allocate); 0 off CUDA."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device == "cuda" else 0


def run_plan(model, spec, plan, dtype, device: str) -> np.ndarray:
    """Seconds ``[ranks, slots]`` of the plan's (only) mini-batch, slot by slot."""
    ranks = plan.mini_batches[0]
    slots = ranks[0].num_micro_batches
    seconds = np.zeros((len(ranks), slots))
    for j in range(slots):
        for r, share in enumerate(ranks):
            before = _alloc_retries(device)
            seconds[r, j] = time_micro_batch(model, spec, share.micro_batches[j], dtype, device)
            if _alloc_retries(device) > before:  # the caching allocator freed and retried: a stall
                print(
                    f"[rank_balance] rank {r}, slot {j}: allocator retried ({seconds[r, j]:.3f} s)",
                    flush=True,
                )
    model.zero_grad(set_to_none=True)
    return seconds


def dump(plan, rounds: list[np.ndarray]) -> list[dict]:
    """Every micro-batch of the plan: rank, slot, seconds per round, and what it holds."""
    out = []
    for r, share in enumerate(plan.mini_batches[0]):
        for j, mb in enumerate(share.micro_batches):
            out.append({
                "rank": r, "slot": j, "seconds": [float(x[r, j]) for x in rounds],
                "lengths": [s.length for s in mb.slots], "padding": [s.is_padding for s in mb.slots],
                "encoded": encoded_image_tokens(mb) + encoded_image_tokens(mb, padding=True),
                "image_slots": len(mb.images),
            })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen2-VL (smoke run on any machine)")
    parser.add_argument("--plans", default="tokens,compute,verl")
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16, help=f"prompts of {ROLLOUTS} rollouts each")
    parser.add_argument("--cap", type=int, default=SEQ_LEN)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; per micro-batch the best")
    parser.add_argument(
        "--dump", type=Path, help="JSON: every micro-batch's seconds per round and its contents"
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tiny = args.tiny or device == "cpu"
    model = build_model(tiny, device, dtype)
    backend = prepare_model_for_packing(model)
    model.gradient_checkpointing_enable()
    cm = CostModel.from_config(model.config)
    spec = qwen_spec(model.config.image_token_id)
    if tiny:  # a CPU forward attends over the whole packed row: small micro-batches
        args.dp, args.prompts, args.cap = min(args.dp, 2), min(args.prompts, 2), min(args.cap, 2048)
    samples = step_samples(model.config, args.prompts, 0.1 if tiny else 1.0, args.seed)
    shape = StepShape(
        dp_size=args.dp, mini_batch_size=len(samples), seq_len=SEQ_LEN, micro_batch_max_tokens=args.cap
    )
    plans = {n: PLANS[n](samples, spec, shape, cm) for n in args.plans.split(",")}
    tokens = sum(len(s.input_ids) for s in samples)
    print(f"[rank_balance] {len(samples)} samples, {tokens:,} tokens, {backend}", flush=True)
    first = next(iter(plans.values())).mini_batches[0][0].micro_batches[0]
    time_micro_batch(model, spec, first, dtype, device)  # warm-up
    model.zero_grad(set_to_none=True)
    timed: dict[str, list[np.ndarray]] = {name: [] for name in plans}
    for rnd in range(args.rounds):
        for name, plan in plans.items():
            timed[name].append(run_plan(model, spec, plan, dtype, device))
            step = timed[name][-1].max(axis=0).sum()
            print(f"[rank_balance] round {rnd}, {name}: step {step:.2f} s", flush=True)
    rows, steps = [], {}
    for name, plan in plans.items():
        seconds = np.min(np.stack(timed[name]), axis=0)  # stalls of 0.2-1.0 s hit single runs (docs)
        steps[name] = seconds.max(axis=0).sum()
        wait = 1 - seconds.sum() / (args.dp * steps[name])
        mbs = [mb for share in plan.mini_batches[0] for mb in share.micro_batches]
        encoded = sum(len(encoded_image_tokens(mb)) for mb in mbs)
        slots = sum(not mb.slots[im.slot].is_padding for mb in mbs for im in mb.images)
        rows.append([
            name, f"{seconds.shape[1]}", f"{steps[name]:.2f}", f"{wait:.2%}",
            f"{plan.sync_idle():.2%}", f"{plan.sync_idle(cm):.2%}", f"{encoded} / {slots}",
        ])  # fmt: skip
    if args.dump:
        args.dump.write_text(json.dumps({n: dump(plans[n], timed[n]) for n in plans}))
    base = steps.get("tokens")
    for row in rows:
        row.append(f"{steps[row[0]] / base:.3f}" if base else "-")
    print_table("machine", ("fact", "value"), [*machine_facts(), ("device", device), ("backend", backend)])
    print_table(
        f"one mini-batch: {len(samples)} samples, {tokens:,} tokens, dp {args.dp}, cap {args.cap}, "
        f"fwd+bwd {dtype} ({'tiny smoke run' if tiny else 'Qwen2-VL-2B shapes'}), activation checkpointing, "
        f"best of {args.rounds} rounds per micro-batch",
        ("plan", "slots", "step s", "measured wait", "predicted idle, tokens", "predicted idle, FLOPs",
         "images encoded / slots", "step vs tokens plan"),
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
