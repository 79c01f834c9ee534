"""Building blocks of the YOLOv5 family, with YOLOv5 v7's attribute names so state_dicts map 1:1.

Each block also says how a YAML row turns into its constructor arguments and output channels
(``yaml_args``), so the parser in ``models.yolo`` never needs editing when a block is added.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from models.batchnorm import BatchNorm2d
from models.bn_silu import bn_silu
from models.bn_silu import usable as bn_silu_usable

# The activation every Conv built with act=True uses. The parser installs one shared instance per
# model (SiLU, or the YAML's `activation`), as YOLOv5 does with its class-level default.
_DEFAULT_ACTIVATION: contextvars.ContextVar[nn.Module | None] = contextvars.ContextVar("default_activation",
                                                                                      default=None)


@contextlib.contextmanager
def default_activation(module: nn.Module):
    """Make ``module`` the activation of every Conv(act=True) constructed inside the block."""
    token = _DEFAULT_ACTIVATION.set(module)
    try:
        yield module
    finally:
        _DEFAULT_ACTIVATION.reset(token)


def make_divisible(value: float, divisor: int = 8) -> int:
    """Smallest multiple of ``divisor`` that is >= value (YOLOv5's channel rounding)."""
    return math.ceil(value / divisor) * divisor


def autopad(kernel, padding=None, dilation=1):
    """'same' padding for odd kernels (int or per-dimension list)."""
    if dilation > 1:
        kernel = dilation * (kernel - 1) + 1 if isinstance(kernel, int) else [dilation * (k - 1) + 1 for k in kernel]
    if padding is None:
        padding = kernel // 2 if isinstance(kernel, int) else [k // 2 for k in kernel]
    return padding


@dataclass(frozen=True)
class RowInputs:
    """What a YAML row's block may look at to compute its arguments and output channels."""
    channels: list        # output channels of each 'from' layer
    repeats: int          # depth-scaled `number`
    width: float          # width_multiple
    detect_outputs: int   # na * (nc + 5): a channel count that is never width-scaled


class SameChannels:
    """Rows whose output has the input's channels; args pass through unchanged."""

    @classmethod
    def yaml_args(cls, args: list, row: RowInputs):
        return list(args), row.channels[0], row.repeats


class ScaledChannels:
    """Conv-like rows: args[0] is the output channels (width-scaled), c_in is prepended."""
    repeats_inside = False  # True: `number` becomes the block's own n argument (C3, BottleneckCSP, ...)

    @classmethod
    def yaml_args(cls, args: list, row: RowInputs):
        if len(row.channels) != 1:
            raise ValueError(f"{cls.__name__} takes exactly one input layer")
        if not args or not isinstance(args[0], int):
            raise ValueError(f"{cls.__name__} needs output channels as its first argument")
        c_out = args[0] if args[0] == row.detect_outputs else make_divisible(args[0] * row.width, 8)
        out = [row.channels[0], c_out, *args[1:]]
        repeats = row.repeats
        if cls.repeats_inside:
            out.insert(2, repeats)
            repeats = 1
        return out, c_out, repeats


class Conv(ScaledChannels, nn.Module):
    """Conv2d (no bias) -> BatchNorm2d -> activation; fuse() folds the BN into the conv."""

    def __init__(self, c1, c2, k=1, s=1, p=None, g=1, d=1, act=True):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, autopad(k, p, d), groups=g, dilation=d, bias=False)
        self.bn = BatchNorm2d(c2)
        if act is True:
            self.act = _DEFAULT_ACTIVATION.get() or nn.SiLU()
        else:
            self.act = act if isinstance(act, nn.Module) else nn.Identity()

    fused_silu = False  # models.fused.fuse_silu sets it on folded CPU inference copies

    def forward(self, x):
        if (self.fused_silu and x.device.type == "cpu" and x.dtype == torch.float32
                and not torch.is_autocast_enabled("cpu") and not torch.jit.is_tracing()):  # traced: two plain ops
            return conv_silu(self.conv, x)
        x = self.conv(x)
        if self.bn is not None and self.bn.training and bn_silu_usable(x, self.bn, self.act):
            return bn_silu(x, self.bn)
        if self.bn is not None:
            x = self.bn(x)
        return self.act(x)


def conv_silu(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """silu(conv(x)) in one oneDNN call (the activation applied as the convolution writes its output):
    one pass over the output instead of two. fp32 CPU inference only (bf16 autocast keeps the two-op
    path, whose rounding exported models share); models.fused.fuse_silu checks it against the two-op path
    before switching it on."""
    return torch.ops.mkldnn._convolution_pointwise(x, conv.weight, conv.bias, list(conv.padding), list(conv.stride),
                                                   list(conv.dilation), conv.groups, "swish", [], "")


class DWConv(Conv):
    """Depth-wise convolution (groups = gcd(c1, c2))."""

    def __init__(self, c1, c2, k=1, s=1, d=1, act=True):
        super().__init__(c1, c2, k, s, g=math.gcd(c1, c2), d=d, act=act)


class DWConvTranspose2d(ScaledChannels, nn.ConvTranspose2d):
    """Depth-wise transposed convolution (groups = gcd(c1, c2), with a bias, no BatchNorm or activation)."""

    def __init__(self, c1, c2, k=1, s=1, p1=0, p2=0):
        super().__init__(c1, c2, k, s, p1, p2, groups=math.gcd(c1, c2))


class MixConv2d(ScaledChannels, nn.Module):
    """Mixed depth-wise convolution (MixConv, arXiv:1907.09595): the output channels split among one convolution
    per kernel size in ``k``, concatenated, then BatchNorm and SiLU. ``equal_ch``: about as many channels per kernel
    (YOLOv5's split: channel i goes to kernel floor(i * (n - 1e-6) / (c2 - 1)), in float32); otherwise about as many
    weights per kernel (channels inversely proportional to k squared, rounded)."""

    def __init__(self, c1, c2, k=(1, 3), s=1, equal_ch=True):
        super().__init__()
        kernels = [k] if isinstance(k, int) else list(k)
        if not kernels or any(not isinstance(size, int) or size < 1 or size % 2 == 0 for size in kernels):
            raise ValueError(f"MixConv2d kernel sizes must be odd positive integers, not {k}")
        if c2 < len(kernels):
            raise ValueError(f"MixConv2d needs at least one output channel per kernel ({c2} for {len(kernels)})")
        split = self.channel_split(c2, kernels, equal_ch)
        if sum(split) != c2 or min(split) < 1:
            raise ValueError(f"MixConv2d cannot split {c2} channels among kernels {kernels} with equal weights "
                             f"(rounded: {split})")
        self.m = nn.ModuleList(nn.Conv2d(c1, channels, size, s, size // 2, groups=math.gcd(c1, channels), bias=False)
                               for size, channels in zip(kernels, split))
        self.bn = BatchNorm2d(c2)
        self.act = nn.SiLU()

    @staticmethod
    def channel_split(c2: int, kernels: list, equal_ch: bool = True) -> list:
        """Output channels of each kernel's convolution."""
        n = len(kernels)
        if equal_ch:
            group = torch.linspace(0, n - 1e-6, c2, device="cpu").floor()  # also while building on "meta"
            return [int((group == g).sum()) for g in range(n)]
        # c_g * k_g^2 equal for every g (each kernel's weights), the c_g summing to c2: solved by least squares and
        # rounded as YOLOv5 does, so that a value at .5 rounds the same way (its checkpoints' shapes)
        weights = np.array(kernels, dtype=np.float64) ** 2
        system = np.zeros((n + 1, n))
        system[0] = 1
        for g in range(n):  # row g + 1: c_g k_g^2 - c_(g+1) k_(g+1)^2 = 0, the last row back to the first kernel
            system[g + 1, g] += weights[g]
            system[g + 1, (g + 1) % n] -= weights[(g + 1) % n]
        solution = np.linalg.lstsq(system, np.array([c2] + [0] * n, dtype=np.float64), rcond=None)[0]
        return [int(value) for value in solution.round()]

    def forward(self, x):
        return self.act(self.bn(torch.cat([conv(x) for conv in self.m], 1)))


class TransformerLayer(nn.Module):
    """Multi-head self-attention and a linear feed-forward, LayerNorm removed (as YOLOv5)."""

    def __init__(self, c, num_heads):
        super().__init__()
        self.q = nn.Linear(c, c, bias=False)
        self.k = nn.Linear(c, c, bias=False)
        self.v = nn.Linear(c, c, bias=False)
        self.ma = nn.MultiheadAttention(embed_dim=c, num_heads=num_heads)
        self.fc1 = nn.Linear(c, c, bias=False)
        self.fc2 = nn.Linear(c, c, bias=False)

    def forward(self, x):
        x = self.ma(self.q(x), self.k(x), self.v(x))[0] + x
        return self.fc2(self.fc1(x)) + x


class TransformerBlock(nn.Module):
    """Vision-transformer style block over the flattened feature map, with a learned position term."""

    def __init__(self, c1, c2, num_heads, num_layers):
        super().__init__()
        self.conv = Conv(c1, c2) if c1 != c2 else None
        self.linear = nn.Linear(c2, c2)
        self.tr = nn.Sequential(*(TransformerLayer(c2, num_heads) for _ in range(num_layers)))
        self.c2 = c2

    def forward(self, x):
        if self.conv is not None:
            x = self.conv(x)
        batch, _, height, width = x.shape
        tokens = x.flatten(2).permute(2, 0, 1)
        return self.tr(tokens + self.linear(tokens)).permute(1, 2, 0).reshape(batch, self.c2, height, width)


class Bottleneck(ScaledChannels, nn.Module):
    """1x1 then 3x3 conv, with a residual add when shapes allow."""

    def __init__(self, c1, c2, shortcut=True, g=1, e=0.5):
        super().__init__()
        hidden = int(c2 * e)
        self.cv1 = Conv(c1, hidden, 1, 1)
        self.cv2 = Conv(hidden, c2, 3, 1, g=g)
        self.add = shortcut and c1 == c2

    def forward(self, x):
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class BottleneckCSP(ScaledChannels, nn.Module):
    """CSP bottleneck (https://github.com/WongKinYiu/CrossStagePartialNetworks)."""
    repeats_inside = True

    def __init__(self, c1, c2, n=1, shortcut=True, g=1, e=0.5):
        super().__init__()
        hidden = int(c2 * e)
        self.cv1 = Conv(c1, hidden, 1, 1)
        self.cv2 = nn.Conv2d(c1, hidden, 1, 1, bias=False)
        self.cv3 = nn.Conv2d(hidden, hidden, 1, 1, bias=False)
        self.cv4 = Conv(2 * hidden, c2, 1, 1)
        self.bn = BatchNorm2d(2 * hidden)
        self.act = nn.SiLU()
        self.m = nn.Sequential(*(Bottleneck(hidden, hidden, shortcut, g, e=1.0) for _ in range(n)))

    def forward(self, x):
        y1 = self.cv3(self.m(self.cv1(x)))
        y2 = self.cv2(x)
        return self.cv4(self.act(self.bn(torch.cat((y1, y2), 1))))


class CrossConv(ScaledChannels, nn.Module):
    """(1 x k) then (k x 1) convolution, optional residual."""

    def __init__(self, c1, c2, k=3, s=1, g=1, e=1.0, shortcut=False):
        super().__init__()
        hidden = int(c2 * e)
        self.cv1 = Conv(c1, hidden, (1, k), (1, s))
        self.cv2 = Conv(hidden, c2, (k, 1), (s, 1), g=g)
        self.add = shortcut and c1 == c2

    def forward(self, x):
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C3(ScaledChannels, nn.Module):
    """CSP bottleneck with three convolutions."""
    repeats_inside = True

    def __init__(self, c1, c2, n=1, shortcut=True, g=1, e=0.5):
        super().__init__()
        hidden = int(c2 * e)
        self.cv1 = Conv(c1, hidden, 1, 1)
        self.cv2 = Conv(c1, hidden, 1, 1)
        self.cv3 = Conv(2 * hidden, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(hidden, hidden, shortcut, g, e=1.0) for _ in range(n)))

    def forward(self, x):
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class C3x(C3):
    """C3 with cross convolutions."""

    def __init__(self, c1, c2, n=1, shortcut=True, g=1, e=0.5):
        super().__init__(c1, c2, n, shortcut, g, e)
        hidden = int(c2 * e)
        self.m = nn.Sequential(*(CrossConv(hidden, hidden, 3, 1, g, 1.0, shortcut) for _ in range(n)))


class C3TR(C3):
    """C3 with a TransformerBlock (4 heads, n layers) in place of the bottlenecks."""

    def __init__(self, c1, c2, n=1, shortcut=True, g=1, e=0.5):
        super().__init__(c1, c2, n, shortcut, g, e)
        hidden = int(c2 * e)
        self.m = TransformerBlock(hidden, hidden, 4, n)


class C3SPP(C3):
    """C3 with an SPP block inside."""
    repeats_inside = False

    def __init__(self, c1, c2, k=(5, 9, 13), n=1, shortcut=True, g=1, e=0.5):
        super().__init__(c1, c2, n, shortcut, g, e)
        hidden = int(c2 * e)
        self.m = SPP(hidden, hidden, k)


class C3Ghost(C3):
    """C3 with Ghost bottlenecks."""

    def __init__(self, c1, c2, n=1, shortcut=True, g=1, e=0.5):
        super().__init__(c1, c2, n, shortcut, g, e)
        hidden = int(c2 * e)
        self.m = nn.Sequential(*(GhostBottleneck(hidden, hidden) for _ in range(n)))


class SPP(ScaledChannels, nn.Module):
    """Spatial pyramid pooling (YOLOv3-SPP)."""

    def __init__(self, c1, c2, k=(5, 9, 13)):
        super().__init__()
        hidden = c1 // 2
        self.cv1 = Conv(c1, hidden, 1, 1)
        self.cv2 = Conv(hidden * (len(k) + 1), c2, 1, 1)
        self.m = nn.ModuleList(nn.MaxPool2d(kernel_size=size, stride=1, padding=size // 2) for size in k)

    def forward(self, x):
        x = self.cv1(x)
        return self.cv2(torch.cat([x] + [pool(x) for pool in self.m], 1))


class SPPF(ScaledChannels, nn.Module):
    """Fast SPP: three chained k x k max-pools, equivalent to SPP(k=(5, 9, 13)) for k=5."""

    def __init__(self, c1, c2, k=5):
        super().__init__()
        hidden = c1 // 2
        self.cv1 = Conv(c1, hidden, 1, 1)
        self.cv2 = Conv(hidden * 4, c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)

    def forward(self, x):
        x = self.cv1(x)
        y1 = self.m(x)
        y2 = self.m(y1)
        return self.cv2(torch.cat((x, y1, y2, self.m(y2)), 1))


class Focus(ScaledChannels, nn.Module):
    """Space-to-depth (x(b,c,w,h) -> y(b,4c,w/2,h/2)) then a Conv."""

    def __init__(self, c1, c2, k=1, s=1, p=None, g=1, act=True):
        super().__init__()
        self.conv = Conv(c1 * 4, c2, k, s, p, g, act=act)

    def forward(self, x):
        return self.conv(torch.cat((x[..., ::2, ::2], x[..., 1::2, ::2], x[..., ::2, 1::2], x[..., 1::2, 1::2]), 1))


class GhostConv(ScaledChannels, nn.Module):
    """Ghost convolution (https://github.com/huawei-noah/ghostnet)."""

    def __init__(self, c1, c2, k=1, s=1, g=1, act=True):
        super().__init__()
        hidden = c2 // 2
        self.cv1 = Conv(c1, hidden, k, s, None, g, act=act)
        self.cv2 = Conv(hidden, hidden, 5, 1, None, hidden, act=act)

    def forward(self, x):
        y = self.cv1(x)
        return torch.cat((y, self.cv2(y)), 1)


class GhostBottleneck(ScaledChannels, nn.Module):
    """Ghost bottleneck: GhostConv, optional depth-wise stride-2 conv, GhostConv, plus a shortcut."""

    def __init__(self, c1, c2, k=3, s=1):
        super().__init__()
        hidden = c2 // 2
        self.conv = nn.Sequential(
            GhostConv(c1, hidden, 1, 1),
            DWConv(hidden, hidden, k, s, act=False) if s == 2 else nn.Identity(),
            GhostConv(hidden, c2, 1, 1, act=False))
        self.shortcut = (nn.Sequential(DWConv(c1, c1, k, s, act=False), Conv(c1, c2, 1, 1, act=False))
                         if s == 2 else nn.Identity())

    def forward(self, x):
        return self.conv(x) + self.shortcut(x)


class Contract(nn.Module):
    """Width/height into channels: (b, c, h, w) -> (b, c*g*g, h/g, w/g)."""

    def __init__(self, gain=2):
        super().__init__()
        self.gain = gain

    @classmethod
    def yaml_args(cls, args: list, row: RowInputs):
        gain = args[0] if args else 2
        return list(args), row.channels[0] * gain ** 2, row.repeats

    def forward(self, x):
        b, c, h, w = x.shape
        g = self.gain
        x = x.view(b, c, h // g, g, w // g, g).permute(0, 3, 5, 1, 2, 4).contiguous()
        return x.view(b, c * g * g, h // g, w // g)


class Expand(nn.Module):
    """Channels into width/height: (b, c, h, w) -> (b, c/(g*g), h*g, w*g)."""

    def __init__(self, gain=2):
        super().__init__()
        self.gain = gain

    @classmethod
    def yaml_args(cls, args: list, row: RowInputs):
        gain = args[0] if args else 2
        return list(args), row.channels[0] // gain ** 2, row.repeats

    def forward(self, x):
        b, c, h, w = x.shape
        g = self.gain
        x = x.view(b, g, g, c // g ** 2, h, w).permute(0, 3, 4, 1, 5, 2).contiguous()
        return x.view(b, c // g ** 2, h * g, w * g)


class Concat(nn.Module):
    """Concatenate a list of tensors along ``dimension``."""

    def __init__(self, dimension=1):
        super().__init__()
        self.d = dimension

    @classmethod
    def yaml_args(cls, args: list, row: RowInputs):
        return list(args), sum(row.channels), row.repeats

    def forward(self, x):
        return torch.cat(x, self.d)


class Upsample(nn.Upsample):
    """``nn.Upsample`` (the YAML's ``nn.Upsample``), whose nearest mode keeps its input's dtype under CUDA's autocast.

    CUDA's autocast runs ``upsample_nearest2d`` in float32: in a fp16 step each of the head's two upsamplings copied
    its input to float32 and wrote float32, the concatenation after it was float32, and both 1x1 convolutions of the
    C3 reading it cast it back to fp16, with the same casts again in the backward (2.7 GB of a yolov5s forward's 27.5
    at batch 64 and 640: benchmarks/cuda_forward_ops.py). Nearest upsampling copies values, so the forward is the same
    to the bit; in the backward the two gradients reaching such a concatenation are added in fp16 instead of float32,
    as every other tensor read by two layers already has its gradients added in its dtype (a C3's input in the
    backbone). The CPU's autocast does not cast it, and the CPU runs torch's forward as before. Other modes keep
    autocast's policy."""

    def forward(self, x):
        if self.mode == "nearest" and x.is_cuda and torch.is_autocast_enabled("cuda"):
            with torch.autocast("cuda", enabled=False):
                return super().forward(x)
        return super().forward(x)


class BatchNormRow:
    """YAML rule for nn.BatchNorm2d: its only argument is the input channels."""

    @classmethod
    def yaml_args(cls, args: list, row: RowInputs):
        return [row.channels[0]], row.channels[0], row.repeats


def fuse_conv_and_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A Conv2d (with bias) computing bn(conv(x)) in eval mode."""
    fused = nn.Conv2d(conv.in_channels, conv.out_channels, kernel_size=conv.kernel_size, stride=conv.stride,
                      padding=conv.padding, dilation=conv.dilation, groups=conv.groups, bias=True)
    fused = fused.requires_grad_(False).to(device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        weight, bias = folded_batchnorm(conv, bn)
        fused.weight.copy_(weight)
        fused.bias.copy_(bias)
    return fused


def folded_batchnorm(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of one convolution computing bn(conv(x)) with the BN's running statistics."""
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    conv_bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
    return conv.weight * scale.view(-1, 1, 1, 1), (conv_bias - bn.running_mean) * scale + bn.bias


def __getattr__(name: str):
    """``from models.common import DetectMultiBackend`` (or ``AutoShape``: YOLOv5's path, for scripts written against
    it) loads models/multibackend.py then, never when the layers are imported."""
    if name in ("DetectMultiBackend", "AutoShape"):
        import models.multibackend

        return getattr(models.multibackend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
