"""What happens at the end of each epoch on the main process: results.csv / TensorBoard rows,
best-fitness tracking with early stopping, and last/best/periodic checkpoints."""
from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path

from utils.checkpoint import copy_checkpoint, model_state, save_checkpoint
from utils.loggers import RESULTS_KEYS, CSVLogger, TensorBoardLogger

LOGGER = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "yolo-trainer/1"


def fitness_of(values: dict[str, float]) -> float:
    """YOLOv5's fitness: 0.1 x mAP50 + 0.9 x mAP50-95 (P and R weigh 0)."""
    return 0.1 * values["metrics/mAP_0.5"] + 0.9 * values["metrics/mAP_0.5:0.95"]


def epoch_values(mean_losses, metrics, learning_rates) -> dict[str, float]:
    """One results.csv row (without the epoch) from train losses, validation metrics and group lrs."""
    if metrics is None:
        scores, val_losses = [0.0] * 4, [0.0] * 3
    else:
        scores = [metrics.mp, metrics.mr, metrics.map50, metrics.map]
        val_losses = [float(x) for x in metrics.losses]
    lrs = list(learning_rates[:3]) + [0.0] * (3 - len(learning_rates[:3]))
    numbers = [*[float(x) for x in mean_losses], *scores, *val_losses, *lrs]
    return dict(zip(RESULTS_KEYS, (float(x) for x in numbers)))


class Recorder:
    """Writes the run's per-epoch outputs; tracks best fitness and patience for early stopping."""

    def __init__(self, save_dir: Path, patience: int, save_period: int = -1, nosave: bool = False):
        self.weights_dir = Path(save_dir) / "weights"
        self.last, self.best = self.weights_dir / "last.pt", self.weights_dir / "best.pt"
        self.csv, self.tensorboard = CSVLogger(save_dir), TensorBoardLogger(save_dir)
        self.patience, self.save_period, self.nosave = patience, save_period, nosave
        self.best_fitness, self.best_epoch = -1.0, -1

    def should_stop(self, epoch: int) -> bool:
        return self.patience > 0 and epoch - self.best_epoch >= self.patience

    def end_epoch(self, epoch: int, values: dict[str, float], has_metrics: bool, final_epoch: bool,
                  training_state) -> bool:
        """Log the row, update best, write checkpoints. ``training_state()`` builds the checkpoint
        dict lazily (only when something is saved). Returns True when this epoch is the new best."""
        self.csv.log(epoch, values)
        self.tensorboard.log(epoch, values)
        fitness = fitness_of(values) if has_metrics else 0.0
        improved = fitness > self.best_fitness
        if improved:
            self.best_fitness, self.best_epoch = fitness, epoch
        if self.nosave and not final_epoch:
            return improved
        save_checkpoint(training_state(self.best_fitness), self.last)
        if improved:  # the same bytes: linked, not serialised again (~0.1 s per save for yolov5n)
            copy_checkpoint(self.last, self.best)
        if self.save_period > 0 and (epoch + 1) % self.save_period == 0:
            copy_checkpoint(self.last, self.weights_dir / f"epoch{epoch}.pt")
        return improved

    def close(self) -> None:
        self.tensorboard.close()


def training_checkpoint(model, ema, optimizer, scaler, epoch: int, global_step: int, best_fitness: float,
                        config, hyp) -> dict:
    """Everything needed to resume exactly; plain data only (loads with weights_only=True)."""
    base = model.module if hasattr(model, "module") else model
    return {
        "format": CHECKPOINT_FORMAT,
        "model": model_state(base),
        "ema": model_state(ema.ema) if ema is not None else None,
        "ema_updates": ema.updates if ema is not None else 0,
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "global_step": global_step,
        "epoch": epoch,
        "best_fitness": float(best_fitness),
        "config": config.to_dict(),
        "hyp": hyp.to_dict(),
        "date": datetime.now().isoformat(timespec="seconds"),
    }
