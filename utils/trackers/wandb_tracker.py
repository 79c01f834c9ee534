"""Weights & Biases: on as YOLOv5 v7 switches it: the ``wandb`` package installed, logged in (WANDB_API_KEY, or an
entry for the W&B host in ~/.netrc written by ``wandb login``) or WANDB_MODE=offline, and not disabled
(WANDB_MODE=disabled, WANDB_DISABLED=true). Its files stay in the run folder (``<run folder>/wandb``), and nothing but
what this module logs is sent: no code, git state, requirements, job, console output, system metrics or machine
metadata (the settings below). The package is imported when a run starts, in the trackers' worker thread.

An offline run is read back with ``read_records`` (the run's ``.wandb`` transaction log through wandb's own record
schema): a resumed offline run learns from it which epochs its earlier process logged."""
from __future__ import annotations

import netrc
import os
import shutil
import struct
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from utils.trackers.core import IMAGE_SUFFIXES, METRIC_NAMES, RunStart, Tracker, ValPredictions, image_key

PREDICTIONS_KEY = "Bounding Box Debugger/Images"  # YOLOv5's W&B panel of val images with their predicted boxes

DEFAULT_HOST = "https://api.wandb.ai"
DEFAULT_PROJECT = "runs/train"   # YOLOv5: this --project is W&B project "YOLOv5", any other its last part


def project_name(project: str) -> str:
    return "YOLOv5" if Path(project).as_posix().rstrip("/").endswith(DEFAULT_PROJECT) else Path(project).name


def _mode() -> str:
    mode = os.environ.get("WANDB_MODE", "").lower()
    if os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1"):
        return "disabled"
    return "offline" if mode == "dryrun" else mode


def _logged_in() -> str:
    """Where W&B's credentials come from ('' when there are none): the environment or ~/.netrc (not checked online)."""
    if os.environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY is set"
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or DEFAULT_HOST).netloc
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        found = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return ""
    return f"logged in ({path})" if found and found[2] else ""


class WandbTracker(Tracker):
    name, label, package = "wandb", "W&B", "wandb"

    @classmethod
    def decide(cls) -> tuple[bool, str]:
        mode = _mode()
        if mode == "disabled":
            return False, "WANDB_MODE=disabled"
        if mode == "offline":
            return True, "WANDB_MODE=offline"
        how = _logged_in()
        return (True, how) if how else (False, "not logged in: wandb login, or WANDB_MODE=offline")

    def __init__(self):
        super().__init__()
        self.run = None
        self.replayed = False     # the last epoch given was one the run already had (a resumed run retraining it)

    def start(self, run: RunStart) -> None:
        import wandb

        offline = _mode() == "offline"
        settings = wandb.Settings(mode="offline" if offline else "online", save_code=False, disable_code=True,
                                  disable_git=True, disable_job_creation=True, x_save_requirements=False,
                                  x_disable_meta=True, x_disable_stats=True, console="off", silent=True)
        if run.resume_id and offline:
            self.logged_through = last_offline_step(run.save_dir / "wandb", run.resume_id)
        self.run = wandb.init(project=project_name(run.experiment), entity=run.params.get("entity") or None,
                              name=run.run_name, group=run.group or None, dir=str(run.save_dir), config=run.params,
                              id=run.resume_id,
                              resume="allow" if run.resume_id else None, settings=settings)
        self.run_id = self.run.id
        if run.resume_id and not offline and self.run.resumed:
            self.logged_through = self.run.starting_step - 1  # the server's next step is one past its last epoch
        if run.resume_id:
            self.note = "continuing its run: "
        self.step = max(self.logged_through, 0)
        for row in run.rows:
            self.log_epoch(int(row["epoch"]), {key: value for key, value in row.items() if key != "epoch"})
        if run.params.get("upload_dataset") and not run.resume_id:  # once per run
            self._log_dataset(run.params["data"], run.params["upload_dataset"])
        self.url = self.run.url if not offline else (
            f"offline run {self.run.id} in {Path(self.run.dir).parent} (upload: wandb sync {run.save_dir / 'wandb'})")

    def _log_dataset(self, data: str, upload) -> None:
        """--upload_dataset ('val': the val split alone): each split's images and labels as a ``dataset`` artifact
        named after the split, as YOLOv5 names them (files referenced in place), with YOLOv5's table of the split
        (``<split>.table.json``: id, the image with its labelled boxes, its classes, its file name). YOLOv5's
        ``<data>_wandb.yaml`` beside the dataset YAML is not written (nothing is written outside the run folder, and
        no run reads a ``wandb-artifact://`` dataset)."""
        import wandb

        from utils.data.dataset_yaml import load_data_config
        from utils.data.verify import img2label_paths, list_image_files

        config = load_data_config(data)
        names = dict(enumerate(config.names))
        for split in ("val",) if upload == "val" else ("train", "val"):
            images = list_image_files(config.split(split))
            label_files = img2label_paths(images)
            artifact = wandb.Artifact(split, type="dataset", metadata={"data": str(config.yaml_file), "images":
                                                                       len(images), "names": config.names})
            for file in images + [label for label in label_files if os.path.isfile(label)]:
                artifact.add_file(file, name=_name_in(file, config.path), policy="immutable")
            artifact.add(_dataset_table(wandb, images, label_files, names), split)
            self.run.log_artifact(artifact, aliases=["latest"])

    def log_epoch(self, epoch: int, values: dict[str, float]) -> None:
        self.replayed = epoch <= self.logged_through
        if self.replayed:
            return
        metrics = {METRIC_NAMES[key]["wandb"]: float(value) for key, value in values.items() if key in METRIC_NAMES}
        self.run.log(metrics, step=epoch)
        self.logged_through = self.step = epoch

    def log_files(self, paths: list[Path], folder: str) -> None:
        import wandb

        paths = [path for path in paths if path.is_file()]
        if folder == "weights":
            for path in paths:
                self._log_model(path)
            return
        images: dict[str, list] = {}
        for path in paths:
            if path.suffix.lower() in IMAGE_SUFFIXES:
                images.setdefault(image_key(path.name), []).append(wandb.Image(str(path), caption=path.name))
            else:  # copied into the run's files (no symlink back into the run folder, no wandb warning about it)
                copied = Path(self.run.dir) / path.name
                shutil.copyfile(path, copied)
                self.run.save(str(copied), base_path=self.run.dir, policy="now")
        if images and not self.replayed:  # a retrained epoch's images: its step is in the run already
            self.run.log(images, step=self.step)

    def log_predictions(self, predictions: ValPredictions) -> None:
        """As YOLOv5's W&B logger: each image with its predicted boxes as W&B box data (drawn, filtered and captioned
        by W&B's viewer; nothing is drawn here) under "Bounding Box Debugger/Images", at the epoch's step."""
        import wandb

        if self.replayed:  # a retrained epoch's images: its step is in the run already
            return
        class_labels = dict(enumerate(predictions.names))
        shown = []
        for image, boxes, path in zip(predictions.images, predictions.boxes, predictions.paths):
            box_data = [{"position": {"minX": float(x1), "minY": float(y1), "maxX": float(x2), "maxY": float(y2)},
                         "class_id": int(cls), "box_caption": f"{predictions.label(cls)} {conf:.3f}",
                         "scores": {"class_score": float(conf)}, "domain": "pixel"}
                        for x1, y1, x2, y2, conf, cls in boxes.tolist()]
            shown.append(wandb.Image(image, caption=Path(path).name, file_type="jpg",  # PNG: 35 ms an image here
                                     boxes={"predictions": {"box_data": box_data, "class_labels": class_labels}}))
        if shown:
            self.run.log({PREDICTIONS_KEY: shown}, step=self.step)

    def _log_model(self, path: Path) -> None:
        """A checkpoint as a version of the run's model artifact ``run_<id>_model``, as YOLOv5's W&B logger names it:
        best.pt at the end ('latest', 'best', 'stripped'), epoch<N>.pt every --save-period epochs."""
        import wandb

        artifact = wandb.Artifact(f"run_{self.run.id}_model", type="model",
                                  metadata={"original_url": str(path), "epochs_trained": self.step + 1})
        artifact.add_file(str(path), name=path.name, policy="immutable")  # not copied to a staging folder
        if path.name == "best.pt":
            aliases = ["latest", "best", "stripped"]
        else:
            aliases = ["latest", "last", f"epoch {path.stem.removeprefix('epoch')}"]
        self.run.log_artifact(artifact, aliases=aliases)

    def finish(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


def _dataset_table(wandb, images: list[str], label_files: list[str], names: dict[int, str]):
    """YOLOv5's W&B dataset table: one row per image (id, the image with its labels as W&B ground-truth boxes in
    normalised coordinates, the names of its classes, its file name). A label file that cannot be read (training
    said so when it scanned the split) gives an image without boxes."""
    from utils.data.verify import Problem, parse_label_file

    table = wandb.Table(columns=["id", "train_image", "Classes", "name"])
    classes = wandb.Classes([{"id": index, "name": name} for index, name in names.items()])
    for index, (image, label_file) in enumerate(zip(images, label_files)):
        rows = np.zeros((0, 5))
        if os.path.isfile(label_file):
            try:
                (rows, _), _, _ = parse_label_file(label_file, len(names))
            except Problem:
                pass
        box_data = [{"position": {"middle": [round(x, 6), round(y, 6)], "width": round(w, 6), "height": round(h, 6)},
                     "class_id": int(cls), "box_caption": names.get(int(cls), str(int(cls)))}
                    for cls, x, y, w, h in rows.tolist()]  # rounded: the labels' float32 as the text gave them
        shown = {int(cls): names.get(int(cls), str(int(cls))) for cls in rows[:, 0].tolist()}
        table.add_data(index, wandb.Image(image, classes=classes, boxes={"ground_truth": {
            "box_data": box_data, "class_labels": names}}), list(shown.values()), Path(image).name)
    return table


def _name_in(file: str, root: Path) -> str:
    """A dataset file's name in its artifact: its path below the dataset's root (else its absolute path's parts)."""
    relative = Path(os.path.relpath(file, root))
    return (relative if relative.parts[0] != ".." else Path(*Path(file).resolve().parts[1:])).as_posix()


# --------------------------------------------------------------------------- reading an offline run back

LOG_BLOCK = 32768                       # the transaction log's block size (a LevelDB-style log)
LOG_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)  # magic, then version 0
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4  # how a record lies across blocks


def read_records(path: Path) -> list:
    """Every record of an offline run's ``run-<id>.wandb`` transaction log, as wandb's own ``Record`` messages
    (``wandb.proto.wandb_internal_pb2``): run, config, history (one per step), files, artifacts, exit, ..."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = Path(path).read_bytes()
    if not data.startswith(LOG_HEADER):
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    records, parts, position = [], b"", len(LOG_HEADER)
    while position + 7 <= len(data):
        left = LOG_BLOCK - position % LOG_BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 and length == 0:  # zeros: padding or an unwritten tail
            position += left
            continue
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        parts = chunk if kind in (FULL, FIRST) else parts + chunk
        if kind in (FULL, LAST):
            record = Record()
            record.ParseFromString(parts)
            records.append(record)
    return records


def history_steps(records: list) -> list[int]:
    return [record.history.step.num for record in records if record.WhichOneof("record_type") == "history"]


def last_offline_step(wandb_dir: Path, run_id: str) -> int:
    """The last step that earlier offline runs with this id logged in this run folder (-1: none)."""
    steps = [-1]
    for log in sorted(Path(wandb_dir).glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        steps += history_steps(read_records(log))
    return max(steps)
