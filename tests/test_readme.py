"""README.md's "Using it" runs as written: its CPU serve command starts the tiny server, and every
```python block, in order and as one script, runs against it.

The serve command is the README's fenced ```bash block that starts ``vllm.entrypoints.openai.api_server``,
run by bash with two substitutions only: this interpreter for ``.venv/bin/python`` and a free port
for ``--port 8000`` (the README's ``MODEL_DIR`` and ``OUTPUT_ROOT`` come from the environment, as
the README says). The Python blocks read ``MMREF_URL``, ``MODEL_DIR`` and ``OUTPUT_ROOT``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from helpers import REPO
from vllm_server import free_port

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

README = (REPO / "README.md").read_text()
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(README) if kind == lang]


def serve_command() -> str:
    (command,) = [b for b in blocks("bash") if "vllm.entrypoints.openai.api_server" in b]
    return command


def test_readme_keeps_exactly_two_top_level_commands():
    section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    commands = [line.strip() for line in section.splitlines() if line.startswith("    ") and line.strip()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]


def test_serve_command_is_the_cpu_one_with_its_settings():
    command = serve_command()
    for needed in ("VLLM_PLUGINS=mmref", "VLLM_CPU_KVCACHE_SPACE=1", "--dtype float32", "--port 8000",
                   ".venv/bin/python", '"$MODEL_DIR"', '"$OUTPUT_ROOT"', "processed_logprobs"):  # fmt: skip
        assert needed in command, needed


@pytest.fixture(scope="module")
def readme_server(qwen2_vl_dir, tmp_path_factory):
    """The README's serve command, started as written (see the module doc); its URL and output root."""
    out = tmp_path_factory.mktemp("readme")
    output_root = out / "outputs"
    output_root.mkdir()
    port = free_port()
    command = (
        serve_command().replace(".venv/bin/python", sys.executable).replace("--port 8000", f"--port {port}")
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env.update(MODEL_DIR=str(qwen2_vl_dir), OUTPUT_ROOT=str(output_root), HF_HUB_OFFLINE="1")
    log_path = out / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline, t0 = time.monotonic() + 600, time.monotonic()
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"the README's serve command exited {proc.returncode}:\n{log_path.read_text()[-4000:]}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"not healthy after 600 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        print(f"README serve command healthy after {time.monotonic() - t0:.0f} s")
        yield url, output_root, log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def test_every_python_block_runs_against_the_served_model(readme_server, qwen2_vl_dir, tmp_path):
    url, output_root, log_path = readme_server
    log = log_path.read_text()
    assert "Loaded endpoint plugin mmref" in log and "mmref: serving refs for qwen2_vl" in log
    assert "dtype=torch.float32" in log  # --dtype float32 took
    (logged,) = {int(n) for n in re.findall(r"body limit (\d+) bytes", log)}
    (stated,) = re.findall(r"; ([\d.]+) MB for the tiny test model", README.replace("\n", " "))
    assert f"{logged / 1e6:.1f}" == stated, (logged, stated)  # the README's figure is what the server logs
    python = blocks("python")
    assert len(python) >= 5
    script = "".join(
        f"print('--- README block {i + 1}', flush=True)\n{body}\n" for i, body in enumerate(python)
    )
    path = tmp_path / "readme_blocks.py"
    path.write_text(script)
    env = {**os.environ, "MMREF_URL": url, "MODEL_DIR": str(qwen2_vl_dir), "OUTPUT_ROOT": str(output_root),
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}  # fmt: skip
    run = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    assert f"--- README block {len(python)}" in run.stdout
    print(run.stdout[-3000:])  # with -s: what the README's prints show
