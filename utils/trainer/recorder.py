"""What the main process writes as a run goes: results.csv / --ndjson-* / TensorBoard rows, the experiment trackers' runs
(utils.trackers) and the last, best and periodic checkpoints. Best fitness and early stopping live in the run's state
(utils.trainer.state)."""
from __future__ import annotations

import logging
from pathlib import Path

from utils.checkpoint import copy_checkpoint, save_checkpoint
from utils.loggers import RESULTS_KEYS, CSVLogger, NDJSONLogger, TensorBoardLogger
from utils.trackers import Trackers, open_trackers

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


# files of the run folder a finished run gives its trackers besides the plots and best.pt
RUN_FILES = ("results.csv", "opt.yaml", "hyp.yaml", "anchors.yaml", "labels.jpg", "labels_correlogram.jpg")


def open_recorder(config, hyp, save_dir: Path, state, resumed: bool) -> "Recorder":
    """The run's Recorder: TensorBoard (off with --no-tensorboard; a resumed run hides what an earlier process logged
    past the checkpoint's position) and the experiment trackers that are on (off with --no-trackers; a resumed run
    continues the runs its checkpoint names)."""
    tensorboard = TensorBoardLogger(save_dir, enabled=config.tensorboard, purge_step=state.epoch if resumed else None)
    ndjson = NDJSONLogger(save_dir, console=config.ndjson_console, file=config.ndjson_file)
    return Recorder(save_dir, config.save_period, tensorboard, open_trackers(config, hyp, save_dir, state.tracker_runs),
                    ndjson)


class Recorder:
    """results.csv (and results.ndjson), TensorBoard, the experiment trackers and checkpoints of one run folder (main
    process only)."""

    def __init__(self, save_dir: Path, save_period: int = -1, tensorboard: TensorBoardLogger | None = None,
                 trackers: Trackers | None = None, ndjson: NDJSONLogger | None = None):
        self.save_dir = Path(save_dir)
        self.weights_dir = self.save_dir / "weights"
        self.last, self.best = self.weights_dir / "last.pt", self.weights_dir / "best.pt"
        self.csv = CSVLogger(save_dir)
        self.ndjson = ndjson or NDJSONLogger(save_dir)  # none given: neither the console's lines nor the file
        self.tensorboard = tensorboard or TensorBoardLogger(save_dir, enabled=False)  # none given: no TensorBoard
        self.trackers = trackers or Trackers([])  # none given: no trackers
        self.save_period = save_period

    def restart_results(self, rows: list[dict]) -> None:
        """results.csv holds exactly the rows of the state being started or resumed (a row written after
        the last checkpoint, by a run killed in between, is dropped, so no epoch appears twice); the trackers
        start (or continue) their runs, given the rows they may lack (an epoch they have is not logged again)."""
        self.csv.rewrite(rows)
        self.ndjson.rewrite(rows)
        self.trackers.start(rows)

    def log(self, epoch: int, values: dict[str, float]) -> None:
        self.csv.log(epoch, values)
        self.ndjson.log(epoch, values)
        self.tensorboard.log(epoch, values)
        self.trackers.log_epoch(epoch, values)

    def log_images(self, paths, step: int) -> None:
        """Plot files the run wrote, shown in TensorBoard at ``step`` and given to the trackers."""
        self.tensorboard.log_images(paths, step)
        self.trackers.log_files(paths)

    def tracker_runs(self) -> dict[str, str]:
        """The trackers' run ids (tracker name -> id) for the checkpoint: a --resume continues those runs."""
        return self.trackers.run_ids()

    def save(self, checkpoint: dict, epoch: int | None = None, improved: bool = False) -> None:
        """last.pt (keeping the previous one until the new one is complete); at the end of an ``epoch``
        also best.pt when it ``improved`` and epoch<N>.pt every --save-period epochs: epochs 0, N, 2N, ... as YOLOv5
        v7's train.py saves them (hard links to last.pt: the same bytes, not serialised again)."""
        save_checkpoint(checkpoint, self.last, keep_previous=True)
        if epoch is None:
            return
        if improved:
            copy_checkpoint(self.last, self.best)
        if self.save_period > 0 and epoch % self.save_period == 0:
            copy_checkpoint(self.last, self.weights_dir / f"epoch{epoch}.pt")
            self.trackers.log_files([self.weights_dir / f"epoch{epoch}.pt"], "weights")  # as YOLOv5's W&B logger

    def close(self, finished: bool = False) -> None:
        """End the run's logs: a ``finished`` run gives its trackers best.pt (stripped) and its files first; any other
        end (a signal, an error) marks the trackers' runs stopped. Safe to call again."""
        if finished:
            self.trackers.log_files([self.save_dir / name for name in RUN_FILES if (self.save_dir / name).is_file()])
            self.trackers.log_files([self.best] if self.best.is_file() else [], "weights")
        self.trackers.close(finished)
        self.tensorboard.close()
