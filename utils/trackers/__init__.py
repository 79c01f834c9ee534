"""Experiment trackers (MLflow, W&B, Comet, ClearML; docs/trackers.md): what a run logs to them besides results.csv and
TensorBoard.

- core.py: the ``Tracker`` interface each tracker implements (its own class: start, log_epoch, log_files,
  log_predictions, finish), ``RunStart`` (what a run starts a tracker with), ``ValPredictions`` (--bbox_interval's val
  images and boxes), ``METRIC_NAMES`` (results.csv's columns -> each tracker's legal names, the one table) and
  ``redacted`` (options with their credentials hidden).
- dispatch.py: ``Trackers``, the one object the Recorder calls: every call goes through the tracker's own background
  queue and worker thread, a tracker that fails says so in one warning line and is dropped, and closing waits a
  bounded time.
- mlflow_tracker.py, wandb_tracker.py, comet_tracker.py, clearml_tracker.py: one ``Tracker`` class each, on as the
  module's docstring says (installed and set up, or the tracker's offline mode), its files inside the run folder.

``open_trackers(config, hyp, save_dir, resume_ids)`` chooses the trackers that are on (``TRACKERS``: each class says
whether it is on and why; no per-backend branches) for the main process; importing this package imports no tracker.
"""
from utils.trackers.core import METRIC_NAMES, RunStart, Tracker, ValPredictions, redacted
from utils.trackers.dispatch import Trackers, open_trackers

__all__ = ["METRIC_NAMES", "RunStart", "Tracker", "Trackers", "ValPredictions", "open_trackers", "redacted"]
