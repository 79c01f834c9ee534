"""--resume: bit-exact continuation (at an epoch end and mid-epoch after SIGTERM), which run is found, which
options may change, and one-line refusals. The torchrun cases are in tests/test_ddp.py."""
from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import torch

import train as train_script
from tests.conftest import make_tiny_run
from tests.test_checkpoint import _payload, _torch_zip
from utils.callbacks import Callbacks
from utils.checkpoint import CheckpointError, load_resumable, previous_path, save_checkpoint
from utils.trainer import stages, trainer
from utils.trainer.resume import ResumeError, checkpoint_to_resume

EPOCHS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    return (root, *make_tiny_run(root, num_train=16))


def train_args(tiny, name, *extra):
    root, data, cfg = tiny
    return ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size", "2", "--epochs", str(EPOCHS),
            "--device", "cpu", "--project", str(root / "runs"), "--name", name, "--noautoanchor", "--noplots", *extra]


class StopAfterEpoch(Callbacks):
    """Registered by monkeypatching the trainer's Callbacks: after ``epoch``'s checkpoint either raise
    KeyboardInterrupt (a crash right after the save) or, as the next epoch starts, send this process SIGTERM (the
    run stops at the next optimizer step inside that epoch)."""

    def __init__(self, epoch: int, how: str):
        super().__init__()
        saved = []

        def after_save(last, saved_epoch, *_):
            saved.append(saved_epoch)
            if saved_epoch == epoch and how == "crash":
                raise KeyboardInterrupt

        def epoch_start():
            if saved and saved[-1] == epoch and how != "crash":
                signal.raise_signal(signal.SIGTERM)
        self.register_action("on_model_save", callback=after_save)
        self.register_action("on_train_epoch_start", callback=epoch_start)


def full_state(path):
    """Every tensor of a (not stripped) training checkpoint, by name: model, EMA and optimizer."""
    checkpoint = torch.load(path, weights_only=True)
    tensors = {f"model.{k}": v for k, v in checkpoint["model"]["state_dict"].items()}
    tensors.update({f"ema.{k}": v for k, v in checkpoint["ema"]["state_dict"].items()})
    for index, state in checkpoint["training"]["optimizer"]["state"].items():
        tensors.update({f"optim.{index}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
    return tensors, checkpoint


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


@pytest.fixture
def unstripped(monkeypatch):
    """Keep last.pt / best.pt as full training checkpoints at the end, so every tensor can be compared."""
    monkeypatch.setattr(stages, "strip_checkpoint", lambda path: None)


CONFIGS = {"workers0-nocache": ["--workers", "0", "--cache", "off"],
           # worker processes load only files (RAM-cached images load in line on a CPU the training fills)
           "workers2-disk-multiscale-imageweights": ["--workers", "2", "--cache", "disk", "--multi-scale",
                                                     "--image-weights"],
           # the checks CUDA defers (utils/trainer/step_checks.py): settled before each checkpoint
           "workers0-deferred-checks": ["--workers", "0", "--cache", "off"]}
CONFIG_ENVIRONMENT = {"workers0-deferred-checks": {"YOLO_TRAINER_STEP_CHECKS": "deferred"}}


def set_environment(monkeypatch, config: str) -> None:
    for name, value in CONFIG_ENVIRONMENT.get(config, {}).items():
        monkeypatch.setenv(name, value)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_resume_is_bit_exact_at_epoch_end_and_mid_epoch(tiny, unstripped, monkeypatch, config, capsys):
    root = tiny[0]
    extra = CONFIGS[config]
    set_environment(monkeypatch, config)
    assert train_script.main(train_args(tiny, f"{config}-straight", *extra)) == 0
    straight, _ = full_state(root / "runs" / f"{config}-straight" / "weights" / "last.pt")
    straight_best, _ = full_state(root / "runs" / f"{config}-straight" / "weights" / "best.pt")
    straight_csv = (root / "runs" / f"{config}-straight" / "results.csv").read_text()
    for how, expected_status in (("crash", 130), ("sigterm", 143)):
        name = f"{config}-{how}"
        monkeypatch.setattr(trainer, "Callbacks", lambda: StopAfterEpoch(1, how))
        assert train_script.main(train_args(tiny, name, *extra)) == expected_status
        monkeypatch.undo()
        monkeypatch.setattr(stages, "strip_checkpoint", lambda path: None)
        set_environment(monkeypatch, config)
        last = root / "runs" / name / "weights" / "last.pt"
        position = torch.load(last, weights_only=True)["training"]["run"]
        if how == "crash":
            assert (position["epoch"], position["batch"]) == (2, 0)
        else:  # stopped inside epoch 3 (index 2) at an optimizer step, not at its end
            assert position["epoch"] == 2 and 0 < position["batch"] < 8
            assert f"--resume {last}" in capsys.readouterr().err
        again = ["--cache", "disk"] if "disk" in extra else []  # a disk cache is written only when asked again
        assert train_script.main(["--resume", str(last), *again]) == 0
        resumed, _ = full_state(last)
        resumed_best, _ = full_state(root / "runs" / name / "weights" / "best.pt")
        assert max_difference(straight, resumed) == 0.0
        assert max_difference(straight_best, resumed_best) == 0.0
        assert (root / "runs" / name / "results.csv").read_text() == straight_csv


@pytest.mark.slow
def test_finished_run_says_how_to_train_further_and_options_are_checked(tiny, monkeypatch, capsys):
    root = tiny[0]
    monkeypatch.setattr(trainer, "Callbacks", lambda: StopAfterEpoch(0, "crash"))
    assert train_script.main(train_args(tiny, "options", "--workers", "0")) == 130
    monkeypatch.undo()
    last = root / "runs" / "options" / "weights" / "last.pt"
    capsys.readouterr()
    assert train_script.main(["--resume", str(last), "--epochs", "9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--epochs 9" in err[0] and "learning-rate schedule" in err[0]
    assert train_script.main(["--resume", str(last), "--seed", "5"]) == 2
    capsys.readouterr()
    # the same value as the run's is fine; --workers may change and is reported; bare --resume finds the run
    assert train_script.main(["--resume", "--project", str(root / "runs"), "--name", "options", "--epochs", str(EPOCHS),
                              "--workers", "1"]) == 0
    assert "--workers changed from 0 to 1" in capsys.readouterr().out  # (train.py logs to stdout)
    rows = (root / "runs" / "options" / "results.csv").read_text().splitlines()
    assert [int(r.split(",")[0]) for r in rows[1:]] == list(range(EPOCHS))
    assert train_script.main(["--resume", str(last)]) == 0  # finished: says so, trains nothing
    out = capsys.readouterr().out
    assert "finished" in out and f"--weights {last}" in out and "Starting training" not in out


def test_resume_refusals_are_one_line(tmp_path, capsys):
    marker = tmp_path / "pwned"
    evil = _torch_zip(tmp_path / "evil.pt", _payload(("os", "system"), f"touch {marker}", False))
    weights_only = tmp_path / "weights.pt"
    save_checkpoint({"model": {"yaml": {}, "state_dict": {}}, "ema": None}, weights_only)
    future = tmp_path / "future.pt"
    save_checkpoint({"model": {"yaml": {}, "state_dict": {}}, "ema": None, "training": {"version": 99}}, future)
    truncated = tmp_path / "cut.pt"
    truncated.write_bytes(weights_only.read_bytes()[:200])
    cases = {evil: "refused", weights_only: "not resumable", future: "version", truncated: "corrupt",
             tmp_path / "missing.pt": "no such checkpoint"}
    for path, reason in cases.items():
        assert train_script.main(["--resume", str(path), "--device", "cpu"]) == 1  # a bad input file
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and reason in err[0] and str(path) in err[0], err
    assert not marker.exists()
    assert train_script.main(["--resume", "--project", str(tmp_path / "empty")]) == 1
    assert "no run to resume" in capsys.readouterr().err


def test_resuming_a_yolov5_checkpoint_without_its_options_is_one_line(yolov5_lookalike, tmp_path, capsys):
    """A YOLOv5 last.pt whose options are not a v6.0+ run's (no opt.yaml beside it; tests/test_yolov5_resume.py
    resumes complete ones)."""
    last = tmp_path / "exp" / "weights" / "last.pt"
    last.parent.mkdir(parents=True)
    shutil.copy(yolov5_lookalike.training_checkpoint, last)  # model, EMA, optimizer; opt holds only imgsz
    assert train_script.main(["--resume", str(last), "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"train.py: error: {last} (opt): has no --optimizer (or --adam): not the options of a YOLOv5 "
                   "v6.0 or later run"]


def test_truncated_last_falls_back_to_previous(tmp_path, caplog):
    last = tmp_path / "last.pt"
    save_checkpoint({"model": {"yaml": {}, "state_dict": {}}, "epoch": 1}, last, keep_previous=True)
    save_checkpoint({"model": {"yaml": {}, "state_dict": {}}, "epoch": 2}, last, keep_previous=True)
    assert torch.load(previous_path(last), weights_only=True)["epoch"] == 1
    assert load_resumable(last)[0]["epoch"] == 2
    last.write_bytes(last.read_bytes()[:100])  # e.g. a copy cut short
    checkpoint, used = load_resumable(last)
    assert checkpoint["epoch"] == 1 and used == previous_path(last) and "falling back" in caplog.text
    previous_path(last).unlink()
    with pytest.raises(CheckpointError, match="corrupt"):
        load_resumable(last)


def test_bare_resume_looks_only_under_the_project(tmp_path):
    def run(folder, age):
        path = folder / "weights" / "last.pt"
        save_checkpoint({"model": {"yaml": {}, "state_dict": {}}, "training": {"version": 1}}, path)
        os.utime(path, (time.time() - age, time.time() - age))
        return path

    older, newer = run(tmp_path / "runs" / "exp", 100), run(tmp_path / "runs" / "exp2", 50)
    run(tmp_path / "elsewhere" / "exp", 0)  # the newest file on disk, outside the project
    shutil.copytree(tmp_path / "runs" / "exp", tmp_path / "runs" / "nested" / "deeper")  # not a run folder
    assert checkpoint_to_resume(True, tmp_path / "runs") == newer
    assert checkpoint_to_resume(True, tmp_path / "runs", "exp") == older
    assert checkpoint_to_resume(str(tmp_path / "runs" / "exp"), tmp_path / "ignored") == older
    with pytest.raises(ResumeError, match="no run to resume"):
        checkpoint_to_resume(True, tmp_path / "nothing")
