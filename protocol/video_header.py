"""A video's container header, read without a decoder (docs/PROTOCOL.md §2, "Videos").

Before any byte reaches FFmpeg (through OpenCV, :mod:`protocol.videos`), the container's own
boxes are walked here: the ISO base media file format (MP4, QuickTime; ISO/IEC 14496-12) is a
tree of ``size | type | body`` boxes, and each video track declares its frame size (``tkhd``,
and the sample entry of ``stsd``), its duration (``mdhd``: ``duration / timescale``) and its
frame count (``stsz``: one size per sample). Only those few fields are read, each bounded by the
bytes that hold it, so a crafted header that declares a 60000x60000 frame or a billion frames is
refused before anything is allocated for it::

    ftyp                                   brand: "isom", "mp42", "qt  " (QuickTime -> .mov)
    moov
      trak                                 one per track
        tkhd     width, height (16.16 fixed point)
        mdia
          mdhd   timescale, duration
          hdlr   handler "vide" (a video track)
          minf / stbl
            stsd sample entry: codec 4CC, width, height
            stsz sample count = frames

Fragmented files (``moov/mvex``: frames in later ``moof`` boxes, no count in the header) are
refused: their frame count is not declared where this reader can bound it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

from protocol.errors import VideoUnreadable

__all__ = ["VideoHeader", "read_video_header", "sniff_video_type"]


@dataclass(frozen=True)
class VideoHeader:
    """What a container declares about its video track (the largest of each, over its tracks).

    All values are as declared, not decoded: :mod:`protocol.videos` checks them against its
    limits before decoding, then checks what the decoder reports the same way."""

    width: int
    """Frame width in pixels (largest of ``tkhd`` and the ``stsd`` sample entry)."""
    height: int
    """Frame height in pixels."""
    frames: int
    """Frames (``stsz`` sample count) of the video track."""
    duration_s: float
    """``mdhd`` duration / timescale, seconds (0.0 when the timescale is 0)."""
    codec: str
    """The sample entry's four-character code, e.g. ``"mp4v"``, ``"avc1"``."""


def sniff_video_type(data: bytes) -> tuple[str, str] | None:
    """``(media_type, store extension)`` of an ISO-BMFF file from its ``ftyp`` box, else None.

    ``("video/quicktime", ".mov")`` for the QuickTime brand ``qt  ``, ``("video/mp4", ".mp4")``
    for every other brand. Reads 12 bytes; nothing is decoded.
    """
    if len(data) < 12 or data[4:8] != b"ftyp":
        return None
    return ("video/quicktime", ".mov") if data[8:12] == b"qt  " else ("video/mp4", ".mp4")


def read_video_header(data: bytes, *, ref: str | None = None) -> VideoHeader:
    """The declared size, frame count and duration of an ISO-BMFF file's video track.

    Raises:
        VideoUnreadable: not ISO-BMFF, a box that runs past its parent or the file (truncated),
            no ``moov``, a fragmented file, no video track, or a video track without a sample
            table, a frame size or frames.
    """
    if sniff_video_type(data) is None:
        raise VideoUnreadable(f"not an MP4/QuickTime file ({len(data)} bytes): no ftyp box", ref=ref)
    view = memoryview(data)
    moov = next((body for kind, body in _boxes(view, ref) if kind == b"moov"), None)
    if moov is None:
        raise VideoUnreadable("the file has no moov box (no track is declared)", ref=ref)
    if any(kind == b"mvex" for kind, _ in _boxes(moov, ref)):
        raise VideoUnreadable("fragmented MP4 (moov/mvex) is not supported: no frame count declared", ref=ref)
    tracks = [
        t for t in (_video_track(body, ref) for kind, body in _boxes(moov, ref) if kind == b"trak") if t
    ]
    if not tracks:
        raise VideoUnreadable("the file has no video track", ref=ref)
    return VideoHeader(
        width=max(t.width for t in tracks),
        height=max(t.height for t in tracks),
        frames=max(t.frames for t in tracks),
        duration_s=max(t.duration_s for t in tracks),
        codec=tracks[0].codec,
    )


def _boxes(body: memoryview, ref: str | None) -> Iterator[tuple[bytes, memoryview]]:
    """``(type, body)`` of each box in ``body``, in order.

    Raises:
        VideoUnreadable: a box header or body that runs past ``body``.
    """
    pos, end = 0, len(body)
    while pos < end:
        if end - pos < 8:
            raise VideoUnreadable(f"truncated box header at byte {pos}", ref=ref)
        size, kind = struct.unpack_from(">I4s", body, pos)
        head = 8
        if size == 1:
            if end - pos < 16:
                raise VideoUnreadable(f"truncated box header at byte {pos}", ref=ref)
            (size,) = struct.unpack_from(">Q", body, pos + 8)
            head = 16
        elif size == 0:  # the box runs to the end of its parent
            size = end - pos
        if size < head or pos + size > end:
            raise VideoUnreadable(
                f"box {kind!r} at byte {pos} declares {size} bytes, {end - pos} remain (truncated file)",
                ref=ref,
            )
        yield bytes(kind), body[pos + head : pos + size]
        pos += size


def _find(body: memoryview, path: tuple[bytes, ...], ref: str | None) -> memoryview | None:
    """The body of the first box at ``path`` (e.g. ``(b"mdia", b"mdhd")``) under ``body``."""
    for kind, inner in _boxes(body, ref):
        if kind == path[0]:
            return inner if len(path) == 1 else _find(inner, path[1:], ref)
    return None


def _video_track(trak: memoryview, ref: str | None) -> VideoHeader | None:
    """The header of one ``trak`` if it is a video track (``hdlr`` ``vide``), else None.

    Raises:
        VideoUnreadable: a video track whose boxes are missing or too short for their fields.
    """
    hdlr = _find(trak, (b"mdia", b"hdlr"), ref)
    if hdlr is None or len(hdlr) < 12 or bytes(hdlr[8:12]) != b"vide":
        return None
    try:
        tkhd, mdhd = _find(trak, (b"tkhd",), ref), _find(trak, (b"mdia", b"mdhd"), ref)
        stbl = _find(trak, (b"mdia", b"minf", b"stbl"), ref)
        stsd, stsz = (
            (_find(stbl, (b"stsd",), ref), _find(stbl, (b"stsz",), ref)) if stbl is not None else (None, None)
        )
        if tkhd is None or mdhd is None or stsd is None or stsz is None:
            raise VideoUnreadable("a video track lacks tkhd, mdhd, stsd or stsz", ref=ref)
        # tkhd: version 0 -> width at 76, version 1 -> 88 (16.16 fixed point, then height)
        at = 88 if tkhd[0] == 1 else 76
        tw, th = (v >> 16 for v in struct.unpack_from(">II", tkhd, at))
        # mdhd: version 0 -> timescale at 12, duration u32; version 1 -> 20, u64
        timescale, duration = (
            struct.unpack_from(">IQ", mdhd, 20) if mdhd[0] == 1 else struct.unpack_from(">II", mdhd, 12)
        )
        # stsd: version/flags, entry count, then entry 1: size, 4CC, 6 reserved, data ref index,
        # 16 bytes pre-defined/reserved, width u16, height u16
        codec = bytes(stsd[12:16]).decode("latin-1")
        sw, sh = struct.unpack_from(">HH", stsd, 8 + 32)
        (frames,) = struct.unpack_from(">I", stsz, 8)
    except struct.error as e:
        raise VideoUnreadable(f"a video track's header is truncated: {e}", ref=ref) from e
    return VideoHeader(
        width=max(tw, sw),
        height=max(th, sh),
        frames=frames,
        duration_s=duration / timescale if timescale else 0.0,
        codec=codec,
    )
