"""``--cuda-graphs``: the model's forward and backward replayed as CUDA graphs (off by default).

Why: a yolov5s training step at batch 64 and 640 px launches ~1,770 kernels. Measured on an H100 (2026-11-27,
benchmarks/results/gpu_check_2026-11-27_h100_throughput.md): its host spends ~80 ms a step issuing them
(cudaLaunchKernel alone 15 ms), while the kernels take at most ~45 ms, and yolov5n (a quarter of the arithmetic)
steps no faster: the GPU waits for the host. A CUDA graph issues a whole captured sequence in one launch.

How: ``torch.cuda.make_graphed_callables`` captures the model's forward and its backward once, for the shape of the
first full batch (after warm-up iterations on a side stream, as capture needs). Batches of that shape then replay
the two graphs; any other shape (a smaller last batch, ``--multi-scale``, ``--rect``) runs the model itself. The loss,
GradScaler, gradient clipping, the optimizer step and the EMA stay eager, and the graphed backward hands its
gradients to autograd as the model's would, so accumulation and ``zero_grad(set_to_none=True)`` work as before.

Gradient accumulation: the graphed backward hands autograd its own static gradient buffers (detached), and a
parameter whose ``.grad`` is None takes such a buffer as its gradient without a copy; the next replay then overwrites
it in place (pytorch/pytorch#181723: a window of micro-steps would step with twice its last micro-step's gradients).
``own_gradients`` gives each gradient its own memory after a replayed micro-step that the optimizer does not step
(TrainStep calls it), so the next micro-step adds to it as autograd always does; a step of one micro-step needs no copy.

What the capture must not change:
- its warm-up iterations run the model in training mode, which moves BatchNorm's running statistics and counts:
  every buffer is put back afterwards, so the run does not depend on the capture;
- autocast's cache of cast weights is off around the graph (a graph's casts must read the weights at each replay).

Not used (with a warning): on a CPU (no graphs there) and under DDP (DistributedDataParallel's gradient hooks are not
captured here). The graphs keep their own memory pool: a run that also steps other shapes eagerly holds both.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

LOGGER = logging.getLogger(__name__)
WARMUP_ITERATIONS = 3  # make_graphed_callables' warm-up runs before the capture (its default)


class _Forward(nn.Module):
    """The model as the one module make_graphed_callables graphs: it patches this wrapper's forward, never the
    model's (which checkpoints, the EMA and validation keep using as it is)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor):
        return tuple(self.model(images))


class GraphedModel:
    """``model``'s training forward for TrainStep: replayed graphs for batches of the captured shape, the model
    itself for the others (see the module docstring). ``batch_size``: the per-process batch whose shape is captured."""

    def __init__(self, model: nn.Module, precision, batch_size: int, capture=None):
        self.model, self.precision, self.batch_size = model, precision, batch_size
        self._capture_function = capture or torch.cuda.make_graphed_callables
        self.graphed = None
        self.key = None  # (shape, strides, dtype) of the captured input
        self.replays = self.eager = 0
        self.replayed = False  # the last call replayed the graphs (its gradients may be the graph's buffers)

    def __call__(self, images: torch.Tensor):
        key = (tuple(images.shape), images.stride(), images.dtype)
        if self.graphed is None and images.shape[0] == self.batch_size and self.model.training:
            self._capture(images, key)
        self.replayed = key == self.key and self.model.training
        if self.replayed:
            self.replays += 1
            with self.precision.autocast(cache=False):
                return list(self.graphed(images))
        self.eager += 1
        with self.precision.autocast():
            return self.model(images)

    def own_gradients(self) -> None:
        """After the backward of a replayed micro-step that is not stepped: every parameter's gradient in memory of its
        own (copies in a few multi-tensor kernels), so that the next replay, which rewrites the graph's buffers, adds
        to it instead (see the module docstring)."""
        if not self.replayed:
            return
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        for parameter, copy in zip(parameters, torch._foreach_mul([p.grad for p in parameters], 1.0)):
            parameter.grad = copy

    def _capture(self, images: torch.Tensor, key) -> None:
        saved = {name: buffer.detach().clone() for name, buffer in self.model.named_buffers()}
        with self.precision.autocast(cache=False):
            self.graphed = self._capture_function(_Forward(self.model), (images.detach().clone(),),
                                                  num_warmup_iters=WARMUP_ITERATIONS, allow_unused_input=True)
        with torch.no_grad():  # the warm-up's BatchNorm statistics and counts are not the run's
            for name, buffer in self.model.named_buffers():
                buffer.copy_(saved[name])
        self.key = key
        LOGGER.info("--cuda-graphs: forward and backward captured for batches of %s; other shapes run eagerly",
                    "x".join(map(str, key[0])))


def graphed_model(enabled: bool, model: nn.Module, precision, batch_size: int, device: torch.device,
                  distributed: bool, multi_scale: bool = False) -> GraphedModel | None:
    """A GraphedModel when ``--cuda-graphs`` asks for one and the run can use it; None (with a warning saying why)
    otherwise."""
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
    return GraphedModel(model, precision, batch_size)
