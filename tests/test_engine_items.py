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
