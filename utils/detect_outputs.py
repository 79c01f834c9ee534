"""What detect.py writes besides the drawn images: --save-txt label lines, --save-csv's predictions.csv, the videos
of video files and live streams, and --update's stripped checkpoints. Their logger is detect.py's."""
from __future__ import annotations

import csv
import logging
import os
from pathlib import Path
from typing import NamedTuple

import cv2
import numpy as np
import torch

from utils.errors import UserError
from utils.files import NotRegularFile, open_regular
from utils.inference import CSV_HEADER, label_lines, prediction_rows

LOGGER = logging.getLogger("detect")


class OutputError(UserError):
    """An output file that cannot be written where it belongs (one line)."""


class WeightsFile(NamedTuple):
    """One ``--weights`` entry on disk; ``downloaded``: fetched from a URL or as a YOLOv5 release name."""
    path: Path
    downloaded: bool


def write_labels(path: Path, det: torch.Tensor, shape, save_conf: bool, save_format: int = 0) -> None:
    """Label lines (utils.inference.label_lines): class cx cy w h (or x1 y1 x2 y2) [conf], normalised."""
    with open(path, "a", encoding="utf-8") as file:
        file.writelines(label_lines(det, shape, save_conf, save_format))


def write_predictions(path: Path, image_name: str, det: torch.Tensor, names) -> None:
    """Append ``det``'s rows (utils.inference.prediction_rows) to predictions.csv, the header first into a new
    file; never through a link or into anything but a regular file."""
    try:
        handle = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except NotRegularFile as error:
        raise OutputError(f"{path}: {error.strerror}; not writing predictions there") from None
    with os.fdopen(handle, "a", encoding="utf-8", newline="") as file:
        writer = csv.writer(file)
        if os.fstat(handle).st_size == 0:
            writer.writerow(CSV_HEADER)
        writer.writerows(prediction_rows(image_name, det, names))


class VideoSink:
    """One cv2.VideoWriter (mp4v) per input video or live stream, opened on its first frame. A video file's writer
    is finished when the next file starts; live streams' frames come in turns, so theirs stay open until close()."""

    def __init__(self):
        self.writers = {}

    def write(self, path: Path, image: np.ndarray, fps: float, live: bool = False) -> None:
        if path not in self.writers:
            if not live:
                self.close()
            height, width = image.shape[:2]
            self.writers[path] = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps or 30.0,
                                                 (width, height))
        self.writers[path].write(image)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.release()
        self.writers = {}


def update_weights(weights: list[WeightsFile]) -> None:
    """--update: each of our own checkpoints among ``weights`` stripped in place (utils.checkpoint.strip_checkpoint:
    an atomic rewrite, EMA weights fp16 as the model, optimizer and training state dropped); anything else is left
    as it is, with one line saying why."""
    from models.backends import is_exported
    from utils.checkpoint import strip_checkpoint

    for path, downloaded in weights:
        if downloaded:
            reason = "downloaded from a URL or as a YOLOv5 release name: kept as fetched"
        elif is_exported(path):
            reason = "an exported model, not a checkpoint"
        elif path.is_symlink():
            reason = "a symbolic link: pass the file it points to"
        elif not os.access(path, os.W_OK):
            reason = "not writable"
        else:
            reason = strip_checkpoint(path, own_only=True)
            if reason is None:  # stripped
                continue
        LOGGER.info(f"--update: {path} left as it is ({reason})")
