"""Packing benchmark: waste, sync idle and plan rates on a realistic RL length mix, with the
data-parallel plans side by side (today's dealing, verl's order, the balanced plan) in one run.

Usage::

    .venv/bin/python bench/pack.py [--steps 3] [--repeats 3] [--seed 0] [--prompts 64]

The mix (GRPO-style steps; every number is a constant below, so runs compare):

- a step = ``PROMPTS`` prompts x ``ROLLOUTS`` rollouts; the rollouts of a prompt share it;
- prompt text: lognormal, median 350 tokens (sigma 0.6), clipped to [40, 4000];
- 80% of prompts carry images: 1 (70%), 2 (20%) or 3-4 (10%); each image is a photo of
  224..1008 px per side (Qwen2-VL grid ``(1, H/14, W/14)``, ``H*W/28**2`` placeholder tokens, i.e.
  64..1296 tokens), wrapped in ``<vision_start> ... <vision_end>``;
- completion: lognormal, median 900 tokens (sigma 0.9), clipped so a sample fits ``SEQ_LEN``;
- 1% of text-only samples carry a literal ``<|image_pad|>`` (stray placeholder).

Single-rank rows: ``pack_samples``. Data-parallel rows, every draw planned six ways on the same
samples (``bench/_baselines.py``): **today** (``plan_step`` before issue 13), **verl KK**
(Karmarkar-Karp rank shares, each packed alone), **balanced, tokens (#13)** (``plan_step(...,
balance="tokens")``, the plan before issue 29), **balanced, compute (#29)** (``plan_step(...,
refine=None)``, the plan as constructed: samples sharing an image kept together, FLOPs balanced
per slot), and that plan with the search (``Refinement(anneal_steps=0)``: **+ descent**;
``Refinement(anneal_steps=1_000_000, plan_time_budget_s=math.inf)``: **+ descent + anneal**,
timed once per draw: ~0.2 s per mini-batch; ``Refinement()``: **+ search (default budget)**,
``plan_step``'s default since issue 43, descent and annealing within the default
``plan_time_budget_s``, 2% of the predicted step on the cost model's card, 2-45 ms).
Columns
(docs/PACKING.md §7 defines them):

- **waste, capacity** = 1 - real tokens / ``sum(max(cap, len(mb)))`` (empty room + pads), with its
  **floor**: no plan under the rules runs fewer than ``min_micro_batches`` micro-batches per rank;
- **waste, compute** = pad tokens processed / all tokens processed (empty room costs no FLOPs
  under varlen attention; time lost at the syncs is the next column);
- **sync idle** (dp rows) = ``StepPlan.sync_idle()``: share of rank-time waiting at the per-
  micro-batch syncs (FSDP), cost ~ tokens, with its **floor** (samples above the cap run alone);
  **FLOP idle**: the same with the Qwen2-VL-2B cost model (vision tower and language model each
  wait for their slowest rank), the tower costing each distinct image once per micro-batch (the
  trainer's dedup), in brackets once per image slot (before issue 29);
- **images encoded / image slots**: vision-tower encodes under dedup over image slots (1.0: every
  slot encoded); **step FLOPs**: the predicted step time (per slot, the slowest rank's vision plus
  its slowest language FLOPs, summed) over the token-balanced plan's with one encode per image slot
  (the trainer before issue 29);
- beside issue 29's targets, two shares of the compute plan's rank-time: the language idle no
  plan under the cap avoids (each mini-batch's costliest sample sets its slot's pace, and a bin
  of at most ``cap`` tokens does at most ``a*cap + b*n*cap`` with ``n`` its longest sample), and
  the vision idle of a tidy layout (each image group alone in ``round(L_g / level)`` bins, sorted
  by cost: the fewest encodes that keep the language levelled), for comparison;
- **plan** samples/s: single rank and *today*: ``plan_bins`` (first-fit-decreasing from
  lengths/kinds/keys, the issue's 200k reference); *verl KK*: KK + ``plan_bins`` per share;
  *balanced*: ``partition_mini_batch`` (vision costs included); **plan_step ms/1024**: the whole
  plan end to end as one rank spends it (analysis, planning, every micro-batch laid out, and rank
  0's ``MicroBatch`` wire structs built: the others' are built on first read, by their own rank),
  per 1024 samples, and **per mini-batch** (the planning time a step spends per optimizer step);
- **pack** samples/s (single rank): ``pack_samples`` end to end, every wire struct built.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages, not the installed
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _baselines import karmarkar_karp, plan_today, plan_verl
from _common import print_facts, print_table, timeit
from _models import qwen2_vl_2b_config
from _pack_targets import (
    ANNEAL,
    ANNEAL_STEPS,
    BASE,
    BUDGET,
    COMPUTE,
    DESCENT,
    compute_target_rows,
    floors,
    idle_measures,
    step_flops,
    target_rows,
)

from protocol.refs import RawRefBody, format_mmraw
from protocol.structs import MMRefs, RawMMRef, TrainingSample
from trainer_lib.planning.bins import NEUTRAL, PIXELS, STRAY, plan_bins
from trainer_lib.planning.cost import CostModel
from trainer_lib.planning.items import MiniBatchItems
from trainer_lib.planning.packing import analyze_entry, pack_samples
from trainer_lib.planning.partition import partition_mini_batch
from trainer_lib.planning.plan import mini_batch_entries, plan_step
from trainer_lib.planning.ranks import StepShape
from trainer_lib.planning.refine import Refinement
from trainer_lib.spec import PackingSpec

SEQ_LEN = 16384
TOK, PAD, V_START, V_END = 261, 256, 259, 260
PROMPTS, ROLLOUTS = 64, 16
RESERVE = 6  # a synthetic-image pad of the smallest Qwen2-VL grid: [pad] + 4 placeholders + [pad]


def grid_ref(h: int, w: int, digest: str) -> RawMMRef:
    """A syntactically valid Qwen2-VL ref of grid ``(1, 2h, 2w)`` (``h*w`` placeholders) whose
    sha256 is ``digest`` (64 hex digits); no image behind it (planning reads no pixels)."""
    body = RawRefBody(
        family="qwen2_vl",
        modality="image",
        mm_hash=digest[:32],
        payload={"image_grid_thw": [1, 2 * h, 2 * w]},
        raw_image_uri=f"file:///data/run_1/assets/images/{digest[:16]}.jpg",
    )
    return RawMMRef(
        ref=format_mmraw(body),
        sha256=digest,
        media_type="image/jpeg",
        grid=[1, 2 * h, 2 * w],
        num_placeholders=h * w,
    )


def make_ref(rng: np.random.Generator, scale: float = 1.0) -> RawMMRef:
    """A random image of the mix: 8..36 merged 28-px cells per side (224..1008 px), each side
    times ``scale`` (at least 2 cells)."""
    h, w = (max(2, int(int(x) * scale)) for x in rng.integers(8, 37, size=2))
    return grid_ref(h, w, "".join(rng.choice(list("0123456789abcdef"), size=64)))


def make_step(
    rng: np.random.Generator,
    prompts: int = PROMPTS,
    rollouts: int = ROLLOUTS,
    lora_ids=(None,),
    scale: float = 1.0,
):
    """One RL step of the mix (module docstring); ``scale`` < 1 shrinks every text length and image
    side by that factor (the same draws: tiny smoke runs of the benches that run a model)."""
    samples = []
    for p in range(prompts):
        text = max(1, int(np.clip(rng.lognormal(np.log(350), 0.6), 40, 4000) * scale))
        n_img = 0
        if rng.random() < 0.8:
            n_img = int(rng.choice([1, 2, 3, 4], p=[0.7, 0.2, 0.05, 0.05]))
        refs = [make_ref(rng, scale) for _ in range(n_img)]
        prompt = [int(t) for t in rng.integers(0, 256, size=text)]
        for r in refs:
            prompt += [V_START] + [TOK] * r.num_placeholders + [V_END]
        lora = lora_ids[p % len(lora_ids)]
        for _ in range(rollouts):
            room = SEQ_LEN - len(prompt)
            n = max(1, int(np.clip(rng.lognormal(np.log(900), 0.9), 1, max(room, 1)) * scale))
            ids = prompt + [int(t) for t in rng.integers(0, 256, size=n)]
            if not refs and rng.random() < 0.01:
                ids[len(prompt) // 2] = TOK  # a literal placeholder in text
            samples.append(
                TrainingSample(
                    input_ids=ids,
                    loss_mask=[False] * len(prompt) + [True] * n,
                    advantages=[0.1] * len(ids),
                    inference_logprobs=[-1.0] * len(ids),
                    mm_refs=MMRefs(items=refs) if refs else None,
                    run_id="run_1",
                    lora_id=lora,
                )
            )
    return samples


class _QwenCounts:
    """The adapter methods packing needs, with Qwen2-VL's arithmetic (merge 2, minimal grid 1x4x4)."""

    def num_placeholders(self, grid) -> int:
        t, h, w = grid
        return t * h * w // 4

    def grid_for_size(self, width: int, height: int) -> tuple[int, int, int]:
        return (1, 4, 4)


def qwen_spec(tok: int = TOK) -> PackingSpec:
    """The packing facts of a Qwen2-VL model whose image placeholder id is ``tok``."""
    return PackingSpec(placeholder_token_id=tok, pad_token_id=PAD, adapter=_QwenCounts())


SPEC = qwen_spec()

SINGLE = [
    ("1 rank, cap = seq_len 16k", {}, SEQ_LEN),
    ("1 rank, cap 8k", {}, 8192),
    ("1 rank, 4 LoRAs, cap 16k", {"lora_ids": ("a", "b", "c", "d")}, SEQ_LEN),
    ("8192 samples, cap 16k", {"prompts": 512}, SEQ_LEN),
]
DP = [
    ("dp 8, mini-batch 256, cap 16k", {}, 256, SEQ_LEN),
    ("dp 8, mini-batch 256, cap 8k", {}, 256, 8192),
    ("dp 8, mini-batch 1024, cap 16k", {}, 1024, SEQ_LEN),
    ("dp 8, mini-batch 256, cap 16k, 4 LoRAs", {"lora_ids": ("a", "b", "c", "d")}, 256, SEQ_LEN),
]
PLANS = {
    "today": (plan_today, {}),
    "verl KK": (plan_verl, {}),
    "balanced, tokens (#13)": (plan_step, {"balance": "tokens"}),
    "balanced, tokens, stretch_cap": (plan_step, {"balance": "tokens", "stretch_cap": True}),
    "balanced, compute (#29)": (plan_step, {"refine": None}),
    DESCENT: (plan_step, {"refine": Refinement(anneal_steps=0)}),
    ANNEAL: (plan_step, {"refine": Refinement(anneal_steps=ANNEAL_STEPS, plan_time_budget_s=math.inf)}),
    BUDGET: (plan_step, {"refine": Refinement()}),
}
"""Name: (plan function, its options). The balanced plans also get the cost model; "compute" is
``plan_step``'s default since issue 29 (it falls back to tokens where a sample exceeds the cap);
the last three add the search (``Refinement``: descent, then annealing; the last one
within the default time budget)."""


def plans_for(cap: int) -> list[str]:
    """The plans of a scenario: ``stretch_cap`` only changes a plan when a sample exceeds the cap."""
    return [name for name in PLANS if cap < SEQ_LEN or "stretch" not in name]


def _built(*args, **kwargs):
    """``pack_samples(*args, **kwargs)`` with every micro-batch's wire struct built (one rank
    reads them all; they are built on first read)."""
    packed = pack_samples(*args, **kwargs)
    for mb in packed.micro_batches:
        _ = mb.micro_batch
    return packed


def run_single(rng, mix: dict, cap: int, steps: int, repeats: int, prompts: int) -> tuple:
    n_total = mbs = real = capacity = 0
    plan, pack = [], []
    for _ in range(steps):
        samples = make_step(rng, **{"prompts": prompts, **mix})
        spec = PackingSpec(placeholder_token_id=TOK, pad_token_id=PAD)  # as before: counts not checked
        run = functools.partial(_built, samples, spec, seq_len=SEQ_LEN, micro_batch_max_tokens=cap)
        packed = run()
        kinds = [PIXELS if s.mm_refs else (STRAY if TOK in s.input_ids else NEUTRAL) for s in samples]
        keys = [s.isolation_key for s in samples]
        lengths = [len(s.input_ids) for s in samples]
        ffd = functools.partial(plan_bins, lengths, cap, keys=keys, kinds=kinds)
        plan.append(len(samples) / timeit(ffd, repeat=repeats).best)
        pack.append(len(samples) / timeit(run, repeat=repeats, warmup=0).best)
        n_total += len(samples)
        mbs += packed.num_micro_batches
        real += packed.num_tokens - packed.num_padding_tokens
        capacity += packed.capacity
    return (
        n_total // steps,
        f"{mbs / steps:.1f}",
        f"{real / n_total:,.0f}",
        f"{1 - real / capacity:.2%}",
        f"{np.median(plan):,.0f}",
        f"{np.median(pack):,.0f}",
    )


def mini_batch_inputs(samples, dp: int, mbs: int, cm: CostModel) -> list[tuple]:
    """Per mini-batch: lengths, keys, kinds, vision costs, and the compute plan's image groups,
    language costs and the costs' unit in the card's seconds (``MiniBatchItems`` keywords), as
    ``plan_step`` derives them."""
    out = []
    for entries in mini_batch_entries(samples, SPEC, dp_size=dp, mini_batch_size=mbs):
        an = [analyze_entry(e, SPEC, e.sample_index) for e in entries]
        keys = [e.sample.isolation_key for e in entries]
        costs = [cm.vision(a.image_tokens) for a in an]
        extra = {"groups": [a.image_key for a in an], "language": [cm.language(a.length) for a in an]}
        extra["unit_seconds"] = cm.seconds_per_unit  # the search's default budget reads it
        out.append(([a.length for a in an], keys, [a.kind for a in an], costs, extra))
    return out


def plan_rate(name: str, inputs: list[tuple], dp: int, cap: int, repeats: int) -> float:
    """Samples/s of the planning alone (no micro-batch built)."""
    n = sum(len(x[0]) for x in inputs)

    def today() -> None:
        for lengths, keys, kinds, *_ in inputs:
            plan_bins(lengths, cap, keys=keys, kinds=kinds)

    def verl() -> None:
        for lengths, keys, kinds, *_ in inputs:
            for part in karmarkar_karp(lengths, dp):
                sub = sorted(part)
                plan_bins(
                    [lengths[i] for i in sub], cap, keys=[keys[i] for i in sub], kinds=[kinds[i] for i in sub]
                )

    def balanced() -> None:
        stretch, refine = "stretch" in name, PLANS[name][1].get("refine")
        for lengths, keys, kinds, vision, extra in inputs:
            items = MiniBatchItems(
                lengths, dp=dp, cap=cap, keys=keys, kinds=kinds, vision=vision, reserve=RESERVE,
                stretch=stretch, **(extra if "compute" in name else {}),
            )  # fmt: skip
            partition_mini_batch(items, refine)

    fn = {"today": today, "verl KK": verl}.get(name, balanced)
    slow = name in (ANNEAL, BUDGET)  # annealing: ~0.3 s / up to 0.045 s per mini-batch
    return n / timeit(fn, repeat=1 if slow else repeats * 3).best


def _rank_zero(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``'s plan with rank 0's wire structs built: what one rank spends per
    step (every rank plans every rank's micro-batches, and reads its own; issue 43)."""
    plan = fn(*args, **kwargs)
    for ranks in plan.mini_batches:
        for mb in ranks[0].micro_batches:
            _ = mb.micro_batch
    return plan


def run_dp(rng, mix: dict, mbs: int, cap: int, cm: CostModel, args) -> dict:
    out = {
        name: {
            "m": [],
            "real": 0,
            "cap": 0,
            "pad": 0,
            "all": 0,
            "idle": [],
            "flop": [],
            "flop_slot": [],
            "plan": [],
            "ms": [],
            "enc": 0,
            "slots": 0,
            "step": 0.0,
        }
        for name in plans_for(cap)
    }
    out["floor"] = {"m": [], "waste": [], "idle": [], "forced": 0.0, "tidy": 0.0}
    out["dp"], out["mbs"] = 8, mbs
    shape = StepShape(dp_size=8, mini_batch_size=mbs, seq_len=SEQ_LEN, micro_batch_max_tokens=cap)
    for _ in range(args.steps):
        samples = make_step(rng, **{"prompts": args.prompts, **mix})
        inputs = mini_batch_inputs(samples, 8, mbs, cm)
        for name in plans_for(cap):
            fn, options = PLANS[name]
            balanced = {"cost_model": cm} if name.startswith("balanced") else {}
            step = dataclasses.replace(shape, stretch_cap=options.get("stretch_cap", False))
            options = {k: v for k, v in options.items() if k != "stretch_cap"}  # the shape's
            run = functools.partial(_rank_zero, fn, samples, SPEC, step, **options, **balanced)
            plan, r = run(), out[name]
            shares = [s for ranks in plan.mini_batches for s in ranks]
            r["m"] += [ranks[0].num_micro_batches for ranks in plan.mini_batches]
            r["real"] += sum(s.num_tokens - s.num_padding_tokens for s in shares)
            r["cap"] += sum(s.capacity for s in shares)
            r["pad"] += sum(s.num_padding_tokens for s in shares)
            r["all"] += sum(s.num_tokens for s in shares)
            r["idle"].append(plan.sync_idle())
            r["flop"].append(plan.sync_idle(cm))
            r["flop_slot"].append(plan.sync_idle(cm, dedup=False))
            loads = [x for ranks in plan.rank_loads for x in ranks]
            r["enc"] += sum(x.encoded_images for x in loads)
            r["slots"] += sum(x.image_slots for x in loads)
            r["step"] += step_flops(plan, cm)
            if name == BASE:  # before issue 29 the trainer also encoded every image slot
                r["step_slot"] = r.get("step_slot", 0.0) + step_flops(plan, cm, dedup=False)
            r["plan"].append(plan_rate(name, inputs, 8, cap, args.repeats))
            r["ms"].append(timeit(run, repeat=args.repeats, warmup=0).best * 1000 * 1024 / len(samples))
        counts, waste, idle = floors(inputs, 8, cap, RESERVE)
        out["floor"]["m"] += counts
        out["floor"]["waste"].append(waste)
        out["floor"]["idle"].append(idle)
        forced, tidy = idle_measures(inputs, counts, cm, 8, cap)
        out["floor"]["forced"] += forced
        out["floor"]["tidy"] += tidy
    return out


def cost_tables(cm: CostModel, samples) -> None:
    coeffs = [
        ("language, per token (linear layers + LM head)", f"{cm.llm_per_token:.3e}"),
        ("language, per token^2 (causal attention)", f"{cm.llm_per_token_sq:.3e}"),
        ("vision, per image token (linear layers)", f"{cm.vision_per_token:.3e}"),
        ("vision, per image token^2 (attention)", f"{cm.vision_per_token_sq:.3e}"),
    ]
    print_table("cost model: Qwen2-VL-2B forward FLOPs (CostModel.from_config)", ("term", "FLOPs"), coeffs)
    terms = dict.fromkeys(("language linear", "language attention", "vision linear", "vision attention"), 0.0)
    for s in samples:
        n, images = len(s.input_ids), [r.num_placeholders for r in (s.mm_refs.items if s.mm_refs else ())]
        terms["language linear"] += cm.llm_per_token * n
        terms["language attention"] += cm.llm_per_token_sq * n * n
        terms["vision linear"] += cm.vision_per_token * sum(images)
        terms["vision attention"] += cm.vision_per_token_sq * sum(v * v for v in images)
    total = sum(terms.values())
    print_table(
        "share of a step's FLOPs on the mix",
        ("term", "share"),
        [(k, f"{v / total:.1%}") for k, v in terms.items()],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps (random draws) per scenario")
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (best of)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="prompts per step (x16 samples)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    cm = CostModel.from_config(qwen2_vl_2b_config())
    print_facts()
    print(f"\nmix: {args.prompts}x{ROLLOUTS} samples/step unless noted, seq_len {SEQ_LEN}")
    cost_tables(cm, make_step(np.random.default_rng(args.seed), prompts=args.prompts))
    rows = [
        (name, *run_single(rng, mix, cap, args.steps, args.repeats, args.prompts))
        for name, mix, cap in SINGLE
    ]
    header = (
        "scenario",
        "samples",
        "micro-batches",
        "mean len",
        "waste, capacity",
        "plan samples/s",
        "pack samples/s",
    )
    print_table("one rank: pack_samples", header, rows)
    rows, targets = [], []
    for name, mix, mbs, cap in DP:
        r = run_dp(rng, mix, mbs, cap, cm, args)
        f = r["floor"]
        for plan in plans_for(cap):
            p = r[plan]
            rows.append((
                name, plan, f"{np.mean(p['m']):.2f} ({np.mean(f['m']):.2f})",
                f"{1 - p['real'] / p['cap']:.2%} ({np.mean(f['waste']):.2%})", f"{p['pad'] / p['all']:.3%}",
                f"{np.mean(p['idle']):.2%} ({np.mean(f['idle']):.2%})",
                f"{np.mean(p['flop']):.2%} ({np.mean(p['flop_slot']):.2%})",
                f"{p['enc'] / max(p['slots'], 1):.3f}", f"{p['step'] / r[BASE]['step_slot']:.3f}",
                f"{np.median(p['plan']):,.0f}", f"{np.median(p['ms']):.0f}",
                f"{np.median(p['ms']) * mbs / 1024:.1f}",
            ))  # fmt: skip
        if mbs == 256 and "LoRA" not in name:
            targets += [
                row for plan in plans_for(cap) if "tokens" in plan for row in target_rows(name, plan, r)
            ]
            targets += [
                row
                for plan in (COMPUTE, DESCENT, ANNEAL, BUDGET)
                for row in compute_target_rows(name, r, plan)
            ]
    header = ("scenario", "plan", "micro-batches/rank (floor)", "waste, capacity (floor)", "waste, compute")
    header += ("sync idle (floor)", "FLOP idle, dedup (per slot)", "images encoded / image slots")
    header += ("step FLOPs vs #13 per slot", "plan samples/s", "plan_step ms/1024", "plan_step ms/mini-batch")
    print_table(
        f"data-parallel plans side by side ({args.steps} steps per row, seed {args.seed})", header, rows
    )
    print_table(
        "targets: issue 13 (tokens), issue 29 (compute)", ("figure", "measured", "target", "verdict"), targets
    )


if __name__ == "__main__":
    main()
