"""Refs in image URLs (``vllm_plugin/connector.py``, ``chat_refs.py``): vLLM's chat route (and the
generate route's ``content_parts``) with a ref vs the same image as a data URL on the real server,
the plugin's key for each part, the trainer's pixels, and every refusal of the token route as the
same typed 4xx."""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import uuid
import zlib
from pathlib import Path

import msgspec
import pytest
import torch

from helpers import photo_bytes, refusal, tokens_and_logprobs
from protocol.adapters import offload_image
from protocol.errors import InvalidRequest
from protocol.refs import file_uri_to_path, format_mmraw, parse_ref
from protocol.structs import MMRefs, TrainingSample
from trainer_lib import MaterializeOptions, materialize
from vllm_plugin import chat_refs, request_scope
from vllm_plugin.chat_refs import CHAT_MODE
from vllm_plugin.weights import ContentKey, engine_hash, parse_handle

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

CHAT = "/v1/chat/completions"
GREEDY = {"temperature": 0, "max_tokens": 8, "logprobs": True, "return_token_ids": True}


# --- without a server: the body walk, the scan ----------------------------------------------------------


def test_ref_parts_finds_every_image_url_form_and_refuses_reserved_uuids():
    ref = "mmraw:v2:" + "a" * 64 + ".jpg:qwen2_vl:1.4.6"
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": ref}}, {"type": "text"}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,AA"}]},
        ],
        "input": [{"content": [{"type": "input_image", "image_url": ref + ":x"}, {"image_url": ref}]}],
    }
    found = chat_refs.ref_parts(body)
    assert [url for _, url in found] == [ref, ref + ":x", ref]
    assert found[0][0] is body["messages"][0]["content"][0]
    with pytest.raises(InvalidRequest, match="reserved"):
        chat_refs.ref_parts(
            {"messages": [{"content": [{"image_url": {"url": "data:,"}, "uuid": "mmref-1"}]}]}
        )


def test_the_scan_sees_escaped_and_split_needles():
    from vllm_plugin.http_edge import decode_json, mentions

    assert mentions([b'{"url": "mm', b'raw:v2:..."}'], chat_refs.NEEDLES)
    assert mentions([b'{"uuid": "\\u006dmref-1"}'], chat_refs.NEEDLES)  # an escaped name: parsed
    assert not mentions([b'{"messages": [{"content": "hello"}]}'], chat_refs.NEEDLES)
    body, encode = decode_json(b'{"a": NaN, "b": 1}')
    assert json.loads(encode(body))["b"] == 1  # the stdlib's reader, written back the same way


def chat_service(adapter, config) -> chat_refs.ChatRefs:
    """An in-process :class:`chat_refs.ChatRefs` over ``config``'s roots (a resolver's fields it
    reads: adapter, store, config, worker threads, raw pixels)."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    resolver = SimpleNamespace(
        adapter=adapter,
        store=config.image_source(),
        config=config,
        pool=ThreadPoolExecutor(2),
        pixel_mode="raw",
    )
    return chat_refs.ChatRefs(resolver)


def test_a_repeated_ref_is_a_lookup_and_its_key_binds_content_and_weights(
    qwen2_vl_adapter, output_root, monkeypatch
):
    """In process: one read per ref string (single-flight, cached); the key is the content's
    (a v1 and a v2 ref of the same bytes share it) and the weight version's."""
    import asyncio

    from vllm_plugin.config import PluginConfig

    jpeg = photo_bytes("coffee", size=(300, 200))
    v1 = offload_image(jpeg, output_root / "run_1" / "assets", qwen2_vl_adapter)
    v2 = offload_image(jpeg, output_root, qwen2_vl_adapter, form="v2")
    service = chat_service(qwen2_vl_adapter, PluginConfig(asset_root=output_root))
    reads = []
    real = qwen2_vl_adapter.read_raw
    monkeypatch.setattr(qwen2_vl_adapter, "read_raw", lambda *a, **k: reads.append(1) or real(*a, **k))

    async def twice():
        first = await asyncio.gather(*(service.image(v1.ref) for _ in range(8)))
        return first, await service.image(v1.ref), await service.image(v2.ref)

    first, again, other_form = asyncio.run(twice())
    assert len(reads) == 2 and all(f is again for f in first)  # v1 once (8 concurrent + 1 later), v2 once
    assert service.image_sync(v1.ref) is again and len(reads) == 2
    assert again.media.media.size == (300, 200) and again.media.original_bytes == jpeg
    key = service.uuid(again, "step-1")
    assert key == service.uuid(other_form, "step-1") and key.startswith("mmref-")
    assert service.uuid(again, "step-2") != key
    content = again.content_key
    assert (content.sha256, content.ext) == (hashlib.sha256(jpeg).hexdigest(), ".jpg")
    assert content.pixel_mode == CHAT_MODE + service.pixel_mode  # never a token-route item's binding
    assert parse_handle(key).sha256 == content.sha256


# --- on the server -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v2_refs(output_root, qwen2_vl_adapter) -> dict:
    """Content-named refs (``mmraw:v2:``) of two photos, under the server's asset root."""
    return {
        n: offload_image(photo_bytes(n), output_root, qwen2_vl_adapter, form="v2")
        for n in ("coffee", "rocket")
    }


_BYTES: dict[str, bytes] = {}
"""The bytes of every photo a test offloaded, by ref string (for its data URL)."""


def data_url(ref) -> str:
    return f"data:{ref.media_type};base64," + base64.b64encode(_BYTES[ref.ref]).decode()


@pytest.fixture(scope="module", autouse=True)
def _photo_bytes(photo_refs, v2_refs, output_root):
    from protocol.store import AssetStore

    store = AssetStore(output_root)
    for ref in (*photo_refs.values(), *v2_refs.values()):
        _BYTES[ref.ref] = store.read_image(parse_ref(ref.ref))[0]


def content(urls: list[str], text: str = "Describe the pictures.") -> list[dict]:
    return [*({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": text}]


def chat_body(model, messages: list[dict], **extra) -> dict:
    return {"model": str(model), "messages": messages, **GREEDY, **extra}


def same(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> None:
    assert a[0] == b[0]
    assert max(abs(x - y) for x, y in zip(a[1], b[1], strict=True)) <= 1e-5


def test_one_image_by_ref_matches_its_data_url(server, photo_refs, v2_refs):
    astronaut, coffee = photo_refs["astronaut"], v2_refs["coffee"]
    with server.client() as c:
        for ref in (astronaut, coffee):  # v1 (a path) and v2 (content-named)
            by_ref = tokens_and_logprobs(
                c.post(CHAT, json=chat_body(server.model, [{"role": "user", "content": content([ref.ref])}]))
            )
            by_url = tokens_and_logprobs(
                c.post(
                    CHAT,
                    json=chat_body(server.model, [{"role": "user", "content": content([data_url(ref)])}]),
                )
            )
            same(by_ref, by_url)
        other = tokens_and_logprobs(
            c.post(
                CHAT,
                json=chat_body(
                    server.model, [{"role": "user", "content": content([photo_refs["chelsea"].ref])}]
                ),
            )
        )
    # negative control: another photo moves the logprobs, or equality proves nothing
    assert max(abs(x - y) for x, y in zip(by_ref[1], other[1], strict=True)) > 1e-4


def test_several_images_by_ref_match_data_urls(server, photo_refs, v2_refs):
    refs = [photo_refs["astronaut"], v2_refs["rocket"], photo_refs["chelsea"]]
    with server.client() as c:
        by_ref = tokens_and_logprobs(
            c.post(
                CHAT,
                json=chat_body(server.model, [{"role": "user", "content": content([r.ref for r in refs])}]),
            )
        )
        by_url = tokens_and_logprobs(
            c.post(
                CHAT,
                json=chat_body(
                    server.model, [{"role": "user", "content": content([data_url(r) for r in refs])}]
                ),
            )
        )
        mixed = tokens_and_logprobs(
            c.post(
                CHAT,
                json=chat_body(
                    server.model,
                    [{"role": "user", "content": content([refs[0].ref, data_url(refs[1]), refs[2].ref])}],
                ),
            )
        )
    same(by_ref, by_url)
    same(mixed, by_url)


def _conversation(urls: list[str], answers: list[str]) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": "You operate a computer."}]
    for k, url in enumerate(urls):
        messages.append({"role": "user", "content": content([url], f"Screen {k}: what now?")})
        if k < len(answers):
            messages.append({"role": "assistant", "content": answers[k]})
    return messages


def test_multi_turn_conversation_by_ref_matches_data_urls(server, photo_refs, v2_refs):
    """Each turn re-sends every earlier screenshot; every turn's answer equals the data-URL one."""
    shots = [photo_refs["coffee"], v2_refs["rocket"], photo_refs["astronaut"]]
    answers: list[str] = []
    with server.client() as c:
        for k in range(len(shots)):
            refs = _conversation([s.ref for s in shots[: k + 1]], answers)
            urls = _conversation([data_url(s) for s in shots[: k + 1]], answers)
            r = c.post(CHAT, json=chat_body(server.model, refs))
            by_url = c.post(CHAT, json=chat_body(server.model, urls))
            same(tokens_and_logprobs(r), tokens_and_logprobs(by_url))
            answers.append(r.json()["choices"][0]["message"]["content"] or "ok")


def _streamed(client, body: dict) -> tuple[list[str], list[float]]:
    tokens, logprobs = [], []
    with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                for entry in (choice.get("logprobs") or {}).get("content") or ():
                    tokens.append(entry["token"])
                    logprobs.append(entry["logprob"])
    return tokens, logprobs


def test_streaming_by_ref_matches_data_urls(server, photo_refs, v2_refs):
    refs = [v2_refs["coffee"], photo_refs["chelsea"]]
    with server.client() as c:
        by_ref = _streamed(
            c, chat_body(server.model, [{"role": "user", "content": content([r.ref for r in refs])}])
        )
        by_url = _streamed(
            c, chat_body(server.model, [{"role": "user", "content": content([data_url(r) for r in refs])}])
        )
    assert len(by_ref[0]) == 8 and by_ref[0] == by_url[0]
    assert max(abs(x - y) for x, y in zip(by_ref[1], by_url[1], strict=True)) <= 1e-5


def test_content_parts_refs_on_the_token_route(server, photo_refs, v2_refs, tokenizer_ids):
    body = {"token_ids": tokenizer_ids, "sampling_params": {"temperature": 0, "max_tokens": 8, "logprobs": 0}}
    with server.client() as c:
        for ref in (photo_refs["rocket"], v2_refs["coffee"]):
            by_ref = c.post(
                "/inference/v1/generate",
                json={**body, "content_parts": [{"type": "image_url", "url": ref.ref, "uuid": "client-id"}]},
            )
            by_url = c.post(
                "/inference/v1/generate",
                json={**body, "content_parts": [{"type": "image_url", "url": data_url(ref)}]},
            )
            assert by_ref.status_code == 200, by_ref.text[:300]
            a, b = by_ref.json()["choices"][0], by_url.json()["choices"][0]
            assert a["token_ids"] == b["token_ids"]
            assert (
                max(
                    abs(x["logprob"] - y["logprob"])
                    for x, y in zip(a["logprobs"]["content"], b["logprobs"]["content"], strict=True)
                )
                <= 1e-5
            )
        bad = c.post(
            "/inference/v1/generate",
            json={**body, "content_parts": [{"type": "image_url", "url": "mmraw:!!"}]},
        )
    assert refusal(bad) == (400, "invalid_ref")


@pytest.fixture(scope="module")
def tokenizer_ids(qwen2_vl_dir) -> list[int]:
    """One image's prompt (a single ``<|image_pad|>``, which vLLM expands) for ``content_parts``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_vl_dir)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"]) if not isinstance(ids, list) else ids


def _render(client, model, urls: list[str], **part) -> tuple[dict, str]:
    parts = [{"type": "image_url", "image_url": {"url": u}, **part} for u in urls]
    r = client.post(
        f"{CHAT}/render",
        json={
            "model": str(model),
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Hi"}]}],
        },
    )
    assert r.status_code == 200, r.text[:300]
    return r.json(), r.headers.get("x-mmref-weight-version", "")


def test_the_plugin_keys_each_part_by_content_and_weight_version(server, photo_refs, qwen2_vl_adapter):
    """vLLM's hash of a ref's part is the plugin's uuid (a client's uuid is replaced), from the full
    sha256 of the bytes, the fingerprint, the pixel mode and the weight version."""
    ref = photo_refs["astronaut"]
    path = Path(file_uri_to_path(parse_ref(ref.ref).raw_image_uri))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    with server.client() as c:
        rendered, version = _render(c, server.model, [ref.ref], uuid="my-id")
        again, _ = _render(c, server.model, [ref.ref])
        by_url, _ = _render(c, server.model, [data_url(ref)])
    (mm_hash,) = rendered["features"]["mm_hashes"]["image"]
    pixels = "raw" if "raw pixels" in server.log() else "normalized"
    key = ContentKey("image", sha, path.suffix, qwen2_vl_adapter.fingerprint, CHAT_MODE + pixels)
    assert version and mm_hash == engine_hash(key, version) == again["features"]["mm_hashes"]["image"][0]
    assert by_url["features"]["mm_hashes"]["image"][0] != mm_hash  # a data URL keeps vLLM's content hash
    assert rendered["token_ids"] == by_url["token_ids"]


def test_a_client_uuid_is_vllms_key_hence_the_reserved_namespace(server, photo_refs):
    """Why the ``mmref-`` namespace is reserved on vLLM's routes: vLLM keys an item by the part's
    uuid alone, so a uuid reused for another image is answered with the first image (measured
    here with a client's own uuid, which the plugin leaves to the client)."""

    def ask(c, ref, **part) -> tuple[list[int], list[float]]:
        image = {"type": "image_url", "image_url": {"url": data_url(ref)}, **part}
        messages = [{"role": "user", "content": [image, {"type": "text", "text": "Describe the pictures."}]}]
        return tokens_and_logprobs(c.post(CHAT, json=chat_body(server.model, messages)))

    with server.client() as c:
        coffee, rocket = ask(c, photo_refs["coffee"]), ask(c, photo_refs["rocket"])
        ask(c, photo_refs["coffee"], uuid="client-key-1")
        reused = ask(c, photo_refs["rocket"], uuid="client-key-1")
    assert coffee[1] != rocket[1]
    same(reused, coffee)  # the rocket's request, answered with the coffee's image


def test_the_trainer_rematerializes_the_chat_routes_pixels(
    server, photo_refs, v2_refs, qwen2_vl_adapter, output_root
):
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

    refs = [photo_refs["chelsea"], v2_refs["rocket"]]
    with server.client() as c:
        rendered, _ = _render(c, server.model, [r.ref for r in refs])
    items = [decode_mm_kwargs_item(s) for s in rendered["features"]["kwargs_data"]["image"]]
    served = torch.cat([it["pixel_values"].data for it in items])
    ids = rendered["token_ids"]
    n = len(ids)
    sample = TrainingSample(
        input_ids=ids, loss_mask=[True] * n, advantages=[0.0] * n, inference_logprobs=[0.0] * n,
        mm_refs=MMRefs(items=refs),
    )  # fmt: skip
    batch = materialize(
        [sample], qwen2_vl_adapter, output_root, MaterializeOptions(raw_pixels=served.dtype == torch.uint8)
    )
    assert batch.features["pixel_values"].dtype == served.dtype
    assert (batch.features["pixel_values"].double() - served.double()).abs().max().item() == 0
    assert torch.equal(
        batch.features["image_grid_thw"], torch.stack([it["image_grid_thw"].data for it in items])
    )


# --- refusals: the token route's, typed, never a 5xx -----------------------------------------------------


def _edited(ref, **changes) -> str:
    return format_mmraw(msgspec.structs.replace(parse_ref(ref.ref), **changes))


def _stored(ref, path: Path, data: bytes) -> str:
    """``ref`` edited to name ``data``, written at ``path``, by its path and hash."""
    path.write_bytes(data)
    return _edited(ref, raw_image_uri=path.as_uri(), mm_hash=hashlib.sha256(data).hexdigest()[:32])


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` (no pixel data: refused before any decode)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )


def refusal_refs(photo_refs, asset_root, tmp_path) -> dict[str, tuple[str, tuple[int, str]]]:
    """One ref per refusal class of the token route: ``name -> (ref, (status, mmref_code))``."""
    good = photo_refs["astronaut"]
    body = parse_ref(good.ref)
    outside = tmp_path / "outside.jpg"
    outside.write_bytes(photo_bytes("astronaut"))
    junk = b"not an image at all" * 50
    bomb = _png_header(20000, 20000)
    t, h, w = body.payload["image_grid_thw"]
    images = asset_root / "images"
    return {
        "invalid_ref": ("mmraw:!!not-base64", (400, "invalid_ref")),
        "mmfile ref": ("mmfile:v1:1:" + "a" * 32 + ":image:" + "b" * 32, (400, "invalid_ref")),
        "unsupported_family": (_edited(good, family="qwen2_5_vl"), (400, "unsupported_family")),
        "outside_root": (_edited(good, raw_image_uri=outside.as_uri()), (403, "outside_root")),
        "asset_not_found": (
            _edited(good, raw_image_uri=(images / "0000000000000000.jpg").as_uri()),
            (404, "asset_not_found"),
        ),
        "hash_mismatch": (_edited(good, mm_hash="0" * 32), (409, "hash_mismatch")),
        "fingerprint_mismatch": (_edited(good, fingerprint="f" * 32), (409, "fingerprint_mismatch")),
        "asset_too_large": (_stored(good, images / "bomb.png", bomb), (413, "asset_too_large")),
        "image_unreadable": (_stored(good, images / "junk.jpg", junk), (422, "image_unreadable")),
        "grid_mismatch": (_edited(good, payload={"image_grid_thw": [t, h + 2, w]}), (422, "grid_mismatch")),
    }


def test_every_refusal_of_the_token_route_is_the_same_typed_4xx_on_the_chat_route(
    server, photo_refs, asset_root, tmp_path, tokenizer_ids
):
    cases = refusal_refs(photo_refs, asset_root, tmp_path)
    good = photo_refs["astronaut"].ref
    with server.client() as c:
        for name, (ref, expected) in cases.items():
            if name != "mmfile ref":  # the token route serves mmfile refs (processed items)
                token = c.post(
                    "/inference/v1/generate",
                    json={"token_ids": tokenizer_ids, "mm_refs": [ref], "sampling_params": {"max_tokens": 2}},
                )
                assert refusal(token) == expected, (name, token.text[:300])
            for messages in (
                [{"role": "user", "content": content([ref])}],
                [{"role": "user", "content": content([good, ref])}],
            ):
                r = c.post(CHAT, json=chat_body(server.model, messages))
                assert refusal(r) == expected, (name, r.text[:300])
                assert r.json()["error"]["ref"] == ref[:512]
            streamed = c.post(
                CHAT, json=chat_body(server.model, [{"role": "user", "content": content([ref])}], stream=True)
            )
            assert refusal(streamed) == expected, name
            one_ref = [{"role": "user", "content": content([ref])}]
            # vLLM's tokenizer route renders chat images too: typed, never a 500
            tokenize = c.post("/tokenize", json={"model": str(server.model), "messages": one_ref})
            assert refusal(tokenize) == expected, (name, tokenize.text[:300])
            parts = c.post(
                "/inference/v1/generate",
                json={
                    "token_ids": tokenizer_ids,
                    "content_parts": [{"type": "image_url", "url": ref}],
                    "sampling_params": {"max_tokens": 2},
                },
            )
            assert refusal(parts) == expected, name
        # invalid_request: too many refs, processor kwargs beside refs, a reserved uuid
        many = [{"role": "user", "content": content([good] * 65)}]
        assert refusal(c.post(CHAT, json=chat_body(server.model, many))) == (400, "invalid_request")
        one = [{"role": "user", "content": content([good])}]
        kwargs = chat_body(server.model, one, mm_processor_kwargs={"max_pixels": 65536})
        assert refusal(c.post(CHAT, json=kwargs)) == (400, "invalid_request")
        reserved = [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": data_url(photo_refs["coffee"])},
                        "uuid": "mmref-" + "0" * 64,
                    }
                ],
            }
        ]
        assert refusal(c.post(CHAT, json=chat_body(server.model, reserved))) == (400, "invalid_request")
        utf16 = json.dumps(chat_body(server.model, reserved)).encode("utf-16")  # vLLM reads UTF-16 JSON too
        wide = c.post(CHAT, content=utf16, headers={"content-type": "application/json"})
        assert refusal(wide) == (400, "invalid_request"), wide.text[:300]
        assert c.get("/health").status_code == 200
        tokens_and_logprobs(c.post(CHAT, json=chat_body(server.model, one)))  # still serving


def test_a_ref_vllm_converts_itself_is_refused_typed_too(server, photo_refs, v2_refs, asset_root, tmp_path):
    """The Anthropic route turns an image source URL into an image part inside vLLM: the connector
    reads the ref there, and a refusal vLLM answers with a 500 (a missing file) or a 400 is
    answered as the plugin's typed refusal."""
    cases = refusal_refs(photo_refs, asset_root, tmp_path)
    with server.client() as c:

        def messages(url: str):
            part = {"type": "image", "source": {"type": "url", "url": url}}
            body = {
                "model": str(server.model),
                "max_tokens": 2,
                "messages": [{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}],
            }
            return c.post("/v1/messages", json=body)

        assert messages(v2_refs["coffee"].ref).status_code == 200
        for name in ("asset_not_found", "hash_mismatch", "grid_mismatch"):
            ref, expected = cases[name]
            assert refusal(messages(ref)) == expected, name


def test_an_object_store_url_is_the_plugins_only_as_an_image_key_under_a_root(tmp_path):
    """``object_key``: exactly ``<object root>/images/<16 hex><ext>``; nothing else (another prefix,
    ``..``, a query, upper-case hex, another extension, a local root's path) is claimed."""
    from protocol.roots import LocalRoot, ObjectRoot, StoreClientConfig

    local, remote = LocalRoot(tmp_path), ObjectRoot("s3://bucket/mmref", StoreClientConfig())
    name = "images/0123456789abcdef.jpg"
    assert chat_refs.object_key([local, remote], f"s3://bucket/mmref/{name}") == (remote, name)
    for url in (
        f"s3://bucket/mmref-other/{name}",
        "s3://bucket/mmref/images/../images/0123456789abcdef.jpg",
        f"s3://bucket/mmref/{name}?versionId=1",
        "s3://bucket/mmref/images/0123456789ABCDEF.jpg",
        "s3://bucket/mmref/images/0123456789abcdef.exe",
        f"s3://bucket/{name}",
        f"{tmp_path}/{name}",
        f"file://{tmp_path}/{name}",
    ):
        assert chat_refs.object_key([local, remote], url) is None, url


def test_content_parts_key_an_object_store_url_as_the_chat_route_does(moto_s3, qwen2_vl_adapter, tmp_path):
    """The generate route's ``content_parts`` key an image key's URL under the server's object-store
    root (its ``uuid`` the content's and the weight version's, the same as its ref's), not only ref
    strings; a URL under no root of the server is left to vLLM (no uuid)."""
    import asyncio

    from fleet_helpers import store_key
    from protocol.roots import AssetRoots, ObjectRoot, StoreClientConfig
    from vllm_plugin.config import PluginConfig
    from vllm_plugin.content_parts import bind_content_refs

    with moto_s3.environment():
        prefix = moto_s3.make_bucket(f"mmref-parts-{uuid.uuid4().hex[:10]}") + "/mmref"
        root = ObjectRoot(prefix, StoreClientConfig(allow_http=True))
        ref = offload_image(
            photo_bytes("coffee", size=(96, 64)), AssetRoots([root]), qwen2_vl_adapter, form="v2"
        )
        config = PluginConfig(asset_root=tmp_path, asset_roots=[prefix], store_allow_http=True)
        service = chat_service(qwen2_vl_adapter, config)
        url = f"{prefix}/{store_key(ref)}"
        parts = [
            {"type": "image_url", "url": url},
            {"type": "image_url", "url": ref.ref},
            {"type": "image_url", "url": url.replace("/mmref/", "/elsewhere/")},
        ]
        previous = request_scope.active()
        request_scope.activate(service)
        try:
            asyncio.run(bind_content_refs(parts, "step-1"))
        finally:
            request_scope.activate(previous)
    assert parts[0]["uuid"].startswith("mmref-") and parts[0]["uuid"] == parts[1]["uuid"]
    assert "uuid" not in parts[2]
