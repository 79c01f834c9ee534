"""Exponential moving average of model weights (YOLOv5 v7 ModelEMA semantics).

After ``updates`` optimizer steps the decay is ``decay * (1 - exp(-updates / tau))``: it ramps up
from 0, so early averages follow the model closely. Every floating-point state entry (parameters
and buffers such as BatchNorm running statistics) is averaged; integer buffers
(``num_batches_tracked``) keep the value copied at construction.

``update(model, keep=t)`` with a boolean tensor ``t`` is the step the device decides (utils/trainer/step_checks.py):
the update count is then a tensor on the device (``t`` added, never read during training), the decay is computed
there in float64 as on the host, and a step whose ``t`` is false leaves the average as it was
(``ema + 0 * (model - ema)``; the model did not move either). ``updates`` reads the count (a checkpoint).
"""
from __future__ import annotations

import math
from copy import deepcopy

import torch
from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare model inside DataParallel / DistributedDataParallel."""
    parallel = (nn.parallel.DataParallel, nn.parallel.DistributedDataParallel)
    return model.module if isinstance(model, parallel) else model


def copy_attr(a, b, include=(), exclude=()) -> None:
    """Set on ``a`` each public attribute of ``b`` (only those in ``include`` when it is given), but ``exclude``."""
    for key, value in vars(b).items():
        if (include and key not in include) or key.startswith("_") or key in exclude:
            continue
        setattr(a, key, value)


def _holdings(root: nn.Module) -> list[tuple[dict, str, object]]:
    """Every (dict, name, object) that makes up ``root``'s tree: each submodule in its parent's ``_modules``, each
    parameter and buffer in its module's ``_parameters`` or ``_buffers``. The tree holds the same objects while
    ``dict.get(name) is object`` holds for all of them."""
    holdings = []
    for module in root.modules():
        for holder in (module._modules, module._parameters, module._buffers):
            holdings.extend((holder, name, value) for name, value in holder.items())
    return holdings


class ModelEMA:
    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000, updates: int = 0):
        self.ema = deepcopy(unwrap_model(model)).eval()
        for parameter in self.ema.parameters():
            parameter.requires_grad_(False)
        self.base_decay = decay
        self.tau = tau
        self._updates = updates
        self._device_updates: torch.Tensor | None = None  # the count while the device decides (update(keep=...))
        self._pairs: tuple | None = None  # (model, both trees' _holdings, EMA tensors, model tensors)

    @property
    def updates(self) -> int:
        if self._device_updates is not None:  # one read (a checkpoint); the count stays on the device after it
            return int(self._device_updates.item())
        return self._updates

    @updates.setter
    def updates(self, value: int) -> None:
        self._updates, self._device_updates = int(value), None

    def decay(self, updates: int) -> float:
        return self.base_decay * (1 - math.exp(-updates / self.tau))

    @torch.no_grad()
    def update(self, model: nn.Module, keep: torch.Tensor | None = None) -> None:
        """One step: ema = d * ema + (1 - d) * model for floating-point entries; with ``keep`` (a boolean tensor),
        only where it is true, decided on the device (see the module docstring)."""
        ema_tensors, model_tensors = self._tensor_pairs(unwrap_model(model))
        if keep is None:
            self._updates = self.updates + 1
            self._device_updates = None
            torch._foreach_lerp_(ema_tensors, model_tensors, 1.0 - self.decay(self._updates))
            return
        if self._device_updates is None:
            self._device_updates = torch.tensor(self._updates, dtype=torch.float64, device=ema_tensors[0].device)
        keep = keep.to(device=self._device_updates.device, dtype=torch.float64)
        self._device_updates += keep
        d = self.base_decay * (1 - torch.exp(-self._device_updates / self.tau))
        weight = ((1.0 - d) * keep).to(ema_tensors[0].dtype)
        change = torch._foreach_sub(model_tensors, ema_tensors)
        torch._foreach_mul_(change, weight)
        torch._foreach_add_(ema_tensors, change)

    def _tensor_pairs(self, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(EMA tensors, model tensors in the EMA's dtypes) of the floating-point state entries. Looked up in the two
        state_dicts once and kept while both module trees hold the same objects (``_holdings``, checked at each update
        with a dict lookup per submodule, parameter and buffer; walking the two trees for their tensors instead was
        ~1.7 ms of host time per update on a yolov5s, time a GPU waits for). Two state_dicts and a detach per entry
        every step were most of the host's time of an update before that. Parameters are kept as themselves, so a
        ``.to()`` that swaps their data is followed; a buffer, parameter or submodule replaced by a new object makes
        the lookup run again."""
        if self._pairs is None or self._pairs[0] is not model or not all(
                holder.get(name) is value for holder, name, value in self._pairs[1]):
            ema_state, model_state = self.ema.state_dict(keep_vars=True), model.state_dict(keep_vars=True)
            keys = [k for k, v in ema_state.items() if v.dtype.is_floating_point]
            holdings = _holdings(self.ema) + _holdings(model)
            self._pairs = (model, holdings, [ema_state[k] for k in keys], [model_state[k] for k in keys])
        _, _, ema_tensors, model_tensors = self._pairs
        if any(m.dtype != e.dtype for e, m in zip(ema_tensors, model_tensors)):
            model_tensors = [m.to(e.dtype) for e, m in zip(ema_tensors, model_tensors)]
        return ema_tensors, model_tensors

    def update_attr(self, model: nn.Module, include: tuple[str, ...] = (),
                    exclude: tuple[str, ...] = ("process_group", "reducer")) -> None:
        """Copy public plain attributes (e.g. ``names``, ``stride``, ``yaml``) from ``model``;
        only those in ``include`` when it is given."""
        copy_attr(self.ema, unwrap_model(model), include, exclude)

    def state_dict(self) -> dict:
        """EMA weights and update count, for checkpoints and resume."""
        return {"ema": self.ema.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state["ema"])
        self.updates = int(state["updates"])
