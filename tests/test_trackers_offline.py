"""W&B, Comet and ClearML in their offline modes (utils.trackers.wandb_tracker, comet_tracker, clearml_tracker): one
tiny training run, and one run crashed after epoch 1 then resumed, with every installed tracker on at once (as a user
with all three set up has them), each read back with its own format's reader:

- W&B: the offline run's ``.wandb`` transaction log through wandb's own record schema: params, per-epoch metrics equal
  to results.csv at step = epoch, images, run files, the dataset and model artifacts, the exit code; the resume
  continues the same run id without an epoch logged twice;
- Comet: the OfflineExperiment archive (experiment.json, messages.json): the same; a resume starts a linked run;
- ClearML: the offline session zip (task.json, metrics.jsonl): the same; a resume starts a linked task;

and each tracker's switch. No network (no credentials, offline modes, the packages' home folders under tmp). Each
tracker's tests skip by name without its package (requirements-trackers.txt; CI installs none of them)."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shutil
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

import train as train_script
from tests.conftest import make_tiny_run
from tests.test_trackers import tiny_args
from utils.loggers import RESULTS_KEYS
from utils.plots import read_results_csv
from utils.trackers import METRIC_NAMES

NEEDS = {name: f"{package} not installed (pip install -r requirements-trackers.txt)"
         for name, package in (("wandb", "wandb"), ("comet", "comet_ml"), ("clearml", "clearml"))}
PACKAGES = {"wandb": "wandb", "comet": "comet_ml", "clearml": "clearml"}
OFFLINE = {"WANDB_MODE": "offline", "COMET_MODE": "offline", "CLEARML_OFFLINE_MODE": "1"}
CREDENTIALS = ("WANDB_API_KEY", "WANDB_DISABLED", "COMET_API_KEY", "COMET_PROJECT_NAME", "CLEARML_API_ACCESS_KEY",
               "CLEARML_API_SECRET_KEY", "CLEARML_CACHE_DIR", "MLFLOW_TRACKING_URI")


def needs(name: str):
    """Skip (by the package's name) unless the tracker's package is installed."""
    pytest.importorskip(PACKAGES[name], reason=NEEDS[name])


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """Every installed tracker on in its offline mode, with no credentials and its home folders under tmp."""
    if not any(importlib.util.find_spec(package) for package in PACKAGES.values()):
        pytest.skip("none of wandb, comet_ml, clearml installed (pip install -r requirements-trackers.txt)")
    root = tmp_path_factory.mktemp("offline-trackers")
    with pytest.MonkeyPatch.context() as patch:
        for name in CREDENTIALS:
            patch.delenv(name, raising=False)
        for name, value in OFFLINE.items():
            patch.setenv(name, value)
        for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            patch.setenv(name, str(root / "home" / name.lower()))
        patch.setenv("COMET_CONFIG", str(root / "home" / "no.comet.config"))
        patch.setenv("CLEARML_CONFIG_FILE", str(root / "home" / "no-clearml.conf"))
        patch.setenv("NETRC", str(root / "home" / "no-netrc"))
        yield (root, *make_tiny_run(root))


def train(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = train_script.main(args)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def plain(offline):
    """A 3-epoch run with --save-period 2 and --upload_dataset val: its folder, stdout and stderr."""
    status, out, err = train(tiny_args(offline, "plain", "--epochs", "3", "--save-period", "2",
                                       "--upload_dataset", "val"))
    assert status == 0, out[-3000:]
    (start,) = [line for line in out.splitlines() if line.startswith("Trackers:")]
    return SimpleNamespace(folder=offline[0] / "plain" / "exp", out=out, err=err, start=start, home=offline[0] / "home")


@pytest.fixture(scope="module")
def resumed(offline):
    """A run crashed right after epoch 1's checkpoint; then, as if the process had died after logging epoch 1 but
    before that checkpoint, epoch 0's checkpoint is restored and the run resumed (epoch 1 trains again). Its folder,
    the trackers' files after the first part, and the resumed process's stdout."""
    from tests.test_resume import StopAfterEpoch
    from utils.trainer import trainer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "Callbacks", lambda: StopAfterEpoch(1, "crash"))
        status, out, _ = train(tiny_args(offline, "resumed", "--epochs", "3", "--noplots"))
    assert status == 130, out[-3000:]
    folder = offline[0] / "resumed" / "exp"
    first = {"wandb": offline_logs(folder), "comet": sorted((folder / "comet").glob("*.zip")),
             "clearml": sessions(folder)}
    shutil.copy(folder / "weights" / "last.prev.pt", folder / "weights" / "last.pt")
    status, out, _ = train(["--resume", str(folder / "weights" / "last.pt")])
    assert status == 0, out[-3000:]
    return SimpleNamespace(folder=folder, first=first, out=out)


def assert_rows_equal_results_csv(rows: dict[int, dict], results_csv: Path, tracker: str) -> None:
    """Step -> {name: value} equal to results.csv: each epoch once, at step = epoch, under the tracker's names."""
    table = read_results_csv(results_csv)
    assert sorted(rows) == [int(e) for e in table["epoch"]]
    for key in RESULTS_KEYS:
        logged = [rows[step][METRIC_NAMES[key][tracker]] for step in sorted(rows)]
        assert logged == pytest.approx(table[key].tolist(), rel=1e-4, abs=1e-12), key


def test_no_warning_from_the_trackers_or_their_packages(offline, plain):
    assert "WARNING" not in plain.out + plain.err


# ---------------------------------------------------------------------- W&B: the offline run's transaction log

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


def test_wandb_offline_run_holds_params_metrics_equal_to_results_csv_and_the_files(request):
    needs("wandb")
    from utils.trackers.wandb_tracker import read_records

    plain = request.getfixturevalue("plain")
    (log,) = offline_logs(plain.folder)  # inside the run folder
    records = read_records(log)
    (run,) = by_type(records, "run")
    assert (f"W&B on (WANDB_MODE=offline): offline run {run.run_id} in {log.parent} (upload: wandb sync "
            f"{plain.folder / 'wandb'})") in plain.start
    assert (run.project, run.display_name) == ("plain", "exp")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["epochs"] == 3 and config["save_period"] == 2 and config["hyp/lr0"] == 0.01
    assert config["save_dir"] == str(plain.folder)
    rows = history_rows(records)
    assert_rows_equal_results_csv(rows, plain.folder / "results.csv", "wandb")
    assert rows[0]["Mosaics/captions"] == ["train_batch0.jpg", "train_batch1.jpg"]  # at their epoch's step
    assert {"results.png", "PR_curve.png", "confusion_matrix.png"} <= set(rows[2]["Results/captions"])
    assert "val_batch0_pred.jpg" in rows[2]["Validation/captions"]
    for step in range(3):  # --bbox_interval's default on 3 epochs: every epoch, the val batch's 4 images
        assert rows[step]["Bounding Box Debugger/Images/count"] == 4
    for name in rows[0]["Mosaics/filenames"] + rows[2]["Results/filenames"]:
        assert (log.parent / "files" / name).is_file()
    saved = {file.path for files in by_type(records, "files") for file in files.files}
    assert {"results.csv", "opt.yaml", "hyp.yaml"} <= saved
    dataset, *artifacts = by_type(records, "artifact")
    assert (dataset.name, dataset.type, list(dataset.aliases)) == ("val", "dataset", ["latest"])
    expected = [f"{kind}/val/im{index}.{suffix}" for index in range(4)
                for kind, suffix in (("images", "jpg"), ("labels", "txt"))]
    entries = {entry.path: entry for entry in dataset.manifest.contents}
    assert sorted(path for path in entries if not path.startswith("media/")) == sorted(expected + ["val.table.json"])
    table = json.loads(Path(entries["val.table.json"].local_path).read_text())  # YOLOv5's dataset table
    assert table["columns"] == ["id", "train_image", "Classes", "name"]
    assert [(row[0], row[1]["path"], row[3]) for row in table["data"]] == [
        (index, f"images/val/im{index}.jpg", f"im{index}.jpg") for index in range(4)]
    data_root = plain.folder.parent.parent / "data"
    for _, image, classes, name in table["data"]:
        labels = [line.split() for line in (data_root / "labels" / "val" / name).with_suffix(".txt").read_text()
                  .splitlines() if line.strip()]
        boxes = image["boxes"]["ground_truth"]
        assert [(box["class_id"], box["position"]["middle"], box["position"]["width"], box["position"]["height"])
                for box in boxes] == [(int(c), [pytest.approx(float(x)), pytest.approx(float(y))],
                                       pytest.approx(float(w)), pytest.approx(float(h))) for c, x, y, w, h in labels]
        assert sorted(classes) == sorted({f"class{c}" for c, *_ in labels})
    models = [(artifact.name, sorted(artifact.aliases), [entry.path for entry in artifact.manifest.contents])
              for artifact in artifacts]
    assert models == [(f"run_{run.run_id}_model", ["epoch 0", "last", "latest"], ["epoch0.pt"]),
                      (f"run_{run.run_id}_model", ["epoch 2", "last", "latest"], ["epoch2.pt"]),
                      (f"run_{run.run_id}_model", ["best", "latest", "stripped"], ["best.pt"])]
    (exit_record,) = by_type(records, "exit")
    assert exit_record.exit_code == 0
    assert not (plain.home / "wandb_dir").exists()  # the run's files went to the run folder


def test_resume_continues_the_same_wandb_run_and_logs_no_epoch_twice(request):
    needs("wandb")
    from utils.trackers.wandb_tracker import read_records

    resumed = request.getfixturevalue("resumed")
    (first,) = resumed.first["wandb"]
    first_records = read_records(first)
    assert sorted(history_rows(first_records)) == [0, 1] and by_type(first_records, "exit")[0].exit_code == 1
    assert "W&B on (WANDB_MODE=offline): continuing its run: offline run " in resumed.out
    logs = offline_logs(resumed.folder)
    assert len(logs) == 2 and {log.name for log in logs} == {first.name}  # one run id, two offline parts
    (second,) = set(logs) - {first}
    second_records = read_records(second)
    assert sorted(history_rows(second_records)) == [2]  # epoch 1 was in the first part: not logged again
    assert_rows_equal_results_csv({**history_rows(first_records), **history_rows(second_records)},
                                  resumed.folder / "results.csv", "wandb")
    assert by_type(second_records, "exit")[0].exit_code == 0


def test_wandb_is_on_as_yolov5_switches_it(monkeypatch, tmp_path):
    from utils.trackers.wandb_tracker import WandbTracker, project_name

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert project_name("runs/train") == "YOLOv5" and project_name("/x/runs/bccd") == "bccd"
    if WandbTracker.switch() is None:  # not installed: nothing said
        needs("wandb")
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


# ---------------------------------------------------------------------- Comet: the OfflineExperiment archive

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


def uploads(messages: list[dict]) -> dict[str, list]:
    """Upload type -> the names of the files uploaded as it (images, assets, model elements)."""
    found: dict[str, list] = {}
    for payload in payloads(messages, "file_upload"):
        extra = payload["additional_params"]
        found.setdefault(payload["upload_type"], []).append(extra.get("fileName") or extra.get("figName"))
    return found


def test_comet_offline_archive_holds_params_metrics_equal_to_results_csv_and_the_files(request):
    needs("comet")
    plain = request.getfixturevalue("plain")
    (archive,) = (plain.folder / "comet").glob("*.zip")  # inside the run folder
    experiment, messages, names = read_archive(archive)
    assert (f"Comet on (COMET_MODE=offline): offline run in {plain.folder / 'comet'} (upload: comet upload "
            f"{archive})") in plain.start
    assert experiment["project_name"] == "plain" and experiment["offline_id"] == archive.stem
    others = {payload["key"]: payload["value"] for payload in payloads(messages, "log_other")}
    assert others["Name"] == "exp" and others["run_folder"] == str(plain.folder)
    params = {param["paramName"]: param["paramValue"] for param in
              (payload.get("param") or payload["params"] for payload in payloads(messages, "parameter_msg"))
              if param["source"] == "manual"}  # "params": a list value's message
    assert params["epochs"] == 3 and params["save_period"] == 2 and params["hyp/lr0"] == 0.01
    assert_rows_equal_results_csv(metric_rows(messages), plain.folder / "results.csv", "comet")
    files = uploads(messages)
    assert sorted(files["model-element"]) == ["best.pt", "epoch0.pt", "epoch2.pt"]
    assert {"train_batch0.jpg", "results.png", "PR_curve.png", "val_batch0_pred.jpg", "labels.jpg",
            "labels_correlogram.jpg"} <= set(
        files["visualization"]) and {"results.csv", "opt.yaml", "hyp.yaml"} <= set(files["asset"])
    assert files["visualization"].count("im0.jpg") == 3  # --bbox_interval's default: a val image every epoch
    stored = {payload["file_path"] for payload in payloads(messages, "file_upload")}
    assert stored <= names  # every uploaded file is in the archive


def test_an_offline_comet_run_cannot_be_continued_so_a_resume_starts_a_linked_run(request):
    needs("comet")
    resumed = request.getfixturevalue("resumed")
    (first,) = resumed.first["comet"]
    assert (f"Comet on (COMET_MODE=offline): an offline Comet run cannot be continued, a new run linked to "
            f"{first.stem}: offline run in ") in resumed.out
    (second,) = set((resumed.folder / "comet").glob("*.zip")) - {first}
    _, messages, _ = read_archive(second)
    others = {payload["key"]: payload["value"] for payload in payloads(messages, "log_other")}
    assert others["resumed_from"] == first.stem and others["Name"] == "exp"
    # the whole run, each epoch once: epoch 0 from the checkpoint's rows, 1 and 2 as trained
    assert_rows_equal_results_csv(metric_rows(messages), resumed.folder / "results.csv", "comet")
    first_messages = read_archive(first)[1]
    assert sorted(metric_rows(first_messages)) == [0, 1]
    assert ("stopped", True) in [(p["key"], p["value"]) for p in payloads(first_messages, "log_other")]


def test_comet_is_on_as_yolov5_switches_it(monkeypatch, tmp_path):
    from utils.trackers.comet_tracker import CometTracker, project_name

    for name in ("COMET_API_KEY", "COMET_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COMET_CONFIG", str(tmp_path / "comet.config"))
    assert project_name("runs/train") == "yolov5" and project_name("/x/runs/bccd") == "bccd"
    if CometTracker.switch() is None:  # not installed: nothing said
        needs("comet")
    assert CometTracker.switch() == (False, "no COMET_API_KEY, ~/.comet.config or COMET_MODE=offline")
    (tmp_path / "comet.config").write_text("[comet]\napi_key = abc\n")
    assert CometTracker.switch() == (True, f"api_key in {tmp_path / 'comet.config'}")
    monkeypatch.setenv("COMET_API_KEY", "k")
    assert CometTracker.switch() == (True, "COMET_API_KEY is set")
    monkeypatch.setenv("COMET_MODE", "offline")
    assert CometTracker.switch() == (True, "COMET_MODE=offline")
    monkeypatch.setenv("COMET_MODE", "disabled")
    assert CometTracker.switch() == (False, "COMET_MODE=disabled")


# ---------------------------------------------------------------------- ClearML: the offline session zip

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


def sessions(run_folder: Path) -> list[Path]:
    return sorted((run_folder / "clearml" / "offline").glob("*.zip"), key=lambda path: path.stat().st_mtime)


def test_clearml_offline_session_holds_params_scalars_equal_to_results_csv_and_the_files(request):
    needs("clearml")
    plain = request.getfixturevalue("plain")
    (session,) = sessions(plain.folder)  # inside the run folder
    task, events, names = read_session(session)
    assert f"ClearML on (CLEARML_OFFLINE_MODE=1): offline session {session.with_suffix('')}" in plain.start
    assert (task["project_name"], task["name"], task["id"]) == ("plain", "exp", session.stem)
    args, hyp = task["hyperparams"]["Args"], task["hyperparams"]["Hyperparameters"]
    assert args["epochs"]["value"] == "3" and args["save_period"]["value"] == "2" and hyp["lr0"]["value"] == "0.01"
    assert task["hyperparams"]["yolo-trainer"]["run_folder"]["value"] == str(plain.folder)
    assert_rows_equal_results_csv(scalar_rows(events), plain.folder / "results.csv", "clearml")
    images = {(event["metric"], event["variant"], event["iter"]) for event in events
              if event["type"] == "training_debug_image"}
    assert {("Mosaics", "train_batch0.jpg", 0), ("Results", "results.png", 2), ("Validation", "val_batch0_pred.jpg", 2),
            ("Labels", "labels.jpg", 2), ("Labels", "labels_correlogram.jpg", 2)} <= images
    assert {(metric, iteration) for metric, _, iteration in images if metric == "Bounding Boxes"} == {
        ("Bounding Boxes", 0), ("Bounding Boxes", 1), ("Bounding Boxes", 2)}  # --bbox_interval's default: every epoch
    artifacts = {artifact["key"]: artifact for artifact in task["execution"]["artifacts"]}
    assert {"results.csv", "opt.yaml", "hyp.yaml", "weights/epoch0.pt", "weights/epoch2.pt",
            "weights/best.pt"} <= set(artifacts)
    best = artifacts["weights/best.pt"]["uri"]
    stored = Path(best).relative_to(session.with_suffix("")).as_posix()
    assert stored in names and Path(best).read_bytes() == (plain.folder / "weights" / "best.pt").read_bytes()
    assert not list(plain.home.glob("**/offline-*"))  # nothing in ClearML's home folders


def test_an_offline_clearml_run_cannot_be_continued_so_a_resume_starts_a_linked_task(request):
    needs("clearml")
    resumed = request.getfixturevalue("resumed")
    (first,) = resumed.first["clearml"]
    assert sorted(scalar_rows(read_session(first)[1])) == [0, 1]
    assert (f"ClearML on (CLEARML_OFFLINE_MODE=1): an offline ClearML run cannot be continued, a new run linked to "
            f"{first.stem}: offline session ") in resumed.out
    (second,) = set(sessions(resumed.folder)) - {first}
    task, events, _ = read_session(second)
    assert task["hyperparams"]["yolo-trainer"]["resumed_from"]["value"] == first.stem
    assert_rows_equal_results_csv(scalar_rows(events), resumed.folder / "results.csv", "clearml")  # each epoch once


def test_clearml_is_on_as_yolov5_switches_it(monkeypatch, tmp_path):
    from utils.trackers.clearml_tracker import ClearmlTracker, project_name

    for name in ("CLEARML_API_ACCESS_KEY", "CLEARML_API_SECRET_KEY", "CLEARML_OFFLINE_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(tmp_path / "clearml.conf"))
    assert project_name("runs/train") == "YOLOv5" and project_name("/x/runs/bccd") == "bccd"
    if ClearmlTracker.switch() is None:  # not installed: nothing said
        needs("clearml")
    assert ClearmlTracker.switch() == (False, "not configured: clearml-init, or CLEARML_OFFLINE_MODE=1")
    (tmp_path / "clearml.conf").write_text("api {}\n")
    assert ClearmlTracker.switch() == (True, f"configured ({tmp_path / 'clearml.conf'})")
    (tmp_path / "clearml.conf").unlink()
    monkeypatch.setenv("CLEARML_API_ACCESS_KEY", "a")
    monkeypatch.setenv("CLEARML_API_SECRET_KEY", "s")
    assert ClearmlTracker.switch() == (True, "CLEARML_API_ACCESS_KEY and CLEARML_API_SECRET_KEY are set")
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    assert ClearmlTracker.switch() == (True, "CLEARML_OFFLINE_MODE=1")


# ---------------------------------------------------------------------- torchrun: rank 0 alone logs

@pytest.mark.slow
def test_two_processes_under_torchrun_log_one_run_to_each_offline_tracker(offline):
    """torchrun, 2 processes (gloo): one W&B run, one Comet archive, one ClearML session, each equal to results.csv,
    and no warning from any tracker."""
    import sys

    from tests.test_ddp import run as run_torchrun  # runs a job again after gloo's known rare abort
    from tests.test_trackers import free_port

    root, data, cfg = offline
    project = root / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(Path(train_script.__file__)), "--data", str(data), "--cfg", str(cfg), "--weights",
               "", "--imgsz", "64", "--batch-size", "4", "--epochs", "2", "--workers", "0", "--device", "cpu",
               "--noautoanchor", "--noplots", "--no-tensorboard", "--project", str(project)]
    # started from a process that ran a ClearML task: its note must not make rank 0's task a stub
    done = run_torchrun(command, env={"CLEARML_PROC_MASTER_ID": "1:offline-parent", "TRAINS_PROC_MASTER_ID": "1:"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("Trackers:") == 1  # rank 0 alone (the other warns of BatchNorm on 2 images: not ours)
    assert not re.search(r"WARNING.*(W&B|wandb|Comet|ClearML|Trackers)", done.stdout + done.stderr)
    folder, results = project / "exp", project / "exp" / "results.csv"
    if importlib.util.find_spec("wandb"):
        from utils.trackers.wandb_tracker import read_records

        (log,) = offline_logs(folder)
        assert_rows_equal_results_csv(history_rows(read_records(log)), results, "wandb")
    if importlib.util.find_spec("comet_ml"):
        (archive,) = (folder / "comet").glob("*.zip")
        assert_rows_equal_results_csv(metric_rows(read_archive(archive)[1]), results, "comet")
    if importlib.util.find_spec("clearml"):
        (session,) = sessions(folder)
        assert_rows_equal_results_csv(scalar_rows(read_session(session)[1]), results, "clearml")


def test_evolve_generations_are_runs_grouped_under_the_evolution_in_its_folder(offline):
    """--evolve 2: each installed offline tracker has one run per generation, named <evolution>-gen<N>, grouped under
    the evolution's name (W&B's group, a Comet tag, a ClearML tag), its files in the evolution's folder."""
    status, out, _ = train(tiny_args(offline, "evolving", "--evolve", "2", "--epochs", "1", "--name", "search"))
    assert status == 0, out[-3000:]
    folder = offline[0] / "evolving" / "search"
    names = ["search-gen1", "search-gen2"]
    if importlib.util.find_spec("wandb"):
        from utils.trackers.wandb_tracker import read_records

        runs = [by_type(read_records(log), "run")[0] for log in offline_logs(folder)]
        assert sorted(run.display_name for run in runs) == names and {run.run_group for run in runs} == {"search"}
    if importlib.util.find_spec("comet_ml"):
        archives = [read_archive(path) for path in sorted((folder / "comet").glob("*.zip"))]
        others = [{p["key"]: p["value"] for p in payloads(messages, "log_other")} for _, messages, _ in archives]
        assert sorted(other["Name"] for other in others) == names and {o["evolution"] for o in others} == {"search"}
        assert [experiment["tags"] for experiment, _, _ in archives] == [["search"], ["search"]]
    if importlib.util.find_spec("clearml"):
        tasks = [read_session(path)[0] for path in sessions(folder)]
        assert sorted(task["name"] for task in tasks) == names
        assert all("search" in task.get("tags", []) for task in tasks), [task.get("tags") for task in tasks]


# ---------------------------------------------------------------------- --bbox_interval's images, each tracker's form

def val_predictions(folder: Path):
    """Two 64x64 images: the first with a box of class 1 at 0.9 and one at 0.1 (below the 0.25 shown), the second
    with none."""
    import numpy as np

    from utils.trackers import ValPredictions

    images = np.full((2, 3, 64, 64), 90, dtype=np.uint8)
    detections = [np.array([[8, 10, 40, 50, 0.9, 1], [0, 0, 20, 20, 0.1, 0]], np.float32), np.zeros((0, 6))]
    return ValPredictions(0, images, detections, ["a/im0.jpg", "a/im1.jpg"], ["cat", "dog"],
                          folder / "val_predictions" / "val_pred_epoch0.jpg")


def log_one_epoch(tracker, folder: Path) -> None:
    from utils.trackers import RunStart

    tracker.start(RunStart("boxes", "exp", {"epochs": 1}, folder))
    tracker.log_epoch(0, dict.fromkeys(RESULTS_KEYS, 0.5))
    tracker.log_predictions(val_predictions(folder))
    tracker.finish(True)


def test_wandb_gets_each_val_image_with_its_boxes_as_box_data_in_the_bounding_box_debugger(offline, tmp_path):
    """As YOLOv5's W&B logger: one wandb.Image per val image under "Bounding Box Debugger/Images" at the epoch's step,
    captioned with its file name, its boxes at conf 0.25 and above as W&B box data (nothing drawn)."""
    needs("wandb")
    from utils.trackers.wandb_tracker import WandbTracker, read_records

    log_one_epoch(WandbTracker(), tmp_path)
    (log,) = offline_logs(tmp_path)
    rows = history_rows(read_records(log))
    assert rows[0]["Bounding Box Debugger/Images/captions"] == ["im0.jpg", "im1.jpg"]
    assert rows[0]["Bounding Box Debugger/Images/count"] == 2
    boxes = [json.loads((log.parent / "files" / entry["predictions"]["path"]).read_text())
             for entry in rows[0]["Bounding Box Debugger/Images/all_boxes"]]
    assert boxes[0]["class_labels"] == {"0": "cat", "1": "dog"}
    assert boxes[0]["box_data"] == [{"position": {"minX": 8, "minY": 10, "maxX": 40, "maxY": 50}, "class_id": 1,
                                     "box_caption": "dog 0.900", "scores": {"class_score": pytest.approx(0.9)},
                                     "domain": "pixel"}]
    assert boxes[1]["box_data"] == []
    assert not (tmp_path / "val_predictions").exists()  # nothing drawn for W&B


def test_comet_gets_each_val_image_with_its_boxes_as_annotations(offline, tmp_path):
    """Comet: each val image named after its file at the epoch's step, its boxes at conf 0.25 and above as the
    annotation layer "Predictions" ([x, y, w, h], class name, confidence) that Comet's viewer draws."""
    needs("comet")
    from utils.trackers.comet_tracker import CometTracker

    log_one_epoch(CometTracker(), tmp_path)
    (archive,) = sorted((tmp_path / "comet").glob("*.zip"))
    _, messages, names = read_archive(archive)
    shown = {payload["additional_params"]["figName"]: payload for payload in payloads(messages, "file_upload")
             if payload["upload_type"] == "visualization"}
    assert sorted(shown) == ["im0.jpg", "im1.jpg"]
    assert shown["im0.jpg"]["additional_params"]["step"] == 0 and shown["im0.jpg"]["file_path"] in names
    (layer,) = shown["im0.jpg"]["metadata"]["annotations"]
    assert layer["name"] == "Predictions"
    assert layer["data"] == [{"boxes": [[8, 10, 32, 40]], "label": "dog", "score": pytest.approx(0.9)}]
    assert "annotations" not in shown["im1.jpg"]["metadata"]  # no box: no layer
    assert not (tmp_path / "val_predictions").exists()


def test_clearml_gets_each_val_image_drawn_with_its_boxes_as_yolov5s_bounding_boxes_samples(offline, tmp_path):
    """As YOLOv5's ClearML logger: each val image with its boxes drawn (conf 0.25 and above) as a debug sample, title
    "Bounding Boxes", series the file name, at the epoch's iteration."""
    needs("clearml")
    import cv2
    import numpy as np

    from utils.drawing import colors
    from utils.trackers.clearml_tracker import ClearmlTracker

    log_one_epoch(ClearmlTracker(), tmp_path)
    (session,) = sessions(tmp_path)
    _, events, names = read_session(session)
    shown = {event["variant"]: event for event in events
             if event["type"] == "training_debug_image" and event["metric"] == "Bounding Boxes"}
    assert sorted(shown) == ["im0.jpg", "im1.jpg"] and {event["iter"] for event in shown.values()} == {0}
    pictures = {}
    with zipfile.ZipFile(session) as archive:
        for variant, event in shown.items():
            (stored,) = [name for name in names if name.endswith(Path(event["url"]).name)]
            pictures[variant] = cv2.imdecode(np.frombuffer(archive.read(stored), np.uint8), cv2.IMREAD_COLOR)
    box_colour = np.array(colors(1, bgr=True))  # class 1's box, drawn (class 0's at 0.1 is not)
    assert np.abs(pictures["im0.jpg"][30, 8].astype(int) - box_colour).max() < 40
    assert np.abs(pictures["im0.jpg"][5, 5].astype(int) - 90).max() < 10  # where the 0.1 box would have been
    assert np.abs(pictures["im1.jpg"].astype(int) - 90).max() < 10  # no box


# ---------------------------------------------------------------------- Comet: per-class metrics, confusion matrix

PER_CLASS = [{"class": 0, "name": "cat", "instances": 5, "precision": 0.5, "recall": 0.4, "f1": 0.444, "tp": 2,
              "fp": 2, "mAP50": 0.3, "mAP50-95": 0.1},
             {"class": 1, "name": "dog", "instances": 3, "precision": 0.75, "recall": 1.0, "f1": 0.857, "tp": 3,
              "fp": 1, "mAP50": 0.9, "mAP50-95": 0.6}]
CONFUSION = [[2, 0, 2], [1, 3, 1], [2, 0, 0]]  # [predicted, true], background last


def comet_validation_messages(folder: Path) -> list[dict]:
    import numpy as np

    from utils.trackers import RunStart
    from utils.trackers.comet_tracker import CometTracker

    tracker = CometTracker()
    tracker.start(RunStart("classes", "exp", {"epochs": 2}, folder))
    for epoch in range(2):
        tracker.log_epoch(epoch, dict.fromkeys(RESULTS_KEYS, 0.5))
        tracker.log_validation(epoch, PER_CLASS, np.array(CONFUSION), ["cat", "dog"])
    tracker.finish(True)
    (archive,) = sorted((folder / "comet").glob("*.zip"))
    _, messages, _ = read_archive(archive)
    return archive, messages


@pytest.mark.parametrize("switches, per_class, matrices", [({}, False, True),
                                                           ({"COMET_LOG_PER_CLASS_METRICS": "True"}, True, True),
                                                           ({"COMET_LOG_CONFUSION_MATRIX": "false"}, False, False)])
def test_comet_logs_per_class_metrics_and_the_confusion_matrix_as_yolov5s_comet_logger(offline, tmp_path, monkeypatch,
                                                                                      switches, per_class, matrices):
    """After each epoch's validation, as YOLOv5's Comet logger: each class's metrics prefixed with its name when
    COMET_LOG_PER_CLASS_METRICS=true (off by default), and the confusion matrix unless COMET_LOG_CONFUSION_MATRIX=false,
    its rows predicted and columns actual classes, 'background' last."""
    needs("comet")
    monkeypatch.delenv("COMET_LOG_PER_CLASS_METRICS", raising=False)
    monkeypatch.delenv("COMET_LOG_CONFUSION_MATRIX", raising=False)
    for name, value in switches.items():
        monkeypatch.setenv(name, value)
    archive, messages = comet_validation_messages(tmp_path)
    rows = metric_rows(messages)
    classes = {name: value for name, value in rows[1].items() if name.startswith(("cat_", "dog_"))}
    if per_class:
        assert classes == {"cat_mAP@.5": 0.3, "cat_mAP@.5:.95": 0.1, "cat_precision": 0.5, "cat_recall": 0.4,
                           "cat_f1": 0.444, "cat_true_positives": 2, "cat_false_positives": 2, "cat_support": 5,
                           "dog_mAP@.5": 0.9, "dog_mAP@.5:.95": 0.6, "dog_precision": 0.75, "dog_recall": 1.0,
                           "dog_f1": 0.857, "dog_true_positives": 3, "dog_false_positives": 1, "dog_support": 3}
        assert sorted(name for name in rows[0] if name.startswith("cat_")) == sorted(n for n in classes if "cat" in n)
    else:
        assert classes == {}
    found = [payload for payload in payloads(messages, "file_upload")
             if payload["upload_type"] == "confusion-matrix"]
    assert [p["additional_params"]["fileName"] for p in found] == (
        ["confusion-matrix-epoch-0.json", "confusion-matrix-epoch-1.json"] if matrices else [])
    if matrices:
        with zipfile.ZipFile(archive) as stored:
            matrix = json.loads(stored.read(found[1]["file_path"]))
        assert matrix["matrix"] == CONFUSION and matrix["labels"] == ["cat", "dog", "background"]
        assert (matrix["rowLabel"], matrix["columnLabel"]) == ("Predicted Category", "Actual Category")
