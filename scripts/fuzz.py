"""Long fuzzing run: the targets of tests/test_fuzz.py with many examples each (default 100k).

    .venv/bin/python scripts/fuzz.py [--examples 100000] [-k PATTERN]

Prints pytest's summary; exit status 0 means no input raised anything but the typed errors.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100_000, help="examples per target")
    parser.add_argument("-k", default="", help="pytest -k expression to select targets")
    args = parser.parse_args()
    env = {**os.environ, "MMREF_FUZZ_EXAMPLES": str(args.examples)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "0",
           "--durations", "0", str(REPO / "tests" / "test_fuzz.py")]  # fmt: skip
    if args.k:
        cmd += ["-k", args.k]
    raise SystemExit(subprocess.call(cmd, env=env, cwd=REPO))


if __name__ == "__main__":
    main()
