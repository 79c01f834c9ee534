"""Metrics: matching, AP on hand-made cases, confusion matrix, COCO JSON, pycocotools agreement, plots."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from utils.boxes import xyxy2xywhn
from utils.coco import coco_evaluate, ground_truth_to_coco, image_ids, predictions_to_coco, write_json
from utils.metrics import (ConfusionMatrix, ap_per_class, coco_ap, fitness, iou_thresholds, keep_top_per_class,
                           match_predictions, match_predictions_coco, yolov5_ap)

IOUV = iou_thresholds()


def shifted(box, iou):
    """A box of the same size shifted right so that its IoU with ``box`` is exactly ``iou``."""
    x1, y1, x2, y2 = box
    width = x2 - x1
    overlap = 2 * iou * width / (1 + iou)  # inter / (2w - inter) = iou, heights equal
    dx = width - overlap
    return [x1 + dx, y1, x2 + dx, y2]


def evaluate(images, match=match_predictions_coco):
    """images: list of (detections (n,6) xyxy conf cls, labels (m,5) cls xyxy) -> APResult."""
    stats = []
    for det, lab in images:
        det, lab = torch.tensor(det, dtype=torch.float32).reshape(-1, 6), torch.tensor(lab).reshape(-1, 5).float()
        stats.append((match(det, lab, IOUV).numpy(), det[:, 4].numpy(), det[:, 5].numpy(), lab[:, 0].numpy()))
    tp, conf, pred_cls, target_cls = (np.concatenate(x) for x in zip(*stats))
    return ap_per_class(tp, conf, pred_cls, target_cls)


def test_perfect_predictions_give_map_one():
    labels = [[0, 10, 10, 50, 60], [1, 100, 100, 200, 180], [0, 300, 20, 340, 90]]
    dets = [[*lab[1:], 0.9 - 0.1 * i, lab[0]] for i, lab in enumerate(labels)]
    result = evaluate([(dets, labels)])
    assert np.allclose(result.ap, 1.0)
    assert np.allclose(result.p, 1.0) and np.allclose(result.r, 1.0)
    assert result.classes.tolist() == [0, 1]


@pytest.mark.parametrize("match", [match_predictions, match_predictions_coco])
def test_shifted_boxes_known_ap_per_threshold(match):
    box = [100.0, 100.0, 200.0, 150.0]
    det = [*shifted(box, 0.72), 0.8, 0]
    result = evaluate([([det], [[0, *box]])], match)
    expected = (IOUV.numpy() <= 0.72).astype(float)  # thresholds 0.50 .. 0.70 pass, 0.75 .. 0.95 fail
    assert np.allclose(result.ap[0], expected)
    assert result.ap.mean() == pytest.approx(5 / 10)
    assert result.ap[:, 0].mean() == pytest.approx(1.0)


def test_half_correct_case_by_hand():
    # two labels of class 0; detections: correct (0.9), false positive (0.8), correct (0.7)
    labels = [[0, 0, 0, 10, 10], [0, 50, 50, 60, 60]]
    dets = [[0, 0, 10, 10, 0.9, 0], [200, 200, 210, 210, 0.8, 0], [50, 50, 60, 60, 0.7, 0]]
    result = evaluate([(dets, labels)])
    # precision/recall points: (1, 0.5), (0.5, 0.5), (2/3, 1); envelope: 1 up to recall 0.5, 2/3 beyond
    expected = (51 * 1.0 + 50 * 2 / 3) / 101
    assert np.allclose(result.ap[0], expected)
    # a third label never found caps recall at 2/3: recall points 0..0.66 count, 0.67..1 are 0
    labels.append([0, 500, 500, 510, 510])
    result = evaluate([(dets, labels)])
    expected = (34 * 1.0 + 33 * 2 / 3) / 101  # recall 1/3 reached at 0.9, 2/3 at 0.7
    assert np.allclose(result.ap[0], expected)


def test_yolov5_rule_closes_the_curve_and_integrates_where_coco_reads_points():
    """YOLOv5 v7's AP on the same curves: 0.995 for a perfect detector (COCO: 1), and past the largest recall a
    ramp to 0 at recall 1 (7 hits of 10 labels, then 3 misses: 0.69 + 0.0085 + 0.105; COCO: 70 of 101 points)."""
    hits = np.arange(1, 11, dtype=float)[:, None]
    assert yolov5_ap(hits / 10, np.ones((10, 1)))[0] == pytest.approx(0.995)
    assert coco_ap(hits / 10, np.ones((10, 1)))[0] == pytest.approx(1.0)
    tp = np.array([1.0] * 7 + [0.0] * 3)
    true_pos, false_pos = tp.cumsum()[:, None], (1 - tp).cumsum()[:, None]
    recall, precision = true_pos / 10, true_pos / (true_pos + false_pos)
    assert yolov5_ap(recall, precision)[0] == pytest.approx(0.69 + 0.0085 + 0.105)
    assert coco_ap(recall, precision)[0] == pytest.approx(70 / 101)


def test_metric_rules_benchmark_scores_coco_json_by_yolov5s_rule():
    from benchmarks.metric_rules import yolov5_rule

    truth = {"images": [{"id": 1}, {"id": 2}],
             "annotations": [{"image_id": 1, "category_id": 0, "bbox": [10, 10, 20, 20]},
                             {"image_id": 2, "category_id": 0, "bbox": [50, 50, 30, 10]},
                             {"image_id": 2, "category_id": 1, "bbox": [0, 0, 5, 5]}]}
    perfect = [{"image_id": 1, "category_id": 0, "bbox": [10, 10, 20, 20], "score": 0.9},
               {"image_id": 2, "category_id": 0, "bbox": [50, 50, 30, 10], "score": 0.8}]
    map50, map5095 = yolov5_rule(perfect, truth)
    assert map50 == pytest.approx((0.995 + 0.0) / 2) and map5095 == pytest.approx(map50)  # class 1 never detected
    missed = [{**perfect[0], "bbox": [100, 100, 20, 20], "score": 0.95}] + perfect  # an extra miss above both hits
    first, _ = yolov5_rule(missed, truth)
    assert first < map50


def test_coco_ap_empty_and_envelope():
    assert coco_ap(np.zeros((0, 10)), np.zeros((0, 10))).tolist() == [0.0] * 10
    recall = np.array([[0.5], [1.0]])
    precision = np.array([[0.5], [1.0]])  # envelope lifts the first point to 1.0
    assert coco_ap(recall, precision)[0] == pytest.approx(1.0)


def test_match_predictions_unique_per_detection_and_label():
    labels = torch.tensor([[0, 0, 0, 10, 10], [0, 1, 0, 11, 10]], dtype=torch.float32)
    # dets 0 and 1 overlap both labels (best: label 0 and label 1); det 2 duplicates label 0 with another
    # class; det 3 duplicates label 1 exactly but has a lower confidence than det 1
    dets = torch.tensor([[0, 0, 10, 10, 0.9, 0], [1.2, 0, 11.2, 10, 0.8, 0], [0, 0, 10, 10, 0.7, 1],
                         [1, 0, 11, 10, 0.6, 0]])
    for match in (match_predictions, match_predictions_coco):
        correct = match(dets, labels, IOUV)
        assert correct.shape == (4, 10) and correct.dtype == torch.bool
        assert correct[:, 0].tolist() == [True, True, False, False]  # one detection per label at each threshold
        assert correct.sum(0).tolist() == [2] * 10  # IoUs 1.0 and 0.96 pass every threshold


def test_match_yolov5_vs_coco_semantics():
    # one label; the higher-confidence detection has the lower IoU
    labels = torch.tensor([[0, 0, 0, 100, 100]], dtype=torch.float32)
    dets = torch.tensor([[*shifted([0, 0, 100, 100], 0.62), 0.9, 0], [*shifted([0, 0, 100, 100], 0.92), 0.5, 0]])
    yolo = match_predictions(dets, labels, IOUV)
    coco = match_predictions_coco(dets, labels, IOUV)
    # YOLOv5: each detection picks its best label, then the label keeps the first (highest-confidence) one
    assert yolo[:, 0].tolist() == [True, False]
    # COCO: the first detection takes the label where its IoU allows (t <= 0.62), the second gets the rest
    assert coco[0].tolist() == (IOUV.numpy() <= 0.62).tolist()
    assert coco[1].tolist() == ((IOUV.numpy() > 0.62) & (IOUV.numpy() <= 0.92)).tolist()


def test_match_coco_contested_greedy_by_confidence():
    # two labels side by side, detection A (higher conf) overlaps both but best with label 1
    labels = torch.tensor([[0, 0, 0, 10, 10], [0, 2, 0, 12, 10]], dtype=torch.float32)
    dets = torch.tensor([[1.8, 0, 11.8, 10, 0.9, 0], [0, 0, 10, 10, 0.8, 0], [2, 0, 12, 10, 0.7, 0]])
    correct = match_predictions_coco(dets, labels, IOUV)
    # A takes label 1 (IoU 0.96), B takes label 0 (IoU 1), C finds nothing left
    assert correct[:, 0].tolist() == [True, True, False]
    assert correct[1].all() and not correct[2].any()


def test_keep_top_per_class():
    conf = torch.tensor([0.1, 0.9, 0.8, 0.7, 0.6, 0.5])
    cls = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    keep = keep_top_per_class(conf, cls, limit=2)
    assert keep.tolist() == [False, True, True, True, True, False]
    assert keep_top_per_class(conf, cls, limit=100).all()


def test_fitness_weights():
    assert fitness([0.9, 0.8, 0.5, 0.3]) == pytest.approx(0.1 * 0.5 + 0.9 * 0.3)
    assert fitness(np.array([[1, 1, 0, 0], [0, 0, 1, 1]])).tolist() == pytest.approx([0.0, 1.0])


def test_confusion_matrix_counts():
    matrix = ConfusionMatrix(nc=2, conf=0.25, iou_thres=0.45)
    labels = torch.tensor([[0, 0, 0, 10, 10], [1, 20, 20, 30, 30], [1, 50, 50, 60, 60]], dtype=torch.float32)
    dets = torch.tensor([[0, 0, 10, 10, 0.9, 0],       # correct class 0
                         [20, 20, 30, 30, 0.8, 0],     # label 1 predicted as 0
                         [80, 80, 90, 90, 0.7, 1],     # background predicted as 1
                         [50, 50, 60, 60, 0.1, 1]])    # below conf: label 1 missed
    matrix.process_batch(dets, labels)
    matrix.process_batch(None, torch.tensor([[0, 0, 0, 5, 5]], dtype=torch.float32))
    expected = np.array([[1, 1, 0],   # predicted 0: true 0, true 1
                         [0, 0, 1],   # predicted 1: background FP
                         [1, 1, 0]])  # missed (background): one class 0 (second image), one class 1
    assert (matrix.matrix == expected).all()
    tp, fp = matrix.tp_fp()
    assert tp.tolist() == [1, 0] and fp.tolist() == [1, 1]


def test_coco_json_format():
    pred = torch.tensor([[10.0, 20.0, 40.0, 60.0, 0.123456789, 2.0]])
    out = predictions_to_coco(pred, 42)
    assert out == [{"image_id": 42, "category_id": 2, "bbox": [10.0, 20.0, 30.0, 40.0], "score": 0.12346}]
    assert image_ids(["a/1.jpg", "b/007.png"]) == {"a/1.jpg": 1, "b/007.png": 7}
    assert image_ids(["a/1.jpg", "b/x.png"]) == {"a/1.jpg": "1", "b/x.png": "x"}
    labels = [np.array([[1, 0.5, 0.5, 0.5, 0.25]]), np.zeros((0, 5))]
    truth = ground_truth_to_coco(["d/3.jpg", "d/4.jpg"], labels, [(200, 100), (50, 50)], ["a", "b"])
    assert truth["images"] == [{"id": 3, "file_name": "3.jpg", "width": 200, "height": 100},
                               {"id": 4, "file_name": "4.jpg", "width": 50, "height": 50}]
    assert truth["categories"] == [{"id": 0, "name": "a"}, {"id": 1, "name": "b"}]
    (annotation,) = truth["annotations"]
    assert annotation["id"] == 1 and annotation["image_id"] == 3 and annotation["category_id"] == 1
    assert annotation["bbox"] == pytest.approx([50.0, 37.5, 100.0, 25.0])
    assert annotation["area"] == pytest.approx(2500.0) and annotation["iscrowd"] == 0


def synthetic_predictions(seed, n_images=50, nc=3):
    """Ground truth boxes with jittered copies (some duplicated, some mislabelled) plus false positives."""
    rng = np.random.default_rng(seed)
    images = []
    for index in range(n_images):
        width, height = rng.integers(200, 640, 2)
        count = rng.integers(1, 30)
        size = rng.uniform(12, [width / 3, height / 3], (count, 2))
        corner = rng.uniform(0, 1, (count, 2)) * ([width, height] - size)
        truth = np.concatenate([corner, corner + size], 1)
        classes = rng.integers(0, nc, count)
        dets = []
        for box, cls in zip(truth, classes):
            for copy in range(1 + (rng.random() < 0.5) + (rng.random() < 0.25)):
                if rng.random() < 0.9:
                    spread = rng.uniform(0.0, 0.25) if copy == 0 else rng.uniform(0.05, 0.4)
                    jitter = rng.normal(0, spread / 2, 4) * np.tile(box[2:] - box[:2], 2)
                    score = 1 / (1 + np.exp(-(2 - 8 * spread + rng.normal(0, 1))))
                    dets.append([*(box + jitter), score, cls if rng.random() < 0.9 else rng.integers(0, nc)])
        for _ in range(rng.integers(0, 10)):
            x, y = rng.uniform(0, width), rng.uniform(0, height)
            dets.append([x, y, x + rng.uniform(5, 100), y + rng.uniform(5, 100), rng.uniform(0.001, 0.6),
                         rng.integers(0, nc)])
        dets = np.array(dets, dtype=np.float64).reshape(-1, 6)
        dets[:, [0, 2]] = dets[:, [0, 2]].clip(0, width)
        dets[:, [1, 3]] = dets[:, [1, 3]].clip(0, height)
        dets = dets[np.argsort(-dets[:, 4], kind="stable")]
        images.append((f"images/{index:04d}.jpg", (width, height), truth, classes, dets))
    return images


@pytest.mark.parametrize("seed", [0, 1])
def test_map_agrees_with_pycocotools(tmp_path, seed):
    pytest.importorskip("pycocotools")
    images = synthetic_predictions(seed)
    stats, predictions, labels = [], [], []
    for path, (width, height), truth, classes, dets in images:
        det = torch.tensor(dets, dtype=torch.float32)
        det = det[keep_top_per_class(det[:, 4], det[:, 5])]
        lab = torch.tensor(np.concatenate([classes[:, None], truth], 1), dtype=torch.float32)
        stats.append((match_predictions_coco(det, lab, IOUV).numpy(), det[:, 4].numpy(), det[:, 5].numpy(),
                      classes))
        predictions += predictions_to_coco(det, image_ids([path])[path])
        labels.append(np.concatenate([classes[:, None], xyxy2xywhn(truth, width, height)], 1))
    result = ap_per_class(*(np.concatenate(x) for x in zip(*stats)))
    truth_json = write_json(ground_truth_to_coco([x[0] for x in images], labels, [x[1] for x in images],
                                                 ["a", "b", "c"]), tmp_path / "annotations.json")
    pred_json = write_json(predictions, tmp_path / "predictions.json")
    assert json.loads(pred_json.read_text())[0].keys() == {"image_id", "category_id", "bbox", "score"}
    coco_map, coco_map50, summary = coco_evaluate(truth_json, pred_json)
    assert 0.3 < coco_map < 0.9 and "Average Precision" in summary
    assert abs(result.ap.mean() - coco_map) < 0.002
    assert abs(result.ap[:, 0].mean() - coco_map50) < 0.002


def test_ap_per_class_plots(tmp_path):
    images = synthetic_predictions(3, n_images=5)
    evaluated = [(dets, np.concatenate([classes[:, None], truth], 1)) for _, _, truth, classes, dets in images]
    stats = []
    for det, lab in evaluated:
        det, lab = torch.tensor(det, dtype=torch.float32), torch.tensor(lab, dtype=torch.float32)
        stats.append((match_predictions(det, lab, IOUV).numpy(), det[:, 4].numpy(), det[:, 5].numpy(),
                      lab[:, 0].numpy()))
    from utils.plots import plot_ap_curves, plot_confusion_matrix

    plot_ap_curves(ap_per_class(*(np.concatenate(x) for x in zip(*stats))), tmp_path, names=["a", "b", "c"])
    for name in ("PR_curve.png", "F1_curve.png", "P_curve.png", "R_curve.png"):
        assert (tmp_path / name).stat().st_size > 1000
    matrix = ConfusionMatrix(nc=3)
    for det, lab in evaluated:
        matrix.process_batch(torch.tensor(det, dtype=torch.float32), torch.tensor(lab, dtype=torch.float32))
    assert plot_confusion_matrix(matrix.matrix, tmp_path / "cm.png", ["a", "b", "c"]).stat().st_size > 1000


@pytest.mark.parametrize("nc, labelled, annotated", [(3, True, True), (80, True, False), (99, False, False)])
def test_the_confusion_matrix_names_its_axes_below_99_classes(tmp_path, monkeypatch, nc, labelled, annotated):
    """As YOLOv5's plot: class names on the axes below 99 classes (COCO's 80 included), values in the cells below
    30."""
    from utils import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    names = [f"c{i}" for i in range(nc)]
    plots.plot_confusion_matrix(np.eye(nc + 1) * 5, tmp_path / "cm.png", names)
    ax = figures[0].axes[0]
    shown = [label.get_text() for label in ax.get_xticklabels()]
    assert (shown == names + ["background"]) == labelled and (len(ax.texts) > 0) == annotated


def test_plot_results(tmp_path):
    from utils.plots import plot_results, read_results_csv
    header = ("epoch,train/box_loss,train/obj_loss,train/cls_loss,metrics/precision,metrics/recall,"
              "metrics/mAP_0.5,metrics/mAP_0.5:0.95,val/box_loss,val/obj_loss,val/cls_loss,x/lr0,x/lr1,x/lr2")
    rows = [",".join(f"{e if i == 0 else 1 / (e + 1 + i):.5f}" for i in range(14)) for e in range(12)]
    csv_file = tmp_path / "results.csv"
    csv_file.write_text("\n".join([header.replace(",", ",  ")] + rows) + "\n")
    data = read_results_csv(csv_file)
    assert len(data["metrics/mAP_0.5"]) == 12 and data["epoch"][-1] == 11
    assert plot_results(csv_file) == tmp_path / "results.png"
    assert (tmp_path / "results.png").stat().st_size > 1000
