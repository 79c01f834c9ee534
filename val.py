"""Validate a detector on a dataset split (YOLOv5 val.py flags and output).

Usage:
    python val.py --weights runs/train/exp/weights/best.pt --data data.yaml --img 640
    python val.py --weights best.pt --data data.yaml --save-json     # + COCO JSON scored by pycocotools
    python val.py --weights best.pt --data data.yaml --task speed    # timing only

``validate(model, dataloader, names, device, ...)`` is the loop the trainer calls every epoch on the
EMA model; ``run(...)`` builds the model and a rectangular-batch loader and calls it.

Scoring matches pycocotools' COCOeval on the same predictions: boxes are mapped back to the original
images, detections are matched greedily by confidence (each takes its best still-free label of the
same class, as COCOeval does), at most 100 detections per image and class are scored (COCOeval's
maxDets), and AP is the 101-point COCO interpolation. P and R are read at the max-F1 confidence.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models import is_channels_last  # noqa: E402
from utils.boxes import scale_boxes, xywh2xyxy, xywhn2xyxy, xyxy2xywh  # noqa: E402
from utils.cli import add_device_flag, add_half_flag, add_run_folder_flags  # noqa: E402
from utils.metrics import (ConfusionMatrix, ap_per_class, fitness, iou_thresholds, keep_top_per_class,  # noqa: E402
                           match_predictions_coco)

LOGGER = logging.getLogger("val")
PLOTTED_BATCHES = 3  # val_batch{0,1,2}_{labels,pred}.jpg
TABLE_HEADER = ("%22s" + "%11s" * 6) % ("Class", "Images", "Instances", "P", "R", "mAP50", "mAP50-95")
TABLE_ROW = "%22s" + "%11i" * 2 + "%11.3g" * 4


class ValError(ValueError):
    """A user mistake (missing file, mismatched data); val.py prints it as one line and exits 2."""


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
    seen: int = 0


def validate(model, dataloader, names, device, conf_thres=0.001, iou_thres=0.6, max_det=300, compute_loss=None,
             save_dir=None, plots=True, half=False, verbose=False, single_cls=False, save_json=False, save_txt=False,
             save_conf=False, json_name="predictions.json") -> ValResult:
    """Run ``model`` over ``dataloader`` and score it; see the module docstring for how.

    ``compute_loss`` given means "called from training": val losses are computed and the speed line is
    only logged at debug level. ``save_dir`` (None: nothing written) receives the plots, ``labels/*.txt``
    with ``save_txt`` and, with ``save_json``, ``json_name`` plus ``annotations.json`` (COCO ground truth).
    ``half`` runs fp16 on CUDA only (autocast when the model itself is fp32). The model's train/eval mode
    is restored afterwards.
    """
    from utils.nms import non_max_suppression

    device = torch.device(device)
    half = half and device.type == "cuda"
    names = _name_list(names)
    save_dir = Path(save_dir) if save_dir is not None else None
    dataset = dataloader.dataset
    acc = _new_accumulator(dataset, names, device, single_cls)
    timers = [_Timer(device) for _ in range(3)]
    losses = torch.zeros(3, device=device)
    autocast = torch.autocast("cuda", dtype=torch.float16) if half and _dtype(model) == torch.float32 else nullcontext()
    input_dtype = torch.float16 if half else _dtype(model)
    channels_last = is_channels_last(model)
    with torch.inference_mode(), autocast, _restore_mode(model):
        for batch_index, (images, targets, paths, shapes) in enumerate(_progress(dataloader, compute_loss)):
            with timers[0]:
                images = images.to(device, non_blocking=True)
                images = images.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
                images = images.to(input_dtype).div_(255)
                targets = targets.to(device)
            with timers[1]:
                pred, raw = model(images)
            if compute_loss is not None:
                losses += compute_loss([x.float() for x in raw], targets)[1]
            plot_targets = targets.clone() if plots and save_dir and batch_index < PLOTTED_BATCHES else None
            targets[:, 2:] *= torch.tensor(images.shape[2:], device=device).flip(0).repeat(2)  # to pixels
            with timers[2]:
                detections = non_max_suppression(pred, conf_thres, iou_thres, multi_label=True, agnostic=single_cls,
                                                 max_det=max_det)
            for si, det in enumerate(detections):
                _score_image(acc, det, targets[targets[:, 0] == si, 1:], paths[si], shapes[si], images.shape[2:],
                             single_cls, save_dir if save_txt else None, save_conf, save_json, plots)
            if plot_targets is not None:
                _plot_batch(images, plot_targets, detections, paths, save_dir, batch_index, names)
    result = _summarise(acc, plots and save_dir is not None, save_dir, verbose)
    result.losses = (losses.cpu() / max(len(dataloader), 1)).numpy()
    result.speed = tuple(t.total / max(acc.seen, 1) * 1e3 for t in timers)
    shape = (getattr(dataloader, "batch_size", 1), 3, getattr(dataset, "imgsz", 0), getattr(dataset, "imgsz", 0))
    level = logging.DEBUG if compute_loss is not None else logging.INFO
    LOGGER.log(level, "Speed: %.1fms pre-process, %.1fms inference, %.1fms NMS per image at shape %s",
               *result.speed, shape)
    if save_json and save_dir is not None:
        result.coco = _write_and_score_json(acc, dataset, names, save_dir, json_name, single_cls, result)
    result.save_dir = save_dir
    return result


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


def _dtype(model) -> torch.dtype:
    parameter = next(model.parameters(), None)
    return parameter.dtype if parameter is not None else torch.float32


def _progress(dataloader, compute_loss):
    from tqdm import tqdm
    return tqdm(dataloader, desc=TABLE_HEADER, bar_format="{l_bar}{bar:10}{r_bar}", leave=compute_loss is None)


def _score_image(acc: _Accumulator, det, labels, path, shapes, input_shape, single_cls, txt_dir, save_conf,
                 save_json, plots) -> None:
    """Match one image's detections against its labels in original-image pixels and record the result."""
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
        acc.json += predictions_to_coco(native, _image_key(acc, path))


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
    """val_batch{i}_labels.jpg and val_batch{i}_pred.jpg (predictions as [image, class, x1, y1, x2, y2, conf]).

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


def _summarise(acc: _Accumulator, plots: bool, save_dir, verbose: bool) -> ValResult:
    """Per-class AP and the printed table (YOLOv5's layout: header, 'all' row, per-class rows when verbose)."""
    nc = acc.nc
    if acc.stats:
        tp, conf, pred_cls, target_cls = _collect_stats(acc.stats)
    else:
        tp, conf, pred_cls, target_cls = np.zeros((0, 10), bool), np.zeros(0), np.zeros(0), np.zeros(0)
    instances = np.bincount(target_cls.astype(int), minlength=nc)
    result = ValResult(seen=acc.seen, instances=int(instances.sum()), maps=np.zeros(nc))
    classes, ap50, ap = np.zeros(0, int), np.zeros(0), np.zeros(0)
    if len(target_cls):
        metrics = ap_per_class(tp, conf, pred_cls, target_cls, plot=plots, save_dir=save_dir, names=acc.names)
        classes, ap50, ap = metrics.classes, metrics.ap[:, 0], metrics.ap.mean(1)
        result.mp, result.mr = float(metrics.p.mean()), float(metrics.r.mean())
        result.map50, result.map = float(ap50.mean()), float(ap.mean())
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
        acc.confusion.plot(save_dir, names=acc.names)
    return result


def _write_and_score_json(acc: _Accumulator, dataset, names, save_dir: Path, json_name: str, single_cls: bool,
                          result: ValResult):
    """Write predictions + COCO ground truth beside them; score with pycocotools when it is installed."""
    from utils.coco import coco_evaluate, ground_truth_to_coco, write_json
    predictions = write_json(acc.json, save_dir / json_name)
    truth = ground_truth_to_coco(dataset.im_files, dataset.labels, dataset.shapes, names, single_cls=single_cls)
    annotations = write_json(truth, save_dir / "annotations.json")
    LOGGER.info("Saved %d COCO predictions to %s and the ground truth to %s", len(acc.json), predictions, annotations)
    scores = coco_evaluate(annotations, predictions)
    if scores is None:
        return None
    coco_map, coco_map50, summary = scores
    LOGGER.info("pycocotools COCOeval:\n%s", summary.rstrip())
    LOGGER.info("mAP50-95: val.py %.4f, pycocotools %.4f | mAP50: val.py %.4f, pycocotools %.4f",
                result.map, coco_map, result.map50, coco_map50)
    return coco_map, coco_map50


def run(data=None, weights="yolov5s.pt", batch_size=32, imgsz=640, conf_thres=0.001, iou_thres=0.6, max_det=300,
        task="val", device="", workers=8, single_cls=False, augment=False, verbose=False, save_txt=False,
        save_hybrid=False, save_conf=False, save_json=False, project=ROOT / "runs/val", name="exp", exist_ok=False,
        half=False, dnn=False, plots=True) -> ValResult:
    """Standalone validation: model from ``weights``, rectangular batches (pad 0.5) of ``data``'s ``task`` split.

    ``task='speed'``: timing only (conf 0.25, IoU 0.45, square batches, no plots or JSON). Raises ValError
    (and the data/checkpoint/device errors, all ValueErrors) for user mistakes.
    """
    from models import for_inference, load_model
    from utils.data.loader import create_dataloader
    from utils.device import select_device
    from utils.paths import increment_path

    _warn_unsupported(augment, save_hybrid, dnn)
    if task == "speed":
        conf_thres, iou_thres, save_json, plots = 0.25, 0.45, False, False
    config = _load_data(data)
    split = "val" if task == "speed" else task
    sources = config.split(split)
    if not sources:
        raise ValError(f"{config.yaml_file}: no '{split}' split in the dataset YAML")
    if not weights or not Path(weights).is_file():
        raise ValError(f"{weights}: weights file not found")
    device = select_device(device)
    half = half and device.type == "cuda"
    model = for_inference(load_model(weights, device=device))
    if half:
        model.half()
    names = ["item"] if single_cls and config.nc != 1 else config.names
    model_nc = int(model.model[-1].nc)
    if not single_cls and model_nc != config.nc:
        raise ValError(f"{weights} ({model_nc} classes) was trained on other data than {config.yaml_file} "
                       f"({config.nc} classes); pass matching --data and --weights")
    stride = int(model.stride.max())
    imgsz = _check_imgsz(imgsz, stride)
    save_dir = increment_path(Path(project) / name, exist_ok=exist_ok, mkdir=True)
    pad, rect = (0.0, False) if task == "speed" else (0.5, True)
    loader, _ = create_dataloader(sources, imgsz, batch_size, stride, rect=rect, pad=pad, workers=workers,
                                  single_cls=single_cls, names=config.names, prefix=f"{split}: ")
    _warmup(model, device, imgsz)
    result = validate(model, loader, names, device, conf_thres=conf_thres, iou_thres=iou_thres, max_det=max_det,
                      save_dir=save_dir, plots=plots, half=half, verbose=verbose, single_cls=single_cls,
                      save_json=save_json, save_txt=save_txt, save_conf=save_conf,
                      json_name=f"{Path(weights).stem}_predictions.json")
    if save_txt:
        count = len(list((save_dir / "labels").glob("*.txt")))
        LOGGER.info("%d labels saved to %s", count, save_dir / "labels")
    LOGGER.info("Results saved to %s", save_dir)
    return result


def _warn_unsupported(augment: bool, save_hybrid: bool, dnn: bool) -> None:
    if augment:
        LOGGER.warning("WARNING: --augment (test-time augmentation) is not supported; validating without it")
    if save_hybrid:
        LOGGER.warning("WARNING: --save-hybrid is not supported; ignored")
    if dnn:
        LOGGER.info("--dnn ignored (PyTorch weights only)")


def _load_data(data):
    from utils.data.dataset_yaml import load_data_config
    if data is None:
        from utils.data.synthetic import ensure_default_dataset
        data = ensure_default_dataset()
    return load_data_config(data)


def _check_imgsz(imgsz, stride: int) -> int:
    size = int(imgsz[0] if isinstance(imgsz, (list, tuple)) else imgsz)
    rounded = max(int(np.ceil(size / stride) * stride), stride)
    if rounded != size:
        LOGGER.warning("WARNING: --img-size %d must be a multiple of max stride %d, updating to %d", size, stride,
                       rounded)
    return rounded


def _warmup(model, device, imgsz: int) -> None:
    """One forward pass so one-time setup (allocations, kernel selection) is not timed as inference."""
    image = torch.zeros(1, 3, imgsz, imgsz, device=device, dtype=_dtype(model))
    if is_channels_last(model):
        image = image.to(memory_format=torch.channels_last)
    with torch.inference_mode():
        model(image)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="val.py", description="Validate a detector on a dataset split")
    parser.add_argument("--data", type=str, default=None, help="dataset.yaml path (default: embedded dataset)")
    parser.add_argument("--weights", nargs="+", type=str, default=["yolov5s.pt"], help="model path(s)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size")
    parser.add_argument("--imgsz", "--img", "--img-size", type=int, default=640, help="inference size (pixels)")
    parser.add_argument("--conf-thres", type=float, default=0.001, help="confidence threshold")
    parser.add_argument("--iou-thres", type=float, default=0.6, help="NMS IoU threshold")
    parser.add_argument("--max-det", type=int, default=300, help="maximum detections per image")
    parser.add_argument("--task", default="val", choices=("val", "test", "speed"), help="val, test or speed")
    add_device_flag(parser)
    parser.add_argument("--workers", type=int, default=8, help="max dataloader workers")
    parser.add_argument("--single-cls", action="store_true", help="treat as single-class dataset")
    parser.add_argument("--augment", action="store_true", help="augmented inference (not supported)")
    parser.add_argument("--verbose", action="store_true", help="report mAP by class")
    parser.add_argument("--save-txt", action="store_true", help="save results to *.txt")
    parser.add_argument("--save-hybrid", action="store_true", help="save label+prediction hybrid (not supported)")
    parser.add_argument("--save-conf", action="store_true", help="save confidences in --save-txt labels")
    parser.add_argument("--save-json", action="store_true", help="save a COCO-JSON results file")
    add_run_folder_flags(parser, str(ROOT / "runs/val"))
    add_half_flag(parser)
    parser.add_argument("--dnn", action="store_true", help="use OpenCV DNN for ONNX inference (ignored)")
    args = parser.parse_args(argv)
    args.save_json |= bool(args.data) and str(args.data).endswith("coco.yaml")
    return args


def _user_errors() -> tuple:
    """Exceptions that report a user mistake (bad file, flag or data), printed as one line."""
    from models.yolo import ModelConfigError
    from utils.checkpoint import CheckpointError
    from utils.config import ConfigError
    from utils.data.dataset import CacheError
    from utils.data.dataset_yaml import DataConfigError
    from utils.data.images import ImageError
    from utils.data.verify import DatasetError
    from utils.device import DeviceError
    return (ValError, CheckpointError, ConfigError, CacheError, DataConfigError, DatasetError, DeviceError, ImageError,
            ModelConfigError, FileNotFoundError)


def main(argv=None) -> int:
    args = parse_args(argv)
    from utils.loggers import setup_logging
    from utils.memory import keep_freed_memory

    setup_logging()
    keep_freed_memory()  # whole-process choice: see utils/memory.py
    options = vars(args).copy()
    weights = options.pop("weights")
    try:
        for weight in weights:
            run(weights=weight, **options)
    except _user_errors() as error:
        print(f"val.py: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("val.py: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
