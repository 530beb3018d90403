"""The items the engine holds: handing the route's items over in step with it, and ``null`` slots.

vLLM keeps processed items in two caches that mirror each other (``vllm/multimodal/cache/``): the
engine core's receiver cache (P1) holds the data, the API process's sender cache (P0,
``renderer.mm_processor_cache``) holds only sizes in the same LRU order, so P0 knows, without
asking, which items P1 holds and sends those as cache handles (``None``). vLLM's own processor
path keeps the two in step by running every P0 operation on the renderer's single multimodal
worker thread (``renderer._mm_executor``, "single-worker per #38418 (P0/P1 order)"), where
``reset_mm_cache`` and ``pause_generation(clear_cache=True)`` also clear P0 before telling P1.

**Hand-off** (:meth:`EngineItems.enter`, :meth:`EngineItems.hand_off`): the items of resolved
refs take the same P0 operations as vLLM's processor gives its own (touch every hash, then
``get_and_update_item`` in prompt position order, then ``release_sender_touches``: P1's own order,
``get_and_update_features``), with guarantees vLLM's path lacks:

- they run while the multimodal worker is parked (so never concurrently with a P0 clear or
  vLLM's own processing), and the request reaches the engine core's input socket in the same
  event-loop step, with no suspension point in between. So P1 receives items and handles in
  exactly the order P0 recorded them: the first of N concurrent uses of a new image carries its
  data and reaches P1 before any of the N-1 handles.
- **resets.** vLLM clears P0, then sends P1 its reset (``reset_mm_cache``, ``pause_generation``,
  ``sleep``), which the engine core's main thread runs when it gets to it, while its input thread
  keeps storing the items of requests that arrived after the reset message: items P0 records in
  that window can be wiped from P1 afterwards. A zero-byte marker in P0 (:data:`IN_STEP_MARKER`,
  never sent) shows a clear: the first hand-off that finds it gone puts it back and, with every
  other hand-off waiting, asks the engine core whether it is paused (a round trip through its
  main thread, queued behind the reset message; repeated while paused). Only then, with P1's
  clear done, do items go through P0 again.
- a request vLLM refuses within that step (its input validation or admission control, before
  anything is sent) has the items it newly recorded dropped again (:meth:`EngineItems.forget`),
  so no later request sends a handle for them.

Used only where the sender cache is ``lru`` (vLLM's default with one API server); with ``shm``,
none (``--mm-processor-cache-gb 0``) or ``processor_only`` (several API servers, internal
data-parallel load balancing) every item travels with its data.

Residuals (vLLM's own mirror has them too; docs/SECURITY.md): a request refused within the step
still moved its other items to the most recently used end of P0 (not of P1); items of vLLM's own
processor path are recorded in P0 before their request reaches P1 (suspension points between), so
under mixed traffic and a full cache the two LRU orders can differ; a pause without a cache clear
in the engine (``keep``), or resumed before it finished, leaves P1 holding items P0 dropped. vLLM
answers a handle P1 lacks with a retryable error and P0 forgets the hash
(``MultiModalCacheMissError``): vLLM 0.32 at once; vLLM >= 0.33 queues it, and only a drain of the
queue forgets it (vLLM's own processing drains first thing; the hand-off, :meth:`EngineItems.settle`
and :meth:`EngineItems.recorded_by_vllm` drain too, with the worker parked: ``drain``).

**``null`` slots** (:meth:`EngineItems.lookup`): vLLM serves a slot of ``null`` from P1 under that
hash. The API process can know:

- **no receiver cache** (``--mm-processor-cache-gb 0``, or ``processor_only``): the engine never
  holds an item, so every ``null`` slot is refused (stock hands the engine an item without data).
- **shm** (``--mm-processor-cache-type shm``): the shared-memory store is written only by the
  API process's sender cache; ``is_cached_item`` is exact.
- **lru** (vLLM's default with one API server): items reach P1 through vLLM's processing or
  resolved refs (both recorded in P0: ``is_cached_item``) or as inline items of this route
  (:class:`EngineItems` remembers every hash it sent with data, up to :data:`SEEN_HASHES`). A hash
  in neither was never sent: the engine lacks it.

A ``null`` slot's range must be as long as the item's embeddings: the route's own record
(:meth:`EngineItems.sent`), or, for an item vLLM's own processor sent (``content_parts``, chat
routes), P0's record of its prompt updates (:meth:`EngineItems.recorded_by_vllm`); a wrong length
is a 422 (stock: HTTP 500).

Residuals: a remembered inline item the engine has since evicted reaches the engine and gets
stock's answer (HTTP 500 "Internal server error"; the engine keeps serving); inline items are not
recorded in P0 (stock does not record them), so under a full cache P1 can evict earlier than P0.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Collection, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from enum import Enum
from typing import Any

from upstream import load
from vllm_plugin.weights import NAMESPACE

__all__ = ["IN_STEP_MARKER", "SEEN_HASHES", "CacheMode", "EngineItems", "RecordedItem", "Release"]


class CacheMode(str, Enum):
    """How the engine holds items between requests (vLLM ``multimodal/cache/factories.py``)."""

    NONE = "none"
    """No receiver cache: ``null`` slots can never be served; items always travel with data."""
    SHM = "shm"
    LRU = "lru"
    UNKNOWN = "unknown"
    """A sender cache this version of the plugin does not know: ``null`` slots pass untouched,
    items travel with data."""

    @classmethod
    def of(cls, sender_cache: Any) -> CacheMode:
        """The mode of the API process's sender cache (``renderer.mm_processor_cache``)."""
        if sender_cache is None or isinstance(sender_cache, load("MultiModalProcessorOnlyCache")):
            return cls.NONE
        if isinstance(sender_cache, load("ShmObjectStoreSenderCache")):
            return cls.SHM
        if isinstance(sender_cache, load("LruKeyReplicatedSenderCache")):
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

IN_STEP_MARKER = NAMESPACE + "in-step"
"""Key of the zero-byte item kept in P0 only, to see a clear (in the reserved ``mmref-`` namespace,
never a resolved ref's ``mmref-`` + 64 hex)."""

_PAUSE_POLL_S = 0.05
"""While the engine is paused after a clear, how often it is asked again."""


class Release:
    """Lets vLLM's parked multimodal worker go on (call it; idempotent)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def __call__(self) -> None:
        self._event.set()

    @property
    def done(self) -> bool:
        """Whether the worker was let go (after it, P0 is no longer this request's alone)."""
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()


class EngineItems:
    """The route's view of the engine's items (see the module doc).

    Args:
        sender_cache: vLLM's API-process processor cache (``renderer.mm_processor_cache``) or None.
        executor: vLLM's single multimodal worker (``renderer._mm_executor``), where every P0
            operation of vLLM runs.
        is_paused: the engine client's ``is_paused`` (a round trip through the engine core's main
            thread). Without it or ``executor``, items always travel with data.
        on_stats: called after each hand-off (``renderer.update_mm_cache_stats``: vLLM's
            ``vllm:mm_cache_*`` metrics then count the route's hits, as ``inject_into_mm_cache``).
        drain: applies the cache-miss invalidations vLLM deferred (vLLM >= 0.33: the door's
            ``invalidation_drain``; None on 0.32, which applies them at once). Run with the worker
            parked, before P0 is read or recorded (:meth:`hand_off`, :meth:`settle`,
            :meth:`recorded_by_vllm`), as vLLM runs it on the worker before its own processing.
    """

    def __init__(
        self,
        sender_cache: Any,
        *,
        executor: Executor | None = None,
        is_paused: Callable[[], Awaitable[bool]] | None = None,
        on_stats: Callable[[], None] | None = None,
        drain: Callable[[], None] | None = None,
    ) -> None:
        self.mode = CacheMode.of(sender_cache)
        self.sender_cache = sender_cache
        self.mirrors = self.mode is CacheMode.LRU and executor is not None and is_paused is not None
        """Whether resolved items go through the sender cache (and travel as handles when held)."""
        self._executor = executor
        self._is_paused = is_paused
        self._on_stats = on_stats
        self._drain = drain
        self._confirming: asyncio.Task[None] | None = None
        self._sent: Any = load("LRUCache")(SEEN_HASHES)
        """``vllm.utils.cache.LRUCache[str, RecordedItem]``."""
        self._lengths: Any = load("LRUCache")(SEEN_HASHES)
        """Placeholder counts of resolved refs' engine hashes, noted when a request is prepared:
        content-named (``weights.engine_hash``), so a hash's count never changes; says nothing of
        whether the engine holds it."""

    # --- hand-off ----------------------------------------------------------------------

    async def enter(self) -> Release:
        """:meth:`exclusive`, with P0 known to be in step with P1 (see the module doc: resets).

        Raises:
            Whatever the engine client raises asking whether it is paused (a dead engine).
        """
        while True:
            if self._confirming is not None:
                await asyncio.shield(self._confirming)
                continue
            release = await self.exclusive()
            if self._confirming is None and self.sender_cache.is_cached_item(IN_STEP_MARKER):
                return release
            if self._confirming is None:  # cleared since the marker went in (or it was evicted)
                self.sender_cache.get_and_update_item((_zero_byte_item(), []), IN_STEP_MARKER)
                self._confirming = asyncio.ensure_future(self._confirm())
            release()

    async def _confirm(self) -> None:
        """Return once every reset sent before now has cleared P1 (and the engine is not paused)."""
        assert self._is_paused is not None
        try:
            while await self._is_paused():
                await asyncio.sleep(_PAUSE_POLL_S)
        finally:
            self._confirming = None

    async def exclusive(self) -> Release:
        """Park vLLM's multimodal worker thread: P0 is this coroutine's until the release.

        Queues behind what the worker already has (vLLM's processing, a clear). Cancelled while
        waiting, the worker passes straight through when it gets there.
        """
        loop = asyncio.get_running_loop()
        parked: asyncio.Future[None] = loop.create_future()
        release = Release()

        def park() -> None:
            loop.call_soon_threadsafe(_resolve, parked)
            release.wait()

        assert self._executor is not None
        self._executor.submit(park)
        try:
            await parked
        except BaseException:
            release()
            raise
        return release

    def hand_off(self, engine_input: Mapping[str, Any], ours: Collection[tuple[str, int]]) -> list[str]:
        """vLLM's sender-cache operations for one request, as its processor performs them
        (``BaseMultiModalProcessor._merge_mm_kwargs``): every hash touched, then, in prompt
        position order, each resolved item given to ``get_and_update_item`` (its slot becomes what
        comes back: the item, or ``None`` where P1 holds it, or an shm address) and every other
        item touched, as P1 will (``get_and_update_features``). Hold :meth:`exclusive` and send
        the request in the same event-loop step.

        Args:
            engine_input: vLLM's ``MultiModalInput`` (``mm_kwargs``, ``mm_hashes``,
                ``mm_placeholders``), resolved items already in their slots.
            ours: the ``(modality, index)`` slots of resolved items.

        Returns:
            The hashes newly recorded (for :meth:`forget` if the request never reaches the engine).
        """
        cache = self.sender_cache
        kwargs, hashes = engine_input["mm_kwargs"], engine_input["mm_hashes"]
        order = load("argsort_mm_positions")(engine_input["mm_placeholders"])
        if self._drain is not None:  # a hash the engine missed is no longer "held" (vLLM >= 0.33)
            self._drain()
        recorded: list[str] = []
        try:
            cache.touch_sender_cache_item(IN_STEP_MARKER)  # kept from the LRU end
            for m, i in order:
                cache.touch_sender_cache_item(hashes[m][i])
            for m, i in order:
                if (m, i) not in ours:
                    cache.touch_sender_cache_item(hashes[m][i])
                    continue
                item = kwargs[m][i]
                data, _ = cache.get_and_update_item((item, []), hashes[m][i])
                if data is item and self.mode is CacheMode.LRU:
                    recorded.append(hashes[m][i])
                kwargs[m][i] = data
        finally:
            cache.release_sender_touches()
        if self._on_stats is not None:
            self._on_stats()
        return recorded

    def forget(self, hashes: Collection[str]) -> None:
        """Drop hashes from P0 (vLLM's ``invalidate``): their request never reached the engine."""
        for mm_hash in hashes:
            self.sender_cache.invalidate(mm_hash)

    # --- null slots --------------------------------------------------------------------

    async def settle(self) -> None:
        """Apply the cache-miss invalidations vLLM deferred (vLLM >= 0.33; see ``drain``) before
        :meth:`lookup` reads P0, with the worker parked (vLLM drains on it before its own
        processing). Nothing to do on 0.32 or without a worker.
        """
        if self._drain is None or not self.mirrors:
            return
        release = await self.exclusive()
        try:
            self._drain()
        finally:
            release()

    def sent(self, mm_hash: str, item: RecordedItem) -> None:
        """An item went to the engine with data (the engine caches it under ``mm_hash``)."""
        if self.mode is CacheMode.LRU:
            self._sent.put(mm_hash, item)

    def note(self, mm_hash: str, item: RecordedItem) -> None:
        """A resolved ref's engine hash and its placeholder count (for :meth:`length_of`)."""
        if mm_hash.startswith(NAMESPACE):  # content-named: never a client's hash
            self._lengths.put(mm_hash, item)

    def length_of(self, mm_hash: str) -> RecordedItem | None:
        """The placeholder count noted for a resolved ref's engine hash (its request may still
        run: :meth:`sent` records it only once the engine has accepted the request)."""
        return self._lengths.get(mm_hash)

    def lookup(self, mm_hash: str) -> tuple[bool, RecordedItem | None]:
        """Whether the engine may hold ``mm_hash``, and the recorded item if this route sent it.

        ``(False, None)`` means the engine certainly lacks it (see the module doc).
        """
        if self.mode is CacheMode.UNKNOWN:
            return True, None
        if self.mode is CacheMode.NONE or mm_hash == IN_STEP_MARKER:
            return False, None
        recorded = self._sent.get(mm_hash) if self.mode is CacheMode.LRU else None
        return recorded is not None or bool(self.sender_cache.is_cached_item(mm_hash)), recorded

    async def recorded_by_vllm(self, mm_hash: str) -> RecordedItem | None:
        """The placeholder count vLLM's own processor recorded in P0 for an item it sent the
        engine (a ``content_parts`` or chat-route image, under vLLM's hash or the client's uuid):
        the embeddings its prompt updates assign (``PromptUpdateDetails.is_embed``, else every
        token of the update). None where P0 has no such record (``lru`` mode only)."""
        if not self.mirrors or self.mode is not CacheMode.LRU:
            return None
        release = await self.exclusive()
        try:
            if self._drain is not None:
                self._drain()
            if not self.sender_cache.is_cached_item(mm_hash):
                return None
            _, updates = self.sender_cache.get_and_update_item(None, mm_hash)
        finally:
            release()
        counts = [_embeds(update.content) for update in updates or ()]
        return RecordedItem(sum(counts)) if counts else None


def _embeds(details: Any) -> int:
    """Embedding positions of a vLLM ``PromptUpdateDetails``."""
    if details.is_embed is None:
        return len(details.full)
    return int(details.is_embed(details.full).sum())


def _zero_byte_item() -> Any:
    """A ``MultiModalKwargsItem`` of size 0 for vLLM's caches (an empty tensor)."""
    import torch

    empty = load("MultiModalFieldElem")(
        data=torch.empty(0, dtype=torch.uint8), field=load("MultiModalSharedField")(batch_size=1)
    )
    return load("MultiModalKwargsItem")({"mmref_marker": empty})


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
