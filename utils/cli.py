"""Command-line flags shared by the entry scripts (train.py, val.py, detect.py, tools), defined once.

``ArgumentParser`` is argparse's, except that a bad flag raises ``utils.errors.ArgumentError`` (one
line, exit 2 under ``utils.errors.run_main``) instead of printing the usage block and exiting.

Validators for ``type=`` check a value when the flags are parsed and say the accepted range:
``positive_int``, ``non_negative_int``, ``probability`` ([0, 1]), ``image_size`` ([32, 16384]),
``batch_size``, ``workers``, ``max_detections``, and the factories ``int_in_range(low, high)`` and
``float_in_range(Range(...))`` for other bounds.
"""
from __future__ import annotations

import argparse

from utils.errors import ArgumentError, shorten
from utils.limits import (MAX_BATCH_SIZE, MAX_DETECTIONS, MAX_IMAGE_SIZE, MAX_WORKERS, MIN_IMAGE_SIZE,
                          Range)

MAX_INT = 2 ** 31 - 1


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors raise ArgumentError (subparsers inherit the class)."""

    def error(self, message: str):
        raise ArgumentError(f"{message} (see {self.prog} --help)")


def int_in_range(low: int, high: int):
    """An argparse ``type=`` accepting integers in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}], got {shorten(text, 40)}")
        return value

    parse.__name__ = f"integer in [{low}, {high}]"
    return parse


def float_in_range(allowed: Range):
    """An argparse ``type=`` accepting finite numbers in ``allowed``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or value not in allowed:
            raise argparse.ArgumentTypeError(f"expected a number in {allowed}, got {shorten(text, 40)}")
        return value

    parse.__name__ = f"number in {allowed}"
    return parse


positive_int = int_in_range(1, MAX_INT)
non_negative_int = int_in_range(0, MAX_INT)
probability = float_in_range(Range(0, 1))
image_size = int_in_range(MIN_IMAGE_SIZE, MAX_IMAGE_SIZE)
batch_size = int_in_range(1, MAX_BATCH_SIZE)
workers = int_in_range(0, MAX_WORKERS)
max_detections = int_in_range(1, MAX_DETECTIONS)


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="", help="cuda device, i.e. 0 or 0,1,2,3 or cpu")


def add_run_folder_flags(parser: argparse.ArgumentParser, project: str) -> None:
    """--project/--name/--exist-ok: outputs go to project/name, then name2, name3, ... (never overwritten)."""
    parser.add_argument("--project", default=project, help="save to project/name")
    parser.add_argument("--name", default="exp", help="save to project/name")
    parser.add_argument("--exist-ok", action="store_true", help="existing project/name ok, do not increment")


def add_amp_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--amp", default="auto", choices=("auto", "bf16", "off"),
                        help="CPU inference precision: auto = bf16 autocast on CPUs with AMX or AVX512-BF16, else fp32 "
                             "(--half is CUDA fp16)")


def add_half_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--half", action="store_true", help="FP16 half-precision inference (CUDA only)")
