"""One model's predictions scored by this project's rule (pycocotools' COCOeval) and by YOLOv5 v7's val.py rule.

val.py reports COCOeval's mAP (greedy matching in confidence order, at most 100 detections per image and class, the
precision envelope read at 101 recall points and 0 past the largest recall reached). YOLOv5 v7's val.py scores the
same predictions otherwise: each label goes to the highest-IoU detection, no cap, and the envelope interpolated
between the closed curve's points (0, 1) ... (1, 0) and integrated (``utils.metrics.yolov5_ap``). So the two
programs' printed mAPs differ on identical predictions; comparing their results.csv compares two rules as well as
two trainings. This script runs val.py once (``--save-json``: the predictions and the labels as COCO JSON) and
scores that file both ways.

    python benchmarks/metric_rules.py --weights runs/train/exp/weights/best.pt --data data.yaml --imgsz 320
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _xyxy(box) -> list[float]:
    x, y, w, h = box
    return [x, y, x + w, y + h]


def yolov5_rule(predictions: list[dict], truth: dict) -> tuple[float, float]:
    """(mAP50, mAP50-95) of COCO-format ``predictions`` against the COCO ground truth ``truth``, by YOLOv5 v7's
    rule: per image, detections in descending confidence matched by ``utils.metrics.match_predictions`` (a label
    to its highest-IoU detection), every detection counted; per class, AP by ``yolov5_ap``; the mean over the
    classes that have labels (0 for a class never detected)."""
    from utils.metrics import iou_thresholds, match_predictions, yolov5_ap

    labels, detections = defaultdict(list), defaultdict(list)
    for annotation in truth["annotations"]:
        labels[annotation["image_id"]].append([annotation["category_id"], *_xyxy(annotation["bbox"])])
    for prediction in predictions:
        detections[prediction["image_id"]].append([*_xyxy(prediction["bbox"]), prediction["score"],
                                                   prediction["category_id"]])
    iouv = iou_thresholds()
    correct, scores, classes, target = [], [], [], []
    for image in truth["images"]:
        image_labels = torch.tensor(labels[image["id"]], dtype=torch.float64).reshape(-1, 5)
        image_dets = torch.tensor(detections[image["id"]], dtype=torch.float64).reshape(-1, 6)
        image_dets = image_dets[torch.argsort(-image_dets[:, 4], stable=True)]  # NMS output order
        correct.append(match_predictions(image_dets, image_labels, iouv).numpy())
        scores.append(image_dets[:, 4].numpy())
        classes.append(image_dets[:, 5].numpy())
        target.append(image_labels[:, 0].numpy())
    tp, conf, pred_cls, target_cls = (np.concatenate(x) for x in (correct, scores, classes, target))
    order = np.argsort(-conf, kind="stable")
    tp, pred_cls = tp[order].reshape(-1, len(iouv)), pred_cls[order]
    per_class = []
    for cls, count in zip(*np.unique(target_cls, return_counts=True)):
        hits = tp[pred_cls == cls].astype(np.float64)
        if not len(hits):
            per_class.append(np.zeros(len(iouv)))
            continue
        true_pos, false_pos = hits.cumsum(0), (1 - hits).cumsum(0)
        per_class.append(yolov5_ap(true_pos / (count + 1e-16), true_pos / (true_pos + false_pos)))
    ap = np.array(per_class).reshape(-1, len(iouv))
    return (float(ap[:, 0].mean()), float(ap.mean(1).mean())) if len(ap) else (0.0, 0.0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)

    import val

    with tempfile.TemporaryDirectory() as folder:
        result = val.run(data=args.data, weights=args.weights, imgsz=args.imgsz, batch_size=args.batch_size,
                         device=args.device, workers=args.workers, save_json=True, plots=False,
                         project=Path(folder), name="val")
        predictions = json.loads((result.save_dir / f"{Path(args.weights).stem}_predictions.json").read_text())
        truth = json.loads((result.save_dir / "annotations.json").read_text())
    map50, map5095 = yolov5_rule(predictions, truth)
    print(f"{args.weights} on {args.data} at {args.imgsz}: {result.seen} images, {len(predictions)} predictions")
    print(f"| rule | mAP50 | mAP50-95 |\n|---|---|---|\n| this project's val.py (COCOeval) | {result.map50:.4f} | "
          f"{result.map:.4f} |")
    if result.coco is not None:
        print(f"| pycocotools on the same JSON | {result.coco[1]:.4f} | {result.coco[0]:.4f} |")
    print(f"| YOLOv5 v7's val.py rule on the same JSON | {map50:.4f} | {map5095:.4f} |")
    print(f"YOLOv5's rule - this project's: mAP50 {map50 - result.map50:+.4f}, mAP50-95 {map5095 - result.map:+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
