"""Drawing with OpenCV only (Hershey fonts, nothing downloaded): labelled boxes, batch mosaics, crops.

All drawing happens on uint8 BGR HxWx3 arrays, in place.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import cv2
import numpy as np
import torch

from utils.boxes import clip_boxes, xywh2xyxy, xyxy2xywh
from utils.paths import increment_path

LOGGER = logging.getLogger(__name__)

# Twenty well-separated colours (RGB), cycled by class index.
_PALETTE_RGB = (
    (255, 56, 56), (255, 157, 151), (255, 112, 31), (255, 178, 29), (207, 210, 49),
    (72, 249, 10), (146, 204, 23), (61, 219, 134), (26, 147, 52), (0, 212, 187),
    (44, 153, 168), (0, 194, 255), (52, 69, 147), (100, 115, 255), (0, 24, 236),
    (132, 56, 255), (82, 0, 133), (203, 56, 255), (255, 149, 200), (255, 55, 199),
)
PREDICTION_PLOT_CONF = 0.25  # predictions below this confidence are not drawn in batch mosaics


def colors(index: int, bgr: bool = False) -> tuple[int, int, int]:
    """Fixed colour for a class index (RGB, or BGR for OpenCV drawing)."""
    rgb = _PALETTE_RGB[int(index) % len(_PALETTE_RGB)]
    return rgb[::-1] if bgr else rgb


def default_line_width(shape) -> int:
    """Line width scaled to the image size: ~0.3% of the mean side, at least 2 px."""
    return max(round((shape[0] + shape[1]) / 2 * 0.003), 2)


def _text_color(background) -> tuple[int, int, int]:
    """Black on light backgrounds, white on dark ones (perceived luminance; order-agnostic enough)."""
    luminance = 0.299 * background[2] + 0.587 * background[1] + 0.114 * background[0]  # BGR
    return (0, 0, 0) if luminance > 150 else (255, 255, 255)


def draw_box_label(img: np.ndarray, xyxy, label: str | None = "", color=(128, 128, 128),
                   line_width: int | None = None, txt_color=None) -> np.ndarray:
    """Draw one box (BGR ``color``) with an optional label on a filled background, in place.

    The label sits above the box, or inside its top edge when there is no room above; its text is ``txt_color``,
    by default black or white, whichever reads better on ``color``. A label that is not ASCII, which OpenCV's font
    cannot draw, is drawn with Pillow in an installed font that has its characters (utils/fonts.py).
    """
    width = line_width or default_line_width(img.shape)
    x1, y1, x2, y2 = (int(round(float(v))) for v in xyxy[:4])
    color = tuple(int(c) for c in color)
    cv2.rectangle(img, (x1, y1), (x2, y2), color, thickness=width, lineType=cv2.LINE_AA)
    if not label:
        return img
    thickness = max(width - 1, 1)
    scale = width / 3
    ascii_label = label.isascii()
    (text_w, text_h), _ = cv2.getTextSize(label if ascii_label else "A", cv2.FONT_HERSHEY_SIMPLEX, scale, thickness)
    outside = y1 - text_h - 3 >= 0
    top = y1 - text_h - 3 if outside else y1
    bottom = y1 if outside else y1 + text_h + 3
    text_color = _text_color(color) if txt_color is None else tuple(int(c) for c in txt_color)
    if not ascii_label:
        from utils.fonts import text_width

        text_w = text_width(label, bottom - top)
    cv2.rectangle(img, (x1, top), (x1 + text_w, bottom), color, -1, cv2.LINE_AA)
    if ascii_label:
        cv2.putText(img, label, (x1, bottom - 2), cv2.FONT_HERSHEY_SIMPLEX, scale, text_color,
                    thickness=thickness, lineType=cv2.LINE_AA)
    else:
        from utils.fonts import draw_text

        draw_text(img, x1, top, label, bottom - top, text_color)
    return img


def _to_numpy(x) -> np.ndarray:
    return x.detach().cpu().float().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _images_uint8_bgr(images) -> np.ndarray:
    """(B, 3, H, W) RGB, uint8 or float in [0, 1] (or [0, 255]) -> (B, H, W, 3) uint8 BGR."""
    array = images.detach().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    if array.dtype != np.uint8:
        array = array.astype(np.float32)
        if array.size and array.max() <= 1.0:
            array = array * 255
        array = np.clip(array, 0, 255).astype(np.uint8)
    return np.ascontiguousarray(array.transpose(0, 2, 3, 1)[..., ::-1])


def _tile_boxes(rows: np.ndarray, tile_w: int, tile_h: int, scale: float):
    """Target rows of one image -> (xyxy in tile pixels, classes, confidences or None)."""
    classes = rows[:, 1].astype(int)
    if rows.shape[1] == 6:  # labels: normalised cx, cy, w, h
        boxes = xywh2xyxy(rows[:, 2:6].copy()) * np.array([tile_w, tile_h, tile_w, tile_h])
        return boxes, classes, None
    boxes = rows[:, 2:6] * scale  # predictions: x1, y1, x2, y2 in batch-image pixels
    return boxes, classes, rows[:, 6]


def _draw_tile_targets(mosaic, rows, origin, tile_size, scale, names, line_width) -> None:
    boxes, classes, confs = _tile_boxes(rows, tile_size[0], tile_size[1], scale)
    for k, (box, cls) in enumerate(zip(boxes, classes)):
        if confs is not None and confs[k] < PREDICTION_PLOT_CONF:
            continue
        name = names[cls] if names and 0 <= cls < len(names) else str(cls)
        label = name if confs is None else f"{name} {confs[k]:.1f}"
        xyxy = box + np.array([origin[0], origin[1], origin[0], origin[1]])
        draw_box_label(mosaic, xyxy, label, colors(cls, bgr=True), line_width)


def plot_images(images, targets, paths=None, fname=None, names=None, max_size: int = 1920,
                max_subplots: int = 16) -> np.ndarray:
    """Draw up to ``max_subplots`` images of a batch as a square grid mosaic; return it (BGR), save to ``fname``.

    ``images``: (B, 3, H, W) RGB tensor or array, uint8 or float in [0, 1].
    ``targets``: one row per box, either
      - labels, (n, 6) = [image_index, class, cx, cy, w, h] normalised to the batch image size, or
      - predictions, (n, 7) = [image_index, class, x1, y1, x2, y2, conf] in batch-image pixels
        (see ``output_to_target``); predictions below conf 0.25 are not drawn.
    ``paths``: file names written on each tile; ``names``: class names (indices are drawn otherwise).
    The mosaic is downscaled so its side is at most ``max_size``. ``fname`` is written with cv2 as JPEG.
    """
    tiles = _images_uint8_bgr(images)[:max_subplots]
    targets = np.zeros((0, 6)) if targets is None or len(targets) == 0 else _to_numpy(targets)
    count, height, width = tiles.shape[0], tiles.shape[1], tiles.shape[2]
    grid = max(math.ceil(count ** 0.5), 1)
    scale = min(1.0, max_size / grid / max(height, width, 1))
    tile_h, tile_w = math.ceil(height * scale), math.ceil(width * scale)
    mosaic = np.full((grid * tile_h, grid * tile_w, 3), 255, dtype=np.uint8)
    line_width = max(round(sum(mosaic.shape[:2]) / 2 * 0.002), 1)
    for i, tile in enumerate(tiles):
        x0, y0 = tile_w * (i % grid), tile_h * (i // grid)
        if scale < 1:
            tile = cv2.resize(tile, (tile_w, tile_h), interpolation=cv2.INTER_AREA)
        mosaic[y0:y0 + tile_h, x0:x0 + tile_w] = tile
        cv2.rectangle(mosaic, (x0, y0), (x0 + tile_w - 1, y0 + tile_h - 1), (255, 255, 255), 2)
        if paths is not None and i < len(paths):
            cv2.putText(mosaic, Path(paths[i]).name[:40], (x0 + 5, y0 + 5 + 10 * line_width),
                        cv2.FONT_HERSHEY_SIMPLEX, line_width / 3, (220, 220, 220), max(line_width - 1, 1), cv2.LINE_AA)
        rows = targets[targets[:, 0] == i]
        if len(rows):
            _draw_tile_targets(mosaic, rows, (x0, y0), (tile_w, tile_h), scale, names, line_width)
    if fname is not None:
        Path(fname).parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(fname), mosaic)
    return mosaic


def output_to_target(output, max_det: int = 300) -> np.ndarray:
    """NMS output (list of (n, 6) xyxy/conf/cls per image) -> (n, 7) prediction rows for ``plot_images``."""
    rows = []
    for index, det in enumerate(output):
        det = _to_numpy(det)[:max_det]
        image_index = np.full((det.shape[0], 1), index, dtype=np.float32)
        rows.append(np.concatenate((image_index, det[:, 5:6], det[:, :4], det[:, 4:5]), 1))
    return np.concatenate(rows, 0) if rows else np.zeros((0, 7), dtype=np.float32)


def save_one_box(xyxy, img: np.ndarray, file, gain: float = 1.02, pad: int = 10, square: bool = False,
                 save: bool = True) -> np.ndarray:
    """Crop ``xyxy`` (grown by ``gain`` and ``pad`` px, optionally squared) from BGR ``img``; save as a new JPEG.

    The file name is made unique (``crop.jpg``, ``crop2.jpg``, ...) so earlier crops are kept.
    """
    box = xyxy2xywh(torch.as_tensor(xyxy, dtype=torch.float32).view(-1, 4))
    if square:
        box[:, 2:] = box[:, 2:].max(1, keepdim=True).values
    box[:, 2:] = box[:, 2:] * gain + pad
    corners = xywh2xyxy(box)
    clip_boxes(corners, img.shape)
    x1, y1, x2, y2 = corners[0].long().tolist()
    crop = img[y1:y2, x1:x2]
    if save and crop.size:
        path = increment_path(Path(file).with_suffix(".jpg"))
        path.parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(path), crop)
    elif save:
        LOGGER.warning(f"{file}: empty crop for box {list(map(float, xyxy[:4]))}, not saved")
    return crop


class Annotator:
    """YOLOv5's drawing helper for scripts written against it (utils.plots.Annotator): boxes and text drawn in place
    on a contiguous uint8 image (``result()`` returns it). OpenCV's Hershey font, as detect.py draws (a label that is
    not ASCII in an installed font that has its characters, utils/fonts.py); ``pil=True`` (or an ``example`` that is
    not ASCII) draws everything with Pillow: in the TrueType ``font`` when that file exists, else an installed font
    that has ``example``'s characters. Fonts are never downloaded."""

    def __init__(self, im, line_width: int | None = None, font_size: int | None = None, font: str = "Arial.ttf",
                 pil: bool = False, example: str = "abc"):
        if not isinstance(im, np.ndarray) and not pil:
            pil = True  # a PIL image
        if isinstance(im, np.ndarray) and not im.flags.c_contiguous:
            raise ValueError("Annotator: image not contiguous; pass np.ascontiguousarray(im)")
        self.pil = pil or not str(example).isascii()
        shape = im.shape if isinstance(im, np.ndarray) else (im.size[1], im.size[0], 3)
        self.lw = line_width or max(round(sum(shape) / 2 * 0.003), 2)
        if self.pil:
            from PIL import Image, ImageDraw

            self.im = im if isinstance(im, Image.Image) else Image.fromarray(im)
            self.draw = ImageDraw.Draw(self.im)
            self.font_size = font_size or max(round(sum(self.im.size) / 2 * 0.035), 12)
            self.font = _pil_font(font, self.font_size, example)
        else:
            self.im = im

    def box_label(self, box, label: str = "", color=(128, 128, 128), txt_color=(255, 255, 255)) -> None:
        """One box with its label above it (inside the box's top edge when there is no room above)."""
        if not self.pil:
            draw_box_label(self.im, box, label, color, self.lw, txt_color)
            return
        x1, y1, x2, y2 = (float(v) for v in box[:4])
        self.draw.rectangle((x1, y1, x2, y2), width=self.lw, outline=tuple(color))
        if label:
            left, top, right, bottom = self.font.getbbox(label)
            width, height = right - left, bottom - top
            outside = y1 - height >= 0
            top_y = y1 - height if outside else y1
            self.draw.rectangle((x1, top_y, x1 + width + 1, top_y + height + 1), fill=tuple(color))
            self.draw.text((x1, top_y - top), label, fill=tuple(txt_color), font=self.font)

    def rectangle(self, xy, fill=None, outline=None, width: int = 1) -> None:
        if self.pil:
            self.draw.rectangle(xy, fill=fill, outline=outline, width=width)
            return
        (x1, y1), (x2, y2) = ((xy[0], xy[1]), (xy[2], xy[3])) if len(xy) == 4 else xy
        corners = (int(x1), int(y1)), (int(x2), int(y2))
        if fill is not None:
            cv2.rectangle(self.im, *corners, tuple(int(c) for c in fill), -1)
        if outline is not None:
            cv2.rectangle(self.im, *corners, tuple(int(c) for c in outline), width)

    def text(self, xy, text: str, txt_color=(255, 255, 255), anchor: str = "top") -> None:
        """``text`` with its top-left corner at ``xy`` (``anchor="bottom"``: its bottom-left)."""
        if self.pil:
            x, y = xy
            if anchor == "bottom":
                y -= self.font.getbbox(text)[3]
            self.draw.text((x, y), text, fill=tuple(txt_color), font=self.font)
            return
        thickness = max(self.lw - 1, 1)
        if not text.isascii():  # OpenCV's font has ASCII only (utils/fonts.py)
            from utils.fonts import draw_text

            (_, height), _ = cv2.getTextSize("A", cv2.FONT_HERSHEY_SIMPLEX, self.lw / 3, thickness)
            draw_text(self.im, int(xy[0]), int(xy[1]) - height - 2, text, height + 3, txt_color)
            return
        cv2.putText(self.im, text, (int(xy[0]), int(xy[1])), cv2.FONT_HERSHEY_SIMPLEX, self.lw / 3,
                    tuple(int(c) for c in txt_color), thickness=thickness, lineType=cv2.LINE_AA)

    def fromarray(self, im: np.ndarray) -> None:
        """Draw on ``im`` from now on (PIL mode: a copy of it)."""
        if self.pil:
            from PIL import Image, ImageDraw

            self.im = Image.fromarray(im)
            self.draw = ImageDraw.Draw(self.im)
        else:
            self.im = im

    def result(self) -> np.ndarray:
        return np.asarray(self.im)


def _pil_font(font: str, size: int, example: str):
    """The TrueType ``font`` when that file exists, else an installed font that has ``example``'s characters."""
    from PIL import ImageFont

    from utils.fonts import label_font

    if Path(font).is_file():
        try:
            return ImageFont.truetype(str(font), size)
        except OSError as error:
            LOGGER.warning(f"{font}: not a font Pillow can read ({error}); using an installed font")
    return label_font(str(example), size)
