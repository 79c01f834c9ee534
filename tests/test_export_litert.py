"""export.py --include litert (alias tflite) and the LiteRT backend (models/formats/litert.py): NHWC input, the
metadata appended inside the file (ours and YOLOv5's), parity with the PyTorch model for fp32, --half and --int8
(calibrated on --data's train images through the inference letterbox; its output stays float so scores cannot
collapse), the fixed batch and size, val.py / detect.py / the hub on the file, YOLOv5's own .tflite layout, and
one-line errors. Skipped by name without the optional litert-torch / ai-edge-litert packages, except the tests of
the missing-package messages, the refused flags and the quantisation helpers."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import export
from models import for_inference, load_model
from models.backends import BackendError, MissingPackage, load_backend
from models.formats import litert
from tests.conftest import save_random_checkpoint
from tests.export_helpers import (INT8_PARITY, check_int8_tracks, check_same_labels, copy_weights, detect_labels,
                                  eager_output, empty_dataset, letterboxed, max_differences)

HEIGHT, WIDTH = 64, 96  # non-square, as phones' camera frames


def needs_litert():
    for module, package in (("litert_torch", "litert-torch"), ("ai_edge_litert", "ai-edge-litert")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"could not import '{package}': optional (pip install -r requirements-litert.txt)")


@pytest.fixture
def random_weights(tmp_path) -> Path:
    return save_random_checkpoint(tmp_path / "random" / "best.pt", ["a", "b"])


@pytest.fixture(scope="module")
def trained(request):
    """(weights, data.yaml): conftest's int8_trained, trained only where LiteRT is installed."""
    needs_litert()  # only the tests that export need it trained
    return request.getfixturevalue("int8_trained")


@pytest.fixture(scope="module")
def eager(trained):
    return for_inference(load_model(trained[0]))


def run_export(weights: Path, *flags: str) -> int:
    return export.main(["--weights", str(weights), "--imgsz", str(HEIGHT), str(WIDTH), "--batch-size", "2", *flags])


def parity_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("LiteRT parity: ")]
    assert len(lines) == 1, out
    return lines[0]


@pytest.fixture(scope="module")
def exports(trained, tmp_path_factory):
    """best.tflite (fp32, through YOLOv5's name tflite) and best.torchscript of the same shape, 64x96, batch 2."""
    needs_litert()
    source = copy_weights(trained[0], tmp_path_factory.mktemp("fp32"))
    assert run_export(source, "--include", "tflite", "torchscript") == 0
    return source.with_suffix(".tflite")


def test_fp32_export_is_nhwc_with_metadata_inside_and_matches_eager(exports, eager, capsys):
    folder = exports.parent
    assert sorted(p.name for p in folder.iterdir()) == ["best.pt", "best.tflite", "best.torchscript"]
    with zipfile.ZipFile(exports) as archive:  # appended after the flatbuffer: YOLOv5's entry first, then ours
        assert archive.namelist() == ["meta.txt", "metadata.json"]
        assert archive.read("meta.txt").decode() == "{'stride': 32, 'names': {0: 'class0', 1: 'class1'}}"
        assert json.loads(archive.read("metadata.json")) == {
            "format": "yolo-trainer-export/1", "names": ["class0", "class1"], "nc": 2, "stride": 32,
            "imgsz": [HEIGHT, WIDTH], "batch": 2, "dynamic": False, "half": False, "int8": False,
                        "channels_last": True,
            "device": "cpu"}
    backend = load_backend(exports)
    assert type(backend).__name__ == "LiteRtBackend" and backend.kind == "litert"
    assert (backend.names, backend.stride, backend.imgsz, backend.dynamic, backend.info.batch) == \
        (["class0", "class1"], 32, (HEIGHT, WIDTH), False, 2)
    assert list(backend.input["shape"]) == [2, HEIGHT, WIDTH, 3] and backend.input["dtype"] == np.float32  # NHWC
    assert backend.output["dtype"] == np.float32 and not backend.int8
    generator = torch.Generator().manual_seed(1)
    for batch in (2, 3, 1):  # 3: chunks of 2, the last zero-padded
        images = torch.rand(batch, 3, HEIGHT, WIDTH, generator=generator)
        pred, raw = backend(images)
        assert raw == []
        boxes, scores = max_differences(pred, eager_output(eager, images))
        assert boxes <= 1e-3 * WIDTH and scores <= 1e-3, batch
    with pytest.raises(BackendError, match=r"^best.tflite was exported for 64x96 inputs, got 96x64; export it again "
                                           r"with --imgsz for other sizes$"):
        backend(torch.rand(2, 3, 96, 64))


def test_half_stores_fp16_weights_in_the_fp16_file_within_the_fp16_tolerance(trained, eager, exports, tmp_path,
                                                                              capsys):
    source = copy_weights(trained[0], tmp_path)
    assert run_export(source, "--include", "litert", "--half") == 0  # --half needs no GPU for LiteRT
    assert "tolerance 0.96 px, 0.01" in parity_line(capsys.readouterr().out)
    path = tmp_path / "best-fp16.tflite"  # YOLOv5's name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-fp16.tflite", "best.pt"]
    assert path.stat().st_size < 0.6 * exports.stat().st_size  # the weights are stored in 2 bytes, not 4
    backend = load_backend(path)
    assert backend.info.half and backend.input["dtype"] == np.float32
    images = torch.rand(2, 3, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(5))
    boxes, scores = max_differences(backend(images)[0], eager_output(eager, images))
    assert boxes <= 1e-2 * WIDTH and scores <= 1e-2


def test_int8_is_calibrated_on_the_data_keeps_float_outputs_and_tracks_the_model(trained, eager, exports, tmp_path,
                                                                                capsys):
    weights, data = trained
    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--include", "litert", "--int8", "--data", str(data)) == 0
    out = capsys.readouterr().out
    assert f"LiteRT --int8: calibrated on 16 images of {data}" in out
    assert re.match(INT8_PARITY, parity_line(out).removeprefix("LiteRT parity: "))  # on 8 calibration images
    path = tmp_path / "best-int8.tflite"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-int8.tflite", "best.pt"]
    backend = load_backend(path)
    # int8 input (the converter folds the first quantisation in), float output: the Detect convolutions and the
    # decode stay float, so boxes and scores never share one int8 scale
    assert backend.int8 and backend.input["dtype"] == np.int8 and backend.output["dtype"] == np.float32
    images = letterboxed(data, "val", (HEIGHT, WIDTH))  # images it was not calibrated on
    check_int8_tracks(backend(images)[0], eager_output(eager, images), HEIGHT, WIDTH)  # boxes back in pixels
    assert path.stat().st_size < 0.4 * exports.stat().st_size  # 1 byte per weight of the body, not 4


def test_quantise_and_dequantise_follow_the_tensor_details():
    """YOLOv5's int8 .tflite takes and returns uint8; ours takes int8: both through their scale and zero point."""
    images = np.array([0.0, 0.6, 1.0, 2.0], dtype=np.float32)
    uint8 = {"dtype": np.uint8, "quantization": (1 / 255, 0)}
    int8 = {"dtype": np.int8, "quantization": (1 / 255, -128)}
    assert litert.quantise(images, uint8).tolist() == [0, 153, 255, 255]  # clipped at the type's range
    assert litert.quantise(images, int8).tolist() == [-128, 25, 127, 127]
    assert litert.quantise(images, {"dtype": np.float32, "quantization": (0.0, 0)}) is not images
    output = np.array([10, 200], dtype=np.uint8)
    assert np.allclose(litert.dequantise(output, {"quantization": (0.5, 10)}), [0.0, 95.0])


def test_yolov5_tflite_with_only_its_meta_txt_is_read(exports, tmp_path):
    """YOLOv5's .tflite carries {'stride', 'names'} in meta.txt (a Python literal, read without eval); the size and
    batch come from the input's shape."""
    with zipfile.ZipFile(exports) as archive:
        start = archive.infolist()[0].header_offset  # where the appended archive begins
    yolov5 = tmp_path / "yolov5s-fp16.tflite"
    yolov5.write_bytes(exports.read_bytes()[:start])
    with zipfile.ZipFile(yolov5, "a") as archive:
        archive.writestr("meta.txt", "{'stride': 32, 'names': {0: 'person', 1: 'car'}}")
    backend = load_backend(yolov5)
    assert (backend.names, backend.stride, backend.imgsz, backend.info.batch) == (["person", "car"], 32,
                                                                                   (HEIGHT, WIDTH), 2)
    images = torch.rand(2, 3, HEIGHT, WIDTH)
    assert torch.equal(backend(images)[0], load_backend(exports)(images)[0])
    yolov5.write_bytes(exports.read_bytes()[:start])  # no metadata at all
    with pytest.raises(BackendError, match=r"yolov5s-fp16.tflite: no metadata inside \(export it with export.py"):
        load_backend(yolov5)
    with zipfile.ZipFile(yolov5, "a") as archive:
        archive.writestr("meta.txt", "{'stride': __import__('os').getpid(), 'names': ['a']}")
    with pytest.raises(BackendError, match=r"meta.txt inside is not a Python literal \("):
        load_backend(yolov5)


def test_foreign_corrupt_and_bad_metadata_files_are_one_line_errors(exports, tmp_path, monkeypatch):
    foreign = tmp_path / "foreign.tflite"
    shutil.copy(Path(export.__file__).parent / "requirements.txt", foreign)
    with pytest.raises(BackendError, match=r"foreign.tflite: not a TFLite model \(no TFL3 identifier\)$"):
        load_backend(foreign)
    data = exports.read_bytes()
    with zipfile.ZipFile(exports) as archive:
        start = archive.infolist()[0].header_offset
    truncated = tmp_path / "truncated.tflite"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(BackendError, match=r"truncated.tflite: no metadata inside"):
        load_backend(truncated)
    corrupt = tmp_path / "corrupt.tflite"  # the metadata intact, the flatbuffer cut in the middle
    corrupt.write_bytes(data[: start // 2] + data[start:])
    with pytest.raises(BackendError, match=r"corrupt.tflite: not a readable TFLite model \("):
        load_backend(corrupt)
    bad = tmp_path / "bad.tflite"
    bad.write_bytes(data[:start])
    values = load_backend(exports).info.to_dict()
    with zipfile.ZipFile(bad, "a") as archive:
        archive.writestr("metadata.json", json.dumps(values | {"imgsz": [64, 64]}))
    with pytest.raises(BackendError, match=r"bad.tflite: not an exported yolo-trainer/YOLOv5 model \(metadata: 'imgsz' "
                                           r"\[64, 64\] and 'batch' 2 do not match the model's input shape "
                                           r"\[2, 3, 64, 96\]\)$"):
        load_backend(bad)
    monkeypatch.setattr(litert, "MAX_METADATA_CHARS", 100)  # an entry's size is checked before it is read
    with pytest.raises(BackendError, match=r"best.tflite: metadata.json holds \d+ bytes of metadata, more than 100$"):
        load_backend(exports)


def test_refused_flags_are_one_line(random_weights, capsys):
    weights = random_weights
    expected = {("--dynamic",): "--include litert: .tflite files have a fixed batch and input size here",
                ("--int8", "--half"): "--include litert: --int8 and --half are two precisions; pick one",
                ("--int8", "--include", "onnx"): "--int8: TorchScript, ONNX and OpenVINO exports are fp32"}
    for flags, start in expected.items():
        assert run_export(weights, "--include", "litert", *flags) == 2, flags
        assert capsys.readouterr().err.strip().startswith(f"export.py: error: {start}"), flags


def test_int8_without_calibration_images_is_refused_before_converting(random_weights, tmp_path, capsys):
    needs_litert()
    data = empty_dataset(tmp_path / "empty")
    assert run_export(random_weights, "--include", "litert", "--int8", "--data", str(data)) == 2
    assert capsys.readouterr().err.strip() == (f"export.py: error: --data {data}: no train images to calibrate --int8 "
                                               "with")


def test_missing_packages_are_named_with_the_install_command(random_weights, tmp_path, capsys, monkeypatch):
    source = random_weights
    monkeypatch.setitem(sys.modules, "litert_torch", None)  # import litert_torch now raises ImportError
    assert run_export(source, "--include", "tflite") == 1
    assert capsys.readouterr().err.strip() == ("export.py: error: --include litert needs the optional package "
                                               "'litert-torch': pip install -r requirements-litert.txt")
    assert sorted(p.name for p in source.parent.iterdir()) == ["best.pt"]
    model = tmp_path / "model.tflite"  # the identifier and the metadata are read before the runtime is needed
    model.write_bytes(b"\x1c\x00\x00\x00TFL3" + bytes(64))
    with zipfile.ZipFile(model, "a") as archive:
        archive.writestr("meta.txt", "{'stride': 32, 'names': ['a']}")
    monkeypatch.setitem(sys.modules, "ai_edge_litert.interpreter", None)
    with pytest.raises(MissingPackage, match=r"^running model.tflite needs the optional package 'ai-edge-litert': "
                                             r"pip install -r requirements-litert.txt$"):
        load_backend(model)


# --- val.py, detect.py and the hub on the exported file -----------------------------------------------------

def test_detect_and_hub_on_the_tflite_equal_the_same_shape_torchscript(exports, trained, tmp_path):
    """detect.py and the hub letterbox to the file's own 64x96 (val.py needs a square fixed-size export, or refuses
    in one line, as for ONNX)."""
    import val
    from utils.hub import load_hub_model

    images = trained[1].parent / "images" / "val"
    expected, got = (detect_labels(path, images, (HEIGHT, WIDTH), tmp_path / "detect", name)
                     for name, path in (("torchscript", exports.with_suffix(".torchscript")), ("tflite", exports)))
    check_same_labels(expected, got, 1.0 / 96 + 1e-6)  # whole pixels of 96x112 images
    hub = load_hub_model(exports)
    hub.conf, hub.amp = 0.001, "off"
    detections = hub(str(sorted(images.iterdir())[0]), size=(HEIGHT, WIDTH)).xyxy[0]
    assert type(hub.model).__name__ == "LiteRtBackend" and len(detections)
    with pytest.raises(Exception, match=r"exported for 64x96 inputs; val.py needs a square or a --dynamic export"):
        val.run(data=trained[1], weights=str(exports), imgsz=64, batch_size=4, workers=0, plots=False, device="cpu")


def test_val_on_a_square_tflite_equals_the_same_shape_torchscript(trained, tmp_path):
    import val

    needs_litert()
    weights, data = trained
    source = copy_weights(weights, tmp_path)
    assert export.main(["--weights", str(source), "--imgsz", "64", "--batch-size", "2", "--include", "litert",
                        "torchscript"]) == 0
    results = [val.run(data=data, weights=str(source.with_suffix(suffix)), imgsz=64, batch_size=4, workers=0,
                       plots=False, project=tmp_path / "val", device="cpu", amp="off")
               for suffix in (".torchscript", ".tflite")]
    reference, exported = results
    assert reference.seen == 4
    for metric in ("mp", "mr", "map50", "map"):
        assert getattr(exported, metric) == pytest.approx(getattr(reference, metric), abs=0.001), metric
