"""SGD with (Nesterov) momentum, the training default, outside ``torch.optim``.

Same update, same results to the bit, and the same ``state_dict`` as ``torch.optim.SGD`` (checkpoints load in
either; YOLOv5's load here), without what torch.optim costs every process start: its first ``step``, and
``add_param_group`` / ``zero_grad`` / ``state_dict``, import ``torch._dynamo`` (1.1-1.4 s on a 2-core Xeon,
torch 2.14), which the CPU and eager CUDA paths never use otherwise.

Update per parameter ``p`` with gradient ``g`` (torch.optim.SGD's, dampening 0)::

    g = g + weight_decay * p                # when weight_decay != 0
    buf = g (first step) | momentum * buf + g
    g = g + momentum * buf (nesterov) | buf
    p = p - lr * g

done group by group with ``torch._foreach_*`` (one call per operation for all parameters of a group; on the
CPU the same per-tensor kernels torch.optim.SGD's loop calls). As in torch's foreach path, without weight
decay the Nesterov term is added to ``p.grad`` in place: gradients are consumed by ``step``.

It takes torch.optim.SGD's arguments and parameter forms (tensors, ``(name, tensor)`` pairs, a list of group
dicts) and raises its errors for them. What it does not implement (``dampening`` other than 0, ``maximize``,
``differentiable``, ``fused``) is refused with a ValueError when a group is made (the constructor,
``add_param_group``, ``load_state_dict``); ``step`` checks every group (settings edited since, sparse gradients)
before any parameter moves. State dicts of older torch versions load: groups lacking the keys torch added since get
torch.optim.SGD's defaults for them (``nesterov``, ``maximize``, ``differentiable``, ``fused`` False,
``foreach`` None), a ``momentum_buffer`` of None counts as none.

A step the device decides to skip (``step(skip=t)``, ``t`` a boolean tensor; GradScaler's ``found_inf`` when it
drives the step): the update runs as one fused kernel per group (``torch._fused_sgd_``) that reads ``t`` itself, so
nothing waits for the device to say whether the gradients were finite (the training step's deferred checks,
utils/trainer/step_checks.py). Momentum buffers are then made as zeros before the first step (``momentum * 0 + g``
is ``g``), so a skipped first step leaves no uninitialised buffer. Same update; the fused kernel may round
differently from the foreach one (fused multiply-adds on CUDA).

The switch back: with ``YOLO_TRAINER_TORCH_SGD=1`` in the environment, ``utils.trainer.optim.build_optimizer``
builds ``torch.optim.SGD`` instead (same settings and checkpoints; the torch._dynamo import is paid again).
"""
from __future__ import annotations

import copy
from collections import defaultdict
from typing import Callable, Iterable

import torch

TORCH_SGD_VARIABLE = "YOLO_TRAINER_TORCH_SGD"  # "1": build_optimizer makes torch.optim.SGD
GROUP_DEFAULTS = {"dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False, "foreach": None,
                  "differentiable": False, "fused": None}  # torch.optim.SGD's group keys, for identical state_dicts
LOADED_GROUP_DEFAULTS = {"nesterov": False, "maximize": False, "foreach": None, "differentiable": False,
                         "fused": False}  # what torch.optim.SGD gives a loaded group that lacks these keys


def check_group(group: dict) -> None:
    """Refuse the settings this SGD does not implement (torch.optim.SGD's other features)."""
    refused = [f"{key}={group[key]!r}" for key in ("maximize", "differentiable", "fused") if group.get(key)]
    if group.get("dampening", 0) != 0:
        refused.insert(0, f"dampening={group['dampening']!r}")
    if refused:
        raise ValueError(f"this SGD does not implement {', '.join(refused)} (torch.optim.SGD does: set "
                         f"{TORCH_SGD_VARIABLE}=1 for build_optimizer); it supports dampening 0, minimisation, "
                         "not differentiable, not fused")


class SGD:
    """``torch.optim.SGD(params, lr, momentum, dampening=0, weight_decay, nesterov, foreach=...)`` for dense
    gradients.

    Keeps torch's optimizer interface where this project and torch's GradScaler use it: ``param_groups``
    (dicts, settings editable between steps), ``state`` (parameter -> {"momentum_buffer": tensor}),
    ``defaults``, ``add_param_group``, ``zero_grad``, ``step(closure=None)``, ``state_dict``,
    ``load_state_dict``. ``foreach`` is kept in the groups for the state_dict; the update is always the
    foreach one (torch's results either way)."""

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float | torch.Tensor = 0.0, nesterov: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, differentiable: bool = False,
                 fused: bool | None = None):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self.defaults = {"lr": lr, "momentum": momentum, **GROUP_DEFAULTS, "dampening": dampening,
                         "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize,
                         "foreach": foreach, "differentiable": differentiable, "fused": fused}
        check_group(self.defaults)
        if isinstance(params, torch.Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                            f"but got {torch.typename(params)}")
        self.param_groups: list[dict] = []
        self.state: defaultdict = defaultdict(dict)
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        for group in groups if isinstance(groups[0], dict) else [{"params": groups}]:
            self.add_param_group(group)

    def __repr__(self) -> str:
        return f"SGD({len(self.param_groups)} groups, lr={[group['lr'] for group in self.param_groups]})"

    def add_param_group(self, param_group: dict) -> None:
        """As torch.optim's: ``param_group`` itself becomes the group, its missing settings filled from
        ``defaults``; checked entirely before anything changes."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering "
                            "of tensors in sets will change between runs. Please use a list instead.")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        names = [p[0] for p in params if isinstance(p, tuple)]
        params = [p[1] if isinstance(p, tuple) else p for p in params]
        if names and len(names) != len(params):
            raise ValueError("all optimizer params should be with/without names. Some param names are missing")
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {torch.typename(p)}")
            if not (p.is_leaf or p.retains_grad):
                raise ValueError("can't optimize a non-leaf Tensor")
        group = {**self.defaults, **param_group}
        check_group(group)
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice in one parameter group")
        seen = {id(p) for existing in self.param_groups for p in existing["params"]}
        if any(id(p) in seen for p in params):
            raise ValueError("some parameters appear in more than one parameter group")
        if any(bool(names) != ("param_names" in existing) for existing in self.param_groups):
            raise ValueError("all optimizer param groups should be with/without names. cannot add param group "
                             f"{'with' if names else 'without'} names to the optimizer")
        param_group["params"] = params
        if names:
            param_group["param_names"] = names
        for key, value in self.defaults.items():
            param_group.setdefault(key, value)
        self.param_groups.append(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self, closure: Callable | None = None, *, skip: torch.Tensor | None = None):
        """One update of every group (``closure``, if given, is called first with gradients enabled and its
        loss returned). Every group is checked before any parameter moves. ``skip``: a boolean tensor on the
        parameters' device; when true the step changes nothing (decided on the device, never read here). A
        GradScaler that drives this optimizer (``_step_supports_amp_scaling``, set by the training step) adds its
        ``found_inf``."""
        skip = self._skip_tensor(skip)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        updates = []
        for group in self.param_groups:
            check_group(group)
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise ValueError(f"this SGD does not take sparse gradients (torch.optim.SGD does: set "
                                 f"{TORCH_SGD_VARIABLE}=1 for build_optimizer)")
            updates.append((group, params))
        for group, params in updates:
            if params and skip is not None:
                self._fused_update(params, group, skip)
            elif params:
                self._update(params, group["lr"], group["momentum"], group["weight_decay"], group["nesterov"])
        return loss

    def _skip_tensor(self, skip: torch.Tensor | None) -> torch.Tensor | None:
        """``skip`` and a driving GradScaler's ``found_inf`` (and its ``grad_scale``, which must be unset: the
        training step unscales first) as one float tensor, or None."""
        if getattr(self, "grad_scale", None) is not None:
            raise ValueError("this SGD takes unscaled gradients: call GradScaler.unscale_ before GradScaler.step")
        found = getattr(self, "found_inf", None)
        if skip is None:
            return None if found is None else found.bool().to(torch.float32)
        if found is not None:
            skip = skip | found.to(skip.device).bool()
        return skip.to(torch.float32)  # the kernel skips on exactly 1.0

    def _fused_update(self, params: list, group: dict, skip: torch.Tensor) -> None:
        """The same update as ``_update`` in one kernel that does nothing when ``skip`` is non-zero."""
        momentum = group["momentum"]
        buffers = []
        if momentum != 0:
            for p in params:
                state = self.state[p]
                if state.get("momentum_buffer") is None:  # momentum * 0 + g == g: a first step as _update's
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buffers.append(state["momentum_buffer"])
        lr = group["lr"]
        lr = lr.squeeze() if isinstance(lr, torch.Tensor) else float(lr)
        torch._fused_sgd_(params, [p.grad for p in params], buffers, weight_decay=float(group["weight_decay"]),
                          momentum=float(momentum), lr=lr, dampening=0.0, nesterov=bool(group["nesterov"]),
                          maximize=False, is_first_step=False, found_inf=skip.to(params[0].device))

    def _update(self, params: list, lr: float | torch.Tensor, momentum: float, weight_decay: float,
                nesterov: bool) -> None:
        grads = [p.grad for p in params]
        if weight_decay != 0:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
        if momentum != 0:
            states = [self.state[p] for p in params]
            moving = [(state["momentum_buffer"], grad) for state, grad in zip(states, grads)
                      if state.get("momentum_buffer") is not None]
            if moving:  # buf = momentum * buf + g
                torch._foreach_mul_([buffer for buffer, _ in moving], momentum)
                torch._foreach_add_([buffer for buffer, _ in moving], [grad for _, grad in moving])
            for state, grad in zip(states, grads):  # a parameter's first step: buf = g
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = grad.detach().clone()
            buffers = [state["momentum_buffer"] for state in states]
            if nesterov:
                torch._foreach_add_(grads, buffers, alpha=momentum)
            else:
                grads = buffers
        if isinstance(lr, torch.Tensor):
            lr = lr.squeeze()  # a 1-element tensor, as torch's foreach path takes it
        torch._foreach_add_(params, grads, alpha=-lr)

    def state_dict(self) -> dict:
        """torch.optim's layout: parameters numbered in group order; state under those numbers (tensors shared),
        state under other keys (an older file's leftovers) as it is."""
        index = {}
        groups = []
        for group in self.param_groups:
            numbers = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                numbers.append(index[id(p)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
        state = {index[id(key)] if isinstance(key, torch.Tensor) else key: dict(entry)
                 for key, entry in self.state.items() if not isinstance(key, torch.Tensor) or id(key) in index}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Groups' settings and per-parameter state, as torch.optim.SGD loads them: missing group keys of older
        torch versions filled with its defaults (LOADED_GROUP_DEFAULTS), momentum buffers moved to each
        parameter's device (and dtype, for floating-point parameters), and copied (never shared with
        ``state_dict``'s tensors), state under numbers that are no parameter's kept as it is. Groups and
        parameter counts must match (checked before, for files, by utils.checkpoint.checks); everything is
        checked before anything changes."""
        groups = copy.deepcopy(state_dict["param_groups"])
        if len(groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(own["params"]) for saved, own in zip(groups, self.param_groups)):
            raise ValueError("the saved optimizer's parameter groups do not match this optimizer's")
        for saved in groups:
            for key, value in LOADED_GROUP_DEFAULTS.items():
                saved.setdefault(key, value)
            check_group(saved)
        numbered = {}
        for saved, own in zip(groups, self.param_groups):
            numbered.update(zip(saved["params"], own["params"]))
        state = defaultdict(dict)
        for number, entry in state_dict["state"].items():
            if number not in numbered:
                state[number] = entry
                continue
            p = numbered[number]
            state[p] = {key: self._loaded(p, value) for key, value in entry.items()}
        for saved, own in zip(groups, self.param_groups):
            saved["params"] = own["params"]
            if "param_names" in own and "param_names" not in saved:
                saved["param_names"] = own["param_names"]
        self.state = state
        self.param_groups = groups

    @staticmethod
    def _loaded(p: torch.Tensor, value):
        if not torch.is_tensor(value):
            return value
        dtype = p.dtype if p.is_floating_point() else value.dtype
        return value.to(device=p.device, dtype=dtype, copy=True)
