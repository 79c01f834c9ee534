"""BatchNorm2d whose training-mode batch statistics stay accurate for channels_last inputs on the CPU.

PyTorch's CPU kernel for channels_last (NHWC) inputs sums each channel over all N*H*W pixels in a single
float32 accumulator per thread, so the rounding error of the batch mean and variance (forward) and of
the gradient sums (backward) grows with the number of pixels. Measured with torch 2.14.1 on a 2-core
AMD EPYC (Zen 4), one thread, batch 8 of 16 x 160 x 160 (yolov5n's first BatchNorm at --img 320): output
and input-gradient relative error 2.4e-5 against float64, where the NCHW kernel gives 6e-8; through
yolov5n's 57 BatchNorms the parameter gradients of one training step end up with a median relative
error of 3.5e-3 instead of NCHW's 1.6e-5; with this class, 2.4e-5 (benchmarks/check_channels_last_numerics.py).

``BatchNorm2d`` runs the same native kernels on a view of the activation as rows of ``k`` pixels
(shape ``(N*H*W / k, k*C)``): each of the ``k*C`` columns then sums only ``N*H*W / k`` pixels (at most
ROW_LIMIT where a divisor allows), and the ``k`` partial results per channel are combined in float64. The
forward reads and writes the activation as often as the native kernel (two reading passes for the
statistics, one to normalise); the backward reads it once more and writes one extra temporary (the input
gradient is formed in two element-wise passes instead of one); the per-channel arithmetic adds a few
small tensor operations per call (~0.2 ms), so maps of at most NATIVE_PIXELS pixels a channel, where
torch's kernel is nearly as accurate, keep torch's kernel. Other inputs (NCHW, CUDA, bf16/fp16, eval mode)
take ``nn.BatchNorm2d``'s own path unchanged, so validation, inference and fused models never reach this
code. Where ``models.native``'s kernels are built, a Conv's BatchNorm followed by SiLU does not reach it either:
``models.bn_silu`` computes both, with sums as accurate; this class remains for the other cases.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

COLUMN_LIMIT = 16384  # k*C columns at most: the per-thread float32 sums of one row stay within 64 KiB
ROW_LIMIT = 1024  # pixels summed per column of the rows view, at most (where a divisor allows)
NATIVE_PIXELS = 4096  # at most this many pixels per channel: torch's own kernel (see uses_grouped_sums)


@functools.lru_cache(maxsize=256)
def pixel_group(pixels: int, channels: int) -> int:
    """The divisor k of ``pixels`` that makes the rows view: the smallest with at most ROW_LIMIT rows (each column
    sums that many pixels) and k * channels <= COLUMN_LIMIT, else the largest within COLUMN_LIMIT (1 when the
    channels alone exceed it). Fewer, longer columns are faster: the kernels' per-column work (buffers, the
    reduction across threads) costs more than their sums over rows; at 1024 rows the statistics and gradient
    sums of yolov5n's maps ran 1.4-2.5x faster than at the most columns (AVX2, 2 threads)."""
    limit = max(COLUMN_LIMIT // channels, 1)
    divisors = set()
    divisor = 1
    while divisor * divisor <= pixels:
        if pixels % divisor == 0:
            divisors.update((divisor, pixels // divisor))
        divisor += 1
    within = [k for k in divisors if k <= limit]
    short = [k for k in within if pixels // k <= ROW_LIMIT]
    return min(short) if short else max(within, default=1)


def uses_grouped_sums(x: torch.Tensor) -> bool:
    """True for the inputs whose native statistics lose precision: CPU float32 channels_last 4-D maps with more
    than NATIVE_PIXELS pixels per channel. The error of torch's kernel grows with that count, while this path
    costs a fixed ~0.4 ms a call in small tensor operations, which is most of a small map's time: yolov5n at
    192 px, batch 16, AVX2, 57 BatchNorms fwd + bwd took 44 ms grouped against 18 ms native, 35 of them on <=
    2304 pixels. With small maps native, the median parameter-gradient error of a yolov5n step (batch 8, 320)
    is 2.4e-5 (with ROW_LIMIT rows) against NCHW's 1.6e-5 (all grouped, most columns: 1.7e-5; all native: 3.5e-3)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 4
            and x.numel() > NATIVE_PIXELS * x.shape[1]
            and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())


def pixel_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """The channels_last tensor's memory as (N*H*W / group, group * C) rows (a view, no copy)."""
    return x.permute(0, 2, 3, 1).reshape(-1, group * x.shape[1])


def batch_statistics(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance (float64) of a channels_last batch, from grouped partial sums."""
    channels = x.shape[1]
    group_mean, group_var = torch.batch_norm_update_stats(pixel_rows(x, group), None, None, 0.0)
    group_mean = group_mean.double().view(group, channels)
    group_var = group_var.double().view(group, channels)
    mean = group_mean.mean(0)
    return mean, (group_var + (group_mean - mean) ** 2).mean(0)  # equal-sized groups


def gradient_sums(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, group: int):
    """Per-channel sum(grad) and sum(grad * (x - mean)) in float64, from grouped partial sums."""
    channels = x.shape[1]
    columns = group * channels
    ones = torch.ones(columns, dtype=x.dtype)
    _, centred_dot, total = torch.ops.aten.native_batch_norm_backward(
        pixel_rows(grad, group), pixel_rows(x, group), None, mean.repeat(group), ones, None, None, False, 0.0,
        [False, True, True])  # eval-mode backward with unit variance: its weight/bias gradients are the two sums
    return total.double().view(group, channels).sum(0), centred_dot.double().view(group, channels).sum(0)


def channel_affine(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """x * scale[c] + shift[c] in one pass that keeps x's memory format (addcmul: twice as fast as the
    eval-mode BatchNorm kernel on channels_last maps, AVX2)."""
    return torch.addcmul(shift.view(1, -1, 1, 1), x, scale.view(1, -1, 1, 1))


class GroupedBatchNorm(torch.autograd.Function):
    """Training-mode batch normalisation from given float64 batch statistics; its backward sums the
    gradients in the same pixel groups and includes the statistics' own gradient terms."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, eps, group):
        invstd = (var + eps).rsqrt()
        gain = invstd * weight.double() if weight is not None else invstd
        offset = bias.double() if bias is not None else torch.zeros_like(mean)
        ctx.save_for_backward(x, mean.to(x.dtype), invstd, gain)
        ctx.group = group
        return channel_affine(x, gain.to(x.dtype), (offset - mean * gain).to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        x, mean, invstd, gain = ctx.saved_tensors
        grad = grad.contiguous(memory_format=torch.channels_last)
        pixels = x.numel() // x.shape[1]
        total, centred_dot = gradient_sums(grad, x, mean, ctx.group)
        grad_x = None
        if ctx.needs_input_grad[0]:
            slope = -gain * invstd ** 2 * centred_dot / pixels  # dx = gain*grad + slope*(x - mean) - gain*mean(grad)
            offset = -slope * mean.double() - gain * total / pixels
            grad_x = channel_affine(x, slope.to(x.dtype), offset.to(x.dtype))
            grad_x.addcmul_(grad, gain.to(x.dtype).view(1, -1, 1, 1))
        grad_weight = (centred_dot * invstd).to(x.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = total.to(x.dtype) if ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None, None, None


@torch.no_grad()
def update_running_stats(bn: nn.BatchNorm2d, mean: torch.Tensor, var: torch.Tensor, pixels: int) -> None:
    """As nn.BatchNorm2d in training: exponential (or, momentum None, cumulative) average of the batch mean and
    unbiased variance, ``pixels`` values a channel."""
    bn.num_batches_tracked.add_(1)
    factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    unbiased = var * pixels / max(pixels - 1, 1)
    bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype), alpha=factor)
    bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype), alpha=factor)


class BatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d (same parameters, buffers and state_dict keys); in training mode, CPU float32
    channels_last inputs get batch statistics and gradient sums accurate to float32 (see the module doc)."""

    def forward(self, x):
        if not (self.training and uses_grouped_sums(x)):
            return super().forward(x)
        pixels = x.numel() // x.shape[1]
        group = pixel_group(pixels, x.shape[1])
        with torch.no_grad():
            mean, var = batch_statistics(x, group)
        if self.track_running_stats and self.running_mean is not None:
            update_running_stats(self, mean, var, pixels)
        return GroupedBatchNorm.apply(x, self.weight, self.bias, mean, var, self.eps, group)
