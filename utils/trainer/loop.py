"""One epoch of training and one optimisation step.

``train_one_epoch`` walks the loader from the run's position (``RunState.batch``: a resumed epoch
starts where it stopped); ``TrainStep`` does forward, loss, backward, and every ``accumulate``
iterations an optimizer step (unscale, clip at 10, step, EMA update). Warmup sets lr, momentum and the
accumulation count per iteration. After each optimizer step the trainer's ``at_step_boundary()`` may
save a mid-epoch checkpoint and end the epoch early (a signal).

Two ways to decide on non-finite values: at once (``TrainStep.checks`` None: the CPU, where reading a value costs
nothing; the results every test and benchmark compares), or on the device, read every REPORT_EVERY batches
(``checks``: utils/trainer/step_checks.py; CUDA with the project's SGD, where each read would stall the GPU).
``StepChecks.chosen`` picks; YOLO_TRAINER_STEP_CHECKS=immediate|deferred overrides it (to compare the two).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from utils import dist
from utils.loggers import memory_string
from utils.errors import TrainingDiverged
from utils.trainer.feed import BatchFeed, copies_run_ahead
from utils.trainer.optim import apply_warmup
from utils.trainer.state import RunState, StepCounters
from utils.trainer.step_checks import StepChecks

LOGGER = logging.getLogger(__name__)

MAX_NONFINITE_IN_ROW = 20  # iterations with a NaN/inf loss, or optimizer steps with NaN/inf gradients, in a row
# The epoch's loss sums stay on the training device; the progress bar reads them every REPORT_EVERY batches and at
# the epoch's last batch (a read waits for the device: on a GPU, once per REPORT_EVERY steps instead of every
# step). The figures shown at a read are the ones an every-batch read shows; between reads the bar keeps them.
REPORT_EVERY = 10


class NonFiniteLossError(TrainingDiverged):
    """Raised when the loss is NaN/inf for too many consecutive iterations."""


class NonFiniteGradientError(TrainingDiverged):
    """Raised when the gradients are NaN/inf at too many consecutive optimizer steps (a finite loss whose
    backward overflows: fp32/bf16 without a GradScaler, or a GradScaler whose scale can fall no further)."""


@dataclass
class EpochStats:
    mean_losses: torch.Tensor          # box, obj, cls over the whole epoch (a resumed one included)
    iterations: int = 0                # batches trained by this call
    images: int = 0
    data_time: float = 0.0             # waiting for the loader
    compute_time: float = 0.0          # forward + loss + backward
    optimizer_time: float = 0.0        # unscale, clip, step, EMA
    skipped_steps: int = 0
    validation_time: float = 0.0       # set by the trainer after validating
    stopped: bool = False              # ended early by at_step_boundary() (a signal)


@dataclass
class TrainStep:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    compute_loss: object
    precision: object                  # utils.trainer.amp.Precision
    ema: object | None
    channels_last: bool = False
    counters: StepCounters = field(default_factory=StepCounters)
    # phase(name) at the end of each phase of a step ("forward", "loss", "backward", "clip", "optimizer", "ema";
    # train_one_epoch adds "data", "copy", "logging"): benchmarks/profile_train_step.py records a CUDA event or the
    # time there. None in training.
    phase: object = None
    loss_scale: float = 1.0  # the loss is multiplied by this before backward (4 with --quad, as YOLOv5)
    checks: StepChecks | None = None  # decide on non-finite values on the device (module docstring); None: at once
    # the model's training forward for batches of one shape, autocast included: --cuda-graphs' GraphedModel
    # (utils/trainer/cuda_graphs.py) or --compile's CompiledModel (utils/trainer/compiled.py); None: the model itself
    runner: object = None

    def __post_init__(self):
        if self.checks is not None:  # a GradScaler passes its found_inf to SGD.step instead of reading it
            self.optimizer._step_supports_amp_scaling = True

    def mark(self, name: str) -> None:
        if self.phase is not None:
            self.phase(name)

    def forward_backward(self, images: torch.Tensor, targets: torch.Tensor, sync: bool = True
                         ) -> tuple[torch.Tensor, bool | torch.Tensor]:
        """Forward, loss and backward; returns (loss items, finite: a bool, or a bool tensor with ``checks``).
        Under DDP, ``sync=False`` (a micro-step
        that is not followed by an optimizer step) keeps the gradients local (``no_sync``): they are averaged
        once, at the step that uses them."""
        # loader batches are already channels_last (then this is free); 'off' gets plain NCHW
        images = images.contiguous(memory_format=torch.channels_last if self.channels_last else torch.contiguous_format)
        local = self.model.no_sync() if not sync and hasattr(self.model, "no_sync") else contextlib.nullcontext()
        with local:
            result = self._forward_backward(images, targets)
        if self.runner is not None and not sync:  # the next micro-step's replay must not overwrite these gradients
            self.runner.own_gradients()
        return result

    def _forward_backward(self, images: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, bool]:
        graphed = self.runner.loss_of(images, targets) if self.runner is not None else None
        if graphed is not None:  # --cuda-graphs with the loss in the graphs: the "forward" phase holds the loss
            loss, items = graphed
            self.mark("forward")
        else:
            if self.runner is not None:
                predictions = self.runner(images)
            else:
                with self.precision.autocast():
                    predictions = self.model(images)
            self.mark("forward")
            loss, items = self.compute_loss([p.float() for p in predictions], targets)  # scaled for DDP averaging
        self.mark("loss")
        if self.checks is not None:
            finite = self.checks.loss(self.counters.global_step, loss)
            self._backward(loss)
            return items, finite
        finite = bool(torch.isfinite(loss).all())
        if dist.get_world_size() > 1:  # every process skips the step together, or none does
            finite = not dist.all_reduce_max([int(not finite)], "agree whether the loss is finite")[0]
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self._count_nonfinite_loss(self.counters.global_step)
            return items, False
        self.counters.nonfinite_in_row = 0
        self._backward(loss)
        return items, True

    def _backward(self, loss: torch.Tensor) -> None:
        if self.loss_scale != 1.0:
            loss = loss * self.loss_scale
        self.precision.scaler.scale(loss).backward()
        self.mark("backward")

    def optimizer_step(self, before_zero_grad=None) -> None:
        """Unscale, clip, step, EMA (``before_zero_grad()``, if given, runs between the step and clearing the
        gradients). A gradient that is not finite (a finite loss whose backward overflowed) is
        skipped: by the GradScaler under fp16 (which also lowers its scale), here without one (fp32, bf16), where
        clipping would otherwise turn it into NaN weights. Under DDP the gradients are already averaged, so every
        process skips alike. Skipped steps are counted (``counters.skipped_steps_*``); after
        ``MAX_NONFINITE_IN_ROW`` in a row the run stops with NonFiniteGradientError."""
        scaler = self.precision.scaler
        scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=10.0)
        if self.checks is not None:
            self._deferred_step(norm, before_zero_grad)
            return
        finite = bool(torch.isfinite(norm))
        self.mark("clip")
        scales = None
        if scaler.is_enabled():
            before = scaler.get_scale()
            scaler.step(self.optimizer)  # skips the step itself when the gradients are not finite
            scaler.update()
            scales = (before, scaler.get_scale())
        elif finite:
            self.optimizer.step()
        if before_zero_grad is not None:
            before_zero_grad()
        self.optimizer.zero_grad(set_to_none=True)
        self.mark("optimizer")
        if self.ema is not None and finite:
            self.ema.update(self.model)
            self.mark("ema")
        self.counters.last_optimizer_step = self.counters.global_step
        self._count_step(finite, scales)

    def _deferred_step(self, norm: torch.Tensor, before_zero_grad=None) -> None:
        """optimizer_step's step, EMA and counting with ``checks``: skipped or not on the device, counted at
        ``settle``."""
        self.mark("clip")
        skip = self.checks.step(norm)
        scaler = self.precision.scaler
        if scaler.is_enabled():
            scaler.step(self.optimizer, skip=skip)  # SGD.step adds the scaler's found_inf (no read)
            scaler.update()
        else:
            self.optimizer.step(skip=skip)
        if before_zero_grad is not None:
            before_zero_grad()
        self.optimizer.zero_grad(set_to_none=True)
        self.mark("optimizer")
        if self.ema is not None:
            self.ema.update(self.model, keep=~skip)
            self.mark("ema")
        self.counters.last_optimizer_step = self.counters.global_step

    def settle(self, state: RunState) -> int:
        """Read and count the deferred checks since the last settle (``checks``; nothing to do without): warnings,
        counters and errors as the immediate checks give them, and the finite iterations into
        ``state.loss_batches``. Returns the iterations skipped for a non-finite loss."""
        if self.checks is None:
            return 0
        skipped = 0
        for iteration, loss_bad, step_bad in self.checks.read():
            if loss_bad:
                skipped += 1
                self._count_nonfinite_loss(iteration)
            else:
                self.counters.nonfinite_in_row = 0
                state.loss_batches += 1
            if step_bad is not None:
                self._count_step(not step_bad, None, iteration)
        return skipped

    def _count_nonfinite_loss(self, iteration: int) -> None:
        counters = self.counters
        counters.nonfinite_in_row += 1
        counters.nonfinite_total += 1
        LOGGER.warning("Non-finite loss at iteration %d: step skipped (%d in a row, %d in total)",
                       iteration, counters.nonfinite_in_row, counters.nonfinite_total)
        if counters.nonfinite_in_row >= MAX_NONFINITE_IN_ROW:
            raise NonFiniteLossError(
                f"loss was NaN/inf for {MAX_NONFINITE_IN_ROW} iterations in a row: lower lr0 (--hyp) or check "
                "the labels; stopping")

    def _count_step(self, updated: bool, scales: tuple[float, float] | None, iteration: int | None = None) -> None:
        """Count a skipped step (``scales``: the GradScaler's loss scale before and after it, if enabled;
        ``iteration``: the step's iteration when counted late, else the current one)."""
        counters = self.counters
        if updated:
            counters.skipped_steps_in_row = 0
            return
        counters.skipped_steps_in_row += 1
        counters.skipped_steps_total += 1
        scale = f" (loss scale {scales[0]:g} -> {scales[1]:g})" if scales is not None else ""
        LOGGER.warning("Non-finite gradient at iteration %d: optimizer step skipped%s (%d in a row, %d in total)",
                       counters.global_step if iteration is None else iteration, scale, counters.skipped_steps_in_row, counters.skipped_steps_total)
        if counters.skipped_steps_in_row >= MAX_NONFINITE_IN_ROW:
            raise NonFiniteGradientError(
                f"gradients were NaN/inf at {MAX_NONFINITE_IN_ROW} optimizer steps in a row: lower lr0 (--hyp), "
                "try --amp off, or check the labels; stopping")


def scale_batch(images: torch.Tensor, size: int, stride: int = 32) -> torch.Tensor:
    """--multi-scale: resize a batch so its long side is ``size``, both sides multiples of ``stride``."""
    scale = size / max(images.shape[2:])
    if scale == 1:
        return images
    shape = [math.ceil(x * scale / stride) * stride for x in images.shape[2:]]
    return F.interpolate(images, size=shape, mode="bilinear", align_corners=False)


def train_one_epoch(step: TrainStep, loader, state: RunState, epochs: int | None, device: torch.device, warmup,
                    at_step_boundary=None, multi_scale_size=None, batch_hook=None, batch_transform=None,
                    callbacks=None) -> EpochStats:
    """Train over the rest of ``loader``'s epoch (``state.epoch`` from batch ``state.batch``; the loader
    must already skip the batches done; ``epochs`` is the run's epoch count for the progress bar, None when
    not known yet). ``warmup`` is a callable(global_step, epoch) -> accumulate count;
    ``at_step_boundary()`` runs after each optimizer step and returns True to end the epoch there;
    ``batch_transform(epoch, batch_index, images, targets, paths)`` -> (images, targets, paths) changes each batch
    as it arrives (--quad: utils/data/quad.py); ``batch_hook(epoch, batch_index, images, targets, paths)`` then sees
    it (e.g. to plot mosaics);
    ``multi_scale_size()`` (--multi-scale) returns (long side, stride) for the next batch;
    ``callbacks`` (utils.callbacks.Callbacks): YOLOv5's batch hooks (``on_train_batch_end`` on the main process, its
    losses read at every batch while it has an action)."""
    step.model.train()
    hooks = _BatchHooks(callbacks)
    epoch, first_batch = state.epoch, state.batch
    num_batches = first_batch + len(loader)
    # exact: float32 sums, added in the same order on any device; a checkpoint reads them (RunState.to_dict)
    totals = torch.tensor(state.loss_sums, dtype=torch.float32, device=device)
    state.loss_sums = totals
    stats = EpochStats(mean_losses=totals)
    shown = None  # the mean losses last read for the progress bar
    LOGGER.info(("\n" + "%11s" * 7), "Epoch", "Mem", "box_loss", "obj_loss", "cls_loss", "Instances", "Size")
    feed = BatchFeed(loader, device, _preparer(epoch, batch_transform, batch_hook), first_batch,
                     ahead=copies_run_ahead(device))
    bar = tqdm(enumerate(feed, start=first_batch), total=num_batches, initial=first_batch,
               disable=not dist.is_main_process(), bar_format="{l_bar}{bar:10}{r_bar}", leave=True)
    step.optimizer.zero_grad(set_to_none=True)
    tick = time.perf_counter()
    for batch_index, (images, targets, _paths, _shapes) in bar:  # on the device, images in [0, 1] (utils/trainer/feed.py)
        stats.data_time += time.perf_counter() - tick
        if hooks.start:
            callbacks.run("on_train_batch_start")
        step.mark("data")
        counters = step.counters
        accumulate = warmup(counters.global_step, epoch)
        stepping = counters.global_step - counters.last_optimizer_step >= accumulate
        if multi_scale_size is not None:
            size, stride = multi_scale_size()
            images = scale_batch(images, size, stride)
        step.mark("copy")
        compute_start = time.perf_counter()
        items, finite = step.forward_backward(images, targets, sync=stepping)
        stats.compute_time += time.perf_counter() - compute_start
        if step.checks is not None:  # counted at the next settle
            totals += torch.where(finite, items.float(), 0.0)
        elif finite:
            totals += items.float()
            state.loss_batches += 1
        else:
            stats.skipped_steps += 1
        optim_start = time.perf_counter()
        if stepping:
            step.optimizer_step(hooks.before_zero_grad)
            if hooks.optimizer_step:
                callbacks.run("optimizer_step")
        stats.optimizer_time += time.perf_counter() - optim_start
        stats.iterations += 1
        stats.images += images.shape[0]
        counters.global_step += 1
        state.batch = batch_index + 1
        if shown is None or stats.iterations % REPORT_EVERY == 0 or state.batch == num_batches:
            stats.skipped_steps += step.settle(state)
            shown = (totals / max(state.loss_batches, 1)).tolist()
        bar.set_description(("%11s" * 2 + "%11.4g" * 5) % (
            f"{epoch + 1}/{epochs or '?'}", memory_string(device), *shown, targets.shape[0], images.shape[-1]))
        if hooks.end:  # YOLOv5's arguments: its global batch index and the epoch's mean losses (0-d tensors)
            stats.skipped_steps += step.settle(state)
            callbacks.run("on_train_batch_end", step.model, counters.global_step - 1, images, targets, _paths,
                          list(totals / max(state.loss_batches, 1)))
        step.mark("logging")
        if stepping and at_step_boundary is not None and state.batch < num_batches and at_step_boundary():
            stats.stopped = True
            break
        tick = time.perf_counter()
    bar.close()
    stats.skipped_steps += step.settle(state)
    state.loss_sums = totals.tolist()
    stats.mean_losses = totals.cpu() / max(state.loss_batches, 1)
    return stats


class _BatchHooks:
    """Which of YOLOv5's per-batch hooks have actions, asked once per epoch (none: the loop calls nothing)."""

    def __init__(self, callbacks):
        has = callbacks.has if callbacks is not None else (lambda hook: False)
        self.start, self.optimizer_step = has("on_train_batch_start"), has("optimizer_step")
        self.end = has("on_train_batch_end") and dist.is_main_process()
        self.before_zero_grad = (lambda: callbacks.run("on_before_zero_grad")) if has("on_before_zero_grad") else None


def _preparer(epoch: int, batch_transform, batch_hook):
    """BatchFeed's ``prepare``: the batch transform, then the hook, on each batch as it leaves the loader."""
    if batch_transform is None and batch_hook is None:
        return None

    def prepare(batch_index: int, batch: tuple) -> tuple:
        images, targets, paths, shapes = batch
        if batch_transform is not None:
            images, targets, paths = batch_transform(epoch, batch_index, images, targets, paths)
        if batch_hook is not None:
            batch_hook(epoch, batch_index, images, targets, paths)
        return images, targets, paths, shapes
    return prepare


def make_warmup(optimizer, warmup_iters: int, lr_lambda, hyp, batch_size: int, nominal_batch: int):
    """Bind the warmup schedule: returns callable(global_step, epoch) -> accumulate count for this step
    (lr, momentum and accumulation ramp during warmup; afterwards the full accumulation count)."""
    def warmup(global_step: int, epoch: int) -> int:
        return apply_warmup(optimizer, global_step, warmup_iters, epoch, lr_lambda, hyp, batch_size, nominal_batch)
    return warmup
