"""train(config, hyp): the coordinator of one training run.

Flow: config -> dataset YAML -> loaders -> model (YAML or weights) -> optimizer, scheduler, EMA ->
epochs of steps -> validation on the EMA model -> checkpoints, results.csv, plots (main process only).
Resume and evolution reuse this flow; DDP changes only the sampler, the model wrapper, the reductions
and who writes.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import yaml

from models.fused import FusedCopy
from utils import dist
from utils.config import Hyp, TrainConfig
from utils.device import select_device
from utils.loss import ComputeLoss
from utils.trainer.amp import choose_precision, use_channels_last
from utils.trainer.callbacks import Callbacks
from utils.trainer.ema import ModelEMA
from utils.trainer.loop import TrainStep, make_warmup, train_one_epoch
from utils.trainer.optim import accumulate_steps, build_optimizer, lr_lambda, scaled_weight_decay, warmup_iterations
from utils.trainer.recorder import Recorder, epoch_values, fitness_of, training_checkpoint
from utils.trainer.setup import freeze_layers, seed_everything
from utils.trainer.stages import build_loaders, final_validation, validate_epoch

LOGGER = logging.getLogger(__name__)


@dataclass
class TrainResult:
    save_dir: Path
    best: Path | None
    last: Path | None
    final_metrics: dict = field(default_factory=dict)
    epochs_run: int = 0


def train(config: TrainConfig, hyp: Hyp, callbacks: Callbacks | None = None) -> TrainResult:
    callbacks = callbacks or Callbacks()
    info = dist.dist_info()
    device = select_device(config.device, info.local_rank)
    dist.init_distributed(device)
    save_dir = Path(config.save_dir)
    if dist.is_main_process():
        (save_dir / "weights").mkdir(parents=True, exist_ok=True)
        _save_yaml(save_dir / "hyp.yaml", hyp.to_dict())
        _save_yaml(save_dir / "opt.yaml", config.to_dict())
    seed_everything(config.seed + 1 + max(info.rank, 0), config.deterministic)

    data = build_loaders(config, hyp, info)  # also builds the model (it needs nc) and the val loader
    step, scheduler, warmup = _build_step(data.model.to(device), config, hyp, data, device, info)
    model = data.model
    eval_model = FusedCopy(step.ema.ema) if step.ema is not None else None  # what validation runs
    recorder = Recorder(save_dir, config.patience, config.save_period, config.nosave) if dist.is_main_process() else None
    batch_hook = _batch_plotter(save_dir, data.names) if dist.is_main_process() and not config.noplots else None
    multi_scale = data.multi_scale_size if config.multi_scale else None
    callbacks.run("on_train_start", save_dir=save_dir, model=model, config=config)
    LOGGER.info("Image sizes %d train, %d val\nUsing %d dataloader workers\nLogging results to %s\n"
                "Starting training for %d epochs...", data.imgsz, data.imgsz, data.workers, save_dir, config.epochs)
    start = time.time()
    epoch, maps, stop = -1, None, False
    for epoch in range(config.epochs):
        data.set_epoch(epoch)
        if config.image_weights:
            data.update_image_weights(maps)
        stats = train_one_epoch(step, data.train_loader, epoch, config.epochs, device, warmup, multi_scale, batch_hook)
        learning_rates = [group["lr"] for group in step.optimizer.param_groups]
        scheduler.step()
        final_epoch = epoch + 1 == config.epochs
        if recorder is not None:
            state = partial(training_checkpoint, model, step.ema, step.optimizer, step.precision.scaler, epoch,
                            step.counters.global_step, config=config, hyp=hyp)
            epoch_maps = _end_epoch(recorder, step, eval_model, data, stats, epoch, final_epoch, learning_rates, state,
                                    config, device, save_dir, callbacks)
            maps = epoch_maps if epoch_maps is not None else maps
            stop = recorder.should_stop(epoch)
        stop, maps = dist.broadcast_object((stop, maps) if dist.is_main_process() else None)
        if stop and not final_epoch:
            LOGGER.info("Stopping training early as no improvement observed in last %d epochs. "
                        "Best results observed at epoch %d.", config.patience, recorder.best_epoch if recorder else -1)
            break
    return _finish(config, recorder, data, device, step.compute_loss, save_dir, epoch, start, callbacks)


def _end_epoch(recorder, step, eval_model, data, stats, epoch, final_epoch, learning_rates, state, config, device,
               save_dir, callbacks):
    """Main process: validate the EMA model (through its fused copy), log the row, save checkpoints.
    Returns per-class mAPs or None."""
    val_start = time.perf_counter()
    metrics = None
    if not config.noval or final_epoch:
        metrics = validate_epoch(eval_model.refresh(), data.val_loader, data.names, device, step.compute_loss, save_dir,
                                 plots=final_epoch and not config.noplots,
                                 half=step.precision.dtype == torch.float16)  # CUDA AMP runs validate in fp16
    stats.validation_time = time.perf_counter() - val_start
    values = epoch_values(stats.mean_losses.tolist(), metrics, learning_rates)
    recorder.end_epoch(epoch, values, metrics is not None, final_epoch, state)
    fitness = fitness_of(values) if metrics is not None else 0.0
    callbacks.run("on_fit_epoch_end", epoch=epoch, values=values, fitness=fitness, stats=stats)
    return metrics.maps if metrics is not None else None


def _build_step(model, config: TrainConfig, hyp: Hyp, data, device, info):
    """Memory format, frozen layers, optimizer, LR schedule, EMA, precision, loss and DDP wrapper."""
    channels_last = use_channels_last(config.channels_last, device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    freeze_layers(model, config.freeze)
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
    warmup_iters = warmup_iterations(hyp.warmup_epochs, len(data.train_loader))
    warmup = make_warmup(optimizer, warmup_iters, lf, hyp, config.batch_size)
    return step, scheduler, warmup


def _finish(config, recorder, data, device, compute_loss, save_dir, epoch, start, callbacks) -> TrainResult:
    result = TrainResult(save_dir, None, None, epochs_run=epoch + 1)
    if recorder is not None:
        LOGGER.info("\n%d epochs completed in %.3f hours.", epoch + 1, (time.time() - start) / 3600)
        result.final_metrics = final_validation(config, recorder.last, recorder.best, data.val_loader, data.names,
                                                device, compute_loss, save_dir)
        result.best = recorder.best if recorder.best.exists() else None
        result.last = recorder.last if recorder.last.exists() else None
        recorder.close()
        callbacks.run("on_train_end", save_dir=save_dir, best=result.best, results=result.final_metrics)
    dist.cleanup()
    return result


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
