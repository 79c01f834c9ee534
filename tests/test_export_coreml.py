"""export.py --include coreml (models/formats/coreml.py): the ``.mlpackage``, its metadata, the check that opens the
written package back (input, output, precision, metadata: Core ML cannot run off Apple platforms, so this is the
export's check here), batch > 1 and a non-square size, the flags it refuses, one-line errors for broken or foreign
packages, and the one line val.py / detect.py / the hub give for a package on Linux. Skipped by name without the
optional coremltools package, except the tests of the messages that name it."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import re
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import export
from models import for_inference, load_model
from models.backends import BackendError, ExportInfo, load_backend
from tests.conftest import make_tiny_dataset, save_random_checkpoint
from utils.errors import ArgumentError, Unavailable

NAMES = ["cat", "dog"]
IMGSZ = 64
INSTALL = "pip install -r requirements-coreml.txt"
APPLE_ONLY = "CoreML runs on Apple platforms only (macOS/iOS): "
off_apple = pytest.mark.skipif(sys.platform == "darwin", reason="checks what happens where Core ML does not exist")


def needs_coremltools():
    if importlib.util.find_spec("coremltools") is None:
        pytest.skip(f"could not import 'coremltools': optional ({INSTALL})")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("coreml") / "best.pt", NAMES)


def copy_weights(weights: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(weights, folder / "best.pt"))


def run_export(weights: Path, *flags: str, imgsz=(IMGSZ,)) -> int:
    return export.main(["--weights", str(weights), "--imgsz", *map(str, imgsz), "--include", "coreml", *flags])


def check_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("CoreML check: ")]


def package_files(package: Path) -> list[str]:
    return sorted(str(path.relative_to(package)) for path in package.rglob("*") if path.is_file())


def coreml_temp_packages() -> set:
    """What coremltools leaves in the system temp folder (it converts into a temporary .mlpackage there)."""
    return set(Path(tempfile.gettempdir()).glob("*.mlpackage"))


@contextlib.contextmanager
def logged_lines(*names: str):
    """The INFO lines the loggers ``names`` give meanwhile (a module fixture cannot use capsys or caplog)."""
    lines, loggers = [], [logging.getLogger(name) for name in names]
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
    try:
        yield lines
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)


@pytest.fixture(scope="module")
def package(weights, tmp_path_factory):
    """best.mlpackage exported at 64x64, batch 1, fp32 (export.run); (package, its log lines, temp packages before)."""
    needs_coremltools()
    source = copy_weights(weights, tmp_path_factory.mktemp("square"))
    before = coreml_temp_packages()
    with logged_lines("export", "models.formats.coreml") as lines:
        export.run(export.ExportConfig(weights=str(source), imgsz=(IMGSZ, IMGSZ), include=("coreml",)))
    return source.with_suffix(".mlpackage"), "\n".join(lines), before


def test_export_writes_a_checked_mlpackage_with_metadata(package, weights):
    path, out, temp_before = package
    assert sorted(p.name for p in path.parent.iterdir()) == ["best.mlpackage", "best.pt"]  # no temp package left
    assert package_files(path) == ["Data/com.apple.CoreML/model.mlmodel", "Data/com.apple.CoreML/weights/weight.bin",
                                   "Manifest.json"]
    assert coreml_temp_packages() <= temp_before  # coremltools' own temporary package was removed too
    eager = for_inference(load_model(weights))
    with torch.no_grad():
        anchors = eager(torch.rand(1, 3, IMGSZ, IMGSZ))[0].shape[1]
    assert check_lines(out) == [f"CoreML check: best.mlpackage opened with coremltools: ML Program (spec 6), fp32 "
                                f"compute, images 1x3x64x64 -> output0 1x{anchors}x7 float32, metadata 2 classes, "
                                "stride 32, imgsz 64x64"]
    size = sum((path / name).stat().st_size for name in package_files(path)) / 1e6
    assert f"CoreML: saved {path} ({size:.1f} MB) in " in out and size > 0.5  # the weights, counted in subfolders
    from models.formats.coreml import read_package

    spec, metadata = read_package(path)
    assert metadata == {"format": "yolo-trainer-export/1", "names": NAMES, "nc": 2, "stride": 32,
                        "imgsz": [IMGSZ, IMGSZ], "batch": 1, "dynamic": False, "half": False, "int8": False,
                        "channels_last": True,
                        "device": "cpu"}
    assert json.loads(spec.description.metadata.userDefined["names"]) == NAMES  # JSON per key, as in ONNX files


def test_non_square_batch_export_replaces_an_earlier_package(package, weights, tmp_path, capsys):
    source = copy_weights(weights, tmp_path)
    target = tmp_path / "best.mlpackage"
    shutil.copytree(package[0], target)  # the 64x64 batch-1 package, replaced whole
    assert run_export(source, "--batch-size", "2", imgsz=(64, 96)) == 0
    line = check_lines(capsys.readouterr().out)[0]
    assert "images 2x3x64x96 -> output0 2x378x7 float32" in line and "imgsz 64x96" in line  # 3 anchors x 126 cells
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.mlpackage", "best.pt"]  # nor the old one aside
    from models.formats.coreml import describe, read_package

    spec, metadata = read_package(target)
    assert describe(spec) == (("images", "FLOAT32", [2, 3, 64, 96]), ("output0", "FLOAT32", [2, 378, 7]))
    assert (metadata["imgsz"], metadata["batch"]) == ([64, 96], 2)


def test_half_converts_with_fp16_compute(package, weights, tmp_path, capsys):
    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--half") == 0  # on the CPU: coremltools converts, the device computes in fp16
    assert ", fp16 compute, images 1x3x64x64" in check_lines(capsys.readouterr().out)[0]
    from models.formats.coreml import count_fp16_tensors, read_package

    spec, metadata = read_package(tmp_path / "best.mlpackage")
    assert metadata["half"] is True and count_fp16_tensors(spec) > 100
    assert count_fp16_tensors(read_package(package[0])[0]) == 0
    weight = "Data/com.apple.CoreML/weights/weight.bin"
    assert (tmp_path / "best.mlpackage" / weight).stat().st_size < 0.6 * (package[0] / weight).stat().st_size


def test_a_package_that_differs_from_the_export_is_an_error_and_not_written(weights, tmp_path, capsys, monkeypatch):
    needs_coremltools()
    from models.formats import coreml

    source = copy_weights(weights, tmp_path)
    monkeypatch.setattr(coreml, "count_fp16_tensors", lambda spec: 12)  # as if the fp32 conversion came out fp16
    assert run_export(source) == 1
    assert capsys.readouterr().err.strip() == (f"export.py: error: {tmp_path / 'best.mlpackage'}: the Core ML program "
                                               "has 12 fp16 tensors, exported without --half; not written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]


def test_check_package_compares_shapes_and_metadata(package, tmp_path):
    from models.formats.coreml import CoreMLError, check_package

    path = package[0]
    info = ExportInfo(names=tuple(NAMES), stride=32, imgsz=(IMGSZ, IMGSZ), batch=1, channels_last=True, device="cpu")
    assert check_package(path, info, (1, 3, 64, 64), (1, 252, 7)).startswith("best.mlpackage opened with coremltools")
    with pytest.raises(CoreMLError, match=r"has input \('images', 'FLOAT32', \[1, 3, 64, 64\]\) and output "
                                          r"\('output0', 'FLOAT32', \[1, 252, 7\]\), exported as .*\[2, 252, 7\]"):
        check_package(path, info, (1, 3, 64, 64), (2, 252, 7))
    other = ExportInfo(names=("a", "b"), stride=32, imgsz=(IMGSZ, IMGSZ), batch=1, channels_last=True, device="cpu")
    with pytest.raises(CoreMLError, match=r"best.mlpackage: the metadata read back .* differs from the export's"):
        check_package(path, other, (1, 3, 64, 64), (1, 252, 7))


def test_flags_coreml_cannot_honour_are_one_line_refusals(weights, tmp_path, capsys):
    needs_coremltools()
    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--dynamic") == 2
    assert capsys.readouterr().err.strip() == (
        "export.py: error: --include coreml: the package has a fixed input shape here (flexible shapes cannot be "
        "checked off Apple platforms); export without --dynamic")
    from models.formats import coreml

    with pytest.raises(ArgumentError, match=r"^--include coreml --int8: not supported .*; export fp32 or --half$"):
        coreml.check_options(SimpleNamespace(dynamic=False, int8=True), torch.device("cpu"))
    with pytest.raises(ArgumentError, match=r"converts on the CPU: use --device cpu \(not cuda\)$"):
        coreml.check_options(SimpleNamespace(dynamic=False), torch.device("cuda"))
    if "int8" in export.ExportConfig.__dataclass_fields__:  # export.py's --int8 (LiteRT's) reaches this refusal
        assert export.main(["--weights", str(source), "--include", "coreml", "--int8"]) == 2
        assert capsys.readouterr().err.startswith("export.py: error: --include coreml --int8: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]


@off_apple
def test_loading_a_package_off_apple_platforms_is_one_line(package, tmp_path, capsys):
    import detect
    import hubconf
    import val

    path = package[0]
    with pytest.raises(Unavailable, match=rf"^{re.escape(APPLE_ONLY)}{re.escape(str(path))} cannot run on linux; "
                                          r"export --include onnx, openvino or ncnn to run here$"):
        load_backend(path)
    with pytest.raises(Unavailable, match=re.escape(APPLE_ONLY)):
        hubconf.custom(path=str(path), device="cpu")
    data = make_tiny_dataset(tmp_path / "data", num_train=1, num_val=1)
    assert val.main(["--weights", str(path), "--data", str(data), "--imgsz", str(IMGSZ), "--device", "cpu"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"val.py: error: {APPLE_ONLY}{path} cannot run on " \
        "linux; export --include onnx, openvino or ncnn to run here"
    images = tmp_path / "data" / "images" / "val"
    assert detect.main(["--weights", str(path), "--source", str(images), "--device", "cpu"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"detect.py: error: {APPLE_ONLY}")


def test_broken_and_foreign_packages_are_one_line_errors(package, tmp_path):
    from models.formats.coreml import read_package

    def broken(name: str, change) -> Path:
        path = tmp_path / name
        shutil.copytree(package[0], path)
        change(path)
        return path

    def fails(path: Path, pattern: str, reader=read_package) -> None:
        with pytest.raises(BackendError, match=pattern) as caught:
            reader(path)
        assert "\n" not in str(caught.value)

    foreign = tmp_path / "foreign.mlpackage"
    foreign.mkdir()
    (foreign / "model.onnx").write_bytes(b"\x08\x07")
    fails(foreign, r"foreign.mlpackage: not a Core ML package \(no Manifest.json inside\)$")
    fails(foreign, r"foreign.mlpackage: not a Core ML package \(no Manifest.json inside\)$", reader=load_backend)
    spec_file = "Data/com.apple.CoreML/model.mlmodel"
    fails(broken("garbage.mlpackage", lambda p: (p / spec_file).write_bytes(b"\xff" * 300)),
          r"garbage.mlpackage: not a readable Core ML package \(")
    fails(broken("nomanifest.mlpackage", lambda p: (p / "Manifest.json").write_text("{not json")),
          r"nomanifest.mlpackage: not a readable Core ML package \(")
    fails(broken("noweights.mlpackage", lambda p: (p / "Data/com.apple.CoreML/weights/weight.bin").unlink()),
          r"noweights.mlpackage: not a readable Core ML package \(its weights file weight.bin is missing\)$")
    import coremltools as ct

    from models.formats.coreml import quiet_coremltools

    with quiet_coremltools():
        model = ct.models.MLModel(str(package[0]), skip_model_load=True)
        model.user_defined_metadata["stride"] = "7"  # not a divisor of the input size
        model.save(str(tmp_path / "tampered.mlpackage"))
    from models.formats.coreml import check_package

    info = ExportInfo(names=tuple(NAMES), stride=32, imgsz=(IMGSZ, IMGSZ), batch=1, channels_last=True, device="cpu")
    with pytest.raises(BackendError, match=r"tampered.mlpackage: not an exported yolo-trainer/YOLOv5 model "
                                           r"\(metadata: 'imgsz' must be .*multiples of the stride 7"):
        check_package(tmp_path / "tampered.mlpackage", info, (1, 3, 64, 64), (1, 252, 7))


def test_output_path_taken_by_a_file_is_refused_before_converting(weights, tmp_path, capsys):
    needs_coremltools()
    source = copy_weights(weights, tmp_path)
    (tmp_path / "best.mlpackage").write_text("a file, not a package")
    assert run_export(source) == 1
    assert capsys.readouterr().err.strip() == (f"export.py: error: {tmp_path / 'best.mlpackage'}: exists and is not "
                                               "a Core ML package; move it away to export here")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.mlpackage", "best.pt"]


def test_missing_coremltools_is_named_with_the_install_command(weights, tmp_path, capsys, monkeypatch):
    source = copy_weights(weights, tmp_path)
    monkeypatch.setitem(sys.modules, "coremltools", None)  # import coremltools now raises ImportError
    assert run_export(source) == 1
    assert capsys.readouterr().err.strip() == ("export.py: error: --include coreml needs the optional package "
                                               f"'coremltools': {INSTALL}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]
    folder = tmp_path / "model.mlpackage"
    folder.mkdir()
    (folder / "Manifest.json").write_text("{}")
    from models.formats.coreml import read_package

    with pytest.raises(BackendError, match=rf"^reading model.mlpackage needs the optional package 'coremltools': "
                                           rf"{INSTALL}$"):
        read_package(folder)
