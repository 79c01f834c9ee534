"""YOLOv5's ``utils.general`` names, for scripts written against YOLOv5 (docs/yolov5-scripts.md).

Each name here is this project's own function under YOLOv5's name, parameter order and return value (v7.0):
``from utils.general import non_max_suppression, scale_boxes, check_img_size`` keeps working. The project itself
imports the modules these come from, never this one. Differences from YOLOv5 on purpose: nothing here installs
packages (``check_requirements`` says what is missing) or configures logging at import (``set_logging`` does).
"""
from __future__ import annotations

import contextlib
import glob
import inspect
import logging
import math
import os
import time
from pathlib import Path

import cv2  # noqa: F401  (YOLOv5 scripts take cv2 from here)
import numpy as np
import torch

from utils.boxes import clip_boxes, scale_boxes, xywh2xyxy, xywhn2xyxy, xyxy2xywh, xyxy2xywhn  # noqa: F401
from utils.errors import UserError
from utils.nms import non_max_suppression as _nms
from utils.paths import increment_path as _increment_path
from utils.plots import save_one_box  # noqa: F401  (YOLOv5 v5's place for it)

ROOT = Path(__file__).resolve().parents[1]
LOGGER = logging.getLogger("yolov5")  # YOLOv5's logger name; set_logging() gives it a console handler
scale_coords = scale_boxes  # YOLOv5 v6's names for them
clip_coords = clip_boxes
_COLOURS = {"black": "\033[30m", "red": "\033[31m", "green": "\033[32m", "yellow": "\033[33m", "blue": "\033[34m",
            "magenta": "\033[35m", "cyan": "\033[36m", "white": "\033[37m", "bright_black": "\033[90m",
            "bright_red": "\033[91m", "bright_green": "\033[92m", "bright_yellow": "\033[93m",
            "bright_blue": "\033[94m", "bright_magenta": "\033[95m", "bright_cyan": "\033[96m",
            "bright_white": "\033[97m", "end": "\033[0m", "bold": "\033[1m", "underline": "\033[4m"}


def set_logging(name: str = "yolov5", verbose: bool = True) -> logging.Logger:
    """Message-only console output for the ``name`` logger (INFO with ``verbose``, else WARNING), as YOLOv5's."""
    logger = logging.getLogger(name)
    if not any(getattr(handler, "_yolov5_console", False) for handler in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._yolov5_console = True
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    return logger


def colorstr(*args) -> str:
    """``colorstr("blue", "bold", "text")``: the last argument wrapped in ANSI codes (blue bold when only the text)."""
    *styles, text = args if len(args) > 1 else ("blue", "bold", args[0])
    unknown = [style for style in styles if style not in _COLOURS]
    if unknown:
        raise ValueError(f"colorstr: unknown style {unknown[0]!r} (one of {', '.join(_COLOURS)})")
    return "".join(_COLOURS[style] for style in styles) + f"{text}" + _COLOURS["end"]


def make_divisible(x, divisor) -> int:
    """The smallest multiple of ``divisor`` (a tensor: its largest value) at least ``x``."""
    if isinstance(divisor, torch.Tensor):
        divisor = int(divisor.max())
    return math.ceil(x / divisor) * divisor


def check_img_size(imgsz, s=32, floor: int = 0):
    """``imgsz`` (an int, or a list of sides) rounded up to multiples of stride ``s``, each at least ``floor``; a
    warning says when it changed. Returns an int for an int, else a list."""
    s = int(s.max()) if isinstance(s, torch.Tensor) else int(s)  # a model's strides: the largest
    if isinstance(imgsz, int):
        new_size = max(make_divisible(imgsz, s), floor)
    else:
        imgsz = list(imgsz)
        new_size = [max(make_divisible(side, s), floor) for side in imgsz]
    if new_size != imgsz:
        LOGGER.warning(f"WARNING: --img-size {imgsz} must be multiple of max stride {s}, updating to {new_size}")
    return new_size


def non_max_suppression(prediction, conf_thres: float = 0.25, iou_thres: float = 0.45, classes=None,
                        agnostic: bool = False, multi_label: bool = False, labels=(), max_det: int = 300,
                        nm: int = 0) -> list[torch.Tensor]:
    """YOLOv5's parameter order for utils.nms.non_max_suppression: one (n, 6) tensor ``x1, y1, x2, y2, conf, cls``
    per image, most confident first. ``prediction`` is the model's output, or the (pred, ...) list
    DetectMultiBackend returns; ``labels`` per image (k, 5) ``cls, cx, cy, w, h`` rows join as confidence 1."""
    if nm:
        raise ValueError(f"non_max_suppression: nm={nm} mask coefficients: this project has no segmentation models")
    return _nms(prediction, conf_thres, iou_thres, classes, agnostic, multi_label, max_det,
                labels=labels if len(labels) else None)


def increment_path(path, exist_ok: bool = False, sep: str = "", mkdir: bool = False) -> Path:
    """``path`` if free (or ``exist_ok``), else ``path{sep}2``, ``path{sep}3``, ... (a file keeps its suffix last);
    ``mkdir`` creates the folder, atomically against another process taking the same name."""
    return _increment_path(path, exist_ok=exist_ok, mkdir=mkdir, sep=sep)


class Profile(contextlib.ContextDecorator):
    """``with dt:`` adds the block's seconds to ``dt.t`` and keeps the last in ``dt.dt`` (CUDA synchronised first,
    so a GPU's queued work is counted where it ran). ``device`` (YOLOv5 master's): synchronise only for a CUDA
    device; without it, whenever CUDA is available (v7.0's)."""

    def __init__(self, t: float = 0.0, device=None):
        self.t, self.dt = t, 0.0
        self.cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")

    def __enter__(self):
        self.start = self.time()
        return self

    def __exit__(self, *exc):
        self.dt = self.time() - self.start
        self.t += self.dt

    def time(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.time()


def print_args(args: dict | None = None, show_file: bool = True, show_func: bool = False) -> None:
    """Log ``name=value`` for ``args`` (default: the calling function's arguments), prefixed by the calling file
    and function as YOLOv5's run() lines are."""
    caller = inspect.currentframe().f_back
    info = inspect.getframeinfo(caller)
    if args is None:
        names, _, _, values = inspect.getargvalues(caller)
        args = {name: values[name] for name in names}
    try:
        file = Path(info.filename).resolve().relative_to(ROOT).with_suffix("")
    except ValueError:
        file = Path(info.filename).stem
    prefix = (f"{file}: " if show_file else "") + (f"{info.function}: " if show_func else "")
    LOGGER.info(colorstr(prefix) + ", ".join(f"{key}={value}" for key, value in args.items()))


def check_file(file, suffix="") -> str:
    """A file's path: as given when it exists (or is empty); an image, video or weights URL downloaded into the
    current folder (utils/downloads.py); else the one file of that name under data/, models/ or utils/."""
    from utils.downloads import MODEL_SUFFIXES, is_url, weights_file
    from utils.sources import resolve_source

    check_suffix(file, suffix)
    file = str(file)
    if not file or os.path.isfile(file):
        return file
    if is_url(file):
        if Path(file.split("?")[0]).suffix.lower() in MODEL_SUFFIXES:
            return str(weights_file(file))
        return str(resolve_source(file)[0])
    found = [match for folder in ("data", "models", "utils")
             for match in glob.glob(str(ROOT / folder / "**" / glob.escape(file)), recursive=True)]
    if not found:
        raise FileNotFoundError(f"File not found: {file}")
    if len(found) > 1:
        raise FileNotFoundError(f"Multiple files match '{file}', specify exact path: {found}")
    return found[0]


check_yaml = check_file  # YOLOv5's check_yaml(file) is check_file for .yaml/.yml


def check_suffix(file="yolov5s.pt", suffix=(".pt",), msg: str = "") -> None:
    """Raise when a file's suffix is not one of ``suffix`` (nothing to check when ``suffix`` is empty)."""
    if not file or not suffix:
        return
    suffixes = (suffix,) if isinstance(suffix, str) else tuple(suffix)
    for name in ([file] if isinstance(file, (str, os.PathLike)) else file):
        ending = Path(name).suffix.lower()
        if ending and ending not in suffixes:
            raise ValueError(f"{msg}{name} acceptable suffix is {suffixes}")


def check_imshow(warn: bool = False) -> bool:
    """Whether OpenCV can open a window here (it cannot with opencv-python-headless or without a display)."""
    try:
        cv2.imshow("test", np.zeros((1, 1, 3), dtype=np.uint8))
        cv2.waitKey(1)
        cv2.destroyAllWindows()
        cv2.waitKey(1)
        return True
    except cv2.error as error:
        if warn:
            LOGGER.warning(f"WARNING: environment does not support cv2.imshow() or PIL Image.show()\n{error}")
        return False


def check_requirements(requirements=ROOT / "requirements.txt", exclude=(), install: bool = True, cmds: str = ""):
    """Raise (one line, with the pip command) when a requirement is missing or its version does not fit. Unlike
    YOLOv5 this never installs anything: ``install`` and ``cmds`` are accepted and ignored."""
    from importlib import metadata

    if isinstance(requirements, (str, Path)) and Path(requirements).suffix == ".txt":
        path = Path(requirements)
        if not path.is_file():
            raise FileNotFoundError(f"{path.resolve()} not found, check failed.")
        lines = path.read_text(encoding="utf-8").splitlines()
    else:
        lines = [requirements] if isinstance(requirements, str) else list(requirements)
    missing = []
    for line in lines:
        text = line.split("#")[0].strip()
        if not text or text.startswith("-"):
            continue
        name = text.split(";")[0].split("[")[0]
        for mark in "<>=!~ ":
            name = name.split(mark)[0]
        if name in exclude:
            continue
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(text)
            continue
        if not _version_fits(installed, text[len(name):].split(";")[0].strip()):
            missing.append(f"{text} (installed {installed})")
    if missing:
        raise UserError(f"requirements not met: {', '.join(missing)}; install with "
                        f"pip install {' '.join(repr(item.split(' (')[0]) for item in missing)}")
    return True


def _version_fits(installed: str, specifier: str) -> bool:
    if not specifier:
        return True
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:  # without packaging only the presence is checked
        return True
    return Version(installed) in SpecifierSet(specifier)


def strip_optimizer(f="best.pt", s: str = "") -> None:
    """YOLOv5's call for finishing a checkpoint: our checkpoints' training state dropped and weights halved
    (utils.checkpoint.strip_checkpoint), written to ``s`` when given (a copy) else to ``f`` in place. A YOLOv5 file
    is left as it is (this project never rewrites YOLOv5's pickled files), which a warning says."""
    from utils.checkpoint import copy_checkpoint, strip_checkpoint

    target = f
    if s:
        copy_checkpoint(f, s)
        target = s
    reason = strip_checkpoint(target, own_only=True)
    if reason:
        LOGGER.warning(f"WARNING: {target} not stripped: {reason}")


def yaml_load(file="data.yaml") -> dict:
    """A YAML file's content, read by the bounded loader (utils/safe_yaml.py: size, alias-bomb and depth limits);
    a file that cannot be read or parsed is one UserError line naming it."""
    from utils.safe_yaml import read_yaml_as

    return read_yaml_as(file, UserError)


def yaml_save(file="data.yaml", data: dict | None = None) -> None:
    """``data`` written to ``file`` as YAML, atomically (utils/files.py); Path values as text, as YOLOv5's."""
    import yaml

    from utils.files import atomic_write

    plain = {key: str(value) if isinstance(value, Path) else value for key, value in (data or {}).items()}
    atomic_write(file, yaml.safe_dump(plain, sort_keys=False, allow_unicode=True))


def check_dataset(data, autodownload: bool = True) -> dict:
    """A dataset YAML (or a dataset archive) checked and resolved as train.py reads it (utils/data/dataset_yaml.py,
    its ``download:`` followed when the dataset is missing, unless ``autodownload=False``): YOLOv5's dict, ``path``
    and the splits as absolute paths (a list where the YAML has several), ``names`` as {index: name}, ``nc``."""
    from utils.data.dataset_yaml import load_data_config

    config = load_data_config(data, download=autodownload)
    result = {"path": str(config.path), "names": dict(enumerate(config.names)), "nc": config.nc,
              "yaml_file": str(config.yaml_file)}
    for split in ("train", "val", "test"):
        sources = config.split(split)
        if sources:
            result[split] = sources[0] if len(sources) == 1 else list(sources)
    return result


def init_seeds(seed: int = 0, deterministic: bool = False) -> None:
    """Seed Python's, NumPy's and torch's generators (``deterministic``: torch's deterministic algorithms too), as
    train.py --seed does (utils/trainer/setup.py)."""
    from utils.trainer.setup import seed_everything

    seed_everything(seed, deterministic)


def one_cycle(y1: float = 0.0, y2: float = 1.0, steps: int = 100):
    """YOLOv5's cosine ramp from ``y1`` at step 0 to ``y2`` at ``steps`` (its --cos-lr schedule with y1=1, y2=lrf)."""
    return lambda x: ((1 - math.cos(x * math.pi / steps)) / 2) * (y2 - y1) + y1


def labels_to_class_weights(labels, nc: int = 80) -> torch.Tensor:
    """Class weights (1 / each class's box count, absent classes counted once), summing to 1, from a dataset's
    per-image (n, 5) ``labels``: YOLOv5's --image-weights weights, as a float tensor."""
    from utils.data.dataset import class_weights

    return torch.from_numpy(class_weights(labels, nc)).float()


def labels_to_image_weights(labels, nc: int = 80, class_weights=None) -> np.ndarray:
    """Each image's weight: the sum of its boxes' ``class_weights`` (None: 1 each)."""
    class_weights = np.ones(nc) if class_weights is None else class_weights
    counts = np.array([np.bincount(np.asarray(lb)[:, 0].astype(int), minlength=nc) for lb in labels]).reshape(-1, nc)
    return (np.asarray(class_weights).reshape(1, nc) * counts).sum(1)


def intersect_dicts(da: dict, db: dict, exclude=()) -> dict:
    """The entries of state_dict ``da`` whose key is in ``db`` with the same shape and contains none of
    ``exclude`` (YOLOv5's transfer of pretrained weights)."""
    return {key: value for key, value in da.items()
            if key in db and all(part not in key for part in exclude) and value.shape == db[key].shape}


def check_version(current: str = "0.0.0", minimum: str = "0.0.0", name: str = "version ", pinned: bool = False,
                  hard: bool = False, verbose: bool = False) -> bool:
    """Whether version ``current`` is at least ``minimum`` (equal to it with ``pinned``); ``hard``: raise instead
    of returning False; ``verbose``: a warning when it does not fit."""
    fits = _version(current) == _version(minimum) if pinned else _version(current) >= _version(minimum)
    message = f"WARNING: {name}{minimum} is required by YOLOv5, but {name}{current} is currently installed"
    if hard and not fits:
        raise UserError(message)
    if verbose and not fits:
        LOGGER.warning(message)
    return fits


def _version(text: str):
    try:
        from packaging.version import Version

        return Version(str(text))
    except ImportError:  # without packaging: the leading numbers ("2.14.1+cu130" -> (2, 14, 1))
        import re

        return tuple(int(part) for part in re.findall(r"\d+", str(text).split("+")[0])[:3])
