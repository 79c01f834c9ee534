"""--time HOURS: the epoch count that fits (pure functions), the decision after the first epoch and the early
stop, the LR schedule rebuilt for the chosen count, a tiny run that ends as a normal run, and --resume keeping
the chosen count. Runs that need a known epoch time use a controlled clock (utils.trainer.time_budget.clock)."""
from __future__ import annotations

import contextlib
import io
import math
import re
from types import SimpleNamespace

import pytest
import torch

import train as train_script
from tests.conftest import make_tiny_run
from tests.test_resume import StopAfterEpoch
from utils.config import Hyp, TrainConfig
from utils.plots import read_results_csv
from utils.trainer import time_budget as budget, trainer
from utils.trainer.time_budget import TimeBudget, end_reserve, epochs_that_fit, validation_estimate
from utils.trainer.optim import EpochSchedule, lr_lambda, warmup_iterations
from utils.trainer.resume import ResumeOptionError, option_changes
from utils.trainer.state import RunState

DECISION = re.compile(r"--time (\S+) h: 1 epoch took (\S+) s, training (\d+) epochs? \((\S+) s kept for the final "
                      r"validation[^)]*\)")
BATCHES_PER_EPOCH = 2  # 8 tiny training images, batch 4


# ---------------------------------------------------------------------- pure functions

def test_epochs_that_fit_counts_whole_epochs_after_the_reserve():
    assert epochs_that_fit(100, 10, 1, 5, most=300) == 9  # 1 done + floor(85 / 10)
    assert epochs_that_fit(100, 10, 1, 0, most=300) == 10  # exactly fills the budget
    assert epochs_that_fit(100, 10, 1, 5, most=4) == 4  # --epochs stays the most
    assert epochs_that_fit(100, 10, 1, 95, most=300) == 1  # nothing left after the reserve: the epoch done
    assert epochs_that_fit(100, 150, 1, 5, most=300) == 1  # the first epoch alone was over budget: at least 1
    assert epochs_that_fit(100, 60, 4, 5, most=300) == 6  # later: the mean epoch (15 s) so far, 35 s left
    assert epochs_that_fit(100, 90, 6, 5, most=300) == 6  # 5 s left: no further epoch fits
    assert epochs_that_fit(100, 0.0, 1, 0, most=300) == 1  # no time measured: no division by zero


def test_end_reserve_and_validation_estimate():
    assert end_reserve(3.0, noval=False, plots=False) == 6.0  # the final validation, counted twice
    assert end_reserve(3.0, noval=True, plots=False) == 9.0  # plus the final epoch's own validation
    assert end_reserve(3.0, noval=False, plots=True) == 6.0 + budget.PLOTS_RESERVE_S  # plus the final plots
    assert validation_estimate(20.0, train_batches=10, val_batches=5) == 10.0


def test_time_budget_counts_the_time_spent_before_a_resume(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(budget, "clock", lambda: now[0])
    clock = TimeBudget(0.5, spent_before_s=30.0)
    assert clock.seconds == 1800 and clock.spent() == 30.0
    clock.start()
    now[0] = 110.0
    assert clock.spent() == 40.0


def test_retargeted_schedule_equals_one_built_for_the_new_count():
    def schedule(epochs):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
        return EpochSchedule(optimizer, lr_lambda(epochs, 0.01))

    retargeted, planned = schedule(100), schedule(7)
    for _ in range(3):
        retargeted.optimizer.step()
        planned.optimizer.step()
        retargeted.step()
        planned.step()
        if retargeted.epoch == 1:
            retargeted.retarget(lr_lambda(7, 0.01))  # decided after the first epoch
    assert retargeted.optimizer.param_groups[0]["lr"] == planned.optimizer.param_groups[0]["lr"]
    for _ in range(4):
        retargeted.step()
    assert retargeted.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.01)  # lrf at epoch 7


def test_epoch_schedule_is_a_function_of_the_epoch_and_matches_lambda_lr():
    """The schedule's rates equal torch's LambdaLR's bit for bit (the runs before it used LambdaLR), at any epoch
    set directly (resume) as after stepping there, and it keeps no state but the epoch."""
    def optimizer():
        weights = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
        return torch.optim.SGD([{"params": [w], "lr": lr} for w, lr in zip(weights, (0.1, 0.01, 0.02))], lr=0.01)

    factor = lr_lambda(30, 0.01, cos=True)
    ours, reference = EpochSchedule(optimizer(), factor), torch.optim.lr_scheduler.LambdaLR(optimizer(), factor)
    for epoch in range(1, 31):
        ours.optimizer.step()
        reference.optimizer.step()
        ours.step()
        reference.step()
        assert ours.rates() == reference.get_last_lr(), epoch
        jumped = EpochSchedule(optimizer(), factor)
        jumped.set_epoch(epoch)
        assert jumped.rates() == ours.rates()
    assert ours.state_dict() == {"epoch": 30}


def budget_stub(hours, spent, epochs_done, planned, epochs, monkeypatch, noval=False):
    """The attributes Trainer._budget_decision reads, with ``spent`` seconds on the clock."""
    monkeypatch.setattr(budget, "clock", lambda: spent)
    clock = TimeBudget(hours)
    clock.started = 0.0
    state = RunState(epoch=epochs_done, planned_epochs=planned)
    data = SimpleNamespace(batches_per_epoch=10, val_loader=[None] * 5)
    config = SimpleNamespace(noval=noval, epochs=100, noplots=True)
    return SimpleNamespace(budget=clock, state=state, config=config, data=data, epochs=epochs)


def test_decision_after_the_first_epoch_and_the_early_stop(monkeypatch, caplog):
    caplog.set_level("INFO")
    stats = SimpleNamespace(validation_time=1.0)

    def decide(stub, stats):
        return trainer.Trainer._budget_decision(stub, stats, stub.state.epoch)

    # first epoch: 10 s of a 36 s budget, 2 s reserved: 1 + floor(24 / 10) = 3 epochs
    assert decide(budget_stub(0.01, 10.0, 1, 0, 100, monkeypatch), stats) == (3, False)
    assert "--time 0.01 h: 1 epoch took 10.0 s, training 3 epochs (2.0 s kept for the final validation)" in caplog.text
    # the first epoch over budget: that epoch is the run
    assert decide(budget_stub(0.01, 40.0, 1, 0, 100, monkeypatch), stats) == (1, True)
    # later epochs on plan: go on; slower than planned (40 s after 2 of 3): stop now
    assert decide(budget_stub(0.01, 20.0, 2, 3, 3, monkeypatch), stats) == (0, False)
    assert decide(budget_stub(0.01, 40.0, 2, 3, 3, monkeypatch), stats) == (0, True)
    assert "40.0 s spent after 2 of 3 epochs, another epoch would not fit: stopping now" in caplog.text
    # later epochs re-plan: 0.02 h = 72 s, 2 s reserved; 20 s after 2 epochs: 2 + floor(50 / 10) = 7 fit
    assert decide(budget_stub(0.02, 20.0, 2, 6, 6, monkeypatch), stats) == (0, False)  # one more: within the margin
    assert decide(budget_stub(0.02, 20.0, 2, 5, 5, monkeypatch), stats) == (7, False)  # two more: the plan grows
    assert "20.0 s spent after 2 epochs, 7 epochs in all now fit instead of 5: the LR schedule spans 7" in caplog.text
    assert decide(budget_stub(0.02, 40.0, 2, 5, 5, monkeypatch), stats) == (3, False)  # slower: fewer, at once
    assert decide(budget_stub(0.02, 20.0, 2, 2, 2, monkeypatch), stats) == (0, False)  # the last epoch: nothing to plan
    # --noval: the validation is estimated from the training batches (10 s / 10 batches x 5), reserved 3 times
    assert decide(budget_stub(0.02, 10.0, 1, 0, 100, monkeypatch, noval=True), stats) == (5, False)
    # with plots, their time is kept too: 1 + floor((36 - 10 - 2 - 10) / 10) = 2
    plotting = budget_stub(0.01, 10.0, 1, 0, 100, monkeypatch)
    plotting.config.noplots = False
    assert decide(plotting, stats) == (2, False)
    # a budget with room for more than --epochs: --epochs, said so
    assert decide(budget_stub(1.0, 10.0, 1, 0, 100, monkeypatch), stats) == (100, False)
    assert "training 100 epochs (2.0 s kept for the final validation; --epochs is the most)" in caplog.text


def test_time_flag_bounds_resume_and_state_compatibility(capsys):
    assert train_script.parse_args(["--time", "0.05"]).time == 0.05
    assert train_script.parse_args([]).time is None
    # --time alone lets the budget decide the epoch count (ultralytics' time= overrides epochs); a given --epochs
    # stays its upper bound; without --time the default is YOLOv5's 100
    assert train_script.parse_args(["--time", "2"]).epochs == train_script.TIME_MAX_EPOCHS
    assert train_script.parse_args(["--time", "2", "--epochs", "50"]).epochs == 50
    assert train_script.parse_args([]).epochs == 100
    for bad in ("0", "-1", "nan", "soon"):
        assert train_script.main(["--time", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--time" in err[0], err
    with pytest.raises(ResumeOptionError, match="time budget"):
        option_changes({"time": 0.5}, TrainConfig(time=0.05))
    assert option_changes({"time": 0.05}, TrainConfig(time=0.05)) == {}
    assert option_changes({"tensorboard": False}, TrainConfig()) == {"tensorboard": (True, False)}
    older = RunState().to_dict()
    del older["planned_epochs"], older["train_seconds"]  # a checkpoint from before --time
    assert (RunState.from_dict(older).planned_epochs, RunState.from_dict(older).train_seconds) == (0, 0.0)
    with pytest.raises(ValueError):
        RunState.from_dict({**RunState().to_dict(), "train_seconds": float("nan")})


# ---------------------------------------------------------------------- tiny runs

def tiny_args(root, data, cfg, name, *extra):
    return ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size", "4", "--epochs", "50",
            "--workers", "0", "--cache", "off", "--device", "cpu", "--project", str(root / "runs"), "--name", name,
            "--noautoanchor", *extra]


def train_capturing_stdout(args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = train_script.main(args)
    return status, out.getvalue()


def expected_lrs(epochs: int, rows: int) -> list[float]:
    """x/lr1 of each results.csv row for a run of ``epochs`` epochs with the default hyp: the last lr of the
    epoch, still inside warmup (at least 100 iterations), so lr0 x lr_lambda(epoch) x global step / warmup."""
    hyp = Hyp.load("hyp.scratch-low.yaml")
    warmup = warmup_iterations(hyp.warmup_epochs, BATCHES_PER_EPOCH)
    lf = lr_lambda(epochs, hyp.lrf)
    return [hyp.lr0 * lf(epoch) * ((epoch + 1) * BATCHES_PER_EPOCH - 1) / warmup for epoch in range(rows)]


@pytest.mark.slow
def test_a_time_budget_run_ends_early_as_a_normal_run(tmp_path):
    data, cfg = make_tiny_run(tmp_path)
    status, out = train_capturing_stdout(tiny_args(tmp_path, data, cfg, "budget", "--time", "0.001"))
    assert status == 0
    # 3.6 s, less than the time kept for the final plots: the first epoch is the run
    assert [d[2] for d in DECISION.findall(out)] == ["1"]
    run = tmp_path / "runs" / "budget"
    table = read_results_csv(run / "results.csv")
    assert len(table["epoch"]) == 1
    assert table["x/lr1"].tolist() == pytest.approx(expected_lrs(1, 1), rel=1e-4)
    checkpoint = torch.load(run / "weights" / "last.pt", weights_only=True)
    assert "training" not in checkpoint and (run / "weights" / "best.pt").exists()  # stripped, as any run
    assert (run / "results.png").exists() and (run / "confusion_matrix.png").exists()
    assert "Validating" in out and "of training time" in out


class EpochClock:
    """A clock that moves only when an epoch's training ends, by ``epoch_seconds``."""

    def __init__(self, epoch_seconds: float):
        self.now, self.epoch_seconds = 1000.0, epoch_seconds

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def epoch_clock(monkeypatch):
    clock = EpochClock(10.0)
    monkeypatch.setattr(budget, "clock", clock)
    real = trainer.train_one_epoch

    def timed(*args, **kwargs):
        stats = real(*args, **kwargs)
        clock.now += clock.epoch_seconds
        return stats

    monkeypatch.setattr(trainer, "train_one_epoch", timed)
    return clock


@pytest.mark.slow
def test_resume_keeps_the_chosen_epoch_count_and_is_exact(tmp_path, epoch_clock, monkeypatch, capsys):
    data, cfg = make_tiny_run(tmp_path)
    extra = ("--time", "0.01", "--noplots")  # 36 s: epochs of 10 s and a reserve under 6 s give 3 epochs
    status, out = train_capturing_stdout(tiny_args(tmp_path, data, cfg, "straight", *extra))
    assert status == 0 and [d[2] for d in DECISION.findall(out)] == ["3"]
    straight = (tmp_path / "runs" / "straight" / "results.csv").read_text()
    assert read_results_csv(tmp_path / "runs" / "straight" / "results.csv")["x/lr1"].tolist() == pytest.approx(
        expected_lrs(3, 3), rel=1e-4)

    with monkeypatch.context() as crash:
        crash.setattr(trainer, "Callbacks", lambda: StopAfterEpoch(1, "crash"))
        assert train_capturing_stdout(tiny_args(tmp_path, data, cfg, "crashed", *extra))[0] == 130
    last = tmp_path / "runs" / "crashed" / "weights" / "last.pt"
    run_state = torch.load(last, weights_only=True)["training"]["run"]
    assert (run_state["epoch"], run_state["planned_epochs"], run_state["train_seconds"]) == (2, 3, 20.0)

    assert train_script.main(["--resume", str(last), "--time", "0.5"]) == 2  # the budget is the run's
    assert "time budget" in capsys.readouterr().err
    epoch_clock.epoch_seconds = 1.0  # choosing again would now give 30 epochs: the resumed run keeps 3
    status, out = train_capturing_stdout(["--resume", str(last)])
    assert status == 0 and not DECISION.findall(out)
    assert "continuing the 3 epochs chosen after the first epoch (20.0 s spent)" in out
    assert (tmp_path / "runs" / "crashed" / "results.csv").read_text() == straight
    assert math.isclose(float(re.search(r"took \S+ h \((\S+) s\) of training time", out)[1]), 21.0)


@pytest.mark.slow
def test_the_reserve_counts_validation_on_the_budgets_clock(tmp_path, epoch_clock, monkeypatch):
    """The first epoch's validation sets the reserve for the final one; it is timed on the clock the budget is
    spent on (timed by another clock, a slow validation on a loaded machine changed the epoch count a controlled
    clock had fixed)."""
    data, cfg = make_tiny_run(tmp_path)
    real = trainer.validate_epoch

    def validation_of_6_s(*args, **kwargs):
        metrics = real(*args, **kwargs)
        epoch_clock.now += 6.0
        return metrics

    monkeypatch.setattr(trainer, "validate_epoch", validation_of_6_s)
    status, out = train_capturing_stdout(tiny_args(tmp_path, data, cfg, "reserve", "--time", "0.01", "--noplots"))
    assert status == 0
    (hours, took, epochs, kept), = DECISION.findall(out)[:1]
    assert float(took) == 16.0 and float(kept) == pytest.approx(end_reserve(6.0, False, plots=False), abs=0.05)
    assert int(epochs) == epochs_that_fit(36.0, 16.0, 1, end_reserve(6.0, False, plots=False), most=50)


@pytest.mark.slow
def test_the_epoch_that_runs_out_of_time_is_validated_and_recorded(tmp_path, epoch_clock, monkeypatch, capsys):
    """--noval: only the final epoch is validated. When the budget ends the run earlier than planned, the epoch
    it ends on is validated too (its results row, best.pt and the final metrics are the run's, not zeros), and
    last.pt records the stop, so a resume after a crash before the end trains no further epoch."""
    data, cfg = make_tiny_run(tmp_path)
    # 72 s: after a first epoch of 10 s, 5 epochs fit (15 s kept for 3 estimated validations); a second epoch of
    # 40 s leaves no room for a third: the run ends on epoch 2 of the 5 planned
    seconds = iter([10.0, 40.0, 40.0])

    real = trainer.train_one_epoch

    def uneven(*args, **kwargs):
        epoch_clock.epoch_seconds = next(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_one_epoch", uneven)  # runs inside the fixture's timed wrapper
    real_final = trainer.final_validation

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies after last.pt, before the end of the run

    monkeypatch.setattr(trainer, "final_validation", crash)
    args = tiny_args(tmp_path, data, cfg, "noval", "--time", "0.02", "--noplots", "--noval")
    assert train_capturing_stdout(args)[0] == 130  # "train.py: interrupted"
    run = tmp_path / "runs" / "noval"
    table = read_results_csv(run / "results.csv")
    assert len(table["epoch"]) == 2  # stopped after 2 of the 5 planned epochs
    assert table["val/box_loss"][0] == 0 and table["val/box_loss"][1] > 0  # --noval, but the last one validated
    assert table["val/obj_loss"][1] > 0
    run_state = torch.load(run / "weights" / "last.pt", weights_only=True)["training"]["run"]
    assert (run_state["epoch"], run_state["planned_epochs"]) == (2, 2)  # the stop is part of the run state

    monkeypatch.setattr(trainer, "final_validation", real_final)
    status, out = train_capturing_stdout(["--resume", str(run / "weights" / "last.pt")])
    assert status == 0
    assert len(read_results_csv(run / "results.csv")["epoch"]) == 2  # no third epoch
    assert "Validating" in out and "2 epochs completed" in out


@pytest.mark.slow
def test_time_without_epochs_never_shows_the_internal_cap(tmp_path, capfd):
    data, cfg = make_tiny_run(tmp_path)
    args = [a for a in tiny_args(tmp_path, data, cfg, "uncapped", "--time", "0.001", "--noplots", "--noval")]
    at = args.index("--epochs")
    del args[at:at + 2]
    assert train_script.main(args) == 0
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert str(train_script.TIME_MAX_EPOCHS) not in text
    assert "1/?" in text  # the first epoch's progress bar, before the budget sets the count
    table = read_results_csv(tmp_path / "runs" / "uncapped" / "results.csv")
    assert table["val/box_loss"][-1] > 0 and all(table["val/box_loss"][:-1] == 0)  # --noval: the last one only
    last = tmp_path / "runs" / "uncapped" / "weights" / "last.pt"
    assert train_script.main(["--resume", str(last)]) == 0  # finished: says so, with the epochs it trained
    captured = capfd.readouterr()
    assert f"this run finished its {len(table['epoch'])} epochs" in captured.out + captured.err
