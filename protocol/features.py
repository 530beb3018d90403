"""Processed-item files of the feature store (``mmfile:v1`` refs, docs/PROTOCOL.md §2.2).

Layout under ``<output_root>/run_<run_id>/assets``::

    mm_features/v1/vllm-mmitem/<fingerprint>/<modality>/<mm_hash[:2]>/<mm_hash>.msgpack

File = msgpack ``{"envelope": FeatureEnvelope, "payload": <bytes>}`` where the payload is vLLM's
own msgpack encoding of one ``MultiModalKwargsItem`` (what ``encode_mm_kwargs_item`` base64s, i.e.
what a ``kwargs_data`` slot holds once base64-decoded) and ``envelope.payload_sha256`` its sha256.
This module neither imports vLLM nor decodes payloads: writers take payload bytes (e.g. the
base64-decoded ``kwargs_data`` slot of vLLM's render output, as the renderers client does), and
:func:`read_feature_item` validates everything but the payload's inner structure, which the
server checks by decoding it with vLLM.

Feature files are regenerable caches: :func:`protocol.sweep.sweep_features` removes them by TTL.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Literal

import msgspec

from protocol.errors import (
    CorruptFeature,
    FingerprintMismatch,
    HashMismatch,
    InvalidRef,
)
from protocol.refs import FileRef, format_mmfile
from protocol.store import AssetStore, atomic_write

__all__ = [
    "DEFAULT_MAX_FEATURE_BYTES",
    "FEATURES_SUBDIR",
    "FeatureEnvelope",
    "FeatureFile",
    "feature_path",
    "read_feature_item",
    "run_asset_root",
    "write_feature_item",
]

FEATURES_SUBDIR = Path("mm_features") / "v1" / "vllm-mmitem"
DEFAULT_MAX_FEATURE_BYTES = 512 * 1024 * 1024


class FeatureEnvelope(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a feature file claims about its payload; every field is checked against the ref."""

    schema_version: Literal[1]
    kind: Literal["vllm.MultiModalKwargsItem"]
    run_id: str
    fingerprint: str
    modality: Literal["image"]
    mm_hash: str
    placeholder_length: int
    """Placeholder tokens the item takes in the prompt (checked against the prompt)."""
    payload_sha256: str


class FeatureFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    envelope: FeatureEnvelope
    payload: bytes


_decoder = msgspec.msgpack.Decoder(FeatureFile)
_encoder = msgspec.msgpack.Encoder()


def run_asset_root(output_root: str | os.PathLike[str], run_id: str) -> Path:
    """``<output_root>/run_<run_id>/assets`` (``run_id`` must already be a validated safe id)."""
    return Path(output_root).resolve() / f"run_{run_id}" / "assets"


def feature_path(asset_root: str | os.PathLike[str], ref: FileRef) -> Path:
    """Where the item of ``ref`` lives under ``asset_root`` (built from validated ids only)."""
    return (
        Path(asset_root)
        / FEATURES_SUBDIR
        / ref.fingerprint
        / ref.modality
        / ref.mm_hash[:2]
        / f"{ref.mm_hash}.msgpack"
    )


def write_feature_item(
    asset_root: str | os.PathLike[str],
    ref: FileRef,
    payload: bytes,
    *,
    placeholder_length: int,
) -> str:
    """Write one processed item atomically (idempotent: an existing file only gets its mtime refreshed).

    Args:
        asset_root: ``<output_root>/run_<run_id>/assets`` for ``ref.run_id``.
        ref: the ids of the item (run, layout fingerprint, modality, hash).
        payload: vLLM's msgpack encoding of the ``MultiModalKwargsItem``.
        placeholder_length: placeholder tokens the item takes in the prompt.

    Returns:
        The ``mmfile:v1:...`` ref string.
    """
    envelope = FeatureEnvelope(
        schema_version=1,
        kind="vllm.MultiModalKwargsItem",
        run_id=ref.run_id,
        fingerprint=ref.fingerprint,
        modality=ref.modality,
        mm_hash=ref.mm_hash,
        placeholder_length=placeholder_length,
        payload_sha256=hashlib.sha256(payload).hexdigest(),
    )
    atomic_write(feature_path(asset_root, ref), _encoder.encode(FeatureFile(envelope, payload)))
    return format_mmfile(ref)


def read_feature_item(
    output_root: str | os.PathLike[str],
    ref: FileRef,
    *,
    fingerprint: str,
    ref_string: str | None = None,
    max_bytes: int = DEFAULT_MAX_FEATURE_BYTES,
) -> FeatureFile:
    """Read and validate the item an ``mmfile:v1`` ref names.

    Args:
        output_root: the confinement root holding ``run_<run_id>/assets`` folders.
        ref: the parsed ref.
        fingerprint: the reader's layout fingerprint; the ref's and the envelope's must equal it.

    Raises:
        FingerprintMismatch: the ref or the file is for another layout.
        AssetOutsideRoot, AssetNotFound: see :meth:`protocol.store.AssetStore.confine`.
        StoreUnavailable: the file is there but cannot be opened (permission denied, too many
            open files: :func:`protocol.store.read_confined`).
        AssetTooLarge: the file exceeds ``max_bytes``.
        CorruptFeature: the file is not a valid envelope (truncated, corrupt, wrong schema, kind
            or modality), or the envelope's ids differ from the ref's.
        HashMismatch: the payload's sha256 differs from the envelope's.
        InvalidRef: ``ref`` is not a :class:`FileRef` (e.g. an ``mmraw:v2`` ref handed to a reader
            that sends every non-v1 ``mmraw`` ref here).
    """
    if not isinstance(ref, FileRef):
        raise InvalidRef(
            f"not an mmfile:v1 ref ({type(ref).__name__}): no feature file to read", ref=ref_string
        )
    if ref.fingerprint != fingerprint:
        raise FingerprintMismatch(
            f"mmfile ref fingerprint {ref.fingerprint} != layout fingerprint {fingerprint}", ref=ref_string
        )
    store = AssetStore(output_root)
    path = feature_path(run_asset_root(output_root, ref.run_id), ref)
    data = store.read_confined(path, max_bytes=max_bytes, ref=ref_string)  # swept meanwhile: not found
    try:
        item = _decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec raises the latter for bad UTF-8
        raise CorruptFeature(f"feature file is not a valid v1 envelope: {e}", ref=ref_string) from e
    env = item.envelope
    claimed = (env.run_id, env.fingerprint, env.modality, env.mm_hash)
    if claimed != (ref.run_id, ref.fingerprint, ref.modality, ref.mm_hash):
        if env.fingerprint != ref.fingerprint:
            raise FingerprintMismatch(
                f"feature file fingerprint {env.fingerprint} != ref fingerprint {ref.fingerprint}",
                ref=ref_string,
            )
        raise CorruptFeature(f"feature envelope ids {claimed} differ from the ref's", ref=ref_string)
    digest = hashlib.sha256(item.payload).hexdigest()
    if digest != env.payload_sha256:
        raise HashMismatch(
            f"payload sha256 {digest} != envelope payload_sha256 {env.payload_sha256}", ref=ref_string
        )
    return item
