"""--time HOURS: a training time budget (ultralytics' ``time=``; YOLOv5 has none).

The budget counts the run's training time: from the start of the first epoch to the end of the final
validation, summed over every process that trained the run (the time a run spends stopped before
``--resume`` does not count). After the first epoch the epoch count becomes what fits, at the mean
epoch time so far, in the budget less a reserve for the end of the run (``epochs_that_fit``), at most
--epochs (which stays the run's upper bound, so a run never trains more epochs than its options say and
its options stay the ones it was started with; train.py gives --time without --epochs an --epochs of
TIME_MAX_EPOCHS, so the budget alone decides, as ultralytics' time= overrides epochs); the
learning-rate schedule is then rebuilt to span that count (the trainer does that). After every later
epoch the same estimate is made again: the count and the schedule follow it (down whenever fewer epochs
fit, up when at least two more do, as the first epoch's one-off costs are averaged away), and the run stops
early when not even one more epoch fits. The count and the time spent are part of the run state
(utils.trainer.state), so a resumed run keeps them.
"""
from __future__ import annotations

import math
import time

clock = time.monotonic  # seconds; tests replace it with a controlled clock

END_RESERVE_VALIDATIONS = 2  # the final validation of best.pt, counted twice (a margin)
# Drawing the end-of-run plots (PR/F1/P/R curves, confusion matrix, validation batches, results.png) and showing
# them in TensorBoard: 8-10 s for a tiny run on a busy 2-core CPU (this project's tests); little on a fast machine
PLOTS_RESERVE_S = 10.0


def epochs_that_fit(budget_s: float, spent_s: float, epochs_done: int, reserve_s: float, most: int) -> int:
    """The run's total epoch count under a budget: the ``epochs_done`` (which took ``spent_s`` seconds) plus
    as many more epochs of their mean length as fit in ``budget_s`` less ``spent_s`` and ``reserve_s``
    (kept for the final validation), at most ``most`` (--epochs); never fewer than the epochs done, at least 1."""
    done = max(int(epochs_done), 1)
    mean_epoch = spent_s / done
    left = budget_s - spent_s - reserve_s
    more = math.floor(left / mean_epoch) if mean_epoch > 0 and left > 0 else 0
    return max(min(done + more, most), done)


def end_reserve(validation_s: float, noval: bool, plots: bool) -> float:
    """Seconds kept for the end of the run from one validation's time: the final validation of best.pt
    (``END_RESERVE_VALIDATIONS`` validations), under --noval the final epoch's own validation as well, and
    the end-of-run plots unless --noplots."""
    return validation_s * (END_RESERVE_VALIDATIONS + (1 if noval else 0)) + (PLOTS_RESERVE_S if plots else 0.0)


def validation_estimate(epoch_s: float, train_batches: int, val_batches: int) -> float:
    """A validation's seconds when none was measured (--noval): one training batch's time per validation
    batch (validation batches hold twice the images, forward only: about two thirds of a training step's
    work, so the estimate errs long)."""
    return epoch_s / max(train_batches, 1) * val_batches


class TimeBudget:
    """The clock of one ``--time`` run in this process: ``spent()`` is the time spent before this process
    (``spent_before_s``, from the run state) plus the time since ``start()``."""

    def __init__(self, hours: float, spent_before_s: float = 0.0):
        self.hours = float(hours)
        self.seconds = self.hours * 3600
        self.spent_before_s = float(spent_before_s)
        self.started: float | None = None

    def start(self) -> None:
        self.started = clock()

    def spent(self) -> float:
        return self.spent_before_s + (clock() - self.started if self.started is not None else 0.0)
