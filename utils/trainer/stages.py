"""The stages around the epoch loop: the dataset and its loaders, per-epoch validation, and the end of
a run (stripping the checkpoints, the final validation of best.pt)."""
from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from utils import dist
from utils.checkpoint import copy_checkpoint, previous_path, strip_checkpoint
from utils.config import ConfigError, Hyp, TrainConfig
from utils.coco import coco_val
from utils.data.dataset_yaml import DataConfig, load_data_config
from utils.data.dataset import class_weights
from utils.data.loader import EpochStream, create_dataloader, set_loader_image_weights
from utils.data.transforms import multi_scale_size
from utils.device import compute_fills_cpus
from utils.trainer.setup import check_img_size, resolve_data

LOGGER = logging.getLogger(__name__)


@dataclass
class RunData:
    train_loader: object
    val_loader: object | None
    names: list[str]
    imgsz: int
    grid_stride: int
    workers: int
    seed: int
    batches_per_epoch: int
    labels: np.ndarray  # (n, 5) every training box [class, cx, cy, w, h] normalised (labels.jpg)
    image_labels: object  # per training image, (n, 5) like labels (AutoAnchor): a list-like view
    image_shapes: np.ndarray  # (N, 2) width, height of each training image
    class_weights: np.ndarray  # 1 / class frequency in the train labels, for --image-weights
    coco: object = None  # utils.coco.CocoVal when the val split is COCO's val2017 (the final validation's JSON)
    stream: EpochStream | None = None  # the training loader's iterator across epochs (utils.data.loader)
    batches: object = None  # the current epoch's training batches (set_epoch)

    def set_epoch(self, epoch: int, start_batch: int = 0, through: int | None = None) -> None:
        """Start (or, from ``start_batch``, continue) ``epoch``: sampler order, augmentation and the
        --multi-scale sizes are those of an uninterrupted run; ``batches`` holds the epoch's batches, from an
        iterator that may go on into the epochs up to ``through`` (EpochStream: the workers build the next epoch's
        first batches while this one ends)."""
        if self.stream is None:
            self.stream = EpochStream(self.train_loader)
        self.batches = self.stream.epoch(epoch, start_batch, through)
        self._rng = np.random.default_rng((self.seed, epoch))
        for _ in range(start_batch):
            self.multi_scale_size()

    def update_image_weights(self, maps) -> None:
        """--image-weights: favour images holding classes with low validation mAP (YOLOv5's rule)."""
        nc = len(self.names)
        maps = np.zeros(nc) if maps is None else np.asarray(maps, np.float64)
        set_loader_image_weights(self.train_loader, self.class_weights * (1 - maps) ** 2 / nc)

    def multi_scale_size(self) -> tuple[int, int]:
        """(random training size in [0.5, 1.5] x imgsz, the grid stride it is a multiple of)."""
        return multi_scale_size(self.imgsz, self.grid_stride, self._rng), self.grid_stride


def load_data(config: TrainConfig) -> tuple[DataConfig, list[str]]:
    """The dataset YAML (the embedded default dataset when --data is empty) and the class names to train."""
    data_yaml = resolve_data(config.data)
    with dist.main_process_first("prepare the dataset (the default one is generated on first use)"):
        data_cfg = load_data_config(data_yaml)
    names = ["item"] if config.single_cls and len(data_cfg.names) != 1 else list(data_cfg.names)
    return data_cfg, names


def scan_labels(sources, names: list[str], single_cls: bool, prefix: str):
    """The split's verified labels (utils.data.verify.scan_split), scanned once per machine: the main process
    first (it writes the label cache), then each other machine's first process (which reads that cache on a
    shared file system, or scans and writes its own), then the rest, who read the cache."""
    from utils.data.verify import scan_split

    with dist.main_process_first(f"scan the {prefix.rstrip(': ')} labels"):
        return scan_split(sources, len(names), prefix=prefix, single_cls=single_cls)


def build_data(config: TrainConfig, hyp: Hyp, data_cfg: DataConfig, names: list[str], grid_stride: int,
               info, device) -> RunData:
    """The train loader and the val loader, each process its own shard of both. Labels are scanned once per
    machine (``scan_labels``); an image cache is one store per machine that the processes fill together
    (utils.data.image_cache), so every process builds the loaders at the same time."""
    imgsz = check_img_size(config.imgsz, grid_stride, floor=grid_stride * 2)
    if config.augment_device and torch.device(device).type == "cpu":
        LOGGER.warning("WARNING: --augment-device renders the augmentation with torch on the CPU, which is no faster "
                       "there than the OpenCV path (docs/device-augmentation.md); it is meant for a GPU")
    batch_size = max(config.batch_size // info.world_size, 1)
    cpus_busy = compute_fills_cpus(device, info.local_world_size)
    common = {"names": names, "single_cls": config.single_cls, "rank": info.rank, "world_size": info.world_size,
              "processes_per_node": info.local_world_size, "cpus_busy": cpus_busy, "cache": config.cache}
    train_loader, dataset = create_dataloader(
        data_cfg.train, imgsz, batch_size, grid_stride, hyp=hyp, augment=True, rect=config.rect,
        workers=config.workers, image_weights=config.image_weights, prefix="train: ", shuffle=not config.rect,
        seed=config.seed, mosaic_partners=config.mosaic_partners, augment_device=config.augment_device,
        decode_device=config.decode_device,
        labels=scan_labels(data_cfg.train, names, config.single_cls, "train: "), **common)
    labels = dataset.flat.boxes
    if len(labels) and labels[:, 0].max() >= len(names):
        raise ConfigError(f"{data_cfg.yaml_file}: label class {int(labels[:, 0].max())} exceeds nc={len(names)}")
    val_loader, _ = create_dataloader(  # every process validates its own whole batches
        data_cfg.val, imgsz, batch_size * 2, grid_stride, hyp=hyp, augment=False, rect=True, pad=0.5,
        workers=config.workers * 2, prefix="val: ", shard="batches",
        labels=scan_labels(data_cfg.val, names, config.single_cls, "val: "), **common)
    workers = getattr(train_loader, "num_workers", 0)
    run_data = RunData(train_loader, val_loader, names, imgsz, grid_stride, workers, config.seed, len(train_loader),
                       labels, dataset.labels, dataset.shapes, class_weights(dataset.labels, len(names)),
                       coco_val(data_cfg))
    run_data.set_epoch(0)
    return run_data


def fit_anchors(model, config: TrainConfig, hyp: Hyp, data: RunData) -> None:
    """AutoAnchor before a new run (utils.autoanchor): computed once, on the main process, and sent to every
    process. A YAML that gives an anchor count needs it; --noautoanchor keeps the model's anchors."""
    from utils.autoanchor import anchor_pixels, adapt_anchors, set_anchors

    placeholder = getattr(model, "anchors_placeholder", False)
    if config.noautoanchor:
        if placeholder:
            raise ConfigError(f"{config.cfg or config.weights}: the model YAML gives an anchor count ('anchors: <n>'), "
                              "which AutoAnchor turns into anchors: drop --noautoanchor or give pixel anchors")
        return
    anchors = None
    if dist.is_main_process():
        adapt_anchors(model, data.image_labels, data.image_shapes, data.imgsz, thr=hyp.anchor_t, seed=config.seed)
        anchors = anchor_pixels(model).reshape(-1, 2)
    anchors = dist.broadcast_object(anchors, phase="run AutoAnchor")
    if not dist.is_main_process():
        set_anchors(model, anchors)


def validate_epoch(model, val_loader, names, device, compute_loss, save_dir, plots: bool, verbose: bool = False,
                   precision=None, distributed: bool = False, first_batch=None, **options):
    """Validate in the precision training computes in (``precision``: utils.trainer.amp.Precision, None for
    fp32), as YOLOv5 validates in fp16 when it trains with AMP: fp16 on CUDA, bf16 autocast where training
    runs bf16 autocast (CPUs with AMX under --amp auto, or --amp bf16). ``first_batch``: called with the first
    batch's images, predictions and paths; ``options``: other keywords of utils.validation.validate."""
    from utils.validation import validate

    dtype = precision.dtype if precision is not None else None
    autocast = precision.autocast() if dtype == torch.bfloat16 else nullcontext()
    with autocast:
        return validate(model, val_loader, names, device, compute_loss=compute_loss, save_dir=Path(save_dir),
                        plots=plots, verbose=verbose, half=dtype == torch.float16, distributed=distributed,
                        first_batch=first_batch, **options)


def strip_last_and_best(last: Path, best: Path) -> None:
    """Strip the run's last.pt and best.pt. When the last epoch was the best, best.pt is a link to last.pt's file
    (``copy_checkpoint``): that file is stripped once and best.pt linked to the result, which is the file stripping
    it again would write (the same content, byte for byte), without a second load and save."""
    same = last.exists() and best.exists() and os.path.samefile(last, best)
    if last.exists():
        strip_checkpoint(last)
    if same:
        copy_checkpoint(last, best)
        LOGGER.info("Optimizer stripped from %s, %.1fMB (the same file as %s)", best, best.stat().st_size / 1e6,
                    last.name)
    elif best.exists():
        strip_checkpoint(best)


def final_validation(config: TrainConfig, weights_dir: Path, val_loader, names, device, compute_loss, save_dir,
                     distributed: bool = False, precision=None, coco=None, callbacks=None):
    """Strip last.pt / best.pt (main process), validate best.pt with the per-class table and plots (every
    process its share; the weights are sent from the main process, so no other node needs the file), draw
    results.png. (metrics, utils.validation.ValResult), both empty (``{}``, None) without a best.pt. On COCO's
    val2017 (``coco``: utils.coco.CocoVal) as YOLOv5: NMS IoU 0.65 and best_predictions.json scored by pycocotools."""
    from models import build_model
    from utils.checkpoint import load_checkpoint, model_entry

    last, best = weights_dir / "last.pt", weights_dir / "best.pt"
    entry = None
    if dist.is_main_process():
        strip_last_and_best(last, best)
        previous_path(last).unlink(missing_ok=True)  # kept only while the run could be resumed
        entry = model_entry(load_checkpoint(best)) if best.exists() else None
    if distributed:
        entry = dist.broadcast_object(entry, phase="strip the checkpoints and send best.pt")
    metrics, result = {}, None
    if entry is not None:
        LOGGER.info("\nValidating %s...", best)
        model = build_model(entry, source=str(best)).to(device).eval()
        coco_options = {"iou_thres": 0.65, "save_json": True, "coco": coco, "json_name": "best_predictions.json"}
        result = validate_epoch(model, val_loader, names, device, compute_loss, save_dir,
                                plots=not config.noplots, verbose=True, precision=precision, distributed=distributed,
                                callbacks=callbacks, **(coco_options if coco is not None else {}))
        metrics = {"metrics/precision": result.mp, "metrics/recall": result.mr,
                   "metrics/mAP_0.5": result.map50, "metrics/mAP_0.5:0.95": result.map}
    if dist.is_main_process():
        if not config.noplots and (Path(save_dir) / "results.csv").exists():
            from utils.plots import plot_results

            plot_results(Path(save_dir) / "results.csv")
        LOGGER.info("Results saved to %s", save_dir)
    return metrics, result
