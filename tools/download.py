"""Fetch YOLOv5's release weights and datasets ahead of training, as YOLOv5's data/scripts do (a login node with
network for compute nodes without, an image build).

    python -m tools.download yolov5s.pt yolov5m6.pt     # YOLOv5 v7.0 release weights, into --dir (default: here)
    python -m tools.download --all-weights --dir weights  # all ten: yolov5n/s/m/l/x and their P6 '6' variants
    python -m tools.download https://host/a.pt          # a model file's URL, into the current folder as --weights
    python -m tools.download coco128.yaml VOC.yaml      # a dataset YAML's download: (a name in data/ or a path)

Everything goes through utils/downloads.py and utils/data/dataset_download.py, as train.py's own downloads: the
same checks, YOLO_TRAINER_MIRROR, nothing fetched is run; what is already there is kept (a dataset whose folder
exists is not fetched again). data/scripts/*.sh call this under YOLOv5's script names. Exit code 0 when every name is
in place, 1 on a download that failed or a name that is none of these (one line), 2 on a bad flag.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from utils.cli import ArgumentParser
from utils.downloads import RELEASE_WEIGHT_NAMES, RELEASE_WEIGHTS, is_url, public_url, weights_file
from utils.errors import UserError, run_main

ALL_WEIGHTS = RELEASE_WEIGHT_NAMES  # --all-weights, in YOLOv5's order


class DownloadNameError(UserError):
    """A name that is neither release weights, a URL nor a dataset YAML."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m tools.download", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="release weights (yolov5s.pt ...), a model URL, or a dataset YAML")
    parser.add_argument("--all-weights", action="store_true", help="every detection model of YOLOv5's v7.0 release")
    parser.add_argument("--dir", default=".", help="where release weights go (default: the current folder)")
    args = parser.parse_args(argv)
    if not args.names and not args.all_weights:
        parser.error("nothing to fetch: give names (yolov5s.pt, coco128.yaml, ...) or --all-weights")
    return args


def fetch_name(name: str, folder: Path) -> str:
    """Fetch one name (module doc) and return the line that says where it is."""
    from utils.data.dataset_yaml import load_data_config

    if name.lower().endswith((".yaml", ".yml")):
        config = load_data_config(name)
        return f"{name}: dataset in {config.path}"
    if is_url(name):
        return f"{public_url(name)}: {weights_file(name)}"
    if name in RELEASE_WEIGHTS:
        path = folder / name
        there = path.exists()
        weights_file(path)
        return f"{name}: {path}" + (" (already there)" if there else "")
    raise DownloadNameError(f"{name}: not a YOLOv5 release weights name ({', '.join(ALL_WEIGHTS)}), a URL or a "
                            "dataset YAML")


def main(argv: list[str] | None = None) -> int:
    return run_main("tools.download", _main, argv)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    for name in [*(ALL_WEIGHTS if args.all_weights else ()), *args.names]:
        print(fetch_name(name, folder), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
