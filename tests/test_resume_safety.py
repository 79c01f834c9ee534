"""Resume keeps the newest work and writes only into its own run: a last.pt copied out of its run folder, an
older checkpoint of a run whose last.pt is newer, a second process taking a run folder in use, a run folder
holding symbolic links, a relative --data resumed from another working folder, errors reading last.pt that
are not the file's fault, and a bare --resume whose newest run is unreadable.

One tiny run is trained per module (stopped after its second of three epochs, started with a relative
--data from its own folder); each test works on a copy of it."""
from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import train as train_script
from tests.conftest import ROOT, make_tiny_run
from utils.checkpoint import load_resumable, previous_path
from utils.config import TrainConfig
from utils.files import FolderBusy, FolderLock
from utils.trainer import trainer
from utils.callbacks import Callbacks
from utils.trainer.resume import (LOCK_NAME, ResumeError, checkpoint_to_resume, newest_of_run, resolve_run,
                                  with_absolute_paths)

EPOCHS = 3


class CrashAfterEpoch(Callbacks):
    """A crash (KeyboardInterrupt) at the end of ``epoch``, after its checkpoint was written."""

    def __init__(self, epoch: int):
        super().__init__()

        def hook(last, saved_epoch, *_):
            if saved_epoch == epoch:
                raise KeyboardInterrupt
        self.register_action("on_model_save", callback=hook)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(root, run folder): epochs 0 and 1 of 3 done; weights/ holds last.pt, last.prev.pt, epoch0.pt, epoch1.pt
    and best.pt; the run was started from ``root`` with ``--data data/data.yaml``."""
    root = tmp_path_factory.mktemp("resume_safety")
    make_tiny_run(root, num_train=8, num_val=4)
    args = ["--data", "data/data.yaml", "--cfg", "tiny.yaml", "--weights", "", "--imgsz", "64", "--batch-size", "4", "--epochs",
            str(EPOCHS), "--device", "cpu", "--project", "runs", "--name", "base", "--noautoanchor", "--noplots",
            "--workers", "0", "--cache", "off", "--save-period", "1"]
    here = os.getcwd()
    original = trainer.Callbacks
    try:
        os.chdir(root)
        trainer.Callbacks = lambda: CrashAfterEpoch(1)
        assert train_script.main(args) == 130
    finally:
        trainer.Callbacks = original
        os.chdir(here)
    return root, root / "runs" / "base"


@pytest.fixture
def run(base, tmp_path):
    """A fresh copy of the base run: tmp/runs/exp."""
    copy = tmp_path / "runs" / "exp"
    shutil.copytree(base[1], copy)
    return copy


def same_file(a, b) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def snapshot(folder: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_the_crashed_run_left_no_lock_and_stored_absolute_data_paths(base):
    root, folder = base
    assert not (folder / LOCK_NAME).exists()  # the lock ends with the run, however it ends
    opt = yaml.safe_load((folder / "opt.yaml").read_text())
    stored = torch.load(folder / "weights" / "last.pt", weights_only=True)["config"]
    for config in (opt, stored):
        assert os.path.isabs(config["data"]) and os.path.isabs(config["cfg"]) and os.path.isabs(config["hyp"])
        assert same_file(config["data"], root / "data" / "data.yaml") and same_file(config["cfg"], root / "tiny.yaml")


def test_copied_last_pt_outside_a_run_folder_is_refused(run, tmp_path, capsys):
    downloads = tmp_path / "home" / "Downloads"
    downloads.mkdir(parents=True)
    copied = downloads / "last.pt"
    shutil.copy(run / "weights" / "last.pt", copied)
    assert train_script.main(["--resume", str(copied)]) == 1
    line = one_error_line(capsys)
    assert str(copied) in line and "RUN/weights/last.pt" in line and "--resume" in line
    assert sorted(p.relative_to(tmp_path / "home") for p in (tmp_path / "home").rglob("*")) == \
        [Path("Downloads"), Path("Downloads/last.pt")]  # no weights/, results.csv or lock beside it


def test_older_checkpoint_of_a_run_with_a_newer_last_is_refused(run, capsys):
    weights = run / "weights"
    last = weights / "last.pt"
    (weights / "best.pt").unlink(missing_ok=True)
    shutil.copy(weights / "epoch0.pt", weights / "best.pt")  # best.pt from epoch 0: last.pt is newer work
    before = snapshot(run)
    for name in ("best.pt", "epoch0.pt", "last.prev.pt"):
        assert train_script.main(["--resume", str(weights / name)]) == 1
        line = one_error_line(capsys)
        assert f"python train.py --resume {last}" in line and "NEW_RUN/weights/last.pt" in line
    assert snapshot(run) == before  # results.csv and last.pt as they were


def test_a_checkpoint_that_is_last_pt_itself_resumes_as_last_pt(run):
    weights = run / "weights"  # (the copy made separate files of the run's hard links: linked again here)
    for name in ("epoch1.pt", "best.pt"):  # saved at the last finished epoch: hard links of last.pt
        (weights / name).unlink(missing_ok=True)
        os.link(weights / "last.pt", weights / name)
        assert newest_of_run(weights / name) == weights / "last.pt"
    assert newest_of_run(weights / "last.pt") == weights / "last.pt"
    alone = run.parent / "alone" / "weights"
    alone.mkdir(parents=True)
    shutil.copy(weights / "epoch0.pt", alone / "epoch0.pt")  # no last.pt in that run: epoch0.pt is its newest
    assert newest_of_run(alone / "epoch0.pt") == alone / "epoch0.pt"


HOLDER = ("import sys; from utils.trainer.resume import lock_run_folder; lock_run_folder(sys.argv[1], 'holder'); "
          "print('locked', flush=True); sys.stdin.read()")


def test_a_second_process_cannot_take_a_run_folder_in_use(run, capsys):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(run)
        assert train_script.main(["--resume", str(run / "weights" / "last.pt")]) == 1
        line = one_error_line(capsys)
        assert "in use by another process" in line and f"pid {holder.pid}" in line and str(run) in line
        assert snapshot(run) == before
        with pytest.raises(FolderBusy):
            FolderLock(run, LOCK_NAME).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert (run / LOCK_NAME).exists()  # SIGKILL: the file stays, the kernel dropped the lock
    lock = FolderLock(run, LOCK_NAME)
    previous = lock.acquire()
    assert f"pid {holder.pid}" in previous  # a dead owner's lock is taken over
    lock.release(remove=True)
    assert not (run / LOCK_NAME).exists()


def test_a_run_folder_holding_symbolic_links_is_refused(run, tmp_path, capsys):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    (run / ".results.csv.tmp").symlink_to(outside)
    assert train_script.main(["--resume", str(run / "weights" / "last.pt")]) == 1
    line = one_error_line(capsys)
    assert "symbolic links" in line and ".results.csv.tmp" in line
    assert outside.read_text() == "precious\n"


def test_relative_data_resumes_the_same_dataset_from_another_folder(base, run, tmp_path, monkeypatch, caplog):
    root = base[0]
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "data").mkdir(parents=True)
    (elsewhere / "data" / "data.yaml").write_text("path: decoy\ntrain: images/train\nval: images/val\n"
                                                  "names:\n  0: a\n  1: b\n")  # the same nc, another dataset
    monkeypatch.chdir(elsewhere)
    caplog.set_level(logging.INFO)
    config, _, state = resolve_run(TrainConfig(resume=str(run / "weights" / "last.pt")), {})
    assert state is not None and os.path.isabs(config.data) and same_file(config.data, root / "data" / "data.yaml")
    assert f"--data {config.data}" in caplog.text
    # a new run stores what it reads (bare names included) as absolute paths
    fresh = with_absolute_paths(TrainConfig(data="data/data.yaml", cfg="yolov5n.yaml", hyp="hyp.scratch-low.yaml"))
    assert same_file(fresh.data, elsewhere / "data" / "data.yaml") and os.path.isabs(fresh.data)
    assert same_file(fresh.cfg, ROOT / "models" / "yolov5n.yaml") and os.path.isabs(fresh.cfg)
    assert same_file(fresh.hyp, ROOT / "data" / "hyps" / "hyp.scratch-low.yaml") and os.path.isabs(fresh.hyp)


@pytest.mark.slow
def test_resume_from_another_folder_finishes_the_run_on_its_own_dataset(base, run, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "data").mkdir(parents=True)
    (elsewhere / "data" / "data.yaml").write_text("path: decoy\ntrain: images/train\nval: images/val\n"
                                                  "names:\n  0: a\n  1: b\n")
    monkeypatch.chdir(elsewhere)
    assert train_script.main(["--resume", str(run)]) == 0
    rows = (run / "results.csv").read_text().splitlines()[1:]
    assert [int(row.split(",")[0]) for row in rows] == list(range(EPOCHS))
    assert not (run / LOCK_NAME).exists()


def test_machine_errors_reading_last_pt_do_not_fall_back(run, monkeypatch, caplog):
    last = run / "weights" / "last.pt"
    assert previous_path(last).is_file()
    real_load = torch.load
    for error in (MemoryError(), OSError(errno.EIO, "Input/output error")):
        def failing_load(path, *args, error=error, **kwargs):
            if Path(str(getattr(path, "name", path))).name == "last.pt":
                raise error
            return real_load(path, *args, **kwargs)
        monkeypatch.setattr(torch, "load", failing_load)
        with pytest.raises(type(error)):
            load_resumable(last)
        assert "falling back" not in caplog.text
    monkeypatch.setattr(torch, "load", real_load)
    last.write_bytes(last.read_bytes()[:300])  # not a valid checkpoint: the previous one is used
    assert load_resumable(last)[1] == previous_path(last) and "falling back" in caplog.text


def test_bare_resume_never_jumps_past_an_unreadable_newest_run(run, caplog):
    project = run.parent
    newer = project / "newer" / "weights"
    newer.mkdir(parents=True)
    (newer / "last.pt").write_bytes((run / "weights" / "last.pt").read_bytes()[:300])  # cut short, no previous
    older_time = time.time() - 100
    os.utime(run / "weights" / "last.pt", (older_time, older_time))
    with pytest.raises(ResumeError, match="not continuing an older run") as refused:
        checkpoint_to_resume(True, project)
    assert str(newer / "last.pt") in str(refused.value)
    shutil.copy(run / "weights" / "last.pt", newer / "last.prev.pt")  # a valid previous file: that run it is
    assert checkpoint_to_resume(True, project) == newer / "last.pt"


# ---------------------------------------------------------------------- links, races, writes beside datasets

def test_a_bare_resume_never_follows_a_linked_run_folder(run, tmp_path, caplog):
    """Run folders, weights/ folders or last.pt files that are links to elsewhere are skipped (with the real path
    to resume them by), even when newer than the runs that really are under --project."""
    project = run.parent
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run, elsewhere / "linked-run")
    shutil.copytree(run / "weights", elsewhere / "weights-only")
    (project / "linked").symlink_to(elsewhere / "linked-run")  # the run folder itself
    (project / "linked-weights").mkdir()
    (project / "linked-weights" / "weights").symlink_to(elsewhere / "weights-only")  # under a link
    (project / "linked-file" / "weights").mkdir(parents=True)
    (project / "linked-file" / "weights" / "last.pt").symlink_to(elsewhere / "linked-run" / "weights" / "last.pt")
    older = time.time() - 100
    os.utime(run / "weights" / "last.pt", (older, older))  # every linked candidate is newer
    caplog.set_level(logging.WARNING)
    assert checkpoint_to_resume(True, project) == run / "weights" / "last.pt"
    for name in ("linked", "linked-weights", "linked-file"):
        assert f"skipping {project / name}" in caplog.text
    assert f"--resume {elsewhere / 'linked-run' / 'weights' / 'last.pt'}" in caplog.text
    shutil.rmtree(run)
    with pytest.raises(ResumeError, match="no run to resume"):
        checkpoint_to_resume(True, project)  # only linked runs left: none is taken


def test_a_checkpoint_rewritten_before_the_folder_is_locked_is_not_resumed(run):
    """Another process may finish (strip) or continue the run between this one reading last.pt and taking the run
    folder's lock: the state read before is then stale, and resuming it would overwrite the newer file."""
    from utils.checkpoint import strip_checkpoint
    from utils.trainer.resume import claim_run_folder, release_run_folder

    last = run / "weights" / "last.pt"
    config, _, state = resolve_run(TrainConfig(resume=str(last)), {})
    assert claim_run_folder(config, state) == run  # unchanged: claimed
    release_run_folder(run)
    assert not (run / LOCK_NAME).exists()
    strip_checkpoint(last)  # what a process finishing the run does last
    with pytest.raises(ResumeError, match="rewritten by another process"):
        claim_run_folder(config, state)
    assert not (run / LOCK_NAME).exists()  # the claim let go of the lock


def test_a_checkpoints_disk_cache_needs_the_command_line_to_write_beside_images(run, caplog):
    """A checkpoint's --cache disk would write a .npy beside every image of whatever dataset its --data names:
    only a command that says --cache disk again caches on disk."""
    from utils.checkpoint import load_checkpoint, save_checkpoint

    last = run / "weights" / "last.pt"
    checkpoint = load_checkpoint(last)
    checkpoint["config"]["cache"] = "disk"
    save_checkpoint(checkpoint, last)
    caplog.set_level(logging.WARNING)
    config, _, _ = resolve_run(TrainConfig(resume=str(last)), {})
    assert config.cache == "auto" and "its --cache disk is not used" in caplog.text
    config, _, _ = resolve_run(TrainConfig(resume=str(last), cache="disk"), {"cache": "disk"})
    assert config.cache == "disk"
    config, _, _ = resolve_run(TrainConfig(resume=str(last), cache="ram"), {"cache": "ram"})
    assert config.cache == "ram"
