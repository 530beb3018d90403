"""Short real clips made offline: scikit-image photos panned into MP4 with OpenCV (the decoder the
server and the trainer use), deterministic bytes (the same call gives the same file)."""

from __future__ import annotations

import functools
import struct
import tempfile
from pathlib import Path

import cv2
import numpy as np
from skimage import data as skdata

__all__ = ["clip_bytes", "with_box_field"]


@functools.cache
def clip_bytes(
    photo: str = "astronaut",
    *,
    fps: int = 8,
    seconds: int = 2,
    size: tuple[int, int] = (160, 120),
    start: int = 0,
) -> bytes:
    """An MP4 (MPEG-4 Part 2, ``mp4v``) of ``fps * seconds`` frames of ``size`` = (w, h) pixels:
    a window panning over a scikit-image photo (``skimage.data.<photo>``), so frames differ;
    ``start`` shifts the pan (another clip of the same photo: the benches' distinct clips).

    Raises:
        RuntimeError: OpenCV has no writer for the codec.
    """
    image = getattr(skdata, photo)()
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    w, h = size
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "clip.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
        if not writer.isOpened():
            raise RuntimeError("OpenCV cannot write mp4v here")
        span_y, span_x = image.shape[0] // 4, image.shape[1] // 4
        for i in range(fps * seconds):
            y, x = (7 * (i + start)) % span_y, (11 * (i + start)) % span_x
            crop = image[y : y + 3 * image.shape[0] // 4, x : x + 3 * image.shape[1] // 4]
            frame = cv2.resize(np.ascontiguousarray(crop[..., :3]), (w, h), interpolation=cv2.INTER_AREA)
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        writer.release()
        return Path(path).read_bytes()


def with_box_field(data: bytes, box: bytes, offset: int, fmt: str, values: tuple[int, ...]) -> bytes:
    """``data`` with big-endian fields of the first ``box`` (4CC) rewritten (``struct`` format
    ``fmt``): ``offset`` bytes after its 8-byte header (a crafted header: e.g. ``stsz`` frame count,
    ``tkhd`` width and height)."""
    at = data.index(box) + 4 + offset  # data.index finds the type; the header starts 4 bytes before
    out = bytearray(data)
    struct.pack_into(fmt, out, at, *values)
    return bytes(out)
