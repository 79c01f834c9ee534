"""Unit tests of the training loop's pieces: epoch bookkeeping, early stopping, non-finite losses."""
from types import SimpleNamespace

import pytest
import torch

from utils.loggers import RESULTS_KEYS
from utils.trainer import amp
from utils.trainer.amp import choose_precision
from utils.trainer.loop import MAX_NONFINITE_IN_ROW, NonFiniteLossError, TrainStep, scale_batch
from utils.trainer.recorder import Recorder, epoch_values, fitness_of
from utils.rng import capture_rng, restore_rng
from utils.trainer.state import RunState


def metrics(map50, map5095):
    return SimpleNamespace(mp=0.5, mr=0.4, map50=map50, map=map5095, losses=[0.1, 0.2, 0.3])


def test_epoch_values_and_fitness():
    values = epoch_values([1.0, 2.0, 3.0], metrics(0.8, 0.5), [0.01, 0.02, 0.03])
    assert list(values) == list(RESULTS_KEYS)
    assert values["metrics/mAP_0.5"] == 0.8 and values["x/lr2"] == 0.03 and values["val/cls_loss"] == 0.3
    assert fitness_of(values) == pytest.approx(0.1 * 0.8 + 0.9 * 0.5)
    assert epoch_values([1, 2, 3], None, [0.1])["metrics/mAP_0.5:0.95"] == 0.0


def test_run_state_tracks_best_and_patience():
    state = RunState()
    improvements = []
    for epoch, score in enumerate([0.3, 0.5, 0.4, 0.45]):
        state.start_epoch(epoch)
        values = epoch_values([0, 0, 0], metrics(score, score), [0, 0, 0])
        improvements.append(state.end_epoch(values, fitness_of(values)))
    assert improvements == [True, True, False, False]
    assert state.best_epoch == 1 and state.best_fitness == pytest.approx(0.5)
    assert state.epoch == 4 and state.epochs_without_improvement() == 2  # patience 2 stops here
    assert [row["epoch"] for row in state.results] == [0, 1, 2, 3]


def test_a_tie_is_an_improvement_and_the_epoch_before_a_stop_may_be_the_last():
    """As YOLOv5's EarlyStopping: an epoch as good as the best counts as an improvement (epochs of zero fitness, left
    unvalidated by --noval, never run down --patience), and the epoch after which no improvement would stop the run
    is known as it starts (validated under --noval and saved under --nosave, as the final one is)."""
    state, possible = RunState(), []
    for epoch, fitness in enumerate([0.0, 0.0, 0.3, 0.3, 0.2, 0.1]):
        state.start_epoch(epoch)
        possible.append(state.stop_possible(patience=2))
        assert state.end_epoch({}, fitness) == (epoch < 4)
    assert state.best_epoch == 3 and state.epochs_without_improvement() == 2  # patience 2 stops after epoch 5
    assert possible == [False, False, False, False, False, True]
    assert not RunState().stop_possible(patience=1) and not state.stop_possible(patience=0)


def test_run_state_round_trips_as_plain_data(tmp_path):
    state = RunState(epoch=3, batch=5, best_fitness=0.25, best_epoch=1, maps=[0.1, 0.2], loss_sums=[1.5, 2.0, 0.25],
                     loss_batches=5, world_size=2)
    state.counters.global_step, state.counters.last_optimizer_step = 44, 43
    state.results.append({"epoch": 0, **epoch_values([1, 2, 3], metrics(0.1, 0.05), [0.1, 0.1, 0.1])})
    torch.save(state.to_dict(), tmp_path / "state.pt")
    loaded = RunState.from_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert loaded == state
    state.start_epoch(3)  # continuing the epoch in progress keeps its position and loss sums
    assert state.batch == 5 and state.loss_sums == [1.5, 2.0, 0.25]
    state.start_epoch(4)
    assert state.batch == 0 and state.loss_sums == [0.0, 0.0, 0.0]


def test_rng_capture_and_restore_as_plain_data(tmp_path):
    import random

    import numpy as np

    torch.save(capture_rng(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_recorder_keeps_previous_last_and_links_best(tmp_path):
    recorder = Recorder(tmp_path, save_period=2)
    recorder.save({"best_fitness": 0.1, "epoch": 0}, epoch=0, improved=True)
    recorder.save({"best_fitness": 0.1, "epoch": 1}, epoch=1, improved=False)
    weights = tmp_path / "weights"
    load = lambda name: torch.load(weights / name, weights_only=True)["epoch"]  # noqa: E731
    assert load("last.pt") == 1 and load("last.prev.pt") == 0 and load("best.pt") == 0 and load("epoch0.pt") == 0
    assert not (weights / "epoch1.pt").exists()  # --save-period 2: epochs 0, 2, 4, ... as YOLOv5 v7
    recorder.save({"best_fitness": 0.1, "epoch": 2})  # mid-epoch: last.pt only
    assert load("last.pt") == 2 and load("last.prev.pt") == 1 and not (weights / "epoch2.pt").exists()
    assert oct((weights / "last.pt").stat().st_mode & 0o777) != oct(0o600)  # the umask's mode, not mkstemp's


def test_results_csv_is_rewritten_from_the_state(tmp_path):
    recorder = Recorder(tmp_path)
    rows = [{"epoch": e, **epoch_values([e, 0, 0], metrics(0.1, 0.1), [0])} for e in range(3)]
    for row in rows:
        recorder.log(row["epoch"], row)
    recorder.restart_results(rows[:2])  # a row written after the last checkpoint disappears
    lines = (tmp_path / "results.csv").read_text().splitlines()
    assert len(lines) == 3 and lines[-1].split(",")[0].strip() == "1"
    recorder.log(2, rows[2])
    assert (tmp_path / "results.csv").read_text().splitlines()[-1].split(",")[0].strip() == "2"


class NaNLoss:
    def __call__(self, predictions, targets):
        loss = predictions[0].sum() * float("nan")
        return loss.reshape(1), torch.zeros(3)


def test_non_finite_loss_skips_step_then_stops():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(lambda x: [model(x)], optimizer, NaNLoss(),
                     choose_precision("off", torch.device("cpu"), model), ema=None)
    before = model[0].weight.detach().clone()
    for _ in range(MAX_NONFINITE_IN_ROW - 1):
        _, finite = step.forward_backward(torch.rand(1, 3, 4, 4), torch.zeros(0, 6))
        assert not finite
    assert torch.equal(model[0].weight, before) and model[0].weight.grad is None
    with pytest.raises(NonFiniteLossError, match="in a row"):
        step.forward_backward(torch.rand(1, 3, 4, 4), torch.zeros(0, 6))


@pytest.mark.parametrize("native", [True, False])
def test_cpu_bf16_autocast_warns_only_without_native_bf16(monkeypatch, caplog, native):
    monkeypatch.setattr(amp, "cpu_has_native_bf16", lambda: native)
    model = torch.nn.Conv2d(3, 4, 3)
    with caplog.at_level("WARNING", logger=amp.__name__):
        precision = choose_precision("bf16", torch.device("cpu"), model)
    assert precision.dtype == torch.bfloat16 and precision.name == "bf16" and not precision.scaler.is_enabled()
    with precision.autocast():
        assert model(torch.rand(1, 3, 8, 8)).dtype == torch.bfloat16
    assert ("no native bf16" in caplog.text) != native


def test_scale_batch_keeps_stride_multiple():
    images = torch.rand(2, 3, 64, 96)
    out = scale_batch(images, 48)
    assert out.shape[2] % 32 == 0 and out.shape[3] % 32 == 0 and max(out.shape[2:]) == 64


def test_transfer_from_unrelated_weights_warns_naming_what_did_not_fit(caplog):
    from utils.trainer.setup import transfer_state

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    other = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)).state_dict()  # same names, other shapes
    assert transfer_state(model, other) == (0, 7)
    assert "fit only 0 of the model's 7 tensors" in caplog.text and "0.weight (4, 3, 3, 3) vs (8, 3, 3, 3)" in caplog.text
    caplog.clear()
    assert transfer_state(model, model.state_dict()) == (7, 7)
    assert "fit only" not in caplog.text


def tiny_step(tmp_path, **options):
    """build_step on the tiny model, as the trainer calls it: (step, warmup)."""
    from tests.conftest import TINY_MODEL_YAML
    from utils.config import Hyp, TrainConfig
    from utils.trainer.setup import build_training_model
    from utils.trainer.trainer import build_step

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_MODEL_YAML)
    model = build_training_model(str(cfg), "", 2, ["a", "b"])
    config = TrainConfig(batch_size=16, epochs=3, channels_last="off", **options)
    data = SimpleNamespace(imgsz=64, batches_per_epoch=10)
    info = SimpleNamespace(distributed=False, world_size=1)
    step, _, warmup = build_step(model, config, Hyp(), data, torch.device("cpu"), info,
                                 choose_precision("off", torch.device("cpu"), model))
    return step, warmup


@pytest.mark.parametrize("nbs, accumulate, decay", [(64, 4, 0.0005), (16, 1, 0.0005), (24, 2, 0.0005 * 32 / 24)])
def test_build_step_takes_the_nominal_batch_from_the_config(tmp_path, nbs, accumulate, decay):
    """--nbs reaches the optimizer: weight decay scaled to it, and the warmup ends at nbs / batch accumulation."""
    step, warmup = tiny_step(tmp_path, nbs=nbs)
    assert step.optimizer.param_groups[1]["weight_decay"] == pytest.approx(decay)
    assert warmup(0, 0) == 1 and warmup(500, 2) == accumulate


def test_the_training_model_activates_out_of_place_and_the_ema_in_place(tmp_path):
    step, _ = tiny_step(tmp_path)
    trained = [m.inplace for m in step.model.modules() if isinstance(m, torch.nn.SiLU)]
    inferring = [m.inplace for m in step.ema.ema.modules() if isinstance(m, torch.nn.SiLU)]
    assert trained and not any(trained)
    assert inferring and all(inferring)


@pytest.mark.parametrize("quad, captured", [(False, 16), (True, 4)])
@pytest.mark.parametrize("flag, builder", [("cuda_graphs", "graphed_model"), ("compile", "compiled_model")])
def test_cuda_graphs_and_compile_take_the_batch_the_model_sees(tmp_path, monkeypatch, quad, captured, flag, builder):
    """--cuda-graphs captures, and --compile compiles, batches of the per-process batch size, a quarter of it with
    --quad (which trains each 4 images as one); other sizes would never be captured and the flag would do nothing."""
    from utils.trainer import trainer

    asked = []
    for name in ("graphed_model", "compiled_model"):
        monkeypatch.setattr(trainer, name, lambda enabled, model, precision, batch_size, *args, name=name: asked.append(
            (name, enabled, batch_size)))
    tiny_step(tmp_path, quad=quad, **{flag: True})
    assert (builder, True, captured) in asked and all(enabled == (name == builder) for name, enabled, _ in asked)


@pytest.mark.parametrize("best_is_last", [True, False])
def test_last_and_best_are_stripped_once_when_best_is_last(tmp_path, monkeypatch, best_is_last):
    """At the end of a run whose last epoch was its best, best.pt is a link to last.pt's file: that file is stripped
    once and best.pt holds exactly the bytes a second strip would have written."""
    import shutil
    import yaml

    from models.yolo import DetectionModel
    from tests.conftest import TINY_MODEL_YAML
    from utils.checkpoint import copy_checkpoint, model_state, save_checkpoint, strip_checkpoint
    from utils.trainer import stages

    def training_file(path, seed):
        torch.manual_seed(seed)
        model = DetectionModel(yaml.safe_load(TINY_MODEL_YAML))
        save_checkpoint({"model": model_state(model), "ema": model_state(model), "epoch": 1, "date": "2026-11-28",
                         "training": {"version": 1}}, path)

    weights = tmp_path / "weights"
    training_file(weights / "last.pt", seed=0)
    if best_is_last:
        copy_checkpoint(weights / "last.pt", weights / "best.pt")
    else:
        training_file(weights / "best.pt", seed=1)
    for name in ("last", "best"):  # what stripping each file on its own writes
        shutil.copy(weights / f"{name}.pt", tmp_path / f"{name}-alone.pt")
        strip_checkpoint(tmp_path / f"{name}-alone.pt")
    calls = []
    monkeypatch.setattr(stages, "strip_checkpoint", lambda path: calls.append(path.name) or strip_checkpoint(path))
    stages.strip_last_and_best(weights / "last.pt", weights / "best.pt")
    assert calls == (["last.pt"] if best_is_last else ["last.pt", "best.pt"])
    for name in ("last", "best"):
        assert (weights / f"{name}.pt").read_bytes() == (tmp_path / f"{name}-alone.pt").read_bytes()
        assert torch.load(weights / f"{name}.pt", weights_only=True)["finished"]
