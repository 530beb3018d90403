"""What the plugin can know about the items the engine holds, for ``null`` (cache-only) slots.

vLLM serves a ``kwargs_data`` slot of ``null`` from the engine's own processor cache (the
receiver cache, ``vllm/multimodal/cache/``): whatever an earlier request sent with data under that
hash. The API process cannot ask the engine; it can know:

- **no receiver cache** (``--mm-processor-cache-gb 0``, or several API servers / internal
  data-parallel load balancing, where vLLM uses ``processor_only``): the engine never holds an item,
  so every ``null`` slot is refused (stock hands the engine an item without data).
- **shm** (``--mm-processor-cache-type shm``): the shared-memory store is written only by the
  API process's sender cache; ``is_cached_item`` is exact, and items sent through
  ``/inference/v1/generate`` never enter it.
- **lru** (vLLM's default with one API server): every item reaches the engine through this API
  process: vLLM's own processing (its sender cache mirrors the receiver cache for those:
  ``is_cached_item``) or this route (:class:`EngineItems` remembers every hash it sent with data,
  up to :data:`SEEN_HASHES` of them). A hash in neither was never sent: the engine lacks it.

Residuals (documented in docs/SECURITY.md): a remembered item the engine has since evicted reaches
the engine and gets stock's answer (HTTP 500 "Internal server error"; the engine keeps serving);
an item that reached the engine only through vLLM's own processing and that vLLM's sender cache
has dropped while the engine still holds it is refused (vLLM's sender cache does not see this
route's items, so it can evict earlier than the engine under mixed traffic).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["SEEN_HASHES", "CacheMode", "EngineItems", "RecordedItem"]


class CacheMode(str, Enum):
    """How the engine holds items between requests (vLLM ``multimodal/cache/factories.py``)."""

    NONE = "none"
    """No receiver cache: ``null`` slots can never be served."""
    SHM = "shm"
    LRU = "lru"
    UNKNOWN = "unknown"
    """A sender cache this version of the plugin does not know: ``null`` slots pass untouched."""

    @classmethod
    def of(cls, sender_cache: Any) -> CacheMode:
        """The mode of the API process's sender cache (``renderer.mm_processor_cache``)."""
        from vllm.multimodal.cache import (
            LruKeyReplicatedSenderCache,
            MultiModalProcessorOnlyCache,
            ShmObjectStoreSenderCache,
        )

        if sender_cache is None or isinstance(sender_cache, MultiModalProcessorOnlyCache):
            return cls.NONE
        if isinstance(sender_cache, ShmObjectStoreSenderCache):
            return cls.SHM
        if isinstance(sender_cache, LruKeyReplicatedSenderCache):
            return cls.LRU
        return cls.UNKNOWN


@dataclass(frozen=True)
class RecordedItem:
    num_placeholders: int
    """Placeholder tokens the item takes (checked against a ``null`` slot's range)."""


SEEN_HASHES = 1 << 18
"""Hashes :class:`EngineItems` remembers (least recently used forgotten first; ~80 MB at most).
More than the engine's processor cache holds of real images (4 GiB by default: ~40k items of
100 kB)."""


class EngineItems:
    """The items this route sent the engine with data, and what vLLM's sender cache holds.

    Args:
        sender_cache: vLLM's API-process processor cache (``renderer.mm_processor_cache``) or None.
    """

    def __init__(self, sender_cache: Any) -> None:
        from vllm.utils.cache import LRUCache

        self.mode = CacheMode.of(sender_cache)
        self.sender_cache = sender_cache
        self._sent: LRUCache[str, RecordedItem] = LRUCache(SEEN_HASHES)

    def sent(self, mm_hash: str, item: RecordedItem) -> None:
        """An item went to the engine with data (the engine caches it under ``mm_hash``)."""
        if self.mode is CacheMode.LRU:
            self._sent.put(mm_hash, item)

    def lookup(self, mm_hash: str) -> tuple[bool, RecordedItem | None]:
        """Whether the engine may hold ``mm_hash``, and the recorded item if this route sent it.

        ``(False, None)`` means the engine certainly lacks it (see the module doc).
        """
        if self.mode is CacheMode.UNKNOWN:
            return True, None
        if self.mode is CacheMode.NONE:
            return False, None
        recorded = self._sent.get(mm_hash) if self.mode is CacheMode.LRU else None
        return recorded is not None or bool(self.sender_cache.is_cached_item(mm_hash)), recorded
