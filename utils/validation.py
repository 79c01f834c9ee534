"""Validation as a library: ``validate(model, dataloader, names, device, ...)`` runs a model over a
loader and scores it. val.py (standalone validation) and the trainer (each epoch, on the EMA model)
both call it.

Scoring matches pycocotools' COCOeval on the same predictions: boxes are mapped back to the original
images, detections are matched greedily by confidence (each takes its best still-free label of the
same class, as COCOeval does), at most 100 detections per image and class are scored (COCOeval's
maxDets), and AP is the 101-point COCO interpolation. P and R are read at the max-F1 confidence.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from models import is_channels_last
from utils import dist
from utils.boxes import scale_boxes, xywh2xyxy, xywhn2xyxy, xyxy2xywh
from utils.metrics import (ConfusionMatrix, ap_per_class, fitness, iou_thresholds, keep_top_per_class,
                           match_predictions_coco)
from utils.plots import plot_ap_curves, plot_confusion_matrix

LOGGER = logging.getLogger(__name__)
PLOTTED_BATCHES = 3  # val_batch{0,1,2}_{labels,pred}.jpg
VAL_HOOKS = ("on_val_start", "on_val_batch_start", "on_val_image_end", "on_val_batch_end", "on_val_end")
TABLE_HEADER = ("%22s" + "%11s" * 6) % ("Class", "Images", "Instances", "P", "R", "mAP50", "mAP50-95")
TABLE_ROW = "%22s" + "%11i" * 2 + "%11.3g" * 4


@dataclass
class ValResult:
    mp: float = 0.0  # mean precision at the max-F1 confidence
    mr: float = 0.0
    map50: float = 0.0
    map: float = 0.0  # mAP50-95
    losses: np.ndarray = field(default_factory=lambda: np.zeros(3))  # val box, obj, cls (with compute_loss)
    maps: np.ndarray = field(default_factory=lambda: np.zeros(0))  # (nc,) per-class mAP50-95 (mean when absent)
    speed: tuple = (0.0, 0.0, 0.0)  # pre-process, inference, NMS ms per image
    fitness: float = 0.0
    seen: int = 0
    instances: int = 0
    coco: tuple | None = None  # (mAP50-95, mAP50) from pycocotools with save_json
    save_dir: Path | None = None
    per_class: list = field(default_factory=list)  # classes with labels: dicts of class, name, instances, precision,
    # recall, mAP50, mAP50-95 (the --verbose table's rows), and f1, tp, fp (at the max-F1 confidence)
    confusion: np.ndarray | None = None  # with plots: (nc + 1)^2 counts [predicted, true] at conf 0.25, IoU 0.45 (the
    # last row/column: background), as confusion_matrix.png draws them; None without plots (not counted, as YOLOv5)

    def __iter__(self):
        """YOLOv5's ``(mp, mr, map50, map, *losses), maps, t = val.run(...)``."""
        yield (self.mp, self.mr, self.map50, self.map, *(float(loss) for loss in self.losses))
        yield self.maps
        yield self.speed


class _Timer:
    """Accumulates wall time of a block; synchronises CUDA so GPU work is counted where it happens."""

    def __init__(self, device: torch.device):
        self.total, self.cuda = 0.0, device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.total += time.perf_counter() - self.start


@dataclass
class _Accumulator:
    """What validation collects over the batches."""
    nc: int
    names: list
    iouv: torch.Tensor
    confusion: ConfusionMatrix
    image_ids: dict
    label_index: dict  # image path -> index in dataset_labels
    dataset_labels: list  # (n, 5) [class, cx, cy, w, h] normalised to the original image
    single_cls: bool = False
    stats: list = field(default_factory=list)  # per image: (image id, correct (n,10), conf, pred cls, target cls)
    json: list = field(default_factory=list)
    category_ids: tuple | None = None  # class index -> COCO category id in the JSON (COCO's val2017), else the index
    seen: int = 0


def validate(model, dataloader, names, device, conf_thres=0.001, iou_thres=0.6, max_det=300, compute_loss=None,
             save_dir=None, plots=True, half=False, verbose=False, single_cls=False, save_json=False, save_txt=False,
             save_conf=False, json_name="predictions.json", distributed=False, first_batch=None,
             save_hybrid=False, coco=None, callbacks=None) -> ValResult:
    """Run ``model`` over ``dataloader`` and score it; see the module docstring for how.

    ``compute_loss`` given means "called from training": val losses are computed and the speed line is
    only logged at debug level. ``save_dir`` (None: nothing written) receives the plots, ``labels/*.txt``
    with ``save_txt`` and, with ``save_json``, ``json_name`` plus ``annotations.json`` (COCO ground truth). ``coco``
    (``utils.coco.coco_val``: the split is COCO's val2017): the JSON takes COCO's category ids and pycocotools scores
    it against the official annotations, as YOLOv5 does.
    ``half`` runs fp16 on CUDA only (autocast when the model itself is fp32). The model's train/eval mode
    is restored afterwards. ``distributed``: every process of the group calls this with its own slice of
    the val set (``create_dataloader(..., shard="batches")``: whole batches, none twice, no padding); the
    statistics are gathered and scored on the main process and every process returns the same result
    (plots and files are written by the main process only). ``first_batch``: called (on the main process) with the
    first batch's images as the loader gave them (uint8), its predictions (per image (n, 6) xyxy, conf, class in
    those images' pixels) and paths: what training gives the experiment trackers every --bbox_interval epochs.
    ``save_hybrid`` (val.py --save-hybrid, YOLOv5's autolabelling): each image's ground truth joins its candidates
    before NMS with confidence 1, so the labels and the metrics are those of labels and predictions together.
    ``callbacks`` (utils.callbacks.Callbacks): YOLOv5's validation hooks, called as its val.py calls them; under
    ``distributed`` each process calls the batch and image hooks for its share, the main process ``on_val_end``.
    """
    from utils.nms import non_max_suppression

    device = torch.device(device)
    half = half and device.type == "cuda"
    names = _name_list(names)
    save_dir = Path(save_dir) if save_dir is not None else None
    writer = not distributed or dist.is_main_process()
    dataset = dataloader.dataset
    acc = _new_accumulator(dataset, names, device, single_cls)
    acc.category_ids = coco.category_ids if coco is not None else None
    timers = [_Timer(device) for _ in range(3)]
    losses = torch.zeros(3, device=device)
    fp16_autocast = half and model_dtype(model) == torch.float32
    autocast = torch.autocast("cuda", dtype=torch.float16) if fp16_autocast else nullcontext()
    input_dtype = torch.float16 if half else model_dtype(model)
    channels_last = is_channels_last(model)
    hooks = _ValHooks(callbacks, names)
    hooks.run("on_val_start")
    with torch.inference_mode(), autocast, _restore_mode(model):
        for batch_index, (images, targets, paths, shapes) in enumerate(_progress(dataloader, compute_loss, writer)):
            hooks.run("on_val_batch_start")
            loaded = images
            with timers[0]:
                images = model_input(images, device, input_dtype, channels_last)
                targets = targets.to(device)
            with timers[1]:
                pred, raw = model(images)
            if compute_loss is not None:
                losses += compute_loss([x.float() for x in raw], targets)[1]
            plot_targets = targets.clone() if plots and save_dir and writer and batch_index < PLOTTED_BATCHES else None
            targets[:, 2:] *= torch.tensor(images.shape[2:], device=device).flip(0).repeat(2)  # to pixels
            with timers[2]:
                truth = [targets[targets[:, 0] == si, 1:] for si in range(images.shape[0])] if save_hybrid else None
                detections = non_max_suppression(pred, conf_thres, iou_thres, multi_label=True, agnostic=single_cls,
                                                 max_det=max_det, labels=truth)
            for si, det in enumerate(detections):
                native = _score_image(acc, det, targets[targets[:, 0] == si, 1:], paths[si], shapes[si],
                                      images.shape[2:], single_cls, save_dir if save_txt else None, save_conf,
                                      save_json, plots)
                hooks.image_end(det, native, paths[si], images[si])
            if plot_targets is not None:
                _plot_batch(images, plot_targets, detections, paths, save_dir, batch_index, names)
            if first_batch is not None and writer and batch_index == 0:
                first_batch(loaded, detections, paths)
            hooks.run("on_val_batch_end", batch_index, images, targets, paths, shapes, detections)
    batches = len(dataloader)
    if distributed:
        losses, batches = _gather(acc, losses, batches)
        if not dist.is_main_process():
            return dist.broadcast_object(None, phase="score the validation")
    result = _summarise(acc, plots and save_dir is not None, save_dir, verbose, hooks)
    result.losses = (losses.cpu() / max(batches, 1)).numpy()
    result.speed = tuple(t.total / max(acc.seen, 1) * 1e3 for t in timers)
    batch_size = getattr(dataloader, "batch_size", None) or getattr(getattr(dataloader, "batch_sampler", None),
                                                                    "batch_size", 1)  # a batch sampler holds it
    shape = (batch_size, 3, getattr(dataset, "imgsz", 0), getattr(dataset, "imgsz", 0))
    level = logging.DEBUG if compute_loss is not None else logging.INFO
    LOGGER.log(level, "Speed: %.1fms pre-process, %.1fms inference, %.1fms NMS per image at shape %s",
               *result.speed, shape)
    if save_json and save_dir is not None:
        result.coco = _write_and_score_json(acc, dataset, names, save_dir, json_name, single_cls, result, coco)
    result.save_dir = save_dir
    return dist.broadcast_object(result, phase="score the validation") if distributed else result


def _gather(acc: _Accumulator, losses: torch.Tensor, batches: int) -> tuple[torch.Tensor, int]:
    """Distributed validation: every process scored its own slice of the val set; the main process
    collects the per-image statistics, confusion counts and loss sums of all (its accumulator is extended
    in place). Returns the summed losses and batch count."""
    parts = dist.gather_object((acc.stats, acc.seen, acc.confusion.matrix, losses.cpu(), batches, acc.json),
                               phase="validate their share of the val set")
    if dist.is_main_process():
        acc.stats = [item for stats, *_ in parts for item in stats]
        acc.json = [item for *_, json_rows in parts for item in json_rows]
        acc.seen = sum(part[1] for part in parts)
        acc.confusion.matrix = sum(part[2] for part in parts)
    return sum(part[3] for part in parts), sum(part[4] for part in parts)


def _new_accumulator(dataset, names, device, single_cls: bool) -> _Accumulator:
    from utils.coco import image_ids
    im_files = [str(f) for f in getattr(dataset, "im_files", [])]
    return _Accumulator(len(names), names, iou_thresholds(device), ConfusionMatrix(len(names)), image_ids(im_files),
                        {f: i for i, f in enumerate(im_files)}, list(getattr(dataset, "labels", [])), single_cls)


@contextmanager
def _restore_mode(model):
    """Eval mode inside, the caller's train/eval mode afterwards (also on errors)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _name_list(names) -> list[str]:
    if isinstance(names, dict):
        return [str(names[i]) for i in sorted(names)]
    return [str(n) for n in names]


def model_input(images: torch.Tensor, device, dtype: torch.dtype, channels_last: bool) -> torch.Tensor:
    """A loader batch (uint8, 0-255) as the model takes it: on ``device``, in its memory layout, in ``dtype``
    (fp16 under --half on CUDA), scaled to [0, 1]."""
    images = images.to(device, non_blocking=True)
    images = images.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return images.to(dtype).div_(255)


def model_dtype(model) -> torch.dtype:
    parameter = next(model.parameters(), None)
    return parameter.dtype if parameter is not None else torch.float32


def _progress(dataloader, compute_loss, shown: bool = True):
    from tqdm import tqdm
    return tqdm(dataloader, desc=TABLE_HEADER, bar_format="{l_bar}{bar:10}{r_bar}", leave=compute_loss is None,
                disable=not shown)


class _ValHooks:
    """YOLOv5's validation hooks of ``callbacks``; calls nothing when none of them has an action (or no callbacks)."""

    def __init__(self, callbacks, names: list[str]):
        active = callbacks is not None and any(callbacks.has(hook) for hook in VAL_HOOKS)
        self.callbacks = callbacks if active else None
        self.names = dict(enumerate(names))  # YOLOv5's {i: name}, as on_val_image_end gets it

    def run(self, hook: str, *args) -> None:
        if self.callbacks is not None:
            self.callbacks.run(hook, *args)

    def image_end(self, det, native, path, image) -> None:
        if self.callbacks is not None:
            self.callbacks.run("on_val_image_end", det, native, Path(path), self.names, image)


def _score_image(acc: _Accumulator, det, labels, path, shapes, input_shape, single_cls, txt_dir, save_conf,
                 save_json, plots) -> torch.Tensor:
    """Match one image's detections against its labels in original-image pixels and record the result; returns the
    detections in those pixels."""
    acc.seen += 1
    (height0, width0), ratio_pad = shapes
    if single_cls:
        det[:, 5] = 0
    native = scale_boxes(input_shape, det.clone(), (height0, width0), ratio_pad)
    labels_native = _original_labels(acc, path, labels, input_shape, shapes)
    if len(det) or len(labels_native):
        scored = native[keep_top_per_class(native[:, 4], native[:, 5])]
        correct = match_predictions_coco(scored, labels_native, acc.iouv)
        acc.stats.append((_image_key(acc, path), correct.cpu().numpy(), scored[:, 4].cpu().numpy(),
                          scored[:, 5].cpu().numpy(), labels_native[:, 0].cpu().numpy()))
    if plots and len(labels_native):
        acc.confusion.process_batch(native if len(native) else None, labels_native)
    if txt_dir is not None and len(native):
        _save_txt(native, (width0, height0), txt_dir / "labels" / f"{Path(path).stem}.txt", save_conf)
    if save_json and len(native):
        from utils.coco import predictions_to_coco
        acc.json += predictions_to_coco(native, _image_key(acc, path), acc.category_ids)
    return native


def _original_labels(acc: _Accumulator, path, labels, input_shape, shapes):
    """(m, 5) class + xyxy labels in original pixels: the dataset's own labels (exactly what the COCO
    ground truth file holds) when the image is found there, else the batch targets mapped back."""
    index = acc.label_index.get(str(path))
    if index is None:
        boxes = scale_boxes(input_shape, xywh2xyxy(labels[:, 1:5]), shapes[0], shapes[1])
        return torch.cat((labels[:, :1], boxes), 1)
    original = torch.from_numpy(np.asarray(acc.dataset_labels[index], dtype=np.float32).reshape(-1, 5))
    (height0, width0) = shapes[0]
    boxes = xywhn2xyxy(original[:, 1:5], width0, height0)
    classes = torch.zeros_like(original[:, :1]) if acc.single_cls else original[:, :1]
    return torch.cat((classes, boxes), 1).to(labels.device)


def _image_key(acc: _Accumulator, path):
    """COCO image id of ``path`` (the stem when the dataset does not list it)."""
    key = acc.image_ids.get(str(path))
    return key if key is not None else Path(path).stem


def _collect_stats(stats):
    """Concatenate per-image stats in COCOeval's order: images by id, confidences rounded to the 5 decimals
    written to the JSON, so ties between detections break exactly as pycocotools breaks them."""
    try:
        stats = sorted(stats, key=lambda item: item[0])
    except TypeError:  # mixed id types (images outside the dataset listing): keep loader order
        pass
    tp, conf, pred_cls, target_cls = (np.concatenate(x, 0) for x in list(zip(*stats))[1:])
    return tp, np.round(conf.astype(np.float64), 5), pred_cls, target_cls


def _save_txt(native, size, file: Path, save_conf: bool) -> None:
    """YOLO-format lines ``class cx cy w h [conf]`` normalised to the original image."""
    gain = torch.tensor([*size, *size], dtype=torch.float32)
    rows = native.float().cpu()
    xywhn = xyxy2xywh(rows[:, :4]) / gain
    columns = [rows[:, 5:6], xywhn] + ([rows[:, 4:5]] if save_conf else [])
    lines = [("%g " * len(row)).rstrip() % tuple(row) for row in torch.cat(columns, 1).tolist()]
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("\n".join(lines) + "\n")


def _plot_batch(images, targets, detections, paths, save_dir: Path, batch_index: int, names) -> None:
    """val_batch{i}_labels.jpg and val_batch{i}_pred.jpg (predictions as [image, class, x1, y1, x2, y2, conf]) in
    ``save_dir``.

    A failure to draw is logged, never fatal: it must not end a validation or a training run.
    """
    try:
        from utils.drawing import plot_images
    except ImportError as error:
        LOGGER.warning("WARNING: batch images not drawn (%s)", error)
        return
    rows = [torch.cat((torch.full((len(d), 1), i, device=d.device), d[:, 5:6], d[:, :5]), 1)
            for i, d in enumerate(detections)]
    predictions = torch.cat(rows, 0) if rows else torch.zeros((0, 7))
    plot_images(images, targets, paths, save_dir / f"val_batch{batch_index}_labels.jpg", names)
    plot_images(images, predictions, paths, save_dir / f"val_batch{batch_index}_pred.jpg", names)


def _summarise(acc: _Accumulator, plots: bool, save_dir, verbose: bool, hooks=None) -> ValResult:
    """Per-class AP and the printed table (YOLOv5's layout: header, 'all' row, per-class rows when verbose)."""
    nc = acc.nc
    if acc.stats:
        tp, conf, pred_cls, target_cls = _collect_stats(acc.stats)
    else:
        tp, conf, pred_cls, target_cls = np.zeros((0, 10), bool), np.zeros(0), np.zeros(0), np.zeros(0)
    instances = np.bincount(target_cls.astype(int), minlength=nc)
    result = ValResult(seen=acc.seen, instances=int(instances.sum()), maps=np.zeros(nc),
                       confusion=acc.confusion.matrix.copy() if plots else None)
    classes, ap50, ap = np.zeros(0, int), np.zeros(0), np.zeros(0)
    metrics = None
    if len(target_cls):
        metrics = ap_per_class(tp, conf, pred_cls, target_cls)
        if plots:
            plot_ap_curves(metrics, save_dir, acc.names)
        classes, ap50, ap = metrics.classes, metrics.ap[:, 0], metrics.ap.mean(1)
        result.mp, result.mr = float(metrics.p.mean()), float(metrics.r.mean())
        result.map50, result.map = float(ap50.mean()), float(ap.mean())
        result.per_class = [{"class": int(cls), "name": acc.names[cls], "instances": int(instances[cls]),
                             "precision": float(metrics.p[i]), "recall": float(metrics.r[i]),
                             "mAP50": float(ap50[i]), "mAP50-95": float(ap[i]), "f1": float(metrics.f1[i]),
                             "tp": int(round(metrics.tp[i])), "fp": int(round(metrics.fp[i]))}
                            for i, cls in enumerate(classes)]
    LOGGER.info(TABLE_ROW, "all", acc.seen, instances.sum(), result.mp, result.mr, result.map50, result.map)
    if not instances.sum():
        LOGGER.warning("WARNING: no labels found in the val set, can not compute metrics without labels")
    if verbose and nc > 1 and len(classes):
        for i, cls in enumerate(classes):
            LOGGER.info(TABLE_ROW, acc.names[cls], acc.seen, instances[cls], metrics.p[i], metrics.r[i], ap50[i], ap[i])
    result.maps += result.map
    result.maps[classes] = ap
    result.fitness = float(fitness([result.mp, result.mr, result.map50, result.map]))
    if plots:
        plot_confusion_matrix(acc.confusion.matrix, save_dir / "confusion_matrix.png", acc.names)
    if hooks is not None and hooks.callbacks is not None:
        empty = np.zeros(0)
        counts = (metrics.tp, metrics.fp, metrics.p, metrics.r, metrics.f1) if metrics is not None else (empty,) * 5
        hooks.run("on_val_end", instances, *counts, ap, ap50, classes, acc.confusion)
    return result


def _write_and_score_json(acc: _Accumulator, dataset, names, save_dir: Path, json_name: str, single_cls: bool,
                          result: ValResult, coco=None):
    """Write predictions + COCO ground truth beside them; score with pycocotools when it is installed: against that
    ground truth, or for COCO's val2017 (``coco``) against its official annotations when they are there, on this
    split's images."""
    from utils.coco import coco_evaluate, ground_truth_to_coco, write_json
    predictions = write_json(acc.json, save_dir / json_name)
    truth = ground_truth_to_coco(dataset.im_files, dataset.labels, dataset.shapes, names, single_cls=single_cls,
                                 category_ids=acc.category_ids)
    annotations = write_json(truth, save_dir / "annotations.json")
    LOGGER.info("Saved %d COCO predictions to %s and the ground truth to %s", len(acc.json), predictions, annotations)
    target, images = annotations, None
    if coco is not None and coco.annotations.is_file():
        target, images = coco.annotations, [image["id"] for image in truth["images"]]
        LOGGER.info("COCO val2017: scoring against the official annotations %s", target)
    elif coco is not None:
        LOGGER.info("COCO val2017: %s not found, scoring against the labels' ground truth", coco.annotations)
    try:
        scores = coco_evaluate(target, predictions, images)
    except AssertionError:  # pycocotools' check that every predicted image is in the annotations
        if images is None:
            raise
        LOGGER.warning("WARNING: %s does not hold every image of this split: scoring against the labels' ground "
                       "truth instead", target)
        scores = coco_evaluate(annotations, predictions)
    if scores is None:
        return None
    coco_map, coco_map50, summary = scores
    LOGGER.info("pycocotools COCOeval:\n%s", summary.rstrip())
    LOGGER.info("mAP50-95: val.py %.4f, pycocotools %.4f | mAP50: val.py %.4f, pycocotools %.4f",
                result.map, coco_map, result.map50, coco_map50)
    return coco_map, coco_map50
