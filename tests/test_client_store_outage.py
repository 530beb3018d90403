"""A store outage as the rollout client reports it (issue 47), on scripted answers: every attempt
answered the plugin's 503 ``store_unavailable`` (its ``Retry-After`` honoured up to the policy's
cap), so the client raises what is both the protocol's ``StoreUnavailable`` and
``RetriesExhausted`` with the attempts made. Through vllm-router on real replicas:
``tests/test_fleet.py``."""

from __future__ import annotations

import asyncio
import pickle
import time

import httpx
import pytest

from protocol.errors import StoreUnavailable
from rollout_client import AsyncRolloutClient, RetriesExhausted, RetryPolicy, RolloutClient
from rollout_client.errors import StoreUnavailableRetriesExhausted
from vllm_plugin.protocol import error_body

REFUSAL = StoreUnavailable("the bucket could not be asked", ref="mmraw:v2:ab")
POLICY = RetryPolicy(max_attempts=3, initial_backoff_s=0.0, max_backoff_s=0.2)


def run(mode: str, handler):
    options = {"retry": POLICY, "suppress_placeholders": False}
    if mode == "sync":
        http = httpx.Client(transport=httpx.MockTransport(handler))
        return RolloutClient("http://x", "unused", "unused", http_client=http, **options).generate_tokens(
            [1, 2]
        )

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            client = AsyncRolloutClient("http://x", "unused", "unused", http_client=http, **options)
            return await client.generate_tokens([1, 2])

    return asyncio.run(go())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_store_outage_raises_store_unavailable_with_the_attempts_made(mode):
    seen = []

    def handler(request):
        seen.append(request)
        return httpx.Response(503, json=error_body(REFUSAL, REFUSAL.message), headers={"Retry-After": "1"})

    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        run(mode, handler)
    error = info.value
    assert isinstance(error, RetriesExhausted) and error.attempts == 3 == len(seen)
    assert error.last_status == 503 and error.code == "store_unavailable" and error.ref == REFUSAL.ref
    assert type(error.__cause__) is StoreUnavailable and "store_unavailable" in str(error)
    assert time.monotonic() - start >= 0.4  # two waits: Retry-After 1 s, capped at max_backoff_s
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is StoreUnavailableRetriesExhausted and (copy.attempts, copy.ref) == (3, REFUSAL.ref)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_untyped_503_is_retries_exhausted_only(mode):
    """vllm-router's own 503 ("No available workers", text/plain) is no store outage."""

    def handler(request):
        return httpx.Response(503, text="No available workers (all circuits open or unhealthy)")

    with pytest.raises(RetriesExhausted) as info:
        run(mode, handler)
    assert not isinstance(info.value, StoreUnavailable) and info.value.__cause__ is None


def test_the_refusal_says_when_asking_again_can_help():
    """The server's side: a root found down is held down ``hold_down_s``; the refusal carries
    that (the plugin's ``Retry-After``), then what is left of it; the roots' refusal the least."""
    from protocol.roots import AssetRoots, ObjectRoot, StoreClientConfig

    client = StoreClientConfig(
        timeout_s=0.5, connect_timeout_s=0.5, max_retries=0, allow_http=True, hold_down_s=2
    )
    down = ObjectRoot("s3://bucket/p", client, endpoint="http://127.0.0.1:9")  # nothing listens on 9
    key = "images/" + "ab" * 8 + ".png"
    with pytest.raises(StoreUnavailable) as first:
        down.get(key, max_bytes=1 << 20)
    with pytest.raises(StoreUnavailable) as held:
        down.get(key, max_bytes=1 << 20)
    assert first.value.retry_after_s == 2 and 0 < held.value.retry_after_s < 2
    with pytest.raises(StoreUnavailable) as both:
        AssetRoots([down]).read_content("ab" * 32, ".png")
    assert 0 < both.value.retry_after_s <= held.value.retry_after_s
    never = ObjectRoot(
        "s3://bucket/p",
        StoreClientConfig(allow_http=True, max_retries=0, hold_down_s=0),
        endpoint="http://127.0.0.1:9",
    )
    with pytest.raises(StoreUnavailable) as info:
        never.get(key, max_bytes=1 << 20)
    assert info.value.retry_after_s is None  # no hold-down: nothing to wait for
