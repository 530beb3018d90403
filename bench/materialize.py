"""Trainer ``materialize``: dedup by ref vs naive per-sample processing, 2 workers vs 1, peak RSS.

A 64-sample RL batch in groups of 8 (each group shares one real photo, 1024x768 JPEG, real
Qwen2-VL processor limits: grid [1,54,74], 3996 patches x 1176 float32 per image slot):

- ``materialize(samples, adapter, root, max_workers=W)`` (each distinct ref read and processed
  once, results placed in every slot, collated) vs naive per-sample processing (the same
  ``adapter.resolve_raw`` for every sample, on the same pool size, then the same collate).
  Target >= 7x.
- ``materialize`` with 2 workers vs 1 (the machine has 2 cores). Target >= 1.7x.
- peak RSS of a fresh process running one ``materialize`` of the batch, from the OS
  (``getrusage(RUSAGE_SELF).ru_maxrss``), vs the batch's own pixel bytes
  (``pixel_values.nbytes``). Target <= 1.5x.

The machine is shared with other developers' jobs, so timings drift by tens of percent within
minutes: every timed configuration runs in ONE process, interleaved round by round (each round
runs each configuration once), and the median per configuration is reported. The two phases of
one ``materialize`` (processing the distinct images on the pool, then the collate of one block per
sample) are timed apart by a replica of those two steps, interleaved the same way. Peak RSS is
measured in a fresh process per configuration, running one call.

Usage: ``.venv/bin/python bench/materialize.py [--repeat 5] [--profile]`` (about 2 minutes).
``--profile`` adds a pyinstrument profile of one ``materialize`` (2 workers).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import (
    BENCH_OUTPUTS,
    REPO,
    bench_asset_root,
    fmt_bytes,
    print_facts,
    print_table,
    ratio_row,
    unique_photos,
)
from _models import ensure_bench_model

BATCH = 64
GROUP = 8
DEDUP_TARGET = 7.0
WORKERS_TARGET = 1.7
RSS_TARGET = 1.5
COMPLETION = 16


def make_batch(batch: int, group: int, adapter, refs: list | None = None) -> list:
    """``batch`` samples; each run of ``group`` consecutive samples shares one distinct photo
    (``refs``: one per group; default: v1 refs of fresh photos in the bench store)."""
    from protocol.adapters import offload_image
    from protocol.placeholders import expand_image_placeholders
    from protocol.structs import MMRefs, TrainingSample

    pad = adapter.placeholder_token_id(_hf_config())
    if refs is None:
        refs = [offload_image(j, bench_asset_root(), adapter) for j in unique_photos(batch // group)]
    samples = []
    for i in range(batch):
        ref = refs[i // group]
        prompt = expand_image_placeholders([1, 2, pad, 3, 4], [ref], pad)
        ids = prompt + list(range(10, 10 + COMPLETION))
        n, c = len(prompt), COMPLETION
        samples.append(
            TrainingSample(
                input_ids=ids,
                loss_mask=[False] * n + [True] * c,
                advantages=[0.0] * n + [1.0] * c,
                inference_logprobs=[0.0] * (n + c),
                mm_refs=MMRefs(items=[ref]),
            )
        )
    return samples


def _hf_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(ensure_bench_model())


def naive(samples: list, adapter, root: Path, max_workers: int) -> dict:
    """Per-sample processing: every sample's image read, decoded and processed, then collated."""
    from concurrent.futures import ThreadPoolExecutor

    from protocol.refs import parse_ref
    from protocol.store import AssetStore

    store = AssetStore(root)
    refs = [s.mm_refs.items[0].ref for s in samples]

    def work(ref: str):
        return adapter.resolve_raw(parse_ref(ref), store, ref=ref)

    with ThreadPoolExecutor(max_workers) as pool:
        items = list(pool.map(work, refs))
    return adapter.collate(items)


# --- timing: one process, configurations interleaved ---------------------------------------------

TIMED = (
    # name, kind, workers, torch intra-op threads (None = default)
    ("materialize, 1 worker", "materialize", 1, None),
    ("materialize, 2 workers", "materialize", 2, None),
    ("materialize, 2 workers, torch threads 1", "materialize", 2, 1),
    ("materialize(dedup=True), 1 worker", "materialize-dedup", 1, None),
    ("materialize(dedup=True), 2 workers", "materialize-dedup", 2, None),
    ("naive per-sample, 1 worker", "naive", 1, None),
    ("naive per-sample, 2 workers", "naive", 2, None),
    ("phases: materialize, 1 worker", "phases-dedup", 1, None),
    ("phases: materialize, 2 workers", "phases-dedup", 2, None),
    ("phases: naive, 2 workers", "phases-naive", 2, None),
)


def timing_child(repeat: int, profile: bool) -> dict:
    import torch

    from protocol.adapters import load_adapter
    from trainer_lib.materialize import materialize

    adapter = load_adapter(ensure_bench_model())
    samples = make_batch(BATCH, GROUP, adapter)
    pad = adapter.placeholder_token_id(_hf_config())
    default_threads = torch.get_num_threads()
    materialize(samples[:1], adapter, BENCH_OUTPUTS, max_workers=1)  # warm-up
    times: dict[str, list] = {name: [] for name, *_ in TIMED}
    for _ in range(repeat):
        for name, kind, workers, threads in TIMED:
            torch.set_num_threads(threads or default_threads)
            if kind.startswith("phases"):
                times[name].append(phases(samples, adapter, workers, dedup=kind == "phases-dedup"))
                continue
            t0 = time.perf_counter()
            if kind == "naive":
                out = naive(samples, adapter, BENCH_OUTPUTS, workers)
            else:
                out = materialize(
                    samples,
                    adapter,
                    BENCH_OUTPUTS,
                    max_workers=workers,
                    placeholder_token_id=pad,
                    dedup=kind == "materialize-dedup",
                )
            times[name].append(time.perf_counter() - t0)
            del out
            gc.collect()
    torch.set_num_threads(default_threads)
    result: dict = {"times": times, "torch_threads": default_threads}
    if profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.001)
        with profiler:
            materialize(samples, adapter, BENCH_OUTPUTS, max_workers=2)
        result["profile"] = profiler.output_text(unicode=False, color=False)
    return result


def phases(samples: list, adapter, workers: int, dedup: bool) -> tuple[float, float]:
    """(process s, collate s): processing on the pool (distinct refs if ``dedup``, else one per
    sample, as naive processing does), then the collate of one block per sample."""
    from concurrent.futures import ThreadPoolExecutor

    from protocol.refs import parse_ref
    from protocol.store import AssetStore

    store = AssetStore(BENCH_OUTPUTS)
    slots = [s.mm_refs.items[0].ref for s in samples]
    todo = list(dict.fromkeys(slots)) if dedup else slots
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda r: adapter.resolve_raw(parse_ref(r), store, ref=r), todo))
    t_process = time.perf_counter() - t0
    by_ref = dict(zip(todo, results, strict=True))
    items = [by_ref[r] for r in slots] if dedup else results
    t0 = time.perf_counter()
    out = adapter.collate(items)
    t_collate = time.perf_counter() - t0
    del out, items, results, by_ref
    gc.collect()
    return t_process, t_collate


# --- peak RSS: a fresh process per configuration, one call ----------------------------------------


def rss_child(kind: str, workers: int, batch: int) -> dict:
    from protocol.adapters import load_adapter
    from trainer_lib.materialize import materialize

    adapter = load_adapter(ensure_bench_model())
    samples = make_batch(batch, GROUP, adapter)
    materialize(samples[:1], adapter, BENCH_OUTPUTS, max_workers=1)  # warm-up: imports, first calls
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if kind == "naive":
        features = naive(samples, adapter, BENCH_OUTPUTS, workers)
    else:
        features = materialize(
            samples, adapter, BENCH_OUTPUTS, max_workers=workers, dedup=kind == "materialize-dedup"
        ).features
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pixels = features["pixel_values"]
    rows_per_image = pixels.shape[0] // len(features["image_grid_thw"])
    batch_pixel_bytes = pixels.nbytes // pixels.shape[0] * rows_per_image * batch  # one image per sample
    return {
        "before": before,
        "peak": peak,
        "pixel_bytes": batch_pixel_bytes,
        "output_bytes": pixels.nbytes,
        "shape": list(pixels.shape),
    }


def run_child(args: list[str]) -> dict:
    """Run this script with ``args`` in a fresh interpreter; return its JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--timing-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    parser.add_argument("--roots-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-roots", action="store_true", help="skip the S3 vs local rows")
    args = parser.parse_args()
    if args.timing_child:
        print(json.dumps(timing_child(args.repeat, args.profile)))
        return
    if args.roots_child:
        from _materialize_roots import roots_timing

        print(json.dumps(roots_timing(make_batch, BATCH, GROUP, args.repeat)))
        return
    if args.rss_child:
        kind, workers, batch = args.rss_child.split(",")
        print(json.dumps(rss_child(kind, int(workers), int(batch))))
        return

    from protocol.adapters import load_adapter

    print_facts(load_adapter(ensure_bench_model()).backend)
    print(f"\n[materialize] {BATCH} samples, groups of {GROUP}; {args.repeat} interleaved rounds", flush=True)
    t0 = time.monotonic()
    timing = run_child(
        ["--timing-child", "--repeat", str(args.repeat), *(["--profile"] if args.profile else [])]
    )
    print(f"[materialize] timing: {time.monotonic() - t0:.0f} s", flush=True)
    rss = {}
    for kind, workers, batch in (
        ("materialize", 2, BATCH),
        ("naive", 2, BATCH),
        ("materialize", 2, 2 * BATCH),
        ("materialize-dedup", 2, BATCH),
    ):
        rss[kind, batch] = run_child(["--rss-child", f"{kind},{workers},{batch}"])
        print(f"[materialize] RSS {kind} batch {batch}: done", flush=True)

    t = timing["times"]

    def med(name: str) -> float:
        return statistics.median(t[name])

    def med_phase(name: str, i: int) -> float:
        return statistics.median(x[i] for x in t[name])

    rows = [
        (name, f"{med(name):.3f}", " ".join(f"{x:.2f}" for x in t[name]))
        for name, kind, *_ in TIMED
        if not kind.startswith("phases")
    ]
    rows += [
        (
            f"{name} (process / collate)",
            f"{med_phase(name, 0):.3f} / {med_phase(name, 1):.3f}",
            " ".join(f"{p:.2f}/{c:.2f}" for p, c in t[name]),
        )
        for name, kind, *_ in TIMED
        if kind.startswith("phases")
    ]
    m = rss["materialize", BATCH]
    print_table(
        f"seconds per call, {BATCH}-sample batch, groups of {GROUP}: pixel_values {m['shape']} float32 = "
        f"{fmt_bytes(m['pixel_bytes'])} (torch intra-op threads {timing['torch_threads']} unless noted)",
        ("configuration", "median s", f"{args.repeat} interleaved runs s"),
        rows,
    )
    print_table(
        "peak RSS of a fresh process doing one call (getrusage ru_maxrss)",
        (
            "configuration",
            "batch",
            "peak RSS",
            "RSS before the call",
            "batch pixel bytes (one copy per sample)",
            "output pixel_values",
            "peak / batch pixel bytes",
        ),
        [
            (
                f"{kind}, 2 workers",
                batch,
                fmt_bytes(r["peak"]),
                fmt_bytes(r["before"]),
                fmt_bytes(r["pixel_bytes"]),
                fmt_bytes(r["output_bytes"]),
                f"{r['peak'] / r['pixel_bytes']:.2f}x",
            )
            for (kind, batch), r in rss.items()
        ],
    )

    dd = rss["materialize-dedup", BATCH]
    dd_ratio = dd["peak"] / dd["pixel_bytes"]
    unique2 = med("naive per-sample, 2 workers") / med("materialize(dedup=True), 2 workers")
    unique_workers = med("materialize(dedup=True), 1 worker") / med("materialize(dedup=True), 2 workers")
    dedup2 = med("naive per-sample, 2 workers") / med("materialize, 2 workers")
    dedup1 = med("naive per-sample, 1 worker") / med("materialize, 1 worker")
    workers = med("materialize, 1 worker") / med("materialize, 2 workers")
    workers_t1 = med("materialize, 1 worker") / med("materialize, 2 workers, torch threads 1")
    p1, c1 = med_phase("phases: materialize, 1 worker", 0), med_phase("phases: materialize, 1 worker", 1)
    p2, c2 = med_phase("phases: materialize, 2 workers", 0), med_phase("phases: materialize, 2 workers", 1)
    pn = med_phase("phases: naive, 2 workers", 0)
    ratio = m["peak"] / m["pixel_bytes"]
    big = rss["materialize", 2 * BATCH]
    big_ratio = big["peak"] / big["pixel_bytes"]
    print_table(
        "targets",
        ("measure", "value", "target", "verdict"),
        [
            ratio_row("dedup: naive / materialize, 2 workers each", dedup2, DEDUP_TARGET),
            ratio_row("dedup: naive / materialize, 1 worker each", dedup1, DEDUP_TARGET),
            ratio_row("dedup: naive / materialize(dedup=True), 2 workers each", unique2, DEDUP_TARGET),
            ("  processing phase only: naive / materialize, 2 workers", f"{pn / p2:.2f}x", "(info)", ""),
            ("  collate share of one materialize, 2 workers", f"{c2 / (p2 + c2) * 100:.0f}%", "(info)", ""),
            ratio_row("materialize 2 workers vs 1", workers, WORKERS_TARGET),
            ratio_row("materialize(dedup=True) 2 workers vs 1", unique_workers, WORKERS_TARGET),
            ("  2 workers with torch threads 1 vs 1 worker", f"{workers_t1:.2f}x", "(info)", ""),
            ("  processing phase only, 2 workers vs 1", f"{p1 / p2:.2f}x", "(info)", ""),
            ("  collate, 2 workers run vs 1 worker run (same op)", f"{c1 / c2:.2f}x", "(info)", ""),
            ratio_row(
                f"peak RSS / batch pixel bytes, batch {BATCH}",
                ratio,
                RSS_TARGET,
                higher_is_better=False,
                detail=f" ({fmt_bytes(m['peak'])} / {fmt_bytes(m['pixel_bytes'])})",
            ),
            ratio_row(
                f"peak RSS / batch pixel bytes, materialize(dedup=True), batch {BATCH}",
                dd_ratio,
                RSS_TARGET,
                higher_is_better=False,
                detail=f" ({fmt_bytes(dd['peak'])} / {fmt_bytes(dd['pixel_bytes'])})",
            ),
            (
                "  RSS growth during the call / pixel bytes",
                f"{(m['peak'] - m['before']) / m['pixel_bytes']:.2f}x",
                "(info)",
                "",
            ),
            ratio_row(
                f"  peak RSS / pixel bytes, batch {2 * BATCH}",
                big_ratio,
                RSS_TARGET,
                higher_is_better=False,
                detail=f" ({fmt_bytes(big['peak'])} / {fmt_bytes(big['pixel_bytes'])})",
            ),
        ],
    )
    if not args.no_roots:
        from _materialize_roots import roots_rows

        roots = run_child(["--roots-child", "--repeat", str(args.repeat)])
        rows, targets = roots_rows(roots, ratio_row)
        print_table(
            f"asset roots: one materialize of the batch (v2 refs, {roots['processed']} distinct images, "
            "2 workers), interleaved",
            ("source", "median s", f"{args.repeat} runs s", "x local"),
            rows,
        )
        print_table("targets: asset roots", ("measure", "value", "target", "verdict"), targets)
    if args.profile:
        print("\n### pyinstrument: one materialize, 2 workers\n")
        print(timing["profile"])


if __name__ == "__main__":
    main()
