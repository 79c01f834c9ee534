"""Command-line flags shared by the entry scripts (train.py, val.py, detect.py), defined once."""
from __future__ import annotations

import argparse


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="", help="cuda device, i.e. 0 or 0,1,2,3 or cpu")


def add_run_folder_flags(parser: argparse.ArgumentParser, project: str) -> None:
    """--project/--name/--exist-ok: outputs go to project/name, then name2, name3, ... (never overwritten)."""
    parser.add_argument("--project", default=project, help="save to project/name")
    parser.add_argument("--name", default="exp", help="save to project/name")
    parser.add_argument("--exist-ok", action="store_true", help="existing project/name ok, do not increment")


def add_half_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--half", action="store_true", help="FP16 half-precision inference (CUDA only)")
