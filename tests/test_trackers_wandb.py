"""Weights & Biases (utils.trackers.wandb_tracker) in offline mode: a tiny training run read back from its offline
run's transaction log with wandb's own record schema (params, per-epoch metrics equal to results.csv at step = epoch,
images, run files, model artifacts, the exit code), a --resume into the same run id without an epoch logged twice,
and the switch. No network: WANDB_MODE=offline, wandb's own folders under tmp_path. Skips by name without ``wandb``."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import make_tiny_run
from tests.test_trackers import tiny_args, train_capturing_stdout
from utils.loggers import RESULTS_KEYS
from utils.plots import read_results_csv
from utils.trackers import METRIC_NAMES

NEEDS_WANDB = "wandb not installed (pip install -r requirements-trackers.txt)"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B on in offline mode, its cache, config and data folders under tmp_path, every other tracker off."""
    pytest.importorskip("wandb", reason=NEEDS_WANDB)
    for name in ("WANDB_API_KEY", "WANDB_DISABLED", "MLFLOW_TRACKING_URI", "COMET_API_KEY", "COMET_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(tmp_path / "no-clearml.conf"))
    return tmp_path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb")
    return (root, *make_tiny_run(root))


def offline_logs(run_folder: Path) -> list[Path]:
    return sorted((run_folder / "wandb").glob("offline-run-*/run-*.wandb"))


def by_type(records, kind: str) -> list:
    return [getattr(record, kind) for record in records if record.WhichOneof("record_type") == kind]


def history_rows(records) -> dict[int, dict]:
    """Step -> {key: value} of every history record (a step logged twice would be two rows: refused here)."""
    rows = {}
    for history in by_type(records, "history"):
        assert history.step.num not in rows, f"step {history.step.num} logged twice"
        rows[history.step.num] = {"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                                  for item in history.item}
    return rows


def assert_metrics_equal_results_csv(rows: dict[int, dict], results_csv: Path) -> None:
    table = read_results_csv(results_csv)
    assert sorted(rows) == [int(e) for e in table["epoch"]]  # each epoch once, at step = epoch
    for key in RESULTS_KEYS:
        logged = [rows[step][METRIC_NAMES[key]["wandb"]] for step in sorted(rows)]
        assert logged == pytest.approx(table[key].tolist(), rel=1e-4, abs=1e-12), key


def test_wandb_offline_run_holds_params_metrics_equal_to_results_csv_and_the_files(tiny, offline, capsys):
    from utils.trackers.wandb_tracker import read_records

    status, out = train_capturing_stdout(tiny_args(tiny, "plain", "--epochs", "3", "--save-period", "2",
                                                   "--upload_dataset", "val"))
    assert status == 0, out[-3000:]
    run_folder = tiny[0] / "plain" / "exp"
    (log,) = offline_logs(run_folder)  # inside the run folder
    records = read_records(log)
    (run,) = by_type(records, "run")
    (start,) = [line for line in out.splitlines() if line.startswith("Trackers:")]
    assert start.startswith(f"Trackers: W&B on (WANDB_MODE=offline): offline run {run.run_id} in {log.parent} (upload: "
                            f"wandb sync {run_folder / 'wandb'})")
    assert "WARNING" not in out + capsys.readouterr().err  # nor any of wandb's own
    assert (run.project, run.display_name) == ("plain", "exp")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["epochs"] == 3 and config["save_period"] == 2 and config["hyp/lr0"] == 0.01
    assert config["save_dir"] == str(run_folder)
    rows = history_rows(records)
    assert_metrics_equal_results_csv(rows, run_folder / "results.csv")
    assert rows[0]["Mosaics/captions"] == ["train_batch0.jpg", "train_batch1.jpg"]  # at their epoch's step
    assert {"results.png", "PR_curve.png", "confusion_matrix.png"} <= set(rows[2]["Results/captions"])
    assert "val_batch0_pred.jpg" in rows[2]["Validation/captions"]
    for name in rows[0]["Mosaics/filenames"] + rows[2]["Results/filenames"]:
        assert (log.parent / "files" / name).is_file()
    saved = {file.path for files in by_type(records, "files") for file in files.files}
    assert {"results.csv", "opt.yaml", "hyp.yaml"} <= saved
    dataset, *artifacts = by_type(records, "artifact")
    assert (dataset.name, dataset.type, list(dataset.aliases)) == ("val", "dataset", ["latest"])
    assert sorted(entry.path for entry in dataset.manifest.contents) == sorted(
        f"{kind}/val/im{index}.{suffix}" for index in range(4) for kind, suffix in (("images", "jpg"), ("labels", "txt")))
    models = [(artifact.name, sorted(artifact.aliases), [entry.path for entry in artifact.manifest.contents])
              for artifact in artifacts]
    assert models == [(f"run_{run.run_id}_model", ["epoch 1", "last", "latest"], ["epoch1.pt"]),
                      (f"run_{run.run_id}_model", ["best", "latest", "stripped"], ["best.pt"])]
    (exit_record,) = by_type(records, "exit")
    assert exit_record.exit_code == 0
    assert not (offline / "wandb-home" / "wandb_dir").exists()  # the run's files went to the run folder


def test_resume_continues_the_same_wandb_run_and_logs_no_epoch_twice(tiny, offline, monkeypatch):
    from tests.test_resume import StopAfterEpoch
    from utils.trackers.wandb_tracker import read_records
    from utils.trainer import trainer

    callbacks = trainer.Callbacks
    monkeypatch.setattr(trainer, "Callbacks", lambda: StopAfterEpoch(1, "crash"))  # right after epoch 1's checkpoint
    status, out = train_capturing_stdout(tiny_args(tiny, "resumed", "--epochs", "3", "--noplots"))
    assert status == 130, out[-3000:]
    monkeypatch.setattr(trainer, "Callbacks", callbacks)
    run_folder = tiny[0] / "resumed" / "exp"
    (first,) = offline_logs(run_folder)
    first_records = read_records(first)
    assert sorted(history_rows(first_records)) == [0, 1] and by_type(first_records, "exit")[0].exit_code == 1
    # as if the process died after logging epoch 1 but before its checkpoint: the resumed run trains epoch 1 again
    shutil.copy(run_folder / "weights" / "last.prev.pt", run_folder / "weights" / "last.pt")
    status, out = train_capturing_stdout(["--resume", str(run_folder / "weights" / "last.pt")])
    assert status == 0, out[-3000:]
    assert "W&B on (WANDB_MODE=offline): continuing its run: offline run " in out
    logs = offline_logs(run_folder)
    assert len(logs) == 2 and {log.name for log in logs} == {first.name}  # one run id, two offline parts
    second = read_records(logs[1])
    assert sorted(history_rows(second)) == [2]  # epoch 1 was in the first part: not logged again
    assert_metrics_equal_results_csv({**history_rows(first_records), **history_rows(second)},
                                     run_folder / "results.csv")
    assert by_type(second, "exit")[0].exit_code == 0


def test_wandb_is_on_as_yolov5_switches_it(monkeypatch, tmp_path):
    from utils.trackers.wandb_tracker import WandbTracker, project_name

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert project_name("runs/train") == "YOLOv5" and project_name("/x/runs/bccd") == "bccd"
    if WandbTracker.switch() is None:  # not installed: nothing said
        pytest.importorskip("wandb", reason=NEEDS_WANDB)
    assert WandbTracker.switch() == (False, "not logged in: wandb login, or WANDB_MODE=offline")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password k123\n")
    assert WandbTracker.switch() == (True, f"logged in ({tmp_path / 'netrc'})")
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example")
    assert WandbTracker.switch()[0] is False  # the key is for another host
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert WandbTracker.switch() == (True, "WANDB_API_KEY is set")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert WandbTracker.switch() == (False, "WANDB_MODE=disabled")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert WandbTracker.switch() == (True, "WANDB_MODE=offline")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    assert WandbTracker.switch() == (False, "WANDB_MODE=disabled")
