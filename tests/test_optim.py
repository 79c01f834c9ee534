"""utils/trainer/optim.py and utils/trainer/ema.py: hand-computed schedule, warmup and EMA values."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from utils.config import ConfigError, Hyp
from utils.trainer.ema import ModelEMA
from utils.trainer.optim import (EpochSchedule, accumulate_steps, apply_warmup, build_optimizer, lr_lambda,
                                 scaled_weight_decay, warmup_iterations)


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1))


def test_accumulate_and_scaled_weight_decay():
    assert accumulate_steps(16) == 4
    assert accumulate_steps(24) == 3  # 64 / 24 = 2.67
    assert accumulate_steps(128) == 1
    assert accumulate_steps(10) == 6  # 6.4
    assert scaled_weight_decay(0.0005, 16, 4) == pytest.approx(0.0005)
    assert scaled_weight_decay(0.0005, 24, 3) == pytest.approx(0.0005 * 72 / 64)
    assert scaled_weight_decay(0.0005, 128, 1) == pytest.approx(0.001)


def test_nominal_batch_sets_accumulation_decay_and_warmup_target():
    """--nbs: the accumulation count, the weight-decay scale and the warmup's last accumulation follow it."""
    assert accumulate_steps(16, 16) == 1
    assert accumulate_steps(8, 16) == 2
    assert accumulate_steps(16, 128) == 8
    assert scaled_weight_decay(0.0005, 16, 1, 16) == pytest.approx(0.0005)
    assert scaled_weight_decay(0.0005, 24, 1, 16) == pytest.approx(0.0005 * 24 / 16)
    hyp, optimizer, lf = warmup_setup()
    assert [apply_warmup(optimizer, step, 200, 0, lf, hyp, 16, nominal_batch=16) for step in (0, 100, 250)] == [1] * 3
    assert [apply_warmup(optimizer, step, 200, 0, lf, hyp, 16, nominal_batch=128) for step in (0, 100, 250)] == [1, 4, 8]


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_parameter_groups_membership_and_decay(name):
    model = tiny_model()
    optimizer = build_optimizer(model, name, lr=0.01, momentum=0.9, weight_decay=0.0005)
    conv1, bn, conv2 = model
    groups = optimizer.param_groups
    assert [len(g["params"]) for g in groups] == [2, 2, 1]
    assert {id(p) for p in groups[0]["params"]} == {id(bn.bias), id(conv2.bias)}
    assert {id(p) for p in groups[1]["params"]} == {id(conv1.weight), id(conv2.weight)}
    assert {id(p) for p in groups[2]["params"]} == {id(bn.weight)}
    assert [g["weight_decay"] for g in groups] == [0.0, 0.0005, 0.0]
    assert all(g["lr"] == 0.01 for g in groups)
    if name == "SGD":
        assert type(optimizer).__name__ == "SGD"  # utils.trainer.sgd's (tests/test_sgd.py)
        assert all(g["nesterov"] and g["momentum"] == 0.9 for g in groups)
    else:
        assert type(optimizer).__name__ == name
        assert all(g["betas"] == (0.9, 0.999) for g in groups)


def test_unknown_optimizer_is_a_clear_config_error():
    with pytest.raises(ConfigError, match="unknown optimizer 'RMSProp'"):
        build_optimizer(tiny_model(), "RMSProp")
    assert issubclass(ConfigError, ValueError)


def test_lr_lambda_endpoints():
    linear = lr_lambda(10, 0.01)
    assert linear(0) == 1.0
    assert linear(10) == pytest.approx(0.01)
    assert linear(5) == pytest.approx(0.505)
    cosine = lr_lambda(10, 0.01, cos=True)
    assert cosine(0) == 1.0
    assert cosine(10) == pytest.approx(0.01)
    assert cosine(5) == pytest.approx(0.505)
    assert cosine(2.5) == pytest.approx((1 - math.cos(math.pi / 4)) / 2 * -0.99 + 1)


def test_warmup_iterations():
    assert warmup_iterations(3.0, 13) == 100  # 39 < 100 minimum
    assert warmup_iterations(3.0, 50) == 150
    assert warmup_iterations(0.5, 401) == 200  # round(200.5) is 200 (half to even)
    assert warmup_iterations(0.0, 1000) == 100  # YOLOv5 keeps the 100-iteration minimum


def warmup_setup(name="SGD", epochs=10):
    hyp = Hyp()  # lr0 0.01, lrf 0.01, momentum 0.937, warmup_momentum 0.8, warmup_bias_lr 0.1
    optimizer = build_optimizer(tiny_model(), name, hyp.lr0, hyp.momentum, 0.0005)
    lf = lr_lambda(epochs, hyp.lrf)
    EpochSchedule(optimizer, lf)  # sets initial_lr per group
    return hyp, optimizer, lf


def group_values(optimizer, key):
    return [g[key] for g in optimizer.param_groups]


def test_warmup_start_middle_end_and_after():
    hyp, optimizer, lf = warmup_setup()
    # step 0: bias lr from warmup_bias_lr, others from 0; momentum warmup_momentum; accumulate 1
    assert apply_warmup(optimizer, 0, 200, 0, lf, hyp, batch_size=16) == 1
    assert group_values(optimizer, "lr") == pytest.approx([0.1, 0.0, 0.0])
    assert group_values(optimizer, "momentum") == pytest.approx([0.8] * 3)
    # step 100 of 200 in epoch 0 (lf = 1): half way; accumulate interp(1 -> 4) = 2.5 -> 2 (half to even)
    assert apply_warmup(optimizer, 100, 200, 0, lf, hyp, batch_size=16) == 2
    assert group_values(optimizer, "lr") == pytest.approx([0.055, 0.005, 0.005])
    assert group_values(optimizer, "momentum") == pytest.approx([0.8685] * 3)
    # step 150: accumulate 1 + 3 * 0.75 = 3.25 -> 3
    assert apply_warmup(optimizer, 150, 200, 0, lf, hyp, batch_size=16) == 3
    # step 200 (last warmup step) in epoch 1: lf(1) = 0.9 * 0.99 + 0.01 = 0.901 -> lr 0.00901
    assert apply_warmup(optimizer, 200, 200, 1, lf, hyp, batch_size=16) == 4
    assert group_values(optimizer, "lr") == pytest.approx([0.00901] * 3)
    assert group_values(optimizer, "momentum") == pytest.approx([0.937] * 3)
    # after warmup: untouched, full accumulation
    for group in optimizer.param_groups:
        group["lr"] = 0.123
    assert apply_warmup(optimizer, 201, 200, 1, lf, hyp, batch_size=16) == 4
    assert group_values(optimizer, "lr") == [0.123] * 3


def test_warmup_large_batch_keeps_accumulate_one_and_adam_betas():
    hyp, optimizer, lf = warmup_setup("Adam")
    assert apply_warmup(optimizer, 50, 100, 0, lf, hyp, batch_size=128) == 1  # interp(1 -> 0.5) = 0.75 -> 1
    assert group_values(optimizer, "lr") == pytest.approx([0.055, 0.005, 0.005])
    assert group_values(optimizer, "betas") == [(0.937, 0.999)] * 3  # YOLOv5 warms SGD momentum only


def ema_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    return model


def test_ema_update_formula():
    model = ema_model()
    ema = ModelEMA(model, decay=0.9, tau=2.0)
    assert not ema.ema.training
    assert not any(p.requires_grad for p in ema.ema.parameters())
    assert ema.decay(0) == 0.0
    assert ema.decay(4) == pytest.approx(0.9 * (1 - math.exp(-2)))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
        model[1].running_mean.fill_(5.0)
        model[1].num_batches_tracked.fill_(7)
    ema.update(model)
    d1 = 0.9 * (1 - math.exp(-0.5))
    assert ema.updates == 1
    assert ema.ema[0].weight[0, 0].item() == pytest.approx(d1 * 1.0 + (1 - d1) * 3.0)
    assert ema.ema[1].running_mean[0].item() == pytest.approx((1 - d1) * 5.0)  # buffers start at 0
    assert ema.ema[1].num_batches_tracked.item() == 0  # integer buffers are not averaged
    first = ema.ema[0].weight[0, 0].item()
    ema.update(nn.DataParallel(model))  # wrapped models are unwrapped
    d2 = 0.9 * (1 - math.exp(-1.0))
    assert ema.ema[0].weight[0, 0].item() == pytest.approx(d2 * first + (1 - d2) * 3.0)


@pytest.mark.parametrize("deferred", [False, True])
def test_ema_follows_replaced_tensors_and_other_dtypes(deferred):
    """ModelEMA keeps its (EMA, model) tensor pairs between updates: a model whose data is swapped by ``.to()``, a
    buffer replaced by a new tensor, a submodule replaced by a new one and a model in another dtype are still what
    each update averages."""
    model = ema_model()
    ema = ModelEMA(model, decay=0.9, tau=2.0)
    keep = torch.ones((), dtype=torch.bool) if deferred else None
    ema.update(model, keep=keep)
    expected = {k: v.clone() for k, v in ema.ema.state_dict().items()}

    def one_update(values: dict) -> None:  # what the next update must give, from the model's state now
        d = 0.9 * (1 - math.exp(-(ema.updates + 1) / 2.0))
        for key, value in model.state_dict().items():
            if value.dtype.is_floating_point:
                values[key] = d * values[key] + (1 - d) * value.to(values[key].dtype)
        ema.update(model, keep=keep)
        for key, value in ema.ema.state_dict().items():
            assert torch.allclose(value, values[key], rtol=1e-6, atol=1e-7), key

    with torch.no_grad():
        model[0].weight.fill_(3.0)
    one_update(expected)
    model.to(torch.float64)  # swaps every parameter's data: the Parameter objects stay, the buffers are new
    with torch.no_grad():
        model[0].weight.fill_(-2.0)
        model[1].running_var.fill_(4.0)
    one_update(expected)
    model[1].running_mean = torch.full((2,), 6.0, dtype=torch.float64)  # a new buffer object
    one_update(expected)
    assert ema.ema[1].running_mean.dtype == torch.float32
    replacement = type(model[1])(2).to(torch.float64)
    with torch.no_grad():
        replacement.running_mean.fill_(-1.0)
        replacement.weight.fill_(0.5)
    model[1] = replacement  # a submodule swapped: the old one still holds its own tensors, the model holds new ones
    one_update(expected)


def test_ema_state_round_trip_and_update_attr():
    model = ema_model()
    ema = ModelEMA(model, decay=0.9, tau=2.0)
    with torch.no_grad():
        model[0].bias.fill_(2.0)
    ema.update(model)
    ema.update(model)
    restored = ModelEMA(ema_model(), decay=0.9, tau=2.0)
    restored.load_state_dict(ema.state_dict())
    assert restored.updates == 2
    assert torch.equal(restored.ema[0].bias, ema.ema[0].bias)
    model.names = ["cell"]
    model._private = 1
    ema.update_attr(model, include=("names",))
    assert ema.ema.names == ["cell"] and not hasattr(ema.ema, "_private")
