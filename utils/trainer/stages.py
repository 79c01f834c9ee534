"""The stages around the epoch loop: data + model setup, per-epoch validation, end-of-run stripping
and the final validation of best.pt."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from utils import dist
from utils.checkpoint import load_checkpoint, save_checkpoint
from utils.config import ConfigError, Hyp, TrainConfig
from utils.data.dataset_yaml import load_data_config
from utils.data.dataset import class_weights
from utils.data.loader import create_dataloader, set_loader_epoch, set_loader_image_weights
from utils.data.transforms import multi_scale_size
from utils.trainer.setup import build_training_model, check_img_size, resolve_data

LOGGER = logging.getLogger(__name__)


@dataclass
class RunData:
    model: torch.nn.Module
    train_loader: object
    val_loader: object | None
    names: list[str]
    imgsz: int
    grid_stride: int
    workers: int
    seed: int
    class_weights: np.ndarray  # 1 / class frequency in the train labels, for --image-weights

    def set_epoch(self, epoch: int) -> None:
        set_loader_epoch(self.train_loader, epoch)
        self._rng = np.random.default_rng((self.seed, epoch))

    def update_image_weights(self, maps: np.ndarray | None) -> None:
        """--image-weights: favour images holding classes with low validation mAP (YOLOv5's rule)."""
        nc = len(self.names)
        maps = np.zeros(nc) if maps is None else np.asarray(maps, np.float64)
        set_loader_image_weights(self.train_loader, self.class_weights * (1 - maps) ** 2 / nc)

    def multi_scale_size(self) -> tuple[int, int]:
        """(random training size in [0.5, 1.5] x imgsz, the grid stride it is a multiple of)."""
        return multi_scale_size(self.imgsz, self.grid_stride, self._rng), self.grid_stride


def build_loaders(config: TrainConfig, hyp: Hyp, info) -> RunData:
    """Dataset YAML -> model (nc from the data) -> train loader (+ val loader on the main process)."""
    data_yaml = resolve_data(config.data)
    with dist.main_process_first():
        data_cfg = load_data_config(data_yaml)
    names = ["item"] if config.single_cls and len(data_cfg.names) != 1 else list(data_cfg.names)
    model, _ = build_training_model(config.cfg, config.weights, len(names), names, anchors=hyp.anchors)
    _check_anchors(model, config)
    grid_stride = max(int(model.stride.max()), 32)
    imgsz = check_img_size(config.imgsz, grid_stride, floor=grid_stride * 2)
    batch_size = max(config.batch_size // info.world_size, 1)
    with dist.main_process_first():
        train_loader, dataset = create_dataloader(
            data_cfg.train, imgsz, batch_size, grid_stride, hyp=hyp, augment=True, cache=config.cache,
            rect=config.rect, workers=config.workers, image_weights=config.image_weights, prefix="train: ",
            shuffle=not config.rect, seed=config.seed, rank=info.rank, world_size=info.world_size,
            single_cls=config.single_cls, names=names)
    labels = np.concatenate([l for l in dataset.labels if len(l)], 0) if any(len(l) for l in dataset.labels) else np.zeros((0, 5))
    if len(labels) and labels[:, 0].max() >= len(names):
        raise ConfigError(f"{data_yaml}: label class {int(labels[:, 0].max())} exceeds nc={len(names)}")
    val_loader = None
    if dist.is_main_process():
        val_loader, _ = create_dataloader(
            data_cfg.val, imgsz, batch_size * 2, grid_stride, hyp=hyp, augment=False, cache=config.cache,
            rect=True, pad=0.5, workers=config.workers * 2, prefix="val: ", single_cls=config.single_cls,
            names=names)
        if not config.noplots:
            from utils.data.plots import plot_labels

            plot_labels(labels, names, Path(config.save_dir))
    workers = getattr(train_loader, "num_workers", 0)
    run_data = RunData(model, train_loader, val_loader, names, imgsz, grid_stride, workers, config.seed,
                       class_weights(dataset.labels, len(names)))
    run_data.set_epoch(0)
    return run_data


def _check_anchors(model, config: TrainConfig) -> None:
    if getattr(model, "anchors_placeholder", False):
        raise ConfigError(f"{config.cfg or config.weights}: the model YAML asks AutoAnchor to compute its anchors "
                          "(anchors: <count>), and AutoAnchor is not available yet; give pixel anchors in the YAML")
    if not config.noautoanchor:
        LOGGER.info("AutoAnchor: not available yet; training with the model's anchors (pass --noautoanchor to silence)")


def validate_epoch(model, val_loader, names, device, compute_loss, save_dir, plots: bool, verbose: bool = False,
                   half: bool = False):
    from utils.validation import validate

    return validate(model, val_loader, names, device, compute_loss=compute_loss, save_dir=Path(save_dir),
                    plots=plots, verbose=verbose, half=half)


def strip_training_state(path: Path) -> None:
    """Finish a checkpoint for use: EMA weights become the model (fp16), optimizer and EMA dropped."""
    checkpoint = load_checkpoint(path)
    entry = checkpoint.get("ema") or checkpoint["model"]
    entry = {**entry, "state_dict": {k: v.half() if v.is_floating_point() else v for k, v in entry["state_dict"].items()}}
    keep = {k: checkpoint[k] for k in ("format", "epoch", "best_fitness", "config", "hyp", "date") if k in checkpoint}
    save_checkpoint({**keep, "model": entry, "ema": None}, path)
    LOGGER.info("Optimizer stripped from %s, %.1fMB", path, path.stat().st_size / 1e6)


def final_validation(config: TrainConfig, last: Path, best: Path, val_loader, names, device, compute_loss, save_dir):
    """Strip last/best, validate best.pt with the per-class table and plots, draw results.png."""
    for path in (last, best):
        if path.exists():
            strip_training_state(path)
    metrics = {}
    if best.exists() and val_loader is not None:
        from models import load_model

        LOGGER.info("\nValidating %s...", best)
        model = load_model(best, device=device)
        result = validate_epoch(model, val_loader, names, device, compute_loss, save_dir,
                                plots=not config.noplots, verbose=True)
        metrics = {"metrics/precision": result.mp, "metrics/recall": result.mr,
                   "metrics/mAP_0.5": result.map50, "metrics/mAP_0.5:0.95": result.map}
    if not config.noplots and (Path(save_dir) / "results.csv").exists():
        from utils.plots import plot_results

        plot_results(Path(save_dir) / "results.csv")
    LOGGER.info("Results saved to %s", save_dir)
    return metrics
