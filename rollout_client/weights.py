"""Weight pushes from the trainer to a running mmref server (README "RL loop").

:func:`push_weights` is the one call after an optimizer step: ``POST /mmref/v1/weights/update``
makes the plugin drain the requests in flight, reload the checkpoint, reset vLLM's encoder and
prefix caches, bind the new version and resume (``vllm_plugin/updates.py``), safe with generation
going on. The server must run with ``VLLM_SERVER_DEV_MODE=1`` (vLLM, and the plugin, register
their weight-update routes only then). The checkpoint is a folder vLLM's ``reload_weights`` reads
(``model.save_pretrained(DIR)`` writes one): on CPU machines the weights travel through the
filesystem.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

__all__ = ["UPDATE_PATH", "push_weights", "weight_version"]

UPDATE_PATH = "/mmref/v1/weights/update"


def push_weights(
    client: httpx.Client, weights_dir: str | os.PathLike[str], version: str, timeout_s: float | None = None
) -> dict[str, Any]:
    """Push new weights with generation going on: ``POST /mmref/v1/weights/update`` (the plugin
    drains requests in flight, reloads ``weights_dir``, resets vLLM's caches, binds ``version``,
    resumes). ``version`` must be new for every set of weights (a step number).

    Args:
        client: an ``httpx.Client`` whose ``base_url`` is the server.
        weights_dir: the checkpoint folder, as the server sees it.
        version: the new weights' name (answers name it in ``x-mmref-weight-version``).
        timeout_s: the server's bound on its drain (its default when None).

    Returns:
        The route's answer: ``weight_version``, ``drained_requests``, ``drain_seconds``,
        ``reload_seconds``, ``held_seconds``, ``prefix_cache_reset``.

    The call waits as long as the update takes (no client timeout: the server bounds its drain by
    ``timeout_s``; a client that gave up earlier would not know whether the update happened).

    Raises:
        httpx.HTTPStatusError: the update failed (503 ``drain_timeout``: nothing changed, retry;
            409 ``update_conflict``: another update or hold runs; 404: the server runs without
            ``VLLM_SERVER_DEV_MODE=1``).
        httpx.TransportError: the connection failed (whether the update happened: read
            :func:`weight_version`).
    """
    body = {"weights_path": os.fspath(weights_dir), "version": version, "timeout_s": timeout_s}
    r = client.post(UPDATE_PATH, json=body, timeout=None)
    r.raise_for_status()
    return r.json()


def weight_version(client: httpx.Client) -> str:
    """The server's weight version (``GET /weight_info``)."""
    r = client.get("/weight_info")
    r.raise_for_status()
    return r.json()["weight_version"]
