"""Detection metrics: prediction matching, per-class AP, confusion matrix, fitness.

Conventions (YOLOv5 v7 behaviour, scored the way pycocotools' COCOeval scores):
- ``detections``: (n, 6) tensor ``x1, y1, x2, y2, conf, cls``; ``labels``: (m, 5) tensor ``cls, x1, y1, x2, y2``,
  both in the same pixel space.
- Matching is done at the ten IoU thresholds 0.50:0.05:0.95 (``iou_thresholds``) and gives a boolean
  ``correct`` matrix (n, 10).
- AP is COCO's: the precision envelope sampled at 101 recall points (precision at the first point whose
  recall reaches each sample, 0 past the largest recall) and averaged.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from utils.boxes import bbox_iou, box_iou  # noqa: F401  (bbox_iou: YOLOv5 scripts import it from here)
from utils.curves import class_names, smooth  # noqa: F401  (class_names: imported from here)

LOGGER = logging.getLogger(__name__)

COCO_MAX_DETS = 100  # COCOeval scores at most this many detections per image and class
RECALL_POINTS = np.linspace(0.0, 1.0, 101)  # COCO's recThrs
CURVE_POINTS = 1000  # confidence samples of the P, R and F1 curves


def iou_thresholds(device=None) -> torch.Tensor:
    """The ten IoU thresholds 0.50, 0.55, ..., 0.95 (float64, the values COCOeval uses)."""
    return torch.from_numpy(np.linspace(0.5, 0.95, 10)).to(device)


def _class_masked_iou(detections: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    """(n, m) float64 IoU of each detection with each label, 0 where the classes differ."""
    iou = box_iou(detections[:, :4].double(), labels[:, 1:5].double())
    iou[detections[:, 5:6] != labels[:, 0][None]] = 0.0
    return iou.cpu().numpy()


def match_predictions(detections: torch.Tensor, labels: torch.Tensor, iouv: torch.Tensor) -> torch.Tensor:
    """YOLOv5 v7 matching -> bool (n, len(iouv)).

    Per threshold t: candidate pairs with IoU >= t and the same class; each detection keeps its
    highest-IoU label, then each label keeps the first detection (in detection order, i.e. highest
    confidence for NMS output) among those that chose it. All thresholds are handled at once.
    """
    thresholds = np.asarray(iouv.cpu(), dtype=np.float64)
    correct = np.zeros((len(detections), len(thresholds)), dtype=bool)
    if len(detections) and len(labels):
        iou = _class_masked_iou(detections, labels)
        level, det, lab = np.nonzero(iou[None] >= thresholds[:, None, None])
        value = iou[det, lab]
        order = np.lexsort((-value, level))  # by threshold, then IoU descending
        level, det, lab = level[order], det[order], lab[order]
        first = np.unique(level * len(detections) + det, return_index=True)[1]  # ordered by (t, det)
        level, det, lab = level[first], det[first], lab[first]
        first = np.unique(level * len(labels) + lab, return_index=True)[1]
        correct[det[first], level[first]] = True
    return torch.from_numpy(correct).to(detections.device)


def match_predictions_coco(detections: torch.Tensor, labels: torch.Tensor, iouv: torch.Tensor) -> torch.Tensor:
    """COCOeval matching -> bool (n, len(iouv)): detections in descending confidence each take the
    highest-IoU still-unmatched label of their class with IoU >= t (ties go to the later label).

    Detection/label pairs that compete with nobody are resolved at once; only contested detections
    go through the greedy loop (vectorised over the thresholds).
    """
    thresholds = np.asarray(iouv.cpu(), dtype=np.float64)
    correct = np.zeros((len(detections), len(thresholds)), dtype=bool)
    if len(detections) and len(labels):
        iou = _class_masked_iou(detections, labels)
        candidate = iou >= thresholds[0]
        per_det, per_label = candidate.sum(1), candidate.sum(0)
        isolated = candidate & (per_det[:, None] == 1) & (per_label[None] == 1)
        det, lab = np.nonzero(isolated)
        correct[det] = iou[det, lab][:, None] >= thresholds
        contested = np.nonzero((per_det > 0) & ~isolated.any(1))[0]
        if len(contested):
            conf = detections[contested, 4].cpu().numpy()
            contested = contested[np.argsort(-conf, kind="stable")]
            _greedy_match(iou, contested, thresholds, correct)
    return torch.from_numpy(correct).to(detections.device)


def _greedy_match(iou: np.ndarray, dets: np.ndarray, thresholds: np.ndarray, correct: np.ndarray) -> None:
    levels = np.arange(len(thresholds))
    last = iou.shape[1] - 1
    taken = np.zeros((len(thresholds), iou.shape[1]), dtype=bool)
    for det in dets:
        row = np.where(taken, -1.0, iou[det])[:, ::-1]  # reversed: argmax finds the last best label
        best = last - row.argmax(1)
        hit = row[levels, last - best] >= thresholds
        correct[det] = hit
        taken[levels[hit], best[hit]] = True


def keep_top_per_class(conf: torch.Tensor, cls: torch.Tensor, limit: int = COCO_MAX_DETS) -> torch.Tensor:
    """Bool mask keeping the ``limit`` highest-confidence detections of each class (COCOeval's maxDets)."""
    if len(conf) <= limit:
        return torch.ones(len(conf), dtype=torch.bool, device=conf.device)
    by_conf = torch.argsort(-conf, stable=True)
    by_class = by_conf[torch.argsort(cls[by_conf], stable=True)]  # grouped by class, confidence order within
    sorted_cls = cls[by_class]
    start = torch.searchsorted(sorted_cls.contiguous(), sorted_cls.contiguous(), right=False)
    rank = torch.empty_like(by_class)
    rank[by_class] = torch.arange(len(conf), device=conf.device) - start
    return rank < limit


def coco_ap(recall: np.ndarray, precision: np.ndarray) -> np.ndarray:
    """COCO 101-point AP for each column of (k, T) recall/precision arrays (detections by confidence)."""
    if len(recall) == 0:
        return np.zeros(recall.shape[1:] or (1,))
    envelope = np.flip(np.maximum.accumulate(np.flip(precision, 0), 0), 0)
    ap = np.zeros(recall.shape[1])
    for column in range(recall.shape[1]):
        index = np.searchsorted(recall[:, column], RECALL_POINTS, side="left")
        inside = index < len(recall)
        ap[column] = envelope[index[inside], column].sum() / len(RECALL_POINTS)
    return ap


def yolov5_ap(recall: np.ndarray, precision: np.ndarray) -> np.ndarray:
    """YOLOv5 v7's AP (its val.py; not what this project reports) for each column of (k, T) recall/precision
    arrays: the curve closed with (recall 0, precision 1) and (1, 0), its precision envelope interpolated
    linearly at 101 recall points and integrated with the trapezoid rule. A perfect detector scores 0.995, and
    past the largest recall reached the envelope falls linearly to 0 at recall 1 instead of being 0 there.
    ``benchmarks/metric_rules.py`` scores the same predictions both ways."""
    integrate = getattr(np, "trapezoid", None) or np.trapz  # numpy 2 renamed it (requirements allow 1.24)
    ap = np.zeros(recall.shape[1])
    for column in range(recall.shape[1]):
        closed_recall = np.concatenate(([0.0], recall[:, column], [1.0]))
        closed = np.concatenate(([1.0], precision[:, column], [0.0]))
        envelope = np.flip(np.maximum.accumulate(np.flip(closed)))
        ap[column] = integrate(np.interp(RECALL_POINTS, closed_recall, envelope), RECALL_POINTS)
    return ap


def _pr_curve(recall: np.ndarray, precision: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Precision envelope sampled at ``points`` recall values (the curve COCO integrates)."""
    envelope = np.flip(np.maximum.accumulate(np.flip(precision)))
    index = np.searchsorted(recall, points, side="left")
    return np.where(index < len(recall), envelope[np.minimum(index, len(recall) - 1)], 0.0)


@dataclass
class APResult:
    """Per-class results for the classes present in the labels (``classes``), plus plotting curves. It unpacks as
    YOLOv5's ``ap_per_class`` tuple: ``tp, fp, p, r, f1, ap, ap_class = ap_per_class(...)``."""
    tp: np.ndarray  # (nc,) true positives at the max-F1 confidence
    fp: np.ndarray
    p: np.ndarray  # (nc,) precision at the max-F1 confidence
    r: np.ndarray
    f1: np.ndarray
    ap: np.ndarray  # (nc, 10)
    classes: np.ndarray  # (nc,) int class ids
    px: np.ndarray  # (1000,) confidence / recall samples
    pr_curve: np.ndarray  # (nc, 1000) precision at recall px, IoU 0.5
    p_curve: np.ndarray  # (nc, 1000) precision at confidence px
    r_curve: np.ndarray
    f1_curve: np.ndarray

    def __iter__(self):
        return iter((self.tp, self.fp, self.p, self.r, self.f1, self.ap, self.classes))


def ap_per_class(tp, conf, pred_cls, target_cls, plot: bool = False, save_dir=".", names=(), eps: float = 1e-16,
                 prefix: str = "") -> APResult:
    """Per-class AP at each IoU threshold plus P, R, F1 at the confidence that maximises the mean F1.

    ``tp``: (n, T) bool correct matrix; ``conf``, ``pred_cls``: (n,); ``target_cls``: (m,) label classes.
    The F1 curve is box-filtered over 10% of its points before taking the argmax (YOLOv5 v7). YOLOv5's keywords:
    ``plot`` writes ``{prefix}PR_curve.png``, ``F1_curve.png``, ``P_curve.png`` and ``R_curve.png`` into the
    folder ``save_dir``, the classes named by ``names`` (a list or ``{i: name}``).
    """
    tp, conf, pred_cls = np.asarray(tp), np.asarray(conf), np.asarray(pred_cls)
    order = np.argsort(-conf, kind="stable")
    tp, conf, pred_cls = tp[order], conf[order], pred_cls[order]
    classes, counts = np.unique(np.asarray(target_cls), return_counts=True)
    nc, levels = len(classes), (tp.shape[1] if tp.ndim == 2 else 1)
    px = np.linspace(0, 1, CURVE_POINTS)
    ap, pr_curve = np.zeros((nc, levels)), np.zeros((nc, CURVE_POINTS))
    p_curve, r_curve = np.zeros((nc, CURVE_POINTS)), np.zeros((nc, CURVE_POINTS))
    for ci, cls in enumerate(classes):
        mine = pred_cls == cls
        if not mine.any():
            continue
        tp_sum = tp[mine].cumsum(0, dtype=float).reshape(-1, levels)
        fp_sum = (1 - tp[mine]).cumsum(0, dtype=float).reshape(-1, levels)
        recall = tp_sum / counts[ci]
        precision = tp_sum / (tp_sum + fp_sum)
        r_curve[ci] = np.interp(-px, -conf[mine], recall[:, 0], left=0)
        p_curve[ci] = np.interp(-px, -conf[mine], precision[:, 0], left=1)
        ap[ci] = coco_ap(recall, precision)
        pr_curve[ci] = _pr_curve(recall[:, 0], precision[:, 0], px)
    f1_curve = 2 * p_curve * r_curve / (p_curve + r_curve + eps)
    best = int(smooth(f1_curve.mean(0), 0.1).argmax()) if nc else 0
    p, r, f1 = p_curve[:, best], r_curve[:, best], f1_curve[:, best]
    true_pos = (r * counts).round()
    false_pos = (true_pos / (p + eps) - true_pos).round()
    result = APResult(true_pos, false_pos, p, r, f1, ap, classes.astype(int), px, pr_curve, p_curve, r_curve, f1_curve)
    if plot:
        from utils.plots import plot_ap_curves  # its drawing modules only when plotting

        plot_ap_curves(result, save_dir, names=names or None, prefix=prefix)
    return result


def fitness(metrics) -> np.ndarray:
    """0.1 * mAP50 + 0.9 * mAP50-95 of ``[P, R, mAP50, mAP50-95]`` rows (P and R weigh 0)."""
    weights = np.array([0.0, 0.0, 0.1, 0.9])
    return (np.asarray(metrics, dtype=float)[..., :4] * weights).sum(-1)


class ConfusionMatrix:
    """(nc + 1) x (nc + 1) counts indexed [predicted, true]; the last row/column is background."""

    def __init__(self, nc: int, conf: float = 0.25, iou_thres: float = 0.45):
        self.matrix = np.zeros((nc + 1, nc + 1), dtype=np.int64)
        self.nc, self.conf, self.iou_thres = nc, conf, iou_thres

    def process_batch(self, detections: torch.Tensor | None, labels: torch.Tensor) -> None:
        """Add one image: ``detections`` (n, 6) xyxy conf cls (None when empty), ``labels`` (m, 5) cls xyxy."""
        gt_cls = labels[:, 0].long().cpu().numpy()
        if detections is None or not len(detections):
            np.add.at(self.matrix, (self.nc, gt_cls), 1)
            return
        detections = detections[detections[:, 4] > self.conf]
        det_cls = detections[:, 5].long().cpu().numpy()
        iou = box_iou(labels[:, 1:5], detections[:, :4]).cpu().numpy()  # (m, n)
        lab, det = np.nonzero(iou > self.iou_thres)
        value = iou[lab, det]
        for key in ("det", "lab"):  # highest IoU first, then one match per detection, then per label
            order = np.argsort(-value, kind="stable")
            lab, det, value = lab[order], det[order], value[order]
            keep = np.unique(det if key == "det" else lab, return_index=True)[1]
            lab, det, value = lab[keep], det[keep], value[keep]
        matched_gt = np.zeros(len(gt_cls), dtype=bool)
        matched_gt[lab] = True
        np.add.at(self.matrix, (det_cls[det], gt_cls[lab]), 1)
        np.add.at(self.matrix, (self.nc, gt_cls[~matched_gt]), 1)
        unmatched_det = np.ones(len(det_cls), dtype=bool)
        unmatched_det[det] = False
        np.add.at(self.matrix, (det_cls[unmatched_det], self.nc), 1)

    def tp_fp(self) -> tuple[np.ndarray, np.ndarray]:
        true_pos = self.matrix.diagonal()
        return true_pos[:-1], (self.matrix.sum(1) - true_pos)[:-1]

    def plot(self, normalize: bool = True, save_dir="", names=()) -> None:
        """YOLOv5's: ``confusion_matrix.png`` in ``save_dir``, the classes named by ``names`` (a list)."""
        from utils.plots import plot_confusion_matrix  # its drawing modules only when plotting

        plot_confusion_matrix(self.matrix, Path(save_dir) / "confusion_matrix.png", list(names), normalize)
