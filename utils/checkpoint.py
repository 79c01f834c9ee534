"""The one save/load pair for checkpoints. Our files are plain data (torch.load(weights_only=True)):

    {"format": "yolo-trainer/1",
     "model": {"yaml": dict, "state_dict": {name: tensor}, "names": [str], "stride": [float]},
     "ema": same shape as "model", or None,
     ... plain data added by the trainer (epoch, best_fitness, optimizer, ema_updates, config, ...)}

YOLOv5 ``.pt`` files (pickled modules) are recognised and converted by ``utils.yolov5_import``.
"""
from __future__ import annotations

import logging
import os
import pickletools
import re
import shutil
import tempfile
import zipfile
from copy import deepcopy
from pathlib import Path

import torch

from utils.dist import is_main_process
from utils.errors import CheckpointError

LOGGER = logging.getLogger(__name__)
FORMAT = "yolo-trainer/1"
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


def save_checkpoint(ckpt: dict, path) -> Path | None:
    """Write ``ckpt`` (plain data) atomically: temp file in the same folder, fsync, os.replace.

    Only the main process writes (returns None elsewhere). "format" is added when absent.
    """
    if not is_main_process():
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, **ckpt}
    handle, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(data, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    return path


def copy_checkpoint(source, path) -> Path | None:
    """Make ``path`` hold ``source``'s bytes, atomically: a hard link when the filesystem has them
    (instant: best.pt from the last.pt just written; last.pt is only ever replaced by a new file, never
    written in place, so the link keeps this epoch's bytes), else a copy. Main process only."""
    if not is_main_process():
        return None
    source, path = Path(source), Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}.link.tmp")
    try:
        try:
            os.link(source, temp)
        except OSError:  # no hard links here (or across devices): copy, then fsync like save_checkpoint
            shutil.copyfile(source, temp)
            with open(temp, "rb+") as file:
                os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path) -> dict:
    """Our format for any supported file (ours, or YOLOv5's converted); CheckpointError otherwise."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint file not found")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a file")
    with open(path, "rb") as file:
        head = file.read(4)
    if head == ZIP_MAGIC:
        pickle_bytes = _zip_pickle(path)
        if _is_yolov5(pickle_bytes):
            from utils.yolov5_import import load_yolov5_checkpoint
            return {**load_yolov5_checkpoint(path), "format": FORMAT}
    elif not head.startswith(b"\x80"):
        raise CheckpointError(f"{path}: not a checkpoint (neither a torch zip archive nor a pickle)")
    else:
        with open(path, "rb") as file:
            if _is_yolov5(file.read(1 << 20)):
                raise CheckpointError(f"{path}: legacy (non-zip) YOLOv5 checkpoint is not supported; "
                                      "re-save it with torch >= 1.6")
    return _check_ours(_torch_load(path), path)


def _zip_pickle(path: Path) -> bytes:
    """The data.pkl bytes of a torch zip archive (CheckpointError when truncated or corrupt)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
            if not names:
                raise CheckpointError(f"{path}: zip archive without data.pkl, not a torch checkpoint")
            return archive.read(names[0])
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"{path}: truncated or corrupt zip archive ({error})") from None


def pickle_globals(data: bytes) -> list[str]:
    """'module.name' of every GLOBAL / STACK_GLOBAL in a pickle, read without unpickling."""
    found, strings, memo = [], [], {}
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            if name == "GLOBAL":
                found.append(arg.replace(" ", "."))
            elif name == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(f"{strings[-2]}.{strings[-1]}")
            elif "UNICODE" in name or name.endswith("STRING"):
                strings.append(arg)
            elif name in ("BINPUT", "LONG_BINPUT", "PUT") and strings:
                memo[arg] = strings[-1]
            elif name == "MEMOIZE" and strings:
                memo[len(memo)] = strings[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET") and arg in memo:
                strings.append(memo[arg])
    except (ValueError, EOFError):
        pass  # a damaged pickle: the loader reports it
    return found


def _is_yolov5(pickle_bytes: bytes) -> bool:
    return any(g.startswith("models.") for g in pickle_globals(pickle_bytes))


def _torch_load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
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
        raise CheckpointError(f"{path}: unsupported checkpoint format {data.get('format')!r} "
                              f"(expected '{FORMAT}')")
    for key in ("model", "ema"):
        entry = data.get(key)
        if key == "model" and entry is None or entry is not None and not (
                isinstance(entry, dict) and {"yaml", "state_dict"} <= entry.keys()):
            raise CheckpointError(f"{path}: '{key}' entry is missing or malformed")
    data.setdefault("ema", None)
    return data
