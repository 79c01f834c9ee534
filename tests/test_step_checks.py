"""The training step's deferred checks (utils/trainer/step_checks.py: CUDA's default, forced on the CPU here): they
train as the immediate checks do, read the device only at the progress bar's reads, skip a non-finite step on the
device (SGD.step(skip=...), ModelEMA.update(keep=...)) and count it late with the same lines and errors."""
from __future__ import annotations

import logging
import math
import sys
import textwrap

import pytest
import torch

from benchmarks.host_reads import HostReads
from tests.test_host_reads import batches, tiny_step
from utils.errors import UserError
from utils.trainer.ema import ModelEMA
from utils.trainer.loop import MAX_NONFINITE_IN_ROW, REPORT_EVERY, NonFiniteLossError, train_one_epoch
from utils.trainer.sgd import SGD
from utils.trainer.state import RunState
from utils.trainer.step_checks import CHECKS_VARIABLE, StepChecks

CPU = torch.device("cpu")


def make_step(deferred: bool, fixed_shapes: bool = False):
    """The tiny model's step; ``fixed_shapes``: the loss form build_step pairs with deferred checks (compared with
    the same form under immediate checks: a 23-step run of this tiny model turns the forms' 1e-7 rounding
    difference into a 1% loss difference, so forms are compared in tests/test_loss.py, one step at a time)."""
    step = tiny_step()
    step.compute_loss.fixed_shapes = fixed_shapes
    if deferred:
        step.checks = StepChecks()
        step.__post_init__()
    return step


def largest_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa if sa[k].is_floating_point())


def train(step, count: int, accumulate: int = 1, at_step_boundary=None):
    state = RunState()
    stats = train_one_epoch(step, batches(count), state, 1, CPU, lambda *args: accumulate, at_step_boundary)
    return state, stats


def poisoned_loss(step, bad_iterations):
    """The step's loss is NaN at the iterations in ``bad_iterations`` (the model's forward is untouched)."""
    original = step.compute_loss

    def compute_loss(predictions, targets):
        loss, items = original(predictions, targets)
        if step.counters.global_step in bad_iterations:
            loss, items = loss * float("nan"), items * float("nan")
        return loss, items
    step.compute_loss = compute_loss


def warnings_of(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if "Non-finite" in record.getMessage()]


@pytest.mark.parametrize("accumulate, fixed_shapes", [(1, True), (2, True), (1, False)])
def test_deferred_checks_train_as_the_immediate_ones_and_read_only_with_the_progress_bar(accumulate, fixed_shapes):
    count = 2 * REPORT_EVERY + 3
    immediate, deferred = make_step(False, fixed_shapes), make_step(True, fixed_shapes)
    a_state, _ = train(immediate, count, accumulate)
    with HostReads() as reads:
        b_state, stats = train(deferred, count, accumulate)
    assert b_state.loss_batches == a_state.loss_batches == count and stats.skipped_steps == 0
    assert torch.allclose(torch.tensor(b_state.loss_sums), torch.tensor(a_state.loss_sums), rtol=1e-6)
    # the fused update rounds like the foreach one here (measured 0 for the weights, 6e-8 for the EMA on a Zen 4)
    assert largest_difference(immediate.model, deferred.model) < 1e-6
    assert largest_difference(immediate.ema.ema, deferred.ema.ema) < 1e-6
    assert deferred.ema.updates == immediate.ema.updates == count // accumulate  # steps at 0 (or 1), 2, 3, ...
    assert deferred.counters == immediate.counters
    places = reads.by_place()
    assert "utils/trainer/loop.py:_forward_backward" not in places  # no read for the loss's decision
    assert "utils/trainer/loop.py:optimizer_step" not in places  # nor for the gradients'
    assert places.pop("utils/trainer/step_checks.py:read") <= math.ceil(count / REPORT_EVERY) + 1
    assert places.pop("utils/trainer/loop.py:train_one_epoch") <= math.ceil(count / REPORT_EVERY) + 3
    assert places == {}


def test_a_nonfinite_loss_is_skipped_on_the_device_and_counted_as_the_immediate_checks_count_it(caplog):
    count, bad = 14, {5, 11}
    immediate, deferred = make_step(False), make_step(True)
    lines = []
    for step in (immediate, deferred):
        poisoned_loss(step, bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            state, stats = train(step, count)
        lines.append(warnings_of(caplog))
        assert state.loss_batches == count - len(bad) and stats.skipped_steps == len(bad)
        assert all(math.isfinite(value) for value in state.loss_sums)
    assert lines[0] == lines[1] == ["Non-finite loss at iteration 5: step skipped (1 in a row, 1 in total)",
                                    "Non-finite loss at iteration 11: step skipped (1 in a row, 2 in total)"]
    assert deferred.counters == immediate.counters
    assert largest_difference(immediate.model, deferred.model) < 1e-6  # neither moved at 5 and 11
    assert all(torch.isfinite(p).all() for p in deferred.ema.ema.parameters())
    # the documented difference: immediately, a window whose only batch had the NaN loss still updates the EMA
    assert (immediate.ema.updates, deferred.ema.updates) == (count, count - len(bad))


def test_a_nonfinite_gradient_of_a_finite_loss_is_a_skipped_step_counted_late(caplog):
    count = 12
    lines, steps = [], []
    for deferred in (False, True):
        step = make_step(deferred)
        weight = next(step.model.parameters())
        weight.register_hook(lambda grad, step=step: grad * float("inf") if step.counters.global_step == 7 else grad)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            state, _ = train(step, count)
        lines.append(warnings_of(caplog))
        steps.append(step)
        assert state.loss_batches == count and step.counters.skipped_steps_total == 1
        assert step.ema.updates == count - 1
    assert lines[0] == lines[1] == [
        "Non-finite gradient at iteration 7: optimizer step skipped (1 in a row, 1 in total)"]
    assert largest_difference(steps[0].model, steps[1].model) < 1e-6
    assert largest_difference(steps[0].ema.ema, steps[1].ema.ema) < 1e-6


def test_twenty_nonfinite_losses_in_a_row_stop_the_run_at_the_next_read(caplog):
    first_bad = 3
    last_read = []
    for deferred in (False, True):
        step = make_step(deferred)
        poisoned_loss(step, set(range(first_bad, 100)))
        caplog.clear()
        with caplog.at_level(logging.WARNING), pytest.raises(NonFiniteLossError, match="20 iterations in a row"):
            train(step, 60)
        last_read.append(step.counters.global_step)
        lines = warnings_of(caplog)
        assert len(lines) == MAX_NONFINITE_IN_ROW
        assert lines[-1] == (f"Non-finite loss at iteration {first_bad + MAX_NONFINITE_IN_ROW - 1}: step skipped "
                             f"({MAX_NONFINITE_IN_ROW} in a row, {MAX_NONFINITE_IN_ROW} in total)")
    immediate_stop, deferred_stop = last_read
    assert immediate_stop == first_bad + MAX_NONFINITE_IN_ROW - 1  # raised in the 20th bad iteration itself
    assert immediate_stop < deferred_stop <= immediate_stop + REPORT_EVERY  # at the next read


def test_a_mid_epoch_checkpoint_settles_the_pending_checks_first():
    step, seen = make_step(True), []
    poisoned_loss(step, {2})
    state = RunState()

    def at_step_boundary():  # what Trainer._at_step_boundary does before it writes last.pt
        step.settle(state)
        seen.append((state.loss_batches, step.counters.nonfinite_total, step.ema.updates))
        return False

    train_one_epoch(step, batches(6), state, 1, CPU, lambda *args: 1, at_step_boundary)
    assert seen == [(1, 0, 1), (2, 0, 2), (2, 1, 2), (3, 1, 3), (4, 1, 4)]
    assert state.loss_batches == 5


def sgd_pair(momentum=0.937, weight_decay=5e-4, nesterov=True):
    torch.manual_seed(0)
    params = [torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last).requires_grad_(),
              torch.randn(7, requires_grad=True)]
    twin = [p.detach().clone().requires_grad_() for p in params]
    make = lambda ps: SGD([{"params": ps[:1], "weight_decay": weight_decay}, {"params": ps[1:]}], lr=0.01,
                          momentum=momentum, nesterov=nesterov)
    return params, make(params), twin, make(twin)


def set_grads(*param_lists, seed=1, poison=False):
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=generator) for p in param_lists[0]]
    if poison:
        grads[1][3] = float("nan")
    for params in param_lists:
        for p, grad in zip(params, grads):
            p.grad = grad.clone().contiguous(memory_format=torch.channels_last if p.dim() == 4 else
                                             torch.contiguous_format)


@pytest.mark.parametrize("momentum, nesterov", [(0.937, True), (0.9, False), (0.0, False)])
def test_sgd_with_a_skip_flag_updates_as_the_foreach_sgd_and_a_skipped_step_changes_nothing(momentum, nesterov):
    params, fused, twin, foreach = sgd_pair(momentum, nesterov=nesterov)
    set_grads(params, twin, seed=1, poison=True)
    before = [p.detach().clone() for p in params]
    fused.step(skip=torch.tensor(True))  # a skipped first step: no parameter moves, no buffer is left unset
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.count_nonzero(entry["momentum_buffer"]) == 0 for entry in fused.state.values())
    for seed in range(2, 6):
        set_grads(params, twin, seed=seed)
        fused.step(skip=torch.tensor(False))
        foreach.step()
        for p, q in zip(params, twin):
            assert torch.allclose(p, q, rtol=0, atol=1e-7), float((p - q).abs().max())
    assert fused.state_dict()["state"].keys() == foreach.state_dict()["state"].keys()


def test_a_gradscaler_drives_the_skip_without_reading_its_flag():
    params, sgd, _, _ = sgd_pair()
    sgd._step_supports_amp_scaling = True  # as TrainStep sets it with deferred checks
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in params]
    loss = sum((p * p).sum() for p in params) * float("inf")
    scaler.scale(loss).backward()
    with HostReads() as reads:
        scaler.unscale_(sgd)
        scaler.step(sgd, skip=torch.tensor(False))
        scaler.update()
    assert reads.total() == 0
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # found_inf skipped it
    assert scaler.get_scale() == 512.0
    sgd.zero_grad()
    scaler.scale(sum((p * p).sum() for p in params)).backward()
    scaler.unscale_(sgd)
    scaler.step(sgd, skip=torch.tensor(False))
    scaler.update()
    assert not any(torch.equal(p, b) for p, b in zip(params, before))


def test_the_ema_decided_on_the_device_averages_as_on_the_host_and_keeps_a_skipped_step_out():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    host, device = ModelEMA(model, tau=3), ModelEMA(model, tau=3)
    for keep in (True, True, False, True, False, True):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        if keep:
            host.update(model)
        device.update(model, keep=torch.tensor(keep))
        assert largest_difference(host.ema, device.ema) < 1e-6
    assert host.updates == device.updates == 4
    device.updates = 9  # a resumed count: back on the host
    assert device.updates == 9 and device.state_dict()["updates"] == 9


def test_the_checks_are_deferred_on_cuda_and_immediate_on_the_cpu_unless_the_variable_says(monkeypatch):
    model = torch.nn.Linear(2, 2)
    sgd, torch_sgd = SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv(CHECKS_VARIABLE, raising=False)
    assert StepChecks.chosen(CPU, sgd) is None and isinstance(StepChecks.chosen(cuda, sgd), StepChecks)
    assert StepChecks.chosen(cuda, torch_sgd) is None  # its step cannot take the flag
    monkeypatch.setenv(CHECKS_VARIABLE, "deferred")
    assert isinstance(StepChecks.chosen(CPU, sgd), StepChecks)
    monkeypatch.setenv(CHECKS_VARIABLE, "immediate")
    assert StepChecks.chosen(cuda, sgd) is None
    monkeypatch.setenv(CHECKS_VARIABLE, "later")
    with pytest.raises(UserError, match="YOLO_TRAINER_STEP_CHECKS='later': must be one of immediate, deferred"):
        StepChecks.chosen(cuda, sgd)


@pytest.mark.slow
def test_two_processes_with_deferred_checks_skip_one_processs_nonfinite_loss_together(tmp_path):
    """torchrun, gloo: rank 1's loss is NaN at iteration 3; both processes skip that step, count it once each and
    end with the same weights (the trainer's checksum line)."""
    from tests.conftest import ROOT, make_tiny_run
    from tests.test_ddp import free_port, run, torchrun

    data, cfg = make_tiny_run(tmp_path, num_train=16, num_val=4)  # 4 batches of 2 per process
    script = tmp_path / "nan_on_rank1.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        import train
        from utils.loss import DetectionLoss

        original = DetectionLoss.__call__
        calls = []

        def poisoned(self, predictions, targets):
            loss, items = original(self, predictions, targets)
            calls.append(1)
            if os.environ["RANK"] == "1" and len(calls) == 4:  # the 4th training batch: iteration 3
                loss = loss * float("nan")
            return loss, items

        DetectionLoss.__call__ = poisoned
        sys.exit(train.main())
    """))
    command = torchrun(str(script), "--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64",
                       "--batch-size", "4", "--epochs", "1", "--workers", "0", "--device", "cpu", "--noautoanchor",
                       "--noplots", "--noval", "--amp", "off", "--save-period", "1", "--project", str(tmp_path / "runs"), "--name", "nan",
                       extra=["--master_port", str(free_port())])
    done = run(command, env={CHECKS_VARIABLE: "deferred"})
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert output.count("Non-finite loss at iteration 3: step skipped (1 in a row, 1 in total)") == 2  # each rank
    assert "model, BatchNorm statistics and EMA identical on all 2 processes" in output
    saved = torch.load(tmp_path / "runs" / "nan" / "weights" / "epoch0.pt", weights_only=True)
    assert saved["training"]["run"]["counters"]["nonfinite_total"] == 1
