"""What the main process writes as a run goes: results.csv / TensorBoard rows and the last, best and
periodic checkpoints. Best fitness and early stopping live in the run's state (utils.trainer.state)."""
from __future__ import annotations

import logging
from pathlib import Path

from utils.checkpoint import copy_checkpoint, save_checkpoint
from utils.loggers import RESULTS_KEYS, CSVLogger, TensorBoardLogger

LOGGER = logging.getLogger(__name__)


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
    """results.csv, TensorBoard and checkpoints of one run folder (main process only)."""

    def __init__(self, save_dir: Path, save_period: int = -1, tensorboard: TensorBoardLogger | None = None):
        self.weights_dir = Path(save_dir) / "weights"
        self.last, self.best = self.weights_dir / "last.pt", self.weights_dir / "best.pt"
        self.csv = CSVLogger(save_dir)
        self.tensorboard = tensorboard or TensorBoardLogger(save_dir, enabled=False)  # none given: no TensorBoard
        self.save_period = save_period

    def restart_results(self, rows: list[dict]) -> None:
        """results.csv holds exactly the rows of the state being started or resumed (a row written after
        the last checkpoint, by a run killed in between, is dropped, so no epoch appears twice)."""
        self.csv.rewrite(rows)

    def log(self, epoch: int, values: dict[str, float]) -> None:
        self.csv.log(epoch, values)
        self.tensorboard.log(epoch, values)

    def log_images(self, paths, step: int) -> None:
        """Plot files the run wrote, shown in TensorBoard at ``step``."""
        self.tensorboard.log_images(paths, step)

    def save(self, checkpoint: dict, epoch: int | None = None, improved: bool = False) -> None:
        """last.pt (keeping the previous one until the new one is complete); at the end of an ``epoch``
        also best.pt when it ``improved`` and epoch<N>.pt every --save-period epochs (hard links to
        last.pt: the same bytes, not serialised again)."""
        save_checkpoint(checkpoint, self.last, keep_previous=True)
        if epoch is None:
            return
        if improved:
            copy_checkpoint(self.last, self.best)
        if self.save_period > 0 and (epoch + 1) % self.save_period == 0:
            copy_checkpoint(self.last, self.weights_dir / f"epoch{epoch}.pt")

    def close(self) -> None:
        self.tensorboard.close()
