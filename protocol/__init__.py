"""Shared protocol of mmref: structs, ref strings, asset store, errors, fingerprints.

Imports no torch at module level; :mod:`protocol.adapters` (which does) is imported
explicitly where images are processed.
"""

from protocol.errors import MMRefError
from protocol.refs import FileRef, RawRefBody, format_mmfile, format_mmraw, parse_ref
from protocol.store import AssetStore, StoredImage
from protocol.structs import MicroBatch, MMRefs, RawMMRef, TrainingSample

__all__ = [
    "AssetStore",
    "FileRef",
    "MMRefError",
    "MMRefs",
    "MicroBatch",
    "RawMMRef",
    "RawRefBody",
    "StoredImage",
    "TrainingSample",
    "format_mmfile",
    "format_mmraw",
    "parse_ref",
]
