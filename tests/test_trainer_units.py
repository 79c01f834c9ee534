"""Unit tests of the training loop's pieces: epoch bookkeeping, early stopping, non-finite losses."""
from types import SimpleNamespace

import pytest
import torch

from utils.loggers import RESULTS_KEYS
from utils.trainer import amp
from utils.trainer.amp import choose_precision
from utils.trainer.loop import MAX_NONFINITE_IN_ROW, NonFiniteLossError, TrainStep, scale_batch
from utils.trainer.recorder import Recorder, epoch_values, fitness_of


def metrics(map50, map5095):
    return SimpleNamespace(mp=0.5, mr=0.4, map50=map50, map=map5095, losses=[0.1, 0.2, 0.3])


def test_epoch_values_and_fitness():
    values = epoch_values([1.0, 2.0, 3.0], metrics(0.8, 0.5), [0.01, 0.02, 0.03])
    assert list(values) == list(RESULTS_KEYS)
    assert values["metrics/mAP_0.5"] == 0.8 and values["x/lr2"] == 0.03 and values["val/cls_loss"] == 0.3
    assert fitness_of(values) == pytest.approx(0.1 * 0.8 + 0.9 * 0.5)
    assert epoch_values([1, 2, 3], None, [0.1])["metrics/mAP_0.5:0.95"] == 0.0


def test_recorder_best_last_and_early_stopping(tmp_path):
    (tmp_path / "weights").mkdir()
    recorder = Recorder(tmp_path, patience=2)
    saved = []

    def state(best_fitness):
        saved.append(best_fitness)
        return {"format": "yolo-trainer/1", "best_fitness": best_fitness}

    scores = [0.3, 0.5, 0.4, 0.45]
    improvements = []
    for epoch, score in enumerate(scores):
        values = epoch_values([0, 0, 0], metrics(score, score), [0, 0, 0])
        improvements.append(recorder.end_epoch(epoch, values, True, epoch == 3, state))
    assert improvements == [True, True, False, False]
    assert recorder.best_epoch == 1 and recorder.should_stop(3) and not recorder.should_stop(2)
    best = torch.load(tmp_path / "weights" / "best.pt", weights_only=True)
    assert best["best_fitness"] == pytest.approx(0.5)
    lines = (tmp_path / "results.csv").read_text().splitlines()
    assert len(lines) == 5 and lines[0].split(",")[0].strip() == "epoch"


def test_nosave_writes_only_the_final_epoch(tmp_path):
    recorder = Recorder(tmp_path, patience=100, nosave=True)
    state = lambda best_fitness: {"best_fitness": best_fitness}  # noqa: E731
    recorder.end_epoch(0, epoch_values([0, 0, 0], metrics(0.1, 0.1), [0]), True, False, state)
    assert not (tmp_path / "weights" / "last.pt").exists()
    recorder.end_epoch(1, epoch_values([0, 0, 0], metrics(0.2, 0.2), [0]), True, True, state)
    assert (tmp_path / "weights" / "last.pt").exists()


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
