"""Two plugin replicas behind vllm-router (issue 28, the README's "Fleet" commands), one S3 bucket.

A real S3 endpoint (moto's server, its own process), two real vLLM servers with the plugin and
real vllm-router in front (``--policy consistent_hash``: the ``X-Session-ID`` header picks the
replica). Each party reads the bucket its own way: replica A a local mount first, then S3 (with a
node read cache); replica B S3 only, through a TCP proxy the tests slow down or cut; the rollout
side offloads to S3 only; the trainer reads a local mount (a copy of the bucket).

What is shown: an RL group under one ``X-Session-ID`` lands on one replica (its resolve-cache
counters on /metrics); streaming through the router; a cache handle minted on one replica served
on the other with the same tokens; the store faults on the plugin (endpoint down 503 with the
server up, object deleted 404, replaced 409, slow 503 within the deadline); msgpack behind the
router (415, the router's); a typed refusal counted once fleet-wide (never retried by the router);
the store stopped for both replicas (issue 47): the typed 503 through the router, text-only
requests 200 on both replicas throughout, the rollout client's ``StoreUnavailable``, all 200 once
it is back; what the router does with each of the plugin's answers under the README's flags and
the old ones, side by side; an image key's S3 URL on the chat route served as its data URL (issue
27); one replica killed mid-run: what the router answers for the requests it had in flight, how
soon it leaves the ring, and every group of a client that retries those answers completes on the
other replica. Every router here runs the README's flags (``fleet_helpers.ROUTER_FLAGS``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest

from fleet_helpers import (
    DEADLINE_S,
    GREEDY,
    HOLD_DOWN_S,
    LONG,
    OLD_ROUTER_FLAGS,
    PAD,
    STORE,
    TEXT,
    Fleet,
    body,
    by_handle,
    counters,
    delta,
    kill,
    metric,
    offload,
    post,
    resolved_hash,
    s3_offloader,
    start_router,
    store_key,
    through,
    tokens,
    unique_image,
    wait_running,
)
from helpers import SERVER_ARGS, DelayProxy, refusal, tokens_and_logprobs, warm_up
from vllm_server import start_server

if sys.version_info < (3, 11):
    pytest.skip("obstore (the fleet extra) needs Python >= 3.11", allow_module_level=True)
import obstore  # a dev dependency on 3.11+: a missing install fails here, not skips

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def fleet(moto_s3, qwen2_vl_dir, tmp_path_factory) -> Iterator[Fleet]:
    from obstore.store import from_url

    work = tmp_path_factory.mktemp("fleet")
    bucket = f"fleet-{uuid.uuid4().hex[:8]}"
    moto_s3.make_bucket(bucket)
    s3 = f"s3://{bucket}/fleet"
    proxy, proxy_a = DelayProxy(moto_s3.port), DelayProxy(moto_s3.port)
    mount_a, trainer_mount = work / "mount-a", work / "trainer-mount"
    common = {**STORE, "MMREF_STORE_ALLOW_HTTP": "1"}
    env_a = {**moto_s3.env(proxy_a.url), **common, "MMREF_ASSET_ROOTS": f"{mount_a},{s3}",
             "MMREF_READ_CACHE_DIR": str(work / "cache-a")}  # fmt: skip
    env_b = {**moto_s3.env(proxy.url), **common, "MMREF_ASSET_ROOTS": s3}
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        stack.callback(proxy.close)
        stack.callback(proxy_a.close)
        stack.enter_context(moto_s3.environment())  # this process offloads to S3 and edits the bucket
        starting = [
            pool.submit(
                start_server, qwen2_vl_dir, None, work / f"{name}.log", extra_args=SERVER_ARGS, extra_env=env
            )
            for name, env in (("a", env_a), ("b", env_b))
        ]
        results = [f.exception() or f.result() for f in starting]  # both started (or failed)
        for server in results:
            if not isinstance(server, BaseException):
                stack.callback(server.stop)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        a, b = results
        warm_up(a)
        warm_up(b)
        router, process = start_router([a.url, b.url], work / "router.log")
        stack.callback(process.kill)
        handle = from_url(f"s3://{bucket}", client_options={"allow_http": True})
        yield Fleet(a, b, router, process, proxy, proxy_a, s3, handle, mount_a, trainer_mount)


@pytest.fixture(scope="module")
def sessions(fleet) -> dict[str, list[str]]:
    """Two ``X-Session-ID`` values the router sends to each replica (found by asking: the ring
    depends on the replicas' ports)."""
    found: dict[str, list[str]] = {"a": [], "b": []}
    probe = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}}
    for k in range(64):
        before = counters(fleet, "vllm:request_success_total")
        post(fleet.router, probe, f"s{k}").raise_for_status()
        (where,) = [r for r, d in delta(counters(fleet, "vllm:request_success_total"), before).items() if d]
        found[where].append(f"s{k}")
        if min(len(v) for v in found.values()) >= 2:
            return found
    raise AssertionError(f"the router used one replica for 64 sessions: {found}")


# --- routing ---------------------------------------------------------------------------------------


def test_an_rl_group_lands_on_one_replica(fleet, qwen2_vl_dir, qwen2_vl_adapter):
    """Each group of 8 (the rollout client: one ``X-Session-ID`` per group, its 8 requests at
    once) is resolved once on one replica: that replica's resolve cache counts 1 miss and 7
    hits, the other replica's nothing."""
    from rollout_client import RolloutClient, Sampling

    with RolloutClient(
        fleet.router, qwen2_vl_dir, fleet.mount_a, offloader=s3_offloader(fleet, qwen2_vl_adapter)
    ) as client:
        for g in range(3):
            messages = [{"role": "user", "content": [{"type": "image", "image": unique_image(f"group{g}")},
                                                     {"type": "text", "text": "What is it?"}]}]  # fmt: skip
            misses, hits = (
                counters(fleet, "mmref_cache_misses_total"),
                counters(fleet, "mmref_cache_hits_total"),
            )
            group = client.sample_group(messages, 8, Sampling(max_tokens=4))
            assert len(group) == 8 and all(r.completion_ids for r in group)
            got = (delta(counters(fleet, "mmref_cache_misses_total"), misses),
                   delta(counters(fleet, "mmref_cache_hits_total"), hits))  # fmt: skip
            assert sorted(zip(*(sorted(d.items()) for d in got), strict=True)) in (
                [(("a", 0.0), ("a", 0.0)), (("b", 1.0), ("b", 7.0))],
                [(("a", 1.0), ("a", 7.0)), (("b", 0.0), ("b", 0.0))],
            ), got


def test_streaming_through_the_router(fleet, qwen2_vl_adapter, sessions):
    ref = offload(fleet, qwen2_vl_adapter, "stream1")
    whole = tokens(post(fleet.router, body(ref, max_tokens=8), sessions["b"][0]))
    r = post(fleet.router, {**body(ref, max_tokens=8), "stream": True}, sessions["b"][0])
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = [t for e in events[:-1] for ch in json.loads(e)["choices"] for t in ch["token_ids"]]
    assert streamed == whole and r.headers["x-mmref-weight-version"]


def test_msgpack_behind_the_router_is_the_routers_415(fleet, qwen2_vl_adapter, sessions):
    """vllm-router reads JSON bodies only (it rewrites them): a msgpack body is refused by the
    router itself, in plain text, before any replica sees it. Straight to a replica, it is served."""
    ref = offload(fleet, qwen2_vl_adapter, "msgpack1")
    packed = msgspec.msgpack.encode(body(ref))
    headers = {"content-type": "application/msgpack", "X-Session-ID": sessions["a"][0]}
    before = counters(fleet, "vllm:request_success_total")
    r = httpx.post(f"{fleet.router}/inference/v1/generate", content=packed, headers=headers, timeout=60)
    assert r.status_code == 415 and r.headers["content-type"].startswith("text/plain"), r.text
    assert "application/json" in r.text
    assert delta(counters(fleet, "vllm:request_success_total"), before) == {"a": 0.0, "b": 0.0}
    direct = httpx.post(f"{fleet.a.url}/inference/v1/generate", content=packed, headers=headers, timeout=60)
    assert tokens(direct) == tokens(post(fleet.a.url, body(ref)))


def test_a_typed_refusal_reaches_one_replica_once(fleet, qwen2_vl_adapter, sessions):
    """The router sends a 5xx again to every replica; the plugin answers each refusal with a
    typed 4xx, which the router passes through: one request, one replica, counted once."""
    ref = offload(fleet, qwen2_vl_adapter, "refused1")
    short = body(ref)
    short["token_ids"] = [t for i, t in enumerate(short["token_ids"]) if i != 3]  # one placeholder short
    gone = offload(fleet, qwen2_vl_adapter, "gone2")
    obstore.delete(fleet.bucket, f"fleet/{store_key(gone)}")
    for payload, status, code in ((short, 422, "placeholder_mismatch"), (body(gone), 404, "asset_not_found")):
        for session in (sessions["a"][0], sessions["b"][0]):
            before = counters(fleet, "mmref_ref_errors_total", code=code)
            assert refusal(post(fleet.router, payload, session)) == (status, code)
            assert sum(delta(counters(fleet, "mmref_ref_errors_total", code=code), before).values()) == 1


# --- cache handles on any replica ------------------------------------------------------------------


def test_a_handle_minted_on_one_replica_is_served_on_the_other(fleet, qwen2_vl_adapter, sessions):
    """A ``null`` slot naming an image hash that replica A minted: replica B, which never saw the
    image, resolves it from the bucket (the hash names the content), checks the binding under its
    own fingerprint, pixel mode and weight version, and answers A's tokens; through the router too."""
    ref = offload(fleet, qwen2_vl_adapter, "handle1")
    minted = resolved_hash(fleet.a.url, ref)
    assert minted.startswith(f"mmref-{ref.sha256}.jpg-") or minted.startswith(f"mmref-{ref.sha256}.png-")
    on_a = tokens(post(fleet.a.url, body(ref)))
    misses = counters(fleet, "mmref_cache_misses_total")
    assert tokens(post(fleet.b.url, by_handle(ref, minted))) == on_a
    assert delta(counters(fleet, "mmref_cache_misses_total"), misses) == {"a": 0.0, "b": 1.0}
    assert tokens(post(fleet.b.url, by_handle(ref, minted))) == on_a  # now held by B's engine
    # the other way, through the router: minted on B, sent under a session the router gives A
    other = offload(fleet, qwen2_vl_adapter, "handle2")
    minted_b = resolved_hash(fleet.b.url, other)
    on_b = tokens(post(fleet.b.url, body(other)))
    assert tokens(post(fleet.router, by_handle(other, minted_b), sessions["a"][0])) == on_b


def test_resolve_of_a_handle_with_null_kwargs_data_encodes_it_from_the_bucket(fleet, qwen2_vl_adapter):
    """``kwargs_data: null`` (vLLM's form of "every item cached") naming a handle replica B never
    held: ``/inference/v1/resolve`` reads the image from the bucket and answers the item A encodes
    (once a 500: the null was filled in place)."""
    ref = offload(fleet, qwen2_vl_adapter, "handle4")
    request = by_handle(ref, resolved_hash(fleet.a.url, ref))
    del request["sampling_params"]
    request["features"]["kwargs_data"] = None
    on_b = httpx.post(f"{fleet.b.url}/inference/v1/resolve", json=request)
    assert on_b.status_code == 200, on_b.text[:300]
    plain = body(ref)
    del plain["sampling_params"]
    on_a = httpx.post(f"{fleet.a.url}/inference/v1/resolve", json=plain)
    import torch
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

    (item,) = on_b.json()["features"]["kwargs_data"]["image"]
    (reference,) = on_a.json()["features"]["kwargs_data"]["image"]
    mine, theirs = decode_mm_kwargs_item(item), decode_mm_kwargs_item(reference)
    assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k].data, theirs[k].data) for k in mine)


def test_a_handle_under_other_weights_or_opaque_is_not_cached(fleet, qwen2_vl_adapter):
    ref = offload(fleet, qwen2_vl_adapter, "handle3")
    minted = resolved_hash(fleet.a.url, ref)
    other_version = minted[:-32] + hashlib.sha256(b"another version").hexdigest()[:32]
    feature_like = "mmref-" + hashlib.sha256(b"a feature file's payload").hexdigest()
    for server in (fleet.a, fleet.b):
        for mm_hash in (other_version, feature_like):
            assert refusal(post(server.url, by_handle(ref, mm_hash))) == (404, "not_cached")
    many = by_handle(ref, minted)  # 65 image handles: stock's --limit-mm-per-prompt refuses them here
    many["features"] = {k: {"image": v["image"] * 65} for k, v in many["features"].items()}
    assert refusal(post(fleet.b.url, many))[0] == 400  # (MMREF_MAX_REFS_PER_REQUEST counts them too)
    obstore.delete(fleet.bucket, f"fleet/{store_key(ref)}")  # the content is gone: a handle B never held
    assert refusal(post(fleet.b.url, by_handle(ref, minted))) == (404, "asset_not_found")


# --- the store's faults, on the S3-only replica ----------------------------------------------------


def test_store_endpoint_down_is_503_and_the_replica_stays_up(fleet, qwen2_vl_adapter):
    """B's way to the store cut (A's is not): B answers a new image 503 within its deadline, stays
    healthy, and serves what it resolved before."""
    held, lost = offload(fleet, qwen2_vl_adapter, "down1"), offload(fleet, qwen2_vl_adapter, "down2")
    before = tokens(post(fleet.b.url, body(held)))
    fleet.proxy.close()
    try:
        start = time.monotonic()
        assert refusal(post(fleet.b.url, body(lost))) == (503, "store_unavailable")
        assert time.monotonic() - start < DEADLINE_S
        assert httpx.get(f"{fleet.b.url}/health").status_code == 200
        assert tokens(post(fleet.b.url, body(held))) == before  # what it resolved before: still served
    finally:
        fleet.proxy.reopen()
    time.sleep(HOLD_DOWN_S)  # B holds the root down that long after it found it down
    assert tokens(post(fleet.b.url, body(lost)))  # the endpoint is back: served (failures are not cached)


# --- the store stopped, seen through the router (issue 47) -----------------------------------------


def test_a_store_outage_through_the_router(fleet, qwen2_vl_dir, qwen2_vl_adapter, sessions):
    """S3 stopped for both replicas: through the router (the README's flags), a new ref is the
    replica's own typed 503 (JSON, ``mmref_code``, ``Retry-After``), answered once by the replica
    its session names; text-only requests are 200 throughout, each on its session's replica (both
    stay in the ring); the rollout client raises ``StoreUnavailable`` after its attempts. S3 back:
    every request 200."""
    from protocol.errors import StoreUnavailable
    from rollout_client import RetriesExhausted, RetryPolicy, RolloutClient, Sampling
    from rollout_client.retry import RETRYABLE_STATUSES

    new = {name: offload(fleet, qwen2_vl_adapter, f"outage-{name}") for name in ("a", "b")}
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=2.0,
                        statuses=RETRYABLE_STATUSES | {500})  # fmt: skip
    client = RolloutClient(fleet.router, qwen2_vl_dir, fleet.mount_a, retry=retry,
                           offloader=s3_offloader(fleet, qwen2_vl_adapter))  # fmt: skip
    ask = [{"role": "user", "content": [{"type": "image", "image": unique_image("outage-client")},
                                        {"type": "text", "text": "And now?"}]}]  # fmt: skip
    client.offloader.offload(unique_image("outage-client"))  # into the bucket while it answers
    fleet.stop_store()
    timings = []
    try:
        for _ in range(3):
            for name, other in (("a", "b"), ("b", "a")):
                session = sessions[name][0]
                errors = counters(fleet, "mmref_ref_errors_total", code="store_unavailable")
                start = time.monotonic()
                r = post(fleet.router, body(new[name]), session)
                timings.append(time.monotonic() - start)
                assert refusal(r) == (503, "store_unavailable") and r.headers["retry-after"] == "1", r.text
                assert r.headers["content-type"] == "application/json"
                routed = delta(counters(fleet, "mmref_ref_errors_total", code="store_unavailable"), errors)
                assert routed == {name: 1.0, other: 0.0}  # once, on its session's replica: no retry
                served = counters(fleet, "vllm:request_success_total")
                assert tokens(post(fleet.router, TEXT, session))
                landed = delta(counters(fleet, "vllm:request_success_total"), served)
                assert landed == {name: 1.0, other: 0.0}  # still in the ring, its sessions its own
        start = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            client.generate(ask, Sampling(max_tokens=2))
        gave_up = time.monotonic() - start
        assert isinstance(info.value, RetriesExhausted) and info.value.attempts == 3
    finally:
        fleet.start_store()
    print(f"store down: typed 503 through the router in {min(timings):.2f}-{max(timings):.2f} s; "
          f"the client gave up after 3 attempts in {gave_up:.1f} s")  # fmt: skip
    time.sleep(HOLD_DOWN_S)
    for name in ("a", "b"):
        assert tokens(post(fleet.router, body(new[name]), sessions[name][0]))
    assert client.generate(ask, Sampling(max_tokens=2)).attempts == 1


def test_what_the_router_does_with_each_answer(fleet, qwen2_vl_adapter, sessions, tmp_path):
    """docs/SCALING.md §7's table, measured: each of the plugin's answers sent under a session of
    replica B through a router with the README's flags and through one with the flags before issue
    47 (:func:`fleet_helpers.through`). With the README's flags every answer is passed through
    once, as the replica gave it, and B keeps its sessions; the old flags' breaker and retries are
    what the issue measured (printed, not asserted: vLLM-router's behaviour, not ours)."""
    old, old_process = start_router([fleet.a.url, fleet.b.url], tmp_path / "old.log", OLD_ROUTER_FLAGS)
    short = body(offload(fleet, qwen2_vl_adapter, "table-short"))
    short["token_ids"] = [t for i, t in enumerate(short["token_ids"]) if i != 3]
    gone, swapped = (
        offload(fleet, qwen2_vl_adapter, "table-gone"),
        offload(fleet, qwen2_vl_adapter, "table-swap"),
    )
    obstore.delete(fleet.bucket, f"fleet/{store_key(gone)}")
    obstore.put(fleet.bucket, f"fleet/{store_key(swapped)}", unique_image("not table-swap"))
    cases = {
        (200, None): TEXT,
        (400, "invalid_ref"): {
            "token_ids": [1, 2],
            "mm_refs": ["mmraw:v2:nothing"],
            "sampling_params": GREEDY,
        },
        (404, "asset_not_found"): body(gone),
        (409, "hash_mismatch"): body(swapped),
        (422, "placeholder_mismatch"): short,
    }
    rows = []
    try:
        for flags, router in (("README", fleet.router), ("old", old)):
            for expected, payload in cases.items():
                rows.append((flags, *expected, through(fleet, router, payload, sessions["b"][0])))
            fresh = [body(offload(fleet, qwen2_vl_adapter, f"table-{flags}-{k}")) for k in range(2)]
            fleet.stop_store()
            for payload in fresh:  # the second finds B's root held down
                rows.append(
                    (flags, 503, "store_unavailable", through(fleet, router, payload, sessions["b"][0]))
                )
            fleet.start_store()
            time.sleep(HOLD_DOWN_S + 2.5)  # the hold-down, and the old breaker's 2 s
    finally:
        fleet.start_store()
        old_process.kill()
    for flags, status, code, seen in rows:
        print(f"{flags} flags | plugin {status} {code} | {seen}")
        if flags == "README":
            assert (seen.status, seen.code, seen.replica_answers) == (status, code, 1), seen
            assert (seen.next_status, seen.next_on) == (200, ["b"]), seen


def test_store_object_deleted_is_404_and_replaced_is_409(fleet, qwen2_vl_adapter):
    gone, swapped = offload(fleet, qwen2_vl_adapter, "del1"), offload(fleet, qwen2_vl_adapter, "rep1")
    obstore.delete(fleet.bucket, f"fleet/{store_key(gone)}")
    obstore.put(fleet.bucket, f"fleet/{store_key(swapped)}", unique_image("someone else"))
    assert refusal(post(fleet.b.url, body(gone))) == (404, "asset_not_found")
    replaced = post(fleet.b.url, body(swapped))
    assert refusal(replaced) == (409, "hash_mismatch") and swapped.sha256[:12] in replaced.text


def test_slow_store_is_503_within_the_deadline(fleet, qwen2_vl_adapter):
    ref = offload(fleet, qwen2_vl_adapter, "slow1")
    fleet.proxy.delay_s = 30.0
    try:
        start = time.monotonic()
        assert refusal(post(fleet.b.url, body(ref))) == (503, "store_unavailable")
        elapsed = time.monotonic() - start
    finally:
        fleet.proxy.delay_s = 0.0
        fleet.proxy.close()  # drop the held connections
        fleet.proxy.reopen()
    assert 1.0 <= elapsed < DEADLINE_S  # gave up on time: no hung request
    time.sleep(HOLD_DOWN_S)
    assert tokens(post(fleet.b.url, body(ref)))


def test_a_slow_store_holds_up_no_other_work_of_the_replica(fleet, qwen2_vl_adapter):
    """Six images of a slow store in one request: 503 within one read's deadline, and the five
    reads queued behind the first in B's worker pool end at once (the root held down) instead of
    each waiting out the deadline there: an inline item, checked in that pool, is served next
    without waiting (once ~6 s more: ~3 s per read, two workers)."""
    refs = [offload(fleet, qwen2_vl_adapter, f"queued{i}") for i in range(6)]
    held = offload(fleet, qwen2_vl_adapter, "queued-inline")
    plain = {k: v for k, v in body(held).items() if k != "sampling_params"}
    features = httpx.post(f"{fleet.a.url}/inference/v1/resolve", json=plain).json()["features"]
    features["mm_hashes"] = {"image": [hashlib.sha256(b"queued-inline").hexdigest()[:32]]}  # the client's
    inline = {"token_ids": plain["token_ids"], "features": features, "sampling_params": GREEDY}
    fleet.proxy.delay_s = 30.0
    try:
        start = time.monotonic()
        assert refusal(post(fleet.b.url, body(*refs))) == (503, "store_unavailable")
        assert time.monotonic() - start < DEADLINE_S
        start = time.monotonic()
        assert tokens(post(fleet.b.url, inline))
        assert time.monotonic() - start < 2.0
    finally:
        fleet.proxy.delay_s = 0.0
        fleet.proxy.close()
        fleet.proxy.reopen()
    time.sleep(HOLD_DOWN_S)
    assert tokens(post(fleet.b.url, body(*refs[:2])))


# --- the trainer: the same pixels from its own mount -------------------------------------------------


def test_the_trainer_materializes_what_each_replica_fed(fleet, qwen2_vl_adapter):
    """Offloaded to S3 by the rollout side; replica A reads its local mount (a copy), replica B
    the bucket, the trainer its own mount (another copy): every party gets the same pixels."""
    from protocol.errors import InvalidRequest
    from protocol.structs import TrainingSample
    from trainer_lib import MaterializeOptions, materialize
    from vllm_plugin.items import decode_item

    ref = offload(fleet, qwen2_vl_adapter, "trainer1")
    key = store_key(ref)
    data = bytes(obstore.get(fleet.bucket, f"fleet/{key}").bytes())
    for mount in (fleet.mount_a, fleet.trainer_mount):
        (mount / "images").mkdir(parents=True, exist_ok=True)
        (mount / key).write_bytes(data)
    ids = body(ref)["token_ids"]
    sample = TrainingSample.from_rollout(ids, [5, 6], [-1.0, -1.0], [ref])
    for server in (fleet.a, fleet.b):
        r = httpx.post(f"{server.url}/inference/v1/resolve", json={"token_ids": ids, "mm_refs": [ref.ref]})
        assert r.status_code == 200, r.text[:300]
        item = decode_item(r.json()["features"]["kwargs_data"]["image"][0], InvalidRequest, "served item")
        raw = r.json()["pixel_mode"] == "raw"
        batch = materialize(
            [sample], qwen2_vl_adapter, fleet.trainer_mount, MaterializeOptions(raw_pixels=raw)
        )
        assert batch.stats.processed == 1
        assert batch.features["pixel_values"].dtype == item["pixel_values"].data.dtype
        assert (batch.features["pixel_values"].double() - item["pixel_values"].data.double()).abs().max() == 0


# --- object-store URLs on the chat route (issue 27) ----------------------------------------------------


def chat(server, url: str) -> httpx.Response:
    """A greedy chat completion with one image part of ``url``, logprobs on."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Describe the picture."}]}]  # fmt: skip
    payload = {"model": str(server.model), "messages": messages, "temperature": 0, "max_tokens": 4,
               "logprobs": True, "return_token_ids": True}  # fmt: skip
    return httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=120)


def test_an_object_store_url_under_the_roots_is_served_like_its_data_url(fleet, qwen2_vl_adapter):
    """Replica B reads S3 only: the URL of the image's key under its root gives the data URL's
    tokens and logprobs (the part keyed by the plugin, as a ref), on the chat route and in the
    generate route's ``content_parts``; a key whose bytes were replaced is the typed 409 on both;
    a key under no configured root is not the plugin's (vLLM's own refusal, never a read of that
    bucket)."""
    import base64

    ref = offload(fleet, qwen2_vl_adapter, "url1")
    url = f"{fleet.s3}/{store_key(ref)}"
    data = "data:image/png;base64," + base64.b64encode(unique_image("url1")).decode()
    assert tokens_and_logprobs(chat(fleet.b, url)) == tokens_and_logprobs(chat(fleet.b, data))
    # the generate route's content_parts too (one placeholder, vLLM expands it; the keying itself:
    # tests/plugin/test_connector.py, in process)
    parts = {"token_ids": [1, 259, PAD, 260, 2], "sampling_params": {**GREEDY, "logprobs": 0}}
    by_url = post(fleet.b.url, {**parts, "content_parts": [{"type": "image_url", "url": url}]})
    by_data = post(fleet.b.url, {**parts, "content_parts": [{"type": "image_url", "url": data}]})
    assert tokens_and_logprobs(by_url) == tokens_and_logprobs(by_data)

    swapped = offload(fleet, qwen2_vl_adapter, "url2")
    obstore.put(fleet.bucket, f"fleet/{store_key(swapped)}", unique_image("someone else's"))
    assert refusal(chat(fleet.b, f"{fleet.s3}/{store_key(swapped)}")) == (409, "hash_mismatch")
    swapped_part = [{"type": "image_url", "url": f"{fleet.s3}/{store_key(swapped)}"}]
    assert refusal(post(fleet.b.url, {**parts, "content_parts": swapped_part})) == (409, "hash_mismatch")
    outside = url.replace(fleet.s3, fleet.s3 + "-other")
    status, code = refusal(chat(fleet.b, outside))
    assert 400 <= status < 500 and code is None


# --- one replica killed mid-run (last: B stays dead) ---------------------------------------------


def test_a_replica_killed_mid_run_loses_nothing(fleet, qwen2_vl_dir, qwen2_vl_adapter, sessions):
    """Replica B is killed (SIGKILL, engine included) with requests of both replicas' sessions in
    flight through the router (the README's flags: no breaker, no router retries). Measured: a
    request B never answered, and one that reaches the router after the kill and before B fails its
    health check, gets the router's 500 "Request failed" in plain text (a stream B had begun would
    end without ``[DONE]``: a transport error); the rollout client here retries 500 too, and every
    request of every session is answered in full. B leaves the ring on its failed health check:
    B's sessions are A's within seconds of the kill.
    """
    from rollout_client import RetryPolicy, RolloutClient, Sampling
    from rollout_client.retry import RETRYABLE_STATUSES

    retry = RetryPolicy(max_attempts=8, initial_backoff_s=0.2, max_backoff_s=1.0, deadline_s=300,
                        statuses=RETRYABLE_STATUSES | {500})  # fmt: skip
    ref = offload(fleet, qwen2_vl_adapter, "kill1")
    bare: list[tuple[int | str, str]] = []  # requests on B with no retry: what the router answers

    def send_bare(stream: bool) -> None:
        try:
            r = post(fleet.router, {**body(ref, **LONG), "stream": stream}, sessions["b"][0])
            done = r.text.rstrip().endswith("data: [DONE]") if stream else r.status_code == 200
            bare.append((r.status_code, f"{'stream' if stream else 'json'} done={done}: {r.text[-160:]!r}"))
        except httpx.HTTPError as e:
            bare.append((type(e).__name__, str(e)[:160]))

    messages = [{"role": "user", "content": [{"type": "image", "image": unique_image("kill2")},
                                             {"type": "text", "text": "And this?"}]}]  # fmt: skip
    offloader = s3_offloader(fleet, qwen2_vl_adapter)
    with RolloutClient(fleet.router, qwen2_vl_dir, fleet.mount_a, offloader=offloader, retry=retry) as client:
        runs = [(s, k) for s in (*sessions["a"], *sessions["b"]) for k in range(3)]
        with ThreadPoolExecutor(len(runs) + 2) as pool:
            bares = [pool.submit(send_bare, stream) for stream in (False, True)]
            futures = [
                pool.submit(
                    client.generate,
                    messages,
                    Sampling(temperature=1.0, max_tokens=192, extra={"ignore_eos": True}),
                    session_id=s,
                )
                for s, _ in runs
            ]
            wait_running(fleet.b)
            kill(fleet.b)
            killed = time.monotonic()
            while post(fleet.router, TEXT, sessions["b"][0]).status_code != 200:  # B still in the ring
                assert time.monotonic() - killed < 30, "the router never took the dead replica out"
            out_after = time.monotonic() - killed
            rollouts = [f.result(timeout=280) for f in futures]
            for f in bares:
                f.result(timeout=120)
    assert all(len(r.completion_ids) == LONG["max_tokens"] for r in rollouts)  # nothing lost
    retried = [r.attempts for r in rollouts if r.attempts > 1]
    print(f"killed B: out of the ring {out_after:.1f} s after the kill; {len(retried)} of {len(rollouts)} "
          f"requests sent again by the client; bare: {bare}")  # fmt: skip
    for status, text in bare:  # answered in full, or a clean failure: never a 200 JSON cut short
        assert "done=True" in text or status == "RemoteProtocolError" or int(status) >= 500, bare
    # B's sessions are A's now
    before = metric(fleet.a.url, "vllm:request_success_total")
    for session in sessions["b"]:
        assert tokens(post(fleet.router, body(ref), session))
    assert metric(fleet.a.url, "vllm:request_success_total") - before == len(sessions["b"])
