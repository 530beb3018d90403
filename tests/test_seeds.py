"""Which seeded requests a vLLM CPU server refuses (``vllm_plugin/seeds.py``); the refusal on a real
server is in test_route_attacks.py and test_route_parity.py."""

from __future__ import annotations

import pytest

from protocol.errors import SeedUnsupported
from vllm_plugin.protocol import MMRefGenerateRequest
from vllm_plugin.seeds import SeedGuard

RANGE = {"offset": 0, "length": 3}


def request(seed: int | None, **extra) -> MMRefGenerateRequest:
    sampling = {"max_tokens": 2} if seed is None else {"max_tokens": 2, "seed": seed}
    return MMRefGenerateRequest.model_validate({"token_ids": [1, 2, 3], "sampling_params": sampling, **extra})


def test_unseeded_requests_always_pass():
    SeedGuard(("chunked prefill is on",)).check(request(None))


def test_seeded_text_passes_only_where_no_setting_splits_prefills():
    SeedGuard(()).check(request(7))
    with pytest.raises(SeedUnsupported, match="chunked prefill is on") as e:
        SeedGuard(("chunked prefill is on",)).check(request(7))
    assert e.value.code == "seed_unsupported" and e.value.http_status == 400


@pytest.mark.parametrize(
    "extra",
    [
        {"content_parts": [{"type": "image_url", "url": "data:image/png;base64,AA=="}]},
        {
            "features": {
                "mm_hashes": {"image": ["a" * 64]},
                "mm_placeholders": {"image": [{"offset": 0, "length": 3}]},
            }
        },
    ],
)
def test_seeded_requests_with_images_are_refused_even_without_split_settings(extra):
    with pytest.raises(SeedUnsupported, match="carries images"):
        SeedGuard(()).check(request(7, **extra))


@pytest.mark.parametrize(
    ("family", "scheduler", "cache", "expected"),
    [
        ("qwen2_vl", {}, {}, ["chunked prefill"]),
        ("qwen2_vl", {"enable_chunked_prefill": False}, {}, []),
        (
            "qwen2_vl",
            {"enable_chunked_prefill": False, "long_prefill_token_threshold": 64},
            {},
            ["threshold"],
        ),
        ("qwen3_5", {"enable_chunked_prefill": False}, {"mamba_cache_mode": "align"}, ["hybrid"]),
        ("qwen3_5", {"enable_chunked_prefill": False}, {}, []),
    ],
)
def test_seed_guard_reads_vllms_own_configs(family, scheduler, cache, expected):
    """``for_engine`` on vLLM's own config objects for the tiny models (what ``engine_client.vllm_config``
    holds); only a CPU server refuses anything."""
    from types import SimpleNamespace

    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig

    from helpers import ensure_tiny_model

    config = SimpleNamespace(
        model_config=ModelConfig(model=str(ensure_tiny_model(family))),
        scheduler_config=SchedulerConfig(
            max_model_len=4096, max_num_batched_tokens=4096, is_encoder_decoder=False, **scheduler
        ),
        cache_config=CacheConfig(**cache),
    )
    guard = SeedGuard.for_engine(config, is_cpu=True)
    assert len(guard.split_settings) == len(expected)
    assert all(word in setting for word, setting in zip(expected, guard.split_settings, strict=True))
    assert SeedGuard.for_engine(config, is_cpu=False) is None
