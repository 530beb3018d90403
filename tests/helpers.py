"""Shared test helpers: tiny models, real photos (scikit-image), the vLLM server launcher."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from make_tiny_models import ensure_tiny_model  # noqa: E402
from vllm_server import VLLMServer, start_server  # noqa: E402

if TYPE_CHECKING:
    from protocol.structs import TrainingSample

SERVER_CACHE_BUDGET = 8 << 20
"""Resolve-cache budget of the test server: small, so the suite exercises eviction."""
SERVER_ARGS = ("--enable-scale-out", "--logprobs-mode", "processed_logprobs")
"""Flags of the session plugin server (and of the stock server it is compared with).

``--enable-scale-out`` also turns on vLLM's own render route, the oracle of the tests;
``--logprobs-mode processed_logprobs``: logprobs of the sampling distribution (after temperature),
what RL importance ratios need and what the e2e test recomputes."""

__all__ = [
    "REPO",
    "SERVER_ARGS",
    "SERVER_CACHE_BUDGET",
    "VLLMServer",
    "ensure_tiny_model",
    "jittered_weights",
    "photo_array",
    "photo_bytes",
    "refusal",
    "rollout_sample",
    "server_mismatch",
    "start_server",
    "warm_up",
]


def photo_array(name: str) -> np.ndarray:
    """A real photo shipped by scikit-image, as an RGB uint8 array."""
    import skimage.data

    image = getattr(skimage.data, name)()
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    return image[..., :3]


def photo_bytes(name: str, fmt: str = "JPEG", size: tuple[int, int] | None = None) -> bytes:
    """A scikit-image photo encoded as ``fmt`` (optionally resized to ``size`` = (w, h))."""
    image = Image.fromarray(photo_array(name))
    if size is not None:
        image = image.resize(size, Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def refusal(response) -> tuple[int, str | None]:
    """``(HTTP status, mmref_code)`` of an error answer of the generate route.

    Checks what every error body must be: vLLM's ``ErrorResponse`` (parsed with vLLM's own model,
    integer ``code`` equal to the status), no traceback, no object address. ``mmref_code`` is None
    for stock vLLM's own refusals, the stable string code for the plugin's.
    """
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    text = response.text
    assert "Traceback" not in text and 'File "' not in text and " at 0x" not in text, text[:300]
    parsed = ErrorResponse.model_validate_json(text)
    assert parsed.error.code == response.status_code, text[:300]
    assert isinstance(parsed.error.message, str) and parsed.error.message, text[:300]
    return response.status_code, response.json()["error"].get("mmref_code")


def warm_up(server: VLLMServer) -> None:
    """The first request on a fresh engine warms it up (~20 s)."""
    with server.client() as c:
        c.post(
            "/v1/completions", json={"model": str(server.model), "prompt": "hi", "max_tokens": 1}
        ).raise_for_status()


# --- weight updates (test_weight_updates.py, test_weight_pushes.py) ----------------------------


def rollout_sample(prompt: list[int], completion: list[int], logprobs: list, refs) -> TrainingSample:
    """A rollout as the trainer sees it: ``prompt + completion``, loss on the completion, the
    server's logprobs (``{"logprob": x}`` entries or bare floats) as ``inference_logprobs``."""
    from protocol.structs import MMRefs, TrainingSample

    values = [c["logprob"] if isinstance(c, dict) else c for c in logprobs]
    n, m = len(prompt), len(completion)
    return TrainingSample(
        input_ids=prompt + completion,
        loss_mask=[False] * n + [True] * m,
        advantages=[0.0] * (n + m),
        inference_logprobs=[0.0] * n + values,
        mm_refs=MMRefs(items=list(refs)) if refs else None,
    )


def server_mismatch(samples: list, model, adapter, output_root, *, per_sample: bool = False):
    """The trainer's recompute of the sampled tokens (packed forward) vs the server's logprobs:
    one ``MismatchStats`` over all samples, or (``per_sample``) one per sample."""
    import torch

    from trainer_lib.mismatch import logprob_mismatch, recompute_logprobs

    results = recompute_logprobs(samples, model, adapter, output_root, seq_len=2048)
    served = [torch.tensor(s.inference_logprobs) for s in samples]
    if per_sample:
        return [logprob_mismatch(lp, sv, m) for (lp, m), sv in zip(results, served, strict=True)]
    return logprob_mismatch(
        torch.cat([lp for lp, _ in results]), torch.cat(served), torch.cat([m for _, m in results])
    )


def jittered_weights(model_dir: Path, out: Path):
    """Weight set ``B`` for update tests: the tiny model with its vision tower x4 and every other
    weight jittered (seeded). Returns ``(folder, model)``, the model float32, eval, packing-ready."""
    import torch
    from transformers import AutoModelForImageTextToText

    from rl_server import save_weights
    from trainer_lib import prepare_model_for_packing

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                p.mul_(4.0)
            else:
                p.add_(0.3 * p.std() * torch.randn(p.shape, generator=gen))
    prepare_model_for_packing(model)
    return save_weights(model, out), model


# --- object-store roots (protocol/roots.py): a real S3 endpoint and a proxy for its faults ----------


class MotoS3:
    """moto's standalone S3 server as its own process on 127.0.0.1 (the S3 wire protocol, request
    signing and error codes over HTTP), for obstore's real S3 client.

    :meth:`env` is what a party needs to reach it through the standard AWS environment chain.
    """

    def __init__(self, log_path: Path, *, timeout: float = 60.0) -> None:
        import subprocess
        import time

        import httpx

        from vllm_server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")  # closed by stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.process.returncode}: {log_path}")
            try:
                httpx.get(f"{self.url}/moto-api/", timeout=1.0)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"moto_server not up within {timeout} s") from None
                time.sleep(0.1)

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """AWS chain variables for this endpoint (or another one, e.g. a proxy in front of it)."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.url,
            "AWS_ACCESS_KEY_ID": "mmref-test-key",
            "AWS_SECRET_ACCESS_KEY": "mmref-test-secret",
            "AWS_REGION": "us-east-1",
            "MMREF_STORE_ALLOW_HTTP": "1",
        }

    def make_bucket(self, name: str) -> str:
        """Create a bucket with a plain HTTP PUT; returns ``s3://<name>``."""
        import httpx

        httpx.put(f"{self.url}/{name}", timeout=10.0).raise_for_status()
        return f"s3://{name}"

    def object_url(self, bucket: str, key: str) -> str:
        """The plain HTTP URL of an object (path style): tests delete or replace objects with it."""
        return f"{self.url}/{bucket}/{key}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except Exception:
            self.process.kill()
            self.process.wait(10)
        self._log.close()


class DelayProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_port``, for store faults: ``delay_s`` holds
    every upstream answer that long (a slow endpoint); :meth:`close` stops listening (endpoint
    down: connection refused). Threads, bounded by the test's own timeouts; stops with the test."""

    def __init__(self, upstream_port: int, *, delay_s: float = 0.0) -> None:
        import socket
        import threading

        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.delay_s), daemon=True).start()

    def _pipe(self, src, dst, delay_s: float) -> None:
        try:
            while chunk := src.recv(65536):
                if delay_s:
                    self._closed.wait(delay_s)  # woken early by close()
                if self._closed.is_set():
                    return
                dst.sendall(chunk)
        except OSError:
            return
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        """Stop listening and drop every connection (the endpoint is down from now on)."""
        self._closed.set()
        self._listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass


__all__ += ["DelayProxy", "MotoS3"]
