"""mmfile:v1 feature files: writer layout and envelope, validating reader, tamper refusal."""

from __future__ import annotations

import hashlib
import os

import msgspec
import pytest

from protocol.errors import AssetNotFound, AssetOutsideRoot, CorruptFeature, FingerprintMismatch, HashMismatch
from protocol.features import (
    FEATURES_SUBDIR,
    feature_path,
    read_feature_item,
    run_asset_root,
    write_feature_item,
)
from protocol.refs import FileRef, parse_ref

FP = "ab" * 16
PAYLOAD = b"\x82\xa1a\x01\xa1b\x02" * 100  # stands in for vLLM's item bytes; the reader does not decode


def make(tmp_path, payload=PAYLOAD, mm_hash="cd" * 32, run_id="r1"):
    ref = FileRef(run_id=run_id, fingerprint=FP, modality="image", mm_hash=mm_hash)
    ref_string = write_feature_item(run_asset_root(tmp_path, run_id), ref, payload, placeholder_length=64)
    return ref, ref_string


def test_layout_envelope_and_round_trip(tmp_path):
    ref, ref_string = make(tmp_path)
    assert ref_string == f"mmfile:v1:r1:{FP}:image:{'cd' * 32}" and parse_ref(ref_string) == ref
    path = tmp_path / "run_r1" / "assets" / FEATURES_SUBDIR / FP / "image" / "cd" / f"{'cd' * 32}.msgpack"
    assert path.is_file() and feature_path(run_asset_root(tmp_path, "r1"), ref) == path
    raw = msgspec.msgpack.decode(path.read_bytes())
    assert set(raw) == {"envelope", "payload"} and raw["payload"] == PAYLOAD
    assert raw["envelope"] == {
        "schema_version": 1,
        "kind": "vllm.MultiModalKwargsItem",
        "run_id": "r1",
        "fingerprint": FP,
        "modality": "image",
        "mm_hash": "cd" * 32,
        "placeholder_length": 64,
        "payload_sha256": hashlib.sha256(PAYLOAD).hexdigest(),
    }
    item = read_feature_item(tmp_path, ref, fingerprint=FP)
    assert item.payload == PAYLOAD and item.envelope.placeholder_length == 64


def test_writer_is_idempotent_and_refreshes_mtime(tmp_path):
    ref, _ = make(tmp_path)
    path = feature_path(run_asset_root(tmp_path, "r1"), ref)
    os.utime(path, (1_000_000, 1_000_000))
    inode = path.stat().st_ino
    make(tmp_path)  # the very same file: kept, mtime refreshed
    assert path.stat().st_mtime > 1_000_000 and path.stat().st_ino == inode
    assert read_feature_item(tmp_path, ref, fingerprint=FP).payload == PAYLOAD
    make(tmp_path, payload=b"other bytes")  # same ids, other content: the latest write is the file
    assert read_feature_item(tmp_path, ref, fingerprint=FP).payload == b"other bytes"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left


def test_writer_repairs_a_damaged_file(tmp_path):
    """A truncated feature file (CorruptFeature on read) is rewritten by the next write of the item."""
    ref, _ = make(tmp_path)
    path = feature_path(run_asset_root(tmp_path, "r1"), ref)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CorruptFeature):
        read_feature_item(tmp_path, ref, fingerprint=FP)
    make(tmp_path)
    assert read_feature_item(tmp_path, ref, fingerprint=FP).payload == PAYLOAD


def rewrite(path, mutate):
    raw = msgspec.msgpack.decode(path.read_bytes())
    mutate(raw)
    path.write_bytes(msgspec.msgpack.encode(raw))


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda raw: raw["envelope"].update(payload_sha256="0" * 64), HashMismatch),
        (lambda raw: raw.update(payload=raw["payload"][:-1]), HashMismatch),
        (lambda raw: raw["envelope"].update(fingerprint="ef" * 16), FingerprintMismatch),
        (lambda raw: raw["envelope"].update(modality="video"), CorruptFeature),
        (lambda raw: raw["envelope"].update(mm_hash="ee" * 32), CorruptFeature),
        (lambda raw: raw["envelope"].update(schema_version=2), CorruptFeature),
        (lambda raw: raw["envelope"].update(kind="pickle"), CorruptFeature),
        (lambda raw: raw["envelope"].update(extra=1), CorruptFeature),
    ],
)
def test_tampered_files_are_refused(tmp_path, mutate, error):
    ref, ref_string = make(tmp_path)
    rewrite(feature_path(run_asset_root(tmp_path, "r1"), ref), mutate)
    with pytest.raises(error) as info:
        read_feature_item(tmp_path, ref, fingerprint=FP, ref_string=ref_string)
    assert info.value.ref == ref_string


def test_truncated_missing_foreign_and_escaping_files(tmp_path):
    ref, _ = make(tmp_path)
    path = feature_path(run_asset_root(tmp_path, "r1"), ref)
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CorruptFeature):
        read_feature_item(tmp_path, ref, fingerprint=FP)
    with pytest.raises(FingerprintMismatch):  # the reader's layout differs from the ref's
        read_feature_item(tmp_path, ref, fingerprint="ff" * 16)
    gone = FileRef(run_id="r1", fingerprint=FP, modality="image", mm_hash="99" * 32)
    with pytest.raises(AssetNotFound):
        read_feature_item(tmp_path, gone, fingerprint=FP)
    # a feature file that is a symlink to a file outside the output root
    outside = tmp_path.parent / f"{tmp_path.name}-outside.msgpack"
    _, _ = make(tmp_path.parent / f"{tmp_path.name}-o", mm_hash="77" * 32)
    outside.write_bytes(b"x")
    link_ref = FileRef(run_id="r1", fingerprint=FP, modality="image", mm_hash="77" * 32)
    link = feature_path(run_asset_root(tmp_path, "r1"), link_ref)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside)
    with pytest.raises(AssetOutsideRoot):
        read_feature_item(tmp_path, link_ref, fingerprint=FP)
