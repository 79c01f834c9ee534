"""The one image decode function: every reader (scan, training, validation, detect) goes through here.

``read_image`` returns an upright (EXIF orientation applied), 8-bit, 3-channel BGR array, whatever
the file holds (gray, RGBA, 16-bit, palette), or raises ``ImageError`` naming the file and reason.
"""
from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np

from utils.data.headers import ImageTooLarge, fast_header, pil_header, pixel_count
from utils.errors import UserError
from utils.limits import MAX_IMAGE_PIXELS

# YOLOv5 v7 lists dng and pfm too: OpenCV decodes a DNG's first picture (often its thumbnail) and PFM as float
# of no fixed range, so neither is read as a training image here. MPO (a camera's multi-picture JPEG) is its
# first JPEG picture, upright by its EXIF orientation, as YOLOv5 reads it.
IMG_EXTENSIONS = ("bmp", "jpeg", "jpg", "mpo", "png", "tif", "tiff", "webp")
ORIENTED_SUFFIXES = (".jpg", ".jpeg", ".mpo", ".tif", ".tiff", ".webp", ".png")  # formats whose EXIF orientation we apply
HEADER_BYTES = 1 << 18  # read for a header alone: JPEG headers (EXIF with its thumbnail) fit in far less
VID_EXTENSIONS = ("asf", "avi", "gif", "m4v", "mkv", "mov", "mp4", "mpeg", "mpg", "ts", "wmv")

# EXIF orientation tag value -> cv2 operations that make the pixels upright.
_EXIF_OPS = {
    2: (cv2.flip, 1),
    3: (cv2.rotate, cv2.ROTATE_180),
    4: (cv2.flip, 0),
    5: None,  # transpose
    6: (cv2.rotate, cv2.ROTATE_90_CLOCKWISE),
    7: None,  # transverse
    8: (cv2.rotate, cv2.ROTATE_90_COUNTERCLOCKWISE),
}


class ImageError(UserError):
    """An image file that cannot be used; the message names the file and the reason."""


def is_image_file(path: str | Path) -> bool:
    return Path(path).suffix[1:].lower() in IMG_EXTENSIONS


def exif_orientation(path: str | Path, data: np.ndarray | None = None) -> int:
    """EXIF orientation tag of a file (1 when absent or unreadable), from its header: ``data`` when the caller
    has read the file already, else the file's first HEADER_BYTES (PIL reads the file when those do not do)."""
    try:
        if data is None:
            with open(path, "rb") as file:
                data = file.read(HEADER_BYTES)
        header = fast_header(data) or pil_header(str(path))
    except (OSError, ValueError):
        return 1
    return header[3] if header else 1


def applied_orientation(path: str | Path, tag: int) -> int:
    """The orientation ``read_image`` applies to ``path`` whose EXIF tag is ``tag``: the tag (1..8) for
    ``ORIENTED_SUFFIXES``, else 1 (other formats, and values outside 1..8, are not applied)."""
    return tag if 1 <= tag <= 8 and _oriented(path) else 1


def _oriented(path: str | Path) -> bool:
    """True for the formats whose EXIF orientation ``read_image`` applies (ORIENTED_SUFFIXES)."""
    return os.path.splitext(path)[1].lower() in ORIENTED_SUFFIXES


def file_orientation(path: str | Path, data: np.ndarray | None = None) -> int:
    """The orientation ``read_image`` applies to ``path``, read from its header (only where one is applied)."""
    return applied_orientation(path, exif_orientation(path, data)) if _oriented(path) else 1


def apply_orientation(img: np.ndarray, orientation: int) -> np.ndarray:
    if orientation in (1, 0) or orientation not in _EXIF_OPS:
        return img
    if orientation == 5:
        return cv2.transpose(img)
    if orientation == 7:
        return cv2.rotate(cv2.transpose(img), cv2.ROTATE_180)
    op, arg = _EXIF_OPS[orientation]
    return op(img, arg)


def to_bgr8(img: np.ndarray) -> np.ndarray:
    """Any decoded array (gray, BGRA, 16-bit, float) -> 8-bit 3-channel BGR."""
    if img.dtype == np.uint16:
        img = cv2.convertScaleAbs(img, alpha=1 / 257)  # round(x / 257) in one uint8 pass (no float64 copies)
    elif img.dtype != np.uint8:
        img = np.clip(img * (255.0 if img.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8)
    if img.ndim == 2:
        return cv2.cvtColor(img, cv2.COLOR_GRAY2BGR)
    if img.shape[2] == 4:
        return cv2.cvtColor(img, cv2.COLOR_BGRA2BGR)
    if img.shape[2] == 1:
        return cv2.cvtColor(img[:, :, 0], cv2.COLOR_GRAY2BGR)
    return img


def check_pixel_count(path, data) -> None:
    """ImageError when the header of ``data`` (the file's bytes) declares more than MAX_IMAGE_PIXELS: refused
    before decoding, as a decompression bomb (a few MB of PNG declaring tens of GB)."""
    try:
        pixels = pixel_count(data)
    except ImageTooLarge as error:
        raise ImageError(f"{path}: image too large ({error}; at most {MAX_IMAGE_PIXELS:,} pixels are decoded)") from None
    if pixels is not None and pixels > MAX_IMAGE_PIXELS:
        raise ImageError(f"{path}: image too large ({pixels:,} pixels; at most {MAX_IMAGE_PIXELS:,} are decoded)")


def read_image(path: str | Path, orientation: int | None = None) -> np.ndarray:
    """Decode ``path`` to an upright uint8 BGR HxWx3 array, or raise ImageError(file, reason).

    Reads the bytes with numpy (so non-ASCII names work on every platform), decodes with OpenCV
    keeping the bit depth and alpha (``IMREAD_UNCHANGED`` ignores EXIF), then applies the EXIF
    orientation (``file_orientation``, from the bytes already read; or ``orientation`` when the caller
    knows it already), so scan, training, validation and detect all see the same pixels.
    """
    path = Path(path)
    try:
        data = np.fromfile(path, dtype=np.uint8)
    except OSError as e:
        raise ImageError(f"{path}: cannot read file ({e.strerror or e})") from None
    if data.size == 0:
        raise ImageError(f"{path}: empty file")
    check_pixel_count(path, data)
    img = cv2.imdecode(data, cv2.IMREAD_UNCHANGED)
    if img is None or img.size == 0:
        raise ImageError(f"{path}: not a decodable image")
    img = to_bgr8(img)
    orientation = file_orientation(path, data) if orientation is None else orientation
    return np.ascontiguousarray(apply_orientation(img, orientation))
