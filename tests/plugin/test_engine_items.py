"""``vllm_plugin.engine_items``: what the route can know about the engine's items, checked against
vLLM's own cache classes (no server): an item this route sent that the engine's receiver cache
still holds is never refused, a hash nobody sent always is."""

from __future__ import annotations

import random

import pytest

from vllm_plugin.engine_items import CacheMode, EngineItems, RecordedItem

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def lru_config(qwen2_vl_dir):
    from vllm.config import ModelConfig

    return ModelConfig(
        model=str(qwen2_vl_dir),
        dtype="float32",
        max_model_len=2048,
        limit_mm_per_prompt={"image": 4},
        mm_processor_cache_gb=2e-6,  # 2147 bytes: a handful of dummy items, evictions
    )


def test_cache_modes_follow_vllms_sender_cache(lru_config):
    from vllm.multimodal.cache import LruKeyReplicatedSenderCache, MultiModalProcessorOnlyCache

    assert CacheMode.of(None) is CacheMode.NONE  # --mm-processor-cache-gb 0
    assert CacheMode.of(MultiModalProcessorOnlyCache(lru_config)) is CacheMode.NONE  # several API servers
    assert CacheMode.of(LruKeyReplicatedSenderCache(lru_config)) is CacheMode.LRU
    assert CacheMode.of(object()) is CacheMode.UNKNOWN
    for items in (EngineItems(None), EngineItems(MultiModalProcessorOnlyCache(lru_config))):
        items.sent("a" * 64, RecordedItem(4))
        assert items.lookup("a" * 64) == (False, None)  # no receiver cache: never servable
    assert EngineItems(object()).lookup("a" * 64) == (True, None)  # unknown: passed through


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_items_the_route_sent_are_known_while_the_engine_holds_them(lru_config, seed):
    """The same random traffic through vLLM's engine-side receiver cache and API-side sender cache
    (vLLM's own processing path) and through the route (items sent with data, null slots)."""
    from vllm.multimodal.cache import (
        LruKeyReplicatedReceiverCache,
        LruKeyReplicatedSenderCache,
        MultiModalCacheMissError,
    )
    from vllm.multimodal.inputs import MultiModalKwargsItem

    receiver = LruKeyReplicatedReceiverCache(lru_config)
    sender = LruKeyReplicatedSenderCache(lru_config)
    record = EngineItems(sender)
    rng = random.Random(seed)
    hashes = [f"h{i:02d}" for i in range(24)]
    sizes = {h: rng.choice([100, 300, 700, 3000]) for h in hashes}  # 3000 > capacity: never cached
    counts = {h: rng.randint(1, 64) for h in hashes}
    by_route: set[str] = set()
    refused = served = 0
    for _ in range(2000):
        h = rng.choice(hashes)
        item = MultiModalKwargsItem.dummy(sizes[h])
        op = rng.random()
        if op < 0.4:  # this route sends the item with data
            receiver.get_and_update_item(item, h)
            record.sent(h, RecordedItem(counts[h]))
            by_route.add(h)
        elif op < 0.6:  # vLLM's own processing path (chat completions) sends it
            data = sender.get_and_update_item((item, []), h)[0]
            try:
                receiver.get_and_update_item(data, h)
            except MultiModalCacheMissError:  # vLLM's own drift: the engine answers, P0 forgets
                sender.invalidate(h)
        else:  # a null slot
            known, recorded = record.lookup(h)
            if h in receiver._cache and h in by_route:
                assert known and recorded == RecordedItem(counts[h]), h
            if not known:
                assert h not in receiver._cache or h not in by_route
                refused += 1
                continue
            try:
                receiver.get_and_update_item(None, h)
                served += 1
            except MultiModalCacheMissError:  # the documented residual: stock's 500
                pass
    assert refused > 10 and served > 100, (refused, served)
    assert record.lookup("never-sent") == (False, None)


def _request(rng: random.Random, hashes: list[str], sizes: dict[str, int]) -> dict:
    """One request's engine input: 1-3 resolved items (repeats allowed) at shuffled prompt positions."""
    from vllm.multimodal.inputs import MultiModalKwargsItem, PlaceholderRange

    n = rng.randint(1, 3)
    chosen = [rng.choice(hashes) for _ in range(n)]
    offsets = rng.sample(range(0, 100, 10), n)  # slot order is not prompt order
    return {
        "mm_kwargs": {"image": [MultiModalKwargsItem.dummy(sizes[h]) for h in chosen]},
        "mm_hashes": {"image": chosen},
        "mm_placeholders": {"image": [PlaceholderRange(offset=o, length=4) for o in offsets]},
    }


def _engine_receives(receiver, engine_input: dict) -> list:
    """What vLLM's engine core does with a request's items: features in prompt order
    (``InputProcessor.process_inputs``), then the receiver cache (``preprocess_add_request``)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.multimodal.utils import argsort_mm_positions

    order = argsort_mm_positions(engine_input["mm_placeholders"])
    features = [
        MultiModalFeatureSpec(
            data=engine_input["mm_kwargs"][m][i],
            modality=m,
            identifier=engine_input["mm_hashes"][m][i],
            mm_position=engine_input["mm_placeholders"][m][i],
            mm_hash=engine_input["mm_hashes"][m][i],
        )
        for m, i in order
    ]
    return receiver.get_and_update_features(features)


def _ours(engine_input: dict) -> set[tuple[str, int]]:
    return {("image", i) for i in range(len(engine_input["mm_hashes"]["image"]))}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_hand_off_keeps_the_sender_cache_in_step_with_the_engines(lru_config, seed):
    """Random requests (several images, repeats, slots out of prompt order, items too large to
    cache, constant evictions, clears of both sides) through the hand-off and vLLM's real sender
    and receiver caches: the engine never gets a handle for an item it lacks, every item it uses is
    the request's own, and most repeats travel as handles."""
    from vllm.multimodal.cache import LruKeyReplicatedReceiverCache, LruKeyReplicatedSenderCache

    sender, receiver = LruKeyReplicatedSenderCache(lru_config), LruKeyReplicatedReceiverCache(lru_config)
    items = EngineItems(sender)
    rng = random.Random(seed)
    hashes = [f"mmref-{i:02d}" for i in range(12)]
    sizes = {h: rng.choice([100, 300, 700, 3000]) for h in hashes}  # 3000 > capacity: never cached
    handles = 0
    for _ in range(1500):
        if rng.random() < 0.02:  # a reset: P0, then P1, no hand-off between (engine_items.enter)
            sender.clear_cache()
            receiver.clear_cache()
            continue
        engine_input = _request(rng, hashes, sizes)
        items.hand_off(engine_input, _ours(engine_input))
        handles += sum(item is None for item in engine_input["mm_kwargs"]["image"])
        for feature in _engine_receives(receiver, engine_input):
            assert feature.data["dummy"].data.numel() == sizes[feature.mm_hash]
    assert handles > 300, handles


def test_a_request_refused_after_the_hand_off_leaves_no_handle_behind(lru_config):
    from vllm.multimodal.cache import LruKeyReplicatedReceiverCache, LruKeyReplicatedSenderCache
    from vllm.multimodal.inputs import MultiModalKwargsItem, PlaceholderRange

    sender, receiver = LruKeyReplicatedSenderCache(lru_config), LruKeyReplicatedReceiverCache(lru_config)
    items = EngineItems(sender)

    def request() -> dict:  # one image twice, the first slot later in the prompt
        ranges = [PlaceholderRange(offset=9, length=4), PlaceholderRange(offset=1, length=4)]
        return {
            "mm_kwargs": {"image": [MultiModalKwargsItem.dummy(300), MultiModalKwargsItem.dummy(300)]},
            "mm_hashes": {"image": ["mmref-a", "mmref-a"]},
            "mm_placeholders": {"image": ranges},
        }

    refused = request()
    recorded = items.hand_off(refused, _ours(refused))
    assert recorded == ["mmref-a"] and refused["mm_kwargs"]["image"] == [
        None,
        refused["mm_kwargs"]["image"][1],
    ]
    items.forget(recorded)  # never sent
    again = request()
    items.hand_off(again, _ours(again))
    assert again["mm_kwargs"]["image"][0] is None and again["mm_kwargs"]["image"][1] is not None
    assert [f.data is not None for f in _engine_receives(receiver, again)] == [True, True]


def test_only_the_lru_sender_cache_with_a_worker_and_an_engine_round_trip_hands_off(lru_config):
    from concurrent.futures import ThreadPoolExecutor

    from vllm.multimodal.cache import LruKeyReplicatedSenderCache, MultiModalProcessorOnlyCache

    async def is_paused() -> bool:
        return False

    with ThreadPoolExecutor(1) as worker:
        assert EngineItems(
            LruKeyReplicatedSenderCache(lru_config), executor=worker, is_paused=is_paused
        ).mirrors
        assert not EngineItems(LruKeyReplicatedSenderCache(lru_config), executor=worker).mirrors
        assert not EngineItems(LruKeyReplicatedSenderCache(lru_config), is_paused=is_paused).mirrors
        only = MultiModalProcessorOnlyCache(lru_config)  # several API servers
        assert not EngineItems(only, executor=worker, is_paused=is_paused).mirrors
        assert not EngineItems(None, executor=worker, is_paused=is_paused).mirrors


def test_a_clear_holds_every_hand_off_until_the_engine_answers(lru_config):
    """After vLLM clears the sender cache (on its multimodal worker, as ``reset_mm_cache`` does),
    the next hand-offs wait for one round trip to the engine (repeated while it is paused); without
    a clear, none waits; a hand-off cancelled while waiting for the worker leaves it free."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from vllm.multimodal.cache import LruKeyReplicatedSenderCache

    from vllm_plugin.engine_items import IN_STEP_MARKER

    sender = LruKeyReplicatedSenderCache(lru_config)
    asked: list[float] = []
    paused = [True, False]  # the first answer after the clear: paused; then not

    async def is_paused() -> bool:
        asked.append(asyncio.get_running_loop().time())
        await asyncio.sleep(0.05)
        return paused.pop(0) if paused else False

    async def scenario(worker: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        items = EngineItems(sender, executor=worker, is_paused=is_paused)
        (await items.enter())()  # first use: no marker yet, one round trip
        assert len(asked) == 2 and sender.is_cached_item(IN_STEP_MARKER)
        for _ in range(3):
            (await items.enter())()
        assert len(asked) == 2  # in step: no round trip
        await loop.run_in_executor(worker, sender.clear_cache)  # renderer.clear_mm_cache_async

        async def use() -> None:
            (await items.enter())()

        await asyncio.gather(*(use() for _ in range(4)))
        assert len(asked) == 3  # one round trip for all four
        held = await items.enter()
        blocked = asyncio.ensure_future(items.enter())  # waits: the worker is parked by `held`
        await asyncio.sleep(0.05)
        assert not blocked.done()
        blocked.cancel()
        held()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        assert await loop.run_in_executor(worker, lambda: "free") == "free"

    with ThreadPoolExecutor(1) as worker:
        asyncio.run(scenario(worker))


class _Renderer033:
    """Stands in for vLLM 0.33's renderer, which cannot be installed here (a CUDA-only wheel): what
    the door's version branch picks is under test, not vLLM. Its method is 0.33's
    ``_drain_mm_cache_invalidations`` (``vllm/renderers/base.py``): invalidate the queued misses."""

    def __init__(self, sender, worker) -> None:
        self.sender, self.worker = sender, worker
        self.queued: set[str] = set()
        self.drained_while_parked: list[bool] = []

    def _drain_mm_cache_invalidations(self) -> None:
        from concurrent.futures import TimeoutError as FutureTimeout

        probe = self.worker.submit(lambda: None)  # runs at once unless the plugin parked the worker
        try:
            probe.result(timeout=0.1)
            self.drained_while_parked.append(False)
        except FutureTimeout:
            self.drained_while_parked.append(True)
        while self.queued:
            self.sender.invalidate(self.queued.pop())


def test_the_door_drains_deferred_invalidations_on_vllm_033_only():
    from upstream import invalidation_drain

    class Renderer:  # a stand-in (see _Renderer033): counts its drains
        drains = 0

        def _drain_mm_cache_invalidations(self) -> None:
            self.drains += 1

    renderer = Renderer()
    assert invalidation_drain(renderer, "0.32.0") is None  # 0.32 invalidates at once: nothing to drain
    assert invalidation_drain(renderer) is None  # the installed release (0.32)
    assert invalidation_drain(object(), "0.33.0") is None  # no such method: nothing to call
    drain = invalidation_drain(renderer, "0.33.1+cu130")
    assert drain is not None and renderer.drains == 0
    drain()
    assert renderer.drains == 1


def test_a_missed_item_is_drained_before_p0_is_read_or_recorded(lru_config):
    """vLLM 0.33 queues an engine cache miss instead of invalidating P0: the hand-off, a ``null``
    slot's lookup (after ``settle``) and ``recorded_by_vllm`` drain the queue first, with vLLM's
    worker parked. So a missed item travels with its data again and a ``null`` slot for it is
    refused, instead of retrying into the same miss."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from vllm.multimodal.cache import LruKeyReplicatedSenderCache
    from vllm.multimodal.inputs import MultiModalKwargsItem, PlaceholderRange

    sender = LruKeyReplicatedSenderCache(lru_config)

    async def is_paused() -> bool:
        return False

    def request() -> dict:
        return {
            "mm_kwargs": {"image": [MultiModalKwargsItem.dummy(100)]},
            "mm_hashes": {"image": ["mmref-a"]},
            "mm_placeholders": {"image": [PlaceholderRange(offset=1, length=4)]},
        }

    async def hand_off(items: EngineItems) -> bool:
        """Whether the item travelled as a handle."""
        engine_input = request()
        release = await items.enter()
        items.hand_off(engine_input, _ours(engine_input))
        release()
        return engine_input["mm_kwargs"]["image"][0] is None

    async def scenario(renderer: _Renderer033) -> None:
        drain = renderer._drain_mm_cache_invalidations
        items = EngineItems(sender, executor=renderer.worker, is_paused=is_paused, drain=drain)
        assert not await hand_off(items) and await hand_off(items)  # data, then a handle
        renderer.queued.add("mmref-a")  # the engine missed it (its output handler queues the hash)
        assert not await hand_off(items)  # drained first: data again
        renderer.queued.add("mmref-a")
        assert items.lookup("mmref-a") == (True, None)  # not drained yet: P0 still "holds" it
        await items.settle()
        assert items.lookup("mmref-a") == (False, None)
        assert not await hand_off(items)
        renderer.queued.add("mmref-a")
        assert await items.recorded_by_vllm("mmref-a") is None
        assert renderer.drained_while_parked and all(renderer.drained_while_parked)

    with ThreadPoolExecutor(1) as worker:
        asyncio.run(scenario(_Renderer033(sender, worker)))
