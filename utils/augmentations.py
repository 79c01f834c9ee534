"""YOLOv5's ``utils.augmentations.letterbox``, for scripts written against YOLOv5 (docs/yolov5-scripts.md). The
project's own transforms are in utils/data/transforms.py."""
from __future__ import annotations

import numpy as np

from utils.data.transforms import letterbox as _letterbox


def letterbox(im: np.ndarray, new_shape=(640, 640), color=(114, 114, 114), auto: bool = True, scaleFill: bool = False,
              scaleup: bool = True, stride: int = 32):
    """Resize keeping the aspect ratio and pad to ``new_shape`` (int or (h, w); ``auto``: only to the next multiple
    of ``stride``; ``scaleFill``: stretch, no padding; ``scaleup=False``: never enlarge). Returns
    ``(image, (ratio_w, ratio_h), (pad_w, pad_h))``, the pads per side."""
    return _letterbox(im, new_shape, color, auto, scaleFill, scaleup, stride)
