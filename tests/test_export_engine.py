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
    11's (no precision flags; NetworkDefinitionCreationFlag.STRONGLY_TYPED)."""

    def __init__(self, major: int):
        calls = {"flags": [], "create_network": None, "parsed": None}

        class Builder:
            platform_has_fast_fp16 = True

            def __init__(self, logger):
                pass

            def create_network(self, flags):
                calls["create_network"] = flags
                return "network"

            def create_builder_config(self):
                return types.SimpleNamespace(set_flag=calls["flags"].append)

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
        logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})
        super().__init__(calls=calls, Logger=logger, Builder=Builder, OnnxParser=OnnxParser,
                         BuilderFlag=types.SimpleNamespace(**flags), NetworkDefinitionCreationFlag=creation)


@pytest.mark.parametrize("major, half, network_flags, builder_flags", [
    (10, False, 0, []), (10, True, 0, ["fp16-flag"]), (11, False, 1 << 1, []), (11, True, 1 << 1, [])])
def test_the_build_takes_tensorrt_10_or_11s_way_to_precision(major, half, network_flags, builder_flags):
    trt = FakeTensorRT(major)
    assert engine.build_engine(trt, b"onnx graph", half) == b"PLAN"
    assert trt.calls["create_network"] == network_flags and trt.calls["flags"] == builder_flags
    with pytest.raises(engine.EngineError, match="TensorRT could not parse the ONNX graph"):
        engine.build_engine(FakeTensorRT(major), b"garbage", half)
