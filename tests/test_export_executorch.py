"""export.py --include executorch and the ExecuTorch backend (models/formats/executorch.py): the .pte beside the
weights with its metadata inside, parity with the PyTorch model, the fixed batch and size (chunks, refusal),
val.py / detect.py / the hub on the file, refused flags, and one-line errors for foreign, corrupt and
metadata-less files. Skipped by name without the optional executorch package, except the tests of the
missing-package messages and of the refused flags."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import export
from models import for_inference, load_model
from models.backends import BackendError, MissingPackage, load_backend
from tests.conftest import make_tiny_dataset, save_random_checkpoint
from tests.export_helpers import (INT8_PARITY, check_int8_export, check_same_labels, copy_weights, detect_labels,
                                  eager_output, empty_dataset, max_differences)

NAMES = ["cat", "dog"]
IMGSZ = 64


def needs_executorch():
    for module in ("executorch.exir", "executorch.runtime"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip("could not import 'executorch': optional (pip install -r requirements-executorch.txt)")
    from models.formats.executorch import require

    require("executorch.runtime", "the ExecuTorch tests")  # the module's quiet import


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("executorch") / "best.pt", NAMES)


@pytest.fixture(scope="module")
def eager(weights):
    return for_inference(load_model(weights))


def run_export(weights: Path, *flags: str) -> int:
    return export.main(["--weights", str(weights), "--include", "executorch", *flags])


@pytest.fixture(scope="module")
def static_file(weights, tmp_path_factory):
    """best.pte exported at 64x64, batch 2, and beside it best.torchscript of the same shape (val.py and detect.py
    run fixed-shape exports on square letterboxed batches of their size: the TorchScript file is the reference)."""
    needs_executorch()
    source = copy_weights(weights, tmp_path_factory.mktemp("static"))
    assert run_export(source, "--imgsz", str(IMGSZ), "--batch-size", "2", "--include", "executorch",
                      "torchscript") == 0
    return source.with_suffix(".pte")


def test_export_writes_the_pte_with_metadata_inside_summary_and_parity(weights, tmp_path, capsys, eager):
    needs_executorch()
    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--imgsz", "64", "96") == 0  # non-square
    out = capsys.readouterr().out
    path = tmp_path / "best.pte"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "best.pte"]  # no temp file left, no sidecar
    assert any(line.startswith(f"ExecuTorch: saved {path} (") for line in out.splitlines()), out
    parity = [line for line in out.splitlines() if line.startswith("ExecuTorch parity: max |diff| ")]
    assert len(parity) == 1 and "at 1x3x64x96; tolerance 0.096 px, 0.001" in parity[0]
    backend = load_backend(path)
    assert type(backend).__name__ == "ExecuTorchBackend" and backend.kind == "executorch"
    assert (backend.names, backend.nc, backend.stride, backend.imgsz, backend.dynamic, backend.info.batch) == \
        (NAMES, 2, 32, (64, 96), False, 1)
    assert backend.info.to_dict() == {"format": "yolo-trainer-export/1", "names": NAMES, "nc": 2, "stride": 32,
                                      "imgsz": [64, 96], "batch": 1, "dynamic": False, "half": False, "int8": False,
                                      "channels_last": True, "device": "cpu"}
    images = torch.rand(1, 3, 64, 96, generator=torch.Generator().manual_seed(3))
    pred, raw = backend(images)
    assert raw == []
    boxes, scores = max_differences(pred, eager_output(eager, images))
    assert boxes <= 1e-3 * 96 and scores <= 1e-3


def test_static_export_matches_eager_chunks_other_batches_and_refuses_other_sizes(static_file, eager):
    backend = load_backend(static_file)
    assert backend.info.batch == 2 and backend.imgsz == (IMGSZ, IMGSZ)
    generator = torch.Generator().manual_seed(1)
    for batch in (2, 3, 1):  # 3: chunks of 2, the last zero-padded; 1: one padded chunk
        images = torch.rand(batch, 3, IMGSZ, IMGSZ, generator=generator)
        boxes, scores = max_differences(backend(images)[0], eager_output(eager, images))
        assert boxes <= 1e-3 * IMGSZ and scores <= 1e-3, batch
    with pytest.raises(BackendError, match=r"^best.pte was exported for 64x64 inputs, got 96x64; export it again "
                                           r"with --imgsz for other sizes$"):
        backend(torch.rand(2, 3, 96, 64))


def test_refused_flags_are_one_line(weights, capsys):
    expected = {("--dynamic",): "--include executorch: .pte files have a fixed batch and input size here",
                ("--half",): "--half needs a CUDA device (--device 0) for TorchScript and ONNX",
                ("--int8", "--include", "onnx"): "--int8: TorchScript, ONNX and OpenVINO exports are "
                                                               "fp32 (or --half); --include ncnn, executorch and "
                                                               "litert take --int8"}
    for flags, start in expected.items():
        assert run_export(weights, *flags) == 2, flags
        assert capsys.readouterr().err.strip().startswith(f"export.py: error: {start}"), flags
    from models.formats import executorch as executorch_format
    from utils.errors import Unavailable

    config = export.ExportConfig(half=True)  # reached on a GPU, past export.py's CPU --half check
    with pytest.raises(Unavailable, match=r"^--include executorch --half: not supported \(XNNPACK's fp16 lowering "
                                          r"of this model is no smaller and slower than fp32\); export fp32 or --int8$"):
        executorch_format.check_options(config, torch.device("cpu"))
    with pytest.raises(Unavailable, match=r"^--include executorch exports for XNNPACK on the CPU: use --device cpu "
                                          r"\(not cuda\)$"):
        executorch_format.check_options(config, torch.device("cuda"))


@pytest.fixture(scope="module")
def trained(request):
    """(weights, data.yaml): conftest's int8_trained, trained only where ExecuTorch is installed."""
    needs_executorch()
    return request.getfixturevalue("int8_trained")


def test_int8_is_calibrated_on_the_data_keeps_float_outputs_and_tracks_the_model(trained, tmp_path, capsys):
    """XNNPACK int8 body, float Detect layer and decode: 1 byte per body weight, scores not collapsed, boxes in
    pixels, and the metadata saying int8."""
    weights, data = trained
    height, width = 64, 96
    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--imgsz", str(height), str(width), "--batch-size", "2", "--int8", "--data",
                      str(data)) == 0
    out = capsys.readouterr().out
    assert f"ExecuTorch --int8: calibrated on 16 images of {data}" in out
    parity = [line.removeprefix("ExecuTorch parity: ") for line in out.splitlines()
              if line.startswith("ExecuTorch parity: ")]
    assert len(parity) == 1 and re.match(INT8_PARITY, parity[0]), out  # on 8 calibration images
    path = tmp_path / "best-int8.pte"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-int8.pte", "best.pt"]
    check_int8_export(path, weights, data, height, width, stored=path)


def test_int8_without_calibration_images_is_refused_before_converting(weights, tmp_path, capsys):
    needs_executorch()
    data = empty_dataset(tmp_path / "empty")
    source = copy_weights(weights, tmp_path / "weights")
    assert run_export(source, "--int8", "--data", str(data)) == 2
    assert capsys.readouterr().err.strip() == (f"export.py: error: --data {data}: no train images to calibrate --int8 "
                                               "with")
    assert sorted(p.name for p in source.parent.iterdir()) == ["best.pt"]


def test_missing_executorch_is_named_with_the_install_command(weights, tmp_path, capsys, monkeypatch):
    source = copy_weights(weights, tmp_path)
    foreign = tmp_path / "model.pte"
    foreign.write_bytes(b"\x3c\x00\x00\x00ET12" + bytes(64))
    monkeypatch.setitem(sys.modules, "executorch.exir", None)  # import executorch.exir now raises ImportError
    monkeypatch.setitem(sys.modules, "executorch.runtime", None)
    assert run_export(source) == 1
    assert capsys.readouterr().err.strip() == ("export.py: error: --include executorch needs the optional package "
                                               "'executorch': pip install -r requirements-executorch.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "model.pte"]
    with pytest.raises(MissingPackage, match=r"^running model.pte needs the optional package 'executorch': "
                                             r"pip install -r requirements-executorch.txt$"):
        load_backend(foreign)


def test_foreign_corrupt_and_metadata_less_files_are_one_line_errors(static_file, tmp_path):
    foreign = tmp_path / "foreign.pte"
    shutil.copy(Path(export.__file__).parent / "requirements.txt", foreign)
    with pytest.raises(BackendError, match=r"foreign.pte: not an ExecuTorch program \(no ET12 identifier\)$"):
        load_backend(foreign)
    truncated = tmp_path / "truncated.pte"
    data = static_file.read_bytes()
    truncated.write_bytes(data[: len(data) // 3])
    with pytest.raises(BackendError, match=r"truncated.pte: not a readable ExecuTorch program \("):
        load_backend(truncated)
    plain = small_program(tmp_path / "plain.pte")  # a valid ExecuTorch program that export.py did not write
    with pytest.raises(BackendError, match=r"plain.pte: no yolo_metadata metadata inside \(not exported by export.py; "
                                           r"methods: forward\)$"):
        load_backend(plain)


def small_program(path: Path, **constant_methods) -> Path:
    """A valid ExecuTorch program of one convolution (portable kernels, no XNNPACK: quick to make)."""
    from executorch.exir import to_edge

    program = torch.export.export(torch.nn.Conv2d(3, 7, 1).eval(), (torch.rand(1, 3, 32, 32),), strict=False)
    path.write_bytes(bytes(to_edge(program, constant_methods=constant_methods or None).to_executorch().buffer))
    return path


def test_metadata_with_a_bad_field_or_size_is_refused_naming_it(static_file, tmp_path):
    """The metadata method's JSON goes through the same checks as every format's (models/export_info.py), and must
    agree with the program's input shape."""
    values = load_backend(static_file).info.to_dict()
    cases = {"stride": ({"stride": 0}, r"'stride' must be an integer in \[1, 1024\], got 0"),
             "size": ({}, r"'imgsz' \[64, 64\] and 'batch' 2 do not match the model's input shape \[1, 3, 32, 32\]")}
    for name, (change, reason) in cases.items():
        text = json.dumps(values | change).encode()
        bad = small_program(tmp_path / f"{name}.pte",
                            yolo_metadata=torch.frombuffer(bytearray(text), dtype=torch.uint8).clone())
        with pytest.raises(BackendError, match=rf"{name}.pte: not an exported yolo-trainer/YOLOv5 model \(metadata: "
                                               rf"{reason}\)$"):
            load_backend(bad)


# --- val.py, detect.py and the hub on the exported file -----------------------------------------------------

def test_val_detect_and_hub_on_the_pte_equal_the_same_shape_torchscript(static_file, tmp_path):
    import val
    from utils.hub import load_hub_model

    data = make_tiny_dataset(tmp_path / "data", num_train=1, num_val=5)
    source = static_file.with_suffix(".torchscript")  # checked against the checkpoint by tests/test_export.py
    results = [val.run(data=data, weights=str(path), imgsz=IMGSZ, batch_size=4, workers=0, plots=False,
                       save_txt=True, save_conf=True, project=tmp_path / "val", device="cpu", amp="off")
               for path in (source, static_file)]
    reference, exported = results
    assert reference.seen == 5 and reference.map50 > 0
    for metric in ("mp", "mr", "map50", "map"):
        assert getattr(exported, metric) == pytest.approx(getattr(reference, metric), abs=0.001), metric
    expected, got = (detect_labels(path, tmp_path / "data" / "images" / "val", (IMGSZ,), tmp_path / "detect", name)
                     for name, path in (("torchscript", source), ("pte", static_file)))
    check_same_labels(expected, got, 1.0 / 96 + 1e-6)  # whole pixels of 96x112 images
    image = sorted((tmp_path / "data" / "images" / "val").iterdir())[0]
    detections = []
    for path in (source, static_file):
        hub = load_hub_model(path)
        hub.conf, hub.amp = 0.001, "off"
        detections.append(hub(str(image), size=IMGSZ).xyxy[0])
    assert type(hub.model).__name__ == "ExecuTorchBackend" and hub.names == dict(enumerate(NAMES))
    expected, got = detections
    assert len(expected) and got.shape == expected.shape
    # the best box (whole pixels of the image) and its score; the random model's lower scores tie, and NMS may keep
    # either of two boxes with equal scores
    assert torch.allclose(got[0], expected[0], atol=1.0) and abs(float(got[0, 4] - expected[0, 4])) <= 1e-3
