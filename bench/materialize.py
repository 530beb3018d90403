"""Trainer ``materialize``: the default (dedup) and the per-slot layout vs naive per-sample
processing, 2 workers vs 1, peak RSS, and reading from S3 vs a local root.

A 64-sample RL batch in groups of 8 (each group shares one real photo, 1024x768 JPEG, real
Qwen2-VL processor limits: grid [1,54,74], 3996 patches x 1176 float32 per image slot):

- ``materialize(samples, adapter, root, MaterializeOptions(max_workers=W))``, the default: each
  distinct ref read and processed once, each distinct image's pixels once plus ``image_index``
  (what every trainer path runs since issue 29); ``materialize(..., dedup=False)``: one copy per
  image slot, the layout a forward without precomputed image embeddings needs; naive per-sample
  processing: the same ``adapter.resolve_raw`` for every sample, on the same pool size, then one
  collate per slot.
  Target: the default >= 7x naive.
- ``materialize`` with 2 workers vs 1 (the machine has 2 cores). Target >= 1.7x.
- peak RSS of a fresh process running one ``materialize`` of the batch, from the OS
  (``getrusage(RUSAGE_SELF).ru_maxrss``), vs the batch's pixel bytes (one copy per sample, what
  the per-slot ``pixel_values`` holds). Target: the default <= 1.0x.
- the same batch with content-named refs from an S3 bucket (moto on loopback) through the node's
  read cache, warm, vs a local root (``_materialize_roots.py``). Target <= 1.2x.

The machine is shared with other developers' jobs, so timings drift by tens of percent within
minutes: every timed configuration runs in ONE process, interleaved round by round (each round
runs each configuration once), and the median per configuration is reported. Processing on the
pool and a collate after it (of the distinct images, or of one block per slot) are timed apart by
a replica of those two steps, interleaved the same way (the default itself writes each distinct
image into the collated features on the pool as it is processed, ``trainer_lib.collate``). Peak
RSS is measured in a fresh process per configuration, running one call.

Usage: ``.venv/bin/python bench/materialize.py [--repeat 5] [--profile] [--no-roots]`` (about 3 minutes).
``--profile`` adds a pyinstrument profile of one ``materialize`` (2 workers).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
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
RSS_TARGET = 1.0
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

DEFAULT, PER_SLOT, NAIVE = (
    "materialize (default: dedup)",
    "materialize(dedup=False), per slot",
    "naive per-sample",
)
TIMED = (
    # name, kind, workers, torch intra-op threads (None = default)
    (f"{DEFAULT}, 1 worker", "default", 1, None),
    (f"{DEFAULT}, 2 workers", "default", 2, None),
    (f"{DEFAULT}, 2 workers, torch threads 1", "default", 2, 1),
    (f"{PER_SLOT}, 1 worker", "per-slot", 1, None),
    (f"{PER_SLOT}, 2 workers", "per-slot", 2, None),
    (f"{NAIVE}, 1 worker", "naive", 1, None),
    (f"{NAIVE}, 2 workers", "naive", 2, None),
    ("phases: default, 2 workers", "phases-dedup", 2, None),
    ("phases: per slot, 2 workers", "phases-slot", 2, None),
    ("phases: naive, 2 workers", "phases-naive", 2, None),
)


def timing_child(repeat: int, profile: bool) -> dict:
    import torch

    from protocol.adapters import load_adapter
    from trainer_lib.materialize import MaterializeOptions, materialize

    adapter = load_adapter(ensure_bench_model())
    samples = make_batch(BATCH, GROUP, adapter)
    pad = adapter.placeholder_token_id(_hf_config())
    default_threads = torch.get_num_threads()
    materialize(samples[:1], adapter, BENCH_OUTPUTS, MaterializeOptions(max_workers=1))  # warm-up
    times: dict[str, list] = {name: [] for name, *_ in TIMED}
    for _ in range(repeat):
        for name, kind, workers, threads in TIMED:
            torch.set_num_threads(threads or default_threads)
            if kind.startswith("phases"):
                times[name].append(phases(samples, adapter, workers, kind.removeprefix("phases-")))
                continue
            t0 = time.perf_counter()
            if kind == "naive":
                out = naive(samples, adapter, BENCH_OUTPUTS, workers)
            else:
                out = materialize(
                    samples,
                    adapter,
                    BENCH_OUTPUTS,
                    MaterializeOptions(max_workers=workers, placeholder_token_id=pad),
                    dedup=kind == "default",
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
            materialize(samples, adapter, BENCH_OUTPUTS, MaterializeOptions(max_workers=2))
        result["profile"] = profiler.output_text(unicode=False, color=False)
    return result


def phases(samples: list, adapter, workers: int, layout: str) -> tuple[float, float]:
    """(process s, collate s): processing on the pool (distinct refs, or one per sample for
    ``naive``), then the collate (the distinct images for ``dedup``, one block per slot else)."""
    from concurrent.futures import ThreadPoolExecutor

    from protocol.refs import parse_ref
    from protocol.store import AssetStore

    store = AssetStore(BENCH_OUTPUTS)
    slots = [s.mm_refs.items[0].ref for s in samples]
    todo = slots if layout == "naive" else list(dict.fromkeys(slots))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda r: adapter.resolve_raw(parse_ref(r), store, ref=r), todo))
    t_process = time.perf_counter() - t0
    by_ref = dict(zip(todo, results, strict=True))
    items = results if layout != "slot" else [by_ref[r] for r in slots]
    t0 = time.perf_counter()
    out = adapter.collate(items)
    t_collate = time.perf_counter() - t0
    del out, items, results, by_ref
    gc.collect()
    return t_process, t_collate


# --- peak RSS: a fresh process per configuration, one call ----------------------------------------


def rss_child(kind: str, workers: int, batch: int) -> dict:
    from protocol.adapters import load_adapter
    from trainer_lib.materialize import MaterializeOptions, materialize

    adapter = load_adapter(ensure_bench_model())
    samples = make_batch(batch, GROUP, adapter)
    # warm-up: imports, first calls
    materialize(samples[:1], adapter, BENCH_OUTPUTS, MaterializeOptions(max_workers=1))
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if kind == "naive":
        features = naive(samples, adapter, BENCH_OUTPUTS, workers)
    else:
        features = materialize(
            samples, adapter, BENCH_OUTPUTS, MaterializeOptions(max_workers=workers), dedup=kind == "default"
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


# --- report -----------------------------------------------------------------------------------------

RSS_RUNS = (("default", BATCH), ("per-slot", BATCH), ("naive", BATCH), ("default", 2 * BATCH))


def report_tables(timing: dict, rss: dict, repeat: int) -> None:
    """The seconds and peak-RSS tables."""
    t = timing["times"]
    rows = [
        (name, f"{statistics.median(t[name]):.3f}", " ".join(f"{x:.2f}" for x in t[name]))
        for name, kind, *_ in TIMED
        if not kind.startswith("phases")
    ]
    rows += [
        (
            f"{name} (process / collate)",
            " / ".join(f"{statistics.median(x[i] for x in t[name]):.3f}" for i in (0, 1)),
            " ".join(f"{p:.2f}/{c:.2f}" for p, c in t[name]),
        )
        for name, kind, *_ in TIMED
        if kind.startswith("phases")
    ]
    m = rss["per-slot", BATCH]
    print_table(
        f"seconds per call, {BATCH}-sample batch, groups of {GROUP}: per-slot pixel_values "
        f"{m['shape']} float32 = {fmt_bytes(m['pixel_bytes'])} (torch threads {timing['torch_threads']})",
        ("configuration", "median s", f"{repeat} interleaved runs s"),
        rows,
    )
    header = (
        "configuration",
        "batch",
        "peak RSS",
        "RSS before the call",
        "batch pixel bytes (one copy per sample)",
    )
    print_table(
        "peak RSS of a fresh process doing one call (getrusage ru_maxrss)",
        (*header, "output pixel_values", "peak / batch pixel bytes"),
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


def target_rows(timing: dict, rss: dict) -> list:
    """The targets table: the default path against naive and the per-slot layout, side by side."""
    t = timing["times"]

    def med(name: str) -> float:
        return statistics.median(t[name])

    def phase(name: str, i: int) -> float:
        return statistics.median(x[i] for x in t[name])

    def rss_row(label: str, key: tuple, target: float | None) -> tuple:
        r = rss[key]
        value, detail = (
            r["peak"] / r["pixel_bytes"],
            f" ({fmt_bytes(r['peak'])} / {fmt_bytes(r['pixel_bytes'])})",
        )
        if target is None:
            return (label, f"{value:.2f}x{detail}", "(info)", "")
        return ratio_row(label, value, target, higher_is_better=False, detail=detail)

    def info(label: str, value: str) -> tuple:
        return (label, value, "(info)", "")

    p2, c2 = phase("phases: default, 2 workers", 0), phase("phases: default, 2 workers", 1)
    ps, cs = phase("phases: per slot, 2 workers", 0), phase("phases: per slot, 2 workers", 1)
    naive2, naive1 = med(f"{NAIVE}, 2 workers"), med(f"{NAIVE}, 1 worker")
    d1, d2, d2t1 = (med(f"{DEFAULT}, {w}") for w in ("1 worker", "2 workers", "2 workers, torch threads 1"))
    return [
        ratio_row("default (dedup): naive / materialize, 2 workers each", naive2 / d2, DEDUP_TARGET),
        ratio_row("default (dedup): naive / materialize, 1 worker each", naive1 / d1, DEDUP_TARGET),
        info(
            "  per slot: naive / materialize(dedup=False), 2 workers",
            f"{naive2 / med(PER_SLOT + ', 2 workers'):.2f}x",
        ),
        info(
            "  collate share, process then collate: distinct images / per slot",
            f"{c2 / (p2 + c2):.0%} / {cs / (ps + cs):.0%}",
        ),
        ratio_row("default, 2 workers vs 1", d1 / d2, WORKERS_TARGET),
        info("  2 workers with torch threads 1 vs 1 worker", f"{d1 / d2t1:.2f}x"),
        rss_row(f"peak RSS / batch pixel bytes, default, batch {BATCH}", ("default", BATCH), RSS_TARGET),
        rss_row(f"  peak RSS / pixel bytes, default, batch {2 * BATCH}", ("default", 2 * BATCH), RSS_TARGET),
        rss_row(f"  peak RSS / batch pixel bytes, per slot, batch {BATCH}", ("per-slot", BATCH), None),
        rss_row(f"  peak RSS / batch pixel bytes, naive, batch {BATCH}", ("naive", BATCH), None),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--timing-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    parser.add_argument("--roots-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-roots", action="store_true", help="skip the S3 vs local rows")
    args = parser.parse_args()
    if args.profile and importlib.util.find_spec("pyinstrument") is None:
        parser.error("--profile needs pyinstrument, the bench extra: bash scripts/install.sh bench")
    if args.timing_child:
        print(json.dumps(timing_child(args.repeat, args.profile)))
        return
    if args.rss_child:
        kind, workers, batch = args.rss_child.split(",")
        print(json.dumps(rss_child(kind, int(workers), int(batch))))
        return
    if args.roots_child:
        from _materialize_roots import roots_timing

        print(json.dumps(roots_timing(make_batch, BATCH, GROUP, args.repeat)))
        return

    from protocol.adapters import load_adapter

    print_facts(load_adapter(ensure_bench_model()).backend)
    print(f"\n[materialize] {BATCH} samples, groups of {GROUP}; {args.repeat} interleaved rounds", flush=True)
    t0 = time.monotonic()
    timing = run_child(
        ["--timing-child", "--repeat", str(args.repeat), *(["--profile"] if args.profile else [])]
    )
    print(f"[materialize] timing: {time.monotonic() - t0:.0f} s", flush=True)
    rss = {(kind, batch): run_child(["--rss-child", f"{kind},2,{batch}"]) for kind, batch in RSS_RUNS}
    report_tables(timing, rss, args.repeat)
    print_table("targets", ("measure", "value", "target", "verdict"), target_rows(timing, rss))
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
