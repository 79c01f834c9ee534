"""ClearML (utils.trackers.clearml_tracker) in offline mode: a tiny training run read back from its offline session
zip (task.json, metrics.jsonl and the stored files): params, per-epoch scalars equal to results.csv at iteration =
epoch, debug images, artifacts; a --resume, which an offline session cannot continue, starts a new task linked to the
old one; the switch. No network: CLEARML_OFFLINE_MODE=1. Skips by name without ``clearml``."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from tests.conftest import make_tiny_run
from tests.test_trackers import tiny_args, train_capturing_stdout
from utils.loggers import RESULTS_KEYS
from utils.plots import read_results_csv
from utils.trackers import METRIC_NAMES

NEEDS_CLEARML = "clearml not installed (pip install -r requirements-trackers.txt)"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """ClearML on in offline mode (no configuration, its home files under tmp_path), every other tracker off."""
    pytest.importorskip("clearml", reason=NEEDS_CLEARML)
    for name in ("CLEARML_API_ACCESS_KEY", "CLEARML_API_SECRET_KEY", "CLEARML_CACHE_DIR", "MLFLOW_TRACKING_URI",
                 "COMET_API_KEY", "COMET_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(tmp_path / "no-clearml.conf"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    return tmp_path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("clearml")
    return (root, *make_tiny_run(root))


def read_session(path: Path) -> tuple[dict, list[dict], set[str]]:
    """(task.json, metrics.jsonl's events, the zip's file names) of an offline session zip."""
    with zipfile.ZipFile(path) as archive:
        task = json.loads(archive.read("task.json"))
        events = [event for line in archive.read("metrics.jsonl").splitlines() if line.strip()
                  for event in json.loads(line)]
        return task, events, set(archive.namelist())


def scalar_rows(events: list[dict]) -> dict[int, dict]:
    """Iteration -> {"title/series": value}; a scalar reported twice at one iteration is refused here."""
    rows: dict[int, dict] = {}
    for event in events:
        if event["type"] == "training_stats_scalar":
            row, name = rows.setdefault(event["iter"], {}), f"{event['metric']}/{event['variant']}"
            assert name not in row, f"{name} reported twice at iteration {event['iter']}"
            row[name] = float(event["value"])
    return rows


def assert_scalars_equal_results_csv(rows: dict[int, dict], results_csv: Path) -> None:
    table = read_results_csv(results_csv)
    assert sorted(rows) == [int(e) for e in table["epoch"]]
    for key in RESULTS_KEYS:
        logged = [rows[step][METRIC_NAMES[key]["clearml"]] for step in sorted(rows)]
        assert logged == pytest.approx(table[key].tolist(), rel=1e-4, abs=1e-12), key


def sessions(run_folder: Path) -> list[Path]:
    return sorted((run_folder / "clearml" / "offline").glob("*.zip"), key=lambda path: path.stat().st_mtime)


def test_clearml_offline_session_holds_params_scalars_equal_to_results_csv_and_the_files(tiny, offline, capsys):
    status, out = train_capturing_stdout(tiny_args(tiny, "plain", "--epochs", "3", "--save-period", "2"))
    assert status == 0, out[-3000:]
    run_folder = tiny[0] / "plain" / "exp"
    (session,) = sessions(run_folder)  # inside the run folder
    task, events, names = read_session(session)
    (start,) = [line for line in out.splitlines() if line.startswith("Trackers:")]
    assert f"ClearML on (CLEARML_OFFLINE_MODE=1): offline session {session.with_suffix('')}" in start
    assert "WARNING" not in out + capsys.readouterr().err
    assert (task["project_name"], task["name"], task["id"]) == ("plain", "exp", session.stem)
    args, hyp = task["hyperparams"]["Args"], task["hyperparams"]["Hyperparameters"]
    assert args["epochs"]["value"] == "3" and args["save_period"]["value"] == "2" and hyp["lr0"]["value"] == "0.01"
    assert task["hyperparams"]["yolo-trainer"]["run_folder"]["value"] == str(run_folder)
    assert_scalars_equal_results_csv(scalar_rows(events), run_folder / "results.csv")
    images = {(event["metric"], event["variant"], event["iter"]) for event in events
              if event["type"] == "training_debug_image"}
    assert {("Mosaics", "train_batch0.jpg", 0), ("Results", "results.png", 2), ("Validation", "val_batch0_pred.jpg", 2),
            ("Labels", "labels.jpg", 2)} <= images
    artifacts = {artifact["key"]: artifact for artifact in task["execution"]["artifacts"]}
    assert {"results.csv", "opt.yaml", "hyp.yaml", "weights/epoch1.pt", "weights/best.pt"} <= set(artifacts)
    best = artifacts["weights/best.pt"]["uri"]
    stored = Path(best).relative_to(session.with_suffix("")).as_posix()
    assert stored in names and Path(best).read_bytes() == (run_folder / "weights" / "best.pt").read_bytes()
    assert not list(Path(offline).glob("**/offline-*.zip"))  # nothing outside the run folder


def test_an_offline_clearml_run_cannot_be_continued_so_a_resume_starts_a_linked_task(tiny, offline, monkeypatch):
    from tests.test_resume import StopAfterEpoch
    from utils.trainer import trainer

    callbacks = trainer.Callbacks
    monkeypatch.setattr(trainer, "Callbacks", lambda: StopAfterEpoch(1, "crash"))
    status, out = train_capturing_stdout(tiny_args(tiny, "resumed", "--epochs", "3", "--noplots"))
    assert status == 130, out[-3000:]
    monkeypatch.setattr(trainer, "Callbacks", callbacks)
    run_folder = tiny[0] / "resumed" / "exp"
    (first,) = sessions(run_folder)
    assert sorted(scalar_rows(read_session(first)[1])) == [0, 1]
    status, out = train_capturing_stdout(["--resume", str(run_folder / "weights" / "last.pt")])
    assert status == 0, out[-3000:]
    assert (f"ClearML on (CLEARML_OFFLINE_MODE=1): an offline ClearML run cannot be continued, a new run linked to "
            f"{first.stem}: offline session ") in out
    (second,) = set(sessions(run_folder)) - {first}
    task, events, _ = read_session(second)
    assert task["hyperparams"]["yolo-trainer"]["resumed_from"]["value"] == first.stem
    assert_scalars_equal_results_csv(scalar_rows(events), run_folder / "results.csv")  # the whole run, each once


def test_clearml_is_on_as_yolov5_switches_it(monkeypatch, tmp_path):
    from utils.trackers.clearml_tracker import ClearmlTracker, project_name

    for name in ("CLEARML_API_ACCESS_KEY", "CLEARML_API_SECRET_KEY", "CLEARML_OFFLINE_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(tmp_path / "clearml.conf"))
    assert project_name("runs/train") == "YOLOv5" and project_name("/x/runs/bccd") == "bccd"
    if ClearmlTracker.switch() is None:  # not installed: nothing said
        pytest.importorskip("clearml", reason=NEEDS_CLEARML)
    assert ClearmlTracker.switch() == (False, "not configured: clearml-init, or CLEARML_OFFLINE_MODE=1")
    (tmp_path / "clearml.conf").write_text("api {}\n")
    assert ClearmlTracker.switch() == (True, f"configured ({tmp_path / 'clearml.conf'})")
    (tmp_path / "clearml.conf").unlink()
    monkeypatch.setenv("CLEARML_API_ACCESS_KEY", "a")
    monkeypatch.setenv("CLEARML_API_SECRET_KEY", "s")
    assert ClearmlTracker.switch() == (True, "CLEARML_API_ACCESS_KEY and CLEARML_API_SECRET_KEY are set")
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    assert ClearmlTracker.switch() == (True, "CLEARML_OFFLINE_MODE=1")
