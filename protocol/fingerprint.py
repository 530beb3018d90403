"""Layout fingerprints: one hash for everything that changes pixels or grids (docs/PROTOCOL.md §4).

``layout_fingerprint`` = ``sha256(canonical JSON)[:32]`` of the family, the
processor class and backend (``pil`` | ``torchvision``), the device it runs on,
every processor field that changes pixels or grids, and the versions of the
libraries that compute them. Server and trainer compare fingerprints: a
mismatch is an error, never a silent re-process (vLLM PRs #19789 and #49975 show
what incomplete hashes cost).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from importlib import metadata
from typing import Any

__all__ = ["FINGERPRINT_HEX_CHARS", "layout_fingerprint", "library_versions"]

FINGERPRINT_HEX_CHARS = 32
_LIBRARIES = ("transformers", "pillow", "torchvision", "torch")


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries that compute pixels (``"absent"`` when missing).

    The local part of a version (``+cpu``, ``+cu130``) is dropped: the same release
    computes the same pixels on CPU whichever accelerator build is installed; the
    device the processor runs on is recorded separately.
    """
    out: dict[str, str] = {}
    for name in _LIBRARIES:
        try:
            out[name] = metadata.version(name).split("+", 1)[0]
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def layout_fingerprint(
    *,
    family: str,
    processor_class: str,
    backend: str,
    device: str,
    fields: Mapping[str, Any],
    versions: Mapping[str, str] | None = None,
) -> str:
    """Return the 32-hex layout fingerprint of a processing configuration.

    Args:
        family: adapter family, e.g. ``"qwen2_vl"``.
        processor_class: the HF image processor class name.
        backend: ``"pil"`` or ``"torchvision"``.
        device: where the processor computes (``"cpu"``, ``"cuda"``).
        fields: pixel- and grid-affecting processor fields (JSON-serializable).
        versions: library versions; default :func:`library_versions`.
    """
    doc = {
        "family": family,
        "processor_class": processor_class,
        "backend": backend,
        "device": device,
        "fields": dict(fields),
        "versions": dict(versions if versions is not None else library_versions()),
    }
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=_jsonable)
    return hashlib.sha256(canonical.encode()).hexdigest()[:FINGERPRINT_HEX_CHARS]


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "value"):  # enums such as PILImageResampling
        return value.value
    return str(value)
