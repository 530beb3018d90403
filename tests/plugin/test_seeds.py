"""Which seeded requests a vLLM CPU server refuses (``vllm_plugin/seeds.py``), from the request's
size and vLLM's own scheduler settings; on real servers, every route: test_route_parity.py (stock as
the control: the refused request kills it), test_weight_pushes.py (a server where text cannot split)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from protocol.errors import SeedUnsupported
from vllm_plugin.admission import rule_check
from vllm_plugin.protocol import MMRefGenerateRequest
from vllm_plugin.seeds import SplitRule

PAD = 261


def rule(**overrides) -> SplitRule:
    settings = {
        "token_budget": 2048,
        "chunked_prefill": True,
        "long_prefill_threshold": 0,
        "max_num_seqs": 4,
        "max_model_len": 2048,
        "encoder_budget": 2048,
        "mamba_block": None,
        "default_temperature": 1.0,
    }
    return SplitRule(**{**settings, **overrides})


def check(r: SplitRule, **request) -> bool:
    """``r.check`` of a short seeded request sampled at random; True: it must run alone."""
    return r.check(
        **{"seed": 7, "temperature": 1.0, "prompt_tokens": 10, "max_tokens": 4, "image_tokens": 0, **request}
    )


def multi(**overrides) -> SplitRule:
    """:func:`rule` on a server with several API processes: nothing may run alone."""
    return rule(single_process=False, **overrides)


def test_unseeded_greedy_and_invalid_requests_pass_on_any_server():
    r = multi()
    assert not check(r, seed=None)
    assert not check(r, temperature=0.0)  # greedy: vLLM gives it no generator, split or not
    assert not check(r, temperature=5e-6)  # below vLLM's _SAMPLING_EPS: still greedy
    for refused_by_vllm in ({"seed": 7.5}, {"seed": "x"}, {"seed": 2**63}, {"temperature": "hot"}):
        assert not check(r, **refused_by_vllm)  # vLLM's request model refuses the value itself
    assert not check(multi(default_temperature=0.0), temperature=None)  # the model's default is greedy


@pytest.mark.parametrize(
    "values", [{"seed": "7"}, {"seed": 7.0}, {"seed": True}, {"temperature": "1.0"}, {"temperature": True}]
)
def test_values_vllms_models_coerce_are_read_as_they_do(values):
    """pydantic's lax mode, as vLLM's ``ChatCompletionRequest`` reads ``seed`` and ``temperature``:
    each of these is a seeded request sampled at random there."""
    with pytest.raises(SeedUnsupported):
        check(multi(), **values)
    assert check(rule(), **values)  # one API process: served alone


def test_chunked_prefill_splits_a_request_when_other_requests_can_fill_the_step():
    # 4 seqs of up to 2048 tokens: any request can be split in a 2048-token step
    with pytest.raises(SeedUnsupported, match="chunked prefill is on") as e:
        check(multi())
    assert e.value.code == "seed_unsupported" and e.value.http_status == 400
    assert "several API processes" in e.value.message
    assert check(rule())  # one API process: alone, nothing shares its step
    # one sequence at a time: nothing else shares the step
    assert not check(multi(max_num_seqs=1))
    # the exact boundary: L + 3 * 100 <= budget (other requests' chunks capped by the threshold)
    assert not check(multi(token_budget=400, long_prefill_threshold=100), prompt_tokens=90, max_tokens=10)
    with pytest.raises(SeedUnsupported, match="chunked"):
        check(multi(token_budget=399, long_prefill_threshold=100), prompt_tokens=90, max_tokens=10)
    # alone, only its own size counts: L <= budget
    assert check(rule(token_budget=100, long_prefill_threshold=100), prompt_tokens=90, max_tokens=10)
    with pytest.raises(SeedUnsupported, match="0 other requests"):
        check(rule(token_budget=99), prompt_tokens=90, max_tokens=10)
    # alone, its own n sequences share the step: n * L <= budget
    assert check(rule(token_budget=200), prompt_tokens=90, max_tokens=10, n=2)
    with pytest.raises(SeedUnsupported, match="1 other requests"):
        check(rule(token_budget=199), prompt_tokens=90, max_tokens=10, n=2)
    # without chunked prefill a prompt is scheduled whole or not at all
    assert not check(multi(chunked_prefill=False), prompt_tokens=2000, max_tokens=48)


def test_output_tokens_count_and_an_unknown_length_is_the_longest():
    """A preempted request is recomputed with its output tokens; no ``max_tokens`` or no known
    prompt length means up to ``max_model_len``."""
    r = rule(max_num_seqs=1, chunked_prefill=True, token_budget=512, max_model_len=2048)
    check(r, prompt_tokens=500, max_tokens=12)
    for request in ({"prompt_tokens": 500, "max_tokens": 13}, {"max_tokens": None}, {"prompt_tokens": None}):
        with pytest.raises(SeedUnsupported):
            check(r, **request)


def test_threshold_mamba_blocks_and_images():
    with pytest.raises(SeedUnsupported, match="long-prefill-token-threshold 64"):
        check(rule(chunked_prefill=False, long_prefill_threshold=64), prompt_tokens=61, max_tokens=4)
    check(rule(chunked_prefill=False, long_prefill_threshold=64), prompt_tokens=60, max_tokens=4)
    with pytest.raises(SeedUnsupported, match="hybrid"):
        check(rule(chunked_prefill=False, mamba_block=16), prompt_tokens=17)
    check(rule(chunked_prefill=False, mamba_block=16), prompt_tokens=12)
    # images: other requests' images can spend the encoder budget, chunked prefill or not
    with pytest.raises(SeedUnsupported, match="encoder budget"):
        check(multi(chunked_prefill=False), image_tokens=64)
    assert not check(multi(chunked_prefill=False, max_num_seqs=1), image_tokens=64)
    assert check(rule(chunked_prefill=False), image_tokens=64)  # alone
    with pytest.raises(SeedUnsupported, match="encoder budget"):  # its own images exceed it
        check(rule(chunked_prefill=False, encoder_budget=63), image_tokens=64)
    # an image in a prompt not rendered yet may be all of it (max_model_len)
    with pytest.raises(SeedUnsupported, match="encoder budget"):
        check(rule(chunked_prefill=False, encoder_budget=2047), prompt_tokens=None, image_tokens=1)


def test_the_generate_route_uses_the_exact_size():
    def generate(**extra) -> MMRefGenerateRequest:
        body = {"token_ids": [1, PAD, PAD, 2], "sampling_params": {"max_tokens": 4, "seed": 7}, **extra}
        return MMRefGenerateRequest.model_validate(body)

    loose = multi(chunked_prefill=False)
    assert not loose.check_generate(generate(), PAD)  # text, no split
    with pytest.raises(SeedUnsupported, match="encoder budget"):
        loose.check_generate(generate(mm_refs=["mmraw:x"]), PAD)  # two image tokens
    part = {"type": "image_url", "url": "data:image/png;base64,AA=="}
    with pytest.raises(SeedUnsupported, match="encoder budget"):
        loose.check_generate(generate(content_parts=[part]), PAD)
    features = {
        "mm_hashes": {"image": ["a" * 64]},
        "mm_placeholders": {"image": [{"offset": 1, "length": 2}]},
    }
    with pytest.raises(SeedUnsupported, match="encoder budget"):
        loose.check_generate(generate(features=features), PAD)
    # one API process: each runs alone; exact sizes: two image tokens fit a 2-token encoder budget
    alone = rule(chunked_prefill=False, encoder_budget=2)
    assert alone.check_generate(generate(mm_refs=["mmraw:x"]), PAD)
    assert alone.check_generate(generate(features=features), PAD)
    with pytest.raises(SeedUnsupported, match="encoder budget"):  # not rendered: may be 2048 tokens
        alone.check_generate(generate(content_parts=[part]), PAD)
    greedy = {"token_ids": [1, 2], "sampling_params": {"temperature": 0, "seed": 7}}
    assert not multi().check_generate(MMRefGenerateRequest.model_validate(greedy), PAD)


def test_openai_bodies_on_vllms_own_routes():
    """``admission.rule_check``: completions with token ids (exact), text or chat (longest),
    chat with an image part (an image)."""
    loose = multi(chunked_prefill=False)
    rule_check(loose, {"prompt": [1, 2, 3], "seed": 7, "max_tokens": 4})
    rule_check(loose, {"messages": [{"role": "user", "content": "hi"}], "seed": 7})
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    chat = {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}], "seed": 7}
    with pytest.raises(SeedUnsupported, match="encoder budget"):
        rule_check(loose, chat)
    rule_check(loose, {**chat, "temperature": 0})
    with pytest.raises(SeedUnsupported, match="chunked"):
        rule_check(multi(), {"prompt": "hi", "seed": 7, "max_tokens": 4})
    tight = multi(max_num_seqs=1, token_budget=100, max_model_len=2048)
    rule_check(tight, {"prompt": [1] * 90, "seed": 7, "max_tokens": 10})
    with pytest.raises(SeedUnsupported):
        rule_check(tight, {"prompt": "x" * 90, "seed": 7, "max_tokens": 10})  # length unknown
    # the fields at the top level count whatever a sampling_params object says (vLLM's chat,
    # completions and responses routes ignore it); a batch's images; a prompt beside its embeds
    with pytest.raises(SeedUnsupported, match="chunked"):
        rule_check(multi(), {"prompt": "hi", "seed": 7, "max_tokens": 4, "sampling_params": {}})
    with pytest.raises(SeedUnsupported, match="chunked"):
        rule_check(multi(), {"prompt": "hi", "max_tokens": 4, "sampling_params": {"seed": 7}})
    with pytest.raises(SeedUnsupported, match="encoder budget"):
        rule_check(loose, {"messages": [[{"role": "user", "content": [image]}]], "seed": 7})
    rule_check(tight, {"prompt": [1] * 90, "seed": 7, "max_tokens": 10})
    with pytest.raises(SeedUnsupported):
        rule_check(tight, {"prompt": [1] * 90, "prompt_embeds": "...", "seed": 7, "max_tokens": 10})
    for not_a_request in ([1], "x", None, {"seed": 7, "max_tokens": "many"}):
        try:
            rule_check(loose, not_a_request)
        except SeedUnsupported:
            assert isinstance(not_a_request, dict)
    # one API process: what splits only beside others runs alone
    assert rule_check(rule(), {"prompt": "hi", "seed": 7, "max_tokens": 4})
    assert rule_check(rule(chunked_prefill=False), chat)
    assert not rule_check(rule(), {**chat, "temperature": 0})


@pytest.mark.parametrize(
    ("family", "scheduler", "cache", "is_cpu", "refuses_text"),
    [
        ("qwen2_vl", {}, {}, True, True),
        ("qwen2_vl", {"enable_chunked_prefill": False}, {}, True, False),
        ("qwen2_vl", {"enable_chunked_prefill": False, "long_prefill_token_threshold": 8}, {}, True, True),
        ("qwen3_5", {"enable_chunked_prefill": False}, {"mamba_cache_mode": "align"}, True, True),
        ("qwen3_5", {"enable_chunked_prefill": False}, {}, True, False),
        ("qwen2_vl", {}, {}, False, False),
    ],
)
def test_for_engine_reads_vllms_own_configs(family, scheduler, cache, is_cpu, refuses_text):
    """``for_engine`` on vLLM's own config objects for the tiny models (what
    ``engine_client.vllm_config`` holds); a GPU server refuses nothing."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig

    from helpers import ensure_tiny_model

    config = SimpleNamespace(
        model_config=ModelConfig(model=str(ensure_tiny_model(family)), max_model_len=4096),
        scheduler_config=SchedulerConfig(
            max_model_len=4096,
            max_num_batched_tokens=4096,
            max_num_seqs=4,
            is_encoder_decoder=False,
            **scheduler,
        ),
        cache_config=CacheConfig(block_size=16, **cache),
    )
    r = SplitRule.for_engine(config, is_cpu=is_cpu)
    if not is_cpu:
        assert r is None
        return
    assert r.token_budget == 4096 and r.max_num_seqs == 4 and r.max_model_len == 4096
    refused = bool(r.split_reasons(100, 0))
    assert refused == refuses_text, r.split_reasons(100, 0)


def test_the_middleware_parses_only_bodies_that_name_a_seed():
    """``http_edge.mentions``: the bytes ``"seed"`` found across chunk boundaries without
    joining the body; only then is it parsed (a 90 MB data-URL body costs a scan, not a copy)."""
    from vllm_plugin.http_edge import mentions

    def _mentions_seed(chunks: list[bytes]) -> bool:
        return mentions(chunks, (b'"seed"',))

    assert _mentions_seed([b'{"seed": 7}'])
    assert _mentions_seed([b'{"se', b'ed": 7}'])
    assert _mentions_seed([b'x"', b"s", b"e", b"e", b'd"'])
    assert not _mentions_seed([b'{"sed": 7, "text": "seeds, seed"}'])
    assert not _mentions_seed([])
