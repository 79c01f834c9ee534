"""The tracker interface, the table of metric names, and the redaction of options before they are logged."""
from __future__ import annotations

import importlib.util
import logging
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from utils.loggers import RESULTS_KEYS

LOGGER = logging.getLogger(__name__)

# results.csv's columns (YOLOv5's names) -> the name each tracker logs them under (docs/trackers.md shows this
# table). MLflow refuses ':' in a metric name on Windows (its client and a Windows server), so
# metrics/mAP_0.5:0.95 is logged as metrics/mAP_0.5-0.95 everywhere; every other name is YOLOv5's. W&B, Comet and
# ClearML take ':' and get YOLOv5's names unchanged (ClearML splits a name at its first '/' into title and series, as
# YOLOv5's ClearML logger does: title "metrics", series "mAP_0.5:0.95").
METRIC_NAMES: dict[str, dict[str, str]] = {
    key: {"mlflow": key.replace(":", "-"), "wandb": key, "comet": key, "clearml": key} for key in RESULTS_KEYS
}

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
PREDICTIONS_FOLDER = "val_predictions"  # <run>/val_predictions/val_pred_epoch<N>.jpg, and the artifacts' folder
PREDICTIONS_CONF = 0.25     # --bbox_interval's boxes: predictions at this confidence and above (YOLOv5's trackers)
PREDICTIONS_IMAGES = 16     # --bbox_interval's images: the first val batch's first 16 (YOLOv5's W&B and ClearML)


def image_key(name: str) -> str:
    """The panel (W&B key, ClearML title) a plot goes to, as YOLOv5's W&B and ClearML loggers name them."""
    if name.startswith("train_batch"):
        return "Mosaics"
    if name.startswith("labels"):
        return "Labels"
    if name.startswith("val_batch"):
        return "Validation"
    if name.startswith("val_pred"):  # --bbox_interval's val images with predictions
        return "Bounding Box Debugger/Images"
    return "Results"


SECRET_NAME = re.compile(r"token|secret|passw|api_?key|auth|credential|signature|^sig$", re.IGNORECASE)
URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
SECRET_QUERY = re.compile(r"(?P<name>[?&;](?:[^=&#;\s]*?)(?:token|secret|passw|key|auth|credential|signature|sig)"
                          r"[^=&#;\s]*=)[^&#;\s]*", re.IGNORECASE)
REDACTED = "***"


def redacted(values: dict) -> dict:
    """``values`` (options, hyperparameters) as they may be logged: a value whose name looks secret (token, password,
    api_key, ...) becomes ``***``, and in text the credentials of a URL (``https://user:pass@host`` ->
    ``https://***@host``) and secret-looking query parameters (``?token=...``, ``&X-Amz-Signature=...``) too."""
    return {name: _redacted(str(name), value) for name, value in values.items()}


def _redacted(name: str, value):
    if isinstance(value, (list, tuple)):
        return [_redacted(name, item) for item in value]
    if isinstance(value, dict):
        return redacted(value)
    if not isinstance(value, str) or not value:
        return value
    if SECRET_NAME.search(name):
        return REDACTED
    value = URL_USERINFO.sub(lambda match: f"{match['scheme']}{REDACTED}@", value)
    return SECRET_QUERY.sub(lambda match: f"{match['name']}{REDACTED}", value)


@dataclass
class RunStart:
    """What a tracker starts (or continues) a run with."""
    experiment: str                 # --project (or the tracker's own setting, e.g. MLFLOW_EXPERIMENT_NAME)
    run_name: str                   # the run folder's name (exp, exp2, ...)
    params: dict                    # opt.yaml's options and the hyperparameters (hyp/<key>), redacted
    save_dir: Path
    resume_id: str | None = None    # the run id a resumed checkpoint stored for this tracker
    group: str = ""                 # --evolve: the evolution's name, which groups its generations' runs
    rows: list = field(default_factory=list)  # results rows of the epochs already finished ({"epoch": e, ...})


class ValPredictions:
    """--bbox_interval's val images with their predictions at one epoch, as every tracker gets them: the first val
    batch's first PREDICTIONS_IMAGES letterboxed images and their boxes at PREDICTIONS_CONF and above. Made on the
    training thread from copies (cheap); what costs, drawing, is done in the trackers' worker threads: each tracker
    shows them its own way (W&B's boxes and Comet's annotations are drawn by the tracker's own viewer), and those that
    take a picture file share one drawing, ``drawn()``, made once by the first thread that asks."""

    def __init__(self, epoch: int, images, detections, paths, names, file: Path):
        count = min(len(images), PREDICTIONS_IMAGES)
        self.epoch = int(epoch)
        self.images = np.ascontiguousarray(_numpy(images[:count]).transpose(0, 2, 3, 1))  # (n, h, w, 3) uint8 RGB
        self.boxes = []  # per image (k, 6) float32 [x1, y1, x2, y2, conf, class] in the image's pixels
        for detection in list(detections)[:count]:
            rows = _numpy(detection)[:, :6].astype(np.float32).reshape(-1, 6)
            self.boxes.append(rows[rows[:, 4] >= PREDICTIONS_CONF])
        self.paths = [str(path) for path in list(paths)[:count]]
        self.names = [str(name) for name in names]
        self.file = Path(file)  # where drawn() writes the mosaic of all of them
        self._lock = threading.Lock()
        self._drawn: bool | None = None

    def label(self, cls: float) -> str:
        index = int(cls)
        return self.names[index] if 0 <= index < len(self.names) else str(index)

    def jpeg(self, index: int) -> bytes:
        """Image ``index`` as JPEG bytes (quality 95; OpenCV encodes one in well under a millisecond, PNG through PIL
        took ~35 ms on a 2-core EPYC)."""
        import cv2

        done, data = cv2.imencode(".jpg", self.images[index][..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 95])
        if not done:
            raise ValueError(f"{self.paths[index]}: the image could not be encoded as JPEG")
        return data.tobytes()

    def drawn(self) -> Path | None:
        """The images drawn with their boxes into one mosaic at ``file`` (once, whichever thread asks first; the
        others wait for it); None when it could not be drawn (one warning)."""
        with self._lock:
            if self._drawn is None:
                try:
                    from utils.drawing import output_to_target, plot_images

                    self.file.parent.mkdir(parents=True, exist_ok=True)
                    plot_images(self.images.transpose(0, 3, 1, 2), output_to_target(self.boxes), self.paths,
                                self.file, self.names)
                    self._drawn = self.file.is_file()
                except Exception as error:  # drawing (cv2, the disk) failed: a picture the trackers miss, never fatal
                    LOGGER.warning("WARNING: --bbox_interval's image %s not drawn (%s)", self.file, error)
                    self._drawn = False
            return self.file if self._drawn else None


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


class Tracker:
    """One experiment tracker. Its methods run in its own worker thread (utils.trackers.dispatch), one at a time and
    in order; an exception from any of them turns the tracker off with one warning line (training goes on).

    ``switch()`` decides from the environment alone (no import of the tracker's package) whether it is on: nothing
    when ``package`` is not installed, else the tracker's own ``decide()``."""

    name = "tracker"        # the key of its run id in a checkpoint (training.run.tracker_runs)
    label = "Tracker"       # how messages name it
    package = ""            # the package it imports (in its worker thread only, never when utils.trackers is imported)

    def __init__(self):
        self.run_id: str | None = None   # set by start()
        self.url = ""                    # where to see the run, set by start()
        self.note = ""                   # said in the start line before the URL (e.g. "continuing run ...")
        self.why = ""                    # why it is on (switch), said in the start line
        self.logged_through = -1         # the last epoch the run has (a resumed run's retrained epochs are not sent)
        self.step = 0                    # the step files and images are shown at (the last epoch logged)

    @classmethod
    def switch(cls) -> tuple[bool, str] | None:
        """(on, why) from the environment; None when its package is not installed (then nothing is said)."""
        if importlib.util.find_spec(cls.package) is None:
            return None
        return cls.decide()

    @classmethod
    def decide(cls) -> tuple[bool, str]:
        """(on, why) from the environment, the package being installed."""
        raise NotImplementedError

    def start(self, run: RunStart) -> None:
        """Create the run (or continue ``run.resume_id``), log the parameters of a new run, and log the ``run.rows``
        the tracker lacks (a resumed run's epochs that an earlier process did not get to send)."""
        raise NotImplementedError

    def log_epoch(self, epoch: int, values: dict[str, float]) -> None:
        """One results.csv row (without the epoch) at step ``epoch``; an epoch the run already has is not logged again."""
        raise NotImplementedError

    def log_files(self, paths: list[Path], folder: str) -> None:
        """Files of the run folder as artifacts under ``folder`` ('' = the top)."""
        raise NotImplementedError

    def log_predictions(self, predictions: ValPredictions) -> None:
        """--bbox_interval's val images with their predictions, at the step of the epoch logged last (their epoch's).
        By default their one drawn mosaic, as a file under PREDICTIONS_FOLDER."""
        drawn = predictions.drawn()
        if drawn is not None:
            self.log_files([drawn], PREDICTIONS_FOLDER)

    def log_validation(self, epoch: int, per_class: list[dict], confusion: np.ndarray | None,
                       names: list[str]) -> None:
        """A validation at step ``epoch``, after its row: per class (dicts of class, name, instances, precision,
        recall, f1, tp, fp, mAP50, mAP50-95 for the classes with labels; each epoch's) and its confusion matrix
        ((nc + 1)^2 counts [predicted, true], the last: background; counted where validation plots, so best.pt's at
        the end; else None). Nothing by default: only YOLOv5's Comet logger logs them."""

    def finish(self, finished: bool) -> None:
        """End the run: finished normally, or stopped (a signal or an error; a --resume continues it)."""
        raise NotImplementedError
