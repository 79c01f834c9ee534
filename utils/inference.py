"""One image through a detector, shared by detect.py and the torch.hub model (utils/hub.py).

    tensor = prepare_image(image_bgr, imgsz, stride, device, half, auto)   # letterboxed (1, 3, h, w) in [0, 1]
    output = forward(model, tensor, autocast)                               # channels_last input, inference mode
    det = select_detections(output, tensor.shape[2:], [image_bgr.shape], ...)[0]  # NMS, boxes in original pixels

``det`` rows are ``x1, y1, x2, y2, confidence, class`` with the box rounded to whole pixels of the original
image; ``as_detections(det, names)`` gives them as ``Detection`` tuples, ``label_lines`` as detect.py --save-txt
lines and ``prediction_rows`` as its --save-csv rows (both in ``det``'s order). ``input_size(model, imgsz)`` is the
letterbox size for a model (rounded up to its stride; a static-shape export keeps its own size).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from utils.boxes import scale_boxes, xyxy2xywh
from utils.data.transforms import letterbox
from utils.errors import UserError
from utils.nms import non_max_suppression

LOGGER = logging.getLogger(__name__)
LABEL_FORMATS = {0: "YOLO", 1: "Pascal-VOC"}  # detect.py --save-format: normalised cx cy w h, or x1 y1 x2 y2
CSV_HEADER = ("Image Name", "Prediction", "Confidence")  # detect.py --save-csv's predictions.csv, as YOLOv5's


class InferenceError(UserError):
    """An input size or image that the model cannot take; one line naming it."""


class Detection(NamedTuple):
    """One detected object: box corners in the original image's pixels, confidence, class index and name."""
    xyxy: tuple[float, float, float, float]
    score: float
    class_id: int
    name: str


def check_image_size(imgsz, stride: int, option: str = "--imgsz") -> tuple[int, int]:
    """(h, w) from one or two sizes, each rounded up to a multiple of ``stride`` (with a warning when changed)."""
    sizes = [int(s) for s in imgsz]
    sizes = sizes * 2 if len(sizes) == 1 else sizes[:2]
    if min(sizes) <= 0:
        raise InferenceError(f"{option} {imgsz}: sizes must be positive")
    rounded = tuple(max(int(np.ceil(s / stride) * stride), stride) for s in sizes)
    if rounded != tuple(sizes):
        LOGGER.warning(f"{option} {sizes} must be a multiple of max stride {stride}, updating to {list(rounded)}")
    return rounded


def input_size(model, imgsz, option: str = "--imgsz") -> tuple[tuple[int, int], bool]:
    """(letterbox size, minimal-padding letterbox?): a static-shape export takes exactly its own size."""
    if model.imgsz is None:
        return check_image_size(imgsz, model.stride, option), True
    if tuple(imgsz) != tuple(model.imgsz):
        LOGGER.warning(f"{Path(model.path).name} was exported for {model.imgsz[0]}x{model.imgsz[1]} inputs; "
                       f"using that instead of {option} {imgsz[0]} {imgsz[1]} (export with --dynamic for any size)")
    return tuple(model.imgsz), False


def prepare_image(image: np.ndarray, imgsz, stride: int, device, half: bool, auto: bool = True) -> torch.Tensor:
    """BGR HxWx3 uint8 -> letterboxed RGB (1, 3, h, w) float in [0, 1] on ``device``; ``auto``: pad only to a
    multiple of ``stride`` (else exactly ``imgsz``)."""
    boxed = letterbox(image, imgsz, stride=stride, auto=auto)[0]
    array = np.ascontiguousarray(boxed[:, :, ::-1].transpose(2, 0, 1))
    tensor = torch.from_numpy(array).to(device)
    tensor = tensor.half() if half else tensor.float()
    return (tensor / 255)[None]


def forward(model, images: torch.Tensor, autocast):
    """The model's output for a (B, 3, h, w) batch: inference mode, channels_last input, inside ``autocast``."""
    with torch.inference_mode(), autocast:
        return model(images.contiguous(memory_format=torch.channels_last))


def select_detections(output, input_shape, original_shapes, conf_thres: float = 0.25, iou_thres: float = 0.45,
                      classes=None, agnostic: bool = False, max_det: int = 1000,
                      multi_label: bool = False, round_boxes: bool = True) -> list[torch.Tensor]:
    """NMS, then each image's boxes mapped from the letterboxed ``input_shape`` (h, w) back to its original
    (h, w[, c]) shape, rounded to whole pixels as detect.py's (unless ``round_boxes`` is False, as the hub
    model's); one (n, 6) tensor per image."""
    detections = non_max_suppression(output, conf_thres, iou_thres, classes, agnostic, multi_label=multi_label,
                                     max_det=max_det)
    for det, shape in zip(detections, original_shapes):
        boxes = scale_boxes(input_shape, det[:, :4], shape[:2])
        det[:, :4] = boxes.round() if round_boxes else boxes
    return detections


def class_name(names, cls) -> str:
    index = int(cls)
    return names[index] if 0 <= index < len(names) else str(index)


def describe(det: torch.Tensor, names) -> str:
    """'2 RBCs, 1 WBC, ' (per class counts, class order)."""
    text = ""
    for cls in det[:, 5].unique():
        count = int((det[:, 5] == cls).sum())
        name = class_name(names, cls)
        text += f"{count} {name}{'s' * (count > 1 and not name.endswith('s'))}, "
    return text


def as_detections(det: torch.Tensor, names) -> list[Detection]:
    """(n, 6) rows -> Detection tuples (plain Python numbers)."""
    return [Detection(tuple(row[:4]), row[4], int(row[5]), class_name(names, row[5])) for row in det.tolist()]


def label_lines(det: torch.Tensor, shape, save_conf: bool = False, save_format: int = 0) -> list[str]:
    """One text line per row of ``det``: class and box normalised to the original (h, w[, c]) ``shape``, as
    ``%g`` numbers: YOLO ``cx cy w h`` (``save_format`` 0) or Pascal-VOC corners ``x1 y1 x2 y2`` (1); then the
    confidence with ``save_conf``."""
    if save_format not in LABEL_FORMATS:
        raise ValueError(f"save_format {save_format}: expected one of {sorted(LABEL_FORMATS)}")
    gain = torch.tensor(shape)[[1, 0, 1, 0]].float()
    boxes = det[:, :4].float()
    boxes = (xyxy2xywh(boxes) if save_format == 0 else boxes) / gain
    lines = []
    for box, (conf, cls) in zip(boxes.tolist(), det[:, 4:6].tolist()):
        values = (int(cls), *box, conf) if save_conf else (int(cls), *box)
        lines.append(("%g " * len(values)).rstrip() % values + "\n")
    return lines


def prediction_rows(image_name: str, det: torch.Tensor, names) -> list[tuple[str, str, str]]:
    """One (image name, class name, confidence with 2 decimals) row per row of ``det`` (``CSV_HEADER``'s columns)."""
    return [(image_name, class_name(names, cls), f"{conf:.2f}") for conf, cls in det[:, 4:6].tolist()]
