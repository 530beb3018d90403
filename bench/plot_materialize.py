"""Plot trainer ``materialize`` time vs batch size and duplication factor -> ``docs/materialize.png``.

Each point: one ``materialize(samples, adapter, root, MaterializeOptions(max_workers=2))`` of a
batch of real 1024x768 photos (real Qwen2-VL processor limits), where each distinct image is
shared by ``dup`` consecutive samples (``dup`` 1 = every sample its own image = what naive
per-sample processing costs; 8 = RL groups of 8). Median of ``--repeat`` interleaved rounds (each round
measures every point once: the shared machine's load drifts). The right panel splits one
64-sample materialize into its two phases: processing the distinct images, and collating one
``pixel_values`` row block per sample.

Usage: ``.venv/bin/python bench/plot_materialize.py [--repeat 3] [--out docs/materialize.png]``
(about 1 minute).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

from _common import (
    BENCH_OUTPUTS,
    REPO,
    bench_asset_root,
    load_average_text,
    print_facts,
    print_table,
    unique_photos,
)
from _models import ensure_bench_model

BATCHES = (8, 16, 32, 64)
DUPS = (1, 2, 4, 8)
WORKERS = 2


def batch_of(batch: int, dup: int, refs: list) -> list:
    from protocol.placeholders import expand_image_placeholders
    from protocol.structs import MMRefs, TrainingSample

    samples = []
    for i in range(batch):
        ref = refs[i // dup]
        ids = [*expand_image_placeholders([1, 2, 261, 3], [ref], 261), 10, 11, 12, 13]
        n = len(ids)
        samples.append(
            TrainingSample(
                input_ids=ids,
                loss_mask=[False] * (n - 4) + [True] * 4,
                advantages=[1.0] * n,
                inference_logprobs=[0.0] * n,
                mm_refs=MMRefs(items=[ref]),
            )
        )
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "materialize.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from protocol.adapters import load_adapter, offload_image
    from protocol.refs import parse_ref
    from protocol.store import AssetStore
    from trainer_lib.materialize import MaterializeOptions, materialize

    adapter = load_adapter(ensure_bench_model())
    print_facts(adapter.backend)
    refs = [offload_image(j, bench_asset_root(), adapter) for j in unique_photos(max(BATCHES))]
    materialize(batch_of(1, 1, refs), adapter, BENCH_OUTPUTS, MaterializeOptions(max_workers=1))  # warm-up

    # interleaved: each round measures every (batch, dup) once; the machine's load drifts
    runs: dict[tuple[int, int], list[float]] = {(b, d): [] for b in BATCHES for d in DUPS}
    runs_dedup: dict[tuple[int, int], list[float]] = {(b, d): [] for b in BATCHES for d in DUPS}
    for rnd in range(args.repeat):
        for batch in BATCHES:
            for dup in DUPS:
                samples = batch_of(batch, dup, refs)
                for dedup, sink in ((False, runs), (True, runs_dedup)):
                    t0 = time.perf_counter()
                    out = materialize(
                        samples, adapter, BENCH_OUTPUTS, MaterializeOptions(max_workers=WORKERS), dedup=dedup
                    )
                    sink[batch, dup].append(time.perf_counter() - t0)
                    del out
                    gc.collect()
        print(f"[plot] round {rnd + 1}/{args.repeat} done", flush=True)
    times = {key: statistics.median(v) for key, v in runs.items()}
    times_dedup = {key: statistics.median(v) for key, v in runs_dedup.items()}

    # phases of a 64-sample materialize: distinct images processed on the pool, then collate
    from concurrent.futures import ThreadPoolExecutor

    store = AssetStore(BENCH_OUTPUTS)
    phases = {}
    for dup in DUPS:
        samples = batch_of(max(BATCHES), dup, refs)
        unique = list(dict.fromkeys(s.mm_refs.items[0].ref for s in samples))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(WORKERS) as pool:
            results = list(pool.map(lambda r: adapter.resolve_raw(parse_ref(r), store, ref=r), unique))
        t_process = time.perf_counter() - t0
        by_ref = dict(zip(unique, results, strict=True))
        t0 = time.perf_counter()
        out = adapter.collate([by_ref[s.mm_refs.items[0].ref] for s in samples])
        t_collate = time.perf_counter() - t0
        phases[dup] = (t_process, t_collate)
        del out, results, by_ref
        gc.collect()

    print_table(
        f"materialize seconds (max_workers={WORKERS}), rows: batch size, columns: samples per image",
        ("batch", *(f"dup {d}" for d in DUPS), "dup 1 / dup 8"),
        [(b, *(f"{times[b, d]:.3f}" for d in DUPS), f"{times[b, 1] / times[b, 8]:.2f}x") for b in BATCHES],
    )
    print_table(
        f"materialize(dedup=True) seconds (max_workers={WORKERS})",
        ("batch", *(f"dup {d}" for d in DUPS), "dup 1 / dup 8"),
        [
            (b, *(f"{times_dedup[b, d]:.3f}" for d in DUPS), f"{times_dedup[b, 1] / times_dedup[b, 8]:.2f}x")
            for b in BATCHES
        ],
    )
    print_table(
        f"phases of one {max(BATCHES)}-sample materialize (s)",
        ("dup", "process distinct images", "collate", "collate share"),
        [(d, f"{p:.3f}", f"{c:.3f}", f"{c / (p + c) * 100:.0f}%") for d, (p, c) in phases.items()],
    )

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5), dpi=110)
    for k, dup in enumerate(DUPS):
        color = f"C{k}"
        ax1.plot(
            BATCHES,
            [times[b, dup] for b in BATCHES],
            marker="o",
            linewidth=2,
            color=color,
            label=f"{dup} sample{'s' if dup > 1 else ''} per image",
        )
        ax1.plot(
            BATCHES,
            [times_dedup[b, dup] for b in BATCHES],
            marker="s",
            linewidth=1.5,
            linestyle="--",
            color=color,
            label=f"{dup} per image, dedup=True",
        )
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(BATCHES, [str(b) for b in BATCHES])
    ax1.set_xlabel("batch size (samples, one 1024x768 photo each)")
    ax1.set_ylabel("materialize time (s)")
    ax1.set_title(f"trainer materialize, max_workers={WORKERS}")
    ax1.grid(True, alpha=0.3)
    ax1.legend(title="duplication")
    labels = [f"{d}" for d in DUPS]
    proc = [phases[d][0] for d in DUPS]
    coll = [phases[d][1] for d in DUPS]
    ax2.bar(labels, proc, label="process distinct images", color="#4c72b0")
    ax2.bar(labels, coll, bottom=proc, label="collate (torch.cat, one block per sample)", color="#dd8452")
    for i, (p, c) in enumerate(zip(proc, coll, strict=True)):
        ax2.text(i, p + c, f"{p + c:.2f} s", ha="center", va="bottom")
    ax2.set_xlabel("samples per image")
    ax2.set_ylabel("seconds")
    ax2.set_title(f"one {max(BATCHES)}-sample batch: where the time goes")
    ax2.legend(loc="upper right")
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(
        "Qwen2-VL real limits: 1024x768 -> grid [1,54,74], 3996x1176 float32 per sample "
        f"(load avg {load_average_text()})",
        fontsize=10,
    )
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
