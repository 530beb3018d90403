"""Shared test helpers: tiny models, real photos (scikit-image), the vLLM server launcher."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from make_tiny_models import ensure_tiny_model  # noqa: E402
from vllm_server import VLLMServer, start_server  # noqa: E402

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
    "photo_array",
    "photo_bytes",
    "refusal",
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
