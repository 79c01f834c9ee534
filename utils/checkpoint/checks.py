"""The one validation of a resumable checkpoint's run state: every field's type and range, with a one-line
CheckpointError naming the file and the field (``<file>: training.run.batch: expected ...``).

Two stages, both before anything is restored:

- ``check_training(ckpt, path)`` (called by utils.checkpoint.training_state, before the run folder, data or
  model are touched): the stored options through the command line's own bounds (TrainConfig.from_dict),
  the hyp through Hyp's ranges, the run's position, counters, record and results rows
  (``check_run``), the generator states (``check_rng``), the optimizer's layout and the loss scaler.
- ``check_against_run(...)`` (called by the trainer once the model, optimizer and loaders exist): the
  optimizer's groups and per-parameter state against the model's parameters, the EMA weights against the
  model, the position against the loader's batches per epoch, the per-class mAPs against the classes.

What is not taken from the file at all: learning rates, momentum, betas, weight decay and every other
optimizer group setting, and the scheduler's attributes; they are rebuilt from the validated hyp, config
and position (utils.trainer.optim.restore_optimizer / restore_schedule).

Every message formats file content through utils.errors.shorten only, and every walk is bounded by a
count checked before it starts (results rows at most one per finished epoch, generator states one per
process), so a crafted file answers in one line, in time bounded by the file's size.
"""
from __future__ import annotations

import math
import re
from dataclasses import fields

import torch

from utils.config import ConfigError, Hyp, TrainConfig
from utils.errors import CheckpointError, shorten
from utils.limits import MAX_CLASSES, MAX_GLOBAL_STEP, MAX_PROCESSES, MAX_TENSORS
from utils.loggers import RESULTS_KEYS

def _run_layout():
    """(RunState, StepCounters, the in-a-row stop limit), imported when a check runs: utils.trainer imports this
    module (its trainer checks a resumed run against what it built), so importing it here at load time would
    be circular."""
    from utils.trainer.loop import MAX_NONFINITE_IN_ROW
    from utils.trainer.state import RunState, StepCounters

    return RunState, StepCounters, MAX_NONFINITE_IN_ROW


ROW_KEYS = frozenset(("epoch", *RESULTS_KEYS))
MT_WORDS = 624  # Mersenne Twister state words (Python's random and numpy's MT19937)
MAX_GROUPS = 16  # optimizer parameter groups (ours has 3)
OPTIMIZER_STATE_KEYS = {"SGD": {"momentum_buffer"}, "Adam": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
                        "AdamW": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}}


class Fields:
    """Checks of values read from one file; each failure is a one-line CheckpointError naming the file and
    the field (its path inside the checkpoint)."""

    def __init__(self, path):
        self.path = path

    def fail(self, name: str, reason: str):
        raise CheckpointError(f"{self.path}: {name}: {reason}")

    def integer(self, value, name: str, low: int, high: int, note: str = "") -> int:
        if type(value) is not int or not low <= value <= high:
            self.fail(name, f"expected an integer in [{low}, {high}]{note}, got {shorten(value, 40)}")
        return value

    def number(self, value, name: str, low: float = -math.inf, high: float = math.inf) -> float:
        finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not finite or not low <= value <= high:
            self.fail(name, f"expected a finite number in [{low:g}, {high:g}], got {shorten(value, 40)}")
        return float(value)

    def kind(self, value, name: str, kinds, what: str):
        if not isinstance(value, kinds):
            self.fail(name, f"expected {what}, got {type(value).__name__}")
        return value

    def keys(self, mapping: dict, name: str, required) -> None:
        missing = [key for key in required if key not in mapping]
        if missing:
            self.fail(f"{name}.{missing[0]}", "is missing")


# ---------------------------------------------------------------------- stage 1: the file alone

def check_training(ckpt: dict, path) -> tuple[TrainConfig, Hyp]:
    """Validate everything resumable in ``ckpt`` that does not need the model or the data; returns the
    checked options and hyp. ``ckpt["training"]`` has the right version and entry types already."""
    where = Fields(path)
    try:
        config = TrainConfig.from_dict(where.kind(ckpt.get("config"), "config", dict, "a dict of options"),
                                       source=f"{path} (config)")
        hyp = Hyp.from_dict(where.kind(ckpt.get("hyp"), "hyp", dict, "a dict of hyperparameters"),
                            source=f"{path} (hyp)")
    except ConfigError as error:
        raise CheckpointError(str(error)) from None
    if config.batch_size < 1:
        where.fail("config.batch_size", f"a run's total batch is saved, got {config.batch_size}")
    training = ckpt["training"]
    run = check_run(training["run"], config.epochs, where)
    global_step = run["counters"]["global_step"]
    where.integer(training["ema_updates"], "training.ema_updates", 0, global_step, " (at most one per batch trained)")
    if training["rng"] or ckpt.get("source") != "yolov5":  # YOLOv5's files hold no generator states
        check_rng(training["rng"], run["world_size"], where)
    check_optimizer_layout(training["optimizer"], where)
    check_scaler(training["scaler"], where)
    where.kind(training["scheduler"], "training.scheduler", dict, "a dict")  # not used: rebuilt from the hyp
    return config, hyp


RUN_RULES = ("epoch", "batch", "counters", "best_fitness", "best_epoch", "results", "maps", "loss_sums",
             "loss_batches", "world_size", "finished")


def check_run(run: dict, epochs: int, where: Fields) -> dict:
    """The RunState dict: position within [0, epochs], counters consistent with it, the record of finished
    epochs. Fields added to RunState without a rule here must hold plain bounded values."""
    where.keys(run, "training.run", RUN_RULES)
    epoch = where.integer(run["epoch"], "training.run.epoch", 0, epochs, f" (the run has {epochs} epochs)")
    counters = check_counters(run["counters"], where)
    global_step = counters["global_step"]
    if epoch > global_step:
        where.fail("training.run.counters.global_step", f"{global_step} batches trained, fewer than the {epoch} "
                                                         "finished epochs")
    batch = where.integer(run["batch"], "training.run.batch", 0, global_step - epoch,
                          " (batches trained in the epoch in progress)")
    if epoch == epochs and batch:
        where.fail("training.run.batch", f"is {batch} but all {epochs} epochs are done")
    where.integer(run["loss_batches"], "training.run.loss_batches", 0, batch)
    sums = where.kind(run["loss_sums"], "training.run.loss_sums", list, "a list")
    if len(sums) != 3:
        where.fail("training.run.loss_sums", f"expected 3 sums (box, obj, cls), got {len(sums)} values")
    for index, value in enumerate(sums):
        where.number(value, f"training.run.loss_sums[{index}]", 0.0)
    where.number(run["best_fitness"], "training.run.best_fitness", -1.0, 1.0)
    where.integer(run["best_epoch"], "training.run.best_epoch", -1, epoch - 1)
    where.integer(run["world_size"], "training.run.world_size", 1, MAX_PROCESSES)
    where.kind(run["finished"], "training.run.finished", bool, "true or false")
    check_results(run["results"], epoch, where)
    check_maps(run["maps"], where)
    if "planned_epochs" in run:  # --time (absent from checkpoints written before it existed)
        where.integer(run["planned_epochs"], "training.run.planned_epochs", 0, epochs, " (0: not chosen yet)")
    if "train_seconds" in run:
        where.number(run["train_seconds"], "training.run.train_seconds", 0.0)
    if "tracker_runs" in run:  # experiment trackers' run ids (absent from checkpoints written before them)
        check_tracker_runs(run["tracker_runs"], where)
    run_state, _, _ = _run_layout()
    for name in {f.name for f in fields(run_state)} - set(RUN_RULES) - {"planned_epochs", "train_seconds",
                                                                         "tracker_runs"}:
        if name in run:
            _plain(run[name], f"training.run.{name}", where)
    return run


TRACKER_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
TRACKER_RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # MLflow's are 32 hex digits
MAX_TRACKERS = 16


def check_tracker_runs(runs, where: Fields) -> None:
    """Tracker name -> run id: a few short names and ids of plain characters (the ids go into a tracker's URLs)."""
    name = "training.run.tracker_runs"
    where.kind(runs, name, dict, "a dict of tracker name -> run id")
    if len(runs) > MAX_TRACKERS:
        where.fail(name, f"{len(runs)} entries, more than {MAX_TRACKERS} trackers")
    for key, value in runs.items():
        if not isinstance(key, str) or not TRACKER_NAME.fullmatch(key):
            where.fail(name, f"expected tracker names of lower-case letters, digits and _, got {shorten(key, 40)}")
        if not isinstance(value, str) or not TRACKER_RUN_ID.fullmatch(value):
            where.fail(f"{name}.{key}", f"expected a run id of at most 128 letters, digits, '_', '.' or '-', "
                                        f"got {shorten(value, 40)}")


def check_counters(counters, where: Fields) -> dict:
    name = "training.run.counters"
    where.kind(counters, name, dict, "a dict")
    _, step_counters, max_in_row = _run_layout()
    where.keys(counters, name, [f.name for f in fields(step_counters) if f.name not in LATER_COUNTERS])
    global_step = where.integer(counters["global_step"], f"{name}.global_step", 0, MAX_GLOBAL_STEP)
    where.integer(counters["last_optimizer_step"], f"{name}.last_optimizer_step", -1, global_step - 1,
                  " (-1 or a batch already trained)")
    for kind in ("nonfinite", "skipped_steps"):  # NaN/inf losses; optimizer steps skipped for NaN/inf gradients
        if f"{kind}_total" not in counters and kind == "skipped_steps":
            continue  # a checkpoint from before steps were counted
        total = where.integer(counters[f"{kind}_total"], f"{name}.{kind}_total", 0, global_step)
        where.integer(counters.get(f"{kind}_in_row"), f"{name}.{kind}_in_row", 0, min(total, max_in_row - 1))
    return counters


LATER_COUNTERS = ("skipped_steps_in_row", "skipped_steps_total")  # absent from checkpoints written before them


def check_results(rows, epoch: int, where: Fields) -> None:
    """At most one row per finished epoch (counted before any row is read), epochs strictly increasing
    (so no row object can appear twice), every column present and finite."""
    name = "training.run.results"
    where.kind(rows, name, list, "a list of rows")
    if len(rows) > epoch:
        where.fail(name, f"{len(rows)} rows for {epoch} finished epochs (at most one per epoch)")
    previous = -1
    for index, row in enumerate(rows):
        field = f"{name}[{index}]"
        if not isinstance(row, dict) or len(row) != len(ROW_KEYS) or not ROW_KEYS.issuperset(row):
            where.fail(field, f"expected a row with the {len(ROW_KEYS)} results.csv columns, got {shorten(row, 60)}")
        previous = where.integer(row["epoch"], f"{field}.epoch", previous + 1, epoch - 1, " (rows in epoch order)")
        for key in RESULTS_KEYS:
            where.number(row[key], f"{field}.{key}")


def check_maps(maps, where: Fields) -> None:
    if maps is None:
        return
    where.kind(maps, "training.run.maps", list, "a list or null")
    if len(maps) > MAX_CLASSES:
        where.fail("training.run.maps", f"{len(maps)} values, more than {MAX_CLASSES} classes")
    for index, value in enumerate(maps):
        where.number(value, f"training.run.maps[{index}]", 0.0, 1.0)


def _plain(value, name: str, where: Fields) -> None:
    """A run-state field without its own rule: a bounded scalar or a short flat list of them."""
    items = value if isinstance(value, list) and len(value) <= 1000 else [value]
    for item in items:
        if not (item is None or isinstance(item, (bool, str)) and len(str(item)) <= 4096 or
                isinstance(item, int) and abs(item) <= 2 ** 63 or isinstance(item, float) and math.isfinite(item)):
            where.fail(name, f"expected plain values, got {shorten(value, 40)}")


def check_rng(states, world_size: int, where: Fields) -> None:
    """One generator state per process that trained the run, each shaped as capture_rng makes it."""
    name = "training.rng"
    where.kind(states, name, list, "a list (one state per process)")
    if len(states) != world_size:
        where.fail(name, f"{len(states)} generator states for a run of {world_size} processes")
    torch_state = torch.get_rng_state()
    for index, state in enumerate(states):
        field = f"{name}[{index}]"
        where.kind(state, field, dict, "a dict")
        where.keys(state, field, ("python", "numpy", "torch"))
        _python_rng(state["python"], f"{field}.python", where)
        _numpy_rng(state["numpy"], f"{field}.numpy", where)
        saved = state["torch"]
        if not torch.is_tensor(saved) or saved.dtype != torch_state.dtype or saved.shape != torch_state.shape:
            where.fail(f"{field}.torch", f"expected a {torch_state.dtype} tensor of shape {tuple(torch_state.shape)}, "
                                         f"got {shorten(saved, 60)}")
        if "cuda" in state:
            cuda = state["cuda"]
            if not isinstance(cuda, list) or len(cuda) > 1024 or not all(
                    torch.is_tensor(t) and t.dtype == torch.uint8 and t.dim() == 1 and t.numel() <= 4096 for t in cuda):
                where.fail(f"{field}.cuda", f"expected a list of byte tensors, got {shorten(cuda, 60)}")


def _mt_words(words, name: str, count: int, where: Fields) -> None:
    if not isinstance(words, (list, tuple)) or len(words) != count or not all(
            type(word) is int and 0 <= word < 2 ** 32 for word in words):
        where.fail(name, f"expected {count} integers in [0, 2**32), got {shorten(words, 60)}")


def _python_rng(state, name: str, where: Fields) -> None:
    if not isinstance(state, (list, tuple)) or len(state) != 3 or state[0] != 3:
        where.fail(name, f"expected a random.getstate() value, got {shorten(state, 60)}")
    _mt_words(state[1], f"{name}[1]", MT_WORDS + 1, where)
    where.integer(state[1][-1], f"{name}[1][-1]", 0, MT_WORDS)
    if state[2] is not None:
        where.number(state[2], f"{name}[2]")


def _numpy_rng(state, name: str, where: Fields) -> None:
    where.kind(state, name, dict, "a dict")
    where.keys(state, name, ("bit_generator", "key", "pos", "has_gauss", "gauss"))
    if state["bit_generator"] != "MT19937":
        where.fail(f"{name}.bit_generator", f"expected 'MT19937', got {shorten(state['bit_generator'], 40)}")
    _mt_words(state["key"], f"{name}.key", MT_WORDS, where)
    where.integer(state["pos"], f"{name}.pos", 0, MT_WORDS)
    where.integer(state["has_gauss"], f"{name}.has_gauss", 0, 1)
    where.number(state["gauss"], f"{name}.gauss")


def check_optimizer_layout(optimizer: dict, where: Fields) -> None:
    """Groups of parameter indices 0..N-1, each listed once; a per-parameter state dict for some of them."""
    groups = where.kind(optimizer.get("param_groups"), "training.optimizer.param_groups", list, "a list")
    state = where.kind(optimizer.get("state"), "training.optimizer.state", dict, "a dict")
    if not 1 <= len(groups) <= MAX_GROUPS:
        where.fail("training.optimizer.param_groups", f"expected 1 to {MAX_GROUPS} groups, got {len(groups)}")
    total = 0
    for index, group in enumerate(groups):
        name = f"training.optimizer.param_groups[{index}].params"
        params = where.kind(group.get("params") if isinstance(group, dict) else None, name, list, "a list")
        if total + len(params) > MAX_TENSORS or params != list(range(total, total + len(params))):
            where.fail(name, f"expected the parameter indices {total}.., got {shorten(params, 60)}")
        total += len(params)
    if len(state) > total:
        where.fail("training.optimizer.state", f"{len(state)} entries for {total} parameters")
    for index, entry in state.items():
        if type(index) is not int or not 0 <= index < total or not isinstance(entry, dict) or len(entry) > 8:
            where.fail("training.optimizer.state", f"expected parameter index -> dict, got {shorten(index, 20)} -> "
                                                   f"{shorten(entry, 60)}")


def check_scaler(scaler: dict, where: Fields) -> None:
    """Empty (no fp16 loss scaling), or a GradScaler state: only its scale and growth tracker are used."""
    if not scaler:
        return
    where.keys(scaler, "training.scaler", ("scale", "_growth_tracker"))
    where.number(scaler["scale"], "training.scaler.scale", 2.0 ** -126, 2.0 ** 127)
    where.integer(scaler["_growth_tracker"], "training.scaler._growth_tracker", 0, MAX_GLOBAL_STEP)


# ---------------------------------------------------------------------- stage 2: against the built run

def check_against_run(resume, optimizer: torch.optim.Optimizer, ema_model, batches_per_epoch: int,
                      classes: int, parameter_names: list[str] | None = None) -> None:
    """The parts of ``resume`` (a utils.checkpoint.TrainingState) that depend on what was built: called
    before anything of it is loaded. ``parameter_names``: the name of each of ``optimizer``'s parameters, in
    order, compared with the file's where it names them (a YOLOv5 run's: its state is placed by name)."""
    where = Fields(resume.path)
    run = resume.run
    if run["batch"] and run["batch"] >= batches_per_epoch:
        where.fail("training.run.batch", f"{run['batch']} batches done, but an epoch of this run has "
                                         f"{batches_per_epoch} batches")
    if run["maps"] is not None and len(run["maps"]) != classes:
        where.fail("training.run.maps", f"{len(run['maps'])} per-class values for {classes} classes")
    check_optimizer_state(resume.optimizer, optimizer, where)
    saved_names = resume.parameter_names
    if saved_names is not None and parameter_names is not None and saved_names != parameter_names:
        index = next((i for i, (a, b) in enumerate(zip(saved_names, parameter_names)) if a != b),
                     min(len(saved_names), len(parameter_names)))
        saved = saved_names[index] if index < len(saved_names) else "none"
        own = parameter_names[index] if index < len(parameter_names) else "none"
        where.fail(f"optimizer parameter {index}", f"is {shorten(saved, 60)} in the file but {shorten(own, 60)} in "
                                                   "this model (its parameters come in another order)")
    if ema_model is not None:
        entry = resume.ema if resume.ema is not None else resume.model
        check_weights(entry.get("state_dict"), ema_model.state_dict(), "ema.state_dict" if resume.ema else
                      "model.state_dict", where)


def check_optimizer_state(saved: dict, optimizer: torch.optim.Optimizer, where: Fields) -> None:
    """Same groups with the same parameter counts as the optimizer built for the model, and per-parameter
    state of the kind this optimizer keeps, shaped like its parameter."""
    own = optimizer.state_dict()["param_groups"]
    groups = saved["param_groups"]
    if len(groups) != len(own):
        where.fail("training.optimizer.param_groups", f"{len(groups)} groups, the optimizer for this model has "
                                                      f"{len(own)}")
    for index, (group, mine) in enumerate(zip(groups, own)):
        if len(group["params"]) != len(mine["params"]):
            where.fail(f"training.optimizer.param_groups[{index}].params", f"{len(group['params'])} parameters, "
                                                                           f"the model has {len(mine['params'])} here")
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    allowed = OPTIMIZER_STATE_KEYS.get(type(optimizer).__name__)
    for index, entry in saved["state"].items():
        name = f"training.optimizer.state[{index}]"
        if allowed is not None and not allowed.issuperset(entry):
            where.fail(name, f"expected keys among {sorted(allowed)}, got {shorten(list(entry), 60)}")
        for key, value in entry.items():
            shown = key if isinstance(key, str) and len(key) <= 40 else shorten(key, 40)
            _optimizer_value(value, key, parameters[index], f"{name}.{shown}", where)


def _optimizer_value(value, key, parameter: torch.Tensor, name: str, where: Fields) -> None:
    if key == "step":
        number = value.item() if torch.is_tensor(value) and value.numel() == 1 and value.is_floating_point() else value
        where.number(number, name, 0.0, float(MAX_GLOBAL_STEP))
    elif value is None and key == "momentum_buffer":
        return
    elif not torch.is_tensor(value) or not value.is_floating_point() or value.shape != parameter.shape:
        where.fail(name, f"expected a float tensor of shape {tuple(parameter.shape)} (its parameter's), "
                         f"got {shorten(value, 60)}")


def check_weights(state_dict, own: dict, name: str, where: Fields) -> None:
    """A state dict with exactly the model's entries and shapes."""
    if not isinstance(state_dict, dict) or len(state_dict) != len(own):
        where.fail(name, f"expected the model's {len(own)} tensors, got {shorten(state_dict, 60)}")
    for key, tensor in own.items():
        value = state_dict.get(key)
        if not torch.is_tensor(value) or value.shape != tensor.shape:
            where.fail(f"{name}.{key}", f"expected a tensor of shape {tuple(tensor.shape)}, got {shorten(value, 60)}")
