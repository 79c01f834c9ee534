"""ClearML: on as YOLOv5 v7 switches it: the ``clearml`` package installed and configured (a clearml.conf, at
CLEARML_CONFIG_FILE or ~/clearml.conf, or CLEARML_API_ACCESS_KEY and CLEARML_API_SECRET_KEY), or CLEARML_OFFLINE_MODE=1
(``Task.set_offline(True)``: the session folder and its zip in ``<run folder>/clearml/offline``, imported later with
``clearml-task``'s ``Task.import_offline_session``). Nothing but what this module logs is captured: no framework
binding (PyTorch saves, TensorBoard, matplotlib, ...), resource monitoring, argparse capture, console streams,
repository, uncommitted diff or requirements (the arguments of ``Task.init`` below). The package is imported when a run
starts, in the trackers' worker thread."""
from __future__ import annotations

import os
from pathlib import Path

from utils.trackers.core import IMAGE_SUFFIXES, METRIC_NAMES, RunStart, Tracker, ValPredictions, image_key

PREDICTIONS_TITLE = "Bounding Boxes"  # YOLOv5's ClearML debug samples of val images with their predicted boxes
DEFAULT_PROJECT = "runs/train"  # this --project is ClearML project "YOLOv5" (as in YOLOv5), any other its last part
FRAMEWORKS = ("catboost", "fastai", "gradio", "hydra", "joblib", "lightgbm", "matplotlib", "megengine", "pytorch",
              "scikit", "tensorboard", "tensorflow", "tfdefines", "xgboost")  # ClearML's bindings: all off
EPOCH_METRIC = METRIC_NAMES["train/box_loss"]["clearml"]  # reported every epoch: its iterations are the task's epochs
MASTER_NOTES = ("CLEARML_PROC_MASTER_ID", "TRAINS_PROC_MASTER_ID")  # ClearML's note of the process that started a task
CAPTURE_NOTHING = dict(auto_connect_frameworks={**dict.fromkeys(FRAMEWORKS, False), "detect_repository": False},
                       auto_resource_monitoring=False, auto_connect_arg_parser=False, auto_connect_streams=False)


def project_name(project: str) -> str:
    return "YOLOv5" if Path(project).as_posix().rstrip("/").endswith(DEFAULT_PROJECT) else Path(project).name


def _offline() -> bool:
    return os.environ.get("CLEARML_OFFLINE_MODE", "").lower() in ("1", "true", "yes", "on")


def _configured() -> str:
    if os.environ.get("CLEARML_API_ACCESS_KEY") and os.environ.get("CLEARML_API_SECRET_KEY"):
        return "CLEARML_API_ACCESS_KEY and CLEARML_API_SECRET_KEY are set"
    path = Path(os.environ.get("CLEARML_CONFIG_FILE") or Path.home() / "clearml.conf")
    return f"configured ({path})" if path.is_file() else ""


class ClearmlTracker(Tracker):
    name, label, package = "clearml", "ClearML", "clearml"

    @classmethod
    def decide(cls) -> tuple[bool, str]:
        if _offline():
            return True, "CLEARML_OFFLINE_MODE=1"
        how = _configured()
        return (True, how) if how else (False, "not configured: clearml-init, or CLEARML_OFFLINE_MODE=1")

    def __init__(self):
        super().__init__()
        self.task = None

    def start(self, run: RunStart) -> None:
        from clearml import Task

        offline = _offline()
        continued = run.resume_id if run.resume_id and not offline else False
        if offline:
            Task.set_offline(True)
        self.task = _init_task(Task, run, continued, offline)
        if not isinstance(self.task.id, str):  # a stub (no configuration, or a parent's task): nothing would be logged
            raise RuntimeError(f"ClearML gave no task ({type(self.task).__name__})")
        self.run_id = self.task.id
        if continued:
            self.task.set_initial_iteration(0)  # continuing sets an offset (last iteration + 1): epochs stay epochs
            self.logged_through = self._last_logged_epoch() if self.task.id == run.resume_id else -1
            self.note = "continuing its run: "
        else:
            self.task.connect({k: v for k, v in run.params.items() if not k.startswith("hyp/")}, name="Args")
            self.task.connect({k[4:]: v for k, v in run.params.items() if k.startswith("hyp/")}, name="Hyperparameters")
            self.task.set_parameter("yolo-trainer/run_folder", str(run.save_dir))
            if run.resume_id:  # an offline session is never continued: a new task names the one it continues
                self.note = f"an offline ClearML run cannot be continued, a new run linked to {run.resume_id}: "
                self.task.set_parameter("yolo-trainer/resumed_from", run.resume_id)
        self.step = max(self.logged_through, 0)
        for row in run.rows:
            self.log_epoch(int(row["epoch"]), {key: value for key, value in row.items() if key != "epoch"})
        folder = self.task.get_offline_mode_folder() if offline else None
        self.url = f"offline session {folder}" if folder else self.task.get_output_log_web_page()

    def _last_logged_epoch(self) -> int:
        """The last epoch a continued task has (asked of the ClearML server; untested here, it needs one)."""
        title, series = EPOCH_METRIC.split("/", 1)
        scalars = self.task.get_reported_scalars()
        return int(max(scalars.get(title, {}).get(series, {}).get("x", []), default=-1))

    def log_epoch(self, epoch: int, values: dict[str, float]) -> None:
        if epoch <= self.logged_through:
            return
        logger = self.task.get_logger()
        for key, value in values.items():
            if key in METRIC_NAMES:  # title/series as YOLOv5's ClearML logger splits them
                title, series = METRIC_NAMES[key]["clearml"].split("/", 1)
                logger.report_scalar(title, series, float(value), iteration=epoch)
        self.logged_through = self.step = epoch

    def log_files(self, paths: list[Path], folder: str) -> None:
        for path in (path for path in paths if path.is_file()):
            if path.suffix.lower() in IMAGE_SUFFIXES and folder != "weights":
                self.task.get_logger().report_image(image_key(path.name), path.name, iteration=self.step,
                                                    local_path=str(path))
            else:  # checkpoints too: ClearML 2.1's OutputModel fails in offline mode (DummyModel has no 'locked')
                name = f"{folder}/{path.name}" if folder else path.name
                self.task.upload_artifact(name, artifact_object=str(path), wait_on_upload=True)

    def log_predictions(self, predictions: ValPredictions) -> None:
        """As YOLOv5's ClearML logger: each image with its boxes drawn ("<class>: <conf>%") as a debug sample, title
        "Bounding Boxes", series the image's file name, at the epoch's iteration (drawn here, in this thread)."""
        import cv2

        from utils.drawing import colors, draw_box_label

        logger = self.task.get_logger()
        for image, boxes, path in zip(predictions.images, predictions.boxes, predictions.paths):
            drawn = cv2.cvtColor(image, cv2.COLOR_RGB2BGR)
            for x1, y1, x2, y2, conf, cls in boxes.tolist():
                draw_box_label(drawn, (x1, y1, x2, y2), f"{predictions.label(cls)}: {round(conf * 100, 2)}%",
                               colors(int(cls), bgr=True))
            logger.report_image(PREDICTIONS_TITLE, Path(path).name, iteration=self.step,
                                image=cv2.cvtColor(drawn, cv2.COLOR_BGR2RGB))

    def finish(self, finished: bool) -> None:
        self.task.get_logger().flush(wait=True)
        if finished:
            self.task.mark_completed(ignore_errors=True)
        else:
            self.task.mark_stopped(force=True, status_message="stopped; a --resume continues it")
        self.task.close()


def _init_task(task_class, run: RunStart, continued: str | bool, offline: bool):
    """``Task.init`` with nothing captured; offline, its session folder goes to ``<run folder>/clearml`` (ClearML takes
    it from CLEARML_CACHE_DIR when the task is created, so the variable is set for that call only)."""
    # ClearML's reports go through a thread, not its default on Linux, a forked copy of the training process (whose
    # close took 10-16 s a run here, 0.01 s through the thread); the setting is the class attribute its config feeds
    task_class._report_subprocess_enabled = False
    # ClearML notes "<pid>:<task id>" in CLEARML_PROC_MASTER_ID (and its old name) when a task starts; a process that
    # inherits another process's note (a run started from a Python process that ran one, torchrun under it) takes
    # itself for that process's child and gets a stub for a task, which logs nothing and is no run id: the note goes
    for name in MASTER_NOTES:
        if os.environ.get(name, str(os.getpid())).split(":")[0] != str(os.getpid()):
            del os.environ[name]
    saved = os.environ.get("CLEARML_CACHE_DIR")
    if offline:
        os.environ["CLEARML_CACHE_DIR"] = str(run.save_dir / "clearml")
    try:
        return task_class.init(project_name=project_name(run.experiment), task_name=run.run_name,
                               reuse_last_task_id=False, continue_last_task=continued,
                               tags=[run.group] if run.group else None, **CAPTURE_NOTHING)
    finally:
        if offline:
            if saved is None:
                os.environ.pop("CLEARML_CACHE_DIR", None)
            else:
                os.environ["CLEARML_CACHE_DIR"] = saved
