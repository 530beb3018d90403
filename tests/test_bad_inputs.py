"""Hostile input against the real server and the trainer library.

Server: every case is a 4xx whose body parses as vLLM's ``ErrorResponse`` (integer ``code``, no traceback):
the plugin's own refusals carry a stable ``mmref_code``, stock vLLM's own keep stock's body; the
server is healthy and still answers a valid request afterwards. Trainer: a typed error, or the
policy's placeholder with a zeroed loss mask — never silently misaligned features.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import zlib

import msgspec
import pytest
from PIL import Image

from helpers import photo_bytes, refusal
from protocol.errors import (
    AssetOutsideRoot,
    AssetTooLarge,
    FingerprintMismatch,
    GridMismatch,
    HashMismatch,
    ImageUnreadable,
    InvalidRef,
    PlaceholderMismatch,
    UnsupportedFamily,
)
from protocol.refs import RawRefBody, file_uri_to_path, format_mmraw, parse_ref
from protocol.structs import MMRefs, RawMMRef, TrainingSample
from trainer_lib import MaterializeOptions, materialize

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]
GREEDY = {"temperature": 0, "max_tokens": 4}
PAD = 261  # <|image_pad|> of the tiny models


def png_bomb(width: int, height: int) -> bytes:
    """A valid, tiny PNG whose header claims ``width x height`` 1-bit pixels (all zero)."""
    raw = zlib.compress(b"".join(b"\x00" + b"\x00" * ((width + 7) // 8) for _ in range(height)), 9)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", raw) + chunk(b"IEND", b"")


class Bad:
    """Builds hostile refs on top of one good ref and the session's asset store."""

    def __init__(self, good: RawMMRef, asset_root, tmp) -> None:
        self.good = good
        self.body = parse_ref(good.ref)
        self.asset_root = asset_root
        self.tmp = tmp

    def ref(self, **changes) -> str:
        return format_mmraw(msgspec.structs.replace(self.body, **changes))

    def raw_json(self, **changes) -> str:
        doc = msgspec.to_builtins(self.body)
        doc.update(changes)
        return "mmraw:" + msgspec.json.encode(doc).decode()

    def stored(self, data: bytes, ext: str = ".jpg", grid=(1, 4, 4)) -> str:
        """Write raw bytes into the store as a client could (no decoding), return a ref to them."""
        digest = hashlib.sha256(data).hexdigest()
        path = self.asset_root / "images" / f"{digest[:16]}{ext}"
        path.write_bytes(data)
        return self.ref(
            mm_hash=digest[:32], raw_image_uri=path.as_uri(), payload={"image_grid_thw": list(grid)}
        )


@pytest.fixture(scope="module")
def bad(photo_refs, asset_root, tmp_path_factory) -> Bad:
    return Bad(photo_refs["astronaut"], asset_root, tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="module")
def prompt(bad) -> list[int]:
    return [1, 2, 3, *([PAD] * bad.good.num_placeholders), 4, 5]


RESERVED = "mmref-" + "a" * 64  # the namespace of the hashes the server gives resolved refs


def ref_cases(bad: Bad) -> dict[str, tuple[str, int, str]]:
    root_dir = os.path.dirname(file_uri_to_path(bad.body.raw_image_uri))
    outside = bad.tmp / "outside.jpg"
    outside.write_bytes(photo_bytes("astronaut"))
    link = bad.asset_root / "images" / "escape.jpg"
    if not link.is_symlink():
        link.symlink_to(outside)
    jpeg = photo_bytes("coffee")
    text = b"this is not an image, whatever its name says\n" * 10
    wide = io.BytesIO()
    Image.new("RGB", (4020, 20), (200, 10, 10)).save(wide, format="PNG")
    return {
        "dotdot traversal": (bad.ref(raw_image_uri=f"file://{root_dir}/../../../../../../etc/hostname"), 403, "outside_root"),
        "absolute path outside root": (bad.ref(raw_image_uri="file:///etc/hostname"), 403, "outside_root"),
        "percent-encoded dotdot": (bad.ref(raw_image_uri=f"file://{root_dir}/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/hostname"), 403, "outside_root"),
        "NUL byte in path": (bad.ref(raw_image_uri=f"file://{root_dir}/a%00.jpg"), 400, "invalid_ref"),
        "symlink escaping root": (bad.ref(raw_image_uri=link.as_uri()), 403, "outside_root"),
        "http scheme": (bad.ref(raw_image_uri="http://127.0.0.1:1/x.jpg"), 400, "invalid_ref"),
        "data scheme": (bad.ref(raw_image_uri="data:image/jpeg;base64,/9j/4AAQ"), 400, "invalid_ref"),
        "ftp scheme": (bad.ref(raw_image_uri="ftp://127.0.0.1/x.jpg"), 400, "invalid_ref"),
        "remote host": (bad.ref(raw_image_uri="file://fileserver/share/x.jpg"), 400, "invalid_ref"),
        "relative path": (bad.ref(raw_image_uri="file:images/x.jpg"), 400, "invalid_ref"),
        "query string": (bad.ref(raw_image_uri=bad.body.raw_image_uri + "?x=1"), 400, "invalid_ref"),
        "unknown family": (bad.ref(family="llava_next"), 400, "unsupported_family"),
        "malformed family": (bad.raw_json(family="Qwen-VL"), 400, "invalid_ref"),
        "uppercase mm_hash": (bad.raw_json(mm_hash="AB" * 16), 400, "invalid_ref"),
        "oversize mm_hash": (bad.raw_json(mm_hash="ab" * 65), 400, "invalid_ref"),
        "oversize ref": ("mmraw:" + "A" * 9000, 400, "invalid_ref"),
        "unknown ref field": (bad.raw_json(extra="x"), 400, "invalid_ref"),
        "missing ref field": ("mmraw:" + msgspec.json.encode({"family": "qwen2_vl"}).decode(), 400, "invalid_ref"),
        "wrong field type": (bad.raw_json(payload=[1, 2, 3]), 400, "invalid_ref"),
        "not base64 or JSON": ("mmraw:%%%", 400, "invalid_ref"),
        "unknown ref kind": ("mmblob:abc", 400, "invalid_ref"),
        "bad mmfile ids": ("mmfile:v1:../x:" + "a" * 32 + ":image:" + "b" * 32, 400, "invalid_ref"),
        "hash mismatch": (bad.ref(mm_hash="0" * 32), 409, "hash_mismatch"),
        "stale fingerprint": (bad.ref(fingerprint="0" * 32), 409, "fingerprint_mismatch"),
        "grid mismatch": (bad.ref(payload={"image_grid_thw": [1, 4, 4]}), 422, "grid_mismatch"),
        "malformed grid payload": (bad.ref(payload={"image_grid_thw": [1, 0, 4]}), 400, "invalid_ref"),
        "truncated jpeg": (bad.stored(jpeg[: len(jpeg) // 2]), 422, "image_unreadable"),
        "corrupt bytes": (bad.stored(os.urandom(4096)), 422, "image_unreadable"),
        "zero-byte file": (bad.stored(b""), 422, "image_unreadable"),
        "wrong media type": (bad.stored(text), 422, "image_unreadable"),
        "decompression bomb": (bad.stored(png_bomb(20000, 20000), ".png"), 413, "asset_too_large"),
        "extreme aspect ratio": (bad.stored(wide.getvalue(), ".png", grid=(1, 2, 32)), 422, "image_unreadable"),
        "claimed grid above the processor's maximum": (bad.ref(payload={"image_grid_thw": [1, 2, 288]}), 422, "grid_mismatch"),
        "missing file": (bad.ref(raw_image_uri=(bad.asset_root / "images" / "feedfacefeedface.jpg").as_uri()), 404, "asset_not_found"),
        "file name too long": (bad.ref(raw_image_uri=(bad.asset_root / "images" / ("f" * 300 + ".jpg")).as_uri()), 404, "asset_not_found"),
        "deeply nested payload": ("mmraw:" + bad.raw_json(payload={"image_grid_thw": "X"})[6:].replace('"X"', "[" * 1500 + "]" * 1500), 400, "invalid_ref"),
        "missing mmfile": ("mmfile:v1:1:" + "a" * 32 + ":image:" + "b" * 32, 409, "fingerprint_mismatch"),
    }  # fmt: skip


STOCK = None
"""The ``mmref_code`` of a refusal stock vLLM makes itself: its own body, no plugin code."""


def check_error(response, status: int, code: str | None, name: str) -> None:
    assert response.status_code == status, (name, response.status_code, response.text[:300])
    assert refusal(response) == (status, code), (name, response.text[:300])


def test_hostile_refs_get_stable_4xx_codes(server, bad, prompt):
    cases = ref_cases(bad)
    with server.client() as c:
        for name, (ref, status, code) in cases.items():
            body = {"token_ids": prompt, "mm_refs": [ref], "sampling_params": GREEDY}
            check_error(c.post("/inference/v1/generate", json=body), status, code, name)
            slot_body = {
                "token_ids": prompt,
                "features": {
                    "mm_hashes": {"image": ["c" * 64]},
                    "mm_placeholders": {"image": [{"offset": 3, "length": bad.good.num_placeholders}]},
                    "kwargs_data": {"image": [ref]},
                },
                "sampling_params": GREEDY,
            }
            if ref.startswith(("mmraw:", "mmfile:v1:")):  # other strings are upstream's base64 slot
                check_error(c.post("/inference/v1/generate", json=slot_body), status, code, f"slot: {name}")
        assert c.get("/health").status_code == 200
        ok = c.post(
            "/inference/v1/generate",
            json={"token_ids": prompt, "mm_refs": [bad.good.ref], "sampling_params": GREEDY},
        )
        assert ok.status_code == 200, ok.text
    assert len(cases) >= 30


def test_hostile_requests_get_stable_4xx_codes(server, bad, prompt):
    good = msgspec.to_builtins(bad.good)
    base = {"token_ids": prompt, "mm_refs": [good], "sampling_params": GREEDY}
    n = bad.good.num_placeholders
    cases = {
        "placeholders: too few": ({**base, "token_ids": prompt[:3] + prompt[4:]}, 422, "placeholder_mismatch"),
        "placeholders: too many": ({**base, "token_ids": [PAD, *prompt]}, 422, "placeholder_mismatch"),
        "refs without placeholders": ({**base, "token_ids": [1, 2, 3]}, 422, "placeholder_mismatch"),
        "two refs, one run": ({**base, "mm_refs": [good, good]}, 422, "placeholder_mismatch"),
        "declared num_placeholders lies": ({**base, "mm_refs": [{**good, "num_placeholders": n + 1}]}, 422, "placeholder_mismatch"),
        "declared sha256 disagrees": ({**base, "mm_refs": [{**good, "sha256": "0" * 64}]}, 400, "invalid_ref"),
        "RawMMRef unknown field": ({**base, "mm_refs": [{**good, "pixels": []}]}, 400, "invalid_ref"),
        "token_ids as words": ({**base, "token_ids": [f"t{t}" for t in prompt]}, 400, STOCK),  # "7" is 7, as on stock
        "token_ids missing": ({"mm_refs": [good], "sampling_params": GREEDY}, 400, STOCK),
        "negative token id": ({**base, "token_ids": [-1, *prompt]}, 400, STOCK),
        "mm_refs is a dict": ({**base, "mm_refs": {"a": good}}, 400, "invalid_request"),
        "mm_refs entry is an int": ({**base, "mm_refs": [7]}, 400, "invalid_request"),
        "empty mm_refs": ({**base, "mm_refs": []}, 400, "invalid_request"),
        "mm_refs and features": ({**base, "features": {"mm_hashes": {}, "mm_placeholders": {}}}, 400, "invalid_request"),
        "too many refs": ({**base, "mm_refs": [good] * 65}, 400, "invalid_request"),
        "sampling_params wrong type": ({**base, "sampling_params": "greedy"}, 400, STOCK),
        "features lengths differ": (
            {"token_ids": prompt, "sampling_params": GREEDY, "features": {
                "mm_hashes": {"image": ["c" * 64, "d" * 64]},
                "mm_placeholders": {"image": [{"offset": 3, "length": n}]},
                "kwargs_data": {"image": [bad.good.ref]}}},
            400, STOCK,
        ),
        "placeholder range off the prompt": (
            {"token_ids": prompt, "sampling_params": GREEDY, "features": {
                "mm_hashes": {"image": ["c" * 64]},
                "mm_placeholders": {"image": [{"offset": 10_000, "length": n}]},
                "kwargs_data": {"image": [bad.good.ref]}}},
            400, STOCK,
        ),
        "features: placeholder entries not objects": (
            {"token_ids": prompt, "sampling_params": GREEDY, "features": {
                "mm_hashes": {"image": ["c" * 64]},
                "mm_placeholders": {"image": ["ab"]},
                "kwargs_data": {"image": [bad.good.ref]}}},
            400, STOCK,
        ),
        "features: hashes not strings": (
            {"token_ids": prompt, "sampling_params": GREEDY, "features": {
                "mm_hashes": {"image": [7]},
                "mm_placeholders": {"image": [{"offset": 3, "length": n}]},
                "kwargs_data": {"image": [None]}}},
            400, STOCK,
        ),
        "features: overlapping ranges": (
            {"token_ids": prompt, "sampling_params": GREEDY, "features": {
                "mm_hashes": {"image": ["c" * 64, "d" * 64]},
                "mm_placeholders": {"image": [{"offset": 3, "length": n}, {"offset": 4, "length": n}]},
                "kwargs_data": {"image": [bad.good.ref, bad.good.ref]}}},
            400, STOCK,
        ),
        "features is a list": ({"token_ids": prompt, "sampling_params": GREEDY, "features": [1]}, 400, STOCK),
        "cache-only slot, unknown hash": (
            {"token_ids": prompt, "sampling_params": GREEDY, "features": {
                "mm_hashes": {"image": ["e" * 64]},
                "mm_placeholders": {"image": [{"offset": 3, "length": n}]},
                "kwargs_data": {"image": [None]}}},
            404, "not_cached",
        ),
        "inline item under a reserved hash": (
            {"token_ids": prompt, "sampling_params": GREEDY, "features": {
                "mm_hashes": {"image": [RESERVED]},
                "mm_placeholders": {"image": [{"offset": 3, "length": n}]},
                "kwargs_data": {"image": ["AAAA"]}}},
            400, "invalid_request",
        ),
        "inline item that is not a vLLM item": (
            {"token_ids": prompt, "sampling_params": GREEDY, "features": {
                "mm_hashes": {"image": ["c" * 64]},
                "mm_placeholders": {"image": [{"offset": 3, "length": n}]},
                "kwargs_data": {"image": ["AAAA"]}}},
            400, "invalid_request",
        ),
        "inline item that is not base64": (
            {"token_ids": prompt, "sampling_params": GREEDY, "features": {
                "mm_hashes": {"image": ["c" * 64]},
                "mm_placeholders": {"image": [{"offset": 3, "length": n}]},
                "kwargs_data": {"image": ["!!not base64!!"]}}},
            400, "invalid_request",
        ),
        "content_parts uuid in the reserved namespace": (
            {"token_ids": prompt, "sampling_params": GREEDY,
             "content_parts": [{"type": "image_url", "url": bad.body.raw_image_uri, "uuid": RESERVED}]},
            400, "invalid_request",
        ),
        "ref slots beyond the limit": (
            {"token_ids": prompt, "sampling_params": GREEDY, "features": {
                "mm_hashes": {"image": ["c" * 64] * 65},
                "mm_placeholders": {"image": [{"offset": i, "length": 1} for i in range(65)]},
                "kwargs_data": {"image": [bad.good.ref] * 65}}},
            400, "invalid_request",
        ),
        "a modality the server does not serve": (
            {"token_ids": prompt, "sampling_params": GREEDY, "features": {
                "mm_hashes": {"video": ["c" * 64]},
                "mm_placeholders": {"video": [{"offset": 3, "length": n}]},
                "kwargs_data": {"video": [bad.good.ref]}}},
            400, "invalid_request",
        ),
        "max_tokens below 1 (vLLM's own check)": ({**base, "sampling_params": {"max_tokens": 0}}, 400, STOCK),
        "token id beyond the vocabulary": ({**base, "token_ids": [10**9, *prompt]}, 400, STOCK),
        "prompt longer than max_model_len": ({**base, "token_ids": [1] * 5000 + prompt}, 400, STOCK),
    }  # fmt: skip
    with server.client() as c:
        for name, (body, status, code) in cases.items():
            check_error(c.post("/inference/v1/generate", json=body), status, code, name)
        raw_cases = {
            "malformed JSON": (b'{"token_ids": [1, 2', "application/json", STOCK),
            "JSON array body": (b"[1, 2, 3]", "application/json", STOCK),
            "malformed msgpack": (b"\xc1\xff\x00", "application/msgpack", "invalid_request"),
            "msgpack non-map": (msgspec.msgpack.encode([1, 2]), "application/msgpack", STOCK),
            "no content type": (msgspec.json.encode(base), "", STOCK),
        }
        for name, (content, ctype, code) in raw_cases.items():
            r = c.post("/inference/v1/generate", content=content, headers={"content-type": ctype})
            check_error(r, 400, code, name)
        # JSON nested deeper than the parser's recursion: FastAPI's own answer, as on stock
        deep = b'{"token_ids": ' + b"[" * 1500 + b"]" * 1500 + b"}"
        r = c.post("/inference/v1/generate", content=deep, headers={"content-type": "application/json"})
        assert (r.status_code, r.json()) == (400, {"detail": "There was an error parsing the body"})
        # mm_metadata at a ref slot (vLLM merges it over the item) is dropped, never merged:
        # garbage there would otherwise fail vLLM's decoder or override the resolved tensors
        slot_body = {"token_ids": prompt, "sampling_params": GREEDY, "features": {
            "mm_hashes": {"image": ["c" * 64]},
            "mm_placeholders": {"image": [{"offset": 3, "length": n}]},
            "kwargs_data": {"image": [bad.good.ref]},
            "mm_metadata": {"image": ["AAAA"]}}}  # fmt: skip
        assert c.post("/inference/v1/resolve", json=slot_body).json()["features"]["mm_metadata"] == {
            "image": [None]
        }
        r = c.post("/inference/v1/generate", json=slot_body)
        assert r.status_code == 200, r.text
        # msgpack types JSON cannot carry, inside a RawMMRef: typed refusals, not 500s
        for name, value in (
            ("sha256 as bytes", bytes.fromhex(bad.good.sha256)),
            ("Ext", msgspec.msgpack.Ext(1, b"x")),
        ):
            hostile = {**base, "mm_refs": [{**good, "sha256": value}]}
            r = c.post("/inference/v1/generate", content=msgspec.msgpack.encode(hostile),
                       headers={"content-type": "application/msgpack"})  # fmt: skip
            check_error(r, 400, "invalid_ref", f"msgpack: {name}")
        # a valid msgpack body works like JSON
        r = c.post(
            "/inference/v1/generate",
            content=msgspec.msgpack.encode(base),
            headers={"content-type": "application/msgpack"},
        )
        assert r.status_code == 200, r.text
        # the same image twice in one prompt is legitimate: two runs, two ranges
        twice = [1, *([PAD] * n), 2, *([PAD] * n), 3]
        r = c.post("/inference/v1/resolve", json={"token_ids": twice, "mm_refs": [good, good]})
        assert r.status_code == 200, r.text
        assert r.json()["features"]["mm_placeholders"]["image"] == [
            {"offset": 1, "length": n},
            {"offset": n + 2, "length": n},
        ]
        assert c.get("/health").status_code == 200


# --- trainer library -------------------------------------------------------------------------------


def sample(refs, input_ids=None) -> TrainingSample:
    ids = input_ids if input_ids is not None else [PAD] * sum(r.num_placeholders for r in refs)
    n = len(ids)
    return TrainingSample(
        input_ids=ids, loss_mask=[True] * n, advantages=[0.0] * n, inference_logprobs=[0.0] * n,
        mm_refs=MMRefs(items=list(refs)),
    )  # fmt: skip


def as_ref(bad: Bad, ref: str, grid=None) -> RawMMRef:
    body = parse_ref(ref)
    g = list(body.payload["image_grid_thw"]) if isinstance(body, RawRefBody) and grid is None else grid
    return msgspec.structs.replace(bad.good, ref=ref, grid=g, num_placeholders=g[0] * g[1] * g[2] // 4)


def test_trainer_refuses_or_zero_losses_hostile_refs(bad, qwen2_vl_adapter, output_root):
    cases = ref_cases(bad)
    always_raise = {
        "dotdot traversal": AssetOutsideRoot,
        "absolute path outside root": AssetOutsideRoot,
        "percent-encoded dotdot": AssetOutsideRoot,
        "symlink escaping root": AssetOutsideRoot,
        "http scheme": InvalidRef,
        "NUL byte in path": InvalidRef,
        "unknown family": UnsupportedFamily,
        "stale fingerprint": FingerprintMismatch,
        "grid mismatch": GridMismatch,
    }
    zero_loss = {  # the image itself is missing or bad: the policy decides
        "hash mismatch": HashMismatch,
        "truncated jpeg": ImageUnreadable,
        "corrupt bytes": ImageUnreadable,
        "zero-byte file": ImageUnreadable,
        "wrong media type": ImageUnreadable,
        "decompression bomb": AssetTooLarge,
        "extreme aspect ratio": ImageUnreadable,
    }
    for name, error in always_raise.items():
        r = as_ref(bad, cases[name][0])
        for policy in ("placeholder_zero_loss", "error"):
            with pytest.raises(error) as info:
                materialize([sample([r])], qwen2_vl_adapter, output_root, MaterializeOptions(policy=policy))
            assert info.value.ref == r.ref, name
    for name, error in zero_loss.items():
        r = as_ref(bad, cases[name][0])
        batch = materialize([sample([bad.good]), sample([r])], qwen2_vl_adapter, output_root)
        assert [any(s.loss_mask) for s in batch.samples] == [True, False], name
        t, h, w = r.grid
        assert batch.features["pixel_values"][-t * h * w :].abs().sum() == 0, name
        with pytest.raises(error) as info:
            materialize([sample([r])], qwen2_vl_adapter, output_root, MaterializeOptions(policy="error"))
        assert info.value.ref == r.ref, name


def test_trainer_never_trains_on_misaligned_placeholders(bad, qwen2_vl_adapter, output_root):
    good = bad.good
    n = good.num_placeholders
    lying = msgspec.structs.replace(good, num_placeholders=n + 4)
    with pytest.raises(PlaceholderMismatch):
        materialize([sample([lying], [PAD] * (n + 4))], qwen2_vl_adapter, output_root)
    with pytest.raises(GridMismatch):
        materialize([sample([msgspec.structs.replace(good, grid=[1, 4, 4])])], qwen2_vl_adapter, output_root)
    checked = MaterializeOptions(placeholder_token_id=PAD)
    for ids in ([PAD] * (n - 1), [PAD] * (n + 1), [1, 2, 3]):
        with pytest.raises(PlaceholderMismatch, match=f"id {PAD}"):
            materialize([sample([good], ids)], qwen2_vl_adapter, output_root, checked)
    # a placeholder-id token typed as text beside an image: the model scatters by token id (N+1 rows
    # for N), so materialize refuses it as packing and the server do (one locate_image_runs)
    ids = [PAD, *([PAD] * n)]
    types = [0] + [1] * n
    s = msgspec.structs.replace(sample([good], ids), mm_refs=MMRefs(items=[good], mm_token_type_ids=types))
    with pytest.raises(PlaceholderMismatch, match="typed as text"):
        materialize([s], qwen2_vl_adapter, output_root, checked)
    # typed positions decide where the images are: a well-typed prompt passes
    s = msgspec.structs.replace(s, input_ids=[7, *([PAD] * n)])
    assert materialize([s], qwen2_vl_adapter, output_root, checked).stats.images == 1
