"""export.py --include openvino and the OpenVINO backend (models/backends.py): YOLOv5's folder layout,
metadata, parity with the PyTorch model (fp32 and --half), dynamic shapes, val.py / detect.py on the
exported folder, and one-line errors. Skipped by name without the optional openvino package (and onnx,
which the conversion starts from), except the test of the missing-package message itself."""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import export
from models import for_inference, load_model
from models.backends import (BackendError, OpenVinoBackend, _libc_sigaltstack, _SignalStack, import_openvino,
                             kept_signal_stack, load_backend)
from tests.conftest import make_tiny_dataset, save_random_checkpoint
from tests.export_helpers import (check_same_labels, copy_weights, detect_labels, eager_output,
                                  label_rows, max_differences)

NAMES = ["cat", "dog"]
IMGSZ = 64


def needs_openvino():
    """Skip by name without onnx or openvino; openvino is imported the backend's way (without its telemetry,
    which a plain ``import openvino`` starts)."""
    pytest.importorskip("onnx")
    if importlib.util.find_spec("openvino") is None:
        pytest.skip("could not import 'openvino': optional (pip install -r requirements-export.txt)")
    import_openvino("the OpenVINO tests")


def save_tiny(path: Path) -> Path:
    """The tiny model, randomly initialised: its scores vary (raised biases would saturate them, and NMS would
    then choose among exact ties)."""
    return save_random_checkpoint(path, NAMES)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("openvino") / "best.pt")


@pytest.fixture(scope="module")
def eager(weights):
    return for_inference(load_model(weights))


def run_export(weights: Path, *flags: str) -> int:
    return export.main(["--weights", str(weights), "--imgsz", str(IMGSZ), "--include", "openvino", *flags])


def parity_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("OpenVINO parity: max |diff| ")]


@pytest.fixture(scope="module")
def static_folder(weights, tmp_path_factory):
    """best_openvino_model/ exported at 64x64, batch 2 (static shapes)."""
    needs_openvino()
    source = copy_weights(weights, tmp_path_factory.mktemp("static"))
    assert run_export(source, "--batch-size", "2") == 0
    return source.parent / "best_openvino_model"


def test_export_writes_yolov5_layout_with_metadata_summary_and_parity(weights, tmp_path, capsys):
    needs_openvino()
    source = copy_weights(weights, tmp_path)
    assert run_export(source) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "best_openvino_model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "best_openvino_model"]  # no temp left
    assert sorted(p.name for p in folder.iterdir()) == ["best.bin", "best.xml", "best.yaml"]
    size = sum(p.stat().st_size for p in folder.iterdir()) / 1e6
    assert any(line.startswith(f"OpenVINO: saved {folder} ({size:.1f} MB) in ") for line in out.splitlines()), out
    parity = parity_lines(out)
    assert len(parity) == 1 and "at 1x3x64x64; tolerance 0.064 px, 0.001" in parity[0]
    metadata = yaml.safe_load((folder / "best.yaml").read_text())
    assert metadata == {"format": "yolo-trainer-export/1", "names": NAMES, "nc": 2, "stride": 32,
                        "imgsz": [IMGSZ, IMGSZ], "batch": 1, "dynamic": False, "half": False, "int8": False,
                        "channels_last": True,
                        "device": "cpu"}
    for path in (folder, folder / "best.xml"):  # the folder or its .xml, as YOLOv5 takes them
        backend = load_backend(path)
        assert type(backend) is OpenVinoBackend and backend.kind == "openvino"
        assert (backend.names, backend.nc, backend.stride, backend.imgsz, backend.dynamic) == \
            (NAMES, 2, 32, (IMGSZ, IMGSZ), False)


def test_static_export_matches_eager_chunks_other_batches_and_refuses_other_sizes(static_folder, eager):
    backend = load_backend(static_folder)
    images = torch.rand(3, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(1))
    pred, raw = backend(images)  # batch 3 through a batch-2 export: chunks of 2, the last zero-padded
    assert raw == []
    boxes, scores = max_differences(pred, eager_output(eager, images))
    assert boxes <= 1e-3 * IMGSZ and scores <= 1e-3
    with pytest.raises(BackendError, match=r"exported for 64x64 inputs, got 96x64; export with --dynamic"):
        backend(torch.rand(2, 3, 96, 64))


def test_dynamic_export_checks_two_shapes_and_runs_at_other_sizes(weights, eager, tmp_path, capsys):
    needs_openvino()
    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--dynamic", "--batch-size", "2") == 0
    parity = parity_lines(capsys.readouterr().out)
    assert [line.split(" at ")[1].split(";")[0] for line in parity] == ["2x3x64x64", "3x3x32x32"]
    backend = load_backend(tmp_path / "best_openvino_model")
    assert backend.dynamic and backend.imgsz is None
    generator = torch.Generator().manual_seed(2)
    for shape in ((1, 3, 64, 64), (3, 3, 96, 128), (2, 3, 160, 32)):
        images = torch.rand(shape, generator=generator)
        boxes, scores = max_differences(backend(images)[0], eager_output(eager, images))
        assert boxes <= 1e-3 * max(shape[2:]) and scores <= 1e-3, shape


def test_half_stores_fp16_weights_on_the_cpu_within_the_fp16_tolerance(weights, eager, static_folder, tmp_path,
                                                                         capsys):
    source = copy_weights(weights, tmp_path)
    assert run_export(source, "--half", "--batch-size", "2") == 0  # --half needs no GPU for OpenVINO
    parity = parity_lines(capsys.readouterr().out)
    assert len(parity) == 1 and "tolerance 0.64 px, 0.01" in parity[0]
    folder = tmp_path / "best_openvino_model"
    assert yaml.safe_load((folder / "best.yaml").read_text())["half"] is True
    fp32_bytes = (static_folder / "best.bin").stat().st_size
    assert (folder / "best.bin").stat().st_size < 0.6 * fp32_bytes  # the weights are stored in 2 bytes, not 4
    images = torch.rand(2, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(5))
    boxes, scores = max_differences(load_backend(folder)(images)[0], eager_output(eager, images))
    assert boxes <= 1e-2 * IMGSZ and scores <= 1e-2


def test_half_with_other_formats_on_the_cpu_is_still_refused(weights, capsys):
    assert export.main(["--weights", str(weights), "--include", "openvino", "torchscript", "--half"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("export.py: error: --half needs a CUDA device (--device 0) for TorchScript and ONNX")


def test_reexport_replaces_the_model_files_and_keeps_others(weights, tmp_path):
    needs_openvino()
    source = copy_weights(weights, tmp_path)
    folder = tmp_path / "best_openvino_model"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "best.xml").write_text("old")
    assert run_export(source) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["best.bin", "best.xml", "best.yaml", "notes.txt"]
    assert (folder / "notes.txt").read_text() == "mine"
    assert load_backend(folder).names == NAMES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "best_openvino_model"]


def test_output_path_taken_by_a_file_is_one_line(weights, tmp_path, capsys):
    needs_openvino()
    source = copy_weights(weights, tmp_path)
    (tmp_path / "best_openvino_model").write_text("a file, not a folder")
    assert run_export(source) == 1
    assert capsys.readouterr().err.strip() == (f"export.py: error: {tmp_path / 'best_openvino_model'}: exists and "
                                               "is not a folder; move it away to export here")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "best_openvino_model"]


def test_missing_openvino_is_named_with_the_install_command(weights, tmp_path, capsys, monkeypatch):
    pytest.importorskip("onnx")
    source = copy_weights(weights, tmp_path)
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino now raises ImportError
    assert run_export(source) == 1
    assert capsys.readouterr().err.strip() == ("export.py: error: --include openvino needs the optional package "
                                               "'openvino': pip install openvino (or pip install -r "
                                               "requirements-export.txt)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]
    folder = tmp_path / "model_openvino_model"
    folder.mkdir()
    (folder / "model.xml").write_text("<net/>")
    with pytest.raises(BackendError, match=r"running model.xml needs the optional package 'openvino': "
                                           r"pip install openvino"):
        load_backend(folder)


def test_broken_folders_and_files_are_one_line_errors(static_folder, tmp_path):
    no_metadata = tmp_path / "no_metadata_openvino_model"
    no_metadata.mkdir()
    for suffix in (".xml", ".bin"):
        shutil.copy(static_folder / f"best{suffix}", no_metadata / f"no_metadata{suffix}")
    with pytest.raises(BackendError, match=r"no_metadata.xml: no metadata file no_metadata.yaml beside it"):
        load_backend(no_metadata)
    truncated = tmp_path / "truncated_openvino_model"
    shutil.copytree(static_folder, truncated)
    for name in ("best.xml", "best.bin", "best.yaml"):
        (truncated / name).rename(truncated / name.replace("best", "truncated"))
    xml = truncated / "truncated.xml"
    xml.write_text(xml.read_text()[: len(xml.read_text()) // 2])
    with pytest.raises(BackendError, match=rf"^{re.escape(str(xml))}: not a readable OpenVINO model \("):
        load_backend(truncated)
    garbage = tmp_path / "garbage.xml"
    garbage.write_text("not a model\n" * 50)
    with pytest.raises(BackendError, match=r"garbage.xml: not a readable OpenVINO model \(not an OpenVINO IR"):
        load_backend(garbage)
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.xml").write_text("<net/>")
    (two / "b.xml").write_text("<net/>")
    with pytest.raises(BackendError, match=r"two: a folder with 2 .xml files; pass the OpenVINO model's .xml file"):
        load_backend(two)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BackendError, match=r"empty: a folder without an OpenVINO model \(.xml file\); pass a model"):
        load_backend(empty)
    with pytest.raises(BackendError, match=r"missing_openvino_model: model file not found"):
        load_backend(tmp_path / "missing_openvino_model")


def test_the_ir_checked_is_the_ir_run_and_a_missing_bin_is_one_line(static_folder, eager, tmp_path, monkeypatch):
    """The .xml and .bin are read once: files swapped in right after the read are never the ones run (the path was
    given to openvino again before). A .bin that is not there is said in one line."""
    from models import backends

    folder = tmp_path / "swapped_openvino_model"
    shutil.copytree(static_folder, folder)
    for name in ("best.xml", "best.bin", "best.yaml"):
        (folder / name).rename(folder / name.replace("best", "swapped"))
    read = backends._read_ir_weights

    def read_then_swap(xml):  # the .xml was read before the .bin
        weights = read(xml)
        xml.write_text("not a model\n" * 50)
        xml.with_suffix(".bin").write_bytes(b"\0" * 16)
        return weights

    monkeypatch.setattr(backends, "_read_ir_weights", read_then_swap)
    images = torch.rand(2, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(2))
    boxes, scores = max_differences(load_backend(folder)(images)[0], eager_output(eager, images))
    assert boxes <= 1e-3 * IMGSZ and scores <= 1e-3
    monkeypatch.setattr(backends, "_read_ir_weights", read)
    no_bin = tmp_path / "no_bin_openvino_model"
    shutil.copytree(static_folder, no_bin)
    for name in ("best.xml", "best.yaml"):
        (no_bin / name).rename(no_bin / name.replace("best", "no_bin"))
    (no_bin / "best.bin").unlink()
    with pytest.raises(BackendError, match=r"no_bin.xml: its weights file no_bin.bin is missing"):
        load_backend(no_bin)


def test_openvino_is_imported_with_its_telemetry_stubbed():
    needs_openvino()
    from openvino.tools.ovc import telemetry_utils

    assert telemetry_utils.tm.__name__ == "openvino.tools.ovc.telemetry_stub"  # the converter's no-op stand-in
    assert sys.modules.get("openvino_telemetry", "absent") == "absent"  # hidden only while importing


@pytest.mark.slow
def test_import_writes_nothing_in_the_home_folder(tmp_path):
    """openvino's converter starts usage telemetry on import (a client id under the home folder, events over the
    network); the backend imports it with the telemetry package hidden."""
    needs_openvino()
    home = tmp_path / "home"
    home.mkdir()
    code = ("import sys; from models.backends import import_openvino; ov = import_openvino('test'); "
            "print(ov.__name__, 'openvino_telemetry' in sys.modules)")
    environment = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "OMP_NUM_THREADS": "1"}
    for variable in ("CI", "TF_BUILD", "JENKINS_URL"):  # the telemetry's own CI opt-out must not be what passes this
        environment.pop(variable, None)
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(export.__file__).parent, env=environment,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["openvino", "False"]
    assert list(home.iterdir()) == []


# --- the thread's alternate signal stack (OpenVINO's CPU plugin swaps it) ---------------------------------

def current_signal_stack() -> tuple:
    stack = _SignalStack()
    assert _libc_sigaltstack()(None, ctypes.byref(stack)) == 0
    return stack.ss_sp or 0, stack.ss_flags, stack.ss_size


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sigaltstack is read through Linux's libc")
def test_kept_signal_stack_puts_back_the_stack_a_call_replaced_also_when_it_raises():
    sigaltstack, saved = _libc_sigaltstack(), _SignalStack()
    assert sigaltstack(None, ctypes.byref(saved)) == 0
    before = current_signal_stack()
    replacement = ctypes.create_string_buffer(64 * 1024)  # what the plugin does: a stack of its own
    stack = _SignalStack(ctypes.cast(replacement, ctypes.c_void_p), 0, len(replacement))
    try:
        for failing in (False, True):
            with pytest.raises(RuntimeError) if failing else contextlib.nullcontext():
                with kept_signal_stack():
                    assert sigaltstack(ctypes.byref(stack), None) == 0
                    assert current_signal_stack() == (ctypes.addressof(replacement), 0, len(replacement))
                    if failing:
                        raise RuntimeError("compile failed")
            assert current_signal_stack() == before
    finally:  # never leave the test process on the buffer freed after this test
        saved.ss_flags &= 2
        sigaltstack(ctypes.byref(saved), None)


SIGNAL_AFTER_RELOAD = """
import ctypes, signal, subprocess, sys
from models.backends import _SignalStack, _libc_sigaltstack, load_backend

def stack():
    current = _SignalStack()
    _libc_sigaltstack()(None, ctypes.byref(current))
    return current.ss_sp, current.ss_flags, current.ss_size

before = stack()
model = load_backend(sys.argv[1])
model = load_backend(sys.argv[1])  # the first model is freed after the second one was loaded
del model
print("stack kept" if stack() == before else "stack replaced", flush=True)
signal.signal(signal.SIGCHLD, lambda number, frame: None)  # as torch's DataLoader does once workers start
subprocess.run([sys.executable, "-c", "pass"], check=True)
signal.signal(signal.SIGUSR1, lambda number, frame: print("signal handled", flush=True))
signal.raise_signal(signal.SIGUSR1)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the plugin's signal stack is Linux's")
def test_reloading_a_model_keeps_the_signal_stack_so_later_signals_are_handled(static_folder):
    """OpenVINO's CPU plugin gives the thread a signal stack of its own and unmaps it when freed: two models freed
    in the order they were loaded left the process on an unmapped stack, and the next signal Python handled (a
    loader worker or child process ending, Ctrl-C) killed it with SIGSEGV."""
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", SIGNAL_AFTER_RELOAD, str(static_folder)],
                          cwd=Path(export.__file__).parent, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout.split("\n")[:2]) == (0, ["stack kept", "signal handled"]), done.stderr[-2000:]


@pytest.mark.slow
def test_openvino_then_loader_workers_and_child_processes_and_the_reverse_end_cleanly(tmp_path):
    """benchmarks/check_openvino_sequence.py once per order, each a fresh process: export, models loaded (one
    reloaded), detect.run, train.run with 2 loader workers, val.run with 2 workers, a child process."""
    needs_openvino()
    script = Path(export.__file__).parent / "benchmarks" / "check_openvino_sequence.py"
    done = subprocess.run([sys.executable, str(script), "--work", str(tmp_path)], cwd=script.parents[1],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert done.stdout.splitlines()[-2:] == ["forward: 1/1 clean; exit codes [0]", "reverse: 1/1 clean; exit codes [0]"]
    logs = sorted(tmp_path.glob("*/run.log"))
    assert len(logs) == 2
    for log in logs:
        text = log.read_text()
        assert "Using 2 dataloader workers" in text  # the loader really started worker processes
        assert text.count("signal stack as at start") == 5, text[-2000:]


# --- val.py and detect.py on the exported folder ----------------------------------------------------------

@pytest.fixture(scope="module")
def dataset_and_exports(weights, tmp_path_factory):
    """A tiny dataset, and the weights beside their --dynamic OpenVINO export (fp32)."""
    needs_openvino()
    root = tmp_path_factory.mktemp("openvino-val")
    data = make_tiny_dataset(root / "data", num_train=1, num_val=6)
    source = copy_weights(weights, root / "weights")
    assert export.run(export.ExportConfig(weights=str(source), imgsz=(IMGSZ, IMGSZ), include=("openvino",),
                                          dynamic=True))
    return root, data, source


def test_val_on_the_openvino_folder_equals_the_checkpoint(dataset_and_exports):
    import val

    root, data, source = dataset_and_exports
    # fp32 (--amp off): under bf16 autocast the checkpoint would round differently from OpenVINO's fp32
    results = [val.run(data=data, weights=str(path), imgsz=IMGSZ, batch_size=4, workers=0, plots=False,
                       save_txt=True, save_conf=True, project=root / "val", device="cpu", amp="off")
               for path in (source, source.parent / "best_openvino_model")]
    reference, exported = results
    assert reference.seen == 6 and reference.map50 > 0
    for metric in ("mp", "mr", "map50", "map"):
        assert getattr(exported, metric) == pytest.approx(getattr(reference, metric), abs=0.001), metric
    expected, got = label_rows(reference.save_dir), label_rows(exported.save_dir)
    assert expected and got.keys() == expected.keys()
    for name, rows in expected.items():
        assert np.allclose(got[name], rows, atol=1e-3), name


def test_detect_on_the_openvino_xml_writes_the_checkpoints_boxes(dataset_and_exports):
    root, data, source = dataset_and_exports
    images = root / "data" / "images" / "val"
    xml = source.parent / "best_openvino_model" / "best.xml"
    expected, got = (detect_labels(path, images, (IMGSZ,), root / "detect", name)
                     for name, path in (("pt", source), ("openvino", xml)))
    check_same_labels(expected, got, 1.0 / 96 + 1e-6)  # whole pixels of 96x112 images: one
