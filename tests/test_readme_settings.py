"""The README's serve command with bad settings (issue 49): the server stops, or warns, before vLLM
builds anything, with the variable's name: one line, no traceback.

Each case runs the README's CPU serve command as ``tests/test_readme.py`` does (this interpreter,
a free port) with its ``MODEL_DIR``/``OUTPUT_ROOT`` and one setting changed: a typo (a warning
naming the closest known variable; the server would go on), no asset root, a bad value, an
``s3://`` root on a plain-HTTP endpoint without ``MMREF_STORE_ALLOW_HTTP``. The check is
``vllm_plugin.preflight``, a ``vllm.general_plugins`` entry point vLLM calls while it builds its
argument parser: "within 10 s" is measured from the moment vLLM can run a plugin, i.e. beside the
time this interpreter takes to import vLLM's API server, measured in the same test (load average
1.4, 2 cores: the import 10.3 s, the warning 10.7 s and the refusals 10.9-13.3 s after the launch;
all of it twice as long with other jobs running).
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO
from test_readme import serve_command
from vllm_server import free_port

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

ENGINE_LINES = ("Initializing a V1 LLM engine", "Resolved architecture", "Starting vLLM API server")
"""Any of these in the log: vLLM went past the check (it builds its config or engine)."""

WITHIN_S = 10.0


def entry_point_installed() -> bool:
    return any(
        ep.name == "mmref" and ep.value == "vllm_plugin.preflight:check_settings"
        for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
    )


@pytest.fixture(scope="module")
def import_floor() -> float:
    """Seconds this interpreter takes to import vLLM's API server: no plugin can run earlier."""
    if not entry_point_installed():
        pytest.fail(
            "vllm_plugin.preflight is not registered under vllm.general_plugins: re-run "
            "`bash scripts/install.sh` (pip install -e . registers pyproject.toml's entry points)"
        )
    code = "import os, time, vllm.entrypoints.openai.api_server; print(time.time(), flush=True); os._exit(0)"
    start = time.time()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return float(out.stdout.split()[-1]) - start  # to the import's end: no interpreter shutdown


def launch(tmp_path: Path, qwen2_vl_dir: Path, env: dict[str, str], until: str | None = None):
    """The README's serve command with ``env`` on top; ``(seconds, exit status or None, log)``:
    to its exit, or (``until``) to the first log line holding ``until``, then stopped."""
    command = (
        serve_command()
        .replace(".venv/bin/python", sys.executable)
        .replace("--port 8000", f"--port {free_port()}")
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MMREF_", "AWS_ENDPOINT"))}
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    base.update(MODEL_DIR=str(qwen2_vl_dir), OUTPUT_ROOT=str(tmp_path), HF_HUB_OFFLINE="1", PYTHONPATH=path)
    base.update(env)
    log_path = tmp_path / "server.log"
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", "-c", command], cwd=REPO, env=base, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        while proc.poll() is None and time.monotonic() - start < 240:
            if until is not None and until in log_path.read_text(errors="replace"):
                break
            time.sleep(0.05)
        return time.monotonic() - start, proc.poll(), log_path.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def check_stopped(elapsed: float, status: int | None, log: str, floor: float, *needles: str) -> None:
    refusals = [line for line in log.splitlines() if "mmref refuses to start" in line]
    print(f"stopped after {elapsed:.1f} s (vLLM's import alone: {floor:.1f} s): {refusals}")
    assert status == 1, log[-3000:]
    assert len(refusals) == 1 and all(n in refusals[0] for n in needles), log[-3000:]
    assert "Traceback" not in log and "validation error" not in log, log[-3000:]
    assert not any(line in log for line in ENGINE_LINES), log[-3000:]
    assert elapsed - floor < WITHIN_S, (elapsed, floor)


def test_a_typo_is_a_warning_naming_the_closest_variable(tmp_path, qwen2_vl_dir, import_floor):
    warning = "MMREF_MAX_WORKER is not a setting of mmref and is ignored; did you mean MMREF_MAX_WORKERS?"
    elapsed, status, log = launch(tmp_path, qwen2_vl_dir, {"MMREF_MAX_WORKER": "4"}, until=warning)
    print(f"warned after {elapsed:.1f} s (vLLM's import alone: {import_floor:.1f} s)")
    assert status is None and warning in log, log[-3000:]  # warned, and still starting
    assert not any(line in log for line in ENGINE_LINES[:2]) and elapsed - import_floor < WITHIN_S


def test_no_asset_root_stops_the_server(tmp_path, qwen2_vl_dir, import_floor):
    """``OUTPUT_ROOT`` unset: the README's ``MMREF_ASSET_ROOT="$OUTPUT_ROOT"`` is empty, i.e. unset
    (it used to be the current folder)."""
    elapsed, status, log = launch(tmp_path, qwen2_vl_dir, {"OUTPUT_ROOT": ""})
    check_stopped(elapsed, status, log, import_floor, "MMREF_ASSET_ROOT / MMREF_ASSET_ROOTS: neither is set")


def test_a_bad_value_stops_the_server(tmp_path, qwen2_vl_dir, import_floor):
    elapsed, status, log = launch(tmp_path, qwen2_vl_dir, {"MMREF_MAX_WORKERS": "two"})
    check_stopped(elapsed, status, log, import_floor, "MMREF_MAX_WORKERS='two'", "an integer >= 1 and <= 64")


def test_an_http_object_store_without_the_flag_stops_the_server(tmp_path, qwen2_vl_dir, import_floor):
    env = {"MMREF_ASSET_ROOTS": "s3://bucket/mmref", "AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}
    elapsed, status, log = launch(tmp_path, qwen2_vl_dir, env)
    check_stopped(
        elapsed,
        status,
        log,
        import_floor,
        "MMREF_ASSET_ROOTS='s3://bucket/mmref'",
        "set MMREF_STORE_ALLOW_HTTP=1",
    )
