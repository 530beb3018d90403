"""``bench/materialize.py``'s roots section: the trainer's ``materialize`` reading from an S3 bucket
(moto's server on loopback, obstore's S3 client) through the node's read-through cache, warm,
beside the same batch from a local root (docs/SCALING.md §2, issue 28's trainer target <= 1.2x).

The batch is ``materialize.py``'s (64 samples in RL groups of 8, one 1024x768 photo per group) with
content-named (``mmraw:v2:``) refs; the same photos sit in a local root and in the bucket. Modes
run round by round, interleaved, in one process: ``materialize`` from the local root; from S3 with
the cache warm (filled by one call before timing: every read a cache hit); from S3 with no cache
(every distinct image one GET: reported, not targeted).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO

sys.path.insert(0, str(REPO / "tests"))

ROOTS_TARGET = 1.2
"""S3 with the cache warm / local root, one ``materialize`` of the batch."""


def roots_timing(make_batch, batch: int, group: int, repeat: int) -> dict:
    """Seconds per ``materialize`` call of each mode, ``repeat`` interleaved rounds after a warm-up.

    Args:
        make_batch: ``materialize.py``'s batch builder, ``(batch, group, adapter, refs) -> samples``.

    Returns:
        ``{"times": {mode: [s, ...]}, "processed": distinct images per call}``.
    """
    from _common import unique_photos
    from _models import ensure_bench_model

    from helpers import MotoS3
    from protocol.adapters import load_adapter
    from protocol.read_cache import ReadCache
    from protocol.roots import AssetRoots, LocalRoot, ObjectRoot, StoreClientConfig
    from trainer_lib.materialize import MaterializeOptions, materialize

    adapter = load_adapter(ensure_bench_model())
    tmp = Path(tempfile.mkdtemp(prefix="mmref-bench-mat-roots-"))
    moto = MotoS3(tmp / "moto.log")
    try:
        os.environ.update(moto.env())
        s3 = ObjectRoot(moto.make_bucket("mmref-bench-mat") + "/fleet", StoreClientConfig(allow_http=True))
        local = LocalRoot(tmp / "local")
        photos = unique_photos(batch // group)
        refs = [adapter.offload(p, s3, form="v2") for p in photos]
        for p in photos:
            adapter.offload(p, local, form="v2")
        samples = make_batch(batch, group, adapter, refs)
        modes = {
            "local root": AssetRoots([local]),
            "S3, read cache warm": AssetRoots([s3], cache=ReadCache(tmp / "cache", 1 << 30)),
            "S3, no cache (GET per image)": AssetRoots([s3]),
        }
        times: dict[str, list[float]] = {m: [] for m in modes}
        processed = 0
        for rnd in range(repeat + 1):  # round 0: warm-up, fills the cache
            for mode, source in modes.items():
                t0 = time.perf_counter()
                out = materialize(samples, adapter, source, MaterializeOptions(max_workers=2))
                if rnd:
                    times[mode].append(time.perf_counter() - t0)
                processed = out.stats.processed
                del out
        return {"times": times, "processed": processed}
    finally:
        moto.stop()


def roots_rows(result: dict, ratio_row) -> tuple[list, list]:
    """The section's table rows (mode, median s, runs, x local) and its targets rows."""
    t = result["times"]
    med = {m: statistics.median(v) for m, v in t.items()}
    local = med["local root"]
    rows = [
        (m, f"{med[m]:.3f}", " ".join(f"{x:.2f}" for x in v), f"{med[m] / local:.2f}x") for m, v in t.items()
    ]
    targets = [
        ratio_row(
            "materialize, S3 with the read cache warm / local root",
            med["S3, read cache warm"] / local,
            ROOTS_TARGET,
            higher_is_better=False,
        ),
        (
            "  materialize, S3 without cache / local root",
            f"{med['S3, no cache (GET per image)'] / local:.2f}x",
            "(info)",
            "",
        ),
    ]
    return rows, targets
