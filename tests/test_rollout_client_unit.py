"""rollout_client without a server: import weight, prompts (single and multi-turn) against the chat
template, sampling parameters, retry policy, offloading once per content, the sampling temperature
carried to the trainer's sample."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO, photo_array, photo_bytes
from protocol.errors import PlaceholderMismatch
from rollout_client import (
    ChatTemplate,
    Offloader,
    PromptBuilder,
    RetryPolicy,
    Rollout,
    Sampling,
)
from rollout_client.retry import parse_retry_after
from rollout_client.suppression import logit_bias


def test_import_is_torch_free():
    code = (
        "import sys, rollout_client, rollout_client.client, rollout_client.conversation;"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def builder(qwen2_vl_dir, tmp_path_factory):
    return PromptBuilder(
        ChatTemplate(qwen2_vl_dir), Offloader(qwen2_vl_dir, tmp_path_factory.mktemp("assets"))
    )


def _full(builder, messages) -> list[int]:
    """The template's tokens for the whole conversation at once, placeholders expanded in order."""
    from protocol.placeholders import expand_image_placeholders

    refs = builder.offload_images([dict(m) for m in messages])
    ids = builder.template.encode(builder.template.render(messages, add_generation_prompt=True))
    return expand_image_placeholders(ids, refs, builder.placeholder_token_id)


def _turn(prepared, completion: list[int], finish: str) -> Rollout:
    return Rollout(
        prepared.prompt_ids, completion, [-1.0] * len(completion), finish, None, "v0", prepared.images
    )


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_next_turn_is_the_template_of_the_whole_conversation(builder, finish):
    """A completion that round-trips through text: turn 2's token-appended prompt equals the template's
    rendering of the whole conversation (with the end-of-turn the model sampled, or the template's)."""
    from rollout_client import Conversation

    tok = builder.template
    answer = tok.encode("A cat on a sofa.")
    eos = tok.tokenizer.convert_tokens_to_ids("<|im_end|>")
    conv = Conversation(builder, [{"role": "system", "content": "Be brief."}])
    conv.add_user("What is it?", images=[photo_bytes("chelsea")])
    first = conv.prepare()
    conv.record(_turn(first, answer + ([eos] if finish == "stop" else []), finish))
    conv.add_user("And this one?", images=[photo_bytes("coffee")])
    second = conv.prepare()
    whole = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": photo_bytes("chelsea")},
                {"type": "text", "text": "What is it?"},
            ],
        },
        {"role": "assistant", "content": "A cat on a sofa."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": photo_bytes("coffee")},
                {"type": "text", "text": "And this one?"},
            ],
        },
    ]
    assert second.prompt_ids == _full(builder, whole)
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    assert [r.sha256 for r in second.images] == [r.sha256 for r in _refs(builder, whole)]
    conv.record(_turn(second, answer, "length"))
    sample = conv.training_sample()
    assert sum(sample.loss_mask) == len(answer) * 2 + (finish == "stop")
    assert sample.input_ids == second.prompt_ids + answer
    assert sample.sampling_temperature == 1.0  # both turns at the Rollout default


def _refs(builder, messages):
    return builder.offload_images([dict(m) for m in messages])


def test_placeholder_text_in_a_message_is_refused(builder):
    from rollout_client import Conversation

    conv = Conversation(builder)
    conv.add_user("look: <|image_pad|>", images=[photo_bytes("rocket")])
    with pytest.raises(PlaceholderMismatch):
        conv.prepare()


def test_offloads_once_per_content(qwen2_vl_dir, tmp_path):
    from PIL import Image

    off = Offloader(qwen2_vl_dir, tmp_path / "assets")
    jpeg = photo_bytes("astronaut", size=(200, 150))
    path = tmp_path / "a.jpg"
    path.write_bytes(jpeg)
    a, b, c = off.offload(jpeg), off.offload(path), off.offload(bytearray(jpeg))
    assert a == b == c and off.stats.offloaded == 1 and off.stats.hits == 2
    pil = Image.fromarray(photo_array("coffee")).resize((200, 150))
    assert off.offload(pil) == off.offload(pil.copy()) and off.stats.offloaded == 2
    assert off.offload(pil).media_type == "image/png"
    with pytest.raises(TypeError):
        off.offload(3)  # type: ignore[arg-type]


def test_offloads_content_named_refs_to_a_root_url(qwen2_vl_dir, tmp_path):
    """``form="v2"`` with a root URL (opened once, on first use): the ref names the content, and
    a party with the root among its own roots reads the same bytes."""
    from protocol.refs import ContentRef, parse_ref
    from protocol.roots import AssetRoots

    root = tmp_path / "bucket-mount"
    off = Offloader(qwen2_vl_dir, root.as_uri(), form="v2")
    jpeg = photo_bytes("astronaut", size=(200, 150))
    ref = off.offload(jpeg)
    assert isinstance(parse_ref(ref.ref), ContentRef) and len(ref.ref) <= 160
    assert off.offload(jpeg) == ref and off.stats.offloaded == 1 and not isinstance(off.asset_root, str)
    data, sha256 = AssetRoots.from_urls([root]).read_image(parse_ref(ref.ref))
    assert data == jpeg and sha256 == ref.sha256


def test_sampling_params_carry_the_suppression():
    p = Sampling(temperature=0.7, max_tokens=5, extra={"min_p": 0.1, "logit_bias": {7: 2.0}}).params([261])
    assert p == {
        "temperature": 0.7,
        "max_tokens": 5,
        "top_p": 1.0,
        "top_k": 0,
        "logprobs": 0,
        "logit_bias": {"261": -100.0, "7": 2.0},
        "min_p": 0.1,
    }
    assert "logit_bias" not in Sampling().params([])
    assert logit_bias([5, 3, 5]) == {"3": -100.0, "5": -100.0}


def test_retry_policy_backoff_is_bounded_full_jitter():
    import random

    policy = RetryPolicy(initial_backoff_s=0.5, max_backoff_s=4.0)
    rng = random.Random(0)
    for attempt, cap in ((1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (9, 4.0)):
        delays = [policy.delay(attempt, rng=rng) for _ in range(200)]
        assert 0 <= min(delays) and max(delays) <= cap and max(delays) > cap * 0.8
    assert policy.delay(3, retry_after=1.5) == 1.5 and policy.delay(3, retry_after=60) == 4.0
    assert parse_retry_after("2") == 2.0 and parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


def test_training_samples_carry_the_sampling_temperature():
    """The trainer's check (trainer_lib.check_sampling_temperature) reads it from the sample."""
    import msgspec

    from protocol.structs import TrainingSample, decode_sample, encode

    rollouts = [Rollout([1], [2], [-0.1], "length", None, "v", temperature=t) for t in (1.0, 0.7, 0.0)]
    samples = [r.to_training_sample() for r in rollouts]
    assert [s.sampling_temperature for s in samples] == [1.0, 0.7, 0.0]
    assert all(decode_sample(encode(s)) == s for s in samples)
    without = TrainingSample.from_rollout([1], [2], [-0.1])
    assert without.sampling_temperature is None
    wire = msgspec.msgpack.decode(encode(without))
    assert len(wire) == 9 and wire[8] is None
    assert decode_sample(msgspec.msgpack.encode(wire[:8])) == without  # a sample of before: None


# --- the calls' logic, both transports, against scripted answers (httpx.MockTransport) -------------


def _scripted(script: list):
    """An httpx handler answering ``script``'s items in order (then the last one): a weight version
    (a 200 with one token), or an ``(HTTP status, error body)``."""
    import httpx

    seen = []

    def handler(request):
        item = script[min(len(seen), len(script) - 1)]
        seen.append(request)
        if isinstance(item, tuple):
            return httpx.Response(item[0], json=item[1])
        choice = {"token_ids": [7], "logprobs": {"content": [{"logprob": -0.5}]}, "finish_reason": "length"}
        body = {"request_id": f"r{len(seen)}", "choices": [choice]}
        return httpx.Response(200, json=body, headers={"x-mmref-weight-version": item})

    return handler, seen


def _run(mode: str, handler, call, model_dir="unused", **options):
    """``call(client)`` on a RolloutClient (sync) or an AsyncRolloutClient (awaited) over ``handler``
    (``options`` override the client's arguments)."""
    import asyncio

    import httpx

    from rollout_client import AsyncRolloutClient, RolloutClient

    fast = RetryPolicy(max_attempts=4, initial_backoff_s=0.0, max_backoff_s=0.0)
    kwargs = {"retry": fast, "suppress_placeholders": False, "max_concurrency": 1, **options}
    if mode == "sync":
        http = httpx.Client(transport=httpx.MockTransport(handler))
        return call(RolloutClient("http://x", model_dir, "unused", http_client=http, **kwargs))

    async def run():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        async with http:
            return await call(AsyncRolloutClient("http://x", model_dir, "unused", http_client=http, **kwargs))

    return asyncio.run(run())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_drain_timeout_is_retried_and_other_refusals_are_not(mode):
    from protocol.errors import DrainTimeout, HashMismatch
    from rollout_client import RetriesExhausted
    from vllm_plugin.protocol import error_body

    drain = (503, error_body(DrainTimeout("still running"), "still running"))
    handler, seen = _scripted([drain, drain, "v1"])
    rollout = _run(mode, handler, lambda c: c.generate_tokens([1, 2], (), Sampling(max_tokens=1)))
    assert rollout.attempts == 3 == len(seen) and rollout.weight_version == "v1"
    handler, seen = _scripted([drain])
    with pytest.raises(RetriesExhausted) as info:
        _run(mode, handler, lambda c: c.generate_tokens([1, 2]))
    assert len(seen) == 4 and isinstance(info.value.__cause__, DrainTimeout)
    handler, seen = _scripted([(409, error_body(HashMismatch("other bytes"), "other bytes"))])
    with pytest.raises(HashMismatch):
        _run(mode, handler, lambda c: c.generate_tokens([1, 2]))
    assert len(seen) == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_group_straddling_an_update_is_drawn_again_under_the_new_version(mode, qwen2_vl_dir):
    """Two answers under ``old`` then ``new`` (a push between them): the two old samples are drawn
    again; an expected version is waited for."""
    handler, seen = _scripted(["old", "old", "new"])
    text = [{"role": "user", "content": "Hi."}]
    group = _run(mode, handler, lambda c: c.sample_group(text, 4, one_version=True), qwen2_vl_dir)
    assert [r.weight_version for r in group] == ["new"] * 4 and len(seen) == 6
    assert {r.session_id for r in group} == {seen[0].headers["x-session-id"]}
    handler, seen = _scripted(["old", "old", "new"])
    rollout = _run(mode, handler, lambda c: c.generate_tokens([1], expected_weight_version="new"))
    assert rollout.attempts == 3 and rollout.weight_version == "new"


def test_version_clock_orders_by_receipt_not_by_recording():
    from rollout_client.versions import VersionClock

    clock = VersionClock()
    clock.observe("new", received_at=2.0)
    clock.observe("old", received_at=1.0)  # received first, recorded late
    assert clock.latest == "new"
    group = [Rollout([1], [2], [-0.1], "length", None, v) for v in ("old", "new", "old")]
    assert clock.stale(group) == [0, 2] and clock.stale(group[1:2]) == []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failed_sample_ends_its_group(mode, qwen2_vl_dir):
    """The first sample refused (400) ends the call at once; the others, slow 503s that would be
    retried, start no attempt after it (the async client cancels them, the sync one lets the
    attempt in flight end)."""
    import asyncio
    import threading
    import time

    import httpx

    from rollout_client import ServerRefusal

    seen, lock = [], threading.Lock()

    def answer(request):
        with lock:
            seen.append(request)
            first = len(seen) == 1
        if first:
            return None, httpx.Response(400, json={"error": {"message": "bad", "code": 400}})
        return 1.0, httpx.Response(503, json={"error": {"message": "busy", "code": 503}})

    def sync_handler(request):
        delay, response = answer(request)
        time.sleep(delay or 0)
        return response

    async def async_handler(request):
        delay, response = answer(request)
        await asyncio.sleep(delay or 0)
        return response

    handler = sync_handler if mode == "sync" else async_handler
    text = [{"role": "user", "content": "Hi."}]
    started = []

    def call(client):
        client.prepare(text)  # the template and tokenizer loaded: only the group is timed
        started.append(time.monotonic())
        return client.sample_group(text, 4)

    with pytest.raises(ServerRefusal):
        _run(mode, handler, call, qwen2_vl_dir, max_concurrency=4)
    assert time.monotonic() - started[0] < 0.9  # not after the others' 1 s answers
    time.sleep(1.5)
    assert len(seen) <= 4  # each sample's first attempt at most (a sync one may not have started): no retry


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_group_is_drawn_at_most_max_attempts_times(mode, qwen2_vl_dir):
    """Versions that never settle (answers alternate a, b): 4 draws in all (4 + 2 + 1 + 3 requests,
    module comment in the test), then WeightVersionMismatch."""
    import httpx

    from rollout_client import WeightVersionMismatch

    seen = []

    def handler(request):
        seen.append(request)
        choice = {"token_ids": [7], "logprobs": {"content": [{"logprob": -0.5}]}, "finish_reason": "length"}
        version = "ab"[(len(seen) - 1) % 2]
        return httpx.Response(200, json={"choices": [choice]}, headers={"x-mmref-weight-version": version})

    # draw 1: a b a b (newest b) -> redraw 0, 2: a b -> [a b b b] -> redraw 0: a (newest a)
    # -> redraw 1, 2, 3: b a b -> [a b a b]: still mixed after 4 draws
    text = [{"role": "user", "content": "Hi."}]
    with pytest.raises(WeightVersionMismatch):
        _run(mode, handler, lambda c: c.sample_group(text, 4), qwen2_vl_dir)
    assert len(seen) == 10


def test_a_group_has_one_deadline(qwen2_vl_dir):
    """Redraws share the call's deadline: answers of 0.3 s in versions that never settle, a 1 s
    deadline: RolloutTimeout after about 4 requests, not the 10 of four full draws."""
    import time

    import httpx

    from rollout_client import RolloutTimeout

    seen = []

    def handler(request):
        seen.append(request)
        time.sleep(0.3)
        choice = {"token_ids": [7], "logprobs": {"content": [{"logprob": -0.5}]}, "finish_reason": "length"}
        version = "ab"[(len(seen) - 1) % 2]
        return httpx.Response(200, json={"choices": [choice]}, headers={"x-mmref-weight-version": version})

    policy = RetryPolicy(max_attempts=4, initial_backoff_s=0.0, max_backoff_s=0.0, deadline_s=1.0)
    text = [{"role": "user", "content": "Hi."}]

    def call(client):
        client.prepare(text)  # the template and tokenizer loaded before the call's clock starts
        return client.sample_group(text, 4)

    with pytest.raises(RolloutTimeout):
        _run("sync", handler, call, qwen2_vl_dir, retry=policy)
    assert 1 <= len(seen) < 10  # the draws stopped at the call's deadline, not after four full draws


def test_no_free_connection_is_retried_and_bare_ref_strings_do_not_make_a_sample():
    import httpx

    from rollout_client.wire import Retry, read_answer

    outcome = read_answer(httpx.PoolTimeout("no connection"), expected_version=None, retry_statuses={503})
    assert isinstance(outcome, Retry) and outcome.status is None  # never sent: sent again
    rollout = Rollout([1, 2], [3], [-0.1], "length", None, "v", ("mmraw:abc",))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="RawMMRef"):
        rollout.to_training_sample()
