"""utils/trainer/sgd.py: torch.optim.SGD's results to the bit, its state_dict both ways, no torch._dynamo."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.conftest import fresh_python
from utils.config import ConfigError
from utils.trainer.optim import build_optimizer
from utils.trainer.sgd import SGD


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


def assert_same_training(own_model: nn.Module, own_optimizer, torch_model: nn.Module, torch_optimizer, steps=3):
    """Both take the same steps: the same weights and state_dicts to the bit."""
    train(own_model, own_optimizer, steps)
    train(torch_model, torch_optimizer, steps)
    assert all(torch.equal(p, q) for p, q in zip(own_model.parameters(), torch_model.parameters()))
    own, reference = own_optimizer.state_dict(), torch_optimizer.state_dict()
    assert own["param_groups"] == reference["param_groups"]
    assert own["state"].keys() == reference["state"].keys()
    assert all(torch.equal(own["state"][k]["momentum_buffer"], reference["state"][k]["momentum_buffer"])
               for k in reference["state"])


PARAMETER_FORMS = {
    "group dicts": lambda model: [{"params": [model[0].weight, model[3].weight], "weight_decay": 5e-4},
                                  {"params": (p for p in [model[0].bias, model[3].bias]), "lr": 0.02},
                                  {"params": model[1].weight}, {"params": [model[1].bias], "nesterov": False}],
    "named parameters": lambda model: list(model.named_parameters()),
    "named group dicts": lambda model: [{"params": list(model.named_parameters())[:3]},
                                        {"params": list(model.named_parameters())[3:], "momentum": 0.5}],
    "a generator": lambda model: model.parameters(),
}


@pytest.mark.parametrize("form", PARAMETER_FORMS)
def test_takes_torch_sgd_parameter_forms(form):
    """A list of group dicts, (name, tensor) pairs, a generator: the groups, state_dicts and steps torch's make."""
    ours, theirs = tiny_model(), tiny_model()
    own_optimizer = SGD(PARAMETER_FORMS[form](ours), lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)
    torch_optimizer = torch.optim.SGD(PARAMETER_FORMS[form](theirs), lr=0.01, momentum=0.9, nesterov=True,
                                      weight_decay=1e-4)
    assert own_optimizer.state_dict()["param_groups"] == torch_optimizer.state_dict()["param_groups"]
    assert_same_training(ours, own_optimizer, theirs, torch_optimizer)


def test_closure_and_tensor_lr_as_torch_sgd():
    results = []
    for optimizer_class in (SGD, torch.optim.SGD):
        model = tiny_model()
        optimizer = optimizer_class(model.parameters(), lr=torch.tensor([0.05]), momentum=0.9)
        x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(1))

        def closure():
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss

        losses = [optimizer.step(closure).item() for _ in range(3)]
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (own_losses, ours), (torch_losses, theirs) = results
    assert own_losses == torch_losses and own_losses[2] < own_losses[0]
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))


def leaf():
    return nn.Parameter(torch.ones(2))


WEIGHT = leaf()
USER_ERRORS = {  # what torch.optim.SGD refuses, and the error type it raises
    "a tensor as params": (lambda sgd: sgd(WEIGHT), TypeError),
    "no parameters": (lambda sgd: sgd([]), ValueError),
    "a set": (lambda sgd: sgd([{"params": {WEIGHT}}]), TypeError),
    "not a tensor": (lambda sgd: sgd([WEIGHT, 1.0]), TypeError),
    "not a leaf": (lambda sgd: sgd([WEIGHT * 2]), ValueError),
    "negative lr": (lambda sgd: sgd([WEIGHT], lr=-0.1), ValueError),
    "negative momentum": (lambda sgd: sgd([WEIGHT], momentum=-0.9), ValueError),
    "negative weight decay": (lambda sgd: sgd([WEIGHT], weight_decay=-1e-4), ValueError),
    "nesterov without momentum": (lambda sgd: sgd([WEIGHT], momentum=0.0, nesterov=True), ValueError),
    "nesterov with dampening": (lambda sgd: sgd([WEIGHT], momentum=0.9, dampening=0.1, nesterov=True), ValueError),
    "a 2-element lr": (lambda sgd: sgd([WEIGHT], lr=torch.tensor([0.1, 0.2])), ValueError),
    "in two groups": (lambda sgd: sgd([{"params": [WEIGHT]}, {"params": [WEIGHT]}]), ValueError),
    "names missing": (lambda sgd: sgd([("weight", WEIGHT), leaf()]), ValueError),
    "named and unnamed groups": (lambda sgd: sgd([{"params": [("weight", WEIGHT)]}, {"params": [leaf()]}]),
                                 ValueError),
    "a group that is no dict": (lambda sgd: sgd([WEIGHT]).add_param_group([leaf()]), TypeError),
    "a group without params": (lambda sgd: sgd([WEIGHT]).add_param_group({"lr": 0.1}), KeyError),
}


@pytest.mark.parametrize("case", USER_ERRORS)
def test_refuses_what_torch_sgd_refuses_with_its_error_type(case):
    build, error = USER_ERRORS[case]
    with pytest.raises(error):
        build(torch.optim.SGD)  # the reference: torch refuses it this way
    with pytest.raises(error):
        build(SGD)


def test_a_parameter_twice_in_one_group_is_refused():
    """torch.optim.SGD warns ("in future, this will cause an error") and would update it twice; this SGD refuses."""
    with pytest.raises(ValueError, match="twice in one parameter group"):
        SGD([WEIGHT, WEIGHT], lr=0.1)


UNSUPPORTED = [{"dampening": 0.1}, {"maximize": True}, {"differentiable": True}, {"fused": True}]


@pytest.mark.parametrize("setting", UNSUPPORTED, ids=lambda setting: next(iter(setting)))
def test_unsupported_settings_are_refused_when_the_group_is_made(setting):
    """torch.optim.SGD takes them (the test checks); this SGD refuses them in the constructor and in
    add_param_group, and a refused group is not added."""
    torch.optim.SGD([leaf()], lr=0.1, momentum=0.9, **setting)
    key = next(iter(setting))
    with pytest.raises(ValueError, match=f"does not implement {key}="):
        SGD([leaf()], lr=0.1, momentum=0.9, **setting)
    with pytest.raises(ValueError, match=f"does not implement {key}="):
        SGD([{"params": [leaf()], **setting}], lr=0.1, momentum=0.9)
    optimizer = SGD([leaf()], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=f"does not implement {key}="):
        optimizer.add_param_group({"params": [leaf()], **setting})
    assert len(optimizer.param_groups) == 1


@pytest.mark.parametrize("edit", ["dampening", "sparse gradient"])
def test_a_bad_last_group_fails_the_step_before_any_parameter_moves(edit):
    model = tiny_model()
    optimizer = three_groups(model, SGD)
    model(torch.randn(2, 3, 12, 12)).square().mean().backward()
    if edit == "dampening":
        optimizer.param_groups[2]["dampening"] = 0.1  # edited after the group was made
        match = "does not implement dampening=0.1"
    else:
        model[1].weight.grad = model[1].weight.grad.to_sparse()  # group 2's only parameter
        match = "sparse gradients"
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # groups 0 and 1 did not move
    assert not optimizer.state


NEWER_GROUP_KEYS = ("nesterov", "maximize", "foreach", "differentiable", "fused")  # keys torch added after 1.x


@pytest.mark.parametrize("momentum_buffer", ["tensors", "None"])
def test_older_torch_state_dicts_load_as_in_torch_sgd(momentum_buffer):
    """Groups without the keys newer torch adds get torch.optim.SGD's defaults (fused False, not the constructor's
    None); a momentum_buffer of None (torch 1.13-2.0 saved one for parameters stepped without momentum) is no
    buffer. Both then continue identically."""
    start = tiny_model()
    first = three_groups(start, torch.optim.SGD, nesterov=False)
    train(start, first, 2)
    old = copy.deepcopy(first.state_dict())
    for group in old["param_groups"]:
        for key in NEWER_GROUP_KEYS:
            del group[key]
    if momentum_buffer == "None":
        old["state"] = {number: {"momentum_buffer": None} for number in old["state"]}
    models = [tiny_model() for _ in range(2)]
    optimizers = [three_groups(models[0], SGD, nesterov=False), three_groups(models[1], torch.optim.SGD, False)]
    for model, optimizer in zip(models, optimizers):
        model.load_state_dict(start.state_dict())
        optimizer.load_state_dict(copy.deepcopy(old))
    assert optimizers[0].state_dict()["param_groups"] == optimizers[1].state_dict()["param_groups"]
    assert all(group["fused"] is False and group["maximize"] is False for group in optimizers[0].param_groups)
    assert_same_training(models[0], optimizers[0], models[1], optimizers[1])


def test_loading_an_unsupported_group_changes_nothing():
    model = tiny_model()
    optimizer = three_groups(model, SGD)
    train(model, optimizer, 1)
    saved = copy.deepcopy(optimizer.state_dict())
    saved["param_groups"][2]["maximize"] = True
    saved["state"] = {number: {"momentum_buffer": torch.zeros_like(entry["momentum_buffer"])}
                      for number, entry in saved["state"].items()}
    state, groups = optimizer.state, optimizer.param_groups
    with pytest.raises(ValueError, match="does not implement maximize=True"):
        optimizer.load_state_dict(saved)
    assert optimizer.state is state and optimizer.param_groups is groups
    assert all(group["maximize"] is False for group in groups)


def test_environment_switches_build_optimizer_back_to_torch_sgd(monkeypatch):
    monkeypatch.setenv("YOLO_TRAINER_TORCH_SGD", "1")
    assert type(build_optimizer(tiny_model(), "SGD")) is torch.optim.SGD
    monkeypatch.setenv("YOLO_TRAINER_TORCH_SGD", "0")
    assert type(build_optimizer(tiny_model(), "SGD")) is SGD
    monkeypatch.setenv("YOLO_TRAINER_TORCH_SGD", "yes")
    with pytest.raises(ConfigError, match="YOLO_TRAINER_TORCH_SGD='yes' is invalid"):
        build_optimizer(tiny_model(), "SGD")
    monkeypatch.delenv("YOLO_TRAINER_TORCH_SGD")
    ours, theirs = tiny_model(), tiny_model()
    own_optimizer = build_optimizer(ours, "SGD", weight_decay=5e-4)
    monkeypatch.setenv("YOLO_TRAINER_TORCH_SGD", "1")
    torch_optimizer = build_optimizer(theirs, "SGD", weight_decay=5e-4)
    assert type(own_optimizer) is SGD and type(torch_optimizer) is torch.optim.SGD
    assert_same_training(ours, own_optimizer, theirs, torch_optimizer)


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
    assert fresh_python(code) == ["False"]


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
