"""Comet (utils.trackers.comet_tracker) in offline mode: a tiny training run read back from its OfflineExperiment
archive (the zip's experiment.json and messages.json): params, per-epoch metrics equal to results.csv at step = epoch,
images, run files and models; a --resume, which an offline archive cannot continue, starts a new run linked to the
old one; the switch. No network: COMET_MODE=offline. Skips by name without ``comet_ml``."""
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

NEEDS_COMET = "comet_ml not installed (pip install -r requirements-trackers.txt)"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Comet on in offline mode (no key, no config file), every other tracker off."""
    pytest.importorskip("comet_ml", reason=NEEDS_COMET)
    for name in ("COMET_API_KEY", "COMET_PROJECT_NAME", "MLFLOW_TRACKING_URI", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COMET_MODE", "offline")
    monkeypatch.setenv("COMET_CONFIG", str(tmp_path / "no.comet.config"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(tmp_path / "no-clearml.conf"))
    return tmp_path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("comet")
    return (root, *make_tiny_run(root))


def read_archive(path: Path) -> tuple[dict, list[dict], set[str]]:
    """(experiment.json, messages.json's messages, the archive's file names) of an OfflineExperiment archive."""
    with zipfile.ZipFile(path) as archive:
        experiment = json.loads(archive.read("experiment.json"))
        messages = [json.loads(line) for line in archive.read("messages.json").splitlines() if line.strip()]
        return experiment, messages, set(archive.namelist())


def payloads(messages: list[dict], kind: str) -> list[dict]:
    return [message["payload"] for message in messages if message["type"] == kind]


def metric_rows(messages: list[dict]) -> dict[int, dict]:
    """Step -> {metric name: value}; a metric logged twice at one step is refused here."""
    rows: dict[int, dict] = {}
    for payload in payloads(messages, "metric_msg"):
        metric = payload["metric"]
        row = rows.setdefault(metric["step"], {})
        assert metric["metricName"] not in row, f"{metric['metricName']} logged twice at step {metric['step']}"
        row[metric["metricName"]] = float(metric["metricValue"])
    return rows


def assert_metrics_equal_results_csv(rows: dict[int, dict], results_csv: Path) -> None:
    table = read_results_csv(results_csv)
    assert sorted(rows) == [int(e) for e in table["epoch"]]
    for key in RESULTS_KEYS:
        logged = [rows[step][METRIC_NAMES[key]["comet"]] for step in sorted(rows)]
        assert logged == pytest.approx(table[key].tolist(), rel=1e-4, abs=1e-12), key


def uploads(messages: list[dict]) -> dict[str, list]:
    """Upload type -> the names of the files uploaded as it (images, assets, model elements)."""
    found: dict[str, list] = {}
    for payload in payloads(messages, "file_upload"):
        extra = payload["additional_params"]
        found.setdefault(payload["upload_type"], []).append(extra.get("fileName") or extra.get("figName"))
    return found


def test_comet_offline_archive_holds_params_metrics_equal_to_results_csv_and_the_files(tiny, offline, capsys):
    status, out = train_capturing_stdout(tiny_args(tiny, "plain", "--epochs", "3", "--save-period", "2"))
    assert status == 0, out[-3000:]
    run_folder = tiny[0] / "plain" / "exp"
    (archive,) = (run_folder / "comet").glob("*.zip")  # inside the run folder
    experiment, messages, names = read_archive(archive)
    (start,) = [line for line in out.splitlines() if line.startswith("Trackers:")]
    assert (f"Comet on (COMET_MODE=offline): offline run in {run_folder / 'comet'} (upload: comet upload {archive})"
            in start)
    assert "WARNING" not in out + capsys.readouterr().err  # nor any of Comet's own
    assert experiment["project_name"] == "plain" and experiment["offline_id"] == archive.stem
    others = {payload["key"]: payload["value"] for payload in payloads(messages, "log_other")}
    assert others["Name"] == "exp" and others["run_folder"] == str(run_folder)
    params = {param["paramName"]: param["paramValue"] for param in
              (payload.get("param") or payload["params"] for payload in payloads(messages, "parameter_msg"))
              if param["source"] == "manual"}  # "params": a list value's message
    assert params["epochs"] == 3 and params["save_period"] == 2 and params["hyp/lr0"] == 0.01
    assert_metrics_equal_results_csv(metric_rows(messages), run_folder / "results.csv")
    files = uploads(messages)
    assert sorted(files["model-element"]) == ["best.pt", "epoch1.pt"]
    assert {"train_batch0.jpg", "results.png", "PR_curve.png", "val_batch0_pred.jpg", "labels.jpg"} <= set(
        files["visualization"]) and {"results.csv", "opt.yaml", "hyp.yaml"} <= set(files["asset"])
    stored = {payload["file_path"] for payload in payloads(messages, "file_upload")}
    assert stored <= names  # every uploaded file is in the archive


def test_an_offline_comet_run_cannot_be_continued_so_a_resume_starts_a_linked_run(tiny, offline, monkeypatch):
    from tests.test_resume import StopAfterEpoch
    from utils.trainer import trainer

    callbacks = trainer.Callbacks
    monkeypatch.setattr(trainer, "Callbacks", lambda: StopAfterEpoch(1, "crash"))
    status, out = train_capturing_stdout(tiny_args(tiny, "resumed", "--epochs", "3", "--noplots"))
    assert status == 130, out[-3000:]
    monkeypatch.setattr(trainer, "Callbacks", callbacks)
    run_folder = tiny[0] / "resumed" / "exp"
    (first,) = (run_folder / "comet").glob("*.zip")
    status, out = train_capturing_stdout(["--resume", str(run_folder / "weights" / "last.pt")])
    assert status == 0, out[-3000:]
    assert (f"Comet on (COMET_MODE=offline): an offline Comet run cannot be continued, a new run linked to "
            f"{first.stem}: offline run in ") in out
    (second,) = set((run_folder / "comet").glob("*.zip")) - {first}
    _, messages, _ = read_archive(second)
    others = {payload["key"]: payload["value"] for payload in payloads(messages, "log_other")}
    assert others["resumed_from"] == first.stem and others["Name"] == "exp"
    assert_metrics_equal_results_csv(metric_rows(messages), run_folder / "results.csv")  # the whole run, each once
    assert sorted(metric_rows(read_archive(first)[1])) == [0, 1]
    assert ("stopped", True) in [(p["key"], p["value"]) for p in payloads(read_archive(first)[1], "log_other")]


def test_comet_is_on_as_yolov5_switches_it(monkeypatch, tmp_path):
    from utils.trackers.comet_tracker import CometTracker, project_name

    for name in ("COMET_API_KEY", "COMET_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COMET_CONFIG", str(tmp_path / "comet.config"))
    assert project_name("runs/train") == "yolov5" and project_name("/x/runs/bccd") == "bccd"
    if CometTracker.switch() is None:  # not installed: nothing said
        pytest.importorskip("comet_ml", reason=NEEDS_COMET)
    assert CometTracker.switch() == (False, "no COMET_API_KEY, ~/.comet.config or COMET_MODE=offline")
    (tmp_path / "comet.config").write_text("[comet]\napi_key = abc\n")
    assert CometTracker.switch() == (True, f"api_key in {tmp_path / 'comet.config'}")
    monkeypatch.setenv("COMET_API_KEY", "k")
    assert CometTracker.switch() == (True, "COMET_API_KEY is set")
    monkeypatch.setenv("COMET_MODE", "offline")
    assert CometTracker.switch() == (True, "COMET_MODE=offline")
    monkeypatch.setenv("COMET_MODE", "disabled")
    assert CometTracker.switch() == (False, "COMET_MODE=disabled")
