"""Saving and loading checkpoints (the layout: utils/checkpoint/__init__.py).

A training checkpoint is written atomically (utils.files.AtomicFile) and, for last.pt, the previous good file is
kept as last.prev.pt until the new one is complete; ``load_resumable`` falls back to it when the newest file is
unreadable. Every file is checked before torch.load runs it: the pickle torch will read (utils.pickle_scan, the
archive member ``utils.yolov5_import.find_pickle`` names), YOLOv5 ``.pt`` files (pickled modules) recognised
and converted by ``utils.yolov5_import``; a resumable state's every field by ``training_state``.
"""
from __future__ import annotations

import logging
import re
import zipfile
from copy import deepcopy
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

from utils.checkpoint.checks import check_training
from utils.dist import is_main_process
from utils.errors import CheckpointError, WriteError, shorten
from utils.files import AtomicFile, remove_stale_temps, replace_with_link
from utils.limits import MAX_CLASSES, MAX_NAME_LENGTH, MAX_TENSOR_BYTES
from utils.pickle_scan import check_legacy_pickles, check_tuple_work, pickle_globals, scan_pickle

LOGGER = logging.getLogger(__name__)
FORMAT = "yolo-trainer/1"
TRAINING_VERSION = 1  # layout of the "training" entry; a resumed run needs the same
ZIP_MAGIC = b"PK\x03\x04"


def model_state(model, half: bool = False) -> dict:
    """A "model"/"ema" entry: everything needed to rebuild ``model`` without pickling code."""
    model = getattr(model, "module", model)  # DDP / DataParallel wrapper
    state = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        state[name] = tensor.half() if half and tensor.is_floating_point() else tensor.clone()
    return {"yaml": deepcopy(model.yaml), "state_dict": state, "names": [str(n) for n in model.names],
            "stride": [float(s) for s in model.stride.tolist()]}


def save_checkpoint(ckpt: dict, path, keep_previous: bool = False) -> Path | None:
    """Write ``ckpt`` (plain data) atomically (utils.files.AtomicFile: temp file in the same folder, fsync,
    os.replace, folder fsync).

    With ``keep_previous`` the file being replaced stays as ``previous_path(path)`` (a hard link, no
    copy) until the new one is complete. Leftover temp files of an interrupted earlier save are removed.
    Only the main process writes (returns None elsewhere). "format" is added when absent. A failed
    write (disk full, no permission) raises WriteError and leaves the previous file as it was.
    """
    if not is_main_process():
        return None
    path = Path(path)
    data = {"format": FORMAT, **ckpt}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temp_files(path)
        with AtomicFile(path) as out:
            torch.save(data, out.file)
            if keep_previous and path.exists():
                replace_with_link(path, previous_path(path))
    except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
        if isinstance(error, RuntimeError) and "write" not in str(error).lower():
            raise
        intact = f"; the previous {path.name} is intact" if path.exists() else ""
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).splitlines()[0][:120]
        raise WriteError(f"{path}: could not write checkpoint ({reason}){intact}") from None
    return path


def previous_path(path) -> Path:
    """Where ``save_checkpoint(keep_previous=True)`` keeps the file it replaced: last.pt -> last.prev.pt."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def _remove_stale_temp_files(path: Path) -> None:
    """Temp files a killed save left beside ``path`` or its previous copy (never another process's save
    in progress: only the main process of the one run that owns this folder writes here)."""
    for name in (path, previous_path(path)):
        remove_stale_temps(name)


def copy_checkpoint(source, path) -> Path | None:
    """Make ``path`` hold ``source``'s bytes, atomically (e.g. best.pt from the last.pt just written:
    a hard link where the filesystem has them). Main process only."""
    if not is_main_process():
        return None
    source, path = Path(source), Path(path)
    try:
        _remove_stale_temp_files(path)
        replace_with_link(source, path)
    except OSError as error:
        raise WriteError(f"{path}: could not write checkpoint ({error.strerror or error})") from None
    return path


def load_checkpoint(path, yolov5_training: bool = False) -> dict:
    """Our format for any supported file (ours, or YOLOv5's converted); CheckpointError otherwise. The file is
    opened once: the checks and torch.load read the same open file, so replacing it on disk between them has no
    effect. ``yolov5_training``: a YOLOv5 file's converted form also has its "yolov5_training" entry (for
    utils.checkpoint.yolov5_run)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint file not found")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a file")
    with open(path, "rb") as file:
        return _load_open(file, path, yolov5_training)


def _load_open(file, path: Path, yolov5_training: bool) -> dict:
    head = file.read(4)
    if head == ZIP_MAGIC:
        scan = scan_pickle(_zip_pickle(file, path))
        check_tuple_work(scan, path)
        if any(name.startswith("models.") for name in scan.globals):  # YOLOv5's pickled modules
            from utils.yolov5_import import load_yolov5_checkpoint
            return _check_names({**load_yolov5_checkpoint(path, yolov5_training, _rewound(file)), "format": FORMAT}, path)
        _check_storages(file, path)
    elif not head.startswith(b"\x80"):
        raise CheckpointError(f"{path}: not a checkpoint (neither a torch zip archive nor a pickle)")
    else:
        if _is_yolov5(_rewound(file).read(1 << 20)):
            raise CheckpointError(f"{path}: legacy (non-zip) YOLOv5 checkpoint is not supported; "
                                  "re-save it with torch >= 1.6")
        check_legacy_pickles(path, _rewound(file))  # the pickle budget and the tuple-expansion bound, as a zip's
    data = _check_ours(_torch_load(_rewound(file), path), path)
    _check_views(data, path)
    return _check_names(data, path)


def _rewound(file):
    file.seek(0)
    return file


def _check_storages(file, path: Path) -> None:
    """Before torch.load: the tensor storages' members stored as torch.save writes them (nothing to inflate: a
    2 MB file declaring gigabytes), at most MAX_TENSOR_BYTES declared in all."""
    from utils.yolov5_import import pickle_member

    with zipfile.ZipFile(_rewound(file)) as archive:
        folder = pickle_member(archive, str(path))[: -len("data.pkl")] + "data/"
        storages = [info for info in archive.infolist() if info.filename.startswith(folder)]
    packed = next((info for info in storages if info.compress_type != zipfile.ZIP_STORED), None)
    if packed is not None:
        raise CheckpointError(f"{path}: tensor storage {shorten(packed.filename, 60)} is compressed (torch.save "
                              "stores them as they are), not a torch checkpoint")
    total = sum(info.file_size for info in storages)
    if total > MAX_TENSOR_BYTES:
        raise CheckpointError(f"{path}: its tensors declare {total / 1e9:.1f} GB, more than the "
                              f"{MAX_TENSOR_BYTES / 1e9:.0f} GB a checkpoint may hold")


def _check_views(data, path: Path) -> None:
    """Every tensor of a loaded file covers no more elements than its storage holds: a zero-stride view of one
    value declaring 16384 x 16384 would become 1 GB on its first ``.float()``."""
    stack, visited = [(data, 0)], set()
    while stack:
        value, depth = stack.pop()
        if id(value) in visited:  # a value shared many times (a pickle can reference one object a million times)
            continue
        visited.add(id(value))
        if depth > 64 or len(visited) > 10_000_000:
            raise CheckpointError(f"{path}: nested deeper than 64 levels or more than 10 million values")
        if torch.is_tensor(value):
            if value.numel() and value.numel() * value.element_size() > value.untyped_storage().nbytes():
                raise CheckpointError(f"{path}: a tensor of {value.numel()} elements is a zero-stride or overlapping "
                                      f"view of a storage of {value.untyped_storage().nbytes()} bytes, not a "
                                      "checkpoint's weights")
        elif isinstance(value, dict):
            stack.extend((item, depth + 1) for pair in value.items() for item in pair)
        elif isinstance(value, (list, tuple)):
            stack.extend((item, depth + 1) for item in value)


def _zip_pickle(file, path: Path) -> bytes:
    """The data.pkl bytes of a torch zip archive (CheckpointError when truncated or corrupt, or when its
    declared size is more than any checkpoint's pickle needs: refused before it is decompressed)."""
    from utils.yolov5_import import find_pickle

    try:
        with zipfile.ZipFile(_rewound(file)) as archive:
            return archive.read(find_pickle(archive, str(path)))
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"{path}: truncated or corrupt zip archive ({error})") from None


def _is_yolov5(pickle_bytes: bytes) -> bool:
    return any(g.startswith("models.") for g in pickle_globals(pickle_bytes))


def _torch_load(file, path: Path):
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for damaged or refused files
        message = str(error)
        refused = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", message)
        if refused or "Weights only load failed" in message:
            what = f"global '{refused.group(1)}'" if refused else "content"
            raise CheckpointError(f"{path}: refused to load {what} (only plain data is allowed)") from None
        first = next((line.strip() for line in message.splitlines() if line.strip()), type(error).__name__)
        raise CheckpointError(f"{path}: corrupt or unsupported checkpoint ({first[:200]})") from None


def _check_ours(data, path: Path) -> dict:
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: unsupported content ({type(data).__name__}), expected a checkpoint dict")
    if data.get("format") != FORMAT:
        if "model" not in data and data and all(torch.is_tensor(v) for v in data.values()):
            raise CheckpointError(f"{path}: a bare state_dict, not a checkpoint (needs the model YAML)")
        raise CheckpointError(f"{path}: unsupported checkpoint format {shorten(data.get('format'), 40)} "
                              f"(expected '{FORMAT}')")
    for key in ("model", "ema"):
        entry = data.get(key)
        if key == "model" and entry is None or entry is not None and not (
                isinstance(entry, dict) and {"yaml", "state_dict"} <= entry.keys()):
            raise CheckpointError(f"{path}: '{key}' entry is missing or malformed")
    data.setdefault("ema", None)
    return data


def _check_names(data: dict, path: Path) -> dict:
    """Class names of the "model" and "ema" entries, checked (``class_names``) before anything uses them."""
    for key in ("model", "ema"):
        entry = data.get(key)
        if entry is not None and entry.get("names") is not None:
            data[key] = {**entry, "names": class_names(entry["names"], f"{path}: {key}.names")}
    return data


def class_names(names, where: str) -> list[str]:
    """A checkpoint's class names as a list of strings: a flat list/tuple of strings, or YOLOv5's {index: name}
    dict, at most MAX_CLASSES names of at most MAX_NAME_LENGTH characters; CheckpointError (``where``: the
    reason) otherwise. Types and sizes are checked before any value is converted or formatted."""
    if isinstance(names, dict):
        if len(names) > MAX_CLASSES or not all(type(key) is int for key in names):
            raise CheckpointError(f"{where}: expected {{index: name}} with at most {MAX_CLASSES} integer keys, "
                                  f"got {shorten(names, 60)}")
        names = [names[key] for key in sorted(names)]
    if not isinstance(names, (list, tuple)) or len(names) > MAX_CLASSES:
        raise CheckpointError(f"{where}: expected a list of at most {MAX_CLASSES} names, got {shorten(names, 60)}")
    for index, name in enumerate(names):
        if not isinstance(name, str) or len(name) > MAX_NAME_LENGTH:
            raise CheckpointError(f"{where}[{index}]: expected a string of at most {MAX_NAME_LENGTH} characters, "
                                  f"got {shorten(name, 60)}")
    return [str(name) for name in names]


# ---------------------------------------------------------------------- training checkpoints

@dataclass
class TrainingState:
    """What a resumed run needs from its checkpoint (types checked by ``training_state``); ``identity``: the file
    as it was read (utils.files.file_identity), so that a file rewritten before the run folder is locked is
    noticed (utils.trainer.resume.check_unchanged)."""
    path: Path
    model: dict
    ema: dict | None
    ema_updates: int
    optimizer: dict
    scaler: dict
    scheduler: dict
    run: dict
    rng: list
    config: dict
    hyp: dict
    identity: tuple | None = None
    origin: str = ""  # "yolov5": a run YOLOv5 started (utils.checkpoint.yolov5_run)
    parameter_names: list | None = None  # the parameter of each optimizer index, where the file names them (YOLOv5's)


def model_entry(ckpt: dict) -> dict:
    """The weights to infer or fine-tune from: the EMA entry when present, else the model entry."""
    return ckpt.get("ema") or ckpt["model"]


def training_checkpoint(model, ema, optimizer, scaler, scheduler, run: dict, rng: list, config: dict,
                        hyp: dict) -> dict:
    """A resumable checkpoint (the layout in the module docstring); ``run`` is a RunState dict."""
    return {
        "format": FORMAT,
        "model": model_state(model),
        "ema": model_state(ema.ema) if ema is not None else None,
        "epoch": int(run["epoch"]) - 1,  # the last finished epoch, as in YOLOv5's files
        "best_fitness": float(run["best_fitness"]),
        "config": config,
        "hyp": hyp,
        "date": datetime.now().isoformat(timespec="seconds"),
        "training": {"version": TRAINING_VERSION, "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                     "scheduler": scheduler.state_dict(), "ema_updates": ema.updates if ema is not None else 0,
                     "run": run, "rng": rng},
    }


def is_finished(ckpt: dict) -> bool:
    """A finished run's stripped checkpoint (nothing left to resume)."""
    return bool(ckpt.get("finished")) and not ckpt.get("training")


def training_state(ckpt: dict, path) -> TrainingState:
    """The resumable part of ``ckpt``, every field's type and range checked (utils.checkpoint.checks:
    options through the command line's bounds, hyp, position, counters, results, generator states,
    optimizer layout) before anything is built; CheckpointError naming the file and field otherwise."""
    origin = ""
    if _is_imported(ckpt) and not is_finished(ckpt):  # a YOLOv5 run's last.pt: read again with its training state
        from utils.checkpoint.yolov5_run import yolov5_resumable

        ckpt, origin = yolov5_resumable(load_checkpoint(path, yolov5_training=True), path, TRAINING_VERSION), "yolov5"
    training = ckpt.get("training")
    if not isinstance(training, dict):
        reason = "a finished run" if is_finished(ckpt) else "weights only, no training state"
        if _is_imported(ckpt):
            reason = f"a YOLOv5 file without training state; to train on from it: --weights {path}"
        raise CheckpointError(f"{path}: not resumable ({reason})")
    version = training.get("version")
    if version != TRAINING_VERSION:
        raise CheckpointError(f"{path}: training state version {shorten(version, 20)}, this version of train.py "
                              f"resumes version {TRAINING_VERSION} only")
    expected = {"optimizer": dict, "scaler": dict, "scheduler": dict, "ema_updates": int, "run": dict, "rng": list}
    for key, kind in expected.items():
        if not isinstance(training.get(key), kind):
            raise CheckpointError(f"{path}: training state '{key}' is missing or not a {kind.__name__}")
    for key in ("config", "hyp"):
        if not isinstance(ckpt.get(key), dict):
            raise CheckpointError(f"{path}: '{key}' is missing or not a dict")
    check_training(ckpt, path)
    return TrainingState(Path(path), ckpt["model"], ckpt.get("ema"), training["ema_updates"], training["optimizer"],
                         training["scaler"], training["scheduler"], training["run"], training["rng"],
                         ckpt["config"], ckpt["hyp"], origin=origin, parameter_names=ckpt.get("parameter_names"))


def load_resumable(path) -> tuple[dict, Path]:
    """Load ``path``; when it is missing or unreadable (truncated, corrupt, refused) and the previous
    file (``previous_path``) exists, warn and load that instead. Returns (checkpoint, path used). Only a file
    that is not a valid checkpoint falls back: when this machine failed to read it (MemoryError, OSError) the
    file may be good, and resuming the older one would later replace it, so that error is raised as it is."""
    path = Path(path)
    try:
        return load_checkpoint(path), path
    except CheckpointError as error:
        if isinstance(error.__context__, (MemoryError, OSError)):
            raise error.__context__ from None
        previous = previous_path(path)
        if not previous.is_file():
            raise
        LOGGER.warning("WARNING: %s; falling back to the previous checkpoint %s", error, previous)
        return load_checkpoint(previous), previous


def _is_imported(ckpt: dict) -> bool:
    """A checkpoint ``load_checkpoint`` converted from a YOLOv5 file (utils.yolov5_import), not one of ours."""
    return ckpt.get("source") == "yolov5"


def strip_checkpoint(path, own_only: bool = False) -> str | None:
    """Finish a run's checkpoint for use: EMA weights (fp16, anchors fp32) become the model; training state dropped;
    the file rewritten atomically (``save_checkpoint``). ``own_only`` (detect.py --update) leaves two kinds of file as
    they are and returns why: a YOLOv5 file (never rewritten in our format) and an unfinished run's last.pt (the
    file --resume continues the run from). None once rewritten."""
    checkpoint = load_checkpoint(path)
    if own_only and _is_imported(checkpoint):
        return "a YOLOv5 checkpoint: this project never rewrites YOLOv5's pickled files"
    if own_only and Path(path).name == "last.pt" and checkpoint.get("training"):
        return "the checkpoint --resume continues its unfinished run from: strip a copy of it instead"
    entry = model_entry(checkpoint)
    entry = {**entry, "state_dict": {k: v.half() if v.is_floating_point() and not k.endswith(".anchors") else v
                                     for k, v in entry["state_dict"].items()}}  # anchors stay exact (pixels / stride)
    keep = {k: checkpoint[k] for k in ("format", "epoch", "best_fitness", "config", "hyp", "date") if k in checkpoint}
    save_checkpoint({**keep, "model": entry, "ema": None, "finished": True}, path)
    LOGGER.info("Optimizer stripped from %s, %.1fMB", path, Path(path).stat().st_size / 1e6)
    return None
