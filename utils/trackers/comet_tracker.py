"""Comet: on as YOLOv5 v7 switches it: the ``comet_ml`` package installed, with an API key (COMET_API_KEY, or
``api_key`` in ~/.comet.config / COMET_CONFIG) or COMET_MODE=offline; COMET_MODE=disabled turns it off. An offline
run is an ``OfflineExperiment`` whose archive (``<id>.zip``, uploaded later with ``comet upload``) is written in
``<run folder>/comet``. Nothing but what this module logs is sent: no source code, git metadata or patch, command-line
arguments, console output, environment, host, GPU/CPU/disk/network details, CO2, or auto-logged framework metrics,
weights or graphs (the experiment's arguments below). The package is imported when a run starts, in the trackers'
worker thread."""
from __future__ import annotations

import configparser
import io
import logging
import os
from pathlib import Path

from utils.trackers.core import IMAGE_SUFFIXES, METRIC_NAMES, RunStart, Tracker, ValPredictions

DEFAULT_PROJECT = "runs/train"  # this --project is Comet project "yolov5" (YOLOv5's default), any other its last part
MODEL_NAME = "yolov5"  # the model's name in the experiment, as YOLOv5's Comet logger names it
EPOCH_METRIC = METRIC_NAMES["train/box_loss"]["comet"]  # logged every epoch: its steps are the epochs a run has
QUIET = dict(log_code=False, log_graph=False, auto_param_logging=False, auto_metric_logging=False, parse_args=False,
             auto_output_logging=False, log_env_details=False, log_git_metadata=False, log_git_patch=False,
             log_env_gpu=False, log_env_host=False, log_env_cpu=False, log_env_network=False, log_env_disk=False,
             auto_log_co2=False, auto_histogram_weight_logging=False,
             auto_histogram_gradient_logging=False, auto_histogram_activation_logging=False, display_summary_level=0)


def project_name(project: str) -> str:
    return "yolov5" if Path(project).as_posix().rstrip("/").endswith(DEFAULT_PROJECT) else Path(project).name


def _mode() -> str:
    return os.environ.get("COMET_MODE", "").lower()


def _api_key_source() -> str:
    if os.environ.get("COMET_API_KEY"):
        return "COMET_API_KEY is set"
    path = Path(os.environ.get("COMET_CONFIG") or Path.home() / ".comet.config")
    config = configparser.ConfigParser()
    try:
        config.read(path)
    except (OSError, configparser.Error):
        return ""
    return f"api_key in {path}" if config.get("comet", "api_key", fallback="") else ""


def _switched(name: str, default: bool) -> bool:
    """A YOLOv5 Comet switch from the environment: "true" (any case) is on, anything else off."""
    return os.environ.get(name, str(default)).lower() == "true"


def _no_late_import_warning(record: logging.LogRecord) -> bool:
    """Comet's warning that torch was imported before it (so its framework auto-logging, which is off here, would be
    partial) is not shown: it says nothing about this run."""
    return "import comet_ml before" not in str(record.msg)


class CometTracker(Tracker):
    name, label, package = "comet", "Comet", "comet_ml"

    @classmethod
    def decide(cls) -> tuple[bool, str]:
        if _mode() == "disabled":
            return False, "COMET_MODE=disabled"
        if _mode() == "offline":
            return True, "COMET_MODE=offline"
        how = _api_key_source()
        return (True, how) if how else (False, "no COMET_API_KEY, ~/.comet.config or COMET_MODE=offline")

    def __init__(self):
        super().__init__()
        self.experiment = None
        self.replayed = False     # the last epoch given was one the run already had (a resumed run retraining it)

    def start(self, run: RunStart) -> None:
        import comet_ml

        logging.getLogger("comet_ml.experiment").addFilter(_no_late_import_warning)

        project = os.environ.get("COMET_PROJECT_NAME") or project_name(run.experiment)
        if _mode() == "offline":
            folder = run.save_dir / "comet"
            folder.mkdir(parents=True, exist_ok=True)
            self.experiment = comet_ml.OfflineExperiment(project_name=project, offline_directory=str(folder), **QUIET)
            if run.resume_id:  # an offline archive is never continued: a new experiment names the one it continues
                self.note = f"an offline Comet run cannot be continued, a new run linked to {run.resume_id}: "
                self.experiment.log_other("resumed_from", run.resume_id)
            self.url = f"offline run in {folder} (upload: comet upload {folder / self.experiment.id}.zip)"
        elif run.resume_id:
            self.experiment = comet_ml.ExistingExperiment(previous_experiment=run.resume_id, **QUIET)
            self.logged_through = self._last_logged_step(comet_ml, run.resume_id)
            self.note = "continuing its run: "
        else:
            self.experiment = comet_ml.Experiment(project_name=project, **QUIET)
        self.run_id = self.experiment.id
        if not run.resume_id or _mode() == "offline":
            self.experiment.set_name(run.run_name)
            self.experiment.log_other("run_folder", str(run.save_dir))
            if run.group:  # --evolve: the generations share the evolution's name as a tag
                self.experiment.add_tag(run.group)
                self.experiment.log_other("evolution", run.group)
            self.experiment.log_parameters(run.params)
        self.step = max(self.logged_through, 0)
        for row in run.rows:
            self.log_epoch(int(row["epoch"]), {key: value for key, value in row.items() if key != "epoch"})
        self.url = self.url or self.experiment.url

    @staticmethod
    def _last_logged_step(comet_ml, experiment_key: str) -> int:
        """The last epoch an online experiment has (asked of Comet's REST API; untested here, it needs a server)."""
        found = comet_ml.API().get_experiment_by_key(experiment_key)
        steps = [int(point["step"]) for point in found.get_metrics(EPOCH_METRIC) if point.get("step") is not None]
        return max(steps, default=-1)

    def log_epoch(self, epoch: int, values: dict[str, float]) -> None:
        self.replayed = epoch <= self.logged_through
        if self.replayed:
            return
        metrics = {METRIC_NAMES[key]["comet"]: float(value) for key, value in values.items() if key in METRIC_NAMES}
        self.experiment.log_metrics(metrics, step=epoch, epoch=epoch)
        self.logged_through = self.step = epoch

    def log_files(self, paths: list[Path], folder: str) -> None:
        for path in (path for path in paths if path.is_file()):
            if folder == "weights":  # as YOLOv5's Comet logger: versions of the experiment's model "yolov5"
                self.experiment.log_model(MODEL_NAME, str(path), file_name=path.name, overwrite=True)
            elif path.suffix.lower() in IMAGE_SUFFIXES:
                self.experiment.log_image(str(path), name=path.name, step=self.step)
            else:
                self.experiment.log_asset(str(path), file_name=path.name, step=self.step)

    def log_predictions(self, predictions: ValPredictions) -> None:
        """Each image with its predicted boxes as Comet annotations (layer "Predictions": box [x, y, w, h] in the
        image's pixels, label the class name, score the confidence; drawn by Comet's image viewer, nothing drawn here),
        named after the image's file, at the epoch's step."""
        for index, (boxes, path) in enumerate(zip(predictions.boxes, predictions.paths)):
            data = [{"boxes": [[x1, y1, x2 - x1, y2 - y1]], "label": predictions.label(cls), "score": conf}
                    for x1, y1, x2, y2, conf, cls in boxes.tolist()]
            # a JPEG file object: Comet would stretch an array's values to its min and max, and encode PNG (slow)
            self.experiment.log_image(io.BytesIO(predictions.jpeg(index)), name=Path(path).name, step=self.step,
                                      annotations=[{"name": "Predictions", "data": data}] if data else None)

    def log_validation(self, epoch: int, per_class: list[dict], confusion, names: list[str]) -> None:
        """As YOLOv5's Comet logger after each validation: with COMET_LOG_PER_CLASS_METRICS=true (off by default) and
        more than one class, each class's metrics prefixed with its name (``<class>_mAP@.5``, ...); unless
        COMET_LOG_CONFUSION_MATRIX=false, the confusion matrix where it was counted (predicted rows, actual columns,
        "background" last; YOLOv5 logs an empty one after each epoch, whose validation counts none)."""
        if self.replayed:
            return
        if _switched("COMET_LOG_PER_CLASS_METRICS", False) and len(names) > 1:
            for row in per_class:
                self.experiment.log_metrics({"mAP@.5": row["mAP50"], "mAP@.5:.95": row["mAP50-95"],
                                             "precision": row["precision"], "recall": row["recall"], "f1": row["f1"],
                                             "true_positives": row["tp"], "false_positives": row["fp"],
                                             "support": row["instances"]}, prefix=row["name"], step=epoch, epoch=epoch)
        if confusion is not None and _switched("COMET_LOG_CONFUSION_MATRIX", True):
            labels = [*names, "background"]
            self.experiment.log_confusion_matrix(matrix=confusion.tolist(), labels=labels, max_categories=len(labels),
                                                 epoch=epoch, step=epoch, column_label="Actual Category",
                                                 row_label="Predicted Category",
                                                 file_name=f"confusion-matrix-epoch-{epoch}.json")

    def finish(self, finished: bool) -> None:
        if not finished:
            self.experiment.log_other("stopped", True)  # Comet's state comes from the end of the process
        self.experiment.end()
