"""The GPU benchmark script still runs: ``bench/packed_forward.py --tiny`` end to end on CPU.

CI never has a GPU, so this is what keeps the script that measures issue 8's GPU target from
rotting between GPU sessions. Only that it runs and reports every row is asserted; timings are
the script's own business (they are never asserted in tests).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ensure_tiny_model

ROOT = Path(__file__).resolve().parent.parent
ROWS = ("packed, cap 2048", "packed, cap 1024", "one sample per forward", "padded batches of 4")


@pytest.mark.timeout(300)
def test_packed_forward_bench_runs_on_cpu():
    ensure_tiny_model("qwen2_vl")
    proc = subprocess.run(
        [sys.executable, "bench/packed_forward.py", "--tiny", "--samples", "6"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    for name in ROWS:
        row = next((r for r in rows if r.startswith(f"| {name}")), None)
        assert row is not None, f"no row {name!r} in:\n{proc.stdout}"
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) >= 0 and float(cells[2].replace(",", "")) > 0  # seconds, tokens/s
    assert "| backend" in proc.stdout and "sdpa" in proc.stdout
