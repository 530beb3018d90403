"""protocol.refs: the mmraw / mmfile ref strings (docs/PROTOCOL.md §1) and file:// URIs."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.errors import InvalidRef
from protocol.refs import (
    MAX_REF_CHARS,
    FileRef,
    RawRefBody,
    file_uri_to_path,
    format_mmfile,
    format_mmraw,
    is_ref,
    parse_ref,
)

MM_HASH = "0123456789abcdef" * 2  # sha256(file bytes)[:32]
FINGERPRINT = "fedcba9876543210" * 2
URI = "file:///data/run_1/assets/images/0123456789abcdef.jpg"


def body_dict(**overrides) -> dict:
    d = {
        "family": "qwen2_vl",
        "modality": "image",
        "mm_hash": MM_HASH,
        "payload": {"image_grid_thw": [1, 4, 6]},
        "fingerprint": FINGERPRINT,
        "raw_image_uri": URI,
    }
    d.update(overrides)
    return {k: v for k, v in d.items() if v is not _DROP}


_DROP = object()


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def mmraw_b64(d: dict) -> str:
    return "mmraw:" + b64url(json.dumps(d).encode())


def mmraw_json(d: dict) -> str:
    return "mmraw:" + json.dumps(d, separators=(",", ":"))


def decode_body(ref: str) -> dict:
    body = ref.removeprefix("mmraw:")
    return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))


# ---------------------------------------------------------------------------------------------------------
# mmraw
# ---------------------------------------------------------------------------------------------------------


def test_mmraw_round_trip_base64url_without_padding():
    body = RawRefBody(**body_dict())
    ref = format_mmraw(body)
    assert ref.startswith("mmraw:")
    encoded = ref.removeprefix("mmraw:")
    assert "=" not in encoded and "+" not in encoded and "/" not in encoded
    assert decode_body(ref) == body_dict()
    assert parse_ref(ref) == body
    assert is_ref(ref)


def test_mmraw_format_is_deterministic_and_omits_a_missing_fingerprint():
    body = RawRefBody(**body_dict(fingerprint=_DROP, payload={"b": 2, "a": [1, 2, 3]}))
    ref = format_mmraw(body)
    assert ref == format_mmraw(RawRefBody(**body_dict(fingerprint=_DROP, payload={"a": [1, 2, 3], "b": 2})))
    assert "fingerprint" not in decode_body(ref)
    parsed = parse_ref(ref)
    assert parsed.fingerprint is None
    assert parsed == body


def test_mmraw_needs_padding_bytes_to_be_dropped():
    # A body whose JSON length is not a multiple of 3 would carry '=' padding in plain base64.
    for extra in ("", "x", "xy"):
        body = RawRefBody(**body_dict(payload={"image_grid_thw": [1, 4, 6], "k": extra}))
        ref = format_mmraw(body)
        assert not ref.endswith("=")
        assert parse_ref(ref) == body


def test_mmraw_accepts_externally_encoded_base64url():
    """A ref written by another client (json.dumps with spaces, key order of its own) parses the same."""
    d = body_dict()
    reordered = dict(reversed(list(d.items())))
    assert parse_ref(mmraw_b64(reordered)) == RawRefBody(**d)


def test_mmraw_compact_json_form():
    d = body_dict()
    assert parse_ref(mmraw_json(d)) == RawRefBody(**d)
    # Spaces inside the JSON are fine as long as the body starts with "{".
    assert parse_ref("mmraw:" + json.dumps(d, indent=1)) == RawRefBody(**d)


def test_mmraw_payload_is_kept_as_given():
    payload = {"grid_thws": [1, 8, 12], "nested": {"x": [1.5, None, True]}}
    parsed = parse_ref(mmraw_json(body_dict(family="kimi_k25", payload=payload)))
    assert parsed.payload == payload
    assert parsed.family == "kimi_k25"


@pytest.mark.parametrize(
    "ref",
    [
        "",
        "mmraw",
        "MMRAW:" + b64url(b"{}"),
        "mmfile:v2:run:" + "a" * 16 + ":image:" + "b" * 32,
        "data:image/png;base64,iVBORw0KGgo=",
        "file:///data/x.jpg",
        " mmraw:" + b64url(b"{}"),
    ],
)
def test_unknown_prefix_is_rejected(ref):
    with pytest.raises(InvalidRef):
        parse_ref(ref)
    assert not is_ref(ref)


@pytest.mark.parametrize(
    "body",
    [
        "",  # empty
        "a",  # 1 mod 4: not decodable
        "abcde",  # 1 mod 4
        "eyJ$",  # not in the alphabet
        "eyJm+YW1",  # '+' is standard base64, not base64url
        "eyJm/YW1",
        "eyJm YW1",
        "e30=",  # '{}' with padding: refs are written and read without padding (docs/PROTOCOL.md §1)
        " e30",
    ],
)
def test_bad_base64_is_rejected(body):
    with pytest.raises(InvalidRef) as info:
        parse_ref("mmraw:" + body)
    assert info.value.ref == "mmraw:" + body


@pytest.mark.parametrize(
    "payload",
    [b"not json", b"\xff\xfe\x00", b"[1, 2, 3]", b'"string"', b"null", b"{", b'{"family": "qwen2_vl",}'],
)
def test_non_json_or_non_object_body_is_rejected(payload):
    with pytest.raises(InvalidRef):
        parse_ref("mmraw:" + b64url(payload))


@pytest.mark.parametrize("text", ["{", "{not json}", "{}", '{"family": "qwen2_vl"', "{\ud800}"])
def test_bad_compact_json_is_rejected(text):
    with pytest.raises(InvalidRef):
        parse_ref("mmraw:" + text)


@pytest.mark.parametrize("encode", [mmraw_b64, mmraw_json], ids=["base64url", "json"])
def test_unknown_field_is_rejected(encode):
    with pytest.raises(InvalidRef):
        parse_ref(encode(body_dict(raw_image_id="abc")))


@pytest.mark.parametrize("encode", [mmraw_b64, mmraw_json], ids=["base64url", "json"])
@pytest.mark.parametrize("field", ["family", "modality", "mm_hash", "payload", "raw_image_uri"])
def test_missing_required_field_is_rejected(encode, field):
    with pytest.raises(InvalidRef):
        parse_ref(encode(body_dict(**{field: _DROP})))


@pytest.mark.parametrize(
    "override",
    [
        {"family": 1},
        {"family": None},
        {"modality": "audio"},  # "video" is a modality since issue 44 (test_video_modality_parses)
        {"modality": ["image"]},
        {"mm_hash": 123},
        {"mm_hash": None},
        {"payload": [1, 4, 6]},
        {"payload": "image_grid_thw"},
        {"payload": None},
        {"raw_image_uri": 5},
        {"raw_image_uri": None},
        {"fingerprint": 7},
    ],
    ids=repr,
)
def test_wrong_types_are_rejected(override):
    d = body_dict()
    d.update(override)
    with pytest.raises(InvalidRef):
        parse_ref(mmraw_json(d))
    with pytest.raises(InvalidRef):
        parse_ref(mmraw_b64(d))


def test_video_modality_parses():
    """Issue 44: a v1 body may name a video (its payload is the video adapter's to check)."""
    d = body_dict(modality="video", payload={"video_grid_thw": [2, 8, 12]})
    for encode in (mmraw_json, mmraw_b64):
        assert parse_ref(encode(d)).modality == "video"


@pytest.mark.parametrize(
    "field,value",
    [
        ("family", ""),
        ("family", "Qwen2_VL"),
        ("family", "qwen2-vl"),
        ("family", "qwen/../x"),
        ("family", "a" * 33),
        ("family", "qwen2_vl\n"),
        ("mm_hash", "0123456789ABCDEF" * 2),
        ("mm_hash", "0123456789abcde"),  # 15 hex: too short
        ("mm_hash", "a" * 129),
        ("mm_hash", "g" * 32),
        ("mm_hash", "../../etc/passwd"),
        ("mm_hash", MM_HASH + "\n"),
        ("fingerprint", "0123456789abcde"),
        ("fingerprint", "a" * 65),
        ("fingerprint", "F" * 32),
        ("fingerprint", ""),
        ("fingerprint", FINGERPRINT + "\n"),
    ],
)
def test_bad_id_patterns_are_rejected(field, value):
    with pytest.raises(InvalidRef):
        parse_ref(mmraw_json(body_dict(**{field: value})))
    with pytest.raises(InvalidRef):
        parse_ref(mmraw_b64(body_dict(**{field: value})))


@pytest.mark.parametrize(
    "field,value",
    [
        ("family", "a"),
        ("family", "a" * 32),
        ("family", "kimi_k25"),
        ("mm_hash", "a" * 16),
        ("mm_hash", "a" * 128),
        ("fingerprint", "0" * 16),
        ("fingerprint", "f" * 64),
    ],
)
def test_id_pattern_bounds_are_accepted(field, value):
    assert getattr(parse_ref(mmraw_json(body_dict(**{field: value}))), field) == value


def test_constructing_a_body_with_a_bad_id_fails():
    # __post_init__ runs on construction too, so format_mmraw can never emit a ref that parse_ref rejects.
    with pytest.raises(ValueError):
        RawRefBody(**body_dict(mm_hash="XYZ"))


def test_max_ref_chars_boundary():
    compact = mmraw_json(body_dict())
    # JSON allows trailing whitespace: pad the compact form to exactly the limit, then one over.
    at_limit = compact + " " * (MAX_REF_CHARS - len(compact))
    assert len(at_limit) == MAX_REF_CHARS
    assert parse_ref(at_limit) == RawRefBody(**body_dict())
    with pytest.raises(InvalidRef):
        parse_ref(at_limit + " ")


def test_over_max_ref_chars_is_rejected_before_decoding():
    huge = format_mmraw(RawRefBody(**body_dict(payload={"blob": "x" * MAX_REF_CHARS})))
    assert len(huge) > MAX_REF_CHARS
    with pytest.raises(InvalidRef) as info:
        parse_ref(huge)
    assert len(info.value.ref) <= 200  # the echoed ref is truncated


@pytest.mark.parametrize("value", [None, 1, 1.5, b"mmraw:e30", ["mmraw:e30"], {"ref": "mmraw:e30"}], ids=repr)
def test_non_string_input_is_rejected(value):
    with pytest.raises(InvalidRef):
        parse_ref(value)
    assert not is_ref(value)


# ---------------------------------------------------------------------------------------------------------
# mmfile
# ---------------------------------------------------------------------------------------------------------


def test_mmfile_round_trip():
    ref = f"mmfile:v1:run_1:{FINGERPRINT}:image:{MM_HASH}"
    parsed = parse_ref(ref)
    assert parsed == FileRef(run_id="run_1", fingerprint=FINGERPRINT, modality="image", mm_hash=MM_HASH)
    assert format_mmfile(parsed) == ref
    assert is_ref(ref)


@pytest.mark.parametrize("run_id", ["r", "run-2024.01_A", "...x", "a..b", "run_1.2"])
def test_mmfile_accepts_safe_run_ids(run_id):
    ref = f"mmfile:v1:{run_id}:{FINGERPRINT}:image:{MM_HASH}"
    assert parse_ref(ref).run_id == run_id
    assert format_mmfile(parse_ref(ref)) == ref


@pytest.mark.parametrize(
    "ref",
    [
        f"mmfile:v1:run_1:{FINGERPRINT}:image",  # 3 parts
        f"mmfile:v1:run_1:{FINGERPRINT}:image:{MM_HASH}:extra",  # 5 parts
        f"mmfile:v1:{FINGERPRINT}:image:{MM_HASH}",
        "mmfile:v1:",
        f"mmfile:v1:::image:{MM_HASH}",
        f"mmfile:v1:..:{FINGERPRINT}:image:{MM_HASH}",
        f"mmfile:v1:.:{FINGERPRINT}:image:{MM_HASH}",
        f"mmfile:v1:../run_2:{FINGERPRINT}:image:{MM_HASH}",
        f"mmfile:v1:run/1:{FINGERPRINT}:image:{MM_HASH}",
        f"mmfile:v1::{FINGERPRINT}:image:{MM_HASH}",
        f"mmfile:v1:run 1:{FINGERPRINT}:image:{MM_HASH}",
        f"mmfile:v1:run_1\n:{FINGERPRINT}:image:{MM_HASH}",
        f"mmfile:v1:run_1:{FINGERPRINT}:video:{MM_HASH}",
        f"mmfile:v1:run_1:{FINGERPRINT}:Image:{MM_HASH}",
        f"mmfile:v1:run_1:{FINGERPRINT}::{MM_HASH}",
        f"mmfile:v1:run_1:{FINGERPRINT.upper()}:image:{MM_HASH}",
        f"mmfile:v1:run_1:{FINGERPRINT}:image:{MM_HASH.upper()}",
        f"mmfile:v1:run_1:{FINGERPRINT}:image:{MM_HASH[:-1]}A",
        f"mmfile:v1:run_1:{FINGERPRINT[:15]}:image:{MM_HASH}",
        f"mmfile:v1:run_1:{FINGERPRINT}:image:{MM_HASH[:15]}",
        f"mmfile:v1:run_1:{FINGERPRINT}:image:{MM_HASH}\n",
        f"mmfile:v1:run_1:{FINGERPRINT}\n:image:{MM_HASH}",
    ],
    ids=repr,
)
def test_mmfile_rejections(ref):
    with pytest.raises(InvalidRef) as info:
        parse_ref(ref)
    assert info.value.ref == ref


# ---------------------------------------------------------------------------------------------------------
# file:// URIs
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "uri,path",
    [
        ("file:///data/run_1/assets/images/a.jpg", "/data/run_1/assets/images/a.jpg"),
        ("file://localhost/data/a.jpg", "/data/a.jpg"),
        ("file:///data/with%20space/%23hash.jpg", "/data/with space/#hash.jpg"),
        ("file:///data/caf%C3%A9.png", "/data/café.png"),
        ("file:///data/%2e%2e/x", "/data/../x"),  # decoded, not resolved: confinement is the store's job
    ],
)
def test_file_uri_to_path_accepts(uri, path):
    assert file_uri_to_path(uri) == path


def test_file_uri_to_path_inverts_path_as_uri(tmp_path):
    for name in ("plain.jpg", "with space.png", "pct%41.gif", "hash#q?.webp", "ünï.jpg", "semi;colon.jpg"):
        p = tmp_path / name
        assert file_uri_to_path(p.as_uri()) == str(p)


@pytest.mark.parametrize(
    "uri",
    [
        "http://example.com/a.jpg",
        "https://localhost/a.jpg",
        "data:image/png;base64,iVBORw0KGgo=",
        "ftp://host/a.jpg",
        "s3://bucket/a.jpg",
        "/data/a.jpg",  # no scheme
        "file://example.com/data/a.jpg",  # remote host
        "file://rel/data/a.jpg",  # what Path('rel/...').as_uri() must never produce: 'rel' is a host
        "file:rel/a.jpg",  # relative path
        "file:",
        "file:///data/a%00.jpg",  # NUL
        "file:///data/a.jpg?x=1",
        "file:///data/a.jpg#frag",
    ],
)
def test_file_uri_to_path_rejects(uri):
    with pytest.raises(InvalidRef) as info:
        file_uri_to_path(uri, ref="mmraw:e30")
    assert info.value.ref == "mmraw:e30"


def test_relative_path_cannot_produce_a_file_uri():
    with pytest.raises(ValueError):
        Path("rel/a.jpg").as_uri()


# ---------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------

_hex = "0123456789abcdef"
_bodies = st.builds(
    RawRefBody,
    family=st.from_regex(r"\A[a-z0-9_]{1,32}\Z"),
    modality=st.just("image"),
    mm_hash=st.text(_hex, min_size=16, max_size=128),
    payload=st.dictionaries(
        st.text(max_size=8),
        st.recursive(
            st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
            lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
            max_leaves=6,
        ),
        max_size=3,
    ),
    raw_image_uri=st.text(max_size=40),
    fingerprint=st.none() | st.text(_hex, min_size=16, max_size=64),
)


@settings(max_examples=300, deadline=None)
@given(_bodies)
def test_mmraw_round_trip_property(body):
    ref = format_mmraw(body)
    assert parse_ref(ref) == body
    assert "=" not in ref


@settings(max_examples=300, deadline=None)
@given(
    run_id=st.from_regex(r"\A[A-Za-z0-9_.-]+\Z").filter(lambda s: s not in (".", "..")),
    fingerprint=st.text(_hex, min_size=16, max_size=64),
    mm_hash=st.text(_hex, min_size=16, max_size=128),
)
def test_mmfile_round_trip_property(run_id, fingerprint, mm_hash):
    ref = FileRef(run_id=run_id, fingerprint=fingerprint, modality="image", mm_hash=mm_hash)
    assert parse_ref(format_mmfile(ref)) == ref


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(st.characters(exclude_characters="/\x00", exclude_categories=["Cs"]), min_size=1)))
def test_file_uri_to_path_inverts_as_uri_property(parts):
    p = Path("/", *[part for part in parts if part not in (".", "..")])
    assert file_uri_to_path(p.as_uri()) == str(p)


_PREFIXES = ("", "mmraw:", "mmraw:{", "mmfile:v1:")
_any_text = st.text(
    st.characters() | st.sampled_from(["\ud800", "\udfff", "\x00", "{", "}", ":", '"', "\n", "=", "-", "_"]),
    max_size=300,
)


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=st.sampled_from(_PREFIXES), text=_any_text)
def test_parse_ref_never_raises_anything_but_invalid_ref(prefix, text):
    try:
        result = parse_ref(prefix + text)
    except InvalidRef:
        return
    assert isinstance(result, RawRefBody | FileRef)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_parse_ref_on_arbitrary_base64url_bodies(data):
    try:
        result = parse_ref("mmraw:" + b64url(data))
    except InvalidRef:
        return
    assert isinstance(result, RawRefBody)


@settings(max_examples=500, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["family", "modality", "mm_hash", "payload", "fingerprint", "raw_image_uri", "x"]),
        st.none()
        | st.booleans()
        | st.integers()
        | st.text(max_size=20)
        | st.lists(st.integers(), max_size=3),
    )
)
def test_parse_ref_on_arbitrary_json_objects(d):
    """Well-formed but arbitrary JSON: only a fully valid body parses, everything else is InvalidRef."""
    for ref in (mmraw_json(d), mmraw_b64(d)):
        try:
            result = parse_ref(ref)
        except InvalidRef:
            continue
        assert isinstance(result, RawRefBody)
        assert set(d) <= {"family", "modality", "mm_hash", "payload", "fingerprint", "raw_image_uri"}


def test_parse_ref_is_fast_on_a_max_size_garbage_ref():
    junk = "mmraw:" + "A" * (MAX_REF_CHARS - len("mmraw:"))
    start = time.perf_counter()
    for _ in range(100):
        with pytest.raises(InvalidRef):
            parse_ref(junk)
    assert time.perf_counter() - start < 1.0
