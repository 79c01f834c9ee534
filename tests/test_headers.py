"""The JPEG/PNG header reader against PIL: the same format, size and EXIF orientation, or it declines."""
from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from tests.conftest import shared_path
from utils.data.headers import (fast_header, image_header, jpeg_frame, jpeg_header, pil_header, png_header,
                                tiff_orientation)
from utils.data.images import IMG_EXTENSIONS, exif_orientation, read_image


def _picture(mode="RGB", size=(40, 24)) -> Image.Image:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def _encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    exif[0x010F] = "maker"  # another IFD0 entry beside the orientation
    return exif.tobytes()


def _big_endian_exif(orientation: int) -> bytes:
    """An EXIF block in Motorola byte order (PIL writes Intel): 2 IFD0 entries, orientation second."""
    entries = struct.pack(">HHI4s", 0x0100, 4, 1, struct.pack(">I", 640))
    entries += struct.pack(">HHIH2x", 0x0112, 3, 1, orientation)
    return b"Exif\x00\x00MM" + struct.pack(">HI", 42, 8) + struct.pack(">H", 2) + entries + b"\x00" * 4


def _with_app1(jpeg: bytes, payload: bytes) -> bytes:
    """``jpeg`` with an APP1 segment holding ``payload`` right after SOI."""
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


def _cases() -> dict[str, bytes]:
    rgb = _picture()
    cases = {f"jpeg exif {k}": _encode(rgb, "JPEG", exif=_exif(k)) for k in range(1, 9)}
    plain = _encode(rgb, "JPEG")
    cases.update({
        "jpeg plain": plain,
        "jpeg exif 0": _encode(rgb, "JPEG", exif=_exif(0)),
        "jpeg exif 9": _encode(rgb, "JPEG", exif=_exif(9)),
        "jpeg big-endian exif 6": _with_app1(plain, _big_endian_exif(6)),
        "jpeg exif without orientation": _encode(rgb, "JPEG", exif=Image.Exif().tobytes()),
        "jpeg progressive": _encode(rgb, "JPEG", progressive=True, exif=_exif(3)),
        "jpeg gray": _encode(_picture("L"), "JPEG", exif=_exif(8)),
        "jpeg cmyk": _encode(_picture("CMYK"), "JPEG"),
        "jpeg with comment and icc": _encode(rgb, "JPEG", comment=b"hello", icc_profile=b"\x00" * 300),
        "jpeg xmp orientation only": _with_app1(
            plain, b"http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta><rdf:Description tiff:Orientation=\"6\"/></x:xmpmeta>"),
        "jpeg two exif blocks": _with_app1(_encode(rgb, "JPEG", exif=_exif(6)), _big_endian_exif(3)),
        "png plain": _encode(rgb, "PNG"),
        "png gray 16-bit": _encode(Image.fromarray(np.arange(40 * 24, dtype=np.uint16).reshape(24, 40)), "PNG"),
        "png palette": _encode(rgb.convert("P"), "PNG"),
        "png exif 6": _encode(rgb, "PNG", exif=_exif(6)),
    })
    text = PngImagePlugin.PngInfo()
    text.add_text("Software", "a tool")
    cases["png text chunk"] = _encode(rgb, "PNG", pnginfo=text)
    xmp = PngImagePlugin.PngInfo()
    xmp.add_itxt("XML:com.adobe.xmp", "<x:xmpmeta><rdf:Description tiff:Orientation=\"3\"/></x:xmpmeta>")
    cases["png xmp orientation"] = _encode(rgb, "PNG", pnginfo=xmp)
    cases["bmp"] = _encode(rgb, "BMP")
    cases["tiff"] = _encode(rgb, "TIFF")
    cases["not an image"] = b"hello, this is text and not an image at all"
    return cases


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_header_equals_pil(name):
    data = CASES[name]
    expected = pil_header(data)
    assert image_header(data) == expected
    assert image_header(np.frombuffer(data, np.uint8)) == expected  # the scan passes numpy arrays
    fast = fast_header(data)
    assert fast is None or fast == expected


def test_plain_files_take_the_fast_path():
    """The common files never reach PIL; what PIL treats specially always does."""
    fast = [name for name in CASES if fast_header(CASES[name]) is not None]
    assert set(fast) == {name for name in CASES if name.startswith(("jpeg exif", "jpeg plain", "jpeg big", "jpeg prog",
                                                                     "jpeg gray", "jpeg cmyk", "jpeg with", "png plain",
                                                                     "png gray", "png palette", "png text"))}
    assert fast_header(CASES["jpeg big-endian exif 6"])[3] == 6
    assert fast_header(CASES["jpeg exif 5"]) == ("JPEG", 40, 24, 5)


@pytest.mark.filterwarnings("ignore::UserWarning")  # PIL warns about the damaged EXIF it reads
def test_damaged_headers_never_disagree_with_pil():
    """Truncated files and flipped bytes: the fast reader declines or agrees with PIL wherever PIL reads the file."""
    rng = np.random.default_rng(1)
    agreed = declined = 0
    for name in ("jpeg exif 6", "jpeg big-endian exif 6", "jpeg progressive", "png plain", "png text chunk"):
        original = np.frombuffer(CASES[name], np.uint8)
        for trial in range(150):
            data = original.copy()
            if trial % 3 == 0:
                data = data[:rng.integers(1, len(data))]
            else:
                spot = rng.integers(0, min(len(data), 400))
                data[spot] = rng.integers(0, 256)
            fast, expected = fast_header(data), pil_header(data.tobytes())
            if fast is None:
                declined += 1
                continue
            if expected is not None:
                assert fast == expected, (name, trial)
                agreed += 1
    assert agreed > 300 and declined > 20


def test_tiff_orientation_bounds():
    block = _big_endian_exif(7)[6:]
    assert tiff_orientation(block, 0, len(block)) == 7
    assert tiff_orientation(block, 0, 20) is None  # the entries run past the block
    assert tiff_orientation(b"XX" + block[2:], 0, len(block)) is None
    assert jpeg_header(b"\xff\xd8\xff\xe0\x00") is None and png_header(b"\x89PNG\r\n\x1a\n") is None


def test_read_image_orientation_from_the_fast_header(tmp_path, monkeypatch):
    """read_image and exif_orientation take the orientation from the bytes, without PIL, for plain files."""
    path = tmp_path / "rotated.jpg"
    path.write_bytes(CASES["jpeg exif 6"])
    import utils.data.images as images_module

    def no_pil(source):
        raise AssertionError("PIL was asked")

    monkeypatch.setattr(images_module, "pil_header", no_pil)
    assert exif_orientation(path) == 6
    assert read_image(path).shape[:2] == (40, 24)  # 40x24 stored, turned upright to 24 wide, 40 high


def test_header_equals_pil_on_real_images():
    """Every image of the shared datasets (real photos, YOLOv5 fixtures, bad inputs) reads as PIL reads it."""
    root = shared_path("datasets", why="real images from other tools")
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.suffix[1:].lower() in IMG_EXTENSIONS]
    assert files
    for path in files:
        data = path.read_bytes()
        assert image_header(data) == pil_header(data), path


def test_jpeg_frame_reads_the_frame_header_of_plain_jpegs_only():
    import cv2

    pixels = np.zeros((30, 50, 3), np.uint8)
    baseline = cv2.imencode(".jpg", pixels)[1].tobytes()
    progressive = cv2.imencode(".jpg", pixels, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes()
    grey = cv2.imencode(".jpg", pixels[..., 0])[1].tobytes()
    assert jpeg_frame(baseline) == (0xC0, 8, 3, 50, 30)
    assert jpeg_frame(progressive) == (0xC2, 8, 3, 50, 30) and jpeg_frame(grey) == (0xC0, 8, 1, 50, 30)
    assert jpeg_frame(cv2.imencode(".png", pixels)[1].tobytes()) is None
    assert jpeg_frame(baseline[:20]) is None  # cut before its frame header
