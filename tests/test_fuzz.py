"""Fuzzing of ref-string parsing, envelope decoding and micro-batch rebuilding (hypothesis).

Every input either parses or raises the module's typed error: never another exception. CI runs
``MMREF_FUZZ_EXAMPLES`` (default 1500) examples per target; ``scripts/fuzz.py`` runs the same
targets with 100k+ each.
"""

from __future__ import annotations

import base64
import os

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import FAKE, TOK, make_ref, make_sample
from protocol.errors import InvalidRef, MMRefError
from protocol.features import feature_path, read_feature_item, run_asset_root, write_feature_item
from protocol.refs import FileRef, RawRefBody, file_uri_to_path, format_mmraw, parse_ref
from protocol.structs import MicroBatch, decode_microbatch, decode_sample
from trainer_lib.planning.packing import PackEntry, build_micro_batch, rebuild_micro_batch
from trainer_lib.planning.padding import make_pad_sample

EXAMPLES = int(os.environ.get("MMREF_FUZZ_EXAMPLES", "1500"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 5000,  # CI: reproducible; long runs explore
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)
FP = "ab" * 16


def parses_or_invalid(text: str) -> None:
    try:
        out = parse_ref(text)
    except InvalidRef:
        return
    assert isinstance(out, RawRefBody | FileRef)


@FUZZ
@given(st.text(max_size=300))
def test_parse_ref_arbitrary_text(text):
    parses_or_invalid(text)
    parses_or_invalid("mmraw:" + text)
    parses_or_invalid("mmfile:v1:" + text)


@FUZZ
@given(st.binary(max_size=400))
def test_parse_ref_arbitrary_base64_and_json_bodies(data):
    parses_or_invalid("mmraw:" + base64.urlsafe_b64encode(data).rstrip(b"=").decode())
    parses_or_invalid("mmraw:{" + data.decode("utf-8", "replace"))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "family": json_values | st.sampled_from(["qwen2_vl", "QWEN", "a" * 40, "qwen2_vl\n"]),
            "modality": json_values | st.just("image"),
            "mm_hash": json_values | st.sampled_from(["ab" * 16, "AB" * 16, "a" * 200, "ab" * 16 + "\n"]),
            "payload": json_values | st.just({"image_grid_thw": [1, 2, 2]}),
            "raw_image_uri": json_values | st.text(max_size=60),
            "fingerprint": json_values,
            "extra": json_values,
        },
    )
)
def test_parse_ref_structured_json(doc):
    text = msgspec.json.encode(doc).decode()
    parses_or_invalid("mmraw:" + text)
    parses_or_invalid("mmraw:" + base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode())


@FUZZ
@given(st.text(max_size=200))
def test_file_uri_to_path(text):
    for uri in (text, "file://" + text, "file:///" + text):
        try:
            path = file_uri_to_path(uri)
        except InvalidRef:
            continue
        assert path.startswith("/") and "\x00" not in path


@FUZZ
@given(st.binary(max_size=600) | st.binary(max_size=40).map(lambda b: b"\x98\x90\x90\x90\x90\xc0" + b))
def test_training_sample_and_microbatch_decoding(data):
    for decode in (decode_sample, decode_microbatch):
        try:
            decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass


MB_FIELDS = list(MicroBatch.__struct_fields__)


@st.composite
def tampered_micro_batches(draw):
    """A real packed micro-batch (images, text, stray placeholders, a synthetic pad), then 1-3 of
    its wire fields replaced by drawn values: shuffled/edited lists, moved boundaries, other grids."""
    refs = [make_ref(2, 2), make_ref(1, 3, 1), make_ref(3, 2, 2)]
    samples = [
        make_sample([1] * 4, refs[:2], adjacent=draw(st.booleans()), typed=draw(st.booleans())),
        make_sample([2] * 6),
        make_sample([3] * 3, refs[2:]),
    ]
    entries = [PackEntry(s, i) for i, s in enumerate(samples)]
    if draw(st.booleans()):
        entries.append(make_pad_sample(FAKE, grid=(1, 4, 4)))
    wire = msgspec.to_builtins(build_micro_batch(entries, FAKE).micro_batch)
    wire += [None] * (len(MB_FIELDS) - len(wire))  # omitted trailing defaults
    for name in draw(st.lists(st.sampled_from(MB_FIELDS), min_size=1, max_size=3, unique=True)):
        i, value = MB_FIELDS.index(name), wire[MB_FIELDS.index(name)]
        small = (
            st.integers(0, 3) if name in ("mm_token_type_ids", "images_per_sample") else st.integers(0, 300)
        )
        if isinstance(value, list) and value and not isinstance(value[0], list | dict):
            edited = list(value)
            k = draw(st.integers(0, len(edited) - 1))
            edited[k] = draw(small | st.booleans() | st.just(TOK)) if draw(st.booleans()) else edited[-1 - k]
            value = draw(
                st.sampled_from([edited, draw(st.permutations(value)), value[:-1], value + value[-1:]])
            )
        elif name in ("synthetic_grids", "mm_refs"):
            value = draw(st.sampled_from([None, [], [[1, 4, 4]], [[1, 4, 6]], [[1, 2]], [[1, 4, 4]] * 2]))
            if name == "mm_refs":
                value = [msgspec.to_builtins(r) for r in draw(st.permutations(refs))][
                    : draw(st.integers(0, 3))
                ]
        else:
            value = draw(st.none() | small | st.text(max_size=3))
        wire[i] = value
    while wire and wire[-1] is None:
        wire.pop()
    return msgspec.msgpack.encode(wire)


@FUZZ
@given(tampered_micro_batches())
def test_rebuilding_a_tampered_micro_batch(data):
    """A received micro-batch is refused at decode (msgspec) or at rebuild (ValueError, which
    PlaceholderMismatch is), or it rebuilds to itself: never another exception."""
    try:
        mb = decode_microbatch(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    try:
        packed = rebuild_micro_batch(mb, FAKE)
    except ValueError:
        return
    assert packed.micro_batch == mb and sum(s.length for s in packed.slots) == len(mb.input_ids)


def test_invalid_utf8_in_a_sample_is_a_decode_error():
    import pytest

    with pytest.raises(msgspec.DecodeError):
        decode_sample(b"\x98\x90\x90\x90\x90\xc0\xa2\xff\xfe")


def _envelope_case(tmp_path, data: bytes) -> None:
    ref = FileRef(run_id="f", fingerprint=FP, modality="image", mm_hash="cd" * 32)
    path = feature_path(run_asset_root(tmp_path, "f"), ref)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    try:
        read_feature_item(tmp_path, ref, fingerprint=FP)
    except MMRefError:
        pass


@FUZZ
@given(st.binary(max_size=600))
def test_envelope_arbitrary_bytes(tmp_path_factory, data):
    _envelope_case(_root(tmp_path_factory), data)


@FUZZ
@given(st.integers(0, 10_000), st.integers(0, 255), st.integers(0, 400))
def test_envelope_mutated_valid_file(tmp_path_factory, position, value, cut):
    root = _root(tmp_path_factory)
    ref = FileRef(run_id="f", fingerprint=FP, modality="image", mm_hash="cd" * 32)
    path = feature_path(run_asset_root(root, "f"), ref)
    path.unlink(missing_ok=True)
    write_feature_item(run_asset_root(root, "f"), ref, b"payload" * 40, placeholder_length=4)
    data = bytearray(path.read_bytes())
    data[position % len(data)] = value
    _envelope_case(root, bytes(data[: max(0, len(data) - cut)]))


_ROOTS: dict[int, object] = {}


def _root(tmp_path_factory):
    key = id(tmp_path_factory)
    if key not in _ROOTS:
        _ROOTS[key] = tmp_path_factory.mktemp("fuzz")
    return _ROOTS[key]


def test_format_mmraw_round_trips_whatever_parses():
    body = RawRefBody(
        family="qwen2_vl", modality="image", mm_hash="ab" * 16, payload={"x": [1]}, raw_image_uri="file:///a"
    )
    assert parse_ref(format_mmraw(body)) == body


# --- the plugin's request parsing (vllm_plugin.api_router): stock's refusal or a typed one ------------

ref_like = (
    st.sampled_from(["mmraw:eyJ9", "mmfile:v1:1:" + "a" * 32 + ":image:" + "b" * 32, "x"]) | json_values
)
request_docs = st.fixed_dictionaries(
    {},
    optional={
        "token_ids": st.lists(st.integers(-2, 600), max_size=6) | json_values,
        "sampling_params": st.just({"max_tokens": 2}) | json_values,
        "mm_refs": st.lists(
            ref_like | st.fixed_dictionaries({"ref": ref_like, "sha256": json_values}), max_size=3
        )
        | json_values,
        "features": st.fixed_dictionaries(
            {"mm_hashes": json_values, "mm_placeholders": json_values},
            optional={"kwargs_data": json_values, "mm_metadata": json_values},
        )
        | json_values,
        "content_parts": json_values,
        "cache_salt": json_values,
        "priority": json_values,
        "stream": json_values,
    },
)


@FUZZ
@given(request_docs | json_values)
def test_generate_request_parsing(doc):
    """Any decoded body is a typed request, stock's validation error (its handler builds stock's
    body), a vLLM error (idem) or a plugin refusal: never another exception (a 500)."""
    from fastapi.exceptions import RequestValidationError
    from vllm.exceptions import VLLMError

    from vllm_plugin.protocol import MMRefGenerateRequest, parse_request

    try:
        assert isinstance(parse_request(doc), MMRefGenerateRequest)
    except (RequestValidationError, MMRefError, VLLMError):
        pass


@FUZZ
@given(st.binary(max_size=300) | st.text(max_size=200).map(str.encode))
def test_generate_body_decoding(data):
    """Raw bytes with a JSON content type decode, or fail with FastAPI's own errors."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    from vllm_plugin.http_edge import decode_json

    try:
        decode_json(bytearray(data))
    except (RequestValidationError, HTTPException):
        pass
