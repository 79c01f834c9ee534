"""--cuda-graphs (utils/trainer/cuda_graphs.py): which runs use it, and that its capture changes nothing a run computes.

On the CPU the capture is a stand-in (benchmarks/graph_stand_in.py) that does what the capture does to the model (warm-up
iterations in training mode, which move BatchNorm's statistics, and gradients taken with autograd.grad, not
accumulated) and returns what the graphs do: the model's outputs, and from the backward the gradients written into
static buffers that it hands to autograd detached (which a parameter without a gradient takes as it is). The ``cuda``
case captures real graphs and compares them with the eager step."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from benchmarks.graph_stand_in import StandInCapture
from tests.conftest import NO_CUDA
from tests.test_host_reads import batches, tiny_step
from utils.cuda_capture import CUDA_CAPTURE_LOCK
from utils.trainer.cuda_graphs import GraphedModel, captures, graphed_model, pad_targets, target_capacity
from utils.trainer.loop import train_one_epoch
from utils.trainer.state import RunState

CPU = torch.device("cpu")


def buffers(model) -> dict:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def test_the_flag_is_used_on_one_cuda_process_only(caplog):
    step = tiny_step()
    model, precision = step.model, step.precision

    def warnings() -> list[str]:
        return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert graphed_model(False, model, precision, 2, torch.device("cuda"), False) is None
        assert not warnings()
        assert graphed_model(True, model, precision, 2, CPU, False) is None
        assert graphed_model(True, model, precision, 2, torch.device("cuda", 0), True) is None
    said = warnings()
    assert len(said) == 2 and "--cuda-graphs has no effect on cpu" in said[0] and "not used under DDP" in said[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        graphs = graphed_model(True, model, precision, 2, torch.device("cuda", 0), False, multi_scale=True)
    assert isinstance(graphs, GraphedModel) and graphs.batch_size == 2 and graphs.graphed is None
    assert len(warnings()) == 1 and "--multi-scale" in warnings()[0]


@pytest.mark.parametrize("accumulate", [1, 2, 4])
def test_the_capture_leaves_the_run_as_it_was_and_a_smaller_last_batch_replays_too(accumulate):
    """A run whose forward goes through GraphedModel (the stand-in capture) ends with the weights, BatchNorm statistics
    and EMA of the same run without it, to the bit, with optimizer steps of 1, 2 and 4 micro-steps (the replays'
    gradient buffers must not be overwritten within a window). The full batch is captured after warm-up passes, a
    smaller batch of the same images (an epoch's last) once more without any; images of another size and eval mode
    run eagerly."""
    plain, graphed = tiny_step(), tiny_step()
    capture = StandInCapture()
    graphed.runner = GraphedModel(graphed.model, graphed.precision, batch_size=2, capture=capture)
    loader = batches(7)
    smaller = [(images[:1], targets[targets[:, 0] == 0], paths[:1], shapes) for images, targets, paths, shapes
               in batches(1)]
    cropped = [(images[..., :32, :32], targets, paths, shapes) for images, targets, paths, shapes in batches(1)]
    for step in (plain, graphed):
        train_one_epoch(step, loader + smaller + cropped + smaller + loader[:2], RunState(), 1, CPU,
                        lambda *args: accumulate)
    assert capture.calls == 2 and capture.warmups == [3, 0] and capture.cache_enabled == [True, True]  # fp32: no autocast
    assert [key[0] for key in graphed.runner.graphs] == [(2, 3, 64, 64), (1, 3, 64, 64)]
    assert (graphed.runner.replays, graphed.runner.eager) == (11, 1)
    for name, module in (("model", lambda s: s.model), ("EMA", lambda s: s.ema.ema)):
        for (key, a), (_, b) in zip(module(plain).state_dict().items(), module(graphed).state_dict().items()):
            assert torch.equal(a, b), (name, key)
    graphed.model.eval()
    with torch.no_grad():
        graphed.runner(loader[0][0].float() / 255)
    assert graphed.runner.eager == 2


@pytest.mark.parametrize(("shape", "captured", "expected"), [
    ((4, 3, 64, 64), [], True), ((2, 3, 64, 64), [], False),  # first the run's full batch
    ((2, 3, 64, 64), [(4, 3, 64, 64)], True),  # then one smaller batch of the same images
    ((2, 3, 32, 32), [(4, 3, 64, 64)], False), ((6, 3, 64, 64), [(4, 3, 64, 64)], False),
    ((1, 3, 64, 64), [(4, 3, 64, 64), (2, 3, 64, 64)], False)])  # at most MAX_SHAPES
def test_which_batches_are_captured(shape, captured, expected):
    def key(dims):
        return dims, torch.empty(dims).stride(), torch.float32

    assert captures(key(shape), [key(c) for c in captured], 4) is expected
    if expected and captured:  # the same shape in another dtype is other images
        assert not captures((shape, torch.empty(shape).stride(), torch.float16), [key(c) for c in captured], 4)


def test_the_capture_puts_batchnorm_back_and_turns_autocast_cache_off():
    """After the capture's warm-up passes BatchNorm holds what one pass of the batch gives (the replayed one), as the
    same model without graphs; the capture ran under autocast with its weight cache off, holding the capture lock."""
    step = tiny_step()
    reference = copy.deepcopy(step.model)
    capture = StandInCapture()
    precision = copy.copy(step.precision)
    precision.dtype = torch.bfloat16  # autocast on the CPU: the capture must see its cache off
    graphs = GraphedModel(step.model, precision, batch_size=2, capture=capture)
    images = batches(1)[0][0].float() / 255
    graphs(images)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference(images)
    assert capture.cache_enabled == [False] and (graphs.replays, graphs.eager) == (1, 0)
    assert capture.locked == [True] and not CUDA_CAPTURE_LOCK.locked()  # the pin thread waited (utils/cuda_capture.py)
    expected, after = buffers(reference), buffers(step.model)
    counted = [name for name in after if name.endswith("num_batches_tracked")]
    assert counted and all(int(after[name]) == 1 for name in counted)  # one pass, not 1 + WARMUP_ITERATIONS
    assert all(torch.equal(expected[name], after[name]) for name in expected)


def test_a_failed_capture_leaves_the_run_training_eagerly(caplog, monkeypatch):
    """A capture that raises (CUDA refuses an operation while capturing, or memory runs out) after its warm-up passes:
    one warning naming the shape and the reason, BatchNorm put back, the captures' cached memory released, this batch
    and every later one eager, no second attempt, and the run's values those of the eager step."""
    class Refusing(StandInCapture):
        def __call__(self, module, sample_args, num_warmup_iters=3, allow_unused_input=False):
            super().__call__(module, sample_args, num_warmup_iters, allow_unused_input)
            raise RuntimeError("operation not permitted when stream is capturing\nCUDA kernel errors ...")

    import utils.trainer.cuda_graphs as cuda_graphs

    released = []
    monkeypatch.setattr(cuda_graphs, "release_cached_memory", lambda: released.append(len(graphed.runner.graphs)))
    plain, graphed = tiny_step(), tiny_step()
    capture = Refusing()
    graphed.runner = GraphedModel(graphed.model, graphed.precision, batch_size=2, capture=capture)
    loader = batches(3)
    with caplog.at_level(logging.WARNING):
        for step in (plain, graphed):
            train_one_epoch(step, loader + loader[:1], RunState(), 1, CPU, lambda *args: 1)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == ["WARNING: --cuda-graphs: the capture for batches of 2x3x64x64 failed (operation not permitted when "
                    "stream is capturing); training on without graphs"]
    assert capture.calls == 1 and graphed.runner.failed and not graphed.runner.graphs
    assert released == [0]  # once, after the captures were dropped: their pool goes back to the device
    assert (graphed.runner.replays, graphed.runner.eager) == (0, 4)
    for (key, a), (_, b) in zip(plain.model.state_dict().items(), graphed.model.state_dict().items()):
        assert torch.equal(a, b), key


def test_gradients_own_their_memory_only_after_a_replay():
    step = tiny_step()
    graphs = GraphedModel(step.model, step.precision, batch_size=2, capture=StandInCapture())
    images = batches(1)[0][0].float() / 255
    sum(o.sum() for o in graphs(images[:1])).backward()  # eager: autograd's own gradients
    before = [p.grad for p in step.model.parameters()]
    graphs.own_gradients()
    assert all(p.grad is g for p, g in zip(step.model.parameters(), before))
    step.optimizer.zero_grad(set_to_none=True)
    sum(o.sum() for o in graphs(images)).backward()  # replayed: the graph's buffers, taken as they are
    static = {s.data_ptr() for s in graphs.graphed.static}
    assert all(p.grad.data_ptr() in static for p in step.model.parameters())
    values = [p.grad.clone() for p in step.model.parameters()]
    graphs.own_gradients()
    assert not any(p.grad.data_ptr() in static for p in step.model.parameters())
    assert all(torch.equal(p.grad, v) for p, v in zip(step.model.parameters(), values))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("with_loss", [False, True], ids=["model", "model+loss"])
def test_graphs_train_as_the_eager_step_on_cuda(accumulate, with_loss):
    """Real CUDA graphs: 8 fp16 micro-steps (GradScaler, deferred checks, the fixed-shape loss, graphed with the model
    over padded targets or eager after it), an optimizer step every ``accumulate``, against the eager step from the
    same weights and batches: weights within fp16 training's rounding; after the capture no step waits for the
    device (``set_sync_debug_mode("error")``)."""
    from tests.test_cuda import tiny_batch, tiny_model
    from utils.config import Hyp
    from utils.loss import DetectionLoss
    from utils.trainer.amp import choose_precision
    from utils.trainer.ema import ModelEMA
    from utils.trainer.loop import TrainStep
    from utils.trainer.optim import build_optimizer
    from utils.trainer.step_checks import StepChecks

    device = torch.device("cuda")
    steps = []
    for graphs in (False, True):
        model = tiny_model().to(device).train()
        precision = choose_precision("auto", device, model)
        step = TrainStep(model, build_optimizer(model, lr=0.01), DetectionLoss(model, Hyp(), imgsz=64, fixed_shapes=True),
                         precision, ModelEMA(model), checks=StepChecks())
        step.runner = GraphedModel(model, precision, batch_size=2,
                                   compute_loss=step.compute_loss if with_loss else None) if graphs else None
        images, targets = tiny_batch(device)
        smaller = images[:1], targets[targets[:, 0] == 0]
        for micro_step in range(8):
            stepping = (micro_step + 1) % accumulate == 0
            batch = smaller if micro_step in (4, 5) else (images, targets)
            if graphs and micro_step >= accumulate and micro_step != 4:  # captured, stepped once: nothing may wait
                torch.cuda.set_sync_debug_mode("error")
            try:
                step.forward_backward(*batch, sync=stepping)
                if stepping:
                    step.optimizer_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            step.counters.global_step += 1
        steps.append(step)
    assert steps[1].runner.replays == 8 and steps[1].runner.eager == 0 and len(steps[1].runner.graphs) == 2
    assert (steps[1].runner.compute_loss is not None) == with_loss
    for a, b in zip(steps[0].model.state_dict().values(), steps[1].model.state_dict().values()):
        if a.dtype.is_floating_point:
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-4)
        else:
            assert torch.equal(a, b)


# --- the loss in the graphs (fixed shapes, padded targets) ------------------------------------------------------

def deferred_step():
    """tiny_step as CUDA trains: the fixed-shape loss and the deferred step checks (which it goes with)."""
    from utils.config import Hyp
    from utils.loss import DetectionLoss
    from utils.trainer.loop import TrainStep
    from utils.trainer.step_checks import StepChecks

    step = tiny_step()
    return TrainStep(step.model, step.optimizer, DetectionLoss(step.model, Hyp(), imgsz=64, fixed_shapes=True),
                     step.precision, step.ema, checks=StepChecks())


def many_targets(count: int, seed: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    boxes = torch.rand(count, 4, generator=generator) * torch.tensor([0.8, 0.8, 0.5, 0.5]) + 0.1
    return torch.cat((torch.randint(0, 2, (count, 1), generator=generator).float(),
                      torch.randint(0, 2, (count, 1), generator=generator).float(), boxes), 1)


@pytest.mark.parametrize("count", [0, 2, 40])
def test_padded_targets_leave_the_fixed_shape_loss_as_it_was(count):
    """Rows of zero size match no anchor: none of their candidates is kept, the real ones are kept as before, and the
    loss, its items and its gradients are the same within float rounding (the sums hold more zeros)."""
    step = deferred_step()
    targets = many_targets(count)
    padded = pad_targets(targets, target_capacity(count, 2))
    assert padded.shape == (target_capacity(count, 2), 6) and torch.equal(padded[:count], targets)
    images = batches(1)[0][0].float() / 255
    results = []
    for given in (targets, padded):
        step.model.zero_grad(set_to_none=True)
        predictions = [p.float() for p in step.model(images)]
        loss, items = step.compute_loss(predictions, given)
        loss.backward()
        valid = step.compute_loss.build_candidates(predictions, given)[-1].view(len(predictions), 5, 3, -1)
        results.append((loss.detach(), items, [p.grad.clone() for p in step.model.parameters()], valid))
    (loss, items, grads, valid), (padded_loss, padded_items, padded_grads, padded_valid) = results
    assert torch.equal(padded_valid[..., :count], valid) and not padded_valid[..., count:].any()
    assert torch.allclose(padded_loss, loss, rtol=1e-6, atol=0) and torch.allclose(padded_items, items, rtol=1e-6, atol=0)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-9) for a, b in zip(padded_grads, grads))


def test_target_capacity_is_twice_the_capture_batch_and_at_least_32_an_image():
    assert target_capacity(0, 2) == 256 and target_capacity(100, 2) == 256  # 64 an image at least, in steps of 256
    assert target_capacity(3000, 64) == 6144 and target_capacity(500, 64) == 2048


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_loss_graphed_with_the_model_trains_as_the_eager_step(accumulate, caplog):
    """A run whose model and fixed-shape loss replay together (the stand-in capture, padded targets) ends with the
    weights, BatchNorm statistics and EMA of the eager run within float rounding; a smaller batch and a batch with
    more targets than the capacity run eagerly (the latter said once); the capture puts BatchNorm back."""
    plain, graphed = deferred_step(), deferred_step()
    capture = StandInCapture()
    graphed.runner = GraphedModel(graphed.model, graphed.precision, batch_size=2, capture=capture,
                                  compute_loss=graphed.compute_loss)
    loader = batches(5)
    crowded = [(images, many_targets(300), paths, shapes) for images, _, paths, shapes in batches(2)]
    smaller = [(images[:1], targets[targets[:, 0] == 0], paths[:1], shapes) for images, targets, paths, shapes
               in batches(1)]
    with caplog.at_level(logging.INFO):
        for step in (plain, graphed):
            train_one_epoch(step, loader + crowded + smaller + loader[:2], RunState(), 1, CPU,
                            lambda *args: accumulate)
    runner = graphed.runner
    assert capture.calls == 2 and runner.capacity == 256 and [captured.capacity for captured in runner.graphs.values()] == [256, 256]
    assert (runner.replays, runner.eager, runner.overflows) == (8, 2, 2)
    said = [r.getMessage() for r in caplog.records if "more than the 256" in r.getMessage()]
    assert said == ["--cuda-graphs: a batch with 300 targets, more than the 256 the loss was captured for, runs "
                    "eagerly (as will any other such batch)"]
    for name, module in (("model", lambda s: s.model), ("EMA", lambda s: s.ema.ema)):
        for (key, a), (_, b) in zip(module(plain).state_dict().items(), module(graphed).state_dict().items()):
            if a.dtype.is_floating_point:
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (name, key, (a - b).abs().max())
            else:
                assert torch.equal(a, b), (name, key)
    from benchmarks.host_reads import HostReads

    images, targets = loader[0][0].float() / 255, loader[0][1]
    with HostReads() as reads:  # a replayed step reads nothing: the padding's size is the targets' shape
        for _ in range(3):
            graphed.forward_backward(images, targets)
            graphed.optimizer_step()
    assert reads.total() == 0 and runner.replays == 11, reads.by_place()
    graphed.model.eval()
    assert runner.loss_of(images, targets) is None  # eval mode: eager


def test_a_loss_with_data_dependent_shapes_stays_out_of_the_graphs():
    step = tiny_step()  # the compact loss: the host reads the number of matches
    graphs = GraphedModel(step.model, step.precision, batch_size=2, capture=StandInCapture(),
                          compute_loss=step.compute_loss)
    images, targets = batches(1)[0][0].float() / 255, batches(1)[0][1]
    assert graphs.compute_loss is None and graphs.loss_of(images, targets) is None
    graphs(images)
    assert (graphs.replays, graphs.eager) == (1, 0)  # the model alone is graphed


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("extra", [(), ("--augment-device",)], ids=["opencv", "augment-device"])
def test_train_py_captures_while_the_loader_pins_batches(extra, tmp_path):
    """train.py --cuda-graphs with 2 loader workers: the capture at the first full batch runs while the DataLoader's
    pin-memory thread pins the next batches (which, unguarded, invalidates a global-mode capture and ends the run:
    utils/cuda_capture.py). 10 images in batches of 4: the smaller last batch is captured too; 2 epochs finish."""
    import subprocess
    import sys

    from tests.conftest import ROOT, make_tiny_run

    data, cfg = make_tiny_run(tmp_path, num_train=10)
    command = [sys.executable, str(ROOT / "train.py"), "--data", str(data), "--cfg", str(cfg), "--weights", "",
               "--imgsz", "64", "--batch-size", "4", "--epochs", "2", "--workers", "2", "--device", "0",
               "--noautoanchor", "--noplots", "--cuda-graphs", "--project", str(tmp_path / "runs"), *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "--cuda-graphs: forward, loss (up to 256 targets) and backward captured for batches of 4x3x64x64" in output
    assert "captured for batches of 2x3x64x64 (into the same memory)" in output
    assert (tmp_path / "runs" / "exp" / "weights" / "last.pt").is_file()


@pytest.mark.slow
def test_train_py_with_the_capture_stood_in_trains_as_without(tmp_path, monkeypatch):
    """train.py --cuda-graphs through the whole trainer on the CPU: the capture a stand-in (graphed_model's CUDA check
    bypassed) and CUDA's step (deferred checks, the fixed-shape loss graphed with the model). 3 epochs of 10 images
    in batches of 4 (the last batch of 2 captured too, without warm-up passes), --nbs 64: warmup raises the micro-steps a step from 1 to 2 by the 5th
    batch (the replays' gradient buffers must then not be overwritten within a step, also across an epoch's end).
    results.csv and last.pt end as the same run's without the flag, within float rounding."""
    import numpy as np

    import train
    from tests.conftest import make_tiny_run
    from utils.checkpoint import load_checkpoint
    from utils.plots import read_results_csv
    from utils.trainer import trainer as trainer_module

    monkeypatch.setenv("YOLO_TRAINER_STEP_CHECKS", "deferred")
    runners = []

    def stood_in(enabled, model, precision, batch_size, device, distributed, multi_scale=False, compute_loss=None):
        if not enabled:
            return None
        runners.append(GraphedModel(model, precision, batch_size, capture=StandInCapture(), compute_loss=compute_loss))
        return runners[-1]

    monkeypatch.setattr(trainer_module, "graphed_model", stood_in)
    data, cfg = make_tiny_run(tmp_path, num_train=10)
    results, weights = [], []
    for name, extra in (("plain", []), ("graphs", ["--cuda-graphs"])):
        assert train.main(["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size", "4",
                           "--epochs", "3", "--workers", "0", "--device", "cpu", "--amp", "off",
                           "--noautoanchor", "--noplots", "--no-tensorboard", "--project", str(tmp_path / "runs"),
                           "--name", name, *extra]) == 0
        folder = tmp_path / "runs" / name
        results.append(read_results_csv(folder / "results.csv"))
        weights.append(load_checkpoint(folder / "weights" / "last.pt")["model"]["state_dict"])
    runner = runners[0]
    assert len(runners) == 1 and runner.compute_loss is not None and runner.capacity == 256
    assert (runner.replays, runner.eager, runner.overflows) == (9, 0, 0)  # 2 full batches and the last, 3 times
    assert [key[0][0] for key in runner.graphs] == [4, 2]
    for column, plain in results[0].items():
        assert np.allclose(results[1][column], plain, rtol=1e-4, atol=1e-6), column
    for key, plain in weights[0].items():
        graphed = weights[1][key]
        if plain.dtype.is_floating_point:
            assert torch.allclose(graphed, plain, rtol=1e-3, atol=1e-5), key
        else:
            assert torch.equal(graphed, plain), key
