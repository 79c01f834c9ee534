"""TensorRT (models/formats/engine.py) where no GPU is: the one-line answers, the file's metadata header, and which
TensorRT API the build takes (10: precision flags; 11: strongly typed), against stand-ins of the two module shapes.
The build and its val.py parity on a GPU are benchmarks/gpu_check.py's ``tensorrt`` step."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch

import export
from models.backends import BackendError, MissingPackage, load_backend
from models.formats import engine
from tests.conftest import ROOT, save_random_checkpoint
from tests.export_helpers import copy_weights
from utils.errors import ArgumentError, Unavailable, UnavailableOption

INFO = {"names": ["a", "b"], "stride": 32, "imgsz": [64, 64], "batch": 1, "dynamic": False, "half": False}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("engine") / "tiny.pt", ["a", "b"])


def engine_file(path, metadata: bytes, body: bytes = b"\x00serialized") -> str:
    path.write_bytes(engine.HEADER.pack(len(metadata)) + metadata + body)
    return str(path)


def test_export_on_the_cpu_is_one_line_and_writes_nothing(weights):
    done = subprocess.run([sys.executable, str(ROOT / "export.py"), "--weights", str(weights), "--include", "engine",
                           "--img", "64"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "export.py: error: --include engine builds a TensorRT engine on an NVIDIA GPU: use --device 0 (not cpu); "
        "TensorRT engines do not run on the CPU")
    assert "Traceback" not in done.stderr and not list(weights.parent.glob("*.engine"))


def test_an_engine_on_the_cpu_is_one_line(tmp_path, monkeypatch):
    path = engine_file(tmp_path / "best.engine", json.dumps(INFO).encode())
    with pytest.raises(Unavailable, match=r"best.engine: TensorRT engines run on an NVIDIA GPU \(--device 0\), "
                                          "not on cpu"):
        load_backend(path, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Unavailable, match="this machine has no CUDA device"):
        load_backend(path, "cuda:0")
    done = subprocess.run([sys.executable, str(ROOT / "detect.py"), "--weights", path, "--source",
                           str(ROOT / "data" / "images"), "--device", "cpu", "--project", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "TensorRT engines run on an NVIDIA GPU" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_metadata_header_is_read_back_and_foreign_files_are_refused(tmp_path):
    values, body = engine.split_engine_file(engine_file(tmp_path / "a.engine", json.dumps(INFO).encode(), b"PLAN"))
    assert values == INFO and body == b"PLAN"
    yolov5_engine = tmp_path / "yolov5s.engine"  # YOLOv5 v7 writes the serialized engine alone
    yolov5_engine.write_bytes(b"ftrt" + bytes(range(256)) * 4)
    with pytest.raises(BackendError, match="no export.py metadata at its start .* --include engine --device 0"):
        engine.split_engine_file(yolov5_engine)
    with pytest.raises(BackendError, match="not a TensorRT engine from export.py"):
        engine.split_engine_file(_short(tmp_path / "c.engine"))
    with pytest.raises(BackendError, match="no export.py metadata"):
        engine.split_engine_file(engine_file(tmp_path / "d.engine", b"\xff\xfe not json"))
    with pytest.raises(BackendError, match="not a JSON object"):
        engine.split_engine_file(engine_file(tmp_path / "e.engine", b"[1, 2]"))


def _short(path):
    path.write_bytes(b"\x01\x00")
    return path


def test_a_gpu_without_tensorrt_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    config = export.ExportConfig(weights="x.pt", include=("engine",), device="0")
    with pytest.raises(MissingPackage, match="--include engine needs the optional package 'tensorrt': pip install"):
        engine.check_options(config, torch.device("cuda", 0))
    for flag in ("dynamic", "int8"):
        refused = export.ExportConfig(weights="x.pt", include=("engine",), device="0")
        setattr(refused, flag, True)
        with pytest.raises(ArgumentError, match=f"--include engine --{flag}|--include engine: engines are built"):
            engine.check_options(refused, torch.device("cuda", 0))


class FakeTensorRT(types.SimpleNamespace):
    """The attributes build_engine touches, recording what it asks for: TensorRT 10's shape (BuilderFlag.FP16) or
    11's (no precision flags; NetworkDefinitionCreationFlag.STRONGLY_TYPED), the loggers' severities and the
    builder config's memory-pool limits."""

    def __init__(self, major: int):
        calls = {"flags": [], "create_network": None, "parsed": None, "loggers": [], "pool_limits": []}

        class Logger:
            WARNING, VERBOSE = "warning-severity", "verbose-severity"

            def __init__(self, severity):
                calls["loggers"].append(severity)

        class Builder:
            platform_has_fast_fp16 = True

            def __init__(self, logger):
                pass

            def create_network(self, flags):
                calls["create_network"] = flags
                return "network"

            def create_builder_config(self):
                return types.SimpleNamespace(set_flag=calls["flags"].append,
                                             set_memory_pool_limit=lambda *pool: calls["pool_limits"].append(pool))

            def build_serialized_network(self, network, config):
                return b"PLAN" if network == "network" else None

        class OnnxParser:
            num_errors = 0

            def __init__(self, network, logger):
                pass

            def parse(self, data):
                calls["parsed"] = data
                return data.startswith(b"onnx")

        flags = {"FP16": "fp16-flag"} if major == 10 else {}
        creation = types.SimpleNamespace(STRONGLY_TYPED=1) if major == 11 else types.SimpleNamespace()
        super().__init__(calls=calls, Logger=Logger, Builder=Builder, OnnxParser=OnnxParser,
                         BuilderFlag=types.SimpleNamespace(**flags), NetworkDefinitionCreationFlag=creation,
                         MemoryPoolType=types.SimpleNamespace(WORKSPACE="workspace-pool"))


@pytest.mark.parametrize("major, half, network_flags, builder_flags", [
    (10, False, 0, []), (10, True, 0, ["fp16-flag"]), (11, False, 1 << 1, []), (11, True, 1 << 1, [])])
def test_the_build_takes_tensorrt_10_or_11s_way_to_precision(major, half, network_flags, builder_flags):
    trt = FakeTensorRT(major)
    assert engine.build_engine(trt, b"onnx graph", half) == b"PLAN"
    assert trt.calls["create_network"] == network_flags and trt.calls["flags"] == builder_flags
    with pytest.raises(engine.EngineError, match="TensorRT could not parse the ONNX graph"):
        engine.build_engine(FakeTensorRT(major), b"garbage", half)


@pytest.mark.parametrize("major", [10, 11])
def test_the_build_takes_the_workspace_limit_and_the_log_severity(major):
    """YOLOv5's --workspace (GB, default 4) is the builder's workspace pool limit; --verbose is TensorRT's VERBOSE."""
    trt = FakeTensorRT(major)
    engine.build_engine(trt, b"onnx graph", False)
    assert trt.calls["pool_limits"] == [("workspace-pool", 4 << 30)] and trt.calls["loggers"] == ["warning-severity"]
    trt = FakeTensorRT(major)
    engine.build_engine(trt, b"onnx graph", False, workspace=12, verbose=True)
    assert trt.calls["pool_limits"] == [("workspace-pool", 12 << 30)] and trt.calls["loggers"] == ["verbose-severity"]


@pytest.fixture
def fake_gpu_build(monkeypatch):
    """export.py --include engine on the CPU with a stand-in TensorRT 10: engine.check_options sees a CUDA device,
    the ONNX trace is skipped, and the file is not run back (checked_backend None, as for a format that cannot run
    here). Returns the stand-in, whose ``calls`` record the build."""
    trt = FakeTensorRT(10)
    check_options = engine.check_options
    monkeypatch.setattr(engine, "check_options", lambda config, device: check_options(config, torch.device("cuda", 0)))
    monkeypatch.setattr(engine, "import_tensorrt", lambda purpose: trt)
    monkeypatch.setattr(engine, "onnx_bytes", lambda graph, example: b"onnx graph")
    monkeypatch.setattr(engine, "checked_backend", lambda written, info, device: None)
    return trt


def test_workspace_and_verbose_reach_the_builder_from_the_command_line(weights, tmp_path, fake_gpu_build):
    source = copy_weights(weights, tmp_path)
    assert export.main(["--weights", str(source), "--img", "64", "--include", "engine", "--workspace", "6",
                        "--verbose"]) == 0
    assert fake_gpu_build.calls["pool_limits"] == [("workspace-pool", 6 << 30)]
    assert fake_gpu_build.calls["loggers"] == ["verbose-severity"]
    values, body = engine.split_engine_file(source.with_suffix(".engine"))
    assert body == b"PLAN" and values["imgsz"] == [64, 64]


def test_the_default_workspace_is_yolov5s_4_gb(weights, tmp_path, fake_gpu_build):
    source = copy_weights(weights, tmp_path)
    assert export.main(["--weights", str(source), "--img", "64", "--include", "engine"]) == 0
    assert fake_gpu_build.calls["pool_limits"] == [("workspace-pool", 4 << 30)]
    assert fake_gpu_build.calls["loggers"] == ["warning-severity"]


def test_a_workspace_that_is_not_a_positive_integer_is_one_line(weights, tmp_path, capsys, fake_gpu_build):
    source = copy_weights(weights, tmp_path)
    for value in ("0", "-2", "1.5", "many"):
        assert export.main(["--weights", str(source), "--include", "engine", "--workspace", value]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"export.py: error: argument --workspace: expected an integer in [1, 2147483647], got '{value}' "
            "(see export.py --help)"]
    for value in (0, True, 2.0):  # export.run's config is checked too, before the build
        config = export.ExportConfig(weights=str(source), imgsz=(64, 64), include=("engine",), workspace=value)
        with pytest.raises(ArgumentError, match=r"^--workspace: expected an integer in \[1, 2147483647\], got "):
            export.run(config)
    assert fake_gpu_build.calls["pool_limits"] == [] and sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]


def test_a_real_tensorrt_takes_the_workspace_limit():
    """Where TensorRT and a GPU are: the builder config API build_engine calls exists and keeps the limit."""
    trt = pytest.importorskip("tensorrt")
    if not torch.cuda.is_available():
        pytest.skip("TensorRT needs a CUDA device")
    config = trt.Builder(trt.Logger(trt.Logger.VERBOSE)).create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 3 << 30)
    assert config.get_memory_pool_limit(trt.MemoryPoolType.WORKSPACE) == 3 << 30
