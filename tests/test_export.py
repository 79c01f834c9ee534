"""export.py and models/backends.py: TorchScript / ONNX exports of a tiny model, parity with the PyTorch
model, dynamic shapes, metadata inside the files, and one-line errors for bad input."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

import export
from models import for_inference, load_model
from models.backends import (METADATA_KEYS, TORCHSCRIPT_METADATA, BackendError, OnnxBackend, PyTorchBackend,
                             TorchScriptBackend, load_backend)
from tests.conftest import save_random_checkpoint
from tests.export_helpers import copy_weights, eager_output
from utils.errors import ArgumentError

NAMES = ["cat", "dog"]
IMGSZ = 64


def onnx_available() -> bool:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


# TorchScript needs nothing optional: it is always tested; ONNX when onnx and onnxruntime are installed
FORMATS = ("torchscript", "onnx") if onnx_available() else ("torchscript",)
SUFFIXES = tuple(export.SUFFIXES[fmt] for fmt in FORMATS)


def save_tiny(path: Path, seed: int = 0) -> Path:
    return save_random_checkpoint(path, NAMES, seed=seed)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("export") / "best.pt")


@pytest.fixture(scope="module")
def eager(weights):
    return for_inference(load_model(weights))


def run_export(weights: Path, *flags: str) -> int:
    return export.main(["--weights", str(weights), "--imgsz", str(IMGSZ), *flags])


def assert_close(exported: torch.Tensor, reference: torch.Tensor, size: int) -> None:
    """Within export.py's fp32 tolerance: 1e-3 of the image size on boxes, 1e-3 on scores."""
    assert exported.shape == reference.shape
    assert (exported[..., :4] - reference[..., :4]).abs().max() <= 1e-3 * size
    assert (exported[..., 4:] - reference[..., 4:]).abs().max() <= 1e-3


def one_error_line(capsys, script: str = "export.py") -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{script}: error: "), err
    return err[0]


@pytest.fixture(scope="module")
def static_files(weights, tmp_path_factory):
    """best.torchscript (and best.onnx) exported at 64x64, batch 2 (static shapes)."""
    source = copy_weights(weights, tmp_path_factory.mktemp("static"))
    assert run_export(source, "--include", *FORMATS, "--batch-size", "2") == 0
    return [source.with_suffix(suffix) for suffix in SUFFIXES]


@pytest.fixture(scope="module")
def dynamic_files(weights, tmp_path_factory):
    source = copy_weights(weights, tmp_path_factory.mktemp("dynamic"))
    assert run_export(source, "--include", *FORMATS, "--dynamic") == 0
    return [source.with_suffix(suffix) for suffix in SUFFIXES]


def onnx_file(files) -> Path:
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    return files[1]


def test_export_writes_both_formats_beside_the_weights_with_summary_and_parity(weights, tmp_path, capsys):
    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--include", *FORMATS) == 0
    out = capsys.readouterr().out
    for title, suffix in (("TorchScript", ".torchscript"), ("ONNX", ".onnx"))[:len(FORMATS)]:
        path = source.with_suffix(suffix)
        assert path.is_file()
        size = f"{path.stat().st_size / 1e6:.1f} MB"
        assert any(line.startswith(f"{title}: saved {path} ({size}) in ") and line.endswith(" s")
                   for line in out.splitlines()), out
        parity = [line for line in out.splitlines() if line.startswith(f"{title} parity: max |diff| ")]
        assert len(parity) == 1 and "at 1x3x64x64; tolerance 0.064 px, 0.001" in parity[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["best.pt", *(f"best{s}" for s in SUFFIXES)])  # no temp


def test_metadata_round_trip_inside_the_files(static_files, eager):
    torchscript = static_files[0]
    expected = {"format": "yolo-trainer-export/1", "names": NAMES, "nc": 2, "stride": 32, "imgsz": [IMGSZ, IMGSZ],
                "batch": 2, "dynamic": False, "half": False, "int8": False, "channels_last": True, "device": "cpu"}
    with zipfile.ZipFile(torchscript) as archive:
        name = next(n for n in archive.namelist() if n.endswith(f"extra/{TORCHSCRIPT_METADATA}"))
        assert json.loads(archive.read(name)) == expected
    assert not list(torchscript.parent.glob("*.json")) and not list(torchscript.parent.glob("*.yaml"))  # no side files
    for path, kind in zip(static_files, (TorchScriptBackend, OnnxBackend)):
        backend = load_backend(path)
        assert type(backend) is kind
        assert (backend.names, backend.nc, backend.stride, backend.imgsz, backend.dynamic) == \
            (NAMES, 2, 32, (IMGSZ, IMGSZ), False)
    checkpoint = load_backend(torchscript.with_suffix(".pt"))
    assert type(checkpoint) is PyTorchBackend and checkpoint.imgsz is None and checkpoint.names == NAMES


def test_onnx_metadata_props(static_files):
    path = onnx_file(static_files)
    import onnx

    props = {p.key: json.loads(p.value) for p in onnx.load(str(path)).metadata_props}
    assert tuple(props) == METADATA_KEYS
    assert (props["names"], props["imgsz"], props["batch"], props["dynamic"]) == (NAMES, [IMGSZ, IMGSZ], 2, False)


def test_static_exports_match_eager_chunk_other_batches_and_refuse_other_sizes(static_files, eager):
    images = torch.rand(3, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(1))
    reference = eager_output(eager, images)
    for path in static_files:
        backend = load_backend(path)
        pred, raw = backend(images)  # batch 3 through a batch-2 export: chunks of 2, the last zero-padded
        assert raw == []
        assert_close(pred, reference, IMGSZ)
        with pytest.raises(BackendError, match=r"exported for 64x64 inputs, got 96x64; export with --dynamic"):
            backend(torch.rand(2, 3, 96, 64))


def test_dynamic_exports_run_at_other_batches_and_sizes(dynamic_files, eager):
    generator = torch.Generator().manual_seed(2)
    for path in dynamic_files:
        backend = load_backend(path)
        assert backend.dynamic and backend.imgsz is None
        for shape in ((1, 3, 64, 64), (3, 3, 96, 128), (2, 3, 160, 32)):
            images = torch.rand(shape, generator=generator)
            pred, _ = backend(images)
            assert_close(pred, eager_output(eager, images), max(shape[2:]))


def test_dynamic_export_checks_parity_at_a_second_shape(capsys, weights, tmp_path):
    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--dynamic", "--batch-size", "2", "--imgsz", "64", "96") == 0
    parity = [line for line in capsys.readouterr().out.splitlines() if line.startswith("TorchScript parity")]
    assert [line.split(" at ")[1].split(";")[0] for line in parity] == ["2x3x64x96", "3x3x32x32"]


def test_compare_flags_differences_beyond_the_tolerance():
    reference = torch.zeros(1, 10, 7)
    reference[..., :4] = 320.0
    same = export.compare(reference, reference.clone(), (1, 3, 640, 640), 1e-3)
    assert same.ok and same.box_pixels == 0 and same.box_limit == pytest.approx(0.64)
    boxes_off = reference.clone()
    boxes_off[0, 3, 1] += 0.5  # half a pixel at 640: inside 1e-3 x 640
    assert export.compare(reference, boxes_off, (1, 3, 640, 640), 1e-3).ok
    boxes_off[0, 3, 1] += 0.2
    figure = export.compare(reference, boxes_off, (1, 3, 640, 640), 1e-3)
    assert not figure.ok and figure.box_pixels == pytest.approx(0.7, abs=1e-4)
    scores_off = reference.clone()
    scores_off[0, 0, 5] = 0.002
    assert not export.compare(reference, scores_off, (1, 3, 640, 640), 1e-3).ok
    nan = reference.clone()
    nan[0, 0, 4] = float("nan")
    assert not export.compare(reference, nan, (1, 3, 640, 640), 1e-3).ok
    assert not export.compare(reference, reference[:, :5], (1, 3, 640, 640), 1e-3).ok


class SizeSpecific(torch.nn.Module):
    """Eager output depends on the input height through Python control flow, which a trace freezes."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, images):
        pred = images.mean((1, 2, 3)).view(-1, 1, 1).expand(-1, 4, 7) * self.scale
        return (pred if images.shape[2] == IMGSZ else pred + 0.01), []


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_export_that_differs_from_eager_is_an_error_and_not_written(fmt, tmp_path):
    """A graph right at the example size but wrong at the second --dynamic size: exit 1, nothing kept."""
    if fmt == "onnx":
        pytest.importorskip("onnx")
        pytest.importorskip("onnxruntime")
    from models.backends import ExportInfo
    info = ExportInfo(names=("a", "b"), stride=32, imgsz=(IMGSZ, IMGSZ), batch=1, dynamic=True, channels_last=True,
                      device="cpu")
    exporter = export.Exporter(SizeSpecific().eval(), info, torch.device("cpu"), export.ExportConfig(include=(fmt,)))
    target = tmp_path / f"model{export.SUFFIXES[fmt]}"
    with pytest.raises(export.ParityError, match=r"differs from the PyTorch model: .* at 2x3x32x32; .*not written"):
        exporter.export(fmt, target)
    assert list(tmp_path.iterdir()) == []


def test_yolov5_style_onnx_metadata_is_read(static_files, tmp_path):
    """YOLOv5's exports only store stride and names (a Python dict literal); sizes come from the graph input."""
    path = onnx_file(static_files)
    import onnx

    proto = onnx.load(str(path))
    del proto.metadata_props[:]
    for key, value in (("stride", "32"), ("names", "{0: 'cat', 1: 'dog'}")):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    path = tmp_path / "yolov5s.onnx"
    onnx.save(proto, str(path))
    backend = load_backend(path)
    assert (backend.names, backend.stride, backend.imgsz, backend.info.batch) == (NAMES, 32, (IMGSZ, IMGSZ), 2)


def test_onnx_without_metadata_or_with_code_in_names_is_refused(static_files, tmp_path):
    path = onnx_file(static_files)
    import onnx

    proto = onnx.load(str(path))
    del proto.metadata_props[:]
    bare = tmp_path / "bare.onnx"
    onnx.save(proto, str(bare))
    with pytest.raises(BackendError, match=r"bare.onnx: not an exported yolo-trainer/YOLOv5 model \(metadata: missing"):
        load_backend(bare)
    for key, value in (("stride", "32"), ("names", "__import__('os').system('echo hacked')")):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, str(bare))
    with pytest.raises(BackendError, match="not an exported"):  # names are read as a literal, never evaluated
        load_backend(bare)


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")
def test_torchscript_runs_only_on_the_device_type_it_was_traced_on(static_files, tmp_path):
    torchscript = static_files[0]
    extra = {TORCHSCRIPT_METADATA: ""}
    module = torch.jit.load(str(torchscript), _extra_files=extra)
    values = json.loads(extra[TORCHSCRIPT_METADATA])
    moved = tmp_path / "cuda.torchscript"
    torch.jit.save(module, str(moved), _extra_files={TORCHSCRIPT_METADATA: json.dumps({**values, "device": "cuda"})})
    with pytest.raises(BackendError, match=r"cuda.torchscript: TorchScript traced on cuda runs only there; use "
                                           r"--device 0 or export again with --device cpu"):
        load_backend(moved, "cpu")


def test_corrupt_and_truncated_exports_are_one_line_errors(static_files, tmp_path):
    for path in static_files:
        truncated = tmp_path / f"truncated{path.suffix}"
        truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
        garbage = tmp_path / f"garbage{path.suffix}"
        garbage.write_bytes(b"not a model\n" * 50)
        for bad in (truncated, garbage):
            with pytest.raises(BackendError) as info:
                load_backend(bad)
            message = str(info.value)
            assert "\n" not in message and message.startswith(str(bad)) and "not a readable" in message


def test_bad_weights_and_flags_are_one_line_errors(weights, tmp_path, capsys):
    not_a_model = tmp_path / "notes.pt"
    not_a_model.write_text("hello")
    assert export.main(["--weights", str(not_a_model)]) == 1  # a bad input file: exit 1; a bad flag: exit 2
    assert "notes.pt" in one_error_line(capsys)
    plain_dict = tmp_path / "dict.pt"
    torch.save({"epoch": 3, "optimizer": None}, plain_dict)
    assert export.main(["--weights", str(plain_dict)]) == 1
    assert "dict.pt" in one_error_line(capsys)
    assert export.main(["--weights", str(tmp_path / "missing.pt")]) == 1
    assert "missing.pt: weights file not found" in one_error_line(capsys)
    assert run_export(weights, "--include", "onnx", "paddle", "bogus") == 2
    assert one_error_line(capsys) == \
        f"export.py: error: --include paddle bogus: not supported (supported: {', '.join(export.SUFFIXES)})"
    assert run_export(weights, "--half") == 2
    assert "--half needs a CUDA device" in one_error_line(capsys)
    assert run_export(weights, "--include", "onnx", "--opset", "9") == 2
    assert "--opset 9: supported 11 to 20" in one_error_line(capsys)
    assert run_export(weights, "--batch-size", "0") == 2
    assert "--batch-size 0" in one_error_line(capsys)


def test_missing_optional_packages_are_named_with_the_install_command(weights, tmp_path, capsys, monkeypatch):
    source = copy_weights(weights, tmp_path)
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx now raises ImportError
    assert run_export(source, "--include", "onnx") == 1
    assert one_error_line(capsys) == ("export.py: error: --include onnx needs the optional package 'onnx': "
                                      "pip install onnx (or pip install -r requirements-export.txt)")
    assert not source.with_suffix(".onnx").exists()
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    onnx_file = tmp_path / "model.onnx"
    onnx_file.write_bytes(b"whatever")
    with pytest.raises(BackendError, match=r"running model.onnx needs the optional package 'onnxruntime': "
                                           r"pip install onnxruntime"):
        load_backend(onnx_file)


def test_optional_imports_metadata_text_and_metadata_yaml_have_one_home_each():
    """models.backends holds the optional-import helper (require: the only code that raises MissingPackage), the
    reading of a metadata value stored as text (json_or_text) and of a metadata YAML beside a model
    (read_metadata_yaml); export.py and the format modules call them instead of keeping copies."""
    import ast

    root = Path(export.__file__).parent
    found = {"raise MissingPackage": set(), "json_or_text": set(), "read_yaml": set()}
    formats = sorted((root / "models" / "formats").glob("*.py"))
    for path in [root / "export.py", root / "models" / "backends.py", *formats]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    getattr(node.exc.func, "id", "") == "MissingPackage":
                found["raise MissingPackage"].add(path.name)
            if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") == "json_or_text":
                found["json_or_text"].add(path.name)
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "read_yaml":
                found["read_yaml"].add(path.name)
    assert found == {"raise MissingPackage": {"backends.py"}, "json_or_text": {"backends.py"},
                     "read_yaml": {"backends.py"}}


def test_simplify_without_onnxsim_is_one_line(weights, capsys, monkeypatch):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    monkeypatch.setitem(sys.modules, "onnxsim", None)  # as if not installed
    assert run_export(weights, "--include", "onnx", "--simplify") == 1
    assert "--simplify needs the optional package 'onnxsim': pip install onnxsim" in one_error_line(capsys)


def test_simplify_keeps_metadata_and_parity(weights, tmp_path, capsys):
    pytest.importorskip("onnxsim")
    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--include", "onnx", "--simplify", "--dynamic") == 0
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("ONNX parity")]) == 2
    backend = load_backend(source.with_suffix(".onnx"))
    assert backend.names == NAMES and backend.dynamic


def test_optimize_exports_or_says_why_not(weights, tmp_path, capsys):
    source = copy_weights(weights, tmp_path)
    code = run_export(source, "--optimize")
    if code == 0:  # a torch build with XNNPACK: the optimised file still matches (checked at export)
        assert "TorchScript parity" in capsys.readouterr().out and source.with_suffix(".torchscript").is_file()
    else:
        assert code == 2 and "--optimize needs a torch build with XNNPACK" in one_error_line(capsys)
        assert not source.with_suffix(".torchscript").exists()


def test_optimize_saves_for_the_lite_interpreter_and_still_loads_here():
    """--optimize's file (YOLOv5's `_save_for_lite_interpreter`): PyTorch Mobile's lite interpreter runs it, and
    torch.jit.load (val.py, detect.py) reads it and its metadata."""
    from torch.jit.mobile import _load_for_lite_interpreter

    module = torch.jit.trace(nn.Conv2d(3, 4, 3), torch.zeros(1, 3, 8, 8))
    data = export.lite_interpreter_bytes(module, {TORCHSCRIPT_METADATA: '{"stride": 32}'})
    assert "bytecode.pkl" in {Path(name).name for name in zipfile.ZipFile(io.BytesIO(data)).namelist()}
    extra = {TORCHSCRIPT_METADATA: ""}
    loaded = torch.jit.load(io.BytesIO(data), _extra_files=extra)
    assert extra[TORCHSCRIPT_METADATA] == b'{"stride": 32}'
    image = torch.rand(1, 3, 8, 8)
    assert torch.equal(loaded(image), module(image))
    path = Path(tempfile.mkdtemp()) / "m.torchscript"
    path.write_bytes(data)
    assert torch.equal(_load_for_lite_interpreter(str(path))(image), module(image))


def test_several_weights_are_exported_in_turn(weights, tmp_path):
    first, second = copy_weights(weights, tmp_path / "a"), copy_weights(weights, tmp_path / "b")
    assert export.main(["--weights", str(first), str(second), "--imgsz", str(IMGSZ)]) == 0
    assert first.with_suffix(".torchscript").is_file() and second.with_suffix(".torchscript").is_file()


def test_a_failed_format_is_reported_at_the_end_and_the_rest_are_exported(weights, tmp_path, capsys, monkeypatch):
    """As YOLOv5: a format whose export fails is not written and is named at the end (exit 1); the formats after it
    and the next checkpoint are exported. export.run raises ExportFailures holding both."""
    first, second = copy_weights(weights, tmp_path / "a"), copy_weights(weights, tmp_path / "b")
    check = export.Exporter.check

    def broken_in_first(self, fmt, written, path):  # the first checkpoint's TorchScript computes something else
        if fmt == "torchscript" and path.parent == first.parent:
            raise export.ParityError(f"{path}: the TorchScript model differs from the PyTorch model: 9.9 px")
        return check(self, fmt, written, path)

    monkeypatch.setattr(export.Exporter, "check", broken_in_first)
    assert export.main(["--weights", str(first), str(second), "--imgsz", str(IMGSZ), "--include", *FORMATS]) == 1
    out, err = capsys.readouterr()
    failed = first.with_suffix(".torchscript")
    assert err.strip().splitlines()[-1] == (f"export.py: error: {failed}: the TorchScript model differs from the "
                                            "PyTorch model: 9.9 px")
    written = [first.with_suffix(suffix) for suffix in SUFFIXES[1:]] + [second.with_suffix(s) for s in SUFFIXES]
    assert sorted(p.name for p in first.parent.iterdir()) == sorted(["best.pt", *(f"best{s}" for s in SUFFIXES[1:])])
    assert sorted(p.name for p in second.parent.iterdir()) == sorted(["best.pt", *(f"best{s}" for s in SUFFIXES)])
    complete = [line for line in (out + err).splitlines() if line.startswith("Export complete")]
    assert len(complete) == 1 and complete[0].endswith(": " + ", ".join(map(str, written)))
    going_on = [line for line in (out + err).splitlines() if "export failed" in line]
    assert going_on == ([f"TorchScript: export failed: {failed}: the TorchScript model differs from the PyTorch "
                         "model: 9.9 px; going on with ONNX"] if len(FORMATS) > 1 else [])

    for path in written:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    with pytest.raises(export.ExportFailures) as raised:
        export.run(export.ExportConfig(weights=str(first), imgsz=(IMGSZ, IMGSZ), include=FORMATS))
    assert [(fmt, type(error)) for fmt, error in raised.value.failures] == [("torchscript", export.ParityError)]
    assert [result.path for result in raised.value.results] == written[:len(FORMATS) - 1]

    capsys.readouterr()  # a later checkpoint that cannot be used ends the command; the earlier failure is still said
    missing = tmp_path / "missing.pt"
    assert export.main(["--weights", str(first), str(missing), "--imgsz", str(IMGSZ), "--include", FORMATS[0]]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-2:] == [
        f"export.py: error: {failed}: the TorchScript model differs from the PyTorch model: 9.9 px",
        f"export.py: error: {missing}: weights file not found (--weights)"]


def test_int8_without_a_format_that_takes_it_is_refused(weights, tmp_path, capsys):
    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--include", "torchscript", "onnx", "--int8") == 2
    assert "--int8: TorchScript, ONNX and OpenVINO exports are fp32" in one_error_line(capsys)
    assert not source.with_suffix(".torchscript").exists()


@contextmanager
def unwritable(folder: Path):
    """``folder`` made unwritable: mode 0555, and for root (which ignores modes) the immutable attribute."""
    folder.chmod(0o555)
    immutable = False
    try:
        if _writable(folder):
            chattr = shutil.which("chattr")
            immutable = bool(chattr) and subprocess.run([chattr, "+i", str(folder)], capture_output=True).returncode == 0
            if not immutable or _writable(folder):
                pytest.skip("cannot make a folder unwritable here (root without chattr +i)")
        yield folder
    finally:
        if immutable:
            subprocess.run([shutil.which("chattr"), "-i", str(folder)], capture_output=True)
        folder.chmod(0o755)


def _writable(folder: Path) -> bool:
    try:
        (folder / ".probe").touch()
    except OSError:
        return False
    (folder / ".probe").unlink()
    return True


def test_unwritable_export_folder_is_one_line(weights, tmp_path, capsys):
    source = copy_weights(weights, tmp_path / "locked")
    with unwritable(source.parent):
        assert run_export(source) == 1
        line = one_error_line(capsys)
    assert line.startswith(f"export.py: error: {source.parent}: export folder is not writable (")
    assert sorted(p.name for p in source.parent.iterdir()) == ["best.pt"]


def test_yolov5_checkpoint_exports_with_its_names(yolov5_lookalike, tmp_path):
    """A YOLOv5 v7-format .pt (imported without running its pickle) exported from a copy."""
    source = Path(shutil.copy(yolov5_lookalike.checkpoint, tmp_path / "yolov5n.pt"))
    assert export.main(["--weights", str(source), "--imgsz", "96", "128", "--include", FORMATS[-1]]) == 0
    backend = load_backend(source.with_suffix(SUFFIXES[-1]))
    checkpoint = load_backend(source)
    assert backend.names == checkpoint.names and backend.nc == 80 and backend.imgsz == (96, 128)
    images = torch.rand(1, 3, 96, 128, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert_close(backend(images)[0], checkpoint(images.contiguous(memory_format=torch.channels_last))[0], 128)


@pytest.mark.slow
def test_yolov5n_exports_to_both_formats_within_tolerance(tmp_path, capsys):
    """yolov5n (random weights) at 160, dynamic: both files written, parity at two shapes each."""
    from models.yolo import DetectionModel
    from utils.checkpoint import model_state, save_checkpoint

    torch.manual_seed(0)
    model = DetectionModel(Path(export.ROOT) / "models" / "yolov5n.yaml")
    source = save_checkpoint({"model": model_state(model), "ema": None}, tmp_path / "yolov5n.pt")
    assert export.main(["--weights", str(source), "--imgsz", "160", "--include", *FORMATS, "--dynamic"]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith(("TorchScript parity", "ONNX parity")) for line in out.splitlines()) == 2 * len(FORMATS)
    eager = for_inference(load_model(source))
    images = torch.rand(2, 3, 96, 128, generator=torch.Generator().manual_seed(3))
    for suffix in SUFFIXES:
        backend = load_backend(source.with_suffix(suffix))
        assert backend.nc == 80 and backend.stride == 32
        assert_close(backend(images)[0], eager_output(eager, images), 128)


def test_fp16_model_traces_to_onnx_with_exact_grid(weights):
    """export --half on CUDA: the fp16 graph traced to ONNX (a Range in fp16 once broke constant folding: "tensor
    does not have a device", seen on an H200), traced here on the CPU; the decoding grid is exact in fp16."""
    onnx = pytest.importorskip("onnx")
    import io

    model = for_inference(load_model(weights)).half()
    detect = model.model[-1]
    grid = detect._make_grid(20, 24, torch.empty(0, dtype=torch.float16))
    assert grid.dtype == torch.float16
    assert torch.equal(grid.float(), detect._make_grid(20, 24, torch.empty(0)))
    assert grid[0, 0, 19, 23].tolist() == [22.5, 18.5]
    buffer = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(export.PredictionOnly(model).eval(), (torch.rand(1, 3, IMGSZ, IMGSZ).half(),), buffer,
                          dynamo=False, opset_version=17, do_constant_folding=True)
    proto = onnx.load_from_string(buffer.getvalue())
    assert proto.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16


# YOLOv5 v7.0's export.py command line, every flag given (values other than its defaults where the flag takes one)
YOLOV5_COMMAND = ["--data", "data/coco128.yaml", "--weights", "yolov5s.pt", "--imgsz", "320", "256", "--batch-size",
                  "2", "--device", "cpu", "--half", "--inplace", "--keras", "--optimize", "--int8", "--dynamic",
                  "--simplify", "--opset", "12", "--verbose", "--workspace", "8", "--nms", "--agnostic-nms",
                  "--topk-per-class", "50", "--topk-all", "60", "--iou-thres", "0.5", "--conf-thres", "0.3",
                  "--include", "torchscript", "onnx"]


def test_every_yolov5_export_flag_is_parsed_into_the_config():
    config = export.config_from_args(export.parse_args(YOLOV5_COMMAND))
    assert config == export.ExportConfig(
        weights="yolov5s.pt", imgsz=(320, 256), batch_size=2, include=("torchscript", "onnx"), device="cpu", half=True,
        dynamic=True, simplify=True, opset=12, optimize=True, int8=True, data="data/coco128.yaml", workspace=8,
        verbose=True, inplace=True, keras=True, nms=True, agnostic_nms=True, topk_per_class=50, topk_all=60,
        iou_thres=0.5, conf_thres=0.3)
    # no flag given: the command line's defaults are ExportConfig's (YOLOv5's, --opset aside)
    assert export.config_from_args(export.parse_args([])) == export.ExportConfig()
    assert (export.ExportConfig().workspace, export.ExportConfig().topk_per_class, export.ExportConfig().topk_all,
            export.ExportConfig().iou_thres, export.ExportConfig().conf_thres) == (4, 100, 100, 0.45, 0.25)


@pytest.mark.parametrize("flags, named", [(["--keras"], "--keras: YOLOv5 uses it"),
                                          (["--nms"], "--nms: YOLOv5 uses it"),
                                          (["--agnostic-nms"], "--agnostic-nms: YOLOv5 uses it"),
                                          (["--nms", "--agnostic-nms", "--keras"], "--keras --nms --agnostic-nms: "
                                                                                  "YOLOv5 uses them")])
def test_yolov5s_tensorflow_flags_are_refused_in_one_line(flags, named, weights, tmp_path, capsys):
    source = copy_weights(weights, tmp_path)
    assert run_export(source, *flags, "--include", "torchscript") == 2
    assert one_error_line(capsys) == (
        f"export.py: error: {named} for its TensorFlow exports only (saved_model, pb, tflite, edgetpu, tfjs); there "
        "are none here (tflite/litert is converted from PyTorch): exports carry the model's output before NMS, which "
        "runs in detect.py / val.py")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]
    options = {flag.lstrip("-").replace("-", "_"): True for flag in flags}
    with pytest.raises(export.ArgumentError, match=f"^{named}"):  # export.run refuses them as well
        export.run(export.ExportConfig(weights=str(source), **options))


def test_yolov5s_tensorflow_flags_are_refused_without_a_traceback(weights, tmp_path):
    source = copy_weights(weights, tmp_path)
    done = subprocess.run([sys.executable, str(Path(export.__file__)), "--weights", str(source), "--nms"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("export.py: error: --nms: YOLOv5 uses it for its "
                                                           "TensorFlow exports only"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]


def test_inplace_and_the_nms_settings_leave_the_export_unchanged(weights, tmp_path):
    """--inplace (YOLOv5's Detect inplace) and --topk-*/--iou-thres/--conf-thres without --nms change nothing."""
    plain = copy_weights(weights, tmp_path / "plain")
    flagged = copy_weights(weights, tmp_path / "flagged")
    assert run_export(plain) == 0
    assert run_export(flagged, "--inplace", "--topk-per-class", "5", "--topk-all", "7", "--iou-thres", "0.6",
                      "--conf-thres", "0.1") == 0
    first, second = (load_backend(path.with_suffix(".torchscript")) for path in (plain, flagged))
    assert first.info == second.info
    images = torch.rand(1, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(first(images)[0], second(images)[0])


def test_run_takes_yolov5s_keywords_and_returns_the_files_paths(weights, tmp_path):
    """YOLOv5's ``export.run(weights=..., include=[...], imgsz=[...])`` (its benchmarks.py calls it so and uses
    ``[-1]`` as the file): keywords with export.py's defaults and checks; each result is also the file's path."""
    import val

    source = copy_weights(weights, tmp_path)
    results = export.run(weights=str(source), include=["torchscript"], imgsz=[IMGSZ])
    assert [result.format for result in results] == ["torchscript"]
    assert str(results[-1]) == str(source.with_suffix(".torchscript")) and Path(results[-1]).is_file()
    assert val._trained_on(results[-1]) == "coco128.yaml"  # accepted wherever a path is (os.fspath)
    with pytest.raises(ArgumentError, match="unknown keyword argument 'imgz' \\(did you mean imgsz\\?\\)"):
        export.run(weights=str(source), imgz=64)
    with pytest.raises(TypeError, match="not both"):
        export.run(export.ExportConfig(weights=str(source)), half=True)
