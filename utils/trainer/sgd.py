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
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch

GROUP_DEFAULTS = {"dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False, "foreach": None,
                  "differentiable": False, "fused": None}  # torch.optim.SGD's group keys, for identical state_dicts


class SGD:
    """``torch.optim.SGD(params, lr, momentum, weight_decay=..., nesterov=...)`` for dense gradients, dampening 0.

    Keeps torch's optimizer interface where this project and torch's GradScaler use it: ``param_groups``
    (dicts, settings editable between steps), ``state`` (parameter -> {"momentum_buffer": tensor}),
    ``add_param_group``, ``zero_grad``, ``step``, ``state_dict``, ``load_state_dict``."""

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False):
        if lr < 0.0 or momentum < 0.0 or weight_decay < 0.0:
            raise ValueError(f"invalid SGD settings lr={lr}, momentum={momentum}, weight_decay={weight_decay}")
        if nesterov and momentum <= 0.0:
            raise ValueError("Nesterov momentum requires a momentum")
        self.defaults = {"lr": lr, "momentum": momentum, **GROUP_DEFAULTS, "weight_decay": weight_decay,
                         "nesterov": nesterov}
        self.param_groups: list[dict] = []
        self.state: defaultdict = defaultdict(dict)
        self.add_param_group({"params": params})

    def __repr__(self) -> str:
        return f"SGD({len(self.param_groups)} groups, lr={[group['lr'] for group in self.param_groups]})"

    def add_param_group(self, group: dict) -> None:
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        seen = {id(p) for existing in self.param_groups for p in existing["params"]}
        for p in params:
            if not isinstance(p, torch.Tensor) or not p.is_leaf:
                raise TypeError("SGD optimizes leaf tensors only")
            if id(p) in seen:
                raise ValueError("a parameter appears in more than one parameter group")
            seen.add(id(p))
        self.param_groups.append({**self.defaults, **{k: v for k, v in group.items() if k != "params"},
                                  "params": params})

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
    def step(self) -> None:
        for group in self.param_groups:
            if group["dampening"] != 0 or group["maximize"] or group["differentiable"] or group["fused"]:
                raise ValueError("this SGD supports dampening 0, minimisation, not differentiable, not fused")
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(params, group["lr"], group["momentum"], group["weight_decay"], group["nesterov"])

    def _update(self, params: list, lr: float, momentum: float, weight_decay: float, nesterov: bool) -> None:
        grads = [p.grad for p in params]
        if any(g.is_sparse for g in grads):
            raise ValueError("this SGD does not take sparse gradients")
        if weight_decay != 0:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
        if momentum != 0:
            states = [self.state[p] for p in params]
            moving = [(state["momentum_buffer"], grad) for state, grad in zip(states, grads)
                      if "momentum_buffer" in state]
            if moving:  # buf = momentum * buf + g
                torch._foreach_mul_([buffer for buffer, _ in moving], momentum)
                torch._foreach_add_([buffer for buffer, _ in moving], [grad for _, grad in moving])
            for state, grad in zip(states, grads):  # a parameter's first step: buf = g
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = grad.detach().clone()
            buffers = [state["momentum_buffer"] for state in states]
            if nesterov:
                torch._foreach_add_(grads, buffers, alpha=momentum)
            else:
                grads = buffers
        torch._foreach_add_(params, grads, alpha=-lr)

    def state_dict(self) -> dict:
        """torch.optim's layout: parameters numbered in group order; state under those numbers (tensors shared)."""
        index = {}
        groups = []
        for group in self.param_groups:
            numbers = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                numbers.append(index[id(p)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
        state = {index[id(p)]: dict(entry) for p, entry in self.state.items() if id(p) in index}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Groups' settings and per-parameter state, as torch.optim loads them: momentum buffers moved to each
        parameter's device and dtype, and copied (never shared with ``state_dict``'s tensors). Groups and parameter
        counts must match (checked before, for files, by utils.checkpoint.checks)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(own["params"]) for saved, own in zip(groups, self.param_groups)):
            raise ValueError("the saved optimizer's parameter groups do not match this optimizer's")
        numbered = {}
        for saved, own in zip(groups, self.param_groups):
            numbered.update(zip(saved["params"], own["params"]))
        state = defaultdict(dict)
        for number, entry in state_dict["state"].items():
            p = numbered[number]
            state[p] = {key: value.to(device=p.device, dtype=p.dtype, copy=True) if torch.is_tensor(value) else value
                        for key, value in entry.items()}
        self.state = state
        self.param_groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": own["params"]}
                             for saved, own in zip(groups, self.param_groups)]
