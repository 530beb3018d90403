"""The Qwen processors' pixel-deciding fields, one list below the image and the video fingerprints.

transformers' ``Qwen2VLImageProcessor`` and the Qwen video processors (``Qwen2VLVideoProcessor``,
``Qwen3VLVideoProcessor``) share these fields (``image_processing_qwen2_vl.py``,
``video_processing_qwen3_vl.py``): :class:`~protocol.adapters.qwen_vl.QwenVLAdapter` fingerprints
them for images, :mod:`protocol.adapters.video_processing` adds the frame-sampling fields for
videos. A module of its own because the video mixin sits below the Qwen adapter that mixes it in
(the adapter imports the mixin, so the mixin cannot import the adapter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["QWEN_PIXEL_FIELDS", "processor_fields"]

QWEN_PIXEL_FIELDS = (
    "do_resize",
    "resample",
    "size",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
)
"""Fields of a Qwen image or video processor that change pixels or grids (fingerprinted)."""


def processor_fields(processor: Any, names: Sequence[str]) -> dict[str, Any]:
    """``{name: processor.<name>}`` for ``names`` in order (a missing attribute: None), ``size``
    as a plain dict (transformers' ``SizeDict`` is not JSON)."""
    fields = {name: getattr(processor, name, None) for name in names}
    if "size" in fields and fields["size"] is not None:
        fields["size"] = dict(fields["size"])
    return fields
