"""What resolving an image through an object store costs beside a local root (docs/SCALING.md).

Real photos at 1024x768 (JPEG q90, distinct bytes) are stored twice: in a local asset root and
in an S3 bucket served by moto's standalone server on loopback (its own process; obstore's real
S3 client, signed requests). Side by side in one run, interleaved image by image so the shared
machine's load falls on every mode alike, medians per image:

- **read** (``AssetRoots.read_image``: bytes read and the full sha256 check, the part the store
  changes): a local root; S3 with the node's read-through cache warm (a hit: the cache file read
  and re-hashed, the store untouched); S3 with no cache (a miss: one GET on loopback);
- **resolve** (``ImageAdapter.resolve_raw`` with the real-size bench model: read, decode, HF
  processor, grid check; what the server and the trainer's ``materialize`` run per distinct
  image): local root vs S3 with the cache warm, and S3 cold;
- S3 misses from 4 threads (the store's request rate one resolver pool sees, loopback).

Targets (issue 28): read, cache hit <= 1.1x local; resolve, cache warm <= 1.2x local. Misses are
reported, not targeted: on loopback they measure the client and moto, not a network.

Usage: ``.venv/bin/python bench/store.py [--images 16] [--repeat 5] [--resolve-images 6]``
(needs the ``fleet`` and ``dev`` extras: obstore, moto).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import REPO, fmt_bytes, fmt_ms, print_facts, print_table, ratio_row, unique_photos

sys.path.insert(0, str(REPO / "tests"))

READ_HIT_TARGET = 1.1
RESOLVE_WARM_TARGET = 1.2


def interleaved(modes: dict, refs: list, repeat: int) -> dict[str, list[float]]:
    """Seconds per call of each mode, image by image and mode by mode in turn (one warm-up pass)."""
    out: dict[str, list[float]] = {m: [] for m in modes}
    for rnd in range(repeat + 1):
        for ref in refs:
            for mode, fn in modes.items():
                t0 = time.perf_counter()
                fn(ref)
                if rnd:
                    out[mode].append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16, help="distinct photos in the read rows")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--resolve-images", type=int, default=6, help="photos in the resolve rows (0: skip)")
    args = parser.parse_args()
    print_facts()

    from helpers import MotoS3
    from protocol.read_cache import ReadCache
    from protocol.refs import ContentRef
    from protocol.roots import AssetRoots, LocalRoot, ObjectRoot, StoreClientConfig, put_content
    from protocol.store import AssetStore

    tmp = Path(tempfile.mkdtemp(prefix="mmref-bench-store-"))
    moto = MotoS3(tmp / "moto.log")
    try:
        os.environ.update(moto.env())
        url = moto.make_bucket("mmref-bench") + "/fleet"
        client = StoreClientConfig(allow_http=True)
        s3 = ObjectRoot(url, client)
        local = LocalRoot(tmp / "local")
        photos = unique_photos(max(args.images, args.resolve_images))
        refs = []
        for data in photos:
            stored = put_content(AssetStore(local.store.root), data)
            put_content(s3, data)
            refs.append(ContentRef(sha256=stored.sha256, ext=stored.ext, family="qwen2_vl", grid=(1, 54, 74)))
        cache = ReadCache(tmp / "cache", 1 << 30)
        local_roots = AssetRoots([local])
        warm = AssetRoots([s3], cache=cache)
        cold = AssetRoots([s3])
        for ref in refs:
            warm.read_image(ref)  # fill the cache
        mean_bytes = statistics.mean(len(p) for p in photos[: args.images])

        reads = interleaved(
            {
                "local root": local_roots.read_image,
                "S3, cache hit": warm.read_image,
                "S3, miss (GET)": cold.read_image,
            },
            refs[: args.images],
            args.repeat,
        )
        med = {m: statistics.median(v) for m, v in reads.items()}
        n = args.images * args.repeat
        print_table(
            f"read: bytes + sha256, {args.images} photos 1024x768 (mean {fmt_bytes(mean_bytes)}), {n} reads",
            ("mode", "median", "p90", "MB/s", "x local"),
            [
                (
                    m,
                    fmt_ms(med[m]),
                    fmt_ms(sorted(v)[int(0.9 * (len(v) - 1))]),
                    f"{mean_bytes / med[m] / 1e6:.0f}",
                    f"{med[m] / med['local root']:.2f}x",
                )
                for m, v in reads.items()
            ],
        )
        hit, miss = (med[m] / med["local root"] for m in ("S3, cache hit", "S3, miss (GET)"))
        targets = [
            ratio_row("read, S3 cache hit / local", hit, READ_HIT_TARGET, higher_is_better=False),
            ("read, S3 miss / local (reported)", f"{miss:.2f}x", "-", "-"),
        ]

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(cold.read_image, refs[: args.images]))
            t0 = time.perf_counter()
            for _ in range(args.repeat):
                list(pool.map(cold.read_image, refs[: args.images]))
            rate = n / (time.perf_counter() - t0)
        print_table(
            "S3 misses from 4 threads (loopback moto: client and server on one shared machine)",
            ("measure", "value"),
            [("GETs/s", f"{rate:.0f}"), ("MB/s", f"{rate * mean_bytes / 1e6:.0f}")],
        )

        if args.resolve_images:
            from _models import ensure_bench_model

            from protocol.adapters import load_adapter

            adapter = load_adapter(ensure_bench_model())
            some = refs[: args.resolve_images]
            resolves = interleaved(
                {
                    "local root": lambda r: adapter.resolve_raw(r, local_roots),
                    "S3, cache warm": lambda r: adapter.resolve_raw(r, warm),
                    "S3, cold (GET)": lambda r: adapter.resolve_raw(r, cold),
                },
                some,
                max(2, args.repeat // 2),
            )
            rmed = {m: statistics.median(v) for m, v in resolves.items()}
            print_table(
                f"resolve_raw: read + decode + processor, {len(some)} photos, grid [1, 54, 74]",
                ("mode", "median", "x local"),
                [(m, fmt_ms(rmed[m]), f"{rmed[m] / rmed['local root']:.2f}x") for m in resolves],
            )
            warm_x, cold_x = (rmed[m] / rmed["local root"] for m in ("S3, cache warm", "S3, cold (GET)"))
            targets += [
                ratio_row(
                    "resolve, S3 cache warm / local", warm_x, RESOLVE_WARM_TARGET, higher_is_better=False
                ),
                ("resolve, S3 cold / local (reported)", f"{cold_x:.2f}x", "-", "-"),
            ]
        print_table("targets", ("measure", "value", "target", "verdict"), targets)
    finally:
        moto.stop()


if __name__ == "__main__":
    main()
