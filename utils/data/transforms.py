"""Image + label transforms. Each works on (image, labels) or on the image alone; order is set by the dataset."""
from __future__ import annotations

import math

import cv2
import numpy as np


def letterbox(img: np.ndarray, new_shape=640, color=(114, 114, 114), auto: bool = True,
              scale_fill: bool = False, scaleup: bool = True, stride: int = 32):
    """Resize keeping aspect ratio and pad to ``new_shape`` (int or (h, w)).

    ``auto`` pads only to the next multiple of ``stride`` (minimum rectangle, used by detect);
    ``scaleup=False`` never enlarges (used by validation). Returns ``(image, (ratio_w, ratio_h), (pad_w, pad_h))``
    where pads are per side (half the total), as needed by ``utils.boxes.scale_boxes``.
    """
    shape = img.shape[:2]
    if isinstance(new_shape, int):
        new_shape = (new_shape, new_shape)
    ratio = min(new_shape[0] / shape[0], new_shape[1] / shape[1])
    if not scaleup:
        ratio = min(ratio, 1.0)
    ratios = (ratio, ratio)
    new_unpad = (int(round(shape[1] * ratio)), int(round(shape[0] * ratio)))  # (w, h)
    dw, dh = new_shape[1] - new_unpad[0], new_shape[0] - new_unpad[1]
    if auto:
        dw, dh = np.mod(dw, stride), np.mod(dh, stride)
    elif scale_fill:
        dw, dh = 0.0, 0.0
        new_unpad = (new_shape[1], new_shape[0])
        ratios = (new_shape[1] / shape[1], new_shape[0] / shape[0])
    dw, dh = dw / 2, dh / 2
    if shape[::-1] != new_unpad:
        img = cv2.resize(img, new_unpad, interpolation=cv2.INTER_LINEAR)
    top, bottom = int(round(dh - 0.1)), int(round(dh + 0.1))
    left, right = int(round(dw - 0.1)), int(round(dw + 0.1))
    if top or bottom or left or right:
        img = cv2.copyMakeBorder(img, top, bottom, left, right, cv2.BORDER_CONSTANT, value=color)
    return img, ratios, (dw, dh)


def make_divisible(x: float, divisor: int) -> int:
    return int(math.ceil(x / divisor) * divisor)
