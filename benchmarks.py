"""Export a checkpoint to every format export.py knows, validate each and time it: one table (YOLOv5's benchmarks.py).

    python benchmarks.py --weights yolov5s.pt --imgsz 640 --data coco128.yaml
    python benchmarks.py --weights best.pt --data data.yaml --device 0 --half    # fp16 exports on a GPU
    python benchmarks.py --weights best.pt --test         # exports only, no validation
    python benchmarks.py --weights best.pt --pt-only      # the PyTorch row alone
    python benchmarks.py --weights best.pt --hard-fail    # exit 1 when a row failed (--hard-fail 0.29: or mAP < 0.29)
    python benchmarks.py --weights best.pt --data data.yaml --int8   # also an int8 row per format that takes --int8

Rows: PyTorch (the checkpoint itself), then each format in export.py's ``SUFFIXES`` in its order, so a format
added there is benchmarked without a change here. ``--int8`` (not in YOLOv5's benchmarks) adds a row for each format
that takes ``export.py --int8`` (its module lists ``int8`` in EXPORT_OPTIONS), calibrated on the train images of
``--data``, after the fp32 rows. Each format is exported by ``export.run`` (checked against
the PyTorch model before it is kept) and validated by ``val.run``; a row is ``ok``, ``unavailable`` (what this
machine or device lacks: a missing package, with its install command; a format for another platform or device) or
``failed`` (the export or its validation broke), with one line saying why, never a traceback. ``--hard-fail``
counts failed rows only, as YOLOv5's benchmarks skip what a platform lacks. mAP50-95 is scored as YOLOv5's benchmarks score it, with ``val.py --task speed`` (square batches of
``--imgsz``, conf 0.25, IoU 0.45), so every row sees the same input; it is lower than val.py's own figure.
Inference is val.py's inference time per image (ms).

Outputs go to ``runs/benchmarks/exp`` (then exp2, ...; ``--project``/``--name``): ``weights/`` holds a hard link
to (else a copy of) the checkpoint and the exports beside it, ``val/<format>/`` each validation, and the table
is written as ``benchmarks.md`` and ``benchmarks.csv``. Nothing is written beside the given weights.
"""
from __future__ import annotations

import argparse
import csv
import io
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from utils.cli import (ArgumentParser, add_device_flag, add_half_flag, add_run_folder_flags, batch_size,  # noqa: E402
                       float_in_range, image_size, workers)
from utils.errors import Unavailable, UserError, one_line, run_main  # noqa: E402
from utils.limits import Range  # noqa: E402

LOGGER = logging.getLogger("benchmarks")
PYTORCH = ("pytorch", "PyTorch")  # the first row: the checkpoint itself
INT8 = "-int8"  # a row's format name for the int8 export of a format: "litert-int8"
REASON_LIMIT = 300  # characters of a failed row's reason
COLUMNS = ("Format", "Size (MB)", "mAP50-95", "Inference (ms/img)", "Status")
CSV_COLUMNS = ("format", "file", "size_mb", "map50_95", "inference_ms", "status", "reason")


class BenchmarkError(UserError):
    """A failed row under --hard-fail, or weights benchmarks.py cannot take; one line."""


@dataclass
class BenchmarkConfig:
    weights: str = "yolov5s.pt"
    imgsz: int = 640
    batch_size: int = 1
    data: str = "coco128.yaml"
    device: str = ""
    half: bool = False
    test: bool = False
    pt_only: bool = False
    hard_fail: bool | float = False  # True: any failed row is an error; a number: also a mAP50-95 below it
    int8: bool = False  # also the int8 export of each format that takes export.py --int8
    workers: int = 8
    project: str = str(ROOT / "runs/benchmarks")
    name: str = "exp"
    exist_ok: bool = False


@dataclass
class Row:
    format: str  # export.py's name ("torchscript"), "pytorch" for the checkpoint, "litert-int8" for an int8 export
    title: str  # "TorchScript"
    path: Path | None = None
    megabytes: float | None = None
    map: float | None = None  # mAP50-95
    inference_ms: float | None = None  # per image
    reason: str = ""  # why it failed or cannot run here; "" when it ran
    unavailable: bool = False  # the machine or device lacks it (utils.errors.Unavailable): not a failure

    @property
    def ok(self) -> bool:
        return not self.reason

    @property
    def status(self) -> str:
        return "ok" if self.ok else "unavailable" if self.unavailable else "failed"


@dataclass
class BenchmarkResult:
    rows: list = field(default_factory=list)
    save_dir: Path | None = None


def benchmark_formats(int8: bool = False) -> list[tuple[str, str]]:
    """(name, title) of each row: PyTorch, then every format export.py has now, in its order; with ``int8``, then
    ("<name>-int8", "<title> int8") for each format whose module takes --int8."""
    import export

    rows = [PYTORCH, *((name, export.TITLES.get(name, name)) for name in export.SUFFIXES)]
    if int8:
        rows += [(name + INT8, f"{export.TITLES.get(name, name)} int8") for name in export.SUFFIXES
                 if name in export.FORMAT_MODULES and takes_int8(name)]
    return rows


def takes_int8(name: str) -> bool:
    """Whether export.py's format ``name`` takes --int8 (its module, which imports no optional package until used,
    lists "int8" in EXPORT_OPTIONS)."""
    import export

    return "int8" in getattr(export.format_module(name), "EXPORT_OPTIONS", ())


def run(config: BenchmarkConfig) -> BenchmarkResult:
    """Benchmark ``config.weights`` in each format (PyTorch alone with ``pt_only``); returns the rows and the
    run folder, where the table is written. A format that fails is a row saying why, not an exception."""
    from utils.device import select_device
    from utils.files import replace_with_link
    from utils.paths import increment_path

    start = time.perf_counter()
    source = checked_weights(config.weights)
    device = select_device(config.device)  # a bad --device is one error, not a failed row per format
    if not config.test or config.int8:  # --int8 calibrates on --data's train images
        check_data(config.data)
    formats = [PYTORCH] if config.pt_only else benchmark_formats(config.int8)
    save_dir = increment_path(Path(config.project) / config.name, exist_ok=config.exist_ok, mkdir=True)
    weights = save_dir / "weights" / source.name
    weights.parent.mkdir(exist_ok=True)
    replace_with_link(source, weights)  # the exports go beside this one, inside the run folder
    LOGGER.info("Benchmarking %s in %d format%s (%s) into %s", source, len(formats), "s" * (len(formats) > 1),
                ", ".join(title for _, title in formats), save_dir)
    result = BenchmarkResult(save_dir=save_dir)
    for number, (name, title) in enumerate(formats, 1):
        LOGGER.info("\n%s (%d/%d)", title, number, len(formats))
        row = benchmark_format(name, title, weights, config, save_dir)
        LOGGER.info("%s: %s", title, describe(row))
        result.rows.append(row)
    LOGGER.info("\nBenchmarks complete (%.1f s)", time.perf_counter() - start)
    write_tables(save_dir, result.rows, header(config, source, device))
    return result


def checked_weights(value: str) -> Path:
    """The checkpoint file ``--weights`` names (a YOLOv5 release name or URL is fetched first, as elsewhere)."""
    import export
    from utils.downloads import weights_file

    path = weights_file(value)
    exported = {suffix for suffix in export.SUFFIXES.values() if suffix.startswith(".")}
    if path.is_dir() or path.suffix.lower() in exported:
        raise BenchmarkError(f"{path}: benchmarks.py takes a .pt checkpoint and exports it itself (--weights)")
    if not path.is_file():
        raise BenchmarkError(f"{path}: weights file not found (--weights)")
    return path


def check_data(data: str) -> None:
    """Read ``--data`` once before any export, so a bad dataset YAML is one error, not a failed row per format."""
    from utils.data.dataset_yaml import load_data_config

    load_data_config(data)


def benchmark_format(name: str, title: str, weights: Path, config: BenchmarkConfig, save_dir: Path) -> Row:
    """Export ``weights`` to ``name`` (the checkpoint itself for PyTorch) and validate the file; a Row either way."""
    import export

    row = Row(name, title)
    try:
        if name == PYTORCH[0]:
            row.path, row.megabytes = weights, export.size_bytes(weights) / 1e6
        else:
            int8 = name.endswith(INT8)
            exported = export.run(export.ExportConfig(
                weights=str(weights), imgsz=(config.imgsz, config.imgsz), batch_size=config.batch_size,
                include=(name.removesuffix(INT8),), device=config.device, half=config.half and not int8, int8=int8,
                data=config.data))[0]
            row.path, row.megabytes = exported.path, exported.megabytes
    except Exception as error:  # noqa: BLE001 - every failure is a row (see failure_reason)
        if isinstance(error, export.ExportFailures):  # the one format asked: its own error
            error = error.failures[0][1]
        row.reason, row.unavailable = "export: " + failure_reason(error), is_unavailable(error)
        return row
    if config.test:
        return row
    import val

    try:
        metrics = val.run(data=config.data, weights=str(row.path), batch_size=config.batch_size,
                          imgsz=config.imgsz, device=config.device, half=config.half, task="speed",
                          workers=config.workers, project=str(save_dir / "val"), name=name, plots=False)
    except Exception as error:  # noqa: BLE001
        row.reason, row.unavailable = "val: " + failure_reason(error), is_unavailable(error)
        return row
    row.map, row.inference_ms = float(metrics.map), float(metrics.speed[1])
    return row


def is_unavailable(error: Exception) -> bool:
    """A format this machine or device cannot run (a missing package, another platform or device), as opposed to
    one that broke: YOLOv5's benchmarks skip the first kind under --hard-fail too."""
    return isinstance(error, (Unavailable, ImportError))


def failure_reason(error: Exception) -> str:
    """One line for a failed row. The project's own errors (a missing optional package names its install
    command, a format that cannot run on this device says so) are already one line; a parity failure says by how
    much; anything else is named by its type (its traceback is logged at DEBUG level)."""
    import export

    if isinstance(error, (UserError, export.ParityError)):
        return one_line(error, REASON_LIMIT)
    if isinstance(error, ImportError):  # a package a format imports itself, not through models.backends.require
        return one_line(f"{error} (pip install -r requirements-export.txt installs the export packages)",
                        REASON_LIMIT)
    LOGGER.debug("benchmark failure", exc_info=error)
    return one_line(f"{type(error).__name__}: {error}", REASON_LIMIT)


def describe(row: Row) -> str:
    """The progress line of one row: "ok, 14.1 MB, mAP50-95 0.4512, 38.20 ms/img" or "failed (reason)"."""
    if not row.ok:
        return f"{row.status} ({row.reason})"
    parts = ["ok", f"{row.megabytes:.1f} MB"]
    if row.map is not None:
        parts += [f"mAP50-95 {row.map:.4f}", f"{row.inference_ms:.2f} ms/img"]
    return ", ".join(parts)


def hard_fail_errors(rows: list[Row], hard_fail: bool | float) -> list[str]:
    """What --hard-fail refuses: each failed row (not those this machine cannot run), and with a floor each validated
    row whose mAP50-95 is below it."""
    if hard_fail is False:
        return []
    errors = [f"{row.title} failed ({row.reason})" for row in rows if row.status == "failed"]
    if not isinstance(hard_fail, bool):
        errors += [f"{row.title} mAP50-95 {row.map:.4f} < {hard_fail:g}" for row in rows
                   if row.ok and row.map is not None and row.map < hard_fail]
    return errors


# ---------------------------------------------------------------------- the table

def cells(row: Row) -> list[str]:
    """The table's cells for ``row`` (COLUMNS); "-" where nothing was measured."""
    def number(value, digits):
        return "-" if value is None else f"{value:.{digits}f}"

    status = "ok" if row.ok else f"{row.status}: {row.reason}"
    return [row.title, number(row.megabytes, 1), number(row.map, 4), number(row.inference_ms, 2), status]


def markdown_table(rows: list[Row]) -> str:
    """A markdown table, its columns padded so it also reads as plain text; "|" in a reason is escaped."""
    table = [list(COLUMNS), *([cell.replace("|", "\\|") for cell in cells(row)] for row in rows)]
    widths = [max(len(line[column]) for line in table) for column in range(len(COLUMNS))]
    lines = ["| " + " | ".join(cell.ljust(width) for cell, width in zip(line, widths)) + " |" for line in table]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(lines) + "\n"


def csv_text(rows: list[Row]) -> str:
    def number(value, digits):
        return "" if value is None else round(value, digits)

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow([row.format, "" if row.path is None else row.path.name, number(row.megabytes, 3),
                         number(row.map, 6), number(row.inference_ms, 3), row.status, row.reason])
    return out.getvalue()


def header(config: BenchmarkConfig, weights: Path, device) -> str:
    """What the figures were measured on: the settings, torch and the machine (written above the table)."""
    import platform

    import torch

    from benchmarks.bench_memory import cpu_name

    half = " --half" if config.half else ""
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    what = "exports only (--test)" if config.test else (f"val.py --task speed on {config.data} (conf 0.25, IoU 0.45, "
                                                        "square batches; lower than val.py's mAP)")
    return (f"benchmarks.py: {weights.name} at --imgsz {config.imgsz} --batch-size {config.batch_size}{half} on "
            f"{device}{gpu}; {what}.\n"
            f"torch {torch.__version__}, Python {platform.python_version()}, {cpu_name()}; "
            f"{time.strftime('%Y-%m-%d %H:%M')}.\n")


def write_tables(save_dir: Path, rows: list[Row], heading: str) -> None:
    from utils.files import atomic_write

    table = markdown_table(rows)
    atomic_write(save_dir / "benchmarks.md", (heading + "\n" + table).encode())
    atomic_write(save_dir / "benchmarks.csv", csv_text(rows).encode())
    LOGGER.info("\n%s\n%sResults saved to %s (benchmarks.md, benchmarks.csv)", heading, table, save_dir)


# ---------------------------------------------------------------------- command line

def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="benchmarks.py", description="Export to every format, validate and time each")
    add = parser.add_argument
    add("--weights", type=str, default="yolov5s.pt", help="checkpoint path (ours or YOLOv5's .pt)")
    add("--imgsz", "--img", "--img-size", type=image_size, default=640, help="inference size (pixels)")
    add("--batch-size", type=batch_size, default=1, help="batch size")
    add("--data", type=str, default="coco128.yaml", help="dataset.yaml path or name in data/")
    add_device_flag(parser)
    add_half_flag(parser)
    add("--test", action="store_true", help="exports only: no validation")
    add("--pt-only", action="store_true", help="the PyTorch row only")
    add("--hard-fail", nargs="?", const=True, default=False, type=float_in_range(Range(0.0, 1.0)),
        help="exit 1 when a format failed (not one this machine lacks); with a number, also when a mAP50-95 is below it")
    add("--int8", action="store_true",
        help="also an int8 row for each format export.py --int8 takes (calibrated on the train images of --data)")
    add("--workers", type=workers, default=8, help="max dataloader workers (val.py's)")
    add_run_folder_flags(parser, str(ROOT / "runs/benchmarks"))
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    """Exit code 0; 1 for a bad input file or, with --hard-fail, a failed row; 2 for a bad flag."""
    return run_main("benchmarks.py", _main, argv)


def _main(argv) -> int:
    config = BenchmarkConfig(**vars(parse_args(argv)))
    from utils.loggers import setup_logging

    setup_logging()
    result = run(config)
    errors = hard_fail_errors(result.rows, config.hard_fail)
    if errors:
        raise BenchmarkError(f"--hard-fail: {'; '.join(errors)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
