"""COCO-format JSON for predictions and ground truth, and optional scoring with pycocotools.

- Predictions: a list of ``{"image_id", "category_id", "bbox": [x, y, w, h], "score"}`` with the box's
  top-left corner and size in original-image pixels (3 decimals), the score to 5 decimals.
- Ground truth: a COCO annotations dict (``images`` with width/height, ``categories``, ``annotations``
  with ``area = w * h``, ``iscrowd = 0`` and ids from 1) so pycocotools scores a run with no other input.
Image ids come from file stems (ints when every stem is a number), see ``image_ids``.
pycocotools is optional: ``coco_evaluate`` returns None when it is not installed.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from utils.boxes import xywhn2xyxy, xyxy2xywh

LOGGER = logging.getLogger(__name__)

# COCO 2017's detection categories: ids 1-90, of which these ten name no category; class index i of an 80-class
# COCO model is the i-th of the rest (what YOLOv5 writes as category_id for COCO's val2017)
UNUSED_COCO_IDS = frozenset((12, 26, 29, 30, 45, 66, 68, 69, 71, 83))
COCO_CATEGORY_IDS = tuple(i for i in range(1, 91) if i not in UNUSED_COCO_IDS)


@dataclass(frozen=True)
class CocoVal:
    """COCO's val2017, recognised as YOLOv5 recognises it (``coco_val``): the predictions JSON takes COCO's category
    ids, and pycocotools scores it against the official ``annotations`` when that file is there (crowd regions
    ignored, as on COCO's server), on this split's images only."""
    annotations: Path
    category_ids: tuple = COCO_CATEGORY_IDS


def coco_val(config) -> CocoVal | None:
    """A CocoVal for a dataset config (``DataConfig``) whose val split is COCO's: one list file ending in
    ``coco/val2017.txt`` (YOLOv5's test) and 80 classes; the official annotations are looked for at
    ``<path>/annotations/instances_val2017.json``. None for any other dataset."""
    val = config.val
    if len(val) != 1 or not Path(val[0]).as_posix().endswith("coco/val2017.txt") or len(config.names) != 80:
        return None
    return CocoVal(Path(config.path) / "annotations" / "instances_val2017.json")


def image_ids(paths) -> dict[str, int | str]:
    """File path -> COCO image id: the stem as an int when all stems are numbers, else the stem.

    Duplicate stems (same name in two folders or with two extensions) fall back to the path string.
    """
    paths = [str(p) for p in paths]
    stems = [Path(p).stem for p in paths]
    if len(set(stems)) != len(stems):
        return {p: p for p in paths}
    numeric = all(s.isdigit() for s in stems)
    return {p: int(s) if numeric else s for p, s in zip(paths, stems)}


def image_id(path) -> int | str:
    """COCO image id of one file: its stem, as an int when numeric."""
    stem = Path(path).stem
    return int(stem) if stem.isdigit() else stem


def predictions_to_coco(predictions, image, category_ids=None) -> list[dict]:
    """(n, 6) xyxy conf cls predictions in original pixels for one image -> COCO result dicts.

    ``image`` is the image id; ``category_ids`` optionally maps class index -> category id.
    """
    predictions = np.asarray(predictions.cpu() if hasattr(predictions, "cpu") else predictions, dtype=np.float64)
    if not len(predictions):
        return []
    boxes = xyxy2xywh(predictions[:, :4])
    boxes[:, :2] -= boxes[:, 2:] / 2  # centre -> top-left corner
    results = []
    for box, score, cls in zip(boxes.tolist(), predictions[:, 4].tolist(), predictions[:, 5].tolist()):
        category = category_ids[int(cls)] if category_ids is not None else int(cls)
        results.append({"image_id": image, "category_id": category,
                        "bbox": [round(v, 3) for v in box], "score": round(score, 5)})
    return results


def ground_truth_to_coco(im_files, labels, shapes, names, single_cls: bool = False, category_ids=None) -> dict:
    """Dataset labels -> COCO annotations dict.

    ``labels[i]``: (n, 5) ``[class, cx, cy, w, h]`` normalised to image i; ``shapes[i]``: (width, height)
    of the original image; ``names``: class names (list or {index: name}).
    """
    names = dict(enumerate(names)) if isinstance(names, (list, tuple)) else dict(names)
    ids = image_ids(im_files)
    category = (lambda c: category_ids[c]) if category_ids is not None else (lambda c: c)
    images, annotations = [], []
    for path, image_labels, (width, height) in zip(im_files, labels, shapes):
        key = ids[str(path)]
        images.append({"id": key, "file_name": Path(path).name, "width": int(width), "height": int(height)})
        image_labels = np.asarray(image_labels, dtype=np.float64).reshape(-1, 5)
        corners = xywhn2xyxy(image_labels[:, 1:5], float(width), float(height))
        for cls, (x1, y1, x2, y2) in zip(image_labels[:, 0].tolist(), corners.tolist()):
            w, h = x2 - x1, y2 - y1
            annotations.append({"id": len(annotations) + 1, "image_id": key,
                                "category_id": category(0 if single_cls else int(cls)),
                                "bbox": [x1, y1, w, h], "area": w * h, "iscrowd": 0})
    categories = [{"id": category(i), "name": str(name)} for i, name in sorted(names.items())]
    return {"info": {"description": "ground truth written by val.py"}, "images": images,
            "annotations": annotations, "categories": categories}


def write_json(data, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        json.dump(data, handle)
    return path


def coco_evaluate(annotations_json, predictions_json, image_list=None):
    """Score predictions with pycocotools' COCOeval (bbox).

    Returns ``(map50_95, map50, summary_text)`` or None when pycocotools is not installed or there are no
    predictions. ``image_list`` restricts the evaluation to those image ids.
    """
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError:
        LOGGER.info("pycocotools not installed: skipping COCO scoring of %s", predictions_json)
        return None
    with open(predictions_json) as handle:
        if not json.load(handle):
            LOGGER.warning("no predictions in %s: nothing for pycocotools to score", predictions_json)
            return None
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        truth = COCO(str(annotations_json))
        result = truth.loadRes(str(predictions_json))
        evaluator = COCOeval(truth, result, "bbox")
        if image_list is not None:
            evaluator.params.imgIds = list(image_list)
        evaluator.evaluate()
        evaluator.accumulate()
    with contextlib.redirect_stdout(io.StringIO()) as summary:
        evaluator.summarize()
    return float(evaluator.stats[0]), float(evaluator.stats[1]), summary.getvalue()
