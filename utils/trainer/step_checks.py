"""A training step's checks for non-finite values, decided on the device and read by the host late.

On a GPU every read of a tensor's value waits for every kernel queued before it, and a step that reads twice (is the
loss finite? are the gradients?) leaves the device idle while the host catches up. ``StepChecks`` keeps those
decisions on the device (utils/trainer/loop.py's TrainStep uses it on CUDA; the CPU, where a read costs nothing,
decides at once):

- a non-finite loss is backpropagated like any other; its iteration's losses are left out of the epoch's sums with
  ``torch.where``, and it marks the accumulation window, whose optimizer step is then skipped on the device:
  ``SGD.step(skip=...)`` (one fused kernel that reads the flag itself) and ``ModelEMA.update(keep=...)``;
- an optimizer step whose gradient norm is not finite is skipped the same way (and by GradScaler's ``found_inf`` under
  fp16, passed to the same kernel);
- under DDP each iteration's flag is the maximum over the processes (an all-reduce queued on the device), so every
  process skips alike and counts alike;
- the flags wait on the device until ``read`` takes them all in one read: every REPORT_EVERY batches, at the end of an
  epoch and before every checkpoint. TrainStep.settle replays them in order: the warning lines, the counters and the
  errors after MAX_NONFINITE_IN_ROW in a row are those of the immediate checks, up to REPORT_EVERY - 1 iterations
  late (the same iteration numbers).

Where the immediate checks differ (only when something is not finite): a non-finite loss there throws away its
window's earlier gradients and the window still steps with the later ones; here the whole window's step is skipped.
A skipped window there still updates the EMA when its only micro-step had the non-finite loss (a step with no
gradients); here the EMA is left as it was. Under fp16 a non-finite loss here also lowers GradScaler's scale (its
gradients are not finite).
"""
from __future__ import annotations

import os

import torch

from utils import dist
from utils.errors import UserError
from utils.trainer.sgd import SGD

CHECKS_VARIABLE = "YOLO_TRAINER_STEP_CHECKS"  # "immediate" or "deferred" instead of the device's default (to compare)
CHECK_MODES = ("immediate", "deferred")


class StepChecks:
    """The pending flags of the iterations since the last ``read`` (see the module docstring)."""

    @classmethod
    def chosen(cls, device: torch.device, optimizer) -> "StepChecks | None":
        """Checks for a step on ``device`` with ``optimizer``: deferred on CUDA, immediate (None) on the CPU, unless
        YOLO_TRAINER_STEP_CHECKS says otherwise; immediate with any optimizer but the project's SGD (whose step reads
        the skip flag itself)."""
        mode = os.environ.get(CHECKS_VARIABLE, "")
        if mode and mode not in CHECK_MODES:
            raise UserError(f"{CHECKS_VARIABLE}={mode!r}: must be one of {', '.join(CHECK_MODES)} (or unset)")
        deferred = mode == "deferred" or (not mode and device.type == "cuda")
        return cls() if deferred and isinstance(optimizer, SGD) else None

    def __init__(self):
        self.pending: list[list] = []                 # [iteration, loss flag, step flag or None (no step)]
        self.window_bad: torch.Tensor | None = None   # a non-finite loss since the last optimizer step (bool)

    def loss(self, iteration: int, loss: torch.Tensor) -> torch.Tensor:
        """Record iteration ``iteration``'s loss; returns whether it is finite (a bool tensor, on every process the
        same under DDP)."""
        bad = (~torch.isfinite(loss)).any().to(torch.uint8)
        bad = dist.all_reduce_in_place(bad, "max").bool()
        self.window_bad = bad if self.window_bad is None else self.window_bad | bad
        self.pending.append([iteration, bad, None])
        return ~bad

    def step(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """Record the optimizer step that ends the current window (``grad_norm``: the clipped gradients' norm, the
        same on every process); returns whether to skip it (a bool tensor)."""
        grad_bad = ~torch.isfinite(grad_norm)
        window_bad = self.window_bad if self.window_bad is not None else torch.zeros_like(grad_bad)
        self.window_bad = None
        if self.pending:  # counted as a skipped step only when its losses were finite, as the immediate checks count
            self.pending[-1][2] = grad_bad & ~window_bad
        return grad_bad | window_bad

    def read(self) -> list[tuple[int, bool, bool | None]]:
        """(iteration, non-finite loss, skipped for its gradients or None when no step ended there) for every
        iteration since the last read, in one read of the device."""
        if not self.pending:
            return []
        flags = [flag for _, loss_bad, step_bad in self.pending
                 for flag in (loss_bad, step_bad if step_bad is not None else loss_bad)]
        values = torch.stack(flags).tolist()
        read = [(iteration, values[2 * i], values[2 * i + 1] if step_bad is not None else None)
                for i, (iteration, _, step_bad) in enumerate(self.pending)]
        self.pending.clear()
        return read
