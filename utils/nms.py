"""Non-maximum suppression: the one implementation used by validation and detect.

Input is the eval-mode model output ``(batch, N, 5 + nc)``: cx, cy, w, h in input pixels,
objectness, per-class scores. Output is, per image, an ``(n, 6)`` tensor
``x1, y1, x2, y2, confidence, class`` sorted by confidence (highest first), where
confidence = objectness * class score, as in YOLOv5.
"""
from __future__ import annotations

import torch
import torchvision

from utils.boxes import xywh2xyxy

MAX_WH = 7680  # class offset for class-aware NMS in one call; larger than any image side
MAX_NMS = 30000  # candidates per image passed to NMS at most (highest confidence kept)


def _check_thresholds(conf_thres: float, iou_thres: float) -> None:
    if not 0.0 <= conf_thres <= 1.0:
        raise ValueError(f"conf_thres={conf_thres} is invalid: use a value in [0, 1]")
    if not 0.0 <= iou_thres <= 1.0:
        raise ValueError(f"iou_thres={iou_thres} is invalid: use a value in [0, 1]")


def _candidates(rows: torch.Tensor, conf_thres: float, multi_label: bool) -> torch.Tensor:
    """Rows (m, 5 + nc) already past the objectness filter -> (k, 6) candidates above conf_thres.

    Single-label keeps each box's best class; multi-label keeps every (box, class) pair above it.
    """
    boxes = xywh2xyxy(rows[:, :4])
    scores = rows[:, 5:] * rows[:, 4:5]
    if multi_label and scores.shape[1] > 1:
        box_index, class_index = (scores > conf_thres).nonzero(as_tuple=True)
        conf = scores[box_index, class_index]
        return torch.cat((boxes[box_index], conf[:, None], class_index[:, None].to(rows.dtype)), 1)
    conf, class_index = scores.max(1, keepdim=True)
    keep = conf[:, 0] > conf_thres
    return torch.cat((boxes, conf, class_index.to(rows.dtype)), 1)[keep]


def _suppress(det: torch.Tensor, iou_thres: float, agnostic: bool, max_det: int) -> torch.Tensor:
    """Class-aware (or agnostic) NMS of (k, 6) candidates, keeping at most max_det, best first."""
    if det.shape[0] > MAX_NMS:
        det = det[det[:, 4].topk(MAX_NMS).indices]
    # Offsetting boxes by class * MAX_WH puts each class in its own region: one NMS call, no cross-class overlap.
    offsets = 0.0 if agnostic else det[:, 5:6] * MAX_WH
    keep = torchvision.ops.nms(det[:, :4] + offsets, det[:, 4], iou_thres)
    return det[keep[:max_det]]


def non_max_suppression(pred, conf_thres: float = 0.25, iou_thres: float = 0.45, classes=None,
                        agnostic: bool = False, multi_label: bool = False, max_det: int = 300) -> list[torch.Tensor]:
    """Filter and suppress the model's predictions; returns one (n, 6) tensor per image.

    ``pred`` is ``(batch, N, 5 + nc)`` (or the eval-mode ``(pred, raw)`` tuple). Boxes with objectness
    at or below ``conf_thres`` are dropped first (cheap), then (box, class) pairs whose
    confidence = objectness * class score is at or below it. ``classes`` keeps only those class
    indices. NMS is class-aware unless ``agnostic``. At most ``MAX_NMS`` candidates enter NMS and
    ``max_det`` detections come out per image. Output dtype is float32 (float input keeps its dtype).
    """
    _check_thresholds(conf_thres, iou_thres)
    if isinstance(pred, (list, tuple)):
        pred = pred[0]
    if pred.dtype not in (torch.float32, torch.float64):
        pred = pred.float()  # half NMS is not supported on every device
    class_filter = None if classes is None else torch.as_tensor(list(classes), device=pred.device)
    objectness_mask = pred[..., 4] > conf_thres  # whole batch at once
    output = []
    for image_pred, mask in zip(pred, objectness_mask):
        det = _candidates(image_pred[mask], conf_thres, multi_label)
        if class_filter is not None and det.shape[0]:
            det = det[(det[:, 5:6] == class_filter.to(det.dtype)).any(1)]
        if det.shape[0]:
            det = _suppress(det, iou_thres, agnostic, max_det)
        output.append(det)
    return output
