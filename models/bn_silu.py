"""Training-mode BatchNorm followed by SiLU as two C kernels each way (built at first use), fewer passes over memory.

With torch's operations a Conv's BatchNorm + SiLU reads or writes its map 6 times forward (statistics, the affine
pass, the SiLU) and 10 times backward (SiLU backward, the gradient sums, two passes forming the input gradient);
the CPU spends that time waiting for memory (on yolov5n at 320 they were a quarter of an fp32 training step on
AVX2). ``models/native/bn_silu.c`` does the same arithmetic in 3 passes forward (statistics; normalise and SiLU in
one) and 6 backward (SiLU gradient and both sums in one; the input gradient in one), and keeps only the
BatchNorm's input for backward (the SiLU's input is recomputed in registers).

``bn_silu(x, bn)`` is used by ``models.common.Conv`` in training for CPU float32 channels_last maps without
autocast (``usable``). The statistics are summed in float over blocks of 256 pixels and in double across blocks,
as accurate as ``models.batchnorm``'s grouped sums; the running statistics are updated as nn.BatchNorm2d does.
Where the kernels are not built (``models.native``), Conv computes as before: ``models.batchnorm`` and torch's SiLU.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from models.batchnorm import BatchNorm2d, update_running_stats
from models.native import DOUBLE_P, FLOAT_P, bn_silu_library


def _float(tensor: torch.Tensor):
    return ctypes.cast(tensor.data_ptr(), FLOAT_P)


def _double(tensor: torch.Tensor):
    return ctypes.cast(tensor.data_ptr(), DOUBLE_P)


def _rows(x: torch.Tensor) -> tuple[int, int]:
    return x.numel() // x.shape[1], x.shape[1]


def _checked(code: int, name: str) -> None:
    if code != 0:
        raise MemoryError(f"{name}: the native kernel could not allocate its per-channel sums")


def usable(x: torch.Tensor, bn: nn.Module, act: nn.Module) -> bool:
    """The fused kernels apply: the project's training-mode affine BatchNorm2d with running statistics (not torch's
    nn.BatchNorm2d, not a synchronised one), a plain SiLU, and a CPU float32 4-D channels_last map of more than one
    pixel a channel (torch refuses one) outside autocast, where the kernels are built."""
    return (bn.training and type(act) is nn.SiLU and type(bn) is BatchNorm2d and bn.affine
            and bn.weight.dtype == torch.float32
            and bn.track_running_stats and bn.running_mean is not None and x.device.type == "cpu"
            and x.dtype == torch.float32 and x.dim() == 4 and x.numel() > x.shape[1]
            and x.is_contiguous(memory_format=torch.channels_last) and not torch.is_autocast_enabled("cpu")
            and bn_silu_library() is not None)


def batch_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance (float64) of a channels_last float32 map, with the C kernel."""
    rows, channels = _rows(x)
    mean = torch.empty(channels, dtype=torch.float64)
    var = torch.empty(channels, dtype=torch.float64)
    _checked(bn_silu_library().bn_stats(_float(x), rows, channels, _double(mean), _double(var),
                                        torch.get_num_threads()), "bn_stats")
    return mean, var


class BatchNormSiLU(torch.autograd.Function):
    """silu(bn(x)) in training mode: the batch statistics of x (their gradient terms included in backward), the
    module's running statistics updated as nn.BatchNorm2d updates them. Every tensor handed to C is held by a name
    until the call returns."""

    @staticmethod
    def forward(ctx, x, weight, bias, bn):
        rows, channels = _rows(x)
        out = torch.empty_like(x, memory_format=torch.channels_last)
        mean, var = torch.empty(channels, dtype=torch.float64), torch.empty(channels, dtype=torch.float64)
        scale, shift = torch.empty(channels), torch.empty(channels)
        weight, bias = weight.detach().contiguous(), bias.detach().contiguous()
        _checked(bn_silu_library().bn_silu_train_forward(
            _float(x), _float(out), rows, channels, _float(weight), _float(bias), bn.eps, _double(mean), _double(var),
            _float(scale), _float(shift), torch.get_num_threads()), "bn_silu_train_forward")
        update_running_stats(bn, mean, var, rows)
        ctx.save_for_backward(x, mean, var, scale, shift)
        ctx.eps = bn.eps
        return out

    @staticmethod
    @once_differentiable  # the kernels' gradient is not itself differentiable: a double backward raises
    def backward(ctx, grad):
        x, mean, var, scale, shift = ctx.saved_tensors
        grad = grad.contiguous(memory_format=torch.channels_last)
        rows, channels = _rows(x)
        grad_x = torch.empty_like(x, memory_format=torch.channels_last)  # holds the SiLU's gradient in between
        grad_weight, grad_bias = torch.empty(channels), torch.empty(channels)
        _checked(bn_silu_library().bn_silu_train_backward(
            _float(grad), _float(x), _float(grad_x), rows, channels, ctx.eps, _double(mean), _double(var),
            _float(scale), _float(shift), _float(grad_weight), _float(grad_bias), int(ctx.needs_input_grad[0]),
            torch.get_num_threads()), "bn_silu_train_backward")
        return (grad_x if ctx.needs_input_grad[0] else None, grad_weight if ctx.needs_input_grad[1] else None,
                grad_bias if ctx.needs_input_grad[2] else None, None)


def bn_silu(x: torch.Tensor, bn: nn.BatchNorm2d) -> torch.Tensor:
    """silu(bn(x)) for a training-mode BatchNorm2d; ``usable(x, bn, act)`` must hold."""
    return BatchNormSiLU.apply(x, bn.weight, bn.bias, bn)
