"""protocol.structs: strict decoding of the wire structs (docs/PROTOCOL.md, "Structs"), no torch on import."""

from __future__ import annotations

import ast
import hashlib
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from protocol.refs import RawRefBody, format_mmraw
from protocol.structs import (
    MicroBatch,
    MMRefs,
    RawMMRef,
    TrainingSample,
    decode_microbatch,
    decode_sample,
    encode,
)

REPO = Path(__file__).resolve().parent.parent
SHA256 = hashlib.sha256(b"a real image would be here").hexdigest()
FINGERPRINT = "0123456789abcdef" * 2
REF = format_mmraw(
    RawRefBody(
        family="qwen2_vl",
        modality="image",
        mm_hash=SHA256[:32],
        payload={"image_grid_thw": [1, 4, 6]},
        fingerprint=FINGERPRINT,
        raw_image_uri=f"file:///data/run_1/assets/images/{SHA256[:16]}.jpg",
    )
)
MMFILE = f"mmfile:v1:run_1:{FINGERPRINT}:image:{SHA256[:32]}"


def raw_ref_dict(**overrides) -> dict:
    d = {
        "ref": REF,
        "modality": "image",
        "sha256": SHA256,
        "media_type": "image/jpeg",
        "grid": [1, 4, 6],
        "num_placeholders": 6,
    }
    d.update(overrides)
    return d


def raw_ref(**overrides) -> RawMMRef:
    return RawMMRef(**raw_ref_dict(**overrides))


def sample(n: int = 4, **overrides) -> TrainingSample:
    kwargs = {
        "input_ids": list(range(10, 10 + n)),
        "loss_mask": [i % 2 == 0 for i in range(n)],
        "advantages": [0.25] * n,
        "inference_logprobs": [-0.5] * n,
    }
    kwargs.update(overrides)
    return TrainingSample(**kwargs)


def sample_list(**overrides) -> list:
    """TrainingSample in its array-like wire form (field order = declaration order)."""
    fields = {
        "input_ids": [1, 2, 3],
        "loss_mask": [False, True, True],
        "advantages": [0.0, 1.0, 1.0],
        "inference_logprobs": [-0.1, -0.2, -0.3],
    }
    fields.update(overrides)
    return list(fields.values())


def microbatch_list(**overrides) -> list:
    fields = {
        "input_ids": [1, 2, 3, 4, 5],
        "loss_mask": [False, True, False, True, True],
        "advantages": [0.0, 1.0, 0.0, -1.0, -1.0],
        "inference_logprobs": [-0.1] * 5,
        "seq_lens": [2, 3],
        "sample_count": 2,
    }
    fields.update(overrides)
    return list(fields.values())


# ---------------------------------------------------------------------------------------------------------
# RawMMRef / MMRefs
# ---------------------------------------------------------------------------------------------------------


def test_raw_mm_ref_json_and_msgpack_round_trip():
    ref = raw_ref()
    assert msgspec.json.decode(msgspec.json.encode(ref), type=RawMMRef) == ref
    assert msgspec.msgpack.decode(encode(ref), type=RawMMRef) == ref
    assert msgspec.json.decode(msgspec.json.encode(raw_ref_dict()), type=RawMMRef) == ref
    # A ref struct is a JSON object (not array-like): the HTTP route accepts it as written by hand.
    assert msgspec.json.decode(msgspec.json.encode(ref)) == raw_ref_dict()


def test_raw_mm_ref_accepts_mmfile_refs_and_defaults_modality():
    d = raw_ref_dict(ref=MMFILE)
    del d["modality"]
    decoded = msgspec.json.decode(msgspec.json.encode(d), type=RawMMRef)
    assert decoded.modality == "image" and decoded.ref == MMFILE


def test_raw_mm_ref_accepts_video_modality():
    """Issue 44: a video by reference; an image-only reader still decodes it (wire compatible)."""
    d = raw_ref_dict(modality="video", media_type="video/mp4", grid=[2, 8, 12], num_placeholders=48)
    decoded = msgspec.json.decode(msgspec.json.encode(d), type=RawMMRef)
    assert decoded.modality == "video" and decoded.grid == [2, 8, 12]


@pytest.mark.parametrize(
    "overrides",
    [
        {"raw_image_id": "abc"},  # unknown field (prime-rl #2836 removed it)
        {"pixel_values": [[0.0]]},
        {"ref": "data:image/png;base64,AAAA"},
        {"ref": "https://example.com/a.jpg"},
        {"ref": 5},
        {"modality": "audio"},  # "video" is a modality since issue 44 (test below)
        {"sha256": SHA256.upper()},
        {"sha256": SHA256[:63]},
        {"sha256": SHA256[:32]},
        {"sha256": SHA256 + "0"},
        {"sha256": SHA256 + "\n"},
        {"media_type": None},
        {"grid": [1, 0, 6]},
        {"grid": [1, -4, 6]},
        {"grid": [1.0, 4.0, 6.0]},
        {"grid": "1,4,6"},
        {"num_placeholders": 0},
        {"num_placeholders": "6"},
        {"num_placeholders": 6.0},
        {"num_placeholders": True},
    ],
    ids=repr,
)
def test_raw_mm_ref_strict_decoding_rejects(overrides):
    data = msgspec.json.encode(raw_ref_dict(**overrides))
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(data, type=RawMMRef)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(raw_ref_dict(**overrides)), type=RawMMRef)


@pytest.mark.parametrize("field", ["ref", "sha256", "media_type", "grid", "num_placeholders"])
def test_raw_mm_ref_missing_field_is_rejected(field):
    d = raw_ref_dict()
    del d[field]
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(d), type=RawMMRef)


def test_raw_mm_ref_is_frozen():
    ref = raw_ref()
    with pytest.raises(AttributeError):
        ref.sha256 = "0" * 64


def test_mm_refs_rejects_unknown_fields_and_bad_token_types():
    good = {"items": [raw_ref_dict()], "mm_token_type_ids": [0, 1, 1, 0, 2]}  # 2: video (transformers')
    assert msgspec.json.decode(msgspec.json.encode(good), type=MMRefs).mm_token_type_ids == [0, 1, 1, 0, 2]
    for bad in (
        {**good, "extra": 1},
        {**good, "mm_token_type_ids": [0, 3]},
        {**good, "mm_token_type_ids": [0, -1]},
        {"items": [{**raw_ref_dict(), "raw_image_id": "x"}]},
    ):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(msgspec.json.encode(bad), type=MMRefs)


# ---------------------------------------------------------------------------------------------------------
# TrainingSample
# ---------------------------------------------------------------------------------------------------------


def test_training_sample_msgpack_round_trip_with_refs():
    s = sample(
        4,
        mm_refs=MMRefs(items=[raw_ref(), raw_ref(ref=MMFILE)], mm_token_type_ids=[0, 1, 1, 0]),
        run_id="run_1",
        lora_id="lora-a",
        is_padding=True,
    )
    data = encode(s)
    assert isinstance(msgspec.msgpack.decode(data), list)  # array-like on the wire
    back = decode_sample(data)
    assert back == s
    assert back.mm_refs.items[1].ref == MMFILE


def test_training_sample_from_rollout_puts_loss_and_logprobs_on_the_completion_only():
    s = TrainingSample.from_rollout([5, 6, 7], [8, 9], [-0.5, -1.25], [raw_ref()])
    assert s.input_ids == [5, 6, 7, 8, 9]
    assert s.loss_mask == [False, False, False, True, True]
    assert s.inference_logprobs == [0.0, 0.0, 0.0, -0.5, -1.25]
    assert s.advantages == [0.0] * 5
    assert s.mm_refs == MMRefs(items=[raw_ref()])
    assert decode_sample(encode(s)) == s
    assert TrainingSample.from_rollout([1], [2], [-0.1], []).mm_refs is None
    with pytest.raises(ValueError, match="1 completion logprobs for 2 completion tokens"):
        TrainingSample.from_rollout([1], [2, 3], [-0.1])


def test_training_sample_defaults_round_trip():
    s = sample(3)
    back = decode_sample(encode(s))
    assert back == s
    assert (back.mm_refs, back.run_id, back.lora_id, back.is_padding) == (None, "", None, False)
    assert decode_sample(msgspec.msgpack.encode(sample_list())).input_ids == [1, 2, 3]


def test_training_sample_json_is_accepted():
    s = sample(2, mm_refs=MMRefs(items=[raw_ref()]))
    assert msgspec.json.decode(msgspec.json.encode(s), type=TrainingSample) == s


@pytest.mark.parametrize(
    "overrides",
    [
        {"loss_mask": [True, True]},
        {"advantages": [0.0, 1.0, 1.0, 1.0]},
        {"inference_logprobs": []},
        {"input_ids": [1, 2]},
    ],
    ids=repr,
)
def test_training_sample_misaligned_lists_are_rejected(overrides):
    with pytest.raises(msgspec.ValidationError, match="entries"):
        decode_sample(msgspec.msgpack.encode(sample_list(**overrides)))
    with pytest.raises(ValueError):
        TrainingSample(**dict(zip(["input_ids", "loss_mask", "advantages", "inference_logprobs"],
                                  sample_list(**overrides), strict=True)))  # fmt: skip


def test_training_sample_token_type_ids_must_align():
    refs = msgspec.to_builtins(MMRefs(items=[raw_ref()], mm_token_type_ids=[0, 1]))
    with pytest.raises(msgspec.ValidationError, match="mm_token_type_ids"):
        decode_sample(msgspec.msgpack.encode([*sample_list(), refs]))
    with pytest.raises(ValueError):
        sample(3, mm_refs=MMRefs(items=[raw_ref()], mm_token_type_ids=[0, 1]))


@pytest.mark.parametrize(
    "overrides",
    [
        {"input_ids": [1, -2, 3]},
        {"input_ids": [1.0, 2.0, 3.0]},
        {"input_ids": ["1", "2", "3"]},
        {"loss_mask": [0, 1, 1]},  # strict: ints are not bools
        {"advantages": ["0", "1", "1"]},
        {"inference_logprobs": None},
    ],
    ids=repr,
)
def test_training_sample_wrong_types_are_rejected(overrides):
    with pytest.raises(msgspec.ValidationError):
        decode_sample(msgspec.msgpack.encode(sample_list(**overrides)))


def test_training_sample_rejects_an_object_and_unknown_ref_fields():
    with pytest.raises(msgspec.ValidationError):  # array-like: an object is not its wire form
        decode_sample(msgspec.msgpack.encode({"input_ids": [1], "loss_mask": [True]}))
    bad_refs = {"items": [{**raw_ref_dict(), "raw_image_id": "x"}]}
    with pytest.raises(msgspec.ValidationError):
        decode_sample(msgspec.msgpack.encode([*sample_list(), bad_refs]))


def test_training_sample_truncated_msgpack_is_rejected():
    data = encode(sample(8))
    with pytest.raises(msgspec.DecodeError):
        decode_sample(data[:-3])


# ---------------------------------------------------------------------------------------------------------
# MicroBatch
# ---------------------------------------------------------------------------------------------------------


def test_microbatch_round_trip():
    mb = MicroBatch(
        input_ids=[1, 2, 3, 4, 5],
        loss_mask=[False, True, False, True, True],
        advantages=[0.0, 1.0, 0.0, -1.0, -1.0],
        inference_logprobs=[-0.1] * 5,
        seq_lens=[2, 3],
        sample_count=2,
        mm_refs=[raw_ref(), raw_ref(ref=MMFILE)],
    )
    data = encode(mb)
    assert isinstance(msgspec.msgpack.decode(data), list)
    assert decode_microbatch(data) == mb
    assert msgspec.json.decode(msgspec.json.encode(mb), type=MicroBatch) == mb
    plain = decode_microbatch(msgspec.msgpack.encode(microbatch_list()))
    assert plain.mm_refs == [] and plain.mm_token_type_ids is None


def test_microbatch_empty_is_consistent():
    mb = decode_microbatch(msgspec.msgpack.encode(microbatch_list(
        input_ids=[], loss_mask=[], advantages=[], inference_logprobs=[], seq_lens=[], sample_count=0
    )))  # fmt: skip
    assert mb.sample_count == 0


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"seq_lens": [2, 2]}, "seq_lens sum"),
        ({"seq_lens": [2, 4]}, "seq_lens sum"),
        ({"seq_lens": [5], "sample_count": 2}, "sample_count"),
        ({"seq_lens": [2, 3], "sample_count": 3}, "sample_count"),
        ({"seq_lens": [2, 3, 0], "sample_count": 3}, ">= 1"),
        ({"sample_count": -1}, ">= 0"),
        ({"loss_mask": [True] * 4}, "entries"),
        ({"advantages": [0.0] * 6}, "entries"),
        ({"inference_logprobs": [0.0]}, "entries"),
    ],
    ids=repr,
)
def test_microbatch_inconsistent_fields_are_rejected(overrides, match):
    with pytest.raises(msgspec.ValidationError, match=match):
        decode_microbatch(msgspec.msgpack.encode(microbatch_list(**overrides)))


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"loss_mask": [True] * 4}, "loss_mask has 4 entries"),
        ({"input_ids": [1, 2, 3]}, "has 5 entries, input_ids 3"),
        ({"seq_lens": [1, 3]}, "seq_lens sum"),
    ],
    ids=repr,
)
def test_replacing_fields_keeps_the_cross_field_rules(overrides, match):
    """msgspec.structs.replace runs __post_init__ from msgspec 0.21 (the floor in pyproject.toml): the
    trainer replaces loss masks and samples with it, and a replaced struct must still be consistent."""
    mb = decode_microbatch(msgspec.msgpack.encode(microbatch_list()))
    with pytest.raises(ValueError, match=match):
        msgspec.structs.replace(mb, **overrides)
    sample = decode_sample(msgspec.msgpack.encode(sample_list()))
    with pytest.raises(ValueError, match="entries"):
        msgspec.structs.replace(sample, loss_mask=[True])


def test_microbatch_rejects_bad_refs():
    with pytest.raises(msgspec.ValidationError):
        decode_microbatch(msgspec.msgpack.encode([*microbatch_list(), [{**raw_ref_dict(), "extra": 1}]]))
    with pytest.raises(msgspec.ValidationError):
        decode_microbatch(msgspec.msgpack.encode([*microbatch_list(), [raw_ref_dict(ref="not-a-ref")]]))


# ---------------------------------------------------------------------------------------------------------
# import protocol stays light
# ---------------------------------------------------------------------------------------------------------


_HEAVY = ("torch", "transformers", "vllm")


def _modules_imported_by(statement: str) -> list[str]:
    code = f"import sys\n{statement}\nprint(sorted(m for m in {_HEAVY!r} if m in sys.modules))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=REPO
    )
    return ast.literal_eval(out.stdout.strip())


def test_import_protocol_does_not_import_torch():
    assert _modules_imported_by("import protocol") == []


def test_protocol_submodules_do_not_import_torch():
    """Only ``protocol.adapters`` may import torch (package docstring); every other module stays light."""
    names = sorted(p.stem for p in (REPO / "protocol").glob("*.py") if p.stem != "__init__")
    assert {"errors", "refs", "structs", "store", "images"} <= set(names)
    assert _modules_imported_by("\n".join(f"import protocol.{n}" for n in names)) == []


def test_microbatch_carries_image_facts_on_the_wire():
    """mm_token_type_ids, images_per_sample and is_padding survive msgpack (no field dropped)."""
    from protocol.structs import MicroBatch, decode_microbatch, encode

    mb = MicroBatch(
        input_ids=[1, 9, 9, 2, 3],
        loss_mask=[False, False, False, True, True],
        advantages=[0.0] * 5,
        inference_logprobs=[0.0] * 5,
        seq_lens=[4, 1],
        sample_count=2,
        mm_token_type_ids=[0, 1, 1, 0, 0],
        images_per_sample=[1, 0],
        is_padding=[False, True],
        synthetic_grids=[[1, 2, 4]],
        run_id="run_7",
        lora_id="a",
    )
    back = decode_microbatch(encode(mb))
    assert back == mb
    assert back.mm_token_type_ids == [0, 1, 1, 0, 0] and back.synthetic_grids == [[1, 2, 4]]
    assert back.images_per_sample == [1, 0] and back.is_padding == [False, True]
    assert (back.run_id, back.lora_id) == ("run_7", "a")
    for bad in ({"synthetic_grids": []}, {"synthetic_grids": [[1, 2, 4]] * 2}, {"mm_refs": [raw_ref()]}):
        with pytest.raises(ValueError, match="images_per_sample sums to 1"):
            msgspec.structs.replace(mb, **bad)
    with pytest.raises(ValueError, match="synthetic_grids need images_per_sample"):
        msgspec.structs.replace(mb, images_per_sample=None)
    for bad in (
        {"mm_token_type_ids": [0, 1]},
        {"images_per_sample": [1]},
        {"is_padding": [True, False, True]},
    ):
        with pytest.raises(ValueError, match="entries"):  # checked on construction and on decode
            msgspec.structs.replace(mb, **bad)
        wire = msgspec.to_builtins(mb)  # array-like: a list in field order
        wire[list(MicroBatch.__struct_fields__).index(next(iter(bad)))] = next(iter(bad.values()))
        with pytest.raises(msgspec.ValidationError):
            decode_microbatch(msgspec.msgpack.encode(wire))
