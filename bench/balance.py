"""Balanced data-parallel steps: today's dealing vs the slot partition, side by side in one run.

Usage::

    .venv/bin/python bench/balance.py [--steps 3] [--repeats 3] [--seed 0]

The mix is ``bench/pack.py``'s (64 prompts x 16 rollouts = 1024 samples a step, seq_len 16k, 80%
of prompts with 1-4 images, 1% of text-only samples with a stray placeholder). Every draw is
planned three ways, on the same samples:

- **today**: ``trainer_lib.padding.plan_step`` (pack each mini-batch, spread the bins to a
  multiple of dp, deal them to the ranks, balance);
- **verl KK**: verl's order (:func:`plan_step_kk`): Karmarkar-Karp over the ranks' token totals,
  then each rank's share packed first-fit-decreasing, counts evened by ``balance_micro_batches``;
- **balanced**: :func:`plan_step_balanced`, the planned ``plan_step`` integration: the same
  padding and mini-batch split, then ``trainer_lib.partition.partition_mini_batch`` per
  mini-batch and each slot's samples built with the existing ``build_micro_batch`` (plus an
  image pad where a slot runs the vision tower and the bin has no image; a pad micro-batch where
  a rank's slot is empty).

Columns (per scenario and plan): micro-batches per rank and mini-batch (and the floor,
``min_micro_batches``); **waste** = 1 - real
tokens / ``sum(max(cap, len(mb)))`` and the **floor** no plan can beat (``min_micro_batches`` per
mini-batch: the cap, whole slots per rank, the vision/text split); **sync idle** with cost ~
tokens (``bench/pack.py``'s definition) and its floor (samples above the cap run alone and set
their slot's pace); **FLOP idle**: the same with the Qwen2-VL-2B cost model, vision tower and
language model synchronized separately (FSDP gathers each layer); **plan** samples/s (today:
``plan_bins`` on the same lengths, the 200k samples/s reference; verl KK: KK + ``plan_bins`` per
share; balanced: ``partition_mini_batch``); **plan_step** ms per 1024 samples end to end.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_facts, print_table, timeit, verdict
from pack import PAD, SEQ_LEN, TOK, _QwenCounts, make_step
from pack import sync_idle as token_idle
from packed_forward import qwen2_vl_2b_config

from protocol.structs import TrainingSample
from trainer_lib.packing import (
    PIXELS,
    PackedStep,
    PackEntry,
    _analyze,
    build_micro_batch,
    pack_samples,
    plan_bins,
    resolve_cap,
)
from trainer_lib.padding import (
    StepPlan,
    _mini_batch_indices,
    balance_micro_batches,
    image_pad_entry,
    make_pad_sample,
    minimal_pad_grid,
    padded_sample_count,
    plan_step,
)
from trainer_lib.partition import CostModel, min_micro_batches, partition_mini_batch, sync_idle

SCENARIOS = [
    ("dp 8, mini-batch 256, cap 16k", {}, {"dp": 8, "mbs": 256, "cap": SEQ_LEN}),
    ("dp 8, mini-batch 256, cap 8k", {}, {"dp": 8, "mbs": 256, "cap": 8192}),
    ("dp 8, mini-batch 1024, cap 16k", {}, {"dp": 8, "mbs": 1024, "cap": SEQ_LEN}),
    (
        "dp 8, mini-batch 256, cap 16k, 4 LoRAs",
        {"lora_ids": ("a", "b", "c", "d")},
        {"dp": 8, "mbs": 256, "cap": SEQ_LEN},
    ),
]
TARGET_IDLE, TARGET_WASTE, TARGET_PLAN = 0.02, 0.04, 200_000
PLANS = ("today", "verl KK", "balanced")


def _mini_batches(
    samples: Sequence[TrainingSample], dp: int, mbs: int, pad_token_id: int, pad_tokens: int
) -> tuple[list[tuple[list[PackEntry], tuple]], int]:
    """``plan_step``'s padding and split: per mini-batch its entries and the key its pads take."""
    n = len(samples)
    target = padded_sample_count(n, dp_size=dp, mini_batch_size=mbs)
    out = []
    for chunk in _mini_batch_indices(n, target, mbs):
        last = samples[max((i for i in chunk if i < n), default=n - 1)] if n else None
        key = (last.run_id, last.lora_id) if last else ("", None)
        pad = make_pad_sample(pad_token_id=pad_token_id, num_tokens=pad_tokens, run_id=key[0], lora_id=key[1])
        out.append(([PackEntry(samples[i] if i < n else pad, i) for i in chunk], key))
    return out, target - n


def plan_step_balanced(
    samples: Sequence[TrainingSample],
    *,
    dp_size: int,
    mini_batch_size: int,
    seq_len: int,
    placeholder_token_id: int,
    pad_token_id: int,
    adapter: Any,
    cost_model: CostModel,
    micro_batch_max_tokens: int | None = None,
    pad_tokens: int = 2,
) -> StepPlan:
    """``plan_step`` with the slot partition: pad, split, analyse, partition, build (see the module doc)."""
    cap = resolve_cap(seq_len, micro_batch_max_tokens)
    grid = tuple(minimal_pad_grid(adapter))
    reserve = adapter.num_placeholders(grid) + 2  # [pad] + placeholders + [pad]
    pads = functools.partial(_pad_entry, adapter, grid, pad_token_id, placeholder_token_id, pad_tokens)
    chunks, num_pads = _mini_batches(samples, dp_size, mini_batch_size, pad_token_id, pad_tokens)
    mini_batches = []
    for entries, key in chunks:
        analyses = [_analyze(e, placeholder_token_id, adapter.num_placeholders, e.index) for e in entries]
        part = partition_mini_batch(
            [a.length for a in analyses],
            dp_size=dp_size,
            cap=cap,
            keys=[(e.sample.run_id, e.sample.lora_id) for e in entries],
            kinds=[a.kind for a in analyses],
            vision_cost=[cost_model.vision([span[1] for span in a.spans]) for a in analyses],
            reserve=reserve,
        )
        steps = []
        for bins in part.ranks:
            mbs = []
            for has_pixels, b in zip(part.slot_has_pixels, bins, strict=True):
                b = sorted(b, key=lambda i: (entries[i].sample.is_padding, i))  # pads after real samples
                chosen = [(entries[i], analyses[i]) for i in b]
                if not b or (has_pixels and all(analyses[i].kind != PIXELS for i in b)):
                    entry = pads(
                        (entries[b[0]].sample.run_id, entries[b[0]].sample.lora_id) if b else key, has_pixels
                    )
                    chosen.append(
                        (entry, _analyze(entry, placeholder_token_id, adapter.num_placeholders, None))
                    )
                mbs.append(
                    build_micro_batch(*zip(*chosen, strict=True), placeholder_token_id=placeholder_token_id)
                )
            steps.append(PackedStep(micro_batches=mbs, micro_batch_max_tokens=cap))
        mini_batches.append(steps)
    return StepPlan(mini_batches=mini_batches, num_padding_samples=num_pads)


def karmarkar_karp(values: Sequence[float], k: int) -> list[list[int]]:
    """``k``-way largest differencing (Karmarkar & Karp 1982): indices of ``values`` per part.

    The baseline the issue names: verl's ``karmarkar_karp`` (``verl/utils/seqlen_balancing.py``,
    ``equal_size=False``), re-implemented here because verl is not a dependency. Each value starts
    a state of ``k`` sums; the two states of largest spread merge, largest sum with smallest.
    """
    heap = [(-v, i, [(v, [i])] + [(0, [])] * (k - 1)) for i, v in enumerate(values)]
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(
            ((x + y, p + q) for (x, p), (y, q) in zip(a, reversed(b), strict=True)), key=lambda s: -s[0]
        )
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], tie, merged))
        tie += 1
    return [items for _, items in heap[0][2]] if heap else [[] for _ in range(k)]


def plan_step_kk(
    samples: Sequence[TrainingSample],
    *,
    dp_size: int,
    mini_batch_size: int,
    seq_len: int,
    placeholder_token_id: int,
    pad_token_id: int,
    adapter: Any,
    micro_batch_max_tokens: int | None = None,
    pad_tokens: int = 2,
) -> StepPlan:
    """verl's order: balance rank token totals (KK), then pack each rank's share (FFD) and make the
    counts equal the way ``balance_micro_batches`` does (pads; multimodal pads for the vision tower)."""
    cap = resolve_cap(seq_len, micro_batch_max_tokens)
    chunks, num_pads = _mini_batches(samples, dp_size, mini_batch_size, pad_token_id, pad_tokens)
    mini_batches = []
    for entries, _ in chunks:
        parts = karmarkar_karp([len(e.sample.input_ids) for e in entries], dp_size)
        shares = [
            pack_samples(
                [entries[i] for i in sorted(part)],
                placeholder_token_id=placeholder_token_id,
                seq_len=seq_len,
                micro_batch_max_tokens=cap,
                num_placeholders=adapter.num_placeholders,
            )
            for part in parts
        ]
        mini_batches.append(
            balance_micro_batches(
                shares, pad_token_id=pad_token_id, placeholder_token_id=placeholder_token_id, adapter=adapter
            )
        )
    return StepPlan(mini_batches=mini_batches, num_padding_samples=num_pads)


def _pad_entry(
    adapter, grid, pad_id: int, placeholder_id: int, pad_tokens: int, key, image: bool
) -> PackEntry:
    """A zero-loss pad of ``key``: with one synthetic image in a vision slot, else text."""
    if image:
        return image_pad_entry(
            adapter,
            grid=grid,
            pad_token_id=pad_id,
            placeholder_token_id=placeholder_id,
            run_id=key[0],
            lora_id=key[1],
        )
    return PackEntry(
        make_pad_sample(pad_token_id=pad_id, num_tokens=pad_tokens, run_id=key[0], lora_id=key[1])
    )


def flop_idle(plan: StepPlan, cost_model: CostModel) -> float:
    """Idle share with FLOP costs, vision tower and language model each waiting for their slowest rank."""
    busy = peak = 0.0
    for ranks in plan.mini_batches:
        language = [
            [sum(cost_model.language(s.length) for s in mb.slots) for mb in r.micro_batches] for r in ranks
        ]
        vision = [
            [cost_model.vision([im.length for im in mb.images]) for mb in r.micro_batches] for r in ranks
        ]
        work = sum(map(sum, language)) + sum(map(sum, vision))
        busy += work
        peak += work / (1 - sync_idle(language, vision)) if work else 0.0
    return 1 - busy / peak if peak else 0.0


def floors(
    samples: Sequence[TrainingSample], mbs: int, dp: int, cap: int, reserve: int
) -> tuple[list[int], float, float]:
    """(micro-batches per rank, waste, token sync idle): floors per mini-batch, over the step.

    Waste: ``min_micro_batches`` slots of ``cap`` per rank (plus the excess of samples above the
    cap). Idle: each sample above the cap sets its slot's pace; such samples with images and those
    without never share a slot (vision tower on all ranks or none), so each kind is grouped into
    its fewest slots, sorted; every other slot is at best perfectly even.
    """
    real = capacity = peak = 0.0
    counts = []
    for c in range(0, len(samples), mbs):
        chunk = samples[c : c + mbs]
        lengths = [len(s.input_ids) for s in chunk]
        kinds = [_analyze(PackEntry(s), TOK, None, i).kind for i, s in enumerate(chunk)]
        keys = [(s.run_id, s.lora_id) for s in chunk]
        m = min_micro_batches(lengths, dp_size=dp, cap=cap, keys=keys, kinds=kinds, reserve=reserve)
        counts.append(m)
        real += sum(lengths)
        capacity += dp * m * cap + sum(n - cap for n in lengths if n > cap)
        over = [(n, k == PIXELS) for n, k in zip(lengths, kinds, strict=True) if n > cap]
        sides = (True, False) if PIXELS in kinds else (None,)
        groups = [sorted((n for n, pix in over if side in (None, pix)), reverse=True) for side in sides]
        slowest = sum(g[j] for g in groups for j in range(0, len(g), dp))  # the largest of each slot
        room = sum(-(-len(g) // dp) * dp - len(g) for g in groups) * cap  # other bins of those slots
        rest = sum(n for n in lengths if n <= cap) - room
        peak += dp * slowest + max(rest, 0)
    return counts, 1 - real / capacity, 1 - real / peak


def cost_shares(samples: Sequence[TrainingSample], cm: CostModel) -> dict[str, float]:
    """Share of the step's forward FLOPs per term of the cost model."""
    terms = {"language linear (tokens)": 0.0, "language attention (len^2)": 0.0}
    terms |= {"vision linear (image tokens)": 0.0, "vision attention (image tokens^2)": 0.0}
    for s in samples:
        n = len(s.input_ids)
        terms["language linear (tokens)"] += cm.llm_per_token * n
        terms["language attention (len^2)"] += cm.llm_per_token_sq * n * n
        for r in s.mm_refs.items if s.mm_refs else ():
            terms["vision linear (image tokens)"] += cm.vision_per_token * r.num_placeholders
            terms["vision attention (image tokens^2)"] += cm.vision_per_token_sq * r.num_placeholders**2
    total = sum(terms.values())
    return {k: v / total for k, v in terms.items()}


def _plan_bins_only(inputs: list[tuple], cap: int) -> list:
    """Today's plan reference: first-fit-decreasing bins of each mini-batch (``bench/pack.py``'s plan)."""
    return [plan_bins(lengths, cap, keys=keys, kinds=kinds) for lengths, keys, kinds, _ in inputs]


def _kk_only(inputs: list[tuple], dp: int, cap: int) -> list:
    """KK rank shares, then FFD bins per share."""
    out = []
    for lengths, keys, kinds, _ in inputs:
        for part in karmarkar_karp(lengths, dp):
            sub = sorted(part)
            out.append(
                plan_bins(
                    [lengths[i] for i in sub], cap, keys=[keys[i] for i in sub], kinds=[kinds[i] for i in sub]
                )
            )
    return out


def _partition_only(inputs: list[tuple], dp: int, cap: int, reserve: int) -> list:
    return [
        partition_mini_batch(
            lengths, dp_size=dp, cap=cap, keys=keys, kinds=kinds, vision_cost=vision, reserve=reserve
        )
        for lengths, keys, kinds, vision in inputs
    ]


def run_scenario(rng, mix: dict, cfg: dict, cm: CostModel, steps: int, repeats: int) -> dict[str, dict]:
    dp, mbs, cap = cfg["dp"], cfg["mbs"], cfg["cap"]
    adapter = _QwenCounts()
    reserve = adapter.num_placeholders(minimal_pad_grid(adapter)) + 2
    common = {"dp_size": dp, "mini_batch_size": mbs, "seq_len": SEQ_LEN, "micro_batch_max_tokens": cap}
    common |= {"placeholder_token_id": TOK, "pad_token_id": PAD, "adapter": adapter}
    out = {
        name: {"m": [], "real": 0, "capacity": 0, "idle": [], "flop": [], "plan": [], "e2e": []}
        for name in PLANS
    }
    out["floor"] = {"m": [], "waste": [], "idle": []}
    for _ in range(steps):
        samples = make_step(rng, **mix)
        n = len(samples)
        runs = {
            "today": functools.partial(plan_step, samples, **common),
            "verl KK": functools.partial(plan_step_kk, samples, **common),
            "balanced": functools.partial(plan_step_balanced, samples, cost_model=cm, **common),
        }
        inputs = []
        for c in range(0, n, mbs):
            an = [
                _analyze(PackEntry(s), TOK, adapter.num_placeholders, i)
                for i, s in enumerate(samples[c : c + mbs])
            ]
            keys = [(s.run_id, s.lora_id) for s in samples[c : c + mbs]]
            vision = [cm.vision([span[1] for span in a.spans]) for a in an]
            inputs.append(([a.length for a in an], keys, [a.kind for a in an], vision))
        plans = {
            "today": functools.partial(_plan_bins_only, inputs, cap),
            "verl KK": functools.partial(_kk_only, inputs, dp, cap),
            "balanced": functools.partial(_partition_only, inputs, dp, cap, reserve),
        }
        for name, run in runs.items():
            plan = run()
            r = out[name]
            packed = [s for ranks in plan.mini_batches for s in ranks]
            r["m"] += [ranks[0].num_micro_batches for ranks in plan.mini_batches]
            r["real"] += sum(s.num_tokens - s.num_padding_tokens for s in packed)
            r["capacity"] += sum(s.capacity for s in packed)
            r["idle"].append(token_idle(plan.mini_batches))
            r["flop"].append(flop_idle(plan, cm))
            r["plan"].append(n / timeit(plans[name], repeat=repeats * 5).best)
            r["e2e"].append(timeit(run, repeat=repeats, warmup=0).best * 1024 / n)
        counts, waste, idle = floors(samples, mbs, dp, cap, reserve)
        out["floor"]["m"] += counts
        out["floor"]["waste"].append(waste)
        out["floor"]["idle"].append(idle)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps (random draws) per scenario")
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (best of)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cm = CostModel.from_config(qwen2_vl_2b_config())
    print_facts()
    coeffs = [
        ("language, per token", f"{cm.llm_per_token:.3e}"),
        ("language, per token^2 (causal attention)", f"{cm.llm_per_token_sq:.3e}"),
        ("vision, per image token", f"{cm.vision_per_token:.3e}"),
        ("vision, per image token^2 (attention)", f"{cm.vision_per_token_sq:.3e}"),
    ]
    print_table("cost model: Qwen2-VL-2B forward FLOPs (CostModel.from_config)", ("term", "FLOPs"), coeffs)
    shares = cost_shares(make_step(np.random.default_rng(args.seed)), cm)
    print_table(
        "share of a step's FLOPs on the mix", ("term", "share"), [(k, f"{v:.1%}") for k, v in shares.items()]
    )
    rng = np.random.default_rng(args.seed)
    rows, targets = [], []
    for name, mix, cfg in SCENARIOS:
        r = run_scenario(rng, mix, cfg, cm, args.steps, args.repeats)
        waste_floor, idle_floor = (float(np.mean(r["floor"][k])) for k in ("waste", "idle"))
        for plan in PLANS:
            p = r[plan]
            waste, idle = 1 - p["real"] / p["capacity"], float(np.mean(p["idle"]))
            rows.append(
                (
                    name,
                    plan,
                    f"{np.mean(p['m']):.2f} ({np.mean(r['floor']['m']):.2f})",
                    f"{waste:.2%}",
                    f"{waste_floor:.2%}",
                    f"{idle:.2%}",
                    f"{idle_floor:.2%}",
                    f"{np.mean(p['flop']):.2%}",
                    f"{np.median(p['plan']):,.0f}",
                    f"{np.median(p['e2e']) * 1000:.0f}",
                )
            )
            if plan == "balanced" and "256" in name and "LoRA" not in name:
                targets.append(
                    (
                        f"{name}: sync idle",
                        f"{idle:.2%}",
                        "<= 2%",
                        verdict(idle, TARGET_IDLE, higher_is_better=False),
                    )
                )
                targets.append(
                    (
                        f"{name}: waste (floor {waste_floor:.2%})",
                        f"{waste:.2%}",
                        "<= 4%",
                        verdict(waste, TARGET_WASTE, higher_is_better=False),
                    )
                )
                rate, ffd = float(np.median(p["plan"])), float(np.median(r["today"]["plan"]))
                targets.append(
                    (
                        f"{name}: plan samples/s (plan_bins alone: {ffd:,.0f})",
                        f"{rate:,.0f}",
                        ">= 200,000",
                        verdict(rate, TARGET_PLAN, higher_is_better=True),
                    )
                )
    header = (
        "scenario",
        "plan",
        "micro-batches/rank (floor)",
        "waste",
        "waste floor",
        "sync idle",
        "idle floor",
    )
    header += ("FLOP idle", "plan samples/s", "plan_step ms/1024")
    print_table(f"today vs verl KK vs balanced ({args.steps} steps per row, seed {args.seed})", header, rows)
    print_table("targets (issue 13)", ("figure", "measured", "target", "verdict"), targets)


if __name__ == "__main__":
    main()
