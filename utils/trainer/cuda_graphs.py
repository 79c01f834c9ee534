"""``--cuda-graphs``: the model's forward and backward replayed as CUDA graphs (off by default).

Why: a yolov5s training step at batch 64 and 640 px launches ~1,770 kernels. Measured on an H100 (2026-11-27,
benchmarks/results/gpu_check_2026-11-27_h100_throughput.md): its host spends ~80 ms a step issuing them
(cudaLaunchKernel alone 15 ms), while the kernels take at most ~45 ms, and yolov5n (a quarter of the arithmetic)
steps no faster: the GPU waits for the host. A CUDA graph issues a whole captured sequence in one launch.

How: utils/trainer/graph_capture.py captures the model's forward and its backward as two graphs for the shape of the
first full batch (after warm-up iterations on a side stream, as capture needs), and once more for an epoch's smaller
last batch when it comes, on the same stream into the same memory pool (so both shapes share one step's activation
memory: 1.04x eager training's peak on an H200 where a last batch run eagerly beside the graphs took 1.63x).
Batches of a captured shape replay their two graphs; any other shape (``--multi-scale``, ``--rect``) runs the model
itself. GradScaler, gradient clipping, the optimizer step and the EMA stay eager, and the graphed backward hands its
gradients to autograd as the model's would, so accumulation and ``zero_grad(set_to_none=True)`` work as before.

The loss is captured with the model when it has fixed shapes (utils/loss.py: CUDA's form, with the deferred step
checks): its ~400 operations a step (forward and backward, 12 ms of host time on the 2026-11-27 H100) are then part
of the two replays. Its shapes depend on the number of targets, which changes every batch, so the targets are padded
to a fixed capacity (``target_capacity``: twice the capture batch's, at least TARGETS_PER_IMAGE an image) with rows
of zero width and height, which no anchor matches (``pad_targets``): the padded loss is the same sums with more
zeros in them (equal within float rounding, tests/test_cuda_graphs.py). A batch with more targets than that runs
eagerly, model and loss (said once, counted in ``overflows``). The compact loss (another optimizer, immediate checks)
reads the number of matches on the host and stays eager, after the graphed model.

Gradient accumulation: the graphed backward hands autograd its own static gradient buffers (detached), and a
parameter whose ``.grad`` is None takes such a buffer as its gradient without a copy; the next replay then overwrites
it in place (pytorch/pytorch#181723: a window of micro-steps would step with twice its last micro-step's gradients).
``own_gradients`` gives each gradient its own memory after a replayed micro-step that the optimizer does not step
(TrainStep calls it), so the next micro-step adds to it as autograd always does; a step of one micro-step needs no copy.

What the capture must not change:
- its warm-up iterations run the model in training mode, which moves BatchNorm's running statistics and counts:
  every buffer is put back afterwards, so the run does not depend on the capture;
- autocast's cache of cast weights is off around the graph (a graph's casts must read the weights at each replay);
- the capture holds ``CUDA_CAPTURE_LOCK``, so the DataLoader's pin-memory thread, which pins the next batches, makes
  no CUDA call meanwhile (one would invalidate the capture and end the run: utils/cuda_capture.py).

A capture that raises (CUDA refuses an operation while capturing, or memory runs out) is one warning; BatchNorm is
put back and the run trains on without graphs (``failed``).

Not used (with a warning): on a CPU (no graphs there) and under DDP (DistributedDataParallel's gradient hooks are not
captured here). The graphs keep their own memory pool: a run that also steps other shapes eagerly (or a batch with
more targets than the loss's capacity) holds that memory beside it.
"""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import torch
from torch import nn

from utils.cuda_capture import CUDA_CAPTURE_LOCK
from utils.trainer.graph_capture import SharedPoolCapture

LOGGER = logging.getLogger(__name__)
WARMUP_ITERATIONS = 3  # eager passes before the run's first capture (make_graphed_callables' default)
MAX_SHAPES = 2  # the full batch and an epoch's smaller last batch
TARGETS_PER_IMAGE = 32  # the graphed loss's least target capacity per image of the batch
TARGET_HEADROOM = 2  # and at least this many times the targets of the batch it is captured with
CAPACITY_STEP = 256  # capacities are whole multiples of this


def target_capacity(num_targets: int, batch_size: int) -> int:
    """The number of target rows the graphed loss is captured for."""
    wanted = max(TARGET_HEADROOM * num_targets, TARGETS_PER_IMAGE * batch_size, 1)
    return -(-wanted // CAPACITY_STEP) * CAPACITY_STEP


def pad_targets(targets: torch.Tensor, capacity: int) -> torch.Tensor:
    """``targets`` (n, 6) as (capacity, 6): the extra rows are boxes of zero width and height, which no anchor matches
    (their width/height ratio to every anchor is infinite), so the fixed-shape loss keeps none of their candidates."""
    return torch.cat((targets, targets.new_zeros(capacity - targets.shape[0], targets.shape[1])))


class _Forward(nn.Module):
    """The model as the one module a capture graphs, its outputs as a tuple (the form a graphed callable returns); a
    wrapper, so that nothing a capture does to the module it is given reaches the model, which checkpoints, the EMA
    and validation keep using as it is."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor):
        return tuple(self.model(images))


class _ForwardLoss(nn.Module):
    """The model and its fixed-shape loss as one module to graph: (images, padded targets) -> (loss, items)."""

    def __init__(self, model: nn.Module, compute_loss):
        super().__init__()
        self.model, self.compute_loss = model, compute_loss

    def forward(self, images: torch.Tensor, targets: torch.Tensor):
        return self.compute_loss([p.float() for p in self.model(images)], targets)


class Captured(NamedTuple):
    """One capture: its graphed callable, and the target rows its loss takes (0 with the model alone graphed)."""
    graphed: Callable
    capacity: int = 0


class GraphedModel:
    """``model``'s training forward for TrainStep: replayed graphs for batches of a captured shape, the model itself
    for the others (see the module docstring). ``batch_size``: the per-process batch whose shape is captured first.
    ``compute_loss``: the run's loss; one with fixed shapes is captured with the model (``loss_of``). ``capture``:
    make_graphed_callables' signature (tests give a stand-in); by default a SharedPoolCapture."""

    def __init__(self, model: nn.Module, precision, batch_size: int, capture=None, compute_loss=None):
        self.model, self.precision, self.batch_size = model, precision, batch_size
        self._capture_function = capture or SharedPoolCapture()
        self.compute_loss = compute_loss if getattr(compute_loss, "fixed_shapes", False) else None
        self.graphs: dict[tuple, Captured] = {}  # batch_key of a captured input -> its capture, the full batch's first
        self.replays = self.eager = self.overflows = 0
        self.failed = False  # a capture raised: every batch runs eagerly from then on
        self.replayed = False  # the last call replayed the graphs (its gradients may be the graph's buffers)

    @property
    def graphed(self):
        """The first capture's graphed callable (the full batch's), or None before it."""
        first = next(iter(self.graphs.values()), None)
        return first.graphed if first is not None else None

    @property
    def capacity(self) -> int:
        """The target rows of the first capture's loss (0 before it, or with the model alone graphed)."""
        return next(iter(self.graphs.values()), Captured(None)).capacity

    def __call__(self, images: torch.Tensor):
        """The model's outputs: replayed when the graphs are the model's alone, else eager."""
        captured = self._graphs_for(images) if self.compute_loss is None else None
        self.replayed = captured is not None
        if self.replayed:
            self.replays += 1
            with self.precision.autocast(cache=False):
                return list(captured.graphed(images))
        self.eager += 1
        with self.precision.autocast():
            return self.model(images)

    def loss_of(self, images: torch.Tensor, targets: torch.Tensor):
        """(loss, items) from the graphs of the model and its loss, or None where this batch runs eagerly (a shape not
        captured, eval mode, more targets than the capacity, or a loss that is not graphed)."""
        if self.compute_loss is None:
            return None
        captured = self._graphs_for(images, targets)
        if captured is None:
            return None
        capacity = captured.capacity
        if targets.shape[0] > capacity:
            if not self.overflows:
                LOGGER.info("--cuda-graphs: a batch with %d targets, more than the %d the loss was captured for, runs "
                            "eagerly (as will any other such batch)", targets.shape[0], capacity)
            self.overflows += 1
            return None
        self.replayed = True
        self.replays += 1
        with self.precision.autocast(cache=False):
            loss, items = captured.graphed(images, pad_targets(targets, capacity))
        return loss, items.detach()

    def own_gradients(self) -> None:
        """After the backward of a replayed micro-step that is not stepped: every parameter's gradient in memory of its
        own (copies in a few multi-tensor kernels), so that the next replay, which rewrites the graph's buffers, adds
        to it instead (see the module docstring)."""
        if not self.replayed:
            return
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        for parameter, copy in zip(parameters, torch._foreach_mul([p.grad for p in parameters], 1.0)):
            parameter.grad = copy

    def _graphs_for(self, images: torch.Tensor, targets: torch.Tensor | None = None):
        """The capture for this batch's shape, made now where ``captures`` wants it; None: eager."""
        if not self.model.training or self.failed:
            return None
        key = batch_key(images)
        if key not in self.graphs and captures(key, list(self.graphs), self.batch_size):
            self._capture(images, key, targets)
        return self.graphs.get(key)

    def _capture(self, images: torch.Tensor, key, targets: torch.Tensor | None = None) -> None:
        warmup = 0 if self.graphs else WARMUP_ITERATIONS  # a later shape's capture is its first pass (module docstring)
        saved = {name: buffer.detach().clone() for name, buffer in self.model.named_buffers()}
        capacity = 0 if targets is None else target_capacity(targets.shape[0], images.shape[0])
        if targets is None:
            module, sample = _Forward(self.model), (images.detach().clone(),)
        else:
            module, sample = _ForwardLoss(self.model, self.compute_loss), (images.detach().clone(),
                                                                           pad_targets(targets, capacity))
        reason = None
        try:
            with CUDA_CAPTURE_LOCK, self.precision.autocast(cache=False):  # the pin thread waits (utils/cuda_capture.py)
                graphed = self._capture_function(module, sample, num_warmup_iters=warmup, allow_unused_input=True)
        except RuntimeError as error:  # CUDA's capture errors and out-of-memory: the run goes on without graphs
            reason = (str(error).strip().splitlines() or ["?"])[0][:200]
        finally:
            with torch.no_grad():  # the warm-up's BatchNorm statistics and counts are not the run's
                for name, buffer in self.model.named_buffers():
                    buffer.copy_(saved[name])
        if reason is not None:
            self.failed = True
            self.graphs.clear()
            release_cached_memory()  # the graphs' pool, else held beside the eager steps (26.0 GB against 13.1 seen)
            LOGGER.warning("WARNING: --cuda-graphs: the capture for batches of %s failed (%s); training on without "
                           "graphs", "x".join(map(str, key[0])), reason)
            return
        self.graphs[key] = Captured(graphed, capacity)
        what = ("forward and backward" if targets is None
                else f"forward, loss (up to {capacity} targets) and backward")
        LOGGER.info("--cuda-graphs: %s captured for batches of %s%s", what, "x".join(map(str, key[0])),
                    "; other shapes run eagerly" if len(self.graphs) == 1 else " (into the same memory)")


def release_cached_memory() -> None:
    """CUDA memory that no tensor holds any more (a dropped capture's pool) back to the device, for the eager steps."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def batch_key(images: torch.Tensor) -> tuple:
    """What a graph's input must match: shape, strides (memory format) and dtype."""
    return tuple(images.shape), images.stride(), images.dtype


def captures(key: tuple, captured: list[tuple], batch_size: int) -> bool:
    """Whether a batch of ``key`` is captured, given the keys ``captured`` so far: first the run's full batch, then one
    smaller batch of the same images (an epoch's last); any other shape (--multi-scale, --rect) runs eagerly."""
    if not captured:
        return key[0][0] == batch_size
    first = captured[0]
    return (len(captured) < MAX_SHAPES and key[0][0] < first[0][0] and key[0][1:] == first[0][1:]
            and key[2] == first[2])


def graphed_model(enabled: bool, model: nn.Module, precision, batch_size: int, device: torch.device,
                  distributed: bool, multi_scale: bool = False, compute_loss=None) -> GraphedModel | None:
    """A GraphedModel when ``--cuda-graphs`` asks for one and the run can use it (``compute_loss``: the run's loss,
    graphed with the model when its shapes are fixed); None (with a warning saying why) otherwise."""
    if not enabled:
        return None
    if device.type != "cuda":
        LOGGER.warning("WARNING: --cuda-graphs has no effect on %s (CUDA graphs need a CUDA device); training "
                       "without", device.type)
        return None
    if distributed:
        LOGGER.warning("WARNING: --cuda-graphs is not used under DDP (its gradient all-reduce is not captured); "
                       "training without")
        return None
    if multi_scale:
        LOGGER.warning("WARNING: --cuda-graphs with --multi-scale: only batches of the first full batch's size "
                       "replay the graphs, the others run eagerly")
    return GraphedModel(model, precision, batch_size, compute_loss=compute_loss)
