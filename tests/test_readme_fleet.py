"""README "Try the fleet on one machine" as written (issue 49): ``scripts/fleet_local.sh`` starts
moto's S3 server and the bucket, two replicas on one ``s3://`` root and vllm-router with the
README's Fleet flags; the section's Python block (the rollout client through the router, v2 refs
into the bucket, the trainer reading the bucket) runs against it with ``fleet-logs/env.sh``'s
variables; SIGTERM stops every process the script started.

Substitutions, as in ``tests/test_readme.py``: the script's own knobs (free ports, a fresh bucket,
a temporary log folder) and ``MODEL_DIR`` the tiny model. The router's flags are the README's
(``tests/test_fleet.py`` checks the script's equal them).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from fleet_helpers import ROUTER_FLAGS
from helpers import REPO
from test_readme import README
from vllm_server import free_port

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

SCRIPT = REPO / "scripts" / "fleet_local.sh"


def test_the_script_runs_the_readme_router_flags():
    flags = " ".join(ROUTER_FLAGS).replace("--policy consistent_hash ", "")
    assert flags in " ".join(SCRIPT.read_text().replace("\\\n", " ").split())
    assert "MODEL_DIR=.cache/tiny_models/qwen2_vl bash scripts/fleet_local.sh" in README


def fleet_block() -> str:
    (block,) = re.findall(r"^```python fleet\n(.*?)^```$", README, re.S | re.M)
    return block


def test_try_the_fleet_on_one_machine(tmp_path, qwen2_vl_dir):
    logs = tmp_path / "fleet-logs"
    ports = {"S3_PORT": free_port(), "ROUTER_PORT": free_port(), "PROMETHEUS_PORT": free_port()}
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MMREF_", "AWS_"))},
           **{k: str(v) for k, v in ports.items()}, "REPLICA_PORTS": f"{free_port()} {free_port()}",
           "BUCKET": f"fleet-{uuid.uuid4().hex[:8]}", "LOGS": str(logs), "MODEL_DIR": str(qwen2_vl_dir),
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    out = tmp_path / "script.out"
    start = time.monotonic()
    with open(out, "wb") as sink:
        script = subprocess.Popen(
            ["bash", str(SCRIPT)], cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    started: list[psutil.Process] = []
    try:
        while "fleet up" not in out.read_text():
            assert script.poll() is None, out.read_text() + "".join(
                p.read_text()[-2000:] for p in logs.glob("*.log")
            )
            assert time.monotonic() - start < 900, "the fleet did not come up in 900 s"
            time.sleep(1)
        up = time.monotonic() - start
        started = psutil.Process(script.pid).children(recursive=True)
        variables = dict(re.findall(r"(\w+)=(\S+)", (logs / "env.sh").read_text()))
        assert variables["MMREF_STORE_ALLOW_HTTP"] == "1" and variables["FLEET_ROOT"].startswith(
            "s3://fleet-"
        )
        block = tmp_path / "fleet_block.py"
        block.write_text(fleet_block())
        run_env = {**os.environ, **variables, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
        t0 = time.monotonic()
        run = subprocess.run([sys.executable, str(block)], cwd=tmp_path, env=run_env, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
        print(
            f"fleet up after {up:.0f} s; the README block ran in {time.monotonic() - t0:.0f} s:\n{run.stdout}"
        )
        assert "mmraw:v2:" in run.stdout and "is not a setting" not in run.stderr
    finally:
        script.send_signal(signal.SIGTERM)
        try:
            script.wait(90)
        finally:  # vLLM's resource trackers end once their parents are gone: give them moments
            _, alive = psutil.wait_procs(started, timeout=30)
            for p in alive:
                p.kill()
    assert not alive, f"processes of the script still running after it stopped: {[p.pid for p in alive]}"
