"""Weight pushes with generation going on (issue: RL load): the plugin's one call
(``POST /mmref/v1/weights/update``, ``vllm_plugin/updates.py``) under continuous image traffic on
the plugin's route and on vLLM's own chat route; its two-phase form around vLLM's own weight
route; a request in flight finishes on the old weights, one sent during an update waits for the
new ones; vLLM's own recipe and control routes through the plugin's gate (``vllm_plugin/control.py``),
and the same recipe killing stock vLLM (the control, on a stock server of its own).

One plugin server for the module (``VLLM_SERVER_DEV_MODE=1``, ``--enable-prefix-caching``,
``--no-enable-chunked-prefill``, processed logprobs, tiny Qwen2-VL in float32). Without chunked
prefill a text prompt is prefilled in one step: the seed rule serves seeded text there
(``seeds.py``), on every route. Two weight sets, ``A`` (the tiny model) and ``B``
(``helpers.jittered_weights``): every answer is recomputed by ``trainer_lib`` under the set its
``x-mmref-weight-version`` header names.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import msgspec
import pytest
from traffic import Traffic
from transformers import AutoTokenizer

from helpers import SERVER_ARGS, dev_served, photo_bytes, refusal, rollout_sample, served, server_mismatch
from protocol.adapters import offload_image
from protocol.placeholders import expand_image_placeholders
from rl_server import held, push_weights, vllm_recipe, weight_version
from rollout_client.suppression import logit_bias

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

FRESH = 1e-4
"""Mean |d| of an answer recomputed under the weights that generated it (measured ~1e-7)."""
STALE = 1e-3
"""Mean |d| above which the weights are not those that generated the answers (measured ~1e-2)."""
PUSHES = 50
LONG = 1500
"""Tokens of a request that is still generating when the test acts (prompt + LONG < 2048)."""
HEADER = "x-mmref-weight-version"
ROOT = "/api"
"""vLLM's ``--root-path``: its routes answer under it too (a proxy's prefix), and so does admission."""
TEXT = "Name every object, its colour and where it is in the picture, in order. " * 3


@pytest.fixture(scope="module")
def push_server(qwen2_vl_dir, output_root, photo_refs, tmp_path_factory):
    log = tmp_path_factory.mktemp("push_server") / "server.log"
    args = ("--enable-prefix-caching", "--no-enable-chunked-prefill", "--root-path", ROOT)
    with dev_served(qwen2_vl_dir, output_root, log, *args) as srv:
        yield srv


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    """Token ids, placeholders expanded (what vLLM's chat route renders for ``image``)."""
    ref: object
    image: bytes


@pytest.fixture(scope="module")
def prompts(qwen2_vl_dir, qwen2_vl_adapter, asset_root) -> tuple[list[Prompt], int]:
    """Three photos, each with the long text after it (the image inside the first 128-token KV
    block: a repeat is served from the prefix cache), and the placeholder id."""
    tokenizer = AutoTokenizer.from_pretrained(qwen2_vl_dir)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
    ids = list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    out = []
    for name in ("coffee", "chelsea", "astronaut"):
        image = photo_bytes(name, size=(112, 112))
        ref = offload_image(image, asset_root, qwen2_vl_adapter)
        out.append(Prompt(expand_image_placeholders(ids, [ref], pad), ref, image))
    assert all(p.ids.index(pad) + p.ids.count(pad) <= 128 < len(p.ids) for p in out)
    return out, pad


def by_ref(client: httpx.Client, prompt: Prompt, max_tokens: int = 8, **sampling) -> httpx.Response:
    body = {
        "token_ids": prompt.ids,
        "mm_refs": [msgspec.to_builtins(prompt.ref)],
        "sampling_params": {"temperature": 1.0, "max_tokens": max_tokens, "logprobs": 0, **sampling},
    }
    return client.post("/inference/v1/generate", json=body)


def by_chat(client: httpx.Client, model, prompt: Prompt, max_tokens: int = 8, **extra) -> httpx.Response:
    url = "data:image/jpeg;base64," + base64.b64encode(prompt.image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT}]
    body = {
        "model": str(model),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "logprobs": True,
        "return_token_ids": True,
        **extra,
    }
    return client.post("/v1/chat/completions", json=body)


def answer_sample(route: str, prompt: Prompt, response: httpx.Response, pad: int):
    """The trainer's sample of a 200 answer, cut before the first sampled image placeholder (the
    trainer refuses one inside a completion; the tokens before it are a prefix of the same
    generation), or None when that leaves nothing; and the version its header names."""
    data = response.json()
    choice = data["choices"][0]
    if route == "chat":
        assert data["prompt_token_ids"] == prompt.ids, "vLLM rendered another prompt than the plugin's"
    completion, logprobs = choice["token_ids"], choice["logprobs"]["content"]
    if pad in completion:
        cut = completion.index(pad)
        completion, logprobs = completion[:cut], logprobs[:cut]
    sample = rollout_sample(prompt.ids, completion, logprobs, [prompt.ref]) if completion else None
    return sample, response.headers[HEADER]


def wait_running(client: httpx.Client, timeout: float = 60) -> None:
    """Return once the engine runs a request (``vllm:num_requests_running`` > 0), past its prefill."""
    deadline = time.monotonic() + timeout
    while True:
        lines = client.get("/metrics").text.splitlines()
        if any(ln.startswith("vllm:num_requests_running{") and float(ln.split()[-1]) > 0 for ln in lines):
            time.sleep(0.2)  # a few decode steps: the prefill (and the image) are done
            return
        assert time.monotonic() < deadline, "no request started"
        time.sleep(0.02)


def traffic(server, prompts: list[Prompt], clients: int = 6, by_refs: int = 4) -> Traffic:
    """``clients`` client threads: the first ``by_refs`` by ref, the others on vLLM's chat route,
    each cycling the prompts."""

    def send(client: httpx.Client, k: int, i: int) -> tuple[str, httpx.Response]:
        prompt = prompts[(k + i) % len(prompts)]
        if k >= by_refs:
            return "chat", by_chat(client, server.model, prompt)
        return "ref", by_ref(client, prompt)

    return Traffic(server, clients, send)


def test_pushes_under_image_traffic_never_fail_mix_or_mislabel(
    push_server, weight_sets, prompts, qwen2_vl_adapter, output_root
):
    """>= 50 pushes 0.2 s apart through the one call, while six clients generate with images on
    both routes: every answer is a 200 named by the version it was generated under, and the
    trainer's recompute under that version's weights matches it (and the other set does not)."""
    (a_dir, a), (b_dir, b) = weight_sets["A"], weight_sets["B"]
    pad = prompts[1]
    models = {}
    drained = 0
    with push_server.client(timeout=300) as c:
        push_weights(c, a_dir, "push-0")
        models["push-0"] = a
        with traffic(push_server, prompts[0]) as load:
            time.sleep(1)
            for k in range(1, PUSHES + 1):
                weights, model = (b_dir, b) if k % 2 else (a_dir, a)
                result = push_weights(c, weights, f"push-{k}")
                assert result["weight_version"] == f"push-{k}" and result["prefix_cache_reset"]
                drained += result["drained_requests"]
                models[f"push-{k}"] = model
                time.sleep(0.2)
            time.sleep(1)
        assert weight_version(c) == f"push-{PUSHES}"
        assert c.get("/health").status_code == 200 and push_server.process.poll() is None
    print(f"answers: {dict(load.counts)}; requests drained by the pushes: {drained}")
    assert set(load.counts) == {"ref 200", "chat 200"}, load.counts
    assert drained > 0, "no push met a request in flight: the test shows nothing"
    samples = collections.defaultdict(list)
    items = prompts[0]
    for route, thread, i, response in load.answers:
        prompt = items[(thread + i) % len(items)]
        sample, version = answer_sample(route, prompt, response, pad)
        if sample is not None:
            samples[models[version] is a].append(sample)
    assert len(samples[True]) >= 20 and len(samples[False]) >= 20, {k: len(v) for k, v in samples.items()}
    for under_a, group in samples.items():
        model, other = (a, b) if under_a else (b, a)
        per = server_mismatch(group, model, qwen2_vl_adapter, output_root, per_sample=True)
        worst = max(s.mean_abs for s in per)
        stale = server_mismatch(group, other, qwen2_vl_adapter, output_root)
        print(
            f"under {'A' if under_a else 'B'}: {len(group)} answers, worst mean |d| {worst:.1e}, "
            f"vs the other weights {stale}"
        )
        assert worst <= FRESH and stale.mean_abs > STALE


def test_a_request_in_flight_finishes_on_the_old_weights_and_one_sent_during_a_hold_waits(
    push_server, weight_sets, prompts, qwen2_vl_adapter, output_root
):
    """The two-phase form: ``hold`` waits for a long request to finish (on ``A``, labelled so);
    vLLM's own ``/collective_rpc reload_weights`` changes the weights; a request sent while held
    is not answered until ``release``, then under ``B``."""
    (a_dir, a), (b_dir, b) = weight_sets["A"], weight_sets["B"]
    prompt, pad = prompts[0][0], prompts[1]
    never = logit_bias([pad])  # a sample starting with the placeholder would leave nothing to check
    with push_server.client(timeout=300) as c, ThreadPoolExecutor(2) as pool:
        push_weights(c, a_dir, "hold-A")
        client = push_server.client(timeout=300)
        long = pool.submit(by_ref, client, prompt, LONG, ignore_eos=True, logit_bias=never)
        wait_running(c)
        assert not long.done()
        with held(c, "hold-B"):
            waiting = pool.submit(by_ref, push_server.client(timeout=300), prompt, logit_bias=never)
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(b_dir)}}
            c.post("/collective_rpc", json=rpc).raise_for_status()
            time.sleep(1.0)
            assert not waiting.done(), "a request sent during the hold was served before the release"
        before, after = long.result(), waiting.result(timeout=120)
    assert before.status_code == after.status_code == 200
    assert before.headers[HEADER] == "hold-A" and after.headers[HEADER] == "hold-B"
    old, _ = answer_sample("ref", prompt, before, pad)
    new, _ = answer_sample("ref", prompt, after, pad)
    assert len(before.json()["choices"][0]["token_ids"]) == LONG
    fresh = {"suppressed_token_ids": [pad]}
    assert server_mismatch([old], a, qwen2_vl_adapter, output_root, **fresh).mean_abs <= FRESH
    assert server_mismatch([new], b, qwen2_vl_adapter, output_root, **fresh).mean_abs <= FRESH


def test_update_refusals_change_nothing(push_server, weight_sets, prompts):
    """Typed refusals, the server keeps serving under its version: a path that is no folder, no
    version, fields of another route, a hold while held, a release without a hold, and a drain
    that does not finish in time (503, retryable, the request in flight unharmed)."""
    a_dir, _ = weight_sets["A"]
    prompt = prompts[0][0]
    with push_server.client(timeout=300) as c:
        push_weights(c, a_dir, "refusals-A")
        update, bad = "/mmref/v1/weights/update", (400, "invalid_request")
        cases = [
            (update, {"weights_path": "/nonexistent", "version": "x"}, bad),
            (update, {"weights_path": str(a_dir)}, bad),
            (update, {"weights_path": str(a_dir), "version": ""}, bad),
            ("/mmref/v1/weights/hold", {"version": "x"}, bad),
            ("/mmref/v1/weights/release", {}, (409, "update_conflict")),
        ]
        for path, body, expected in cases:
            assert refusal(c.post(path, json=body)) == expected, (path, body)
        c.post("/mmref/v1/weights/hold", json={}).raise_for_status()
        try:
            assert refusal(c.post("/mmref/v1/weights/hold", json={})) == (409, "update_conflict")
        finally:
            c.post("/mmref/v1/weights/release", json={}).raise_for_status()
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(by_ref, push_server.client(timeout=300), prompt, LONG, ignore_eos=True)
            wait_running(c)
            assert not long.done()
            body = {"weights_path": str(a_dir), "version": "too-late", "timeout_s": 0.05}
            assert refusal(c.post("/mmref/v1/weights/update", json=body)) == (503, "drain_timeout")
            assert long.result().status_code == 200
        assert weight_version(c) == "refusals-A"
        assert by_ref(c, prompt).headers[HEADER] == "refusals-A"


def test_a_release_or_hold_while_an_update_drains_is_refused(push_server, weight_sets, prompts):
    """While an update waits for a long request, a ``release`` (a trainer retrying after a client
    timeout) and a ``hold`` are refused (409): nothing resets caches under the running request or
    opens the gate; the request ends on the old weights, the update lands (once the release went
    through and left the engine paused)."""
    a_dir, _ = weight_sets["A"]
    with push_server.client(timeout=300) as c, ThreadPoolExecutor(2) as pool:
        push_weights(c, a_dir, "drain-A")
        long = pool.submit(by_ref, push_server.client(timeout=300), prompts[0][0], LONG, ignore_eos=True)
        wait_running(c)
        update = pool.submit(push_weights, push_server.client(timeout=300), a_dir, "drain-B", 120)
        time.sleep(0.5)  # the update is draining: the long request still runs
        assert not long.done() and not update.done()
        for path in ("/mmref/v1/weights/release", "/mmref/v1/weights/hold"):
            assert refusal(c.post(path, json={})) == (409, "update_conflict"), path
        assert long.result().status_code == 200 and long.result().headers[HEADER] == "drain-A"
        assert update.result(timeout=120)["weight_version"] == "drain-B"
        assert by_ref(c, prompts[0][0]).headers[HEADER] == "drain-B"


def test_held_never_leaves_the_server_held_when_the_holds_answer_is_lost(push_server):
    """``rl_server.held``: the hold reaches the server but its answer is lost (the connection cut):
    the helper releases before it raises, so the server is not left held with its gate closed
    (a new hold is accepted, a request is served)."""
    from fault_proxy import FaultProxy

    with FaultProxy(push_server.url, ["cut"]) as proxy, httpx.Client(base_url=proxy.url) as client:
        with pytest.raises(httpx.TransportError), held(client, "never-held"):
            pass
        assert [path for path, _ in proxy.seen] == ["/mmref/v1/weights/hold", "/mmref/v1/weights/release"]
    with push_server.client(timeout=60) as c:
        c.post("/mmref/v1/weights/hold", json={"timeout_s": 30}).raise_for_status()
        c.post("/mmref/v1/weights/release", json={}).raise_for_status()
        text = {"model": str(push_server.model), "prompt": [3, 17, 42], "max_tokens": 2}
        assert c.post("/v1/completions", json=text).status_code == 200


def test_a_hold_whose_client_hangs_up_is_cancelled(push_server, prompts):
    """A hold's client that gives up while the drain waits for a long request hangs up: the hold
    is cancelled and the gate reopens at once (no one would release a hold whose answer never
    arrived; once, the server ended held, every request waiting at its gate)."""
    text = {"model": str(push_server.model), "prompt": [3, 17, 42], "max_tokens": 2}
    with push_server.client(timeout=300) as c, ThreadPoolExecutor(1) as pool:
        long = pool.submit(by_ref, push_server.client(timeout=300), prompts[0][0], LONG, ignore_eos=True)
        wait_running(c)
        with pytest.raises(httpx.ReadTimeout), push_server.client(timeout=1.0) as impatient:
            impatient.post("/mmref/v1/weights/hold", json={})
        time.sleep(0.5)
        assert c.post("/v1/completions", json=text, timeout=20).status_code == 200  # the gate is open
        assert not long.done() and long.result().status_code == 200
        c.post("/mmref/v1/weights/hold", json={"timeout_s": 30}).raise_for_status()  # not held
        c.post("/mmref/v1/weights/release", json={}).raise_for_status()


def test_a_client_stalled_in_its_body_holds_up_no_update(push_server):
    """Half a body sent, then nothing: the request is not admitted until its body is in, so a hold
    drains at once (it would otherwise wait for the client, and every request after it at the
    gate), on vLLM's routes, the plugin's and under the root path."""
    import socket

    host, port = httpx.URL(push_server.url).host, httpx.URL(push_server.url).port
    stalled = []
    try:
        for path in ("/v1/chat/completions", "/inference/v1/generate", f"{ROOT}/v1/completions"):
            sock = socket.create_connection((host, port))
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(head.encode() + b'Content-Length: 1000\r\n\r\n{"token_ids": [1')
            stalled.append(sock)
        time.sleep(0.5)  # the server has the headers and the first bytes
        with push_server.client(timeout=60) as c:
            held_answer = c.post("/mmref/v1/weights/hold", json={"timeout_s": 5.0})
            assert held_answer.status_code == 200, held_answer.text[:300]
            assert held_answer.json()["drained_requests"] == 0
            c.post("/mmref/v1/weights/release", json={}).raise_for_status()
    finally:
        for sock in stalled:
            sock.close()


def test_a_version_is_named_as_set_or_refused(push_server, weight_sets, prompts):
    """A version with a character outside ASCII labels every answer as set (UTF-8, on the plugin's
    route and vLLM's); one no header can carry (CR LF) and a body that is not UTF-8 are refused
    (400) before anything changes (once: a 500 on every later answer, and on the update)."""
    a_dir, _ = weight_sets["A"]
    update = "/mmref/v1/weights/update"
    with push_server.client(timeout=300) as c:
        push_weights(c, a_dir, "step-α")
        text = {"model": str(push_server.model), "prompt": [3, 17, 42], "max_tokens": 2}
        for answer in (by_ref(c, prompts[0][0]), c.post("/v1/completions", json=text)):
            assert answer.status_code == 200 and answer.headers[HEADER] == "step-α", answer.text[:300]
        bad = {"weights_path": str(a_dir), "version": "step-8\r\nx-other: 1"}
        assert refusal(c.post(update, json=bad)) == (400, "invalid_request")
        raw = b'{"weights_path": "' + str(a_dir).encode() + b'", "version": "\xff"}'
        assert refusal(c.post(update, content=raw, headers={"content-type": "application/json"})) == (
            400,
            "invalid_request",
        )
        assert weight_version(c) == "step-α"


def test_seeded_text_that_cannot_split_is_served_on_every_route(push_server):
    """Without chunked prefill nothing splits a text prompt here: a seeded request sampled at random
    is served on every route (the same seed twice, the same tokens); one with an image runs alone
    (other requests' images could spend the encoder budget of its step), the same seed twice the
    same tokens; with ``n=2`` its two sequences' images can: refused."""
    prompt = [3, 17, 42, 99, 7]
    sampling = {"max_tokens": 6, "temperature": 1.0, "seed": 11}
    bodies = {
        "/inference/v1/generate": {"token_ids": prompt, "sampling_params": sampling},
        "/v1/completions": {"model": str(push_server.model), "prompt": prompt, **sampling},
    }
    with push_server.client() as c:
        for path, body in bodies.items():
            first, again = c.post(path, json=body), c.post(path, json=body)
            assert first.status_code == again.status_code == 200, (path, first.text[:300])
            assert first.json()["choices"] == again.json()["choices"], path
        url = "data:image/jpeg;base64," + base64.b64encode(photo_bytes("coffee", size=(56, 56))).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}]
        chat = {
            "model": str(push_server.model),
            "messages": [{"role": "user", "content": content}],
            **sampling,
        }
        for path in ("/v1/chat/completions", f"{ROOT}/v1/chat/completions"):  # both reach vLLM's route
            first, again = c.post(path, json=chat), c.post(path, json=chat)
            assert first.status_code == again.status_code == 200, (path, first.text[:300])
            assert first.json()["choices"] == again.json()["choices"], path
            refused = c.post(path, json={**chat, "n": 2})
            assert refusal(refused) == (400, "seed_unsupported"), (path, refused.text[:300])
            assert "encoder budget" in refused.json()["error"]["message"]


def test_vllms_keep_pause_waits_for_a_request_whose_image_the_prefix_cache_covered(push_server, prompts):
    """The step that kills stock (``test_vllms_recipe_kills_stock_under_image_traffic``): a request
    whose image the prefix cache covered runs when ``/pause?mode=keep`` arrives. Here the pause
    holds: it answers once the request has finished under its weights; nothing is preempted."""
    prompt = prompts[0][0]
    with push_server.client(timeout=300) as c, ThreadPoolExecutor(1) as pool:
        assert by_chat(c, push_server.model, prompt, max_tokens=1).status_code == 200  # caches the blocks
        version = weight_version(c)
        running = pool.submit(
            by_chat, push_server.client(timeout=300), push_server.model, prompt, LONG, ignore_eos=True
        )
        wait_running(c)
        assert not running.done()
        assert c.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        assert running.done(), "the pause answered with the request still running"
        assert c.get("/is_paused").json() == {"is_paused": True}
        assert c.post("/resume").json() == {"status": "resumed"}
        answer = running.result()
    assert answer.status_code == 200 and answer.headers[HEADER] == version
    assert len(answer.json()["choices"][0]["token_ids"]) == LONG
    assert push_server.process.poll() is None
    assert "Expected number of multimodal embeddings" not in push_server.log()


def test_vllms_control_routes_pass_through_the_gate(push_server, prompts):
    """A weight-transfer step outside a hold is the typed 409 naming the safe sequence; a pause
    vLLM's route refuses (``mode=fast``) is stock's 400 and holds nothing; ``/pause`` twice holds
    once (the plugin's own hold is then refused), ``/resume`` releases it, and a second ``/resume``
    is vLLM's own."""
    text = {"model": str(push_server.model), "prompt": [3, 17, 42], "max_tokens": 2}
    with push_server.client(timeout=300) as c:
        for path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):
            answer = c.post(path, json={})
            assert refusal(answer) == (409, "update_conflict"), (path, answer.text[:300])
            assert "POST /pause" in answer.json()["error"]["message"]
        malformed = c.post("/pause", params={"mode": "fast"})
        assert malformed.status_code == 400 and "mmref_code" not in malformed.json()["error"]
        assert c.get("/is_paused").json() == {"is_paused": False}
        for _ in range(2):
            assert c.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
        assert refusal(c.post("/mmref/v1/weights/hold", json={})) == (409, "update_conflict")
        assert c.post("/resume").json() == {"status": "resumed"}
        assert c.post("/resume").json() == {"status": "resumed"}
        assert c.get("/is_paused").json() == {"is_paused": False}
        assert c.post("/v1/completions", json=text).status_code == 200
        assert by_ref(c, prompts[0][0]).status_code == 200


RECIPE_S = 60.0
"""How long vLLM's recipe is replayed under traffic (the issue's 60 s)."""
RECIPE_GAP_S = 0.3


def test_vllms_recipe_under_image_traffic_is_served(
    push_server, weight_sets, prompts, qwen2_vl_adapter, output_root
):
    """vLLM's own recipe (``rl_server.vllm_recipe``: ``/pause?mode=keep``, ``/collective_rpc
    reload_weights``, both cache resets, ``/update_weight_version``, ``/resume``) every 0.3 s for
    60 s while twelve clients generate with images on both routes: the engine lives, every answer is
    a 200, and the trainer's recompute under the weights its header names matches it."""
    (a_dir, a), (b_dir, b) = weight_sets["A"], weight_sets["B"]
    pad = prompts[1]
    models = {"recipe-0": a}
    with push_server.client(timeout=300) as c:
        push_weights(c, a_dir, "recipe-0")
        with traffic(push_server, prompts[0], clients=12, by_refs=8) as load:
            end, k = time.monotonic() + RECIPE_S, 0
            while time.monotonic() < end:
                k += 1
                weights, models[f"recipe-{k}"] = (b_dir, b) if k % 2 else (a_dir, a)
                vllm_recipe(c, weights, f"recipe-{k}")
                time.sleep(RECIPE_GAP_S)
        assert weight_version(c) == f"recipe-{k}"
        assert c.get("/health").status_code == 200 and push_server.process.poll() is None
    print(f"{k} recipes in {RECIPE_S:.0f} s; answers: {dict(load.counts)}")
    assert set(load.counts) == {"ref 200", "chat 200"}, load.counts
    assert k >= 20
    samples = collections.defaultdict(list)
    items = prompts[0]
    for route, thread, i, response in load.answers:
        sample, version = answer_sample(route, items[(thread + i) % len(items)], response, pad)
        if sample is not None and len(samples[models[version] is a]) < 40:
            samples[models[version] is a].append(sample)
    assert len(samples[True]) >= 20 and len(samples[False]) >= 20, {k: len(v) for k, v in samples.items()}
    for under_a, group in samples.items():
        model, other = (a, b) if under_a else (b, a)
        worst = max(
            s.mean_abs for s in server_mismatch(group, model, qwen2_vl_adapter, output_root, per_sample=True)
        )
        stale = server_mismatch(group, other, qwen2_vl_adapter, output_root)
        print(f"under {'A' if under_a else 'B'}: worst mean |d| {worst:.1e}, vs the other weights {stale}")
        assert worst <= FRESH and stale.mean_abs > STALE


@pytest.fixture
def stock_push_server(qwen2_vl_dir, output_root, tmp_path):
    """Stock vLLM (no plugin) with the push server's flags, in dev mode: the control."""
    args = (*SERVER_ARGS, "--enable-prefix-caching", "--no-enable-chunked-prefill")
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    with served(
        qwen2_vl_dir, output_root, tmp_path / "stock.log", plugin=False, extra_args=args, extra_env=env
    ) as srv:
        yield srv


def test_vllms_recipe_kills_stock_under_image_traffic(stock_push_server, weight_sets, prompts):
    """The control: the same recipe and traffic (chat route only: stock has no refs) on stock vLLM.
    The engine dies within seconds, of the cause ``vllm_plugin/updates.py`` names: a request whose
    image the prefix cache covered, preempted by the keep pause's cache clear, reaches the vision
    tower without its pixels."""
    (a_dir, _), (b_dir, _) = weight_sets["A"], weight_sets["B"]
    server, items = stock_push_server, prompts[0]

    def send(client: httpx.Client, k: int, i: int) -> tuple[str, httpx.Response]:
        return "chat", by_chat(client, server.model, items[(k + i) % len(items)])

    with server.client(timeout=60) as c, Traffic(server, 12, send, timeout=60) as load:
        end, k = time.monotonic() + RECIPE_S, 0
        while time.monotonic() < end and server.process.poll() is None:
            k += 1
            with contextlib.suppress(httpx.HTTPError):
                vllm_recipe(c, b_dir if k % 2 else a_dir, f"stock-{k}")
            time.sleep(RECIPE_GAP_S)
    deadline = time.monotonic() + 60
    while server.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"stock: {k} recipes; answers: {dict(load.counts)}")
    assert server.process.poll() is not None, "stock survived the recipe: the control shows nothing"
    assert "Expected number of multimodal embeddings to match number of input items" in server.log()
