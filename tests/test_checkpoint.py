"""utils/checkpoint.py and utils/yolov5_import.py: our format, atomic writes, YOLOv5 import, refusals."""
from __future__ import annotations

import logging
import pickle
import struct
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from models import build_model, load_model
from models.yolo import DetectionModel
from utils.checkpoint import (FORMAT, CheckpointError, copy_checkpoint, load_checkpoint, model_state,
                              pickle_globals, save_checkpoint)
from tests.conftest import shared_path

MODELS = Path(__file__).resolve().parents[1] / "models"
LOGGER = logging.getLogger(__name__)


def tiny_model(seed: int = 0) -> DetectionModel:
    torch.manual_seed(seed)
    config = yaml.safe_load((MODELS / "yolov5n.yaml").read_text())
    config.update(width_multiple=0.125, nc=2)
    model = DetectionModel(config)
    model.names = ["cat", "dog"]
    return model


def outputs(model, image):
    with torch.no_grad():
        return model.eval()(image)[0]


@pytest.fixture(scope="module")
def image():
    torch.manual_seed(1)
    return torch.rand(1, 3, 64, 96)


# ---------------------------------------------------------------- our format

def test_save_load_round_trip_is_plain_data(tmp_path, image):
    model = tiny_model()
    path = save_checkpoint({"model": model_state(model), "ema": None, "epoch": 3}, tmp_path / "last.pt")
    raw = torch.load(path, weights_only=True)  # plain data: no code needed to read it
    assert raw["format"] == FORMAT and raw["epoch"] == 3 and raw["model"]["stride"] == [8.0, 16.0, 32.0]
    ckpt = load_checkpoint(path)
    rebuilt = build_model(ckpt["model"])
    assert rebuilt.names == ["cat", "dog"] and rebuilt.stride.tolist() == [8.0, 16.0, 32.0]
    assert torch.equal(outputs(model, image), outputs(rebuilt, image))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temp file left


def test_half_state_loads_as_float32(tmp_path, image):
    model = tiny_model()
    entry = model_state(model, half=True)
    assert entry["state_dict"]["model.0.conv.weight"].dtype == torch.float16
    assert entry["state_dict"]["model.0.bn.num_batches_tracked"].dtype == torch.int64
    rebuilt = build_model(entry)
    assert rebuilt.model[0].conv.weight.dtype == torch.float32
    assert torch.allclose(outputs(model, image), outputs(rebuilt, image), rtol=1e-2, atol=0.5)


def test_load_model_prefers_ema(tmp_path, image):
    model, ema = tiny_model(0), tiny_model(1)
    with_ema = save_checkpoint({"model": model_state(model), "ema": model_state(ema)}, tmp_path / "a.pt")
    without = save_checkpoint({"model": model_state(model), "ema": None}, tmp_path / "b.pt")
    loaded = load_model(with_ema)
    assert not loaded.training and loaded.model[0].conv.weight.dtype == torch.float32
    assert torch.equal(outputs(loaded, image), outputs(ema, image))
    assert torch.equal(outputs(load_model(without), image), outputs(model, image))


def test_failed_save_leaves_old_file_and_no_temp(tmp_path):
    path = save_checkpoint({"model": model_state(tiny_model()), "ema": None}, tmp_path / "last.pt")
    before = path.read_bytes()
    with pytest.raises(Exception):
        save_checkpoint({"model": model_state(tiny_model()), "bad": lambda: None}, path)  # not picklable
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


@pytest.mark.parametrize("links", [True, False])
def test_copied_checkpoint_keeps_its_bytes_when_the_source_is_rewritten(tmp_path, monkeypatch, links):
    """best.pt is made from the last.pt just written (hard link, or a copy where links fail); writing
    the next last.pt must not change it, and no temp file is left."""
    import os

    if not links:
        monkeypatch.setattr(os, "link", lambda *args: (_ for _ in ()).throw(OSError("no links here")))
    last = save_checkpoint({"model": model_state(tiny_model(0)), "ema": None, "epoch": 1}, tmp_path / "last.pt")
    best = copy_checkpoint(last, tmp_path / "best.pt")
    assert best.read_bytes() == last.read_bytes()
    assert (os.stat(best).st_ino == os.stat(last).st_ino) == links
    save_checkpoint({"model": model_state(tiny_model(1)), "ema": None, "epoch": 2}, last)
    assert load_checkpoint(best)["epoch"] == 1 and load_checkpoint(last)["epoch"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]


def test_fuse_after_load_keeps_outputs(tmp_path, image):
    model = tiny_model()
    path = save_checkpoint({"model": model_state(model)}, tmp_path / "w.pt")
    fused = load_model(path).fuse()
    assert torch.allclose(outputs(model, image), outputs(fused, image), rtol=1e-4, atol=1e-4)


def test_wrong_weights_for_yaml_is_one_line_error():
    entry = model_state(tiny_model())
    entry["state_dict"].pop("model.0.conv.weight")
    with pytest.raises(CheckpointError, match=r"missing 1 \(e.g. model.0.conv.weight\)"):
        build_model(entry)


# ---------------------------------------------------------------- bad files

def test_missing_truncated_and_non_checkpoint_files(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope.pt")
    ours = save_checkpoint({"model": model_state(tiny_model())}, tmp_path / "ok.pt")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(ours.read_bytes()[: ours.stat().st_size // 2])
    text = tmp_path / "notes.pt"
    text.write_text("just some text\n")
    jpeg = tmp_path / "photo.pt"
    jpeg.write_bytes(b"\xff\xd8\xff\xe0" + bytes(100))
    bare = tmp_path / "bare.pt"
    torch.save(tiny_model().state_dict(), bare)
    for path, reason in ((truncated, "truncated or corrupt"), (text, "not a checkpoint"),
                         (jpeg, "not a checkpoint"), (bare, "bare state_dict")):
        with pytest.raises(CheckpointError) as error:
            load_checkpoint(path)
        assert str(path) in str(error.value) and reason in str(error.value) and "\n" not in str(error.value)
        with pytest.raises(CheckpointError):
            load_model(path)


def test_truncated_yolov5_checkpoint(tmp_path, yolov5_lookalike):
    data = yolov5_lookalike.checkpoint.read_bytes()
    for size in (len(data) // 3, len(data) - 100):
        copy = tmp_path / f"cut{size}.pt"
        copy.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match="truncated or corrupt"):
            load_model(copy)


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _payload(function: tuple, argument: str, yolov5_marker: bool) -> bytes:
    """Protocol-2 pickle of {"model": function(argument)}, optionally also naming models.yolo."""
    body = b"\x80\x02}(" + _unicode("model") + _global(*function) + _unicode(argument) + b"\x85R"
    if yolov5_marker:
        body += _unicode("ema") + _global("models.yolo", "DetectionModel") + b")\x81"
    return body + b"u."


def _torch_zip(path: Path, pickle_bytes: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle_bytes)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return path


@pytest.mark.parametrize("function", [("os", "system"), ("posix", "system"), ("builtins", "eval"),
                                      ("builtins", "exec"), ("subprocess", "check_call")])
@pytest.mark.parametrize("container", ["yolov5-zip", "plain-zip", "plain-pickle"])
def test_malicious_pickles_are_refused_and_never_run(tmp_path, function, container):
    marker = tmp_path / "pwned"
    if function[1] in ("eval", "exec"):
        command = f"open({str(marker)!r}, 'w').close()"
    elif function[0] == "subprocess":
        command = ["touch", str(marker)]
    else:
        command = f"touch {marker}"
    payload = _payload(function, command if isinstance(command, str) else "x", container == "yolov5-zip")
    if isinstance(command, list):  # subprocess takes a list: swap the string for a 2-item list
        payload = payload.replace(_unicode("x"), b"]" + _unicode("touch") + _unicode(str(marker)) + b"\x86")
    assert f"{function[0]}.{function[1]}" in pickle_globals(payload)
    path = tmp_path / "evil.pt"
    if container == "plain-pickle":
        path.write_bytes(payload)
    else:
        _torch_zip(path, payload)
    with pytest.raises(CheckpointError) as error:
        load_model(path)
    message = str(error.value)
    assert "\n" not in message and str(path) in message and "refused" in message
    assert function[1] in message
    assert not marker.exists()


def test_unknown_yolov5_class_is_refused(tmp_path):
    payload = b"\x80\x02}(" + _unicode("model") + _global("models.yolo", "Sneaky") + b")\x81u."
    with pytest.raises(CheckpointError, match="refused global 'models.yolo.Sneaky'"):
        load_checkpoint(_torch_zip(tmp_path / "x.pt", payload))


# ---------------------------------------------------------------- YOLOv5 fixture

def test_yolov5_fixture_reproduces_yolov5_outputs():
    """Against YOLOv5's own inference output, recorded in ../shared: it cannot be generated without YOLOv5."""
    why = "compares with YOLOv5's own recorded inference output, which cannot be generated without YOLOv5"
    model = load_model(shared_path("fixtures", "yolov5", "yolov5n_v7_random.pt", why=why))
    reference = torch.load(shared_path("fixtures", "yolov5", "yolov5n_v7_random_io.pt", why=why), weights_only=True)
    assert model.model[0].conv.weight.dtype == torch.float32 and not model.training
    with torch.no_grad():
        pred = model(reference["input"])[0]
    error = (pred - reference["output"]).abs().max().item()
    LOGGER.info("yolov5n fixture parity: max abs error %.3g", error)
    assert pred.shape == reference["output"].shape
    assert torch.allclose(pred, reference["output"], rtol=1e-4, atol=1e-3), error
    assert model.names[:3] == ["person", "bicycle", "car"] and len(model.names) == 80
    assert model.stride.tolist() == [8.0, 16.0, 32.0]


def test_yolov5_format_checkpoint_reproduces_the_lookalike_outputs(yolov5_lookalike):
    """A YOLOv5-format file (pickled fp16 module tree) runs as the independently written look-alike
    of YOLOv5's layers runs it (float32 compute): same importer, mapping and decoding as for YOLOv5's."""
    model = load_model(yolov5_lookalike.checkpoint)
    reference = torch.load(yolov5_lookalike.io, weights_only=True)
    assert model.model[0].conv.weight.dtype == torch.float32 and not model.training
    with torch.no_grad():
        pred = model(reference["input"])[0]
    assert pred.shape == reference["output"].shape == (2, 3 * (12 * 16 + 6 * 8 + 3 * 4), 85)
    error = (pred - reference["output"]).abs().max().item()
    assert torch.allclose(pred, reference["output"], rtol=1e-4, atol=1e-3), error
    assert reference["output"][..., 4:].std() > 0.01  # not a degenerate constant output
    assert model.names[:3] == ["person", "bicycle", "car"] and len(model.names) == 80
    assert model.stride.tolist() == [8.0, 16.0, 32.0]


def test_yolov5_checkpoint_converts_to_our_format(tmp_path, yolov5_lookalike):
    ckpt = load_checkpoint(yolov5_lookalike.checkpoint)
    assert ckpt["format"] == FORMAT and ckpt["source"] == "yolov5" and ckpt["ema"] is None
    assert ckpt["model"]["stride"] == [8.0, 16.0, 32.0] and ckpt["date"] == "2024-01-01T00:00:00"
    assert ckpt["epoch"] == -1 and ckpt["best_fitness"] is None
    recorded = torch.load(yolov5_lookalike.io, weights_only=True)["state_dict"]
    state = ckpt["model"]["state_dict"]
    assert list(state) == list(recorded)  # every parameter and buffer, in module order, nothing else
    for name, tensor in recorded.items():
        assert state[name].shape == tensor.shape and torch.equal(state[name].to(tensor.dtype), tensor), name
    assert state["model.24.anchors"].shape == (3, 3, 2)
    assert torch.equal(state["model.24.anchors"][0, 0].float(), torch.tensor([10 / 8, 13 / 8]))  # grid units
    # converted once, it is plain data we can save and reload without the importer
    path = save_checkpoint(ckpt, tmp_path / "converted.pt")
    assert torch.load(path, weights_only=True)["model"]["names"][0] == "person"
    image = torch.rand(1, 3, 64, 64)
    assert torch.equal(outputs(build_model(ckpt["model"]), image), outputs(load_model(path), image))


def test_yolov5_training_checkpoint_keeps_model_and_ema_apart(yolov5_lookalike):
    """A last.pt written mid-training: model, EMA (its first conv weight doubled), optimizer, and best_fitness a
    one-element numpy array (pickled with numpy's _reconstruct and _codecs.encode, read without either)."""
    ckpt = load_checkpoint(yolov5_lookalike.training_checkpoint)
    assert ckpt["epoch"] == 4 and ckpt["best_fitness"] == pytest.approx(0.23) and ckpt["ema_updates"] == 1000
    model, ema = ckpt["model"]["state_dict"], ckpt["ema"]["state_dict"]
    assert list(model) == list(ema) and len(model) == 349
    first = "model.0.conv.weight"
    assert torch.equal(ema[first].float(), model[first].float() * 2)
    assert all(torch.equal(ema[name], model[name]) for name in model if name != first)
    loaded = load_model(yolov5_lookalike.training_checkpoint)  # inference uses the EMA, as YOLOv5 does
    assert torch.equal(loaded.model[0].conv.weight, ema[first].float())


@pytest.mark.parametrize("legacy", [False, True])
def test_a_file_replaced_after_its_scan_is_not_the_one_loaded(tmp_path, monkeypatch, legacy):
    """The checks and torch.load read one open file: a file swapped in on disk between them (a process that can
    write the folder) is never loaded unchecked."""
    import utils.checkpoint.store as store

    path, other = tmp_path / "last.pt", tmp_path / "other.pt"
    for file, epoch in ((path, 3), (other, 7)):
        save_checkpoint({"model": model_state(tiny_model()), "ema": None, "epoch": epoch}, file)
        if legacy:  # torch's pre-1.6 format: a sequence of pickles
            torch.save(torch.load(file, weights_only=True), file, _use_new_zipfile_serialization=False)
    scan = store.check_legacy_pickles if legacy else store.scan_pickle

    def scan_then_swap(*args):
        result = scan(*args)
        other.replace(path)
        return result

    monkeypatch.setattr(store, "check_legacy_pickles" if legacy else "scan_pickle", scan_then_swap)
    assert load_checkpoint(path)["epoch"] == 3
    assert torch.load(path, weights_only=True)["epoch"] == 7  # the swap happened


def test_pickle_globals_reads_without_unpickling():
    payload = pickle.dumps({"a": torch.nn.Identity}, protocol=4)  # STACK_GLOBAL with memoised strings
    assert "torch.nn.modules.linear.Identity" in pickle_globals(payload)


def test_legacy_non_zip_yolov5_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "old.pt"
    path.write_bytes(_payload(("os", "system"), f"touch {marker}", yolov5_marker=True))
    with pytest.raises(CheckpointError, match="legacy \\(non-zip\\) YOLOv5 checkpoint"):
        load_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"),
                                     RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter "
                                                  "failed writing file data/0: file write failed")])
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_file(tmp_path, monkeypatch, failure):
    from utils.errors import WriteError

    last = save_checkpoint({"model": model_state(tiny_model()), "ema": None, "epoch": 1}, tmp_path / "last.pt")

    def full_disk(data, file):
        file.write(b"partial")
        raise failure
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(WriteError) as error:
        save_checkpoint({"model": model_state(tiny_model()), "ema": None, "epoch": 2}, last, keep_previous=True)
    message = str(error.value)
    assert "\n" not in message and str(last) in message and "previous last.pt is intact" in message
    monkeypatch.undo()
    assert torch.load(last, weights_only=True)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temp file left behind
