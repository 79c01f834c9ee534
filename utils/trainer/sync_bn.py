"""--sync-bn: BatchNorm statistics over the global batch of all DDP processes.

On CUDA this is torch's ``nn.SyncBatchNorm``. torch's version refuses CPU tensors, so on CPU (gloo)
``CPUSyncBatchNorm`` does the same with one all-reduce per layer and direction: the per-channel sums of
``x - c`` and ``(x - c)^2`` over every process's batch, where ``c`` is the running mean (identical on
every process, and close to the batch mean, so the variance does not lose precision to cancellation).
The all-reduce is autograd-aware (``torch.distributed.nn``), so the backward pass is the exact gradient
of the global-batch normalisation. Running statistics come out identical on every process.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as torch_dist
from torch import nn

LOGGER = logging.getLogger(__name__)


class CPUSyncBatchNorm(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch_dist.is_available() and torch_dist.is_initialized()
                and torch_dist.get_world_size() > 1):
            return super().forward(x)
        channels = x.shape[1]
        shift = self.running_mean.detach().view(1, -1, 1, 1).to(x.dtype)
        centred = x - shift
        count = x.new_full((1,), float(x.numel() // channels))
        sums = _AllReduceSum.apply(torch.cat((centred.sum((0, 2, 3)), (centred * centred).sum((0, 2, 3)), count)))
        total = float(sums[-1].item())  # one all-reduce, differentiable: the backward all-reduces the gradient
        shifted_mean, mean_square = sums[:channels] / total, sums[channels:2 * channels] / total
        variance = (mean_square - shifted_mean * shifted_mean).clamp_min(0)
        mean = shifted_mean + shift.view(-1)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), variance.detach(), total)
        scale = torch.rsqrt(variance + self.eps)
        normalised = (x - mean.view(1, -1, 1, 1)) * scale.view(1, -1, 1, 1)
        if self.affine:
            normalised = normalised * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)
        return normalised

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, variance: torch.Tensor, count: float) -> None:
        self.num_batches_tracked += 1
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = variance * (count / max(count - 1, 1))
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the process group; its gradient is the sum of every process's gradient (each process's
    loss depends on every process's input through the shared statistics)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        torch_dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        torch_dist.all_reduce(total)
        return total


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm2d of ``model`` synchronised over the process group (torch's on CUDA, ours on CPU);
    parameters, buffers and settings carried over."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _convert(model)


def _convert(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.BatchNorm2d) and not isinstance(module, CPUSyncBatchNorm):
        synced = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats)
        synced.load_state_dict(module.state_dict())
        synced.train(module.training)
        return synced
    for name, child in module.named_children():
        setattr(module, name, _convert(child))
    return module
