"""Console logging setup and run loggers (results.csv, results.ndjson, TensorBoard). Writers act on rank 0 only."""
from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

from utils import dist
from utils.errors import writing
from utils.files import append_text, atomic_write

LOGGER = logging.getLogger(__name__)

RESULTS_KEYS = (
    "train/box_loss", "train/obj_loss", "train/cls_loss",
    "metrics/precision", "metrics/recall", "metrics/mAP_0.5", "metrics/mAP_0.5:0.95",
    "val/box_loss", "val/obj_loss", "val/cls_loss",
    "x/lr0", "x/lr1", "x/lr2",
)
RESULTS_FORMAT = ".5g"  # how results.csv prints each value (the digits a tracker's copy is compared at)


def setup_logging(verbose: bool = True, stream=None) -> None:
    """Plain message-only console logging (like YOLOv5's) on ``stream`` (default stdout; train.py --ndjson-console:
    stderr, so that stdout carries the JSON lines alone). Under DDP only the main process logs info;
    the others log warnings and errors, and the few lines every rank must say (``extra={"all_ranks":
    True}``, e.g. the start line), prefixed with their rank, never copies of the main process's lines."""
    main = dist.is_main_process()
    handler = logging.StreamHandler(stream or sys.stdout)
    prefix = "" if main else f"[rank {dist.dist_info().rank}] "
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    if not (main and verbose):
        handler.addFilter(lambda record: record.levelno >= logging.WARNING or getattr(record, "all_ranks", False))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    for noisy in ("matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # a tracker's HTTP client (MLflow's urllib3) warns at every retry of a call to a server that is down; the trackers
    # say it once (utils.trackers.dispatch), so only urllib3's errors are shown
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)


def memory_string(device) -> str:
    """Memory in use: reserved CUDA memory on GPU, the process RSS on CPU (from /proc, no psutil)."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return f"{torch.cuda.memory_reserved(device) / 1e9:.3g}G"
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return f"{resident_pages * os.sysconf('SC_PAGE_SIZE') / 1e9:.3g}G"
    except (OSError, ValueError, IndexError):
        return "-"


class RowsFile:
    """A run folder's file of results rows (``name``): a row appended each epoch, the whole file rewritten to a
    resumed run's rows; written by the main process only, atomically on rewrite and never through a symbolic link.
    Subclasses give the row's text (``_line``) and a header (``_header``, none by default)."""

    name = ""

    def __init__(self, save_dir: Path):
        self.file = Path(save_dir) / self.name

    def log(self, epoch: int, values: dict[str, float]) -> None:
        if not dist.is_main_process():
            return
        new = not self.file.exists()
        with writing(self.file):
            append_text(self.file, (self._header() if new else "") + self._line(epoch, values))  # never through a link

    def rewrite(self, rows: list[dict]) -> None:
        """Replace the file with ``rows`` (dicts with "epoch" and every column), atomically and without following
        a symbolic link (utils.files.atomic_write); no rows: no file."""
        if not dist.is_main_process():
            return
        if not rows:
            self.file.unlink(missing_ok=True)
            return
        with writing(self.file):
            atomic_write(self.file, self._header() + "".join(self._line(int(row["epoch"]), row) for row in rows))

    @staticmethod
    def _header() -> str:
        return ""

    @staticmethod
    def _line(epoch: int, values: dict) -> str:
        raise NotImplementedError


class CSVLogger(RowsFile):
    """results.csv with YOLOv5's columns and layout (values right-aligned in 20-character fields)."""

    name = "results.csv"

    @staticmethod
    def _header() -> str:
        return ",".join(f"{k:>20s}" for k in ("epoch",) + RESULTS_KEYS) + "\n"

    @staticmethod
    def _line(epoch: int, values: dict) -> str:
        return f"{epoch:>20d}," + ",".join(f"{float(values[k]):>20{RESULTS_FORMAT}}" for k in RESULTS_KEYS) + "\n"


class NDJSONLogger(RowsFile):
    """YOLOv5's ``--ndjson-console`` / ``--ndjson-file``: each results.csv row as one JSON object per line,
    ``{"epoch": N, "train/box_loss": ..., ..., "x/lr2": ...}``, printed to stdout and/or appended to
    ``results.ndjson`` in the run folder. Values are the full floats (results.csv rounds to 5 digits); a value
    that is not finite is ``null``, since JSON has no NaN or infinity."""

    name = "results.ndjson"

    def __init__(self, save_dir: Path, console: bool = False, file: bool = False):
        super().__init__(save_dir)
        self.console, self.to_file = console, file

    def log(self, epoch: int, values: dict[str, float]) -> None:
        if self.console and dist.is_main_process():
            print(self._line(epoch, values), end="", flush=True)
        if self.to_file:
            super().log(epoch, values)

    def rewrite(self, rows: list[dict]) -> None:
        """As results.csv after a resume, when the file is on."""
        if self.to_file:
            super().rewrite(rows)

    @staticmethod
    def _line(epoch: int, values: dict) -> str:
        numbers = {key: float(values[key]) for key in RESULTS_KEYS}
        record = {"epoch": int(epoch), **{key: value if math.isfinite(value) else None for key, value in numbers.items()}}
        return json.dumps(record, allow_nan=False) + "\n"


class TensorBoardLogger:
    """TensorBoard event files in the run folder (as YOLOv5 writes them): per epoch every results.csv column as a
    scalar under the same tag (train/box_loss, metrics/mAP_0.5, x/lr0 ...), and the run's plot files as images
    (``log_images``). Main process only. ``enabled=False`` (--no-tensorboard), or a tensorboard package that
    cannot be imported (one warning), writes nothing. ``purge_step``: a resumed run's first epoch: TensorBoard
    hides what an earlier process logged from that step on (rows past the checkpoint the run resumed from)."""

    def __init__(self, save_dir: Path, enabled: bool = True, purge_step: int | None = None):
        self.writer = None
        if not (enabled and dist.is_main_process()):
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as error:  # not installed, or a broken install: training goes on without it
            LOGGER.warning("WARNING: TensorBoard: unavailable (%s); install it with 'pip install tensorboard', or "
                           "pass --no-tensorboard", str(error).splitlines()[0] if str(error) else type(error).__name__)
            return
        self.writer = SummaryWriter(str(save_dir), purge_step=purge_step)
        LOGGER.info("TensorBoard: Start with 'tensorboard --logdir %s', view at http://localhost:6006/",
                    Path(save_dir).parent)

    def log(self, epoch: int, values: dict[str, float]) -> None:
        """One results.csv row (``values`` without the epoch) at step ``epoch``, written out at once."""
        if self.writer is None:
            return
        for key, value in values.items():
            self.writer.add_scalar(key, float(value), epoch)
        self.writer.flush()

    def log_images(self, paths, step: int) -> None:
        """Image files (JPG/PNG plots the run wrote) under their file names without suffix, e.g. PR_curve. The
        file's own encoded bytes go into the event file (TensorBoard shows PNG and JPEG as they are): decoding and
        encoding the plots again as PNG took ~5 s of a 10-epoch BCCD run's end on a 2-core Xeon."""
        if self.writer is None:
            return
        from PIL import Image
        from tensorboard.compat.proto.summary_pb2 import Summary

        for path in paths:
            try:
                with Image.open(path) as image:  # the header only: size, format and bands
                    if image.format not in ("PNG", "JPEG"):
                        raise ValueError(f"a {image.format} file, not a PNG or JPEG")
                    width, height, bands = image.width, image.height, len(image.getbands())
                encoded = Path(path).read_bytes()
            except (OSError, ValueError) as error:
                LOGGER.warning("WARNING: TensorBoard: cannot read %s (%s)", path, error)
                continue
            picture = Summary.Image(height=height, width=width, colorspace=bands, encoded_image_string=encoded)
            self.writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=Path(path).stem, image=picture)]),
                                                step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file (its writer thread ends); safe to call again."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
