"""Decode image bytes exactly the way vLLM 0.32 does before its HF processor runs.

Mirrors ``vllm/multimodal/media/image.py::ImageMediaIO.load_bytes`` with
``image_mode="RGB"`` and vLLM's helpers in ``vllm/multimodal/image.py``
(``open_image``, ``normalize_image``, ``convert_image_mode``): open, pixel-limit
check, EXIF transpose, load, then RGB conversion that composites anything with
transparency (RGBA, LA, PA, or a ``transparency`` entry) onto white. The test
suite compares this against vLLM's own loader on real and synthetic images.

The format allow-list is narrower than vLLM's (raster photo formats only).
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from pathlib import Path

from PIL import Image, ImageOps

from protocol.errors import AssetTooLarge, ImageUnreadable, MMRefError

__all__ = ["ALLOWED_FORMATS", "DEFAULT_MAX_IMAGE_PIXELS", "image_bytes", "load_image", "sniff_media_type"]

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
DEFAULT_MAX_IMAGE_PIXELS = 178_956_970
"""vLLM's ``VLLM_MAX_IMAGE_PIXELS`` default (also PIL's decompression-bomb threshold x2)."""

_MEDIA_TYPES = {
    "JPEG": ("image/jpeg", ".jpg"),
    "PNG": ("image/png", ".png"),
    "WEBP": ("image/webp", ".webp"),
    "GIF": ("image/gif", ".gif"),
    "BMP": ("image/bmp", ".img"),
    "TIFF": ("image/tiff", ".img"),
}


def image_bytes(image: bytes | bytearray | memoryview | Image.Image | str | os.PathLike[str]) -> bytes:
    """The encoded bytes the store holds for ``image``: bytes as they are, a path read once, a PIL
    image encoded as PNG (lossless: the server and the trainer decode the same pixels; PIL's PNG
    encoder is deterministic, so the same image gives the same bytes and the same ref).

    Raises:
        TypeError: anything else.
        OSError: a path that cannot be read.
    """
    if isinstance(image, bytes | bytearray | memoryview):
        return bytes(image)
    if isinstance(image, str | os.PathLike):
        return Path(image).read_bytes()
    if isinstance(image, Image.Image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"an image must be bytes, a PIL image or a path, got {type(image).__name__}")


def sniff_media_type(data: bytes) -> tuple[str, str]:
    """Return ``(media_type, file extension)`` from the bytes' header, without decoding pixels.

    The extension follows the asset-store layout (docs/PROTOCOL.md §2): ``.jpg .png .webp .gif``,
    else ``.img``.

    Raises:
        AssetTooLarge: a header over Pillow's decompression-bomb limit.
        ImageUnreadable: the header is not one of :data:`ALLOWED_FORMATS`, or Pillow fails on it
            in any other way (``OSError``, ``ValueError``, ...).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS) as im:
                fmt = im.format or ""
    except Image.DecompressionBombError as e:
        raise AssetTooLarge(f"decompression bomb refused: {e}") from e
    except (MMRefError, MemoryError):
        raise
    except Exception as e:  # OSError, ValueError ("Truncated IHDR chunk"), ...: whatever Pillow raises
        raise ImageUnreadable(f"not a readable image ({len(data)} bytes): {e}") from e
    return _MEDIA_TYPES.get(fmt, ("application/octet-stream", ".img"))


def load_image(
    data: bytes, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, ref: str | None = None
) -> Image.Image:
    """Decode ``data`` into a loaded RGB ``PIL.Image`` the way vLLM does.

    Args:
        data: encoded image bytes (JPEG, PNG, WEBP, GIF, BMP or TIFF).
        max_pixels: refuse images with more than ``width * height`` pixels (checked on
            the header, before decoding: a decompression bomb never allocates).
        ref: the ref named in errors.

    Returns:
        An RGB image, EXIF orientation applied, pixels loaded.

    Raises:
        AssetTooLarge: more than ``max_pixels`` pixels.
        ImageUnreadable: unknown format, truncated or corrupt data: whatever Pillow raises
            (``OSError``, ``ValueError``, ``TypeError``...), but ``MemoryError``.
    """
    try:
        with warnings.catch_warnings():  # the max_pixels check below decides, as in vLLM
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
            w, h = image.size
            if max_pixels > 0 and w * h > max_pixels:
                raise AssetTooLarge(f"image is {w}x{h} = {w * h} pixels, limit {max_pixels}", ref=ref)
            with contextlib.suppress(Exception):  # vLLM ignores broken EXIF the same way
                image = ImageOps.exif_transpose(image)
            image.load()
    except Image.DecompressionBombError as e:  # PIL's hard limit, 2x its warning threshold
        raise AssetTooLarge(f"decompression bomb refused: {e}", ref=ref) from e
    except (MMRefError, MemoryError):  # AssetTooLarge above; out of memory is not the image's fault
        raise
    except Exception as e:  # OSError, SyntaxError, ValueError, TypeError (a mis-typed TIFF tag), ...
        raise ImageUnreadable(f"cannot decode image ({len(data)} bytes): {e}", ref=ref) from e
    return _to_rgb(image)


def _to_rgb(image: Image.Image) -> Image.Image:
    """``vllm.multimodal.image.convert_image_mode(image, "RGB")`` with a white background."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        if image.mode != "RGBA":
            image = image.convert("RGBA")
        rgb = Image.new("RGB", image.size, (255, 255, 255))
        rgb.paste(image, mask=image.split()[3])
        return rgb
    return image.convert("RGB")
