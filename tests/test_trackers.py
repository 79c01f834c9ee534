"""Experiment trackers (utils.trackers): the queue that keeps a failing tracker away from training, the metric-name
table, redaction, the checkpoint's tracker_runs field; and MLflow against a real ``mlflow server`` on 127.0.0.1 (SQLite
store, artifacts served from tmp_path), read back with MlflowClient: params, per-epoch metrics equal to results.csv,
artifacts, --resume into the same run without an epoch logged twice, a server killed mid-run. The MLflow tests skip by
name where the ``mlflow`` package is not installed (requirements-trackers.txt; CI does not install it)."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import train as train_script
from tests.conftest import make_tiny_run
from utils.checkpoint import training_state
from utils.config import Hyp, TrainConfig
from utils.loggers import RESULTS_KEYS
from utils.plots import read_results_csv
from utils.trackers import METRIC_NAMES, Tracker, Trackers, dispatch, open_trackers, redacted

MLFLOW = importlib.util.find_spec("mlflow") is not None
needs_mlflow = pytest.mark.skipif(not MLFLOW, reason="mlflow not installed (pip install -r requirements-trackers.txt)")
SERVER_WAIT_S = 90  # a cold mlflow server (imports, SQLite migrations) takes ~7 s on an idle 2-core machine
# without its job runner (8 more processes that keep the 2 cores busy for ~30 s after the server answers; the GenAI
# jobs they run are not used here)
SERVER_ENV = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


# ---------------------------------------------------------------------- the queue, without any tracker package

class FakeTracker(Tracker):
    name, label = "fake", "Fake"

    def __init__(self, fail_on: str = "", block: threading.Event | None = None):
        super().__init__()
        self.calls, self.fail_on, self.block = [], fail_on, block

    def start(self, run):
        self.calls.append(("start", run.run_name, [row["epoch"] for row in run.rows]))
        self.run_id, self.url = "run1", "fake://run1"
        self._maybe_fail("start")

    def log_epoch(self, epoch, values):
        self.calls.append(("log_epoch", epoch))
        self._maybe_fail("log_epoch")

    def log_files(self, paths, folder):
        self.calls.append(("log_files", [p.name for p in paths], folder))

    def log_validation(self, epoch, per_class, confusion, names):
        self.calls.append(("log_validation", epoch, per_class, None if confusion is None else confusion.tolist(),
                           names))

    def finish(self, finished):
        if self.block is not None:
            self.block.wait()
        self.calls.append(("finish", finished))

    def _maybe_fail(self, method):
        if method == self.fail_on:
            raise ConnectionError("server down")


def trackers_of(*trackers) -> Trackers:
    for tracker in trackers:
        tracker.why = "test"
    return Trackers(list(trackers), open_trackers(TrainConfig(trackers=False), Hyp(), Path("runs/exp")).run)


def test_a_failing_tracker_says_so_once_and_the_others_get_every_call(caplog):
    caplog.set_level(logging.INFO)
    good, bad = FakeTracker(), FakeTracker(fail_on="log_epoch")
    bad.name, bad.label = "bad", "Bad"
    trackers = trackers_of(good, bad)
    trackers.start([{"epoch": 0, **dict.fromkeys(RESULTS_KEYS, 0.0)}])
    for epoch in (1, 2, 3):
        trackers.log_epoch(epoch, dict.fromkeys(RESULTS_KEYS, 1.0))
    trackers.log_files([Path("a.png")], "plots")
    assert trackers.run_ids() == {"fake": "run1", "bad": "run1"}
    trackers.close(finished=True)
    trackers.close(finished=True)  # closing twice is harmless
    assert good.calls == [("start", "exp", [0]), ("log_epoch", 1), ("log_epoch", 2), ("log_epoch", 3),
                          ("log_files", ["a.png"], "plots"), ("finish", True)]
    assert bad.calls == [("start", "exp", [0]), ("log_epoch", 1)]  # nothing after its failure
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["WARNING: Bad: log_epoch failed, no more logging to it; training goes on "
                        "(ConnectionError: server down)"]
    (start,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Trackers:")]
    assert start == ("Trackers: Fake on (test): fake://run1; Bad on (test): fake://run1; "
                     "--no-trackers turns them off")


def test_calls_return_at_once_and_close_waits_a_bounded_time(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "CLOSE_WAIT_SECONDS", 0.5)
    release = threading.Event()
    stuck = FakeTracker(block=release)  # its server never answers the run's end
    trackers = trackers_of(stuck)
    trackers.start([])
    began = time.perf_counter()
    for epoch in range(1000):
        trackers.log_epoch(epoch, dict.fromkeys(RESULTS_KEYS, 1.0))
    assert time.perf_counter() - began < 1.0  # queued, not sent: the training loop never waits for a tracker
    began = time.perf_counter()
    trackers.close(finished=True)
    assert time.perf_counter() - began < 5.0
    assert "still unsent after 0.5 s" in caplog.text
    release.set()


def test_a_stuck_tracker_holds_up_neither_training_nor_the_other_trackers(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "CLOSE_WAIT_SECONDS", 2.0)  # the good tracker's few calls take milliseconds
    release, stuck_in_epoch = threading.Event(), threading.Event()

    class Stuck(FakeTracker):  # its server stops answering at the first epoch
        name, label = "stuck", "Stuck"

        def log_epoch(self, epoch, values):
            stuck_in_epoch.set()
            release.wait()

    stuck, good = Stuck(), FakeTracker()
    trackers = trackers_of(stuck, good)
    trackers.start([])
    for epoch in range(3):
        trackers.log_epoch(epoch, dict.fromkeys(RESULTS_KEYS, 1.0))
    assert stuck_in_epoch.wait(10)  # its thread has taken epoch 0: epochs 1-2 and the end wait behind it
    trackers.close(finished=True)
    assert good.calls == [("start", "exp", []), ("log_epoch", 0), ("log_epoch", 1), ("log_epoch", 2),
                          ("finish", True)]  # every call, while the other tracker hangs
    assert "WARNING: Trackers: 4 call(s) still unsent after 2 s" in caplog.text  # the stuck one: epochs 0-2, end
    release.set()


def test_trackers_are_chosen_by_their_switch_and_none_run_off_the_main_process(monkeypatch, caplog):
    caplog.set_level(logging.INFO)

    class On(FakeTracker):
        switch = classmethod(lambda cls: (True, "configured"))

    class Off(FakeTracker):
        label = "Off"
        switch = classmethod(lambda cls: (False, "not configured"))

    class Absent(FakeTracker):
        switch = classmethod(lambda cls: None)

    classes = (On, Off, Absent)
    chosen = open_trackers(TrainConfig(), Hyp(), Path("runs/exp"), {"fake": "abc"}, classes=classes)
    assert [type(t) for t in chosen.trackers] == [On] and chosen.off == ["Off off (not configured)"]
    assert chosen.resume_ids == {"fake": "abc"} and chosen.run.run_name == "exp"
    assert chosen.run.params["hyp/lr0"] == 0.01 and chosen.run.params["epochs"] == 100
    assert open_trackers(TrainConfig(trackers=False), Hyp(), Path("x"), classes=classes).trackers == []
    silent = open_trackers(TrainConfig(), Hyp(), Path("x"), classes=(Off,))
    silent.start([])
    assert "Trackers: Off off (not configured)" in caplog.text  # installed but not set up: said once
    monkeypatch.setattr(dispatch.dist, "is_main_process", lambda: False)
    assert open_trackers(TrainConfig(), Hyp(), Path("x"), classes=classes).trackers == []


def test_options_are_redacted_before_they_are_logged():
    values = redacted({"weights": "https://user:s3cret@host/a.pt?token=abc&x=1#sha256=ff", "api_key": "k",
                       "data": "s3://bucket/d.yaml?X-Amz-Signature=zz&X-Amz-Date=1", "epochs": 3,
                       "freeze": ["http://u:p@h/", 0], "name": "exp", "comet_token": ""})
    assert values == {"weights": "https://***@host/a.pt?token=***&x=1#sha256=ff", "api_key": "***",
                      "data": "s3://bucket/d.yaml?X-Amz-Signature=***&X-Amz-Date=1", "epochs": 3,
                      "freeze": ["http://***@h/", 0], "name": "exp", "comet_token": ""}


def test_metric_names_are_yolov5s_mapped_to_names_every_mlflow_store_takes():
    assert list(METRIC_NAMES) == list(RESULTS_KEYS)
    names = [METRIC_NAMES[key]["mlflow"] for key in RESULTS_KEYS]
    assert all(re.fullmatch(r"[/\w.\- ]+", name) for name in names)  # MLflow's rule on Windows (no ':')
    assert len(set(names)) == len(names)
    assert METRIC_NAMES["metrics/mAP_0.5:0.95"]["mlflow"] == "metrics/mAP_0.5-0.95"
    assert METRIC_NAMES["train/box_loss"]["mlflow"] == "train/box_loss"


def test_importing_the_trackers_or_train_imports_no_tracker_package():
    packages = [tracker.package for tracker in dispatch.TRACKERS]
    assert packages and all(packages)
    code = f"import sys, train, utils.trackers; print([p for p in {packages!r} if p in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1],
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("tracker_class", dispatch.TRACKERS, ids=lambda tracker_class: tracker_class.name)
def test_a_tracker_whose_package_is_broken_is_one_warning(tracker_class, monkeypatch, caplog):
    """Its package fails to import in the worker thread (as a broken install does): one warning, no further call."""
    package = tracker_class.package
    for name in [package, *(name for name in sys.modules if name.startswith(f"{package}."))]:
        monkeypatch.setitem(sys.modules, name, None)  # any import of it (or of a module of it) raises ImportError
    trackers = trackers_of(tracker_class())
    trackers.start([{"epoch": 0, **dict.fromkeys(RESULTS_KEYS, 0.0)}])
    for epoch in (1, 2):
        trackers.log_epoch(epoch, dict.fromkeys(RESULTS_KEYS, 1.0))
    trackers.log_files([Path("a.png")], "")
    trackers.close(finished=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and re.match(f"WARNING: {tracker_class.label}: start failed, no more logging to it; "
                                           r"training goes on \((ModuleNotFound|Import)Error: ", warnings[0])
    assert trackers.failed == {tracker_class.name} and trackers.run_ids() == {}


# ---------------------------------------------------------------------- the checkpoint's optional field

def test_tracker_run_ids_in_a_checkpoint_are_optional_and_checked():
    from tests.test_checkpoint_validation import make_resumable, mutate, refused, run_of

    resumable = make_resumable()
    assert "tracker_runs" in run_of(resumable)  # written by this version
    older = mutate(resumable, lambda c: run_of(c).pop("tracker_runs"))  # before trackers
    assert training_state(older, Path("last.pt")).run.get("tracker_runs") is None
    good = mutate(resumable, lambda c: run_of(c).update(tracker_runs={"mlflow": "0123abcd" * 4}))
    assert training_state(good, Path("last.pt")).run["tracker_runs"] == {"mlflow": "0123abcd" * 4}
    path = Path("runs/train/exp/weights/last.pt")
    for bad, field in (([1], "training.run.tracker_runs"), ({"mlflow": "../../x"}, "training.run.tracker_runs.mlflow"),
                       ({"MLflow!": "a"}, "training.run.tracker_runs"), ({"mlflow": 5}, "training.run.tracker_runs"),
                       ({f"t{i}": "a" for i in range(17)}, "training.run.tracker_runs")):
        refused(lambda b=bad: training_state(mutate(resumable, lambda c: run_of(c).update(tracker_runs=b)), path),
                str(path), field)


def test_yolov5s_tracker_flags_are_accepted_and_may_change_on_resume():
    args = train_script.parse_args(["--entity", "team", "--upload_dataset", "val", "--bbox_interval", "5",
                                    "--artifact_alias", "v2", "--no-trackers"])
    config = train_script.config_from_args(args)
    assert (config.entity, config.upload_dataset, config.bbox_interval, config.artifact_alias, config.trackers) == (
        "team", "val", 5, "v2", False)
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert train_script.config_from_args(train_script.parse_args(["--upload_dataset"])).upload_dataset is True
    from utils.trainer.resume import option_changes

    assert option_changes({"trackers": False}, TrainConfig()) == {"trackers": (True, False)}


# ---------------------------------------------------------------------- MLflow against a real server

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(folder: Path):
    """``mlflow server`` on 127.0.0.1 (a free port), SQLite store and served artifacts in ``folder``; yields
    (uri, process)."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = open(folder / "server.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                                "--workers", "1", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
                                "--artifacts-destination", str(folder / "artifacts")],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=SERVER_ENV)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_WAIT_S
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield uri, process
    finally:
        stop(process)
        log.close()


def stop(process: subprocess.Popen) -> None:
    """End the server (its whole process group: uvicorn's worker included)."""
    import signal

    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not MLFLOW:
        pytest.skip("mlflow not installed (pip install -r requirements-trackers.txt)")
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as (uri, _):
        yield uri


@pytest.fixture
def tracked(server, monkeypatch):
    """MLflow on (the server's URI set), and MLflow's client failing fast rather than retrying for minutes."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=server)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("trackers")
    return (root, *make_tiny_run(root))


def tiny_args(tiny, project: str, *extra: str) -> list[str]:
    root, data, cfg = tiny
    return ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size", "4",
            "--workers", "0", "--device", "cpu", "--project", str(root / project), "--noautoanchor",
            "--no-tensorboard", *extra]


def train_capturing_stdout(args: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = train_script.main(args)
    return status, out.getvalue()


def only_run(client, project: Path):
    experiment = client.get_experiment_by_name(str(project))
    (run,) = client.search_runs([experiment.experiment_id])
    return run


def assert_metrics_equal_results_csv(client, run_id: str, results_csv: Path) -> None:
    """Every results.csv column, logged once per epoch at step = epoch, equal to the file's value (5 digits)."""
    table = read_results_csv(results_csv)
    epochs = [int(e) for e in table["epoch"]]
    for key in RESULTS_KEYS:
        history = client.get_metric_history(run_id, METRIC_NAMES[key]["mlflow"])
        assert [m.step for m in history] == epochs, key  # each epoch once, in order
        assert [m.value for m in history] == pytest.approx(table[key].tolist(), rel=1e-4, abs=1e-12), key


def artifact_names(client, run_id: str, folder: str | None = None) -> set[str]:
    return {Path(info.path).name for info in client.list_artifacts(run_id, folder)}


@needs_mlflow
def test_mlflow_run_holds_params_metrics_equal_to_results_csv_and_the_files(tiny, tracked):
    status, out = train_capturing_stdout(tiny_args(tiny, "plain", "--epochs", "3", "--save-period", "2"))
    assert status == 0, out[-3000:]
    run_folder = tiny[0] / "plain" / "exp"
    run = only_run(tracked, tiny[0] / "plain")
    (start,) = [line for line in out.splitlines() if line.startswith("Trackers:")]  # other trackers: off or absent
    assert start.startswith(f"Trackers: MLflow on (MLFLOW_TRACKING_URI={tracked.tracking_uri}): {tracked.tracking_uri}"
                            f"/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}; ")
    assert start.endswith("; --no-trackers turns them off")
    assert "WARNING" not in out
    assert (run.info.run_name, run.info.status) == ("exp", "FINISHED")
    params = run.data.params
    assert params["epochs"] == "3" and params["save_period"] == "2" and params["hyp/lr0"] == "0.01"
    assert params["imgsz"] == "64" and params["trackers"] == "True" and params["save_dir"] == str(run_folder)
    assert_metrics_equal_results_csv(tracked, run.info.run_id, run_folder / "results.csv")
    top = artifact_names(tracked, run.info.run_id)
    assert {"results.csv", "opt.yaml", "hyp.yaml", "labels.jpg", "labels_correlogram.jpg", "results.png", "PR_curve.png",
            "confusion_matrix.png", "train_batch0.jpg", "val_batch0_pred.jpg"} <= top
    assert artifact_names(tracked, run.info.run_id, "weights") == {"best.pt", "epoch0.pt", "epoch2.pt"}
    local = Path(tracked.download_artifacts(run.info.run_id, "weights/best.pt", str(tiny[0] / "download")))
    assert local.read_bytes() == (run_folder / "weights" / "best.pt").read_bytes()  # stripped, as at the end


@needs_mlflow
def test_evolve_generations_are_child_runs_of_one_parent_run_per_evolution(tiny, tracked):
    """--evolve 2 under MLflow: one parent run named after the evolution, made by the first generation, and a child
    run per generation (mlflow.parentRunId), tagged with the evolution."""
    status, out = train_capturing_stdout(tiny_args(tiny, "evolving", "--evolve", "2", "--epochs", "1", "--name",
                                                   "search"))
    assert status == 0, out[-3000:]
    experiment = tracked.get_experiment_by_name(str(tiny[0] / "evolving"))
    runs = tracked.search_runs([experiment.experiment_id])
    (parent,) = [run for run in runs if run.data.tags.get("yolo-trainer.evolution_parent") == "search"]
    children = [run for run in runs if run.data.tags.get("yolo-trainer.evolution") == "search"]
    assert parent.info.run_name == "search" and len(runs) == 3
    assert sorted(run.info.run_name for run in children) == ["search-gen1", "search-gen2"]
    assert {run.data.tags["mlflow.parentRunId"] for run in children} == {parent.info.run_id}
    assert all(len(tracked.get_metric_history(run.info.run_id, "metrics/mAP_0.5")) == 1 for run in children)


@needs_mlflow
def test_resume_continues_the_same_mlflow_run_and_logs_no_epoch_twice(tiny, tracked, monkeypatch):
    from tests.test_resume import StopAfterEpoch
    from utils.trainer import trainer

    callbacks = trainer.Callbacks
    monkeypatch.setattr(trainer, "Callbacks", lambda: StopAfterEpoch(1, "crash"))  # right after epoch 1's checkpoint
    status, out = train_capturing_stdout(tiny_args(tiny, "resumed", "--epochs", "3", "--noplots"))
    assert status == 130, out[-3000:]
    monkeypatch.setattr(trainer, "Callbacks", callbacks)
    weights = tiny[0] / "resumed" / "exp" / "weights"
    stopped = only_run(tracked, tiny[0] / "resumed")
    assert stopped.info.status == "KILLED"
    assert [m.step for m in tracked.get_metric_history(stopped.info.run_id, "train/box_loss")] == [0, 1]
    # as if the process died after logging epoch 1 but before its checkpoint: the resumed run trains epoch 1 again
    shutil.copy(weights / "last.prev.pt", weights / "last.pt")
    status, out = train_capturing_stdout(["--resume", str(weights / "last.pt")])
    assert status == 0, out[-3000:]
    assert f"MLflow on (MLFLOW_TRACKING_URI={tracked.tracking_uri}): continuing its run: " in out
    run = only_run(tracked, tiny[0] / "resumed")  # still one run
    assert (run.info.run_id, run.info.status) == (stopped.info.run_id, "FINISHED")
    assert_metrics_equal_results_csv(tracked, run.info.run_id, weights.parent / "results.csv")  # 0, 1, 2 once each
    assert "best.pt" in artifact_names(tracked, run.info.run_id, "weights")


@needs_mlflow
def test_a_server_killed_mid_run_is_one_warning_and_training_ends_normally(tiny, tracked, monkeypatch, tmp_path):
    from utils.trainer import recorder

    with mlflow_server(tmp_path / "doomed") as (uri, process):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        log = recorder.Recorder.log

        def log_then_kill(self, epoch, values):
            if epoch == 1:
                stop(process)  # before epoch 1 is logged: its call and everything after fail
            log(self, epoch, values)

        monkeypatch.setattr(recorder.Recorder, "log", log_then_kill)
        status, out = train_capturing_stdout(tiny_args(tiny, "killed", "--epochs", "4", "--noplots"))
    assert status == 0, out[-3000:]
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: MLflow: log_epoch failed, no more logging to it;")
    assert len(read_results_csv(tiny[0] / "killed" / "exp" / "results.csv")["epoch"]) == 4
    assert (tiny[0] / "killed" / "exp" / "weights" / "best.pt").is_file()


def test_mlflow_is_on_only_when_installed_and_its_uri_is_set(monkeypatch):
    from utils.trackers.mlflow_tracker import MlflowTracker, shown_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if not MLFLOW:
        assert MlflowTracker.switch() is None  # not installed: nothing said
        return
    on, why = MlflowTracker.switch()
    assert not on and "MLFLOW_TRACKING_URI is not set" in why  # never a local ./mlruns unasked
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://me:pw@mlflow.example/")
    assert MlflowTracker.switch() == (True, "MLFLOW_TRACKING_URI=https://***@mlflow.example/")
    assert shown_uri("sqlite:///x.db") == "sqlite:///x.db"


@needs_mlflow
def test_a_server_down_at_start_is_one_warning_and_the_start_line_says_so(tiny, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # urllib3 warns at each retry: not shown
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    status, out = train_capturing_stdout(tiny_args(tiny, "down", "--epochs", "2", "--noplots"))
    assert status == 0, out[-3000:]
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: MLflow: start failed, no more logging to it;")
    assert "Retrying" not in out  # urllib3's line per retry is not shown (utils.loggers.setup_logging)
    assert "MLflow on (MLFLOW_TRACKING_URI=http://127.0.0.1:" in out and "not started (the warning above says why)" in out
    assert len(read_results_csv(tiny[0] / "down" / "exp" / "results.csv")["epoch"]) == 2


@needs_mlflow
@pytest.mark.slow
def test_two_processes_under_torchrun_log_one_run(tiny, tracked):
    """torchrun, 2 processes (gloo): rank 0 alone opens MLflow; one run, its metrics equal to results.csv."""
    root, data, cfg = tiny
    project = root / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
               str(Path(train_script.__file__)), "--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64",
               "--batch-size", "4", "--epochs", "2", "--workers", "0", "--device", "cpu", "--noautoanchor", "--noplots",
               "--no-tensorboard", "--project", str(project)]
    from tests.test_ddp import run as run_torchrun  # runs a job again after gloo's known rare abort

    done = run_torchrun(command)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("Trackers: MLflow on") == 1 and "WARNING: MLflow" not in done.stdout + done.stderr
    run = only_run(tracked, project)  # exactly one run
    assert run.info.status == "FINISHED"
    assert_metrics_equal_results_csv(tracked, run.info.run_id, project / "exp" / "results.csv")


@needs_mlflow
def test_a_continued_mlflow_run_gets_the_rows_it_lacks_once_and_a_missing_one_is_replaced(tracked, tmp_path):
    from utils.trackers import RunStart
    from utils.trackers.mlflow_tracker import MlflowTracker

    rows = [{"epoch": epoch, **dict.fromkeys(RESULTS_KEYS, epoch + 0.5)} for epoch in range(4)]
    first = MlflowTracker()
    first.start(RunStart("unit", "exp", {"epochs": 4}, tmp_path, rows=rows[:1]))  # the server got epoch 0 only
    second = MlflowTracker()  # resumed from a checkpoint that holds epochs 0-2 (1 and 2 were queued when it died)
    second.start(RunStart("unit", "exp", {"epochs": 4}, tmp_path, resume_id=first.run_id, rows=rows[:3]))
    for row in rows[2:]:  # epoch 2 trained again after a resume from an older checkpoint, then epoch 3
        second.log_epoch(row["epoch"], {key: value for key, value in row.items() if key != "epoch"})
    second.finish(True)
    history = tracked.get_metric_history(first.run_id, "metrics/mAP_0.5-0.95")
    assert [(m.step, m.value) for m in history] == [(e, e + 0.5) for e in range(4)]  # each epoch once
    assert second.run_id == first.run_id and second.note == "continuing its run: "
    assert tracked.get_run(first.run_id).data.params == {"epochs": "4"}  # params are logged once, at creation
    tracked.delete_run(first.run_id)
    third = MlflowTracker()  # its run deleted meanwhile: a new run, linked to the old one
    third.start(RunStart("unit", "exp", {"epochs": 4}, tmp_path, resume_id=first.run_id, rows=rows[:2]))
    assert third.run_id != first.run_id and "is not on this server, a new run" in third.note
    assert tracked.get_run(third.run_id).data.tags["yolo-trainer.resumed_from"] == first.run_id
    assert [m.step for m in tracked.get_metric_history(third.run_id, "train/box_loss")] == [0, 1]


def recording_trackers(monkeypatch) -> list:
    """Training runs get one FakeTracker that is on (its calls recorded); returns the list of those made."""
    from utils.trainer import recorder

    made = []

    class Recording(FakeTracker):
        switch = classmethod(lambda cls: (True, "test"))

        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(recorder, "open_trackers", lambda *args: open_trackers(*args, classes=(Recording,)))
    return made


@pytest.mark.parametrize("interval, epochs_drawn", [(2, [1]), (-1, [0, 1, 2])])
def test_val_images_with_predictions_go_to_the_trackers_every_bbox_interval_epochs(tmp_path, monkeypatch, interval,
                                                                                   epochs_drawn):
    """--bbox_interval N: the first val batch's predictions given to the trackers every N epochs (YOLOv5's W&B
    default for -1: every epoch up to 10 epochs); a tracker that takes a picture (the default) gets them drawn into
    <run>/val_predictions, in its worker thread; no tracker on, nothing drawn."""
    from utils import drawing

    made = recording_trackers(monkeypatch)
    drawn_in = []  # (file name, thread name) of each picture drawn
    plot_images = drawing.plot_images

    def recorded(images, targets, paths=None, fname=None, *args, **kwargs):
        drawn_in.append((Path(fname).name, threading.current_thread().name))
        return plot_images(images, targets, paths, fname, *args, **kwargs)

    monkeypatch.setattr(drawing, "plot_images", recorded)
    data, cfg = make_tiny_run(tmp_path)
    args = ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size", "4", "--epochs",
            "3", "--device", "cpu", "--project", str(tmp_path / "runs"), "--noautoanchor", "--noplots", "--workers",
            "0", "--bbox_interval", str(interval)]
    assert train_script.main(args) == 0
    folder = tmp_path / "runs" / "exp" / "val_predictions"
    assert sorted(p.name for p in folder.iterdir()) == [f"val_pred_epoch{e}.jpg" for e in epochs_drawn]
    # drawn in the tracker's worker thread, not on the training thread
    assert drawn_in == [(f"val_pred_epoch{e}.jpg", "tracker-fake") for e in epochs_drawn]
    logged = [(call[0], call[1]) for call in made[0].calls
              if call[0] == "log_epoch" or (call[0] == "log_files" and call[2] == "val_predictions")]
    expected = [("log_epoch", e) for e in range(3)]
    for e in reversed(epochs_drawn):  # each image right after its epoch's row (the trackers' step is that epoch)
        expected.insert(expected.index(("log_epoch", e)) + 1, ("log_files", [f"val_pred_epoch{e}.jpg"]))
    assert logged == expected
    assert train_script.main(args + ["--no-trackers"]) == 0
    assert not (tmp_path / "runs" / "exp2" / "val_predictions").exists()


def test_each_epochs_validation_per_class_and_best_pts_confusion_matrix_go_to_the_trackers(tmp_path, monkeypatch):
    """Each epoch's validation per class after its row; at the end, best.pt's confusion matrix (its validation counts
    one; an epoch's does not) at the last epoch's step."""
    made = recording_trackers(monkeypatch)
    data, cfg = make_tiny_run(tmp_path)
    assert train_script.main(["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size",
                              "4", "--epochs", "2", "--device", "cpu", "--project", str(tmp_path / "runs"),
                              "--noautoanchor", "--workers", "0", "--bbox_interval", "100"]) == 0
    calls = [call for call in made[0].calls if call[0] in ("log_epoch", "log_validation")]
    assert [call[:2] for call in calls] == [("log_epoch", 0), ("log_validation", 0), ("log_epoch", 1),
                                            ("log_validation", 1), ("log_validation", 1)]  # the last: best.pt's
    table = read_results_csv(tmp_path / "runs" / "exp" / "results.csv")
    for epoch, (_, _, per_class, confusion, names) in enumerate(calls[1:4:2]):
        assert names == ["class0", "class1"] and {row["name"] for row in per_class} <= set(names)
        assert {"precision", "recall", "f1", "tp", "fp", "instances", "mAP50", "mAP50-95"} <= set(per_class[0])
        assert confusion is None  # an epoch's validation counts no confusion matrix (as YOLOv5's)
        mean = np.mean([row["mAP50-95"] for row in per_class])
        assert mean == pytest.approx(table["metrics/mAP_0.5:0.95"][epoch], rel=1e-3, abs=1e-5)
    labels = sum(row["instances"] for row in calls[1][2])
    _, _, per_class, confusion, _ = calls[-1]  # best.pt's: the confusion matrix confusion_matrix.png draws
    assert per_class == [] and np.array(confusion).shape == (3, 3)  # the two classes and background
    assert np.array(confusion)[:, :2].sum() == labels > 0  # each label counted once: matched, or missed (background)


def test_evolve_generations_log_runs_grouped_under_the_evolution_with_their_files_in_its_folder(tmp_path, monkeypatch):
    """--evolve: each generation is a tracker run named <evolution>-gen<N>, grouped under the evolution's name, whose
    files go to the evolution's folder (a generation's own folder is removed when it ends); --no-trackers: none."""
    from utils.trainer import recorder

    starts = []

    class Recording(FakeTracker):
        switch = classmethod(lambda cls: (True, "test"))

        def start(self, run):
            starts.append((run.run_name, run.group, run.save_dir))
            super().start(run)

    monkeypatch.setattr(recorder, "open_trackers", lambda *args: open_trackers(*args, classes=(Recording,)))
    data, cfg = make_tiny_run(tmp_path)
    args = ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--evolve", "2", "--epochs", "1", "--imgsz", "64",
            "--batch-size", "4", "--workers", "0", "--device", "cpu", "--project", str(tmp_path / "runs"), "--name",
            "search", "--noautoanchor"]
    assert train_script.main(args) == 0
    folder = tmp_path / "runs" / "search"
    assert sorted(name for name, _, _ in starts) == ["search-gen1", "search-gen2"]  # evolve.csv counts from 1
    assert {(group, Path(save_dir)) for _, group, save_dir in starts} == {("search", folder)}
    starts.clear()
    assert train_script.main(args[:-1] + ["--name", "quiet", "--no-trackers", "--noautoanchor"]) == 0
    assert starts == []
    assert open_trackers(TrainConfig(), Hyp(), Path("runs/exp"), classes=(Recording,)).run.group == ""  # not evolving


def predictions_of(folder: Path, images: int = 2):
    from utils.trackers import ValPredictions

    pixels = torch.full((images, 3, 32, 48), 90, dtype=torch.uint8)
    detections = [torch.tensor([[4.0, 5, 20, 25, 0.9, 1], [0, 0, 10, 10, 0.2, 0], [1, 1, 9, 9, 0.25, 0]])]
    detections += [torch.zeros((0, 6))] * (images - 1)
    return ValPredictions(3, pixels, detections, [f"d/im{i}.jpg" for i in range(images)], ["cat", "dog"],
                          folder / "val_predictions" / "val_pred_epoch3.jpg")


def test_val_predictions_keep_the_first_16_images_as_rgb_and_their_boxes_at_conf_025_and_above(tmp_path):
    predictions = predictions_of(tmp_path, images=20)
    assert predictions.images.shape == (16, 32, 48, 3) and predictions.images.dtype == np.uint8
    assert len(predictions.boxes) == len(predictions.paths) == 16 and predictions.paths[0] == "d/im0.jpg"
    assert predictions.boxes[0].tolist() == [[4, 5, 20, 25, pytest.approx(0.9), 1], [1, 1, 9, 9, 0.25, 0]]
    assert [predictions.label(cls) for cls in (0, 1, 7)] == ["cat", "dog", "7"]


def test_val_predictions_are_drawn_once_whichever_tracker_thread_asks_first(tmp_path, monkeypatch):
    from utils import drawing

    calls = []
    plot_images = drawing.plot_images

    def slow(*args, **kwargs):
        calls.append(threading.current_thread().name)
        time.sleep(0.2)  # the others ask meanwhile, and wait
        return plot_images(*args, **kwargs)

    monkeypatch.setattr(drawing, "plot_images", slow)
    predictions = predictions_of(tmp_path)
    got = []
    threads = [threading.Thread(target=lambda: got.append(predictions.drawn()), name=f"t{i}") for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and got == [predictions.file] * 3
    picture = cv2.imread(str(predictions.file))
    assert picture is not None and (np.abs(picture.astype(int) - 90).max(axis=2) > 40).any()  # a box drawn on grey


def test_val_predictions_that_cannot_be_drawn_are_one_warning_and_none(tmp_path, caplog):
    (tmp_path / "val_predictions").write_text("a file where the folder should be")
    predictions = predictions_of(tmp_path)
    assert predictions.drawn() is None and predictions.drawn() is None
    assert len([r for r in caplog.records if "not drawn" in r.getMessage()]) == 1
