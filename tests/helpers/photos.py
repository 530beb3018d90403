"""Real photos shipped by scikit-image, as arrays and as encoded files."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

__all__ = ["photo_array", "photo_bytes"]


def photo_array(name: str) -> np.ndarray:
    """A real photo shipped by scikit-image, as an RGB uint8 array."""
    import skimage.data

    image = getattr(skimage.data, name)()
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    return image[..., :3]


def photo_bytes(name: str, fmt: str = "JPEG", size: tuple[int, int] | None = None) -> bytes:
    """A scikit-image photo encoded as ``fmt`` (optionally resized to ``size`` = (w, h))."""
    image = Image.fromarray(photo_array(name))
    if size is not None:
        image = image.resize(size, Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()
