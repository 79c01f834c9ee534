"""benchmarks.py (YOLOv5's format benchmark) on a tiny checkpoint: the table's rows, a missing package as a
failed row, --hard-fail, the run folders; and the benchmarks/ package beside it still importing as a package."""
from __future__ import annotations

import csv
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import export
from tests.conftest import make_tiny_dataset, save_random_checkpoint
from utils.errors import ArgumentError, UserError

ROOT = Path(__file__).resolve().parents[1]
IMGSZ = 64


@pytest.fixture(scope="module")
def cli():
    """benchmarks.py as a module: ``import benchmarks`` is the benchmarks/ package, so it is loaded by path."""
    spec = importlib.util.spec_from_file_location("benchmarks_cli", ROOT / "benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint, data.yaml): the tiny model, confident so that it detects something, and 4 val images."""
    root = tmp_path_factory.mktemp("bench")
    data = make_tiny_dataset(root / "data")
    return save_random_checkpoint(root / "tiny.pt", ["class0", "class1"], confident=True), data


def read_rows(folder: Path) -> dict:
    with open(folder / "benchmarks.csv", newline="") as file:
        return {row["format"]: row for row in csv.DictReader(file)}


def test_rows_are_pytorch_then_every_format_export_knows(cli, monkeypatch):
    expected = [("pytorch", "PyTorch"), *((name, export.TITLES[name]) for name in export.SUFFIXES)]
    assert cli.benchmark_formats() == expected
    monkeypatch.setitem(export.SUFFIXES, "newformat", ".new")  # a format added to export.py later
    monkeypatch.setitem(export.TITLES, "newformat", "New Format")
    assert cli.benchmark_formats()[-1] == ("newformat", "New Format")


def test_int8_adds_a_row_for_each_format_that_takes_int8_after_the_fp32_rows(cli):
    rows = cli.benchmark_formats(int8=True)
    assert rows[:len(export.SUFFIXES) + 1] == cli.benchmark_formats()
    assert rows[len(export.SUFFIXES) + 1:] == [("ncnn-int8", "NCNN int8"), ("executorch-int8", "ExecuTorch int8"),
                                               ("litert-int8", "LiteRT int8")]


def test_an_int8_row_exports_int8_calibrated_on_the_data_and_validates_it(cli, tiny, tmp_path):
    if any(importlib.util.find_spec(name) is None for name in ("pnnx", "ncnn")):
        pytest.skip("could not import 'pnnx'/'ncnn': optional (pip install -r requirements-ncnn.txt)")
    weights, data = tiny
    (tmp_path / "weights").mkdir()
    source = Path(shutil.copy(weights, tmp_path / "weights" / "tiny.pt"))
    config = cli.BenchmarkConfig(weights=str(source), imgsz=IMGSZ, data=str(data), device="cpu", workers=0)
    row = cli.benchmark_format("ncnn-int8", "NCNN int8", source, config, tmp_path)
    assert row.ok, row.reason
    assert row.path == tmp_path / "weights" / "tiny-int8_ncnn_model" and row.megabytes > 0
    assert " 8=1" in (row.path / "model.ncnn.param").read_text()  # int8 convolutions inside
    assert 0 <= row.map <= 1 and row.inference_ms > 0
    assert (tmp_path / "val" / "ncnn-int8").is_dir()


def test_table_rows_missing_package_hard_fail_and_new_run_folders(cli, tiny, tmp_path, monkeypatch, capsys):
    """PyTorch (val.run's own mAP), TorchScript ok; ONNX without its package an unavailable row naming the install
    command, which --hard-fail does not count (as YOLOv5's); a broken export is a failed row and --hard-fail then
    exits 1; each run gets its own folder with the table as markdown and CSV."""
    import val

    weights, data = tiny
    monkeypatch.setattr(export, "SUFFIXES", {name: export.SUFFIXES[name] for name in ("torchscript", "onnx")})
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx now fails, installed or not
    project = tmp_path / "runs"
    common = ["--weights", str(weights), "--data", str(data), "--imgsz", str(IMGSZ), "--workers", "0",
              "--device", "cpu", "--project", str(project)]

    assert cli.main(common) == 0
    out = capsys.readouterr().out
    assert "TorchScript (2/3)" in out and "ONNX: unavailable (export: " in out
    rows = read_rows(project / "exp")
    assert list(rows) == ["pytorch", "torchscript", "onnx"]
    reference = val.run(data=str(data), weights=str(weights), imgsz=IMGSZ, batch_size=1, task="speed", workers=0,
                        device="cpu", project=str(tmp_path / "val"), plots=False)
    capsys.readouterr()
    pytorch, torchscript, onnx = rows["pytorch"], rows["torchscript"], rows["onnx"]
    assert pytorch["status"] == "ok" and pytorch["file"] == "tiny.pt" and float(pytorch["size_mb"]) > 0
    assert reference.map > 0 and float(pytorch["map50_95"]) == round(reference.map, 6)
    assert float(pytorch["inference_ms"]) > 0
    assert torchscript["status"] == "ok" and torchscript["file"] == "tiny.torchscript"
    assert 0 <= float(torchscript["map50_95"]) <= 1 and float(torchscript["inference_ms"]) > 0
    assert (project / "exp" / "weights" / "tiny.torchscript").is_file()
    assert onnx["status"] == "unavailable" and onnx["map50_95"] == "" and "pip install onnx" in onnx["reason"]
    table = (project / "exp" / "benchmarks.md").read_text()
    assert "| PyTorch " in table and "| TorchScript " in table and "| unavailable: export: " in table
    assert table.startswith("benchmarks.py: tiny.pt at --imgsz 64 --batch-size 1 on cpu; val.py --task speed")
    assert not list(weights.parent.glob("tiny.torchscript"))  # nothing written beside the given weights

    monkeypatch.setattr(export, "SUFFIXES", {"onnx": ".onnx"})  # ONNX alone, to be quick
    assert cli.main([*common, "--test", "--hard-fail"]) == 0  # exports only, into a new folder; unavailable is no fault
    rows = read_rows(project / "exp2")
    assert rows["pytorch"]["status"] == "ok" and rows["pytorch"]["map50_95"] == "" and rows["onnx"]["reason"]

    def broken(self, fmt, written, path):
        raise export.ParityError(f"{path}: the TorchScript model differs from the PyTorch model: 9.9 px")

    monkeypatch.setattr(export, "SUFFIXES", {"torchscript": ".torchscript"})
    monkeypatch.setattr(export.Exporter, "check", broken)
    assert cli.main([*common, "--test", "--hard-fail"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("benchmarks.py: error: --hard-fail: TorchScript failed (export: ") and "\n" not in error.strip()
    assert read_rows(project / "exp3")["torchscript"]["status"] == "failed"
    assert (project / "exp" / "benchmarks.md").read_text() == table  # the first run's table is kept


def test_hard_fail_flag_and_floor(cli):
    assert cli.parse_args([]).hard_fail is False
    assert cli.parse_args(["--hard-fail"]).hard_fail is True
    assert cli.parse_args(["--hard-fail", "0.29", "--pt-only"]).hard_fail == 0.29
    with pytest.raises(ArgumentError, match="--hard-fail"):
        cli.parse_args(["--hard-fail", "2"])
    good = cli.Row("pytorch", "PyTorch", map=0.31)
    low = cli.Row("onnx", "ONNX", map=0.28)
    failed = cli.Row("openvino", "OpenVINO", reason="export: differs")
    missing = cli.Row("ncnn", "NCNN", reason="export: needs ncnn", unavailable=True)
    exported = cli.Row("torchscript", "TorchScript")  # --test: no mAP, no floor
    assert cli.hard_fail_errors([good, low, failed, missing, exported], False) == []
    assert cli.hard_fail_errors([good, low, failed, missing, exported], True) == ["OpenVINO failed (export: differs)"]
    assert cli.hard_fail_errors([good, low, failed, exported], 0.29) == ["OpenVINO failed (export: differs)",
                                                                        "ONNX mAP50-95 0.2800 < 0.29"]


def test_failure_reasons_are_one_line(cli):
    assert cli.failure_reason(UserError("x.onnx: needs the optional package 'onnx': pip install onnx")) == (
        "x.onnx: needs the optional package 'onnx': pip install onnx")
    assert cli.failure_reason(ImportError("No module named 'coremltools'")).startswith(
        "No module named 'coremltools' (pip install -r requirements-export.txt")
    assert cli.failure_reason(RuntimeError("only on macOS\nmore detail")) == "RuntimeError: only on macOS more detail"


def test_exported_weights_are_refused(cli, tiny, tmp_path, capsys):
    weights, _ = tiny
    exported = tmp_path / "tiny.torchscript"
    exported.write_bytes(b"")
    assert cli.main(["--weights", str(exported), "--project", str(tmp_path / "runs")]) == 1
    assert capsys.readouterr().err == (f"benchmarks.py: error: {exported}: benchmarks.py takes a .pt checkpoint and "
                                       "exports it itself (--weights)\n")
    assert not (tmp_path / "runs").exists()


def test_script_and_benchmarks_package_side_by_side(tiny, tmp_path):
    """``python benchmarks.py`` runs as a script, and ``python benchmarks/x.py`` still imports ``benchmarks.y``
    (the package, not benchmarks.py); so does ``from benchmarks import ...`` here."""
    from benchmarks import bench_memory  # noqa: F401 - the package, not benchmarks.py

    weights, _ = tiny
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "benchmarks.py", "--weights", str(weights), "--pt-only", "--test",
                           "--device", "cpu", "--project", str(tmp_path / "runs")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| PyTorch " in done.stdout and (tmp_path / "runs" / "exp" / "benchmarks.csv").is_file()
    done = subprocess.run([sys.executable, "benchmarks/bench_startup.py", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: bench_startup.py"), done.stderr[-2000:]


def test_tensorrt_on_the_cpu_is_an_unavailable_row_that_hard_fail_does_not_count(cli, tiny, tmp_path):
    weights, data = tiny
    config = cli.BenchmarkConfig(weights=str(weights), data=str(data), imgsz=IMGSZ, device="cpu", test=True)
    row = cli.benchmark_format("engine", "TensorRT", weights, config, tmp_path)
    assert row.status == "unavailable" and "NVIDIA GPU" in row.reason and row.path is None
    assert cli.hard_fail_errors([row], True) == []
