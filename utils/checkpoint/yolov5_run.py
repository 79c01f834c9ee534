"""A run YOLOv5 started, continued here: ``python train.py --resume runs/train/exp/weights/last.pt`` on YOLOv5's
last.pt (v6.0 to v7), in YOLOv5's run folder.

``yolov5_resumable`` turns the file, and what YOLOv5's own --resume reads beside it, into a resumable checkpoint
of ours, which then goes through the same checks as any other (utils.checkpoint.checks):

- the model (fp16, as YOLOv5 saves it: YOLOv5's own resume trains on from the same rounded weights), its EMA and
  the EMA's update count;
- the optimizer's per-parameter state (SGD's momentum buffers; Adam's moments and steps). YOLOv5's groups are
  matched to its two layouts by their sizes -- v6.2 and later (smart_optimizer): biases, decayed weights,
  normalisation weights, which are utils.trainer.optim's groups; v6.1 and before: BatchNorm2d weights, weights,
  biases -- and each parameter's state moves to its name's place in ours. The names go with the state, and the
  trainer checks them against its own model's (a model whose parameters come in another order is refused);
- the options: ``<run>/opt.yaml`` when it is there (YOLOv5 reads it first, and people edit it to change
  --epochs), else the checkpoint's ``opt``; each through the command line's bounds. An option YOLOv5 stored as
  None was not given, and takes this project's default. v6.0's ``adam`` and ``linear_lr`` become --optimizer
  and --cos-lr; YOLOv5's options this project does not have (``bucket``) are left out;
- the hyperparameters: opt's ``hyp`` dict, else ``<run>/hyp.yaml``;
- the position: the epoch after the file's ``epoch``, and its best fitness; results.csv's rows up to it (for
  an epoch listed twice, as after a YOLOv5 resume, the later row) and the best epoch among them (--patience).

What YOLOv5's files do not hold starts afresh, as in YOLOv5's own resume: the fp16 loss scale, the random
generators (the draws go on from --seed) and the batch count, which the trainer sets to epoch x batches per
epoch once the loader exists (YOLOv5's ``ni``; warmup is measured in it). From there the run trains by this
project's rules, which are YOLOv5 v7's. Refused in one line: an --evolve generation's file, a run YOLOv5 sized
with AutoBatch (the batch it chose is not stored: it printed it), an optimizer that matches no YOLOv5 layout, a
results.csv that cannot be read. ``keep_yolov5_files`` keeps YOLOv5's last.pt and results.csv beside the run's
new ones (``weights/last.yolov5.pt``, ``results.yolov5.csv``), since the resumed run replaces both.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import fields
from pathlib import Path

import numpy as np

from utils.config import ConfigError, TrainConfig
from utils.errors import CheckpointError, shorten, writing
from utils.files import read_regular
from utils.loggers import RESULTS_KEYS
from utils.metrics import fitness
from utils.safe_yaml import read_yaml_as

LOGGER = logging.getLogger(__name__)

OWN_LAYOUT = "v6.2+"  # utils.yolov5_import.optimizer_layouts: the layout whose groups are utils.trainer.optim's
MAX_RESULTS_BYTES = 64 << 20  # results.csv: about 300 bytes a row
KEPT_LAST, KEPT_RESULTS = "last.yolov5.pt", "results.yolov5.csv"


def yolov5_resumable(ckpt: dict, path, version: int) -> dict:
    """Our resumable checkpoint layout (utils.checkpoint; its "training" entry of layout ``version``) for YOLOv5's
    last.pt ``path``, read by ``load_checkpoint(path, yolov5_training=True)`` as ``ckpt``, plus "parameter_names": the
    parameter of each optimizer index. CheckpointError (one line, naming the file) when it cannot be resumed."""
    path = Path(path)
    ckpt = dict(ckpt)
    training = ckpt.pop("yolov5_training", None)
    epoch = ckpt.get("epoch")
    if training is None or type(epoch) is not int or epoch < 0:
        raise CheckpointError(f"{path}: not resumable (a YOLOv5 file without its optimizer or epoch: a finished run's "
                              f"or released weights); to train on from it: --weights {path}")
    folder = path.parent.parent
    opt, opt_source = run_options(folder, training["opt"], path)
    config = config_from_options(opt, folder, opt_source)
    hyp = run_hyp(opt, folder)
    done = epoch + 1
    rows = read_results(folder / "results.csv", done)
    optimizer, names, layout = own_optimizer(training["optimizer"], training["layouts"], path)
    updates = ckpt.get("ema_updates") or 0
    batches = max(done, updates)  # a bound for the checks; the trainer sets the count (module docstring)
    best_fitness = ckpt.get("best_fitness")
    best_fitness = float(best_fitness) if isinstance(best_fitness, float) and math.isfinite(best_fitness) else 0.0
    scores = list(fitness(np.array([[0, 0, row["metrics/mAP_0.5"], row["metrics/mAP_0.5:0.95"]] for row in rows])
                          .reshape(-1, 4)))
    best_epoch = max((row["epoch"] for row, score in zip(rows, scores) if score == max(scores)), default=-1)
    run = {"epoch": done, "batch": 0, "best_fitness": best_fitness, "best_epoch": best_epoch, "results": rows,
           "maps": None, "loss_sums": [0.0, 0.0, 0.0], "loss_batches": 0, "world_size": 1, "finished": False,
           "planned_epochs": 0, "train_seconds": 0.0, "tracker_runs": {},
           "counters": {"global_step": batches, "last_optimizer_step": batches - 1, "nonfinite_in_row": 0,
                        "nonfinite_total": 0, "skipped_steps_in_row": 0, "skipped_steps_total": 0}}
    LOGGER.info("%s: a YOLOv5 run (options from %s), continued from epoch %d with its optimizer state (%s layout), "
                "EMA and %d results rows", path, opt_source, done, layout, len(rows))
    return {**ckpt, "config": config, "hyp": hyp, "parameter_names": names,
            "training": {"version": version, "optimizer": optimizer, "scaler": {}, "scheduler": {},
                         "ema_updates": updates, "run": run, "rng": []}}


def run_options(folder: Path, stored, path: Path) -> tuple[dict, str]:
    """(YOLOv5's options, where they came from): ``<run>/opt.yaml`` when present, else the checkpoint's ``opt``."""
    source = folder / "opt.yaml"
    if source.is_file():
        stored = read_yaml_as(source, CheckpointError)
    else:
        source = f"{path} (opt)"
    if not isinstance(stored, dict) or not all(isinstance(key, str) for key in stored):
        raise CheckpointError(f"{source}: expected YOLOv5's options (a mapping), got {shorten(stored, 60)}")
    return stored, str(source)


def config_from_options(opt: dict, folder: Path, source: str) -> dict:
    """Our stored options (TrainConfig fields) from YOLOv5's, checked with the command line's bounds."""
    values = {key: value for key, value in opt.items() if value is not None}  # None: the option was not given
    if "optimizer" not in values and isinstance(values.get("adam"), bool):  # v6.0: --adam
        values["optimizer"] = "Adam" if values["adam"] else "SGD"
    if "cos_lr" not in values and isinstance(values.get("linear_lr"), bool):  # v6.0: one-cycle unless --linear-lr
        values["cos_lr"] = not values["linear_lr"]
    if "imgsz" not in values and isinstance(values.get("img_size"), list) and values["img_size"]:
        values["imgsz"] = values["img_size"][0]  # before v6.0: [train, test]
    if isinstance(values.get("freeze"), int) and not isinstance(values["freeze"], bool):
        values["freeze"] = [values["freeze"]]
    for key, flag in (("optimizer", "--optimizer (or --adam)"), ("cos_lr", "--cos-lr (or --linear-lr)")):
        if key not in values:
            raise CheckpointError(f"{source}: has no {flag}: not the options of a YOLOv5 v6.0 or later run")
    if values.get("evolve"):
        raise CheckpointError(f"{source}: an --evolve generation's run; evolution starts its generations afresh")
    if values.get("batch_size") == -1:
        raise CheckpointError(f"{source}: a YOLOv5 AutoBatch run (--batch-size -1): the batch it chose is not in its "
                              "files; set batch_size in opt.yaml to the batch YOLOv5 printed ('AutoBatch: Using "
                              "batch-size N') and resume again")
    if isinstance(values.get("hyp"), dict):
        values["hyp"] = str(folder / "hyp.yaml")  # the values come from the dict (run_hyp); the option names them
    known = {field.name for field in fields(TrainConfig)}
    values = {key: value for key, value in values.items() if key in known}
    try:
        TrainConfig.from_dict(values, source=source)
    except ConfigError as error:
        raise CheckpointError(str(error)) from None
    return values


def run_hyp(opt: dict, folder: Path) -> dict:
    """The run's hyperparameters: opt's ``hyp`` dict (YOLOv5 v6.0+), else ``<run>/hyp.yaml``."""
    hyp = opt.get("hyp")
    if isinstance(hyp, dict):
        return hyp
    where = folder / "hyp.yaml"
    hyp = read_yaml_as(where, CheckpointError)
    if not isinstance(hyp, dict):
        raise CheckpointError(f"{where}: expected a mapping of hyperparameters")
    return hyp


def read_results(path: Path, epochs_done: int) -> list[dict]:
    """results.csv's rows for the finished epochs, as RunState holds them; [] (with a warning) when there is none."""
    try:
        raw = read_regular(path, MAX_RESULTS_BYTES)
    except FileNotFoundError:
        LOGGER.warning("WARNING: %s not found: the resumed run's results.csv and plots start at epoch %d", path,
                       epochs_done)
        return []
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read ({error.strerror or error})") from None
    lines = raw.decode("utf-8", errors="replace").splitlines()
    columns = ["epoch", *RESULTS_KEYS]
    header = [cell.strip() for cell in lines[0].split(",")] if lines else []
    if header != columns:
        raise CheckpointError(f"{path}: not YOLOv5's results.csv (its header is {shorten(','.join(header), 80)}); "
                              "move it away to resume without the earlier rows")
    rows = {}
    for number, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        try:
            values = [float(cell) for cell in line.split(",")]
        except ValueError:
            values = []
        if len(values) != len(columns) or not all(map(math.isfinite, values)) or not values[0].is_integer() \
                or values[0] < 0:
            raise CheckpointError(f"{path}: line {number}: expected {len(columns)} finite numbers, the first an "
                                  f"epoch, got {shorten(line.strip(), 80)}; mend or remove the line to resume")
        if values[0] < epochs_done:
            rows[int(values[0])] = dict(zip(RESULTS_KEYS, values[1:]))  # a later row for an epoch replaces it
    return [{"epoch": epoch, **rows[epoch]} for epoch in sorted(rows)]


def own_optimizer(saved: dict, layouts: dict, path: Path) -> tuple[dict, list[str], str]:
    """(the optimizer state in utils.trainer.optim's group order, the parameter name of each index, the file's
    layout). ``layouts``: utils.yolov5_import.optimizer_layouts of the model; the file's layout is the one its group
    sizes match."""
    sizes = [len(group["params"]) for group in saved["param_groups"]]
    matched = [name for name, groups in layouts.items() if [len(group) for group in groups] == sizes]
    if len({tuple(map(tuple, layouts[name])) for name in matched}) != 1:
        expected = "; ".join(f"{name}: {[len(group) for group in groups]}" for name, groups in layouts.items())
        raise CheckpointError(f"{path}: optimizer groups of {shorten(sizes, 60)} parameters match "
                              f"{'no' if not matched else 'more than one'} YOLOv5 layout for this model ({expected})")
    index_of = {name: index for names, group in zip(layouts[matched[0]], saved["param_groups"])
                for name, index in zip(names, group["params"])}
    names = [name for group in layouts[OWN_LAYOUT] for name in group]
    missing = [name for name in names if name not in index_of]
    if missing:
        raise CheckpointError(f"{path}: the optimizer holds no state for the parameters {shorten(missing, 80)}")
    state = {}
    for index, name in enumerate(names):
        entry = saved["state"].get(index_of[name])
        if entry is not None:
            state[index] = dict(entry)
    groups, start = [], 0
    for group in layouts[OWN_LAYOUT]:
        groups.append({"params": list(range(start, start + len(group)))})
        start += len(group)
    return {"state": state, "param_groups": groups}, names, matched[0]


def keep_yolov5_files(folder: Path, last: Path) -> None:
    """Before the resumed run replaces them: YOLOv5's last.pt as weights/last.yolov5.pt and its results.csv as
    results.yolov5.csv, hard links (the run writes both anew, by rename, never in place), each once (a file kept by
    an earlier attempt stays)."""
    for source, kept in ((Path(last), Path(last).with_name(KEPT_LAST)), (folder / "results.csv", folder / KEPT_RESULTS)):
        if not source.is_file() or os.path.lexists(kept):
            continue
        with writing(kept):
            try:
                os.link(source, kept)
            except OSError:  # a file system without hard links
                shutil.copy2(source, kept)
        LOGGER.info("Kept YOLOv5's %s as %s", source.name, kept)
