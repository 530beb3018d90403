"""Resolved refs reach the engine as items or as cache handles through vLLM's own sender cache, in
step with the engine's receiver cache, on a real server whose receiver cache holds only a few items.

Each round: N concurrent first uses of a new image (some streamed), one request whose two slots name
the new image in reverse prompt order, reuses of older images (some still held, some evicted), and,
in some rounds, ``/reset_mm_cache`` or ``/pause?clear_cache=true`` + ``/resume`` fired in the middle
of the burst. Every request is answered 200 with the tokens the session server gives the same body
one at a time (a request the pause aborted: a prefix of them), the engine logs no cache miss
(a handle for an item it does not hold), and handles were used (vLLM's ``vllm:mm_cache_hits``).
"""

from __future__ import annotations

import asyncio
import io
import random
import re
import time
from collections.abc import Iterator

import httpx
import msgspec
import numpy as np
import pytest
from PIL import Image

from helpers import SERVER_ARGS, VLLMServer, photo_array, served

pytestmark = [pytest.mark.server, pytest.mark.timeout(1500)]

PAD = 261
ROUNDS = 18
FIRST_USES = 8
SAMPLING = {"temperature": 0, "max_tokens": 3}
RECEIVER_GB = "0.0005"
"""~537 kB: seven 112x112 items (75 kB of uint8 pixels each): the engine evicts during the test."""


@pytest.fixture(scope="module")
def handles_server(qwen2_vl_dir, output_root, tmp_path_factory) -> Iterator[VLLMServer]:
    log = tmp_path_factory.mktemp("handles") / "server.log"
    with served(
        qwen2_vl_dir,
        output_root,
        log,
        extra_args=(*SERVER_ARGS, "--mm-processor-cache-gb", RECEIVER_GB),
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_mm_cache, /pause, /resume
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def images(asset_root, qwen2_vl_adapter) -> list:
    """ROUNDS + 1 distinct real-photo crops, 112x112 JPEG, offloaded: RawMMRef each."""
    from protocol.adapters import offload_image

    rng = np.random.default_rng(7)
    names = ("astronaut", "coffee", "chelsea", "rocket")
    refs = []
    for k in range(ROUNDS + 1):
        photo = photo_array(names[k % len(names)])
        h, w = photo.shape[:2]
        y, x = int(rng.integers(0, h // 2)), int(rng.integers(0, w // 2))
        crop = Image.fromarray(np.ascontiguousarray(photo[y : y + h // 2, x : x + w // 2]))
        buf = io.BytesIO()
        crop.resize((112, 112), Image.Resampling.BICUBIC).save(buf, format="JPEG", quality=90)
        refs.append(offload_image(buf.getvalue(), asset_root, qwen2_vl_adapter))
    assert len({r.sha256 for r in refs}) == len(refs)
    return refs


def by_ref(ref, **extra) -> dict:
    ids = [1, 259, *[PAD] * ref.num_placeholders, 260, 2]
    return {"token_ids": ids, "mm_refs": [ref.ref], "sampling_params": SAMPLING, **extra}


def reversed_slots(ref) -> dict:
    """Two slots naming ``ref``, the first one placed after the second in the prompt."""
    n = ref.num_placeholders
    ids = [1, *[PAD] * n, 7, *[PAD] * n, 2]
    features = {
        "mm_hashes": {"image": ["a" * 64, "b" * 64]},
        "mm_placeholders": {"image": [{"offset": n + 2, "length": n}, {"offset": 1, "length": n}]},
        "kwargs_data": {"image": [ref.ref, ref.ref]},
    }
    return {"token_ids": ids, "features": features, "sampling_params": SAMPLING}


async def answer(client: httpx.AsyncClient, body: dict) -> tuple[list[int], str]:
    """``(token ids, finish reason)`` of a generate answer, streamed or not; asserts 200."""
    await asyncio.sleep(random.uniform(0, 0.02))
    r = await client.post("/inference/v1/generate", json=body)
    assert r.status_code == 200, r.text[:400]
    if not body.get("stream"):
        (choice,) = r.json()["choices"]
        return choice["token_ids"], choice["finish_reason"]
    tokens, reason = [], ""
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in msgspec.json.decode(line[6:])["choices"]:
                tokens += choice["token_ids"]
                reason = choice.get("finish_reason") or reason
    return tokens, reason


async def disturb(client: httpx.AsyncClient, kind: str) -> None:
    await asyncio.sleep(random.uniform(0, 0.05))
    if kind == "reset":
        (await client.post("/reset_mm_cache")).raise_for_status()
    elif kind == "pause":
        (await client.post("/pause", params={"mode": "abort", "clear_cache": "true"})).raise_for_status()
        (await client.post("/resume")).raise_for_status()


def cache_hits(server: VLLMServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^vllm:mm_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def test_first_uses_reuses_and_resets_under_concurrency(handles_server, server, images):
    random.seed(11)
    plan = []  # per round: [(body, expected key)], disturbance
    for r in range(1, ROUNDS + 1):
        new = images[r]
        bodies = [(by_ref(new, stream=i % 3 == 0), ("ref", r)) for i in range(FIRST_USES)]
        bodies.append((reversed_slots(new), ("reversed", r)))
        bodies += [(by_ref(images[k]), ("ref", k)) for k in {r - 1, max(0, r - 9)}]
        random.shuffle(bodies)
        plan.append((bodies, "reset" if r % 4 == 2 else "pause" if r % 4 == 0 else None))
    with server.client() as c:  # the oracle: the session server, one request at a time
        expected = {}
        for k, ref in enumerate(images):
            expected["ref", k] = c.post("/inference/v1/generate", json=by_ref(ref)).json()
            expected["reversed", k] = c.post("/inference/v1/generate", json=reversed_slots(ref)).json()
        expected = {key: a["choices"][0]["token_ids"] for key, a in expected.items()}
    misses_before = handles_server.log().count("Multi-modal cache miss")
    hits_before = cache_hits(handles_server)

    async def run() -> int:
        aborted = 0
        async with httpx.AsyncClient(base_url=handles_server.url, timeout=300) as client:
            for bodies, kind in plan:
                jobs = [answer(client, body) for body, _ in bodies]
                if kind is not None:
                    jobs.insert(random.randrange(len(jobs)), disturb(client, kind))
                results = [r for r in await asyncio.gather(*jobs) if r is not None]
                for (tokens, reason), (_, key) in zip(results, bodies, strict=True):
                    if reason == "abort":  # in flight when the pause came
                        assert kind == "pause" and tokens == expected[key][: len(tokens)], key
                        aborted += 1
                    else:
                        assert tokens == expected[key], (key, tokens, expected[key])
        return aborted

    start = time.monotonic()
    aborted = asyncio.run(run())
    log = handles_server.log()
    assert log.count("Multi-modal cache miss") == misses_before == 0
    hits = cache_hits(handles_server) - hits_before
    assert hits >= ROUNDS * (FIRST_USES - 2), hits  # later first uses went as handles
    print(f"{ROUNDS} rounds in {time.monotonic() - start:.1f} s; {hits:.0f} handles; {aborted} aborted")
    with handles_server.client() as c:
        assert c.get("/health").status_code == 200
