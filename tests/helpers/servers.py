"""The vLLM server in tests: the session server's flags, a launcher that warms up and stops it
(:func:`served`, the one way a test module starts a server of its own), and readers of its answers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from vllm_server import VLLMServer, start_server

SERVER_CACHE_BUDGET = 8 << 20
"""Resolve-cache budget of the test server: small, so the suite exercises eviction."""

SERVER_ARGS = ("--enable-scale-out", "--logprobs-mode", "processed_logprobs")
"""Flags of the session plugin server (and of the stock server it is compared with).

``--enable-scale-out`` also turns on vLLM's own render route, the oracle of the tests;
``--logprobs-mode processed_logprobs``: logprobs of the sampling distribution (after temperature),
what RL importance ratios need and what the e2e test recomputes."""

__all__ = [
    "SERVER_ARGS",
    "SERVER_CACHE_BUDGET",
    "VLLMServer",
    "dev_served",
    "refusal",
    "served",
    "start_server",
    "tokens_and_logprobs",
    "warm_up",
]


def tokens_and_logprobs(response) -> tuple[list[int], list[float]]:
    """The first choice's token ids and sampled-token logprobs of a 200 answer (the generate route,
    or a chat completion asked with ``return_token_ids`` and ``logprobs``)."""
    assert response.status_code == 200, response.text[:500]
    choice = response.json()["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]


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


@contextlib.contextmanager
def served(model_dir: Path, output_root: Path, log: Path, **kwargs) -> Iterator[VLLMServer]:
    """``start_server(model_dir, output_root, log, **kwargs)``, warmed up; stopped on exit."""
    server = start_server(model_dir, output_root, log, **kwargs)
    try:
        warm_up(server)
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def dev_served(model_dir: Path, output_root: Path, log: Path, *args: str) -> Iterator[VLLMServer]:
    """:func:`served` in vLLM's dev mode (``VLLM_SERVER_DEV_MODE=1``: the plugin's weight-update
    routes on), with :data:`SERVER_ARGS` and ``args``."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    with served(model_dir, output_root, log, extra_args=(*SERVER_ARGS, *args), extra_env=env) as server:
        yield server
