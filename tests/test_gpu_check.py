"""``scripts/gpu_check.sh`` stays runnable between GPU sessions (CI has no GPU; a lent machine's
minutes are few): it parses, every repository file it names exists, every pytest file it runs
has ``@pytest.mark.gpu`` tests, and every option it passes a bench is one the bench's argparse
declares.
What its steps measure is the benches' own business (``tests/test_bench_smoke.py`` runs them on CPU).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_gpu_check_parses_and_names_only_what_exists():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    paths = set(re.findall(r"\b((?:bench|tests|scripts)/[\w./-]+\.(?:py|sh))", code))
    assert {"bench/packed_forward.py", "tests/test_logprob_head.py"} <= paths, paths
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, missing
    for test in sorted(p for p in paths if p.startswith("tests/")):
        assert "@pytest.mark.gpu" in (ROOT / test).read_text(), f"{test} has no GPU test"


def test_the_options_gpu_check_passes_are_taken_by_its_benches():
    code = "\n".join(line for line in SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#"))
    ts_args = set(re.findall(r"(--[\w-]+)", code.split("ts_args=(", 1)[1].split("fi", 1)[0]))
    wanted: dict[str, set[str]] = {}
    for bench, options in re.findall(r'"\$PY" (bench/\w+\.py)([^\n]*)', code):
        flags = wanted.setdefault(bench, set())
        flags |= set(re.findall(r"(--[\w-]+)", options))
        flags |= {"--tiny"} if '"$@"' in options else set()  # the script's own arguments: --tiny on CPU
        flags |= ts_args if "ts_args" in options else set()
    assert "bench/packed_forward.py" in wanted, wanted
    for bench, flags in sorted(wanted.items()):  # read from the source: no import of torch per bench
        taken = set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", (ROOT / bench).read_text()))
        assert flags <= taken, f"{bench} takes no {sorted(flags - taken)}"
