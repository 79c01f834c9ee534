"""Optimizer, learning-rate schedule, warmup and gradient accumulation (YOLOv5 v7 semantics).

Parameter groups, in ``optimizer.param_groups`` order (results.csv ``x/lr0, x/lr1, x/lr2``):

- group 0: every bias (no weight decay); the only group warmed up from ``warmup_bias_lr``
- group 1: other weights, e.g. conv weights (weight decay)
- group 2: normalisation-layer weights, e.g. BatchNorm (no weight decay)

Gradients are accumulated to a nominal batch of 64 images (``--nbs``; YOLOv5 has it fixed at 64), and the hyp
weight decay is scaled by ``batch * accumulate / nbs`` so the effective decay per image seen does not depend on
the batch.

Resuming (``restore_optimizer``, ``restore_schedule``, ``restore_scaler``) takes only state from the
checkpoint (momentum buffers, Adam moments and step counts, the fp16 loss scale); every setting (lr,
momentum, betas, weight decay, nesterov, maximize, the learning rate) is rebuilt from the
validated hyp, config and position, so a file cannot override them.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Callable

import numpy as np
import torch
from torch import nn

from utils.cli import OPTIMIZER_NAMES
from utils.config import ConfigError, Hyp
from utils.trainer.sgd import SGD, TORCH_SGD_VARIABLE

LOGGER = logging.getLogger(__name__)

NOMINAL_BATCH = 64
OPTIMIZERS = OPTIMIZER_NAMES  # the --optimizer choices
MIN_WARMUP_ITERATIONS = 100
NORM_LAYERS = tuple(getattr(nn, name) for name in (
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "GroupNorm", "LayerNorm",
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LocalResponseNorm", "RMSNorm") if hasattr(nn, name))


def accumulate_steps(batch_size: int, nominal_batch: int = NOMINAL_BATCH) -> int:
    """Batches whose gradients are summed before each optimizer step."""
    return max(round(nominal_batch / batch_size), 1)


def scaled_weight_decay(weight_decay: float, batch_size: int, accumulate: int,
                        nominal_batch: int = NOMINAL_BATCH) -> float:
    return weight_decay * batch_size * accumulate / nominal_batch


def parameter_groups(model: nn.Module) -> tuple[list, list, list]:
    """(biases, decayed weights, normalisation weights), each parameter listed once.

    Frozen parameters are included like YOLOv5 does; they never get a gradient, so never move.
    """
    biases, weights, norm_weights = [], [], []
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if name == "bias":
                biases.append(parameter)
            elif name == "weight" and isinstance(module, NORM_LAYERS):
                norm_weights.append(parameter)
            else:
                weights.append(parameter)
    return biases, weights, norm_weights


def build_optimizer(model: nn.Module, name: str = "SGD", lr: float = 0.01, momentum: float = 0.937,
                    weight_decay: float = 1e-5) -> torch.optim.Optimizer:
    """SGD (Nesterov; utils.trainer.sgd, torch.optim.SGD's update and state_dict; torch.optim.SGD itself with
    YOLO_TRAINER_TORCH_SGD=1) / Adam / AdamW (torch.optim's, betas = (momentum, 0.999)) over the three groups
    above.

    ``weight_decay`` is applied to group 1 only; pass the already scaled value."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer '{name}' (choose from {', '.join(OPTIMIZERS)})")
    biases, weights, norm_weights = parameter_groups(model)
    if name == "SGD":
        sgd = torch.optim.SGD if torch_sgd_requested() else SGD
        optimizer = sgd(biases, lr=lr, momentum=momentum, nesterov=True, weight_decay=0.0)
    elif name == "Adam":
        optimizer = torch.optim.Adam(biases, lr=lr, betas=(momentum, 0.999), weight_decay=0.0)
    else:
        optimizer = torch.optim.AdamW(biases, lr=lr, betas=(momentum, 0.999), weight_decay=0.0)
    optimizer.add_param_group({"params": weights, "weight_decay": weight_decay})
    optimizer.add_param_group({"params": norm_weights, "weight_decay": 0.0})
    LOGGER.info("optimizer: %s(lr=%g) with parameter groups %d bias, %d weight(decay=%g), %d norm weight",
                "torch.optim.SGD" if isinstance(optimizer, torch.optim.SGD) else name, lr, len(biases), len(weights),
                weight_decay, len(norm_weights))
    return optimizer


def torch_sgd_requested() -> bool:
    """The switch back to torch.optim.SGD: YOLO_TRAINER_TORCH_SGD=1 (unset, empty or 0: utils.trainer.sgd's)."""
    value = os.environ.get(TORCH_SGD_VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        raise ConfigError(f"environment variable {TORCH_SGD_VARIABLE}={value[:40]!r} is invalid: use 1 "
                          "(torch.optim.SGD) or 0 (utils.trainer.sgd's)")
    return value == "1"


def lr_lambda(epochs: int, lrf: float, cos: bool = False) -> Callable[[float], float]:
    """Per-epoch lr multiplier: 1 at epoch 0, ``lrf`` at ``epochs``.

    Linear by default, one-cycle cosine with ``cos``."""
    if cos:
        def factor(epoch: float) -> float:
            return ((1 - math.cos(epoch * math.pi / epochs)) / 2) * (lrf - 1) + 1
    else:
        def factor(epoch: float) -> float:
            return (1 - epoch / epochs) * (1.0 - lrf) + lrf
    return factor


class EpochSchedule:
    """The learning rate as a function of the epoch: every group's lr is ``initial_lr * factor(epoch)``.

    ``initial_lr`` is each group's lr when the schedule is made (the hyp's lr0), kept in the group as
    torch's schedulers keep it (warmup ramps towards ``initial_lr * factor(epoch)``). The schedule holds no
    other state: ``set_epoch`` puts the rates where any epoch's start has them (resume), ``retarget`` swaps
    the factor (--time: a new epoch count) from where the run stands. ``state_dict`` is the epoch, for the
    checkpoint's record; resuming never reads it (the position comes from the run state)."""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Callable[[float], float]):
        self.optimizer, self.factor, self.epoch = optimizer, factor, 0
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * self.factor(self.epoch)

    def step(self) -> None:
        """The end of an epoch: the next epoch's rates."""
        self.set_epoch(self.epoch + 1)

    def retarget(self, factor: Callable[[float], float]) -> None:
        """Follow ``factor`` from the current epoch on, as if the schedule had used it from the start."""
        self.factor = factor
        self.set_epoch(self.epoch)

    def rates(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}


def warmup_iterations(warmup_epochs: float, batches_per_epoch: int) -> int:
    """Warmup length in optimizer iterations (batches).

    As in YOLOv5 at least 100 iterations, even when ``warmup_epochs`` is 0."""
    return max(round(warmup_epochs * batches_per_epoch), MIN_WARMUP_ITERATIONS)


def apply_warmup(optimizer: torch.optim.Optimizer, global_step: int, warmup_iters: int, epoch: int,
                 lf: Callable[[float], float], hyp: Hyp, batch_size: int,
                 nominal_batch: int = NOMINAL_BATCH) -> int:
    """Set warmup lr and momentum for ``global_step`` (batches since the start of training) and
    return the accumulation count to use now.

    While ``global_step <= warmup_iters`` each quantity is interpolated linearly over
    [0, warmup_iters]: lr from ``warmup_bias_lr`` (group 0, biases) or 0 (other groups) to
    ``initial_lr * lf(epoch)`` (``initial_lr`` is set by ``EpochSchedule``, create it first);
    momentum from ``warmup_momentum`` to ``hyp.momentum`` in groups that have a ``momentum`` key
    (SGD; Adam/AdamW betas are left alone, as in YOLOv5); accumulation from 1 to
    ``nominal_batch / batch_size``, rounded half to even as numpy does, at least 1.
    After warmup nothing is changed and the full accumulation count is returned.
    """
    if global_step > warmup_iters:
        return accumulate_steps(batch_size, nominal_batch)
    span = [0, warmup_iters]
    accumulate = max(1, round(float(np.interp(global_step, span, [1, nominal_batch / batch_size]))))
    for index, group in enumerate(optimizer.param_groups):
        start_lr = hyp.warmup_bias_lr if index == 0 else 0.0
        group["lr"] = float(np.interp(global_step, span, [start_lr, group["initial_lr"] * lf(epoch)]))
        if "momentum" in group:
            group["momentum"] = float(np.interp(global_step, span, [hyp.warmup_momentum, hyp.momentum]))
    return accumulate


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load the per-parameter state of a checkpoint's optimizer (checked against this optimizer beforehand by
    utils.checkpoint.checks); the groups keep the settings ``build_optimizer`` gave them."""
    own_groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": saved["state"], "param_groups": own_groups})


def restore_schedule(schedule: EpochSchedule, epoch: int) -> None:
    """Put the learning rates where ``epoch`` finished epochs leave them: ``initial_lr * factor(epoch)``, the
    value an uninterrupted run has from that epoch's start (or from the end of warmup, which sets its own
    values before each of its steps); ``initial_lr`` is the hyp's lr0, never a value from the file."""
    schedule.set_epoch(epoch)


def restore_scaler(scaler, saved: dict) -> None:
    """An fp16 run's loss scale and growth tracker; the growth and backoff settings stay this scaler's."""
    if scaler.is_enabled() and saved:
        scaler.load_state_dict({**scaler.state_dict(), "scale": float(saved["scale"]),
                                "_growth_tracker": int(saved["_growth_tracker"])})
