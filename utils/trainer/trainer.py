"""train(config, hyp): the coordinator of one training run.

Flow: config -> dataset YAML -> loaders -> model (YAML or weights) -> optimizer, scheduler, EMA ->
epochs of steps -> validation on the EMA model -> checkpoints, results.csv, plots (main process only).
Resume and evolution reuse this flow; DDP changes only the sampler, the model wrapper, the reductions
and who writes.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch
import yaml

from utils import dist
from utils.checkpoint import model_state, save_checkpoint
from utils.config import Hyp, TrainConfig
from utils.device import select_device
from utils.loggers import RESULTS_KEYS, CSVLogger, TensorBoardLogger
from utils.loss import ComputeLoss
from utils.trainer.amp import choose_precision, use_channels_last
from utils.trainer.callbacks import Callbacks
from utils.trainer.ema import ModelEMA
from utils.trainer.loop import TrainStep, make_warmup, train_one_epoch
from utils.trainer.optim import accumulate_steps, build_optimizer, lr_lambda, scaled_weight_decay, warmup_iterations
from utils.trainer.setup import build_training_model, check_img_size, freeze_layers, seed_everything
from utils.trainer.stages import build_loaders, final_validation, validate_epoch

LOGGER = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "yolo-trainer/1"


@dataclass
class TrainResult:
    save_dir: Path
    best: Path | None
    last: Path | None
    final_metrics: dict = field(default_factory=dict)
    epochs_run: int = 0


def fitness_of(values: dict[str, float]) -> float:
    return 0.1 * values["metrics/mAP_0.5"] + 0.9 * values["metrics/mAP_0.5:0.95"]


def train(config: TrainConfig, hyp: Hyp, callbacks: Callbacks | None = None) -> TrainResult:
    callbacks = callbacks or Callbacks()
    info = dist.dist_info()
    device = select_device(config.device, info.local_rank)
    dist.init_distributed(device)
    save_dir = Path(config.save_dir)
    weights_dir = save_dir / "weights"
    if dist.is_main_process():
        weights_dir.mkdir(parents=True, exist_ok=True)
        _save_yaml(save_dir / "hyp.yaml", hyp.to_dict())
        _save_yaml(save_dir / "opt.yaml", config.to_dict())
    seed_everything(config.seed + 1 + max(info.rank, 0), config.deterministic)

    data = build_loaders(config, hyp, info)  # also builds the model (it needs nc) and val loader
    model, train_loader, val_loader, names = data.model, data.train_loader, data.val_loader, data.names
    model = model.to(device)
    channels_last = use_channels_last(config.channels_last, device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    freeze_layers(model, config.freeze)

    batches_per_epoch = len(train_loader)
    accumulate = accumulate_steps(config.batch_size)
    weight_decay = scaled_weight_decay(hyp.weight_decay, config.batch_size, accumulate)
    optimizer = build_optimizer(model, config.optimizer, hyp.lr0, hyp.momentum, weight_decay)
    lf = lr_lambda(config.epochs, hyp.lrf, cos=config.cos_lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    ema = ModelEMA(model) if dist.is_main_process() else None
    precision = choose_precision(config.amp, device, model)
    compute_loss = ComputeLoss(model, hyp, imgsz=data.imgsz, label_smoothing=config.label_smoothing)

    train_model = model
    if info.distributed:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    step = TrainStep(train_model, optimizer, compute_loss, precision, ema, channels_last, info.world_size)
    warmup_iters = warmup_iterations(hyp.warmup_epochs, batches_per_epoch)
    warmup = make_warmup(optimizer, warmup_iters, lf, hyp, config.batch_size)
    multi_scale = data.multi_scale_size if config.multi_scale else None

    batch_hook = _batch_plotter(save_dir, names) if dist.is_main_process() and not config.noplots else None
    csv_logger, tb_logger = CSVLogger(save_dir), TensorBoardLogger(save_dir)
    best_fitness, patience_left = -1.0, config.patience
    last, best = weights_dir / "last.pt", weights_dir / "best.pt"
    callbacks.run("on_train_start", save_dir=save_dir, model=model, config=config)
    LOGGER.info("Image sizes %d train, %d val\nUsing %d dataloader workers\nLogging results to %s\n"
                "Starting training for %d epochs...", data.imgsz, data.imgsz, data.workers, save_dir, config.epochs)
    start = time.time()
    epoch, maps = -1, None
    for epoch in range(config.epochs):
        data.set_epoch(epoch)
        if config.image_weights:
            data.update_image_weights(maps)
        stats = train_one_epoch(step, train_loader, epoch, config.epochs, device, warmup, multi_scale, batch_hook)
        learning_rates = [group["lr"] for group in optimizer.param_groups]
        scheduler.step()
        final_epoch = epoch + 1 == config.epochs
        values, fitness = None, None
        if dist.is_main_process():
            val_start = time.perf_counter()
            metrics = None
            if not config.noval or final_epoch:
                metrics = validate_epoch(ema.ema, val_loader, names, device, compute_loss, save_dir,
                                         plots=final_epoch and not config.noplots)
            stats.validation_time = time.perf_counter() - val_start
            values = _epoch_values(stats, metrics, learning_rates)
            maps = metrics.maps if metrics is not None else maps
            fitness = fitness_of(values) if metrics is not None else 0.0
            csv_logger.log(epoch, values)
            tb_logger.log(epoch, values)
            improved = fitness > best_fitness
            if improved:
                best_fitness, patience_left = fitness, config.patience
            else:
                patience_left -= 1
            if not config.nosave or final_epoch:
                checkpoint = _training_checkpoint(model, ema, optimizer, epoch, best_fitness, config, hyp, step)
                save_checkpoint(checkpoint, last)
                if improved:
                    save_checkpoint(checkpoint, best)
                if config.save_period > 0 and (epoch + 1) % config.save_period == 0:
                    save_checkpoint(checkpoint, weights_dir / f"epoch{epoch}.pt")
                callbacks.run("on_model_save", epoch=epoch, last=last, best=best if improved else None)
            callbacks.run("on_fit_epoch_end", epoch=epoch, values=values, fitness=fitness, stats=stats)
        stop, maps = dist.broadcast_object((patience_left <= 0, maps) if dist.is_main_process() else None)
        if stop and not final_epoch:
            LOGGER.info("Stopping training early as no improvement observed in last %d epochs. "
                        "Best results observed at epoch %d.", config.patience, epoch + 1 - config.patience)
            break

    result = TrainResult(save_dir, best if best.exists() else None, last if last.exists() else None, epochs_run=epoch + 1)
    if dist.is_main_process():
        LOGGER.info("\n%d epochs completed in %.3f hours.", epoch + 1, (time.time() - start) / 3600)
        result.final_metrics = final_validation(config, last, best, val_loader, names, device, compute_loss, save_dir)
        tb_logger.close()
        callbacks.run("on_train_end", save_dir=save_dir, best=result.best, results=result.final_metrics)
    dist.cleanup()
    return result


def _epoch_values(stats, metrics, learning_rates) -> dict[str, float]:
    box, obj, cls = stats.mean_losses.tolist()
    if metrics is None:
        precision = recall = map50 = map5095 = 0.0
        val_losses = [0.0, 0.0, 0.0]
    else:
        precision, recall, map50, map5095 = metrics.mp, metrics.mr, metrics.map50, metrics.map
        val_losses = [float(x) for x in metrics.losses]
    numbers = [box, obj, cls, precision, recall, map50, map5095, *val_losses, *learning_rates[:3]]
    numbers += [0.0] * (len(RESULTS_KEYS) - len(numbers))
    return dict(zip(RESULTS_KEYS, (float(x) for x in numbers)))


def _training_checkpoint(model, ema, optimizer, epoch, best_fitness, config, hyp, step) -> dict:
    """Everything needed to resume exactly; plain data only (loads with weights_only=True)."""
    base = model.module if hasattr(model, "module") else model
    return {
        "format": CHECKPOINT_FORMAT,
        "model": model_state(base),
        "ema": model_state(ema.ema) if ema is not None else None,
        "ema_updates": ema.updates if ema is not None else 0,
        "optimizer": optimizer.state_dict(),
        "scaler": step.precision.scaler.state_dict(),
        "global_step": step.counters.global_step,
        "epoch": epoch,
        "best_fitness": float(best_fitness),
        "config": config.to_dict(),
        "hyp": hyp.to_dict(),
        "date": datetime.now().isoformat(timespec="seconds"),
    }


def _batch_plotter(save_dir: Path, names: list[str]):
    """train_batch0..2.jpg: the first three augmented batches with their boxes."""
    from utils.drawing import plot_images

    def hook(epoch, batch_index, images, targets, paths):
        if epoch == 0 and batch_index < 3:
            plot_images(images, targets, paths, save_dir / f"train_batch{batch_index}.jpg", names)
    return hook


def _save_yaml(path: Path, values: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(values, f, sort_keys=False)
