"""Box conversions and IoU variants.

Conventions used across the project:
- ``xyxy``: corners (x1, y1, x2, y2) in pixels.
- ``xywh``: centre, width, height (cx, cy, w, h) in pixels.
- ``xywhn``: centre, width, height normalised by the image width/height (YOLO label format).

Every function accepts a torch tensor or a numpy array and returns the same kind.
"""
from __future__ import annotations

import math

import numpy as np
import torch


def _empty_like(x):
    return x.clone() if isinstance(x, torch.Tensor) else np.copy(x)


def xywh2xyxy(x):
    y = _empty_like(x)
    y[..., 0] = x[..., 0] - x[..., 2] / 2
    y[..., 1] = x[..., 1] - x[..., 3] / 2
    y[..., 2] = x[..., 0] + x[..., 2] / 2
    y[..., 3] = x[..., 1] + x[..., 3] / 2
    return y


def xyxy2xywh(x):
    y = _empty_like(x)
    y[..., 0] = (x[..., 0] + x[..., 2]) / 2
    y[..., 1] = (x[..., 1] + x[..., 3]) / 2
    y[..., 2] = x[..., 2] - x[..., 0]
    y[..., 3] = x[..., 3] - x[..., 1]
    return y


def xywhn2xyxy(x, w: float, h: float, padw: float = 0.0, padh: float = 0.0):
    """Normalised centre boxes -> pixel corners, shifted by the letterbox padding."""
    y = _empty_like(x)
    y[..., 0] = w * (x[..., 0] - x[..., 2] / 2) + padw
    y[..., 1] = h * (x[..., 1] - x[..., 3] / 2) + padh
    y[..., 2] = w * (x[..., 0] + x[..., 2] / 2) + padw
    y[..., 3] = h * (x[..., 1] + x[..., 3] / 2) + padh
    return y


def xyxy2xywhn(x, w: float, h: float, clip: bool = False, eps: float = 0.0):
    """Pixel corners -> normalised centre boxes, optionally clipped to the image first."""
    if clip:
        x = _empty_like(x)
        clip_boxes(x, (h - eps, w - eps))
    y = _empty_like(x)
    y[..., 0] = ((x[..., 0] + x[..., 2]) / 2) / w
    y[..., 1] = ((x[..., 1] + x[..., 3]) / 2) / h
    y[..., 2] = (x[..., 2] - x[..., 0]) / w
    y[..., 3] = (x[..., 3] - x[..., 1]) / h
    return y


def clip_boxes(boxes, shape) -> None:
    """Clip xyxy boxes in place to an image of ``shape`` = (height, width)."""
    height, width = shape[0], shape[1]
    if isinstance(boxes, torch.Tensor):
        boxes[..., 0].clamp_(0, width)
        boxes[..., 1].clamp_(0, height)
        boxes[..., 2].clamp_(0, width)
        boxes[..., 3].clamp_(0, height)
    else:
        boxes[..., [0, 2]] = boxes[..., [0, 2]].clip(0, width)
        boxes[..., [1, 3]] = boxes[..., [1, 3]].clip(0, height)


def scale_boxes(img1_shape, boxes, img0_shape, ratio_pad=None):
    """Map xyxy boxes from a letterboxed image (``img1_shape``) back to the original (``img0_shape``).

    ``ratio_pad`` is ``((ratio_h, ratio_w), (pad_w, pad_h))`` as recorded by the loader (separate gains,
    since the resized size is rounded per axis); when absent it is recomputed for a centred letterbox.
    Boxes are modified in place and returned, clipped to the original image.
    """
    if ratio_pad is None:
        gain = min(img1_shape[0] / img0_shape[0], img1_shape[1] / img0_shape[1])
        gain_h = gain_w = gain
        pad = ((img1_shape[1] - img0_shape[1] * gain) / 2, (img1_shape[0] - img0_shape[0] * gain) / 2)
    else:
        gains = ratio_pad[0] if isinstance(ratio_pad[0], (tuple, list)) else (ratio_pad[0], ratio_pad[0])
        gain_h, gain_w = gains
        pad = ratio_pad[1]
    boxes[..., [0, 2]] -= pad[0]
    boxes[..., [1, 3]] -= pad[1]
    boxes[..., [0, 2]] /= gain_w
    boxes[..., [1, 3]] /= gain_h
    clip_boxes(boxes, img0_shape)
    return boxes


def box_area(boxes: torch.Tensor) -> torch.Tensor:
    return (boxes[:, 2] - boxes[:, 0]).clamp(0) * (boxes[:, 3] - boxes[:, 1]).clamp(0)


def box_iou(box1: torch.Tensor, box2: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Pairwise IoU of xyxy boxes: (N, 4) x (M, 4) -> (N, M)."""
    top_left = torch.max(box1[:, None, :2], box2[None, :, :2])
    bottom_right = torch.min(box1[:, None, 2:], box2[None, :, 2:])
    inter = (bottom_right - top_left).clamp(0).prod(2)
    return inter / (box_area(box1)[:, None] + box_area(box2)[None, :] - inter + eps)


def bbox_iou(box1: torch.Tensor, box2: torch.Tensor, xywh: bool = True, GIoU: bool = False,
             DIoU: bool = False, CIoU: bool = False, eps: float = 1e-7) -> torch.Tensor:
    """Element-wise IoU (or GIoU/DIoU/CIoU) of two broadcastable box sets (..., 4) -> (..., 1)."""
    if xywh:
        (x1, y1, w1, h1), (x2, y2, w2, h2) = box1.chunk(4, -1), box2.chunk(4, -1)
        b1_x1, b1_x2, b1_y1, b1_y2 = x1 - w1 / 2, x1 + w1 / 2, y1 - h1 / 2, y1 + h1 / 2
        b2_x1, b2_x2, b2_y1, b2_y2 = x2 - w2 / 2, x2 + w2 / 2, y2 - h2 / 2, y2 + h2 / 2
    else:
        b1_x1, b1_y1, b1_x2, b1_y2 = box1.chunk(4, -1)
        b2_x1, b2_y1, b2_x2, b2_y2 = box2.chunk(4, -1)
        w1, h1 = b1_x2 - b1_x1, (b1_y2 - b1_y1).clamp(eps)
        w2, h2 = b2_x2 - b2_x1, (b2_y2 - b2_y1).clamp(eps)

    inter = (torch.min(b1_x2, b2_x2) - torch.max(b1_x1, b2_x1)).clamp(0) * \
            (torch.min(b1_y2, b2_y2) - torch.max(b1_y1, b2_y1)).clamp(0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    if not (CIoU or DIoU or GIoU):
        return iou
    enclose_w = torch.max(b1_x2, b2_x2) - torch.min(b1_x1, b2_x1)
    enclose_h = torch.max(b1_y2, b2_y2) - torch.min(b1_y1, b2_y1)
    if CIoU or DIoU:
        diagonal_sq = enclose_w ** 2 + enclose_h ** 2 + eps
        centre_dist_sq = ((b2_x1 + b2_x2 - b1_x1 - b1_x2) ** 2 + (b2_y1 + b2_y2 - b1_y1 - b1_y2) ** 2) / 4
        if CIoU:
            v = (4 / math.pi ** 2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)).pow(2)
            with torch.no_grad():
                alpha = v / (v - iou + (1 + eps))
            return iou - (centre_dist_sq / diagonal_sq + v * alpha)
        return iou - centre_dist_sq / diagonal_sq
    enclose_area = enclose_w * enclose_h + eps
    return iou - (enclose_area - union) / enclose_area
