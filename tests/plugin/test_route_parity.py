"""Differential test of the route: the same bodies to stock vLLM and to vLLM with the plugin.

Two servers at once, same tiny Qwen2-VL, same flags (``helpers.SERVER_ARGS``), the stock one
without ``VLLM_PLUGINS``. Every body stock serves must get stock's answer from the plugin server
(status, tokens, finish reasons, logprobs, streamed tokens); every body stock refuses must get
stock's own error body, byte for byte once parsed. The bodies: vLLM's own render output (inline
items), ``null`` slots after an inline item, a literal placeholder token in user text, ranges over
text tokens, ``content_parts``, streaming, ``cache_salt``, ``priority``, the largest body stock
serves, bodies built by the released ``renderers`` client's feature builder (its ``generate()``
expects ``"token_id:N"`` logprob strings, which vLLM 0.32's route does not return, so only its
builder is used), and stock's refusals. One deliberate difference: on these CPU servers a seeded
request sampled at random that other requests could split runs alone (it waits for the requests in
flight, and new ones wait for it), with stock's answer; one that would split even alone is refused
(``seed_unsupported``) on every route: stock serves it until a step prefills it in parts, which
kills its engine (``vllm_plugin/seeds.py``; the last test shows it on the stock server, which it
takes down).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import io
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch

from helpers import SERVER_ARGS, VLLMServer, photo_bytes, refusal, served

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

GREEDY = {"temperature": 0, "max_tokens": 6, "logprobs": 1}
PAD = 261


@pytest.fixture(scope="module")
def stock(qwen2_vl_dir, output_root, tmp_path_factory) -> Iterator[VLLMServer]:
    """Stock vLLM (no endpoint plugin) with the session plugin server's flags (and vLLM's dev
    routes, which change no answer)."""
    log = tmp_path_factory.mktemp("stock") / "server.log"
    with served(
        qwen2_vl_dir,
        output_root,
        log,
        plugin=False,
        extra_args=SERVER_ARGS,
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},  # /pause and /resume for the last test's control
    ) as srv:
        assert "Loaded endpoint plugin" not in srv.log()
        yield srv


def data_url(name: str, size: tuple[int, int] | None = None) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(photo_bytes(name, size=size)).decode()


def rendered(server: VLLMServer, names: list[str], text: str = "Describe the pictures.") -> dict:
    """vLLM's own render of a chat with these photos: expanded ``token_ids`` and ``features``."""
    content = [{"type": "image_url", "image_url": {"url": data_url(n)}} for n in names]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]
    with server.client() as c:
        r = c.post("/v1/chat/completions/render", json={"model": str(server.model), "messages": messages})
    assert r.status_code == 200, r.text
    body = r.json()
    return {"token_ids": body["token_ids"], "features": body["features"], "sampling_params": GREEDY}


def answer(response) -> tuple:
    """What must be equal: the status and, for a 200, tokens, finish reasons and logprobs (streamed
    or not); for an error, the whole body."""
    if response.status_code != 200:
        return response.status_code, response.json()
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [msgspec.json.decode(e) for e in events[:-1]]
        assert not any("error" in ch for ch in chunks), chunks
        choices = [ch for chunk in chunks for ch in chunk["choices"]]
        tokens = [t for ch in choices for t in ch["token_ids"] or ()]
        reasons = [ch["finish_reason"] for ch in choices if ch["finish_reason"]]
        logprobs = [lp["logprob"] for ch in choices for lp in (ch["logprobs"] or {}).get("content") or ()]
        return 200, "stream", tokens, reasons, logprobs
    choices = response.json()["choices"]
    logprobs = [lp["logprob"] for ch in choices for lp in (ch["logprobs"] or {}).get("content") or ()]
    return 200, [ch["token_ids"] for ch in choices], [ch["finish_reason"] for ch in choices], logprobs


def assert_same(name: str, ours: tuple, theirs: tuple) -> None:
    assert ours[0] == theirs[0], (name, ours, theirs)
    if ours[0] != 200:
        assert ours == theirs, name  # stock's refusal: stock's body
        return
    assert ours[:-1] == theirs[:-1], name
    assert len(ours[-1]) == len(theirs[-1]), name
    assert max((abs(a - b) for a, b in zip(ours[-1], theirs[-1], strict=True)), default=0) <= 1e-4, name


def post_both(stock: VLLMServer, ours: VLLMServer, name: str, **request) -> tuple:
    """Send one request to both servers; assert the same answer; return stock's."""
    with stock.client() as a, ours.client() as b:
        theirs = answer(a.post("/inference/v1/generate", **request))
        mine = answer(b.post("/inference/v1/generate", **request))
    assert_same(name, mine, theirs)
    return theirs


def test_bodies_stock_serves_get_stocks_answer(stock, server):
    one = rendered(stock, ["coffee"])
    two = rendered(stock, ["rocket", "chelsea"])
    (placeholder,) = one["features"]["mm_placeholders"]["image"]
    offset, length = placeholder["offset"], placeholder["length"]
    null_slot = copy.deepcopy(one)
    null_slot["features"].update(kwargs_data={"image": [None]}, mm_metadata=None)
    literal_pad = copy.deepcopy(one)  # user text holding <|image_pad|>: 55 pad ids, 54 covered
    literal_pad["token_ids"] = [*one["token_ids"][:5], PAD, *one["token_ids"][5:]]
    literal_pad["features"]["mm_placeholders"]["image"] = [{"offset": offset + 1, "length": length}]
    over_text = copy.deepcopy(one)  # the range covers vision_start and a text token: vLLM merges by range
    over_text["features"]["mm_placeholders"]["image"] = [{"offset": offset - 2, "length": length}]
    text = {"token_ids": [3, 17, 42, 99, 7], "sampling_params": GREEDY}
    wrapped = copy.deepcopy(one)  # a MIME-wrapped base64 item (76 characters a line): vLLM skips the breaks
    item = wrapped["features"]["kwargs_data"]["image"][0]
    wrapped["features"]["kwargs_data"]["image"] = [
        "\n".join(item[i : i + 76] for i in range(0, len(item), 76))
    ]
    wrapped["features"]["mm_hashes"] = {"image": ["w" * 64]}
    content_parts = {
        "token_ids": [
            *one["token_ids"][: offset - 1],
            259,
            PAD,
            260,
            *one["token_ids"][offset + length + 1 :],
        ],
        "content_parts": [{"type": "image_url", "url": data_url("astronaut")}],
        "sampling_params": GREEDY,
        "return_token_ids": True,
    }
    cases = {
        "text only": text,
        "text, logprobs 2": {**text, "sampling_params": {"temperature": 0, "max_tokens": 5, "logprobs": 2}},
        "inline item (vLLM's render output)": one,
        "inline item, base64 with line breaks": wrapped,
        "two inline items": two,
        "null slot after that hash was sent inline": null_slot,
        "literal placeholder token in user text beside an image": literal_pad,
        "a range over text tokens": over_text,
        "content_parts": content_parts,
        "streaming, text": {**text, "stream": True},
        "streaming, inline item": {**one, "stream": True},
        "cache_salt": {**one, "cache_salt": "salt-1"},
        "priority": {**text, "priority": 3},
        "return_token_ids with features": {**two, "return_token_ids": True},
    }  # fmt: skip
    for name, body in cases.items():
        status = post_both(stock, server, name, json=body)[0]
        assert status == 200, name


def seeded_bodies(model, **sampling) -> dict[str, dict]:
    """The same short seeded prompt on every generating route, by route."""
    prompt = [3, 17, 42, 99, 7]
    return {
        "/inference/v1/generate": {"token_ids": prompt, "sampling_params": {"max_tokens": 5, **sampling}},
        "/v1/completions": {"model": str(model), "prompt": prompt, "max_tokens": 5, **sampling},
        "/v1/chat/completions": {
            "model": str(model),
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5,
            **sampling,
        },
    }


def choices(response) -> list:
    """The generated part of each choice (token ids or text or message), in order."""
    keys = ("token_ids", "text", "message")
    return [{k: c.get(k) for k in keys} for c in response.json()["choices"]]


def test_the_seed_rule_on_every_route(stock, server):
    """One rule for the whole server (``seeds.py``, applied by ``admission.py`` on vLLM's routes):
    a greedy seeded request has no generator and gets stock's answer on every route; a seeded
    request sampled at random, which other requests could split here (4 sequences of up to 2048
    tokens share a 2048-token step with chunked prefill on), runs alone and gets stock's answer;
    one that splits even alone (two sequences of 1500 tokens; a chat of unknown length with
    ``n=2``) is refused, on every route."""
    with stock.client() as a, server.client() as b:
        for temperature, n in ((0, 1), (1.0, 1), (1.0, 2)):
            for path, body in seeded_bodies(server.model, seed=7, temperature=temperature, n=n).items():
                if n == 2 and path == "/v1/chat/completions":
                    continue
                ours, theirs = b.post(path, json=body), a.post(path, json=body)
                assert ours.status_code == theirs.status_code == 200, (path, ours.text[:300])
                assert choices(ours) == choices(theirs), (path, temperature, n)
        prompt, sampling = [5] * 1500, {"max_tokens": 5, "seed": 7, "temperature": 1.0, "n": 2}
        bodies = {
            "/v1/completions": {"model": str(server.model), "prompt": prompt, **sampling},
            "/inference/v1/generate": {"token_ids": prompt, "sampling_params": sampling},
            "/v1/chat/completions": seeded_bodies(server.model, **sampling)["/v1/chat/completions"],
        }
        for path, body in bodies.items():
            refused = b.post(path, json=body)
            assert refusal(refused) == (400, "seed_unsupported"), (path, refused.text[:300])
            assert "1 other requests" in refused.json()["error"]["message"], path
        assert b.get("/health").status_code == 200


def test_a_seeded_request_runs_alone(server):
    """A seeded request sampled at random waits until the request in flight has finished, and a
    request sent after it waits until it has finished: nothing shares its steps."""
    long = {"model": str(server.model), "prompt": [3] * 50, "max_tokens": 400, "ignore_eos": True}
    seeded = {"model": str(server.model), "prompt": [4] * 20, "max_tokens": 3, "seed": 5, "temperature": 1.0}
    short = {"model": str(server.model), "prompt": [6] * 20, "max_tokens": 3}
    done: dict[str, float] = {}

    def post(name: str, body: dict) -> int:
        with server.client() as c:
            status = c.post("/v1/completions", json=body).status_code
        done[name] = time.monotonic()
        return status

    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(post, "long", long)
        time.sleep(1.0)  # running
        alone = pool.submit(post, "seeded", seeded)
        time.sleep(0.3)
        after = pool.submit(post, "short", short)
        assert [f.result(timeout=300) for f in (first, alone, after)] == [200, 200, 200]
    assert done["long"] < done["seeded"] < done["short"], done


def test_the_seed_rule_reads_a_body_as_vllm_does(stock, server):
    """Forms of a seeded request sampled at random that vLLM's request models read as one (a seed
    or temperature as a string, a float or a bool; ``sampling_params`` beside the top-level
    fields, which vLLM's chat route ignores; the body in UTF-16) run alone like the plain one and
    get stock's answer; with ``n=2`` (a chat's length is unknown: two sequences of up to 2048
    tokens can split) each is refused like the plain one."""
    chat = seeded_bodies(server.model)["/v1/chat/completions"]
    forms = {
        "seed as a string": {**chat, "seed": "7", "temperature": 1.0},
        "seed as a float": {**chat, "seed": 7.0, "temperature": 1.0},
        "seed as a bool": {**chat, "seed": True, "temperature": 1.0},
        "temperature as a string": {**chat, "seed": 7, "temperature": "1.0"},
        "an empty sampling_params": {**chat, "seed": 7, "temperature": 1.0, "sampling_params": {}},
    }
    utf16 = {"content-type": "application/json"}
    with stock.client() as a, server.client() as b:
        for name, body in forms.items():
            ours, theirs = (
                b.post("/v1/chat/completions", json=body),
                a.post("/v1/chat/completions", json=body),
            )
            assert ours.status_code == theirs.status_code == 200, (name, ours.text[:300])
            assert choices(ours) == choices(theirs), name
            refused = b.post("/v1/chat/completions", json={**body, "n": 2})
            assert refusal(refused) == (400, "seed_unsupported"), (name, refused.text[:300])
        seeded = json.dumps({**chat, "seed": 7, "temperature": 1.0, "n": 2}).encode("utf-16")
        refused = b.post("/v1/chat/completions", content=seeded, headers=utf16)
        assert refusal(refused) == (400, "seed_unsupported"), refused.text[:300]
        for sampling in ({"temperature": 0}, {"seed": 7, "temperature": 1.0}):
            body = json.dumps({**chat, **sampling}).encode("utf-16")
            ours = b.post("/v1/chat/completions", content=body, headers=utf16)
            theirs = a.post("/v1/chat/completions", content=body, headers=utf16)
            assert ours.status_code == theirs.status_code == 200, ours.text[:300]
            assert ours.json()["choices"][0]["message"] == theirs.json()["choices"][0]["message"]
        assert b.get("/health").status_code == 200


def test_stock_refusals_keep_stocks_body(stock, server):
    one = rendered(stock, ["astronaut"])
    ids = one["token_ids"]
    (placeholder,) = one["features"]["mm_placeholders"]["image"]
    json_type = {"content-type": "application/json"}
    base = {"token_ids": [1, 2, 3], "sampling_params": GREEDY}
    cases = {
        "invalid JSON": {"content": b"{not json", "headers": json_type},
        "no content type": {"content": b'{"token_ids": [1]}', "headers": {"content-type": ""}},
        "text/plain": {"content": json.dumps(base).encode(), "headers": {"content-type": "text/plain"}},
        "+json with bad JSON": {"content": b"{x", "headers": {"content-type": "application/vnd.api+json"}},
        "empty body": {"content": b"", "headers": json_type},
        "a JSON array": {"json": [1, 2]},
        "nesting 1500 deep": {"content": b'{"token_ids": ' + b"[" * 1500 + b"]" * 1500 + b"}", "headers": json_type},
        "token_ids missing": {"json": {"sampling_params": GREEDY}},
        "negative token id": {"json": {**base, "token_ids": [-1]}},
        "max_tokens 0": {"json": {**base, "sampling_params": {"max_tokens": 0}}},
        "an integer of 5000 digits": {"content": b'{"token_ids": [' + b"9" * 5000 + b"]}", "headers": json_type},
        "a space before the content type's parameters": {"content": json.dumps(base).encode(), "headers": {"content-type": "application/json ; charset=utf-8"}},
        "NaN temperature": {"content": b'{"token_ids":[1],"sampling_params":{"temperature":NaN}}', "headers": json_type},
        "token id beyond the vocabulary": {"json": {**base, "token_ids": [10**9]}},
        "prompt longer than max_model_len": {"json": {**base, "token_ids": [1] * 5000}},
        "sampling_params a string": {"json": {**base, "sampling_params": "x"}},
        "empty cache_salt": {"json": {**base, "cache_salt": ""}},
        "n above max_num_seqs": {"json": {**base, "sampling_params": {"n": 9}}},
        "range beyond the prompt": {"json": {**one, "features": {**one["features"], "mm_placeholders": {"image": [{"offset": len(ids), "length": 5}]}}}},
        "overlapping ranges": {"json": {**one, "features": {
            "mm_hashes": {"image": ["a" * 64, "b" * 64]},
            "mm_placeholders": {"image": [placeholder, placeholder]},
            "kwargs_data": {"image": one["features"]["kwargs_data"]["image"] * 2}}}},
        "metadata-only item without ec_transfer_params": {"json": {**one, "features": {**one["features"], "kwargs_data": {"image": [None]}}}},
        "content_parts and features": {"json": {**one, "content_parts": [{"type": "image_url", "url": data_url("coffee")}]}},
    }  # fmt: skip
    for name, request in cases.items():
        status, body = post_both(stock, server, name, **request)
        assert 400 <= status < 500 and "mmref_code" not in json.dumps(body), (name, body)


def test_the_largest_body_stock_serves_is_served(stock, server):
    """30 images at the processor's maximum size as float32 inline items (what the renderers client
    sends): 48 MB, more than the old 32 MiB limit, within max_model_len: stock serves it, so does
    the plugin (its default limit is derived from the served model)."""
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import (
        decode_mm_kwargs_item,
        encode_mm_kwargs_item,
    )

    big = rendered(stock, ["astronaut"])  # 512x512: capped at the processor's max pixels
    (length,) = [p["length"] for p in big["features"]["mm_placeholders"]["image"]]
    item = decode_mm_kwargs_item(big["features"]["kwargs_data"]["image"][0])
    pixels = item["pixel_values"]
    item = type(item)({**item, "pixel_values": type(pixels)(data=pixels.data.float(), field=pixels.field)})
    encoded = encode_mm_kwargs_item(item)
    ids, ranges = [1], []
    for _ in range(30):
        ids.append(259)
        ranges.append({"offset": len(ids), "length": length})
        ids += [PAD] * length + [260]
    body = {
        "token_ids": [*ids, 2],
        "sampling_params": {**GREEDY, "max_tokens": 2},
        "features": {
            "mm_hashes": {"image": [f"big{i:061d}" for i in range(30)]},
            "mm_placeholders": {"image": ranges},
            "kwargs_data": {"image": [encoded] * 30},
        },
    }
    content = msgspec.json.encode(body)
    assert len(content) > 40 << 20
    assert (
        post_both(stock, server, "48 MB", content=content, headers={"content-type": "application/json"})[0]
        == 200
    )


def test_renderers_client_feature_builder_bodies(stock, server, qwen2_vl_adapter):
    """Bodies whose ``features`` the released renderers client builds (``_build_qwen_vl_features``,
    renderers 0.1.12) from the model's HF processor output, as a client that processes images
    itself sends them; inline and, after that, as a cache-only ``null`` slot."""
    from PIL import Image
    from renderers.base import MultiModalData, PlaceholderRange
    from renderers.client import _build_qwen_vl_features

    names = ["chelsea", "coffee"]
    template = rendered(stock, names)  # the chat's expanded ids and ranges, from vLLM itself
    images = [Image.open(io.BytesIO(photo_bytes(n))).convert("RGB") for n in names]
    processed = [qwen2_vl_adapter.image_processor(images=[im], return_tensors="pt") for im in images]
    placeholders = [
        PlaceholderRange(offset=p["offset"], length=p["length"])
        for p in template["features"]["mm_placeholders"]["image"]
    ]
    mm_data = MultiModalData(
        mm_hashes={"image": [hashlib.sha256(photo_bytes(n)).hexdigest() for n in names]},
        mm_placeholders={"image": placeholders},
        mm_items={"image": [{"pixel_values": p["pixel_values"].numpy(), "image_grid_thw": p["image_grid_thw"].numpy()} for p in processed]},
    )  # fmt: skip
    features = _build_qwen_vl_features(mm_data, spatial_merge_size=2)
    body = {
        "token_ids": template["token_ids"],
        "features": features,
        "sampling_params": GREEDY,
        "cache_salt": "r",
    }
    assert post_both(stock, server, "renderers features", json=body)[0] == 200
    cached = {**body, "features": {**features, "kwargs_data": {"image": [None, None]}}}
    assert post_both(stock, server, "renderers features, null slots", json=cached)[0] == 200
    streamed = {**body, "stream": True, "priority": 0}
    assert post_both(stock, server, "renderers features, streamed", json=streamed)[0] == 200
    assert torch.is_floating_point(processed[0]["pixel_values"])  # float32 normalized, as the client sends


def hostile_items(body: dict) -> dict[str, dict]:
    """``body`` (one rendered image) with its item's pixels replaced by each class the served
    processor never emits: non-finite or huge values, other dtypes."""
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import (
        decode_mm_kwargs_item,
        encode_mm_kwargs_item,
    )

    item = decode_mm_kwargs_item(body["features"]["kwargs_data"]["image"][0])
    elem = item["pixel_values"]
    floats = elem.data.float()
    classes = {
        "NaN": floats.clone().fill_(float("nan")),
        "inf": floats.clone().fill_(float("inf")),
        "3e38": floats.clone().fill_(3e38),
        "float64": floats.double(),
        "float16": floats.half(),
        "bool": elem.data > 100,
        "complex64": floats.to(torch.complex64),
        "int8": elem.data.to(torch.int8),
        "int64": elem.data.long(),
    }
    out = {}
    for k, (name, pixels) in enumerate(classes.items()):
        hostile = copy.deepcopy(body)
        bad = type(item)({**item, "pixel_values": type(elem)(data=pixels, field=elem.field)})
        hostile["features"]["kwargs_data"]["image"][0] = encode_mm_kwargs_item(bad)
        hostile["features"]["mm_hashes"]["image"][0] = f"hostile{k:057d}"
        out[name] = hostile
    return out


def test_hostile_pixel_values_change_no_other_answer(stock, server):
    """An inline item whose pixels are NaN, inf, 3e38 or of a dtype the processor never emits: the
    plugin refuses each before the engine sees it, and every victim (other images, other cache
    salts), sent after each and alongside all of them, gets its baseline tokens. The control: stock
    answers the NaN item 200 and the next request comes back wrong. Runs before the last test (the
    stock server stays poisoned)."""
    small = lambda name: rendered_at(stock, name, (180, 120))  # noqa: E731
    victims = [{**small(n), "cache_salt": f"victim-{n}"} for n in ("chelsea", "coffee", "astronaut")]
    hostile = hostile_items(small("rocket"))
    with server.client() as b:
        baseline = [tokens_of(b.post("/inference/v1/generate", json=v)) for v in victims]
        for name, body in hostile.items():
            assert refusal(b.post("/inference/v1/generate", json=body))[0] == 400, name
            assert [tokens_of(b.post("/inference/v1/generate", json=v)) for v in victims] == baseline, name
    with ThreadPoolExecutor(8) as pool:
        attacks = [pool.submit(_post, server, body) for body in hostile.values() for _ in range(2)]
        answers = [pool.submit(_post, server, v) for _ in range(3) for v in victims]
        assert all(a.result().status_code == 400 for a in attacks)
        assert [tokens_of(a.result()) for a in answers] == baseline * 3
    with stock.client() as a:
        before = tokens_of(a.post("/inference/v1/generate", json=victims[0]))
        assert a.post("/inference/v1/generate", json=hostile["NaN"]).status_code == 200
        assert tokens_of(a.post("/inference/v1/generate", json=victims[0])) != before


def rendered_at(server: VLLMServer, name: str, size: tuple[int, int]) -> dict:
    """vLLM's own render of a one-photo chat, the photo resized to ``size``."""
    content = [
        {"type": "image_url", "image_url": {"url": data_url(name, size)}},
        {"type": "text", "text": "Hi"},
    ]
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions/render",
            json={"model": str(server.model), "messages": [{"role": "user", "content": content}]},
        )
    assert r.status_code == 200, r.text
    return {"token_ids": r.json()["token_ids"], "features": r.json()["features"], "sampling_params": GREEDY}


def tokens_of(response) -> list[int]:
    assert response.status_code == 200, response.text[:300]
    return response.json()["choices"][0]["token_ids"]


def _post(server: VLLMServer, body: dict):
    with server.client() as c:
        return c.post("/inference/v1/generate", json=body)


def test_stock_dies_when_a_seeded_sampled_request_is_split(stock):
    """The control of the seed rule: on stock, a seeded request sampled at random that shares its
    first step with a longer prompt (both queued while the engine is paused, then resumed) is
    prefilled in two steps, and vLLM's CPU generator kills the engine. Runs last: the module's
    stock server goes down."""
    long_prompt = {"model": str(stock.model), "prompt": [5] * 1500, "max_tokens": 2, "temperature": 0}
    seeded = {"model": str(stock.model), "prompt": [9] * 1000, "max_tokens": 2, "temperature": 1.0, "seed": 7}
    with stock.client() as c, ThreadPoolExecutor(2) as pool:
        c.post("/pause", params={"mode": "keep"}).raise_for_status()
        first = pool.submit(stock.client().post, "/v1/completions", json=long_prompt)
        time.sleep(2)  # queued first (a paused engine publishes no queue metrics): scheduled first
        second = pool.submit(stock.client().post, "/v1/completions", json=seeded)
        time.sleep(2)
        c.post("/resume").raise_for_status()
        answers = [f.exception() or f.result().status_code for f in (first, second)]
    assert any(a != 200 for a in answers), answers
    deadline = time.monotonic() + 60
    while stock.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "CPU Generator does not use offset" in stock.log()
