"""A bound on the values a forward pass may produce, checked before each layer runs.

Building a DetectionModel runs a probe forward pass (64 to 512 px) to measure its strides. A model
YAML within every per-value bound can still describe a probe that needs terabytes (a wide layer
upsampled 64x, twice). ``ActivationBudget`` hooks every leaf module: before it runs, the values it is
about to produce are estimated from its input shapes and settings (convolutions, upsampling, padding,
linear layers and attention by formula; any other leaf as large as its inputs, which covers
activations, normalisation, pooling, Concat and the reshaping blocks) and added up; past the budget the
pass stops with a ModelConfigError naming the layer. Real models stay below it: summed this way, the
largest probe pass of yolov5x6 produces 115 M values and yolov5-p7's (256 px) 389 M, the most of any
YAML in models/ and models/hub/, against a budget of 1,000 M.
"""
from __future__ import annotations

import math

import torch
from torch import nn

MAX_PROBE_VALUES = 1_000_000_000  # 4 GB of float32, summed over every leaf output of one probe pass


def _tensors(inputs) -> list[torch.Tensor]:
    found, pending = [], list(inputs)
    while pending:
        item = pending.pop()
        if torch.is_tensor(item):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return found


def _conv_side(side: int, kernel: int, stride: int, padding: int, dilation: int, transposed: bool,
               output_padding: int = 0) -> int:
    if transposed:
        return (side - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1
    return max((side + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1, 0)


def _conv_values(conv: nn.Conv2d | nn.ConvTranspose2d, x: torch.Tensor) -> int:
    if x.dim() != 4:
        return x.numel()
    transposed = isinstance(conv, nn.ConvTranspose2d)
    padding = conv.padding if isinstance(conv.padding, tuple) else (0, 0)
    if conv.padding == "same":
        sides = x.shape[2:]
    else:
        output_padding = conv.output_padding if transposed else (0, 0)
        sides = [_conv_side(x.shape[2 + k], conv.kernel_size[k], conv.stride[k], padding[k], conv.dilation[k],
                            transposed, output_padding[k]) for k in range(2)]
    return x.shape[0] * conv.out_channels * sides[0] * sides[1]


def _upsample_values(upsample: nn.Upsample, x: torch.Tensor) -> int:
    batch_channels, sides = x.shape[0] * x.shape[1], x.shape[2:]
    if upsample.size is not None:
        size = upsample.size if isinstance(upsample.size, tuple) else (upsample.size,) * len(sides)
        return batch_channels * math.prod(size)
    factor = upsample.scale_factor
    factors = factor if isinstance(factor, tuple) else (factor,) * len(sides)
    return batch_channels * math.prod(math.floor(side * f) for side, f in zip(sides, factors))


def estimated_values(module: nn.Module, inputs) -> int:
    """Values ``module`` will output for ``inputs`` (an upper bound for the layer types that grow)."""
    tensors = _tensors(inputs)
    if not tensors:
        return 0
    x, size = tensors[0], sum(t.numel() for t in tensors)
    if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
        return _conv_values(module, x)
    if isinstance(module, nn.Upsample):
        return _upsample_values(module, x)
    if isinstance(module, nn.ZeroPad2d) and x.dim() == 4:
        left, right, top, bottom = module.padding
        return x.shape[0] * x.shape[1] * (x.shape[2] + top + bottom) * (x.shape[3] + left + right)
    if isinstance(module, nn.Linear):
        return x.numel() // max(module.in_features, 1) * module.out_features
    if isinstance(module, nn.MultiheadAttention) and x.dim() == 3:
        tokens, batch = x.shape[0], x.shape[1]
        return size + batch * module.num_heads * tokens * tokens  # the attention matrix
    return size


class ActivationBudget:
    """Context manager: while active, each leaf module of ``model`` adds its estimated output to a
    running total before it runs; ``on_exceeded(layer_index, total)`` is called past ``limit``
    (it raises). ``reset()`` starts a new pass."""

    def __init__(self, model: nn.Module, on_exceeded, limit: int = MAX_PROBE_VALUES):
        self.model, self.on_exceeded, self.limit = model, on_exceeded, limit
        self.total, self.handles = 0, []

    def reset(self) -> None:
        self.total = 0

    def _hook(self, index):
        def check(module, inputs):
            self.total += estimated_values(module, inputs)
            if self.total > self.limit:
                self.on_exceeded(index, self.total)
        return check

    def __enter__(self) -> ActivationBudget:
        for layer in self.model.model:
            for module in layer.modules():
                if not any(True for _ in module.children()) or isinstance(module, nn.MultiheadAttention):
                    self.handles.append(module.register_forward_pre_hook(self._hook(getattr(layer, "i", None))))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
