"""The door's functions (``upstream/door.py``): :func:`~upstream.locate` and :func:`~upstream.load`
(the version-keyed branch, in one place), and the accessors of what the plugin reaches other than
by import, on stand-ins for vLLM's objects."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from upstream import (
    load,
    locate,
    mm_worker,
    served_image_processor,
    serving_tokens_keywords,
    touchpoint,
    video_source,
)


def test_locate_is_the_version_keyed_branch():
    assert locate("cli_env_setup", "0.32.0").module == "vllm.entrypoints.serve.utils.api_utils"
    assert locate("cli_env_setup", "0.33.0").module == "vllm.entrypoints.common.startup"
    assert locate("cli_env_setup", "0.33.2rc1+cu130").module == "vllm.entrypoints.common.startup"
    assert "online_derenderer" not in locate("ServingTokens.__init__", "0.32.0").keywords
    assert "online_derenderer" in locate("ServingTokens.__init__", "0.33.0").keywords
    drain = touchpoint("renderer._drain_mm_cache_invalidations")
    assert not drain.exists_in("0.32.0") and drain.exists_in("0.33.1+cu130")
    with pytest.raises(KeyError, match="no vLLM surface touchpoint 'nope'"):
        touchpoint("nope")


def test_load_imports_through_the_table():
    assert load("cli_env_setup").__name__ == "cli_env_setup"
    assert load("ServingTokens.__init__").__qualname__ == "ServingTokens.__init__"
    with pytest.raises(ValueError, match="assigned"):
        load("state.online_renderer")
    with pytest.raises(ValueError, match=r">=0\.33 only"):
        load("renderer._drain_mm_cache_invalidations", "0.32.0")


def test_serving_tokens_keywords_follow_the_release():
    state = SimpleNamespace(online_derenderer="derenderer")
    assert serving_tokens_keywords(state, "0.32.0") == {}
    assert serving_tokens_keywords(state, "0.33.0") == {"online_derenderer": "derenderer"}
    assert serving_tokens_keywords(state) == {}  # the installed 0.32


def test_served_image_processor_is_the_infos_own_or_the_hf_processors():
    qwen_like = SimpleNamespace(get_hf_processor=lambda: SimpleNamespace(image_processor="hf"))
    kimi_like = SimpleNamespace(image_processor="fused", get_hf_processor=lambda: pytest.fail("not asked"))
    assert served_image_processor(SimpleNamespace(info=qwen_like)) == "hf"
    assert served_image_processor(SimpleNamespace(info=kimi_like)) == "fused"


def test_mm_worker_is_a_single_thread_executor_or_none():
    with ThreadPoolExecutor(max_workers=1) as one, ThreadPoolExecutor(max_workers=2) as two:
        assert mm_worker(SimpleNamespace(_mm_executor=one)) is one
        assert mm_worker(SimpleNamespace(_mm_executor=two)) is None
    assert mm_worker(SimpleNamespace()) is None


def test_video_source_is_the_loaders_own_adjustment():
    registry = load("VIDEO_LOADER_REGISTRY")
    source = load("VideoSourceMetadata")(30, 0.0, 0.0)
    assert video_source(registry.load("qwen3_vl"), source) == (30, 24.0, 0.0)  # unknown fps: 24
    assert video_source(registry.load("qwen2_vl"), source) == source
