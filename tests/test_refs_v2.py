"""protocol.refs: the content-named ``mmraw:v2:`` form (docs/PROTOCOL.md §1): strict grammar,
exact round trips, the length target, and v1 refs parsing as before beside it."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.errors import InvalidRef
from protocol.refs import (
    IMAGE_EXTS,
    MAX_CONTENT_REF_CHARS,
    MAX_GRID_VALUE,
    ContentRef,
    FileRef,
    RawRefBody,
    format_content_ref,
    format_mmraw,
    image_key,
    is_ref,
    parse_ref,
)
from protocol.structs import RawMMRef

SHA = hashlib.sha256(b"an image").hexdigest()
FP = "fedcba9876543210" * 2
GOOD = ContentRef(sha256=SHA, ext=".jpg", family="qwen2_5_vl", grid=(1, 54, 72), fingerprint=FP)
TEXT = f"mmraw:v2:{SHA}.jpg:qwen2_5_vl:1.54.72:{FP}"


def test_format_and_parse_are_exact_inverses():
    assert format_content_ref(GOOD) == TEXT
    assert parse_ref(TEXT) == GOOD
    no_fp = msgspec.structs.replace(GOOD, fingerprint=None)
    assert format_content_ref(no_fp) == TEXT.rsplit(":", 1)[0]
    assert parse_ref(format_content_ref(no_fp)) == no_fp
    kimi = ContentRef(sha256=SHA, ext=".png", family="kimi_vl", grid=(34, 46))
    assert parse_ref(format_content_ref(kimi)) == kimi
    assert is_ref(TEXT)


def test_the_parsed_ref_carries_what_the_checks_need():
    assert GOOD.modality == "image"
    assert GOOD.mm_hash == SHA  # the whole sha256, not v1's 32-hex prefix
    assert GOOD.key == f"images/{SHA[:16]}.jpg" == image_key(SHA, ".jpg")  # today's store layout


def test_a_real_ref_is_within_the_160_character_target():
    """The issue's target: <= 160 characters per image ref; a v1 ref of the same image was 369."""
    assert len(TEXT) == 129
    longest_family = max(
        ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe", "kimi_k25"), key=len
    )
    worst = ContentRef(sha256=SHA, ext=".webp", family=longest_family, grid=(2, 9999, 9999), fingerprint=FP)
    assert len(format_content_ref(worst)) <= 160
    # the grammar's ceiling: 32-char family, 4 seven-digit entries, 64-hex fingerprint
    ceiling = f"mmraw:v2:{SHA}.webp:{'f' * 32}:{'.'.join(['1048575'] * 4)}:{'a' * 64}"
    assert len(ceiling) <= MAX_CONTENT_REF_CHARS
    assert isinstance(parse_ref(ceiling), ContentRef)


@pytest.mark.parametrize(
    "text",
    [
        TEXT + "\n",  # fullmatch: no trailing newline slips through
        " " + TEXT,
        TEXT.replace(".jpg", ".JPG"),
        TEXT.replace(".jpg", ".jpeg"),
        TEXT.replace(".jpg", ""),
        TEXT.replace(SHA, SHA[:63]),
        TEXT.replace(SHA, SHA.upper()),
        TEXT.replace(SHA, SHA[:32]),  # v1's prefix is not enough here
        TEXT.replace(":qwen2_5_vl:", ":Qwen:"),
        TEXT.replace(":qwen2_5_vl:", "::"),
        TEXT.replace(":qwen2_5_vl:", ":../x:"),
        TEXT.replace("1.54.72", "01.54.72"),
        TEXT.replace("1.54.72", "0.54.72"),
        TEXT.replace("1.54.72", "1.54."),
        TEXT.replace("1.54.72", "1..72"),
        TEXT.replace("1.54.72", "1.2.3.4.5"),
        TEXT.replace("1.54.72", "1.-54.72"),
        TEXT.replace("1.54.72", "1.５4.72"),  # a non-ASCII digit
        TEXT.replace("1.54.72", f"1.{MAX_GRID_VALUE + 1}.72"),
        TEXT.replace("1.54.72", "1.12345678.72"),
        TEXT + ":extra",
        TEXT[:-1] + "F",
        TEXT.replace(FP, FP[:15]),
        TEXT.rsplit(":", 1)[0] + ":",
        "mmraw:v2:",
        "mmraw:v2:" + "a" * 300,
        "mmraw:v3:" + TEXT[9:],
    ],
)
def test_off_grammar_refs_are_invalid(text):
    with pytest.raises(InvalidRef) as info:
        parse_ref(text)
    assert info.value.code == "invalid_ref"


def test_the_struct_refuses_what_the_grammar_refuses():
    for bad in (
        {"sha256": SHA[:63]},
        {"ext": ".exe"},
        {"family": "Qwen"},
        {"grid": ()},
        {"grid": (1, 2, 3, 4, 5)},
        {"grid": (0, 2)},
        {"grid": (True, 2)},
        {"grid": (MAX_GRID_VALUE + 1,)},
        {"fingerprint": "xyz"},
    ):
        with pytest.raises(ValueError):
            msgspec.structs.replace(GOOD, **bad)
    with pytest.raises(ValueError):
        image_key(SHA, ".jpeg")
    with pytest.raises(ValueError):
        image_key("../" + SHA[3:], ".jpg")


def test_v1_refs_parse_as_before_beside_v2():
    body = RawRefBody(
        family="qwen2_vl",
        modality="image",
        mm_hash=SHA[:32],
        payload={"image_grid_thw": [1, 4, 6]},
        raw_image_uri=f"file:///data/run_1/assets/images/{SHA[:16]}.jpg",
        fingerprint=FP,
    )
    v1 = format_mmraw(body)
    assert parse_ref(v1) == body
    assert not v1.startswith("mmraw:v2:")  # base64url never holds ':'
    assert len(v1) > 300  # what v2 replaces
    assert isinstance(parse_ref("mmfile:v1:run_1:" + FP + ":image:" + SHA[:32]), FileRef)


def test_a_raw_mm_ref_may_carry_a_v2_ref():
    item = RawMMRef(ref=TEXT, sha256=SHA, media_type="image/jpeg", grid=[1, 54, 72], num_placeholders=972)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(item), type=RawMMRef) == item


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(st.text(max_size=200))
def test_arbitrary_text_after_the_prefix_parses_or_is_invalid(text):
    try:
        out = parse_ref("mmraw:v2:" + text)
    except InvalidRef:
        return
    assert isinstance(out, ContentRef)
    assert format_content_ref(out) == "mmraw:v2:" + text  # only canonical text parses


@settings(max_examples=200, deadline=None, database=None)
@given(
    sha=st.binary(min_size=1, max_size=64).map(lambda b: hashlib.sha256(b).hexdigest()),
    ext=st.sampled_from(IMAGE_EXTS),
    family=st.from_regex(r"[a-z0-9_]{1,32}", fullmatch=True),
    grid=st.lists(st.integers(1, MAX_GRID_VALUE), min_size=1, max_size=4).map(tuple),
    fp=st.none() | st.from_regex(r"[a-f0-9]{16,64}", fullmatch=True),
)
def test_every_valid_ref_round_trips(sha, ext, family, grid, fp):
    ref = ContentRef(sha256=sha, ext=ext, family=family, grid=grid, fingerprint=fp)
    text = format_content_ref(ref)
    assert len(text) <= MAX_CONTENT_REF_CHARS
    assert parse_ref(text) == ref
