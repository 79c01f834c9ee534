"""export.py --include ncnn and the NCNN backend (models/formats/ncnn.py): the ``_ncnn_model`` folder and its
metadata, parity with the PyTorch model (fp32, --half, batches run image by image, a non-square size), the flags
NCNN refuses, folder detection against OpenVINO, val.py / detect.py / the hub on the folder, and one-line errors.
Skipped by name without the optional pnnx and ncnn packages, except the tests of the messages that name them."""
from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

import export
from models import for_inference, load_model
from models.backends import BackendError, OpenVinoBackend, _backend_class, load_backend
from tests.conftest import make_tiny_dataset, save_random_checkpoint
from tests.export_helpers import (INT8_PARITY, check_int8_export, check_same_labels, copy_weights, detect_labels,
                                  eager_output, label_rows, max_differences)
from utils.errors import ArgumentError

NAMES = ["cat", "dog"]
IMGSZ = 64
FILES = ["metadata.yaml", "model.ncnn.bin", "model.ncnn.param"]
INSTALL = "pip install -r requirements-ncnn.txt"


def needs_ncnn():
    for name in ("pnnx", "ncnn"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"could not import '{name}': optional ({INSTALL})")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("ncnn") / "best.pt", NAMES)


@pytest.fixture(scope="module")
def eager(weights):
    return for_inference(load_model(weights))


def run_export(weights: Path, *flags: str, imgsz=(IMGSZ,)) -> int:
    return export.main(["--weights", str(weights), "--imgsz", *map(str, imgsz), "--include", "ncnn", *flags])


def parity_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("NCNN parity: max |diff| ")]


@pytest.fixture(scope="module")
def square_export(weights, tmp_path_factory):
    """export.run at 64x64: best_ncnn_model/, and best.torchscript (the same static input size, so val.py and detect.py
    letterbox both alike: their reference); (folder, torchscript file, the NCNN ExportResult)."""
    needs_ncnn()
    source = copy_weights(weights, tmp_path_factory.mktemp("square"))
    config = export.ExportConfig(weights=str(source), imgsz=(IMGSZ, IMGSZ), include=("ncnn", "torchscript"))
    results = export.run(config)
    return source.parent / "best_ncnn_model", source.with_suffix(".torchscript"), results[0]


@pytest.fixture(scope="module")
def square_folder(square_export):
    return square_export[0]


def test_export_writes_the_ncnn_layout_with_metadata_and_parity(square_export):
    folder, _, result = square_export
    assert sorted(p.name for p in folder.parent.iterdir()) == ["best.pt", "best.torchscript", "best_ncnn_model"]
    assert sorted(p.name for p in folder.iterdir()) == FILES  # no temp folder, nor pnnx's intermediate files, left
    assert (result.format, result.path) == ("ncnn", folder)
    assert result.megabytes == sum(p.stat().st_size for p in folder.iterdir()) / 1e6
    assert len(result.parity) == 1 and result.parity[0].ok
    assert "at 1x3x64x64; tolerance 0.064 px, 0.001" in result.parity[0].describe()
    assert (folder / "model.ncnn.param").read_text().startswith("7767517\n")
    metadata = yaml.safe_load((folder / "metadata.yaml").read_text())
    assert metadata == {"format": "yolo-trainer-export/1", "names": NAMES, "nc": 2, "stride": 32,
                        "imgsz": [IMGSZ, IMGSZ], "batch": 1, "dynamic": False, "half": False, "int8": False,
                        "channels_last": True,
                        "device": "cpu"}
    from models.formats.ncnn import NcnnBackend

    for path in (folder, folder / "model.ncnn.param"):  # the folder or its .param
        backend = load_backend(path)
        assert type(backend) is NcnnBackend and backend.kind == "ncnn"
        assert (backend.names, backend.nc, backend.stride, backend.imgsz, backend.dynamic, backend.info.batch) == \
            (NAMES, 2, 32, (IMGSZ, IMGSZ), False, 1)


def test_square_export_matches_eager_on_batches_and_refuses_other_sizes(square_folder, eager):
    backend = load_backend(square_folder)
    images = torch.rand(3, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(1))
    pred, raw = backend(images)  # three images, run one at a time
    assert raw == [] and pred.shape == (3, 252, 7)
    boxes, scores = max_differences(pred, eager_output(eager, images))
    assert boxes <= 1e-3 * IMGSZ and scores <= 1e-3
    one = backend(images[1:2])[0]  # an image's output does not depend on the others in its batch
    assert torch.equal(one[0], pred[1])
    with pytest.raises(BackendError, match=r"exported for 64x64 inputs, got 96x64; export with --dynamic"):
        backend(torch.rand(2, 3, 96, 64))


def test_non_square_batch_export_is_checked_image_by_image_and_matches_eager(weights, eager, tmp_path, capsys):
    needs_ncnn()
    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--batch-size", "2", imgsz=(64, 96)) == 0  # height 64, width 96
    out = capsys.readouterr().out
    folder = tmp_path / "best_ncnn_model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "best_ncnn_model"]
    size = sum(p.stat().st_size for p in folder.iterdir()) / 1e6
    assert any(line.startswith(f"NCNN: saved {folder} ({size:.1f} MB) in ") for line in out.splitlines()), out
    assert "NCNN takes one image at a time: exported for batch 1, batches of 2 run image by image" in out
    parity = parity_lines(out)
    assert len(parity) == 1 and "at 2x3x64x96; tolerance 0.096 px, 0.001" in parity[0]  # two images, one by one
    backend = load_backend(folder)
    assert (backend.imgsz, backend.info.batch) == ((64, 96), 1)
    images = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(3))
    boxes, scores = max_differences(backend(images)[0], eager_output(eager, images))
    assert boxes <= 1e-3 * 96 and scores <= 1e-3
    with pytest.raises(BackendError, match=r"exported for 64x96 inputs, got 96x64"):
        backend(torch.rand(1, 3, 96, 64))


def test_half_stores_fp16_weights_on_the_cpu_within_the_fp16_tolerance(weights, eager, square_folder, tmp_path,
                                                                         capsys):
    needs_ncnn()
    import ncnn

    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--half") == 0  # no GPU needed: the weights are stored in fp16
    out = capsys.readouterr().out
    assert "tolerance 0.64 px, 0.01" in parity_lines(out)[0]
    if not ncnn.cpu_support_arm_asimdhp():
        assert "this CPU has no fp16 arithmetic, so ncnn computes in fp32 (the weights rounded to fp16)" in out
    folder = tmp_path / "best_ncnn_model"
    assert yaml.safe_load((folder / "metadata.yaml").read_text())["half"] is True
    fp32_bytes = (square_folder / "model.ncnn.bin").stat().st_size
    assert (folder / "model.ncnn.bin").stat().st_size < 0.6 * fp32_bytes
    images = torch.rand(2, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(5))
    boxes, scores = max_differences(load_backend(folder)(images)[0], eager_output(eager, images))
    assert boxes <= 1e-2 * IMGSZ and scores <= 1e-2


def test_flags_ncnn_cannot_honour_are_one_line_refusals(weights, tmp_path, capsys):
    needs_ncnn()
    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--dynamic") == 2
    assert capsys.readouterr().err.strip() == (
        "export.py: error: --include ncnn: NCNN models have a fixed input size (the decode grids become constants; "
        "pnnx leaves the dynamic grid's arange/meshgrid to ops ncnn lacks); export without --dynamic")
    assert export.main(["--weights", str(source), "--include", "ncnn", "torchscript", "--half"]) == 2
    assert "--half needs a CUDA device (--device 0) for TorchScript and ONNX" in capsys.readouterr().err
    from models.formats import ncnn as ncnn_format

    with pytest.raises(ArgumentError, match=r"^--include ncnn: --int8 and --half are two precisions; pick one$"):
        ncnn_format.check_options(SimpleNamespace(dynamic=False, int8=True, half=True), torch.device("cpu"))
    with pytest.raises(ArgumentError, match=r"exports and runs on the CPU: use --device cpu \(not cuda\)"):
        ncnn_format.check_options(SimpleNamespace(dynamic=False, int8=False, half=False), torch.device("cuda"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]


@pytest.fixture(scope="module")
def trained(request):
    """(weights, data.yaml): conftest's int8_trained, trained only where pnnx and ncnn are installed."""
    needs_ncnn()
    return request.getfixturevalue("int8_trained")


def test_int8_quantises_the_body_calibrated_on_the_data_and_tracks_the_model(trained, tmp_path, capsys):
    """int8 convolutions up to the Detect layer (1 byte per weight), the Detect convolutions and the decode float:
    scores not collapsed, boxes in pixels, the metadata saying int8, checked on calibration images."""
    weights, data = trained
    height, width = 64, 96
    source = copy_weights(weights, tmp_path)
    # with a format that takes no --int8 beside it (YOLOv5's `--include torchscript onnx tflite --int8`): that one float
    assert run_export(source, "--int8", "--data", str(data), "--include", "torchscript", "ncnn",
                      imgsz=(height, width)) == 0
    out = capsys.readouterr().out
    assert "--int8 quantises NCNN; TorchScript exported without it (float)" in out
    assert "NCNN --int8: calibrated" in out and "convolutions on 16 images" in out, out
    int8_lines = [line.removeprefix("NCNN parity: ") for line in out.splitlines() if line.startswith("NCNN parity: ")]
    assert len(int8_lines) == 1 and re.match(INT8_PARITY, int8_lines[0]), out  # on 8 calibration images
    assert re.search(r"^TorchScript parity: max \|diff\| ", out, re.M), out  # the float check, not the int8 one
    assert not load_backend(tmp_path / "best.torchscript").info.int8
    folder = tmp_path / "best-int8_ncnn_model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-int8_ncnn_model", "best.pt", "best.torchscript"]
    lines = (folder / "model.ncnn.param").read_text().splitlines()
    convolutions = [line for line in lines if line.startswith("Convolution ")]
    int8_lines = [line for line in convolutions if line.endswith(" 8=1")]
    assert len(int8_lines) == len(convolutions) - 3  # all but the Detect layer's three
    check_int8_export(folder, weights, data, height, width, stored=folder / "model.ncnn.bin")


def test_an_export_that_differs_is_an_error_and_not_written(weights, tmp_path, capsys, monkeypatch):
    needs_ncnn()
    from models.formats.ncnn import NcnnBackend

    source = copy_weights(weights, tmp_path)
    wrong = NcnnBackend._run_one
    monkeypatch.setattr(NcnnBackend, "_run_one", lambda self, image: wrong(self, image) + 0.5)
    assert run_export(source) == 1
    assert re.match(r"export.py: error: .*best_ncnn_model: the NCNN model differs from the PyTorch model: .*"
                    r"not written$", capsys.readouterr().err.strip())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]


def test_a_failed_conversion_is_one_line_and_leaves_nothing(weights, tmp_path, capsys, monkeypatch):
    needs_ncnn()
    import pnnx

    fake = tmp_path / "fake-pnnx"
    fake.write_text("#!/bin/sh\necho 'pass_level2'\necho 'unsupported op aten::foo' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(pnnx, "EXEC_PATH", str(fake))
    source = copy_weights(weights, tmp_path / "weights")
    assert run_export(source) == 1
    assert capsys.readouterr().err.strip() == ("export.py: error: pnnx could not convert the model to NCNN "
                                               "(unsupported op aten::foo)")  # its last complaint, not its progress
    assert sorted(p.name for p in source.parent.iterdir()) == ["best.pt"]


def test_reexport_replaces_the_model_files_and_keeps_others(weights, tmp_path):
    needs_ncnn()
    source = copy_weights(weights, tmp_path)
    folder = tmp_path / "best_ncnn_model"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "model.ncnn.param").write_text("old")
    assert run_export(source) == 0
    assert sorted(p.name for p in folder.iterdir()) == FILES + ["notes.txt"]
    assert (folder / "notes.txt").read_text() == "mine"
    assert load_backend(folder).names == NAMES


def test_folders_are_told_apart_by_their_files(tmp_path):
    """An NCNN folder holds model.ncnn.param, whatever its name; any other folder is taken for OpenVINO's."""
    ncnn_folder = tmp_path / "best_openvino_model"  # named like OpenVINO's, holding NCNN's files
    ncnn_folder.mkdir()
    (ncnn_folder / "model.ncnn.param").write_text("7767517\n")
    openvino_folder = tmp_path / "best_ncnn_model"
    openvino_folder.mkdir()
    (openvino_folder / "best.xml").write_text("<net/>")
    assert _backend_class(ncnn_folder).__name__ == "NcnnBackend"
    assert _backend_class(openvino_folder) is OpenVinoBackend
    assert _backend_class(ncnn_folder / "model.ncnn.param").__name__ == "NcnnBackend"


def test_corrupt_and_foreign_files_are_one_line_errors(square_folder, tmp_path, capfd):
    def broken(name: str, change) -> Path:
        folder = tmp_path / name
        shutil.copytree(square_folder, folder)
        change(folder)
        return folder

    def fails(folder: Path, pattern: str) -> None:
        with pytest.raises(BackendError, match=pattern) as caught:
            load_backend(folder)
        assert "\n" not in str(caught.value)

    param = "model.ncnn.param"
    fails(broken("foreign", lambda f: (f / param).write_text("hello world\n")),
          r"foreign/model.ncnn.param: not an NCNN model \(no 7767517 magic number on the first line\)$")
    fails(broken("binary", lambda f: (f / param).write_bytes(bytes(range(256)) * 4)),
          r"binary/model.ncnn.param: not an NCNN model \(not a text .param file\)$")
    lines = (square_folder / param).read_text().splitlines()
    fails(broken("cut", lambda f: (f / param).write_text("\n".join(lines[: len(lines) // 2]) + "\n")),
          r"cut/model.ncnn.param: not an NCNN model \(the header says \d+ layers, the file has \d+ layer lines\)$")
    fails(broken("huge", lambda f: (f / param).write_text(f"7767517\n2000000000 1\n{lines[2]}\n")),
          r"not an NCNN model \(2000000000 layers and 1 blobs\)$")
    bad_line = [*lines[:3], "Convolution conv 9 1 x", *lines[4:]]
    fails(broken("badline", lambda f: (f / param).write_text("\n".join(bad_line) + "\n")),
          r"not an NCNN model \(line 4 is not '<type> <name> <inputs> <outputs> <blobs...> <params...>'\)$")
    def with_line_4(folder: Path, line: str) -> None:
        (folder / param).write_text("\n".join([*lines[:3], line, *lines[4:]]) + "\n")

    fails(broken("unknown", lambda f: with_line_4(f, lines[3].replace("Convolution ", "Convolution3000 ", 1))),
          r"unknown/model.ncnn.param: not an NCNN model this ncnn can run \(layer type Convolution3000 unknown to "
          r"it\)$")
    for name, word in (("badword", "0=x"), ("bigid", "40=1"), ("negative", "-5=1"), ("array", "-23300=3,1,2"),
                       ("longvalue", "0=" + "1" * 16)):
        fails(broken(name, lambda f: with_line_4(f, f"{lines[3]} {word}")),
              rf"{name}/model.ncnn.param: not an NCNN model \(line 4 has a parameter ncnn cannot read: {word}\)$")
    words = lines[3].split()  # a layer reading blob in0 (the input), making one blob
    fails(broken("unmade", lambda f: with_line_4(f, " ".join([*words[:4], "nosuchblob", *words[5:]]))),
          r"not an NCNN model \(line 4 reads blob nosuchblob, which no earlier layer makes\)$")
    fails(broken("twice", lambda f: with_line_4(f, " ".join([*words[:5], "in0", *words[6:]]))),
          r"not an NCNN model \(line 4 makes a blob that already exists\)$")
    few_blobs = lines[1].split()[0] + " 3"
    fails(broken("fewblobs", lambda f: (f / param).write_text("\n".join([lines[0], few_blobs, *lines[2:]]) + "\n")),
          r"not an NCNN model \(the header says 3 blobs, the layers make \d+\)$")
    weights = (square_folder / "model.ncnn.bin").read_bytes()
    size = len(weights)
    fails(broken("truncated", lambda f: (f / "model.ncnn.bin").write_bytes(weights[: size // 3])),
          rf"truncated: not a readable NCNN model \(model.ncnn.bin holds {size // 3:,} bytes, the layers of "
          rf"model.ncnn.param read {size:,}\)$")
    fails(broken("longer", lambda f: (f / "model.ncnn.bin").write_bytes(weights + bytes(8))),
          rf"longer: not a readable NCNN model \(model.ncnn.bin holds {size + 8:,} bytes, the layers of "
          rf"model.ncnn.param read {size:,}\)$")
    fails(broken("nobin", lambda f: (f / "model.ncnn.bin").unlink()),
          r"nobin/model.ncnn.param: no weights file model.ncnn.bin beside it$")
    fails(broken("nometa", lambda f: (f / "metadata.yaml").unlink()),
          r"nometa/model.ncnn.param: no metadata file metadata.yaml beside it \(export.py writes it with the model\)$")
    fails(broken("badmeta", lambda f: (f / "metadata.yaml").write_text("names: [a, b]\nstride: 7\nimgsz: [64, 64]\n")),
          r"badmeta/metadata.yaml: not an exported yolo-trainer/YOLOv5 model \(metadata: 'imgsz' must be")
    fails(broken("nometa_names", lambda f: (f / "metadata.yaml").write_text("stride: 32\n")),
          r"metadata: missing 'names'\)$")
    assert capfd.readouterr().err == ""  # refused before ncnn could complain on stderr


def test_loading_leaves_the_process_stderr_alone(square_folder, monkeypatch):
    """Nothing redirects file descriptor 2 while ncnn loads (another thread's errors would vanish meanwhile): the
    files are checked first and the weights go through a reader of ours."""
    redirects = []
    monkeypatch.setattr("os.dup2", lambda *args, **kwargs: redirects.append(args))
    backend = load_backend(square_folder)
    assert redirects == [] and backend.names == NAMES


def test_missing_packages_are_named_with_the_install_command(weights, tmp_path, capsys, monkeypatch):
    source = copy_weights(weights, tmp_path)
    monkeypatch.setitem(sys.modules, "pnnx", None)  # import pnnx now raises ImportError
    assert run_export(source) == 1
    assert capsys.readouterr().err.strip() == ("export.py: error: --include ncnn needs the optional package 'pnnx': "
                                               f"{INSTALL}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]
    folder = tmp_path / "model_ncnn_model"
    folder.mkdir()
    (folder / "model.ncnn.param").write_text("7767517\n1 1\nInput in0 0 1 in0\n")
    (folder / "model.ncnn.bin").write_bytes(b"")
    (folder / "metadata.yaml").write_text("names: [a]\nstride: 32\nimgsz: [64, 64]\n")
    monkeypatch.setitem(sys.modules, "ncnn", None)
    with pytest.raises(BackendError, match=rf"^running model_ncnn_model needs the optional package 'ncnn': {INSTALL}$"):
        load_backend(folder)


# --- val.py, detect.py and the hub on the folder ---------------------------------------------------------

@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("ncnn-val")
    return root, make_tiny_dataset(root / "data", num_train=1, num_val=6)


def test_val_on_the_ncnn_folder_equals_the_static_torchscript(square_export, dataset):
    import val

    folder, reference_file, _ = square_export
    root, data = dataset
    results = [val.run(data=data, weights=str(path), imgsz=IMGSZ, batch_size=4, workers=0, plots=False,
                       save_txt=True, save_conf=True, project=root / "val", device="cpu", amp="off")
               for path in (reference_file, folder)]
    reference, exported = results
    assert reference.seen == exported.seen == 6
    for metric in ("mp", "mr", "map50", "map"):
        assert getattr(exported, metric) == pytest.approx(getattr(reference, metric), abs=0.001), metric
    expected, got = label_rows(reference.save_dir), label_rows(exported.save_dir)
    assert expected and got.keys() == expected.keys()
    for name, rows in expected.items():
        assert np.allclose(got[name], rows, atol=1e-3), name


def test_detect_and_the_hub_on_the_ncnn_folder_give_the_static_torchscripts_boxes(square_export, dataset):
    import detect
    import hubconf

    folder, reference_file, _ = square_export
    root, data = dataset
    images = root / "data" / "images" / "val"
    expected, got = (detect_labels(path, images, (IMGSZ,), root / "detect", name)
                     for name, path in (("torchscript", reference_file), ("ncnn", folder)))
    check_same_labels(expected, got, 1e-3)
    files = sorted(images.iterdir())[:2]
    model = hubconf.custom(path=str(folder), device="cpu")  # the hub (and the API) load the folder as detect.py does
    model.conf, model.amp, model.max_det = 0.001, "off", 20
    results = model([str(path) for path in files], size=IMGSZ)
    assert results.names == dict(enumerate(NAMES)) and model.imgsz == (IMGSZ, IMGSZ)
    expected = detect.run(weights=folder, source=images, imgsz=IMGSZ, device="cpu", amp="off", conf_thres=0.001,
                          max_det=20, nosave=True, project=root / "detect", name="api").detections
    for index, path in enumerate(files):  # the hub's boxes are not rounded (YOLOv5's AutoShape); detect.py's are
        rounded = [found._replace(xyxy=tuple(float(round(v)) for v in found.xyxy)) for found in results.detections[index]]
        assert expected[str(path)] and rounded == expected[str(path)]
