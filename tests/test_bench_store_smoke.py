"""``bench/store.py`` still runs: moto on loopback, every read mode and the targets table (a tiny run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="obstore needs Python >= 3.11")


def test_store_bench_prints_every_mode_and_the_targets():
    out = subprocess.run(
        [sys.executable, "bench/store.py", "--images", "2", "--repeat", "1", "--resolve-images", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for line in (
        "| local root",
        "| S3, cache hit",
        "| S3, miss (GET)",
        "GETs/s",
        "read, S3 cache hit / local",
    ):
        assert line in out.stdout
