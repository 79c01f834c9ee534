"""--resume on a run YOLOv5 started (utils.checkpoint.yolov5_run): its last.pt, opt.yaml, hyp.yaml and results.csv
as YOLOv5 v6.0 and v7 leave them (written by the look-alike, tests/generate_yolov5.py), continued here; the optimizer
state placed by parameter name; one-line refusals."""
from __future__ import annotations

import shutil

import pytest
import torch
import yaml

import train as train_script
from models import build_model
from tests.conftest import make_tiny_run
from tests.generate_yolov5 import write_yolov5_run
from utils.checkpoint import CheckpointError, load_checkpoint, training_state
from utils.checkpoint.checks import check_against_run
from utils.checkpoint.yolov5_run import own_optimizer
from utils.trainer.optim import build_optimizer

EPOCHS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("yolov5-resume")
    return (root, *make_tiny_run(root, num_train=8))


@pytest.fixture(scope="module")
def v7_run(tiny, tmp_path_factory):
    _, data, cfg = tiny
    folder = tmp_path_factory.mktemp("v7")
    return write_yolov5_run(folder, cfg, data, EPOCHS, 1, "v7"), torch.load(folder / "momentum.pt")


def fresh_copy(run, tmp_path):
    copy = tmp_path / "runs" / "exp"
    shutil.copytree(run, copy)
    return copy


def resumed(run):
    last = run / "weights" / "last.pt"
    return training_state(load_checkpoint(last), last)


def test_state_of_a_v7_run(v7_run, tiny):
    run, momentum = v7_run
    state = resumed(run)
    assert state.origin == "yolov5" and state.rng == [] and state.scaler == {}
    assert state.run["epoch"] == 2 and state.run["batch"] == 0 and state.ema_updates == 7
    # results.csv: epoch 0 listed twice (a YOLOv5 resume after a crash): the later row wins; the best epoch from them
    assert [row["epoch"] for row in state.run["results"]] == [0, 1]
    assert state.run["results"][0]["metrics/mAP_0.5"] == 0.5 and state.run["results"][1]["metrics/mAP_0.5"] == 0.1
    assert state.run["best_epoch"] == 0 and state.run["best_fitness"] == pytest.approx(0.23)
    assert state.config["epochs"] == EPOCHS and state.config["batch_size"] == 2 and state.config["imgsz"] == 64
    assert state.config["data"] == str(tiny[1]) and "bucket" not in state.config and "entity" not in state.config
    assert state.hyp["lr0"] == 0.01 and state.hyp["mosaic"] == 1.0
    # every momentum buffer at its parameter's place in our groups (biases, weights, norm weights)
    names = state.parameter_names
    assert sorted(names) == sorted(momentum) and len(state.optimizer["state"]) == len(names)
    for index, name in enumerate(names):
        assert torch.equal(state.optimizer["state"][index]["momentum_buffer"], momentum[name]), name
    model = build_model(state.model)
    assert torch.equal(model.state_dict()["model.0.conv.weight"].half(), state.model["state_dict"]["model.0.conv.weight"])
    assert not torch.equal(state.ema["state_dict"]["model.0.conv.weight"], state.model["state_dict"]["model.0.conv.weight"])


def test_the_trainer_checks_the_names_against_its_model(v7_run):
    state = resumed(v7_run[0])
    model = build_model(state.model)
    optimizer = build_optimizer(model)
    named = {id(p): name for name, p in model.named_parameters()}
    own = [named[id(p)] for group in optimizer.param_groups for p in group["params"]]
    check_against_run(state, optimizer, None, 4, 2, own)  # the look-alike's module order is ours
    swapped = list(own)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(CheckpointError, match=r"optimizer parameter 0: is .* in the file but .* in this model"):
        check_against_run(state, optimizer, None, 4, 2, swapped)


def test_a_v6_run_is_regrouped_by_name(tiny, tmp_path):
    _, data, cfg = tiny
    run = write_yolov5_run(tmp_path, cfg, data, EPOCHS, 0, "v6.0")
    momentum = torch.load(tmp_path / "momentum.pt")
    state = resumed(run)
    assert state.config["optimizer"] == "SGD" and state.config["cos_lr"] is False  # v6.0: --linear-lr
    assert state.config["freeze"] == [0] and state.run["epoch"] == 1
    biases = [name for name in state.parameter_names if name.endswith(".bias")]
    assert state.parameter_names[:len(biases)] == biases  # our group 0; the file had BatchNorm weights first
    for index, name in enumerate(state.parameter_names):
        assert torch.equal(state.optimizer["state"][index]["momentum_buffer"], momentum[name]), name


def test_train_py_continues_a_yolov5_run(v7_run, tmp_path):
    run = fresh_copy(v7_run[0], tmp_path)
    last = run / "weights" / "last.pt"
    original, results = last.read_bytes(), (run / "results.csv").read_text()
    assert train_script.main(["--resume", str(last), "--no-tensorboard"]) == 0
    assert (run / "weights" / "last.yolov5.pt").read_bytes() == original  # YOLOv5's files are kept
    assert (run / "results.yolov5.csv").read_text() == results
    rows = [line.split(",") for line in (run / "results.csv").read_text().splitlines()[1:]]
    assert [int(row[0]) for row in rows] == [0, 1, 2]  # YOLOv5's two epochs, then the one trained here
    assert [float(row[6]) for row in rows[:2]] == [0.5, 0.1]
    finished = torch.load(last, weights_only=True)
    assert finished["finished"] and finished["epoch"] == EPOCHS - 1 and finished["config"]["data"]
    assert yaml.safe_load((run / "opt.yaml").read_text())["bucket"] == ""  # YOLOv5's opt.yaml left as it was


@pytest.mark.parametrize("change, reason", [
    ({"evolve": 300}, "an --evolve generation's run"),
    ({"batch_size": -1}, "AutoBatch run (--batch-size -1)"),
    ({"optimizer": None}, "has no --optimizer (or --adam)"),
    ({"epochs": 0}, "option 'epochs'"),
])
def test_options_yolov5_cannot_continue_with_are_one_line(v7_run, tmp_path, capsys, change, reason):
    run = fresh_copy(v7_run[0], tmp_path)
    opt = yaml.safe_load((run / "opt.yaml").read_text())
    opt.update(change)
    (run / "opt.yaml").write_text(yaml.safe_dump(opt))  # opt.yaml is read first, as YOLOv5 does
    assert train_script.main(["--resume", str(run / "weights" / "last.pt")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and reason in err[0] and str(run / "opt.yaml") in err[0], err
    assert not (run / "weights" / "last.yolov5.pt").exists()  # nothing written


def test_a_broken_results_csv_is_named_with_its_line(v7_run, tmp_path, capsys):
    run = fresh_copy(v7_run[0], tmp_path)
    with open(run / "results.csv", "a") as file:
        file.write("1, 0.1, nan\n")
    assert train_script.main(["--resume", str(run / "weights" / "last.pt")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{run / 'results.csv'}: line 5: expected 14 finite numbers" in err[0], err
    (run / "results.csv").unlink()  # none at all: a warning, and the run's rows start here
    assert resumed(run).run["results"] == []


def test_optimizer_groups_matching_no_layout_are_refused():
    layouts = {"v6.2+": [["b"], ["w1", "w2"], ["n"]], "v6.1-": [["n"], ["w1", "w2"], ["b"]]}
    saved = {"state": {0: {"momentum_buffer": torch.zeros(1)}}, "param_groups": [{"params": [0, 1]}, {"params": [2]}]}
    with pytest.raises(CheckpointError, match=r"groups of \[2, 1\] parameters match no YOLOv5 layout"):
        own_optimizer(saved, layouts, "last.pt")
    # both layouts have these sizes: only taken when they name the same parameters
    saved = {"state": {0: {"momentum_buffer": torch.ones(1)}}, "param_groups": [{"params": [0]}, {"params": [1, 2]},
                                                                              {"params": [3]}]}
    with pytest.raises(CheckpointError, match="more than one YOLOv5 layout"):
        own_optimizer(saved, layouts, "last.pt")
    optimizer, names, layout = own_optimizer(saved, {"v6.2+": layouts["v6.2+"]}, "last.pt")
    assert names == ["b", "w1", "w2", "n"] and layout == "v6.2+" and list(optimizer["state"]) == [0]


def test_a_finished_yolov5_run_says_how_to_train_on(yolov5_lookalike, tmp_path, capsys):
    last = tmp_path / "runs" / "exp" / "weights" / "last.pt"
    last.parent.mkdir(parents=True)
    shutil.copy(yolov5_lookalike.checkpoint, last)  # stripped, as YOLOv5 leaves a finished run (no optimizer)
    assert train_script.main(["--resume", "--project", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr()
    assert f"{last}: this run has finished. To train it further" in out.out + out.err
    assert f"--weights {last}" in out.out + out.err
