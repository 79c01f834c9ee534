"""utils/trainer/sgd.py: torch.optim.SGD's results to the bit, its state_dict both ways, no torch._dynamo."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from utils.trainer.optim import build_optimizer
from utils.trainer.sgd import SGD

ROOT = Path(__file__).resolve().parents[1]


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 4, 1))


def three_groups(model: nn.Module, optimizer_class, nesterov: bool = True):
    """The trainer's layout: biases without decay, weights with, BatchNorm weights without."""
    params = list(model.parameters())  # conv0.w, conv0.b, bn.w, bn.b, conv3.w, conv3.b
    optimizer = optimizer_class([params[1], params[3], params[5]], lr=0.01, momentum=0.9, nesterov=nesterov,
                                weight_decay=0.0)
    optimizer.add_param_group({"params": [params[0], params[4]], "weight_decay": 5e-4})
    optimizer.add_param_group({"params": [params[2]], "weight_decay": 0.0})
    return optimizer


def train(model: nn.Module, optimizer, steps: int, start: int = 0) -> None:
    """Steps with the lr and momentum changing per step (as warmup does) and one parameter without a gradient."""
    x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    for step in range(start, start + steps):
        for group in optimizer.param_groups:
            group["lr"], group["momentum"] = 0.01 * (step + 1), 0.8 + 0.02 * step
        model(x).square().mean().backward()
        if step == 1:
            model[3].bias.grad = None  # no state for it until its first gradient
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("nesterov", [True, False])
def test_same_weights_and_state_as_torch_sgd_to_the_bit(nesterov):
    ours, theirs = tiny_model(), tiny_model()
    own_optimizer, torch_optimizer = three_groups(ours, SGD, nesterov), three_groups(theirs, torch.optim.SGD, nesterov)
    train(ours, own_optimizer, 5)
    train(theirs, torch_optimizer, 5)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))
    own, reference = own_optimizer.state_dict(), torch_optimizer.state_dict()
    assert own["param_groups"] == reference["param_groups"]  # every key and value, parameter numbers included
    assert own["state"].keys() == reference["state"].keys()
    assert all(torch.equal(own["state"][k]["momentum_buffer"], reference["state"][k]["momentum_buffer"])
               for k in reference["state"])


def test_state_dict_loads_both_ways_and_continues_identically():
    """A checkpoint of ours resumes in torch.optim.SGD (YOLOv5) and torch's in ours, with the same next steps."""
    start = tiny_model()
    first = three_groups(start, SGD)
    train(start, first, 3)
    saved = first.state_dict()
    models = [tiny_model() for _ in range(3)]
    for model in models:
        model.load_state_dict(start.state_dict())
    optimizers = [three_groups(models[0], SGD), three_groups(models[1], torch.optim.SGD), three_groups(models[2], SGD)]
    optimizers[0].load_state_dict(saved)  # ours copies the buffers it loads
    optimizers[1].load_state_dict(copy.deepcopy(saved))  # torch's would share them with `first`
    optimizers[2].load_state_dict(copy.deepcopy(optimizers[1].state_dict()))  # torch's, after a round trip
    for model, optimizer in zip(models, optimizers):
        train(model, optimizer, 2, start=3)
    weights = [list(model.parameters()) for model in models]
    assert all(torch.equal(p, q) and torch.equal(p, r) for p, q, r in zip(*weights))
    train(start, first, 2, start=3)  # the run that was never saved
    assert all(torch.equal(p, q) for p, q in zip(start.parameters(), models[0].parameters()))


def test_loaded_buffers_are_moved_to_the_parameter_dtype_and_groups_must_match():
    model = tiny_model()
    optimizer = three_groups(model, SGD)
    train(model, optimizer, 1)
    saved = optimizer.state_dict()
    saved["state"] = {k: {"momentum_buffer": v["momentum_buffer"].double()} for k, v in saved["state"].items()}
    optimizer.load_state_dict(saved)
    assert all(entry["momentum_buffer"].dtype == torch.float32 for entry in optimizer.state.values())
    same_dtype = optimizer.state_dict()
    optimizer.load_state_dict(same_dtype)
    before = [entry["momentum_buffer"].clone() for entry in optimizer.state.values()]
    for entry in same_dtype["state"].values():
        entry["momentum_buffer"].add_(1.0)  # the loaded state is a copy
    assert all(torch.equal(entry["momentum_buffer"], old) for entry, old in zip(optimizer.state.values(), before))
    saved["param_groups"] = saved["param_groups"][:2]
    with pytest.raises(ValueError, match="groups do not match"):
        optimizer.load_state_dict(saved)


def test_rejects_what_it_does_not_implement():
    weight = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="Nesterov"):
        SGD([weight], lr=0.1, momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match="in more than one"):
        SGD([weight, weight], lr=0.1)
    optimizer = SGD([weight], lr=0.1, momentum=0.9)
    optimizer.param_groups[0]["dampening"] = 0.1
    weight.grad = torch.ones(2)
    with pytest.raises(ValueError, match="dampening 0"):
        optimizer.step()
    assert torch.equal(weight, torch.ones(2))


def test_zero_grad_keeps_or_drops_gradients():
    weight = nn.Parameter(torch.ones(2))
    optimizer = SGD([weight], lr=0.1)
    weight.grad = torch.full((2,), 3.0)
    optimizer.zero_grad(set_to_none=False)
    assert torch.equal(weight.grad, torch.zeros(2))
    optimizer.zero_grad()
    assert weight.grad is None
    optimizer.step()  # no gradient: nothing moves
    assert torch.equal(weight, torch.ones(2))


def test_training_step_does_not_import_torch_dynamo():
    """What the own SGD is for: a process that builds the default optimizer and takes a step never pays the
    torch._dynamo import (over a second per start) that torch.optim's first step triggers."""
    code = ("import sys, torch\n"
            "from utils.trainer.optim import build_optimizer\n"
            "model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))\n"
            "optimizer = build_optimizer(model, 'SGD', weight_decay=5e-4)\n"
            "model(torch.randn(2, 3, 8, 8)).sum().backward()\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)\n"
            "optimizer.step(); optimizer.zero_grad(); optimizer.state_dict()\n"
            "print('torch._dynamo' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_build_optimizer_sgd_is_ours_adam_stays_torchs():
    assert type(build_optimizer(tiny_model(), "SGD")) is SGD
    assert isinstance(build_optimizer(tiny_model(), "Adam"), torch.optim.Adam)


def test_grad_scaler_unscales_skips_and_steps_it_like_torch_sgd():
    """The fp16 path (CUDA AMP) drives the optimizer through torch's GradScaler: unscale_, skip on inf, step."""
    results = []
    for optimizer_class in (SGD, torch.optim.SGD):
        model = tiny_model()
        optimizer = three_groups(model, optimizer_class)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(1))
        for step in range(3):
            scaler.scale(model(x).square().mean()).backward()
            if step == 1:
                model[0].weight.grad[0, 0, 0, 0] = float("inf")  # this step is skipped, the scale halved
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        results.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    (ours, our_scale), (theirs, their_scale) = results
    assert our_scale == their_scale == 2.0 ** 7
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    assert not torch.equal(ours[0], tiny_model()[0].weight)  # the finite steps moved the weights
