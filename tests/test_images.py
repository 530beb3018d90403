"""protocol.images: decode exactly like vLLM 0.32's own loader, refuse bombs before allocating.

The oracle is vLLM itself:
``vllm.multimodal.media.image.ImageMediaIO(image_mode="RGB").load_bytes(data).media``.
"""

from __future__ import annotations

import functools
import io
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import photo_array, photo_bytes
from protocol.errors import AssetTooLarge, ImageUnreadable
from protocol.images import DEFAULT_MAX_IMAGE_PIXELS, load_image, sniff_media_type

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def vllm_load():
    """vLLM 0.32's image loader (the one its multimodal pipeline uses before the HF processor)."""
    image_io = pytest.importorskip("vllm.multimodal.media.image")

    def load(data: bytes) -> Image.Image:
        return image_io.ImageMediaIO(image_mode="RGB").load_bytes(data).media

    return load


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


@functools.lru_cache(maxsize=4)
def png_header_bomb(width: int, height: int) -> bytes:
    """A real, valid 1-bit grayscale PNG of ``width x height`` zeros; small on disk (zlib of zeros)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    comp = zlib.compressobj(9)
    idat = []
    for start in range(0, height, 256):
        idat.append(comp.compress(row * min(256, height - start)))
    idat.append(comp.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"".join(idat)) + chunk(b"IEND", b"")


def _photo(name: str = "astronaut", size: tuple[int, int] = (96, 80)) -> Image.Image:
    return Image.fromarray(photo_array(name)).resize(size, Image.Resampling.BICUBIC)


def _alpha_ramp(size: tuple[int, int]) -> Image.Image:
    w, h = size
    ramp = np.tile(np.linspace(0, 255, w, dtype=np.uint8), (h, 1))
    ramp[: h // 4] = 255  # opaque band
    ramp[-h // 4 :] = 0  # fully transparent band
    return Image.fromarray(ramp, "L")


def _rgba() -> Image.Image:
    image = _photo().convert("RGBA")
    image.putalpha(_alpha_ramp(image.size))
    return image


def _la() -> Image.Image:
    image = _photo("coffee").convert("LA")
    image.putalpha(_alpha_ramp(image.size))
    return image


def _palette_png_with_transparency() -> bytes:
    image = _photo("chelsea").quantize(colors=32)
    return encode(image, "PNG", transparency=3)


def _l_png_with_transparency() -> bytes:
    return encode(
        _photo("coffee").convert("L"), "PNG", transparency=int(np.array(_photo("coffee").convert("L"))[0, 0])
    )


def _rgb_png_with_trns() -> bytes:
    image = _photo("rocket")
    return encode(image, "PNG", transparency=image.getpixel((0, 0)))


def _exif_jpeg(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(_photo("astronaut", (96, 64)), "JPEG", quality=90, exif=exif)


def _animated_gif() -> bytes:
    frames = [_photo(name, (64, 48)).quantize(colors=64) for name in ("astronaut", "coffee", "chelsea")]
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


def _ramp(dtype, lo: float, hi: float) -> np.ndarray:
    return np.linspace(lo, hi, 80 * 96).reshape(80, 96).astype(dtype)


def _i16_png() -> bytes:
    gray = np.array(_photo("coffee").convert("L"), dtype=np.uint16) * 257
    return encode(Image.fromarray(gray), "PNG")


CASES = {
    "photo_jpeg": lambda: photo_bytes("astronaut", "JPEG"),
    "photo_png": lambda: photo_bytes("chelsea", "PNG"),
    "photo_jpeg_resized": lambda: photo_bytes("rocket", "JPEG", (123, 77)),
    "rgba_png_partial_alpha": lambda: encode(_rgba(), "PNG"),
    "la_png": lambda: encode(_la(), "PNG"),
    "palette_png_trns": _palette_png_with_transparency,
    "palette_png": lambda: encode(_photo("chelsea").quantize(colors=16), "PNG"),
    "l_png_trns": _l_png_with_transparency,
    "rgb_png_trns": _rgb_png_with_trns,
    "bilevel_png": lambda: encode(_photo().convert("1"), "PNG"),
    "gray_jpeg": lambda: encode(_photo("coffee").convert("L"), "JPEG", quality=85),
    "cmyk_jpeg": lambda: encode(_photo("chelsea").convert("CMYK"), "JPEG", quality=85),
    "i16_png": _i16_png,
    "i32_tiff": lambda: encode(Image.fromarray(_ramp(np.int32, 0, 80 * 96 * 7)), "TIFF"),
    "float_tiff": lambda: encode(Image.fromarray(_ramp(np.float32, -5, 300)), "TIFF"),
    "exif_orientation_6_jpeg": lambda: _exif_jpeg(6),
    "exif_orientation_3_jpeg": lambda: _exif_jpeg(3),
    "broken_exif_jpeg": lambda: encode(_photo(), "JPEG", exif=b"Exif\x00\x00garbage-not-tiff"),
    "animated_gif": _animated_gif,
    "gif_trns": lambda: encode(_photo("chelsea", (64, 48)).quantize(colors=32), "GIF", transparency=5),
    "webp_lossy": lambda: photo_bytes("coffee", "WEBP", (96, 80)),
    "webp_lossless_rgba": lambda: encode(_rgba(), "WEBP", lossless=True),
    "bmp": lambda: photo_bytes("rocket", "BMP", (64, 48)),
    "rgba_tiff": lambda: encode(_rgba(), "TIFF"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_load_image_matches_vllm_pixel_for_pixel(case, vllm_load):
    data = CASES[case]()
    ours = load_image(data)
    theirs = vllm_load(data)
    assert ours.mode == theirs.mode == "RGB"
    assert ours.size == theirs.size
    a, b = np.asarray(ours), np.asarray(theirs)
    assert a.dtype == np.uint8 and a.shape == (ours.height, ours.width, 3)
    np.testing.assert_array_equal(a, b)


def test_transparency_is_composited_on_white(vllm_load):
    data = encode(_rgba(), "PNG")
    rgb = np.asarray(load_image(data))
    h = rgb.shape[0]
    assert (rgb[-(h // 4) :] == 255).all()  # the fully transparent band is white, not the photo, not black
    assert not (rgb[: h // 4] == 255).all()  # the opaque band keeps the photo
    np.testing.assert_array_equal(rgb, np.asarray(vllm_load(data)))


def test_exif_orientation_is_applied():
    data = _exif_jpeg(6)
    with Image.open(io.BytesIO(data)) as raw:
        assert raw.size == (96, 64)
    assert load_image(data).size == (64, 96)  # rotated 90 degrees


def test_animated_gif_gives_the_first_frame():
    data = _animated_gif()
    first = np.asarray(load_image(data))
    with Image.open(io.BytesIO(data)) as im:
        assert im.n_frames == 3
        frame0 = np.asarray(im.convert("RGB"))
        im.seek(1)
        frame1 = np.asarray(im.convert("RGB"))
    np.testing.assert_array_equal(first, frame0)
    assert not np.array_equal(first, frame1)


def test_load_image_returns_a_loaded_image():
    image = load_image(photo_bytes("astronaut", "PNG", (32, 32)))
    assert image.mode == "RGB"
    assert image.getpixel((0, 0)) is not None
    assert getattr(image, "fp", None) is None  # pixels are in memory, nothing left open


# ---------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        photo_bytes("astronaut", "JPEG")[:2000],
        photo_bytes("astronaut", "PNG")[:3000],
        photo_bytes("astronaut", "JPEG")[:-5000],
        b"",
        b"\x00",
        np.random.default_rng(0).bytes(4096),
        b"\xff\xd8\xff\xe0" + np.random.default_rng(1).bytes(4096),  # JPEG magic, then garbage
        b"\x89PNG\r\n\x1a\n" + b"\x00" * 64,  # PNG magic, then garbage
        b"GIF89a",
        b"<svg xmlns='http://www.w3.org/2000/svg'/>",
    ],
    ids=[
        "truncated_jpeg_header",
        "truncated_png",
        "truncated_jpeg_body",
        "empty",
        "one_byte",
        "random",
        "jpeg_magic_garbage",
        "png_magic_garbage",
        "gif_magic_only",
        "svg",
    ],
)
def test_unreadable_bytes(data, vllm_load):
    with pytest.raises(ImageUnreadable) as info:
        load_image(data, ref="mmraw:abc")
    assert info.value.ref == "mmraw:abc"
    with pytest.raises(ValueError):  # vLLM refuses the same bytes
        vllm_load(data)


def test_formats_outside_the_allow_list_are_unreadable():
    image = _photo()
    for fmt in ("PPM", "PCX", "ICO", "TGA"):  # vLLM would open these; the store takes photo formats only
        data = encode(image, fmt)
        with pytest.raises(ImageUnreadable):
            load_image(data)
        with pytest.raises(ImageUnreadable):
            sniff_media_type(data)


def _tiff_with_float_strip_offsets() -> bytes:
    """A 9x7 RGB TIFF whose StripOffsets tag (273) is typed DOUBLE (11) instead of LONG (4):
    Pillow's decoder raises ``TypeError: 'float' object cannot be interpreted as an integer``."""
    data = bytearray(encode(Image.new("RGB", (9, 7)), "TIFF"))
    assert data[70:74] == b"\x11\x01\x04\x00"  # tag 273, type 4 at byte 72
    data[72] = 11
    return bytes(data)


def _png_with_truncated_ihdr() -> bytes:
    """PNG magic, then an IHDR chunk of length 1 with a valid CRC: ``ValueError: Truncated IHDR chunk``."""
    return b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\x01IHDR\x00" + struct.pack(">I", zlib.crc32(b"IHDR\x00"))


def test_a_mis_typed_tiff_tag_is_unreadable_not_a_type_error():
    """Pillow raises a TypeError decoding a TIFF whose StripOffsets tag is typed DOUBLE: 422
    ``image_unreadable`` (docs/SECURITY.md), never an untyped 500."""
    tiff = _tiff_with_float_strip_offsets()
    assert sniff_media_type(tiff) == ("image/tiff", ".img")  # the header is a TIFF's
    with pytest.raises(ImageUnreadable) as info:
        load_image(tiff, ref="mmraw:tiff")
    assert info.value.ref == "mmraw:tiff" and isinstance(info.value.__cause__, TypeError)


def test_sniffing_a_truncated_ihdr_is_unreadable_not_a_value_error():
    """Pillow raises a ValueError opening a PNG whose IHDR chunk is 1 byte long: the sniff of a
    writer (``put_image``, ``put_content``) refuses it as ``image_unreadable`` too."""
    png = _png_with_truncated_ihdr()
    with pytest.raises(ImageUnreadable) as info:
        sniff_media_type(png)
    assert isinstance(info.value.__cause__, ValueError) and "IHDR" in str(info.value)
    with pytest.raises(ImageUnreadable):
        load_image(png)


def test_max_pixels_limit():
    data = photo_bytes("coffee", "PNG", (64, 48))
    assert load_image(data, max_pixels=64 * 48).size == (64, 48)
    with pytest.raises(AssetTooLarge) as info:
        load_image(data, max_pixels=64 * 48 - 1, ref="mmraw:big")
    assert info.value.ref == "mmraw:big"
    assert "64x48" in str(info.value)


def test_decompression_bomb_is_refused():
    bomb = png_header_bomb(30000, 30000)
    assert len(bomb) < 200_000  # 900 megapixels in ~110 kB
    with pytest.raises(AssetTooLarge):
        load_image(bomb)


_RSS_PROBE = """
import resource, sys
from protocol.errors import AssetTooLarge
from protocol.images import load_image
data = open(sys.argv[1], "rb").read()
max_pixels = int(sys.argv[2])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load_image(data, max_pixels=max_pixels)
    outcome = "loaded"
except AssetTooLarge:
    outcome = "AssetTooLarge"
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(outcome, after - before)
"""


@pytest.mark.parametrize(
    "width,height,max_pixels",
    [
        (30000, 30000, DEFAULT_MAX_IMAGE_PIXELS),  # beyond PIL's own bomb threshold too
        (6000, 6000, 10_000_000),  # under PIL's threshold: only our header check stops it (RGB = 108 MB)
    ],
)
def test_bomb_is_refused_without_allocating(tmp_path, width, height, max_pixels):
    path = tmp_path / "bomb.png"
    path.write_bytes(png_header_bomb(width, height))
    out = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(path), str(max_pixels)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=True,
    )
    outcome, grown_kib = out.stdout.split()
    assert outcome == "AssetTooLarge"
    assert int(grown_kib) < 20 * 1024, f"peak RSS grew by {grown_kib} KiB while refusing the bomb"


def test_images_under_the_default_limit_load_like_vllm(vllm_load):
    """9460x9460 = 89.5 MP: over PIL's *warning* threshold (89.48 MP), under vLLM's limit (179 MP).

    vLLM loads it (PIL only warns); the same bytes must load here too, or the trainer refuses an image
    the server accepts.
    """
    data = png_header_bomb(9460, 9460)
    assert 9460 * 9460 < DEFAULT_MAX_IMAGE_PIXELS
    theirs = vllm_load(data)
    assert theirs.size == (9460, 9460) and theirs.mode == "RGB"
    del theirs
    ours = load_image(data)
    assert ours.size == (9460, 9460) and ours.mode == "RGB"
    assert ours.getpixel((9459, 9459)) == (0, 0, 0)


# ---------------------------------------------------------------------------------------------------------
# sniff_media_type
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt,expected",
    [
        ("JPEG", ("image/jpeg", ".jpg")),
        ("PNG", ("image/png", ".png")),
        ("WEBP", ("image/webp", ".webp")),
        ("GIF", ("image/gif", ".gif")),
        ("BMP", ("image/bmp", ".img")),
        ("TIFF", ("image/tiff", ".img")),
    ],
)
def test_sniff_media_type(fmt, expected):
    assert sniff_media_type(photo_bytes("rocket", fmt, (32, 24))) == expected


def test_sniff_reads_the_header_not_the_pixels():
    jpeg = photo_bytes("rocket", "JPEG", (64, 48))
    assert sniff_media_type(jpeg[:1024]) == ("image/jpeg", ".jpg")  # truncated body: still a JPEG header
    assert sniff_media_type(_animated_gif()) == ("image/gif", ".gif")
    assert sniff_media_type(encode(_rgba(), "WEBP", lossless=True)) == ("image/webp", ".webp")


@pytest.mark.parametrize("data", [b"", b"hello", b"%PDF-1.4\n", b"\x00" * 100], ids=repr)
def test_sniff_rejects_non_images(data):
    with pytest.raises(ImageUnreadable):
        sniff_media_type(data)


def test_sniff_does_not_call_a_bomb_unreadable():
    """A 900 MP PNG is a well-formed PNG: either its type is sniffed, or it is refused as too large (413)."""
    bomb = png_header_bomb(30000, 30000)
    try:
        result = sniff_media_type(bomb)
    except AssetTooLarge:
        return
    assert result == ("image/png", ".png")
