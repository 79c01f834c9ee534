"""Labels OpenCV's Hershey font cannot draw: its fonts have ASCII only, so a class named "кошка" or "猫" came out as
"?????" or "?". Such a label is drawn with Pillow in an installed TrueType font that has every one of its characters,
as YOLOv5 draws non-ASCII labels with Pillow (it downloads Arial Unicode for them; nothing is downloaded here).

Fonts are the ones matplotlib knows (its own DejaVu Sans, which covers Latin, Greek and Cyrillic, and the system's,
e.g. Noto Sans CJK where it is installed): families known to cover many scripts are tried first, then any other; the
first whose character map holds every character of the label is used, else the one holding most (the others then
show as empty boxes). Matplotlib is imported on the first such label only. The metric plots (matplotlib) take the
same font for class names that are not ASCII (``names_font``).
"""
from __future__ import annotations

import functools
import logging

import numpy as np

LOGGER = logging.getLogger(__name__)

PREFERRED = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Noto Sans CJK", "Source Han Sans", "WenQuanYi Zen Hei",
             "WenQuanYi Micro Hei", "Microsoft YaHei", "SimHei", "PingFang SC", "Hiragino Sans", "Arial Unicode MS",
             "Noto Sans", "DejaVu Sans")


@functools.lru_cache(maxsize=1)
def _candidates() -> tuple[str, ...]:
    """Font files, the preferred families first (matplotlib's list of its own and the system's fonts)."""
    from matplotlib import font_manager

    fonts = [font for font in font_manager.fontManager.ttflist if font.fname.lower().endswith((".ttf", ".otf",
                                                                                                ".ttc"))]
    rank = {name.lower(): index for index, name in enumerate(PREFERRED)}
    fonts.sort(key=lambda font: (rank.get(font.name.lower(), len(PREFERRED)), font.weight != 400, font.style != "normal",
                                 font.fname))
    return tuple(dict.fromkeys(font.fname for font in fonts))


@functools.lru_cache(maxsize=64)
def font_file(characters: frozenset) -> str | None:
    """The first candidate font whose character map holds all ``characters`` (else the one holding most); None when
    no font file is known."""
    from matplotlib.ft2font import FT2Font

    best, best_count = None, -1
    for path in _candidates():
        try:
            font = FT2Font(path)
        except (OSError, RuntimeError, ValueError):
            continue
        count = sum(1 for character in characters if font.get_char_index(ord(character)))
        if count == len(characters):
            return path
        if count > best_count:
            best, best_count = path, count
    if best is not None:
        LOGGER.warning("WARNING: no installed font has every character of %s; some show as boxes (install a font "
                       "for that script, e.g. Noto Sans CJK)", "".join(sorted(characters))[:40])
    return best


@functools.lru_cache(maxsize=64)
def _pil_font(path: str | None, size: int):
    from PIL import ImageFont

    if path is not None:
        try:
            return ImageFont.truetype(path, size)
        except OSError:
            pass
    try:
        return ImageFont.load_default(size)
    except TypeError:  # Pillow before 10.1
        return ImageFont.load_default()


def _beyond_ascii(text: str) -> frozenset:
    """The characters a font is chosen for: those past ASCII, which every candidate font has (so "кошка 0.91" and
    "кошка 0.87" share one search, and one warning)."""
    return frozenset(character for character in text if not character.isascii())


def label_font(text: str, size: int):
    """A Pillow font of ``size`` px that can draw ``text``."""
    return _pil_font(font_file(_beyond_ascii(text)), max(int(size), 6))


def text_width(text: str, height: int) -> int:
    """The width in px of ``text`` drawn ``height`` px tall (``draw_text``)."""
    left, _, right, _ = label_font(text, round(height * 0.8)).getbbox(text)
    return max(right - left, 1) + 2


def draw_text(img: np.ndarray, x: int, y: int, text: str, height: int, color) -> None:
    """``text`` in ``color`` (BGR) on BGR uint8 ``img``, in place, in the ``height`` px tall band whose top-left corner
    is (x, y), vertically centred; the part outside the image is left out."""
    from PIL import Image, ImageDraw

    font = label_font(text, round(height * 0.8))
    left, top, right, bottom = font.getbbox(text)
    x0, y0 = max(x, 0), max(y, 0)
    x1, y1 = min(x + max(right - left, 1) + 2, img.shape[1]), min(y + height, img.shape[0])
    if x1 <= x0 or y1 <= y0:
        return
    region = Image.fromarray(np.ascontiguousarray(img[y0:y1, x0:x1, ::-1]))
    ImageDraw.Draw(region).text((x - x0 + 1 - left, y - y0 + (height - (bottom - top)) // 2 - top), text, font=font,
                                fill=tuple(int(c) for c in color[::-1]))
    img[y0:y1, x0:x1] = np.asarray(region)[:, :, ::-1]


def names_font(names, size: float | None = None):
    """matplotlib FontProperties of a font that has every character of ``names`` (class names, legend labels), or
    None when they are all ASCII (matplotlib's default font draws those)."""
    characters = _beyond_ascii("".join(str(name) for name in names))
    if not characters:
        return None
    from matplotlib.font_manager import FontProperties

    path = font_file(characters)
    return FontProperties(fname=path, size=size) if path is not None else None
