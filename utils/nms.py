"""Non-maximum suppression: the one implementation used by validation and detect.

Input is the eval-mode model output ``(batch, N, 5 + nc)``: cx, cy, w, h in input pixels,
objectness, per-class scores. Output is, per image, an ``(n, 6)`` tensor
``x1, y1, x2, y2, confidence, class`` sorted by confidence (highest first), where
confidence = objectness * class score, as in YOLOv5.
"""
from __future__ import annotations

import functools
import importlib.machinery
import importlib.metadata
import importlib.util
import math
import os
import re

import torch

from utils.boxes import xywh2xyxy

MAX_NMS = 30000  # candidates per image passed to NMS at most (highest confidence kept)
NMS_CHUNK = 256  # candidates in the first greedy-NMS chunk at least (see _greedy_nms)
NMS_GROWTH = 2  # a further chunk is at most this many times the previous one
NMS_MIN_CHUNK = 32  # and at least this many candidates
# The (torch, torchvision) releases whose operator library NMS loads without importing torchvision: torchvision's
# compatibility table (its README) pairs torch 2.N with torchvision 0.(N + 15); listed up to torch 2.14 /
# torchvision 0.29, the pair requirements.txt pins. Any other pair (or one without metadata) imports torchvision.
TORCHVISION_FOR_TORCH = {(2, minor): (0, minor + 15) for minor in range(15)}


def _check_thresholds(conf_thres: float, iou_thres: float) -> None:
    if not 0.0 <= conf_thres <= 1.0:
        raise ValueError(f"conf_thres={conf_thres} is invalid: use a value in [0, 1]")
    if not 0.0 <= iou_thres <= 1.0:
        raise ValueError(f"iou_thres={iou_thres} is invalid: use a value in [0, 1]")


def _candidates(rows: torch.Tensor, conf_thres: float, multi_label: bool):
    """Rows (m, 5 + nc) past the objectness filter -> (row index, confidence, class) above conf_thres.

    Single-label keeps each box's best class; multi-label keeps every (box, class) pair above it.
    """
    scores = rows[:, 5:] * rows[:, 4:5]
    if multi_label and scores.shape[1] > 1:
        row_index, class_index = (scores > conf_thres).nonzero(as_tuple=True)
        return row_index, scores[row_index, class_index], class_index
    conf, class_index = scores.max(1)
    row_index = (conf > conf_thres).nonzero().squeeze(1)
    return row_index, conf[row_index], class_index[row_index]


def _best_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores, best first, equal scores in index order: a stable sort's first
    ``k``, without sorting the rest (a 12,000-candidate image: 0.07 ms for the best 300, 0.6 ms for all)."""
    if k >= scores.shape[0]:
        return scores.argsort(descending=True, stable=True)
    kth = scores.topk(k, sorted=False).values.min()
    index = (scores >= kth).nonzero().squeeze(1)  # ascending: equal scores stay in index order
    return index[scores[index].argsort(descending=True, stable=True)[:k]]


def _release(version: str) -> tuple[int, int] | None:
    """major.minor of a version string ('2.14.1+cu130' -> (2, 14)); None when it does not start that way."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def _library_name() -> str | None:
    """The name of torchvision's operator library (``_C_stable`` since 0.29, ``_C`` before) when the installed
    torch and torchvision (their package metadata) are a pair in TORCHVISION_FOR_TORCH; else None."""
    try:
        torch_release, torchvision_release = (_release(importlib.metadata.version(name))
                                              for name in ("torch", "torchvision"))
    except (ImportError, ValueError):  # PackageNotFoundError: no metadata
        return None
    if torch_release is None or TORCHVISION_FOR_TORCH.get(torch_release) != torchvision_release:
        return None
    return "_C_stable" if torchvision_release >= (0, 29) else "_C"


def _torchvision_library() -> str | None:
    """The file of torchvision's operator library to load directly: only for a known pair (``_library_name``),
    and only from the torchvision package Python would import when it is the distribution whose version was
    read. Else None: import the package."""
    name = _library_name()
    if name is None:
        return None
    try:
        distributed = importlib.metadata.distribution("torchvision").locate_file("torchvision")
        spec = importlib.util.find_spec("torchvision")
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        if not folders or not os.path.samefile(folders[0], distributed):
            return None
        loader = (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES)
        found = importlib.machinery.FileFinder(folders[0], loader).find_spec(name)
    except (ImportError, OSError, ValueError):  # metadata gone since, a folder that does not exist
        return None
    return found.origin if found is not None and found.origin else None


@functools.lru_cache(maxsize=1)
def _torchvision_nms():
    """torchvision's compiled NMS operator (``torchvision::nms``). Its library is loaded without importing the
    torchvision package where ``_torchvision_library`` finds it: that import takes ~1.3-1.8 s (torch._dynamo,
    through torchvision.ops), paid by every validation, detect.py run and training otherwise. For another
    (torch, torchvision) pair, or where the library cannot be found or loaded that way, the package is imported
    and its own operator used."""
    try:
        library = _torchvision_library()
        if library is not None:
            torch.ops.load_library(library)
            return torch.ops.torchvision.nms
    except (OSError, RuntimeError, AttributeError):
        pass
    import torchvision

    return torchvision.ops.nms


def _batched_nms(nms_op, boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor,
                 iou_thres: float) -> torch.Tensor:
    """Class-aware NMS as torchvision.ops.batched_nms computes it (the kept indices, in any order): one NMS per
    class above 4,000 box coordinates on the CPU (20,000 elsewhere), else one NMS over boxes moved apart by
    class (each class offset by the largest coordinate + 1)."""
    if boxes.numel() > (4000 if boxes.device.type == "cpu" else 20000):
        keep = torch.zeros_like(scores, dtype=torch.bool)
        for cls in torch.unique(classes):
            members = torch.where(classes == cls)[0]
            keep[members[nms_op(boxes[members], scores[members], iou_thres)]] = True
        return torch.where(keep)[0]
    if boxes.numel() == 0:
        return torch.empty((0,), dtype=torch.int64, device=boxes.device)
    offsets = classes.to(boxes) * (boxes.max() + torch.tensor(1).to(boxes))
    return nms_op(boxes + offsets[:, None], scores, iou_thres)


def _greedy_nms(boxes: torch.Tensor, scores: torch.Tensor, iou_thres: float, max_det: int,
                classes: torch.Tensor | None = None) -> torch.Tensor:
    """Indices kept by greedy NMS, best first, equal scores in candidate order (as one pass of torchvision's
    NMS, whose sort is stable), stopping early once ``max_det`` boxes are kept; class-aware when ``classes``
    is given (boxes of different classes never suppress each other).

    Candidates go through NMS in chunks, best first: the first holds ``max(max_det, NMS_CHUNK)``; while fewer
    than ``max_det`` boxes survive, the next chunk follows with the boxes kept so far placed first (rank
    +inf), so that they suppress it. Its cost stops growing at ``max_det`` kept boxes. A further chunk holds
    about 1.5x the candidates that should give the boxes still wanted at the survival rate so far, at least
    ``NMS_MIN_CHUNK``, at most ``NMS_GROWTH`` times the previous one. On BCCD val (yolov5n, 320, conf 0.001,
    max_det 300, 87 images, a 2-core Xeon), against chunks doubling each time: a model after 2 epochs (90% of
    the first chunk survive) 0.94 instead of 1.62 ms per image (fp32), after 4 epochs 1.33 instead of 2.26
    (bf16); a trained one (~4,500 candidates, most suppressed) 2.21 against 2.15 (the stable order's cost).
    """
    nms_op = _torchvision_nms()

    def nms(index: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        """Greedy NMS of boxes[index] ranked by ``ranks``: the positions in ``index`` kept, in ascending order
        (class by class as torchvision's batched_nms, which on CPU compares only boxes of one class)."""
        if classes is None:
            kept = nms_op(boxes[index], ranks, iou_thres)
        else:
            kept = _batched_nms(nms_op, boxes[index], ranks, classes[index], iou_thres)
        # ``index`` is in rank order (kept boxes, then candidates best first), so ascending positions are the
        # stable order
        return kept.sort().values

    candidates = min(scores.shape[0], MAX_NMS)
    keep = order = scores.new_zeros(0, dtype=torch.long)
    chunk = max(NMS_CHUNK, min(max_det, MAX_NMS))
    start = 0
    while start < candidates and keep.shape[0] < max_det:
        if start:
            wanted = max_det - keep.shape[0]
            estimate = math.ceil(1.5 * wanted * start / max(keep.shape[0], 1))
            chunk = min(max(estimate, NMS_MIN_CHUNK), NMS_GROWTH * chunk)
        needed = min(start + chunk, candidates)
        if order.shape[0] < needed:  # a partial sort while few are needed, then all
            order = _best_first(scores, needed if 8 * needed < scores.shape[0] else candidates)
        new = order[start:start + chunk]
        start += chunk
        index = torch.cat((keep, new))
        ranks = torch.cat((torch.full_like(scores[keep], float("inf")), scores[new]))
        survivors = nms(index, ranks)
        # the kept boxes survive (they do not overlap each other); the new survivors follow, best first
        keep = torch.cat((keep, index[survivors[survivors >= keep.shape[0]]]))
    return keep[:max_det]


def non_max_suppression(pred, conf_thres: float = 0.25, iou_thres: float = 0.45, classes=None,
                        agnostic: bool = False, multi_label: bool = False, max_det: int = 300,
                        labels=None) -> list[torch.Tensor]:
    """Filter and suppress the model's predictions; returns one (n, 6) tensor per image.

    ``pred`` is ``(batch, N, 5 + nc)`` (or the eval-mode ``(pred, raw)`` tuple). Boxes with objectness
    at or below ``conf_thres`` are dropped first (cheap), then (box, class) pairs whose
    confidence = objectness * class score is at or below it. ``classes`` keeps only those class
    indices. NMS is class-aware unless ``agnostic``. At most ``MAX_NMS`` candidates enter NMS and
    ``max_det`` detections come out per image. Output dtype is float32 (float input keeps its dtype).
    ``labels`` (val.py --save-hybrid, YOLOv5's autolabelling): per image, ground-truth rows (k, 5) ``class, cx, cy, w,
    h`` in input pixels that join that image's candidates with confidence 1, after its predictions.
    """
    _check_thresholds(conf_thres, iou_thres)
    if isinstance(pred, (list, tuple)):
        pred = pred[0]
    if pred.dtype not in (torch.float32, torch.float64):
        pred = pred.float()  # half NMS is not supported on every device
    class_filter = None if classes is None else torch.as_tensor(list(classes), device=pred.device)
    objectness_mask = pred[..., 4] > conf_thres  # whole batch at once
    output = []
    for image, (image_pred, mask) in enumerate(zip(pred, objectness_mask)):
        rows = image_pred[mask]
        row_index, conf, class_index = _candidates(rows, conf_thres, multi_label)
        xywh = rows[row_index, :4]
        if labels is not None and len(labels[image]):
            truth = labels[image].to(xywh)
            xywh = torch.cat((xywh, truth[:, 1:5]))
            conf = torch.cat((conf, torch.ones_like(truth[:, 0])))
            class_index = torch.cat((class_index, truth[:, 0].long()))
        if class_filter is not None:
            wanted = (class_index[:, None] == class_filter).any(1)
            xywh, conf, class_index = xywh[wanted], conf[wanted], class_index[wanted]
        boxes = xywh2xyxy(xywh)
        if conf.shape[0]:
            keep = _greedy_nms(boxes, conf, iou_thres, max_det, None if agnostic else class_index)
            boxes, conf, class_index = boxes[keep], conf[keep], class_index[keep]
        output.append(torch.cat((boxes, conf[:, None], class_index[:, None].to(boxes.dtype)), 1))
    return output
