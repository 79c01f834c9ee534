"""YOLOv5's --ndjson-console / --ndjson-file: each epoch's results.csv row as one JSON line on stdout and in
results.ndjson; a resumed run's file holds exactly the rows of a straight run; YOLOv5 flags this project does
another way (--bucket, --evolve_population, --resume_evolve) are refused in one line."""
from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

import train as train_script
from tests.conftest import make_tiny_run
from tests.test_resume_safety import CrashAfterEpoch
from utils.trainer import trainer
from utils.config import TrainConfig
from utils.loggers import RESULTS_KEYS, NDJSONLogger
from utils.plots import read_results_csv
from utils.trainer.resume import option_changes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ndjson")
    return (root, *make_tiny_run(root))


def train_args(tiny, name, *extra):
    root, data, cfg = tiny
    return ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size", "4", "--epochs", "3",
            "--workers", "0", "--cache", "off", "--device", "cpu", "--project", str(root / "runs"), "--name", name,
            "--noautoanchor", "--noplots", "--no-tensorboard", "--no-trackers", *extra]


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def row(epoch, **values):
    return {"epoch": epoch, **dict.fromkeys(RESULTS_KEYS, 0.5), **values}


@pytest.mark.slow
def test_lines_on_stdout_and_in_the_file_are_the_results_csv_rows(tiny):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert train_script.main(train_args(tiny, "both", "--ndjson-console", "--ndjson-file")) == 0
    run = tiny[0] / "runs" / "both"
    in_file = json_lines((run / "results.ndjson").read_text())
    # the same lines on the console, and nothing else there: the log goes to stderr, so stdout pipes into a reader
    assert [json.loads(line) for line in out.getvalue().splitlines()] == in_file
    table = read_results_csv(run / "results.csv")
    assert [line["epoch"] for line in in_file] == [int(e) for e in table["epoch"]] == [0, 1, 2]
    for line in in_file:
        assert list(line) == ["epoch", *RESULTS_KEYS]  # results.csv's columns, in its order
        for key in RESULTS_KEYS:  # results.csv rounds to 5 significant digits; the JSON keeps the float
            assert line[key] == pytest.approx(float(table[key][line["epoch"]]), rel=1e-4, abs=1e-12), key
    assert in_file[0]["x/lr0"] > 0


@pytest.mark.slow
def test_a_resumed_run_writes_the_straight_runs_lines(tiny, monkeypatch):
    assert train_script.main(train_args(tiny, "straight", "--ndjson-file")) == 0
    straight = (tiny[0] / "runs" / "straight" / "results.ndjson").read_text()
    monkeypatch.setattr(trainer, "Callbacks", lambda: CrashAfterEpoch(0))
    assert train_script.main(train_args(tiny, "crashed", "--ndjson-file")) == 130
    monkeypatch.undo()
    run = tiny[0] / "runs" / "crashed"
    assert len(json_lines((run / "results.ndjson").read_text())) == 1
    with open(run / "results.ndjson", "a") as file:  # a row written after the checkpoint, by a process killed then
        file.write(json.dumps(row(1)) + "\n")
    assert train_script.main(["--resume", str(run / "weights" / "last.pt")]) == 0
    assert (run / "results.ndjson").read_text() == straight  # resume is bit-exact: so are the lines


def test_a_run_without_the_flags_writes_no_file_and_prints_no_json(tmp_path):
    logger = NDJSONLogger(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        logger.log(0, row(0))
        logger.rewrite([row(0)])
    assert out.getvalue() == "" and not (tmp_path / "results.ndjson").exists()


def test_values_that_are_not_finite_are_null_and_rewrite_keeps_exactly_the_rows(tmp_path):
    logger = NDJSONLogger(tmp_path, file=True)
    logger.log(0, row(0, **{"train/box_loss": math.nan, "val/obj_loss": math.inf}))
    logger.log(1, row(1))
    lines = (tmp_path / "results.ndjson").read_text().splitlines()
    first = json.loads(lines[0])  # strict JSON: no NaN or Infinity tokens
    assert first["train/box_loss"] is None and first["val/obj_loss"] is None and first["train/obj_loss"] == 0.5
    logger.rewrite([row(0, **{"x/lr0": 0.01})])
    assert json_lines((tmp_path / "results.ndjson").read_text()) == [row(0, **{"x/lr0": 0.01})]
    logger.rewrite([])
    assert not (tmp_path / "results.ndjson").exists()


def test_resume_may_switch_the_lines_on_and_older_checkpoints_have_them_off():
    assert option_changes({"ndjson_file": True, "ndjson_console": True}, TrainConfig()) == {
        "ndjson_file": (False, True), "ndjson_console": (False, True)}
    stored = TrainConfig().to_dict()
    del stored["ndjson_file"], stored["ndjson_console"]  # a checkpoint from before the flags
    config = TrainConfig.from_stored(stored)
    assert (config.ndjson_file, config.ndjson_console) == (False, False)


@pytest.mark.parametrize("flags, words", [
    (["--bucket", "my-bucket"], ["--bucket my-bucket", "gsutil", "evolve.csv"]),
    (["--evolve", "3", "--evolve_population", "data/hyps"], ["--evolve_population", "v7.0", "--evolve again"]),
    (["--evolve", "3", "--resume_evolve", "last.yaml"], ["--resume_evolve", "v7.0", "--evolve again"]),
])
def test_yolov5_flags_done_another_way_are_refused_in_one_line(tmp_path, capsys, flags, words):
    assert train_script.main(["--project", str(tmp_path / "runs"), "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(word in err[0] for word in words), err
    assert not (tmp_path / "runs").exists()  # refused before anything is written
    assert train_script.parse_args(["--bucket", ""]).bucket == ""  # YOLOv5's default: nothing to refuse
    assert train_script.refused_yolov5_option(train_script.parse_args([])) is None
