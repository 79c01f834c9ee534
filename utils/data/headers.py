"""Size and EXIF orientation of JPEG and PNG files from their bytes, without PIL in the common case.

``image_header(buf)`` returns ``(format, width, height, orientation tag)`` exactly as PIL reports them
(``Image.open(...).format``, ``.size``, ``getexif().get(0x0112, 1) or 1``). Plain JPEGs (markers up to
the first scan, one frame header, at most one EXIF block) and PNGs (chunk list, no EXIF or XMP text) are
read here in a few dozen byte operations; everything else, including anything this reader is not sure
about, goes to PIL. PIL parses every JPEG marker in Python (~0.15 ms a file) and, to find a PNG's
orientation, decodes the whole image, which at 100k files is most of a dataset scan.

Matching PIL matters because the scan records the orientation that loading applies: the fast readers
decline (return None) on what PIL treats specially: frame precision other than 8 bits or unusual
component counts (PIL refuses them), XMP in a JPEG without an EXIF orientation (PIL reads ``tiff:Orientation``
from XMP then), and PNG EXIF in any of its places (eXIf, or text chunks PIL reads EXIF and XMP from).
"""
from __future__ import annotations

import io
import os
import struct

_JPEG_START = b"\xff\xd8\xff"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_SOF_MARKERS = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))
_EXIF_PREFIX = b"Exif\x00\x00"
_XMP_PREFIX = b"http://ns.adobe.com/xap/1.0/"
_PNG_EXIF_KEYWORDS = (b"Raw profile type exif", b"XML:com.adobe.xmp")
_ORIENTATION_TAG = 0x0112
_TIFF_TYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4}  # bytes per value


def image_header(buf) -> tuple[str, int, int, int] | None:
    """(format, width, height, EXIF orientation tag) of an image file's bytes, None when PIL cannot open it."""
    fast = fast_header(buf)
    return fast if fast is not None else pil_header(buf)


class ImageTooLarge(ValueError):
    """An image whose header declares more pixels than are ever decoded (utils.limits.MAX_IMAGE_PIXELS)."""


def pixel_count(buf) -> int | None:
    """Width x height from an image file's bytes, before any decoding: the fast readers, else PIL's header (PIL
    refuses twice its MAX_IMAGE_PIXELS at open: ImageTooLarge); None where neither knows the format."""
    fast = fast_header(buf)
    if fast is not None:
        return fast[1] * fast[2]
    from PIL import Image

    try:
        with Image.open(io.BytesIO(buf)) as image:
            return image.size[0] * image.size[1]
    except Image.DecompressionBombError as error:
        raise ImageTooLarge(str(error).split(" could be ")[0]) from None
    except Exception:  # PIL raises many types for foreign bytes
        return None


def fast_header(buf) -> tuple[str, int, int, int] | None:
    """``image_header`` for the plain JPEGs and PNGs read here; None for every other file."""
    buf = _bytes_view(buf)
    start = bytes(buf[:8])
    if start.startswith(_JPEG_START):
        return jpeg_header(buf)
    if start == _PNG_SIGNATURE:
        return png_header(buf)
    return None


def _bytes_view(buf) -> memoryview:
    """A view whose items are Python ints (numpy uint8 scalars would overflow when shifted)."""
    return memoryview(buf).cast("B")


def pil_header(source) -> tuple[str, int, int, int] | None:
    """The same four values from PIL (any format it knows) for a file's bytes or its path, None when PIL
    cannot open it."""
    from PIL import Image

    try:
        with Image.open(source if isinstance(source, (str, os.PathLike)) else io.BytesIO(source)) as image:
            orientation = int(image.getexif().get(_ORIENTATION_TAG, 1) or 1)
            return image.format or "", image.size[0], image.size[1], orientation
    except Image.DecompressionBombError as error:
        raise ImageTooLarge(str(error).split(" could be ")[0]) from None
    except Exception:  # PIL raises many types for foreign bytes
        return None


def _jpeg_segments(buf):
    """(marker, first byte, end) of each marker segment of a JPEG's bytes before its first scan; a last None when the
    markers are not plain (truncated, or no marker where one must be)."""
    end, pos = len(buf), 2
    while True:
        if pos + 4 > end or buf[pos] != 0xFF:
            yield None
            return
        marker = buf[pos + 1]
        if marker == 0xDA:  # start of scan: the header is over
            return
        length = (buf[pos + 2] << 8) | buf[pos + 3]
        segment, pos = pos + 4, pos + 2 + length
        if length < 2 or pos > end:
            yield None
            return
        yield marker, segment, pos


def jpeg_header(buf) -> tuple[str, int, int, int] | None:
    """("JPEG", width, height, orientation) from the markers before the first scan; None when unsure."""
    buf = _bytes_view(buf)
    size, exif, xmp = None, None, False
    for found in _jpeg_segments(buf):
        if found is None:
            return None
        marker, segment, pos = found
        if marker in _SOF_MARKERS:
            if size is not None or pos - segment < 6 or buf[segment] != 8 or buf[segment + 5] not in (1, 3, 4):
                return None  # a second frame, or what PIL refuses (precision, component count)
            size = ((buf[segment + 3] << 8) | buf[segment + 4], (buf[segment + 1] << 8) | buf[segment + 2])
        elif marker == 0xE1:
            head = bytes(buf[segment:segment + len(_XMP_PREFIX)])
            if head.startswith(_EXIF_PREFIX):
                if exif is not None:
                    return None
                exif = (segment + len(_EXIF_PREFIX), pos)
            elif head == _XMP_PREFIX:
                xmp = True
        elif not 0xC0 <= marker <= 0xFE or 0xD0 <= marker <= 0xD9:
            return None  # fill bytes, standalone or unknown markers before the scan: PIL's own rules decide
    if size is None or 0 in size:
        return None
    orientation = 0 if exif is None else tiff_orientation(buf, *exif)
    if orientation is None or (orientation == 0 and xmp):
        return None
    return "JPEG", size[0], size[1], orientation or 1


def jpeg_frame(buf) -> tuple[int, int, int, int, int] | None:
    """(frame marker, sample precision, component count, width, height) of a JPEG's bytes with one frame header
    before its first scan; None for anything else (not a JPEG, markers not plain, no frame or several)."""
    buf = _bytes_view(buf)
    if bytes(buf[:3]) != _JPEG_START:
        return None
    frames = []
    for found in _jpeg_segments(buf):
        if found is None:
            return None
        marker, segment, pos = found
        if marker in _SOF_MARKERS:
            if pos - segment < 6:
                return None
            frames.append((marker, buf[segment], buf[segment + 5], (buf[segment + 3] << 8) | buf[segment + 4],
                           (buf[segment + 1] << 8) | buf[segment + 2]))
    return frames[0] if len(frames) == 1 else None


def tiff_orientation(buf, start: int, end: int) -> int | None:
    """The orientation tag's value in the first IFD of the TIFF structure in ``buf[start:end]``: 0 when
    absent, None when the structure is not the plain one (PIL then decides). Every entry is checked as PIL
    reads it: one whose type is unknown or whose data lies outside the block makes PIL stop or skip, so
    then this reader declines."""
    if end - start < 8:
        return None
    order = bytes(buf[start:start + 2])
    if order not in (b"II", b"MM"):
        return None
    fmt = "<" if order == b"II" else ">"
    magic, offset = struct.unpack_from(fmt + "HI", buf, start + 2)
    first = start + offset
    if magic != 42 or first + 2 > end:
        return None
    (count,) = struct.unpack_from(fmt + "H", buf, first)
    if first + 2 + 12 * count > end:
        return None
    found = None
    for entry in range(first + 2, first + 2 + 12 * count, 12):
        tag, kind, values, data_offset = struct.unpack_from(fmt + "HHII", buf, entry)
        unit = _TIFF_TYPE_SIZES.get(kind)
        if unit is None or (unit * values > 4 and start + data_offset + unit * values > end):
            return None
        if tag == _ORIENTATION_TAG:
            if found is not None or kind != 3 or values != 1:  # twice, or not one SHORT
                return None
            (found,) = struct.unpack_from(fmt + "H", buf, entry + 8)
    return 0 if found is None else found


def png_header(buf) -> tuple[str, int, int, int] | None:
    """("PNG", width, height, 1) from the chunk list; None when the file may carry EXIF or is malformed."""
    buf = _bytes_view(buf)
    end = len(buf)
    if end < 33:
        return None
    length, kind, width, height = struct.unpack_from(">I4sII", buf, 8)
    if kind != b"IHDR" or length != 13 or width == 0 or height == 0:
        return None
    pos = 8
    while pos + 8 <= end:
        length, kind = struct.unpack_from(">I4s", buf, pos)
        if kind == b"IEND":
            return "PNG", width, height, 1
        if kind == b"eXIf":
            return None
        if kind in (b"tEXt", b"zTXt", b"iTXt"):
            keyword = bytes(buf[pos + 8:pos + 8 + min(length, 80)]).split(b"\x00", 1)[0]
            if keyword in _PNG_EXIF_KEYWORDS:
                return None
        pos += 12 + length
    return None  # no IEND: truncated, let PIL and the decoder decide
