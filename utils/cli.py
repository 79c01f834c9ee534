"""Command-line flags shared by the entry scripts (train.py, val.py, detect.py, tools), defined once.

``ArgumentParser`` is argparse's, except that a bad flag raises ``utils.errors.ArgumentError`` (one
line, exit 2 under ``utils.errors.run_main``) instead of printing the usage block and exiting.

Validators for ``type=`` check a value when the flags are parsed and say the accepted range:
``positive_int``, ``non_negative_int``, ``probability`` ([0, 1]), ``image_size`` ([32, 16384]),
``batch_size`` (``train_batch_size`` also takes -1: AutoBatch), ``workers``, ``max_detections``, and the
factories ``int_in_range(low, high)`` and ``float_in_range(Range(...))`` for other bounds; train.py's
``label_smoothing``, ``freeze_layer``, ``save_period``, ``save_every_min`` and choices are here too.
Each validator is an ``IntBound`` / ``FloatBound`` whose ``check(value)`` applies the same bound to a
value read from a file: utils.config.TrainConfig.from_dict checks the options stored in a checkpoint
with them, so every bound has one definition.
"""
from __future__ import annotations

import argparse

from utils.errors import ArgumentError, shorten
from utils.limits import (MAX_BATCH_SIZE, MAX_DETECTIONS, MAX_IMAGE_SIZE, MAX_WORKERS, MIN_IMAGE_SIZE,
                          Range)

MAX_INT = 2 ** 31 - 1
AUTO_BATCH = -1  # --batch-size -1: AutoBatch picks the batch size (train.py)


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors raise ArgumentError (subparsers inherit the class)."""

    def error(self, message: str):
        raise ArgumentError(f"{message} (see {self.prog} --help)")


class IntBound:
    """Integers in [low, high] (plus the ``special`` values, e.g. -1 for AutoBatch): an argparse ``type=``
    that parses a flag's text, and ``check(value)`` that applies the same bound to a value read from a file
    (an ``int`` only: no bool, float or text), so a bound is written once for both."""

    def __init__(self, low: int, high: int, special: tuple[int, ...] = ()):
        self.low, self.high, self.special = low, high, tuple(special)
        extra = "".join(f" or {value}" for value in self.special)
        self.__name__ = self.description = f"integer in [{low}, {high}]{extra}"

    def accepts(self, value) -> bool:
        return type(value) is int and (self.low <= value <= self.high or value in self.special)

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            value = None
        if not self.accepts(value):
            raise argparse.ArgumentTypeError(f"expected an {self.description}, got {shorten(text, 40)}")
        return value

    def check(self, value) -> int:
        """``value`` itself when it is within the bound; ValueError (the reason, value shortened) otherwise."""
        if not self.accepts(value):
            raise ValueError(f"expected an {self.description}, got {shorten(value, 40)}")
        return value


class FloatBound:
    """Finite numbers in ``allowed``: an argparse ``type=`` and ``check(value)`` for a value read from a file
    (an int or float, not a bool or text), as ``IntBound``."""

    def __init__(self, allowed: Range):
        self.allowed = allowed
        self.__name__ = self.description = f"number in {allowed}"

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            value = None
        if value is None or value not in self.allowed:
            raise argparse.ArgumentTypeError(f"expected a {self.description}, got {shorten(text, 40)}")
        return value

    def check(self, value) -> float:
        if value not in self.allowed:  # Range refuses bools, text and non-finite numbers
            raise ValueError(f"expected a {self.description}, got {shorten(value, 40)}")
        return float(value)


def int_in_range(low: int, high: int) -> IntBound:
    """An argparse ``type=`` accepting integers in [low, high]."""
    return IntBound(low, high)


def float_in_range(allowed: Range) -> FloatBound:
    """An argparse ``type=`` accepting finite numbers in ``allowed``."""
    return FloatBound(allowed)


positive_int = int_in_range(1, MAX_INT)
non_negative_int = int_in_range(0, MAX_INT)
probability = float_in_range(Range(0, 1))
image_size = int_in_range(MIN_IMAGE_SIZE, MAX_IMAGE_SIZE)
batch_size = int_in_range(1, MAX_BATCH_SIZE)
nominal_batch = int_in_range(1, MAX_BATCH_SIZE)  # train.py --nbs
train_batch_size = IntBound(1, MAX_BATCH_SIZE, special=(AUTO_BATCH,))  # train.py --batch-size: -1 = AutoBatch
workers = int_in_range(0, MAX_WORKERS)
max_detections = int_in_range(1, MAX_DETECTIONS)
# train.py's other bounded flags (also applied to the options stored in a checkpoint: utils.config.TrainConfig)
label_smoothing = float_in_range(Range(0, 1, high_open=True))
freeze_layer = int_in_range(0, 1000)
save_period = int_in_range(-1, MAX_INT)
save_every_min = float_in_range(Range(0, 10 ** 6))
bbox_interval = int_in_range(-1, MAX_INT)  # YOLOv5's W&B option (-1: its default)
local_rank = int_in_range(-MAX_INT - 1, MAX_INT)  # accepted and ignored (torchrun sets LOCAL_RANK)
# train.py's choices, defined once
CACHE_MODES = ("ram", "disk", "auto", "off")
OPTIMIZER_NAMES = ("SGD", "Adam", "AdamW")
TRAIN_AMP_MODES = ("auto", "fp16", "bf16", "off")
CHANNELS_LAST_MODES = ("auto", "on", "off")
MOSAIC_PARTNERS = ("dataset", "batch")  # where a mosaic's other 3 images come from (YoloDataset.__getitems__)


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="", help="cuda device, i.e. 0 or 0,1,2,3 or cpu")


def add_run_folder_flags(parser: argparse.ArgumentParser, project: str) -> None:
    """--project/--name/--exist-ok: outputs go to project/name, then name2, name3, ... (never overwritten)."""
    parser.add_argument("--project", default=project, help="save to project/name")
    parser.add_argument("--name", default="exp", help="save to project/name")
    parser.add_argument("--exist-ok", action="store_true", help="existing project/name ok, do not increment")


def add_tracker_flags(parser: argparse.ArgumentParser) -> None:
    """--no-trackers, and YOLOv5's W&B flags (accepted, with YOLOv5's defaults: docs/trackers.md)."""
    parser.add_argument("--no-trackers", dest="trackers", action="store_false",
                        help="log to no experiment tracker (MLflow, W&B, Comet, ClearML when installed and set up: "
                             "docs/trackers.md); TensorBoard has its own switch")
    parser.add_argument("--entity", default=None, help="W&B entity (team or user) of the run")
    parser.add_argument("--upload_dataset", nargs="?", const=True, default=False,
                        help="upload the dataset to W&B as artifacts ('val': the val split alone; docs/trackers.md)")
    parser.add_argument("--bbox_interval", type=bbox_interval, default=-1,
                        help="epochs between the val images with predicted boxes sent to the trackers (-1: YOLOv5's "
                             "default, a tenth of the epochs; docs/trackers.md)")
    parser.add_argument("--artifact_alias", type=str, default="latest",
                        help="YOLOv5's W&B dataset artifact version (accepted; no wandb-artifact:// datasets here)")


def add_amp_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--amp", default="auto", choices=("auto", "bf16", "off"),
                        help="CPU inference precision: auto = bf16 autocast on CPUs with AMX or AVX512-BF16, else fp32 "
                             "(--half is CUDA fp16)")


def add_half_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--half", action="store_true", help="FP16 half-precision inference (CUDA only)")
