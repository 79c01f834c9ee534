"""YOLOv5 detection model: Detect head, DetectionModel and the YAML parser.

Module names in a model YAML resolve through ``MODULES`` (no eval). String arguments are resolved
by a tiny parser: the symbols ``nc``, ``anchors``, ``None``, ``True``, ``False``, numeric literals
and calls of allow-listed constructors with literal arguments, such as ``nn.LeakyReLU(0.1)``.

Every value is bounded before anything is built (``models.bounds``: nc, depth/width multiples, rows,
repeats, channels, other numeric arguments such as kernel sizes, anchors positive and finite), a
shape-only build on the meta device counts parameters and modules first, and the stride probe runs
under ``models.activation_budget.ActivationBudget``, so a YAML (or the YAML dict inside a checkpoint) cannot make
the build run for minutes or exhaust memory.
"""
from __future__ import annotations

import ast
import logging
import math
import sys
from copy import deepcopy
from pathlib import Path

if __name__ == "__main__" and str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # python models/yolo.py: the project's packages

import torch
from torch import nn

from models.bounds import (REQUIRED_KEYS, check_anchors, check_arguments, check_config, check_nc, is_count,
                           scaled_repeats)
from models.activation_budget import MAX_PROBE_VALUES, ActivationBudget
from models.common import (C3, C3SPP, C3TR, SPP, SPPF, BatchNormRow, Bottleneck, BottleneckCSP, C3Ghost, C3x,
                           Concat, Contract, Conv, CrossConv, DWConv, DWConvTranspose2d, Expand, Focus,
                           GhostBottleneck, GhostConv, MixConv2d, RowInputs, SameChannels, ScaledChannels, Upsample,
                           default_activation, fuse_conv_and_bn)
from utils.errors import UserError, shorten
from utils.limits import MAX_ARGUMENT, MAX_CHANNELS, MAX_MODEL_MODULES, MAX_PARAMETERS, MAX_REPEATS
from utils.safe_yaml import read_yaml_as

LOGGER = logging.getLogger(__name__)
MODELS_DIR = Path(__file__).resolve().parent
ACTIVATIONS = {f"nn.{cls.__name__}": cls for cls in (nn.SiLU, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardswish,
                                                     nn.Mish, nn.GELU, nn.ELU, nn.Sigmoid, nn.Tanh, nn.Identity)}
MAX_SYMBOL_LENGTH = 200  # characters of a string argument that is parsed (e.g. "nn.LeakyReLU(0.1)")


class ModelConfigError(UserError):
    """A model YAML that cannot be built; the message names the file, the row and the problem."""


class Detect(nn.Module):
    """Per-level 1x1 convs to na * (5 + nc) outputs; decodes boxes in eval mode."""
    checks_own_arguments = True  # nc and anchors have their own bounds (check_nc, check_anchors)

    @classmethod
    def yaml_args(cls, args: list, row: RowInputs):
        args = list(args)
        if len(args) < 2:
            raise ValueError("Detect needs [nc, anchors]")
        check_nc(args[0])
        check_anchors(args[1])
        if isinstance(args[1], int):  # anchors per level, computed later by AutoAnchor
            args[1] = [list(range(args[1] * 2))] * len(row.channels)
        return [args[0], args[1], list(row.channels)], row.channels[0], row.repeats

    def __init__(self, nc=80, anchors=(), ch=()):
        super().__init__()
        anchors = [list(level) for level in anchors]
        if not anchors or len({len(level) for level in anchors}) != 1 or len(anchors[0]) % 2:
            raise ValueError("anchors must be equal-length lists of (w, h) pairs, one list per level")
        if len(anchors) != len(ch):
            raise ValueError(f"{len(anchors)} anchor levels but {len(ch)} input layers")
        self.nc = nc
        self.no = nc + 5
        self.nl = len(anchors)
        self.na = len(anchors[0]) // 2
        self.register_buffer("anchors", torch.tensor(anchors, dtype=torch.float32).view(self.nl, -1, 2))
        self.register_buffer("stride", torch.ones(self.nl), persistent=False)
        self.m = nn.ModuleList(nn.Conv2d(c, self.no * self.na, 1) for c in ch)
        self._grids = [torch.empty(0)] * self.nl

    def forward(self, x):
        x = list(x) if isinstance(x, (list, tuple)) else [x]  # 'from' may name a single layer
        decoded = []
        for i in range(self.nl):
            x[i] = self.m[i](x[i])
            batch, _, ny, nx = x[i].shape
            x[i] = x[i].view(batch, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
            if not self.training:
                decoded.append(self._decode(x[i], i).view(batch, -1, self.no))
        return x if self.training else (torch.cat(decoded, 1), x)

    def _decode(self, raw, i):
        if raw.dtype == torch.bfloat16:  # bf16 autocast: its 8-bit mantissa steps by 2 px from 256 to 512
            raw = raw.float()
        ny, nx = raw.shape[2:4]
        grid = self._grid(ny, nx, i, raw)
        anchor_pixels = (self.anchors[i] * self.stride[i]).view(1, self.na, 1, 1, 2)
        xy, wh, conf = raw.sigmoid().split((2, 2, self.nc + 1), 4)
        xy = (xy * 2 + grid) * self.stride[i]
        wh = (wh * 2) ** 2 * anchor_pixels
        return torch.cat((xy, wh, conf), 4)

    def _grid(self, ny, nx, i, like):
        """Cell offsets minus 0.5, shape (1, 1, ny, nx, 2); cached per level, shape, device and dtype.

        While tracing (TorchScript / ONNX export) the grid is always built from the traced sizes and
        never cached: a cached grid would enter the trace as a constant of the example input's size.
        """
        if torch.jit.is_tracing():
            return self._make_grid(ny, nx, like)
        grid = self._grids[i]
        if grid.shape[2:4] != (ny, nx) or grid.device != like.device or grid.dtype != like.dtype:
            grid = self._grids[i] = self._make_grid(ny, nx, like)
        return grid

    @staticmethod
    def _make_grid(ny, nx, like):
        """Built in float32, then cast: the values (k - 0.5, k < 2048) are exact in fp16 too, and a Range in fp16
        breaks the ONNX exporter's constant folding ("tensor does not have a device", export --half on CUDA)."""
        y = torch.arange(ny, device=like.device, dtype=torch.float32)
        x = torch.arange(nx, device=like.device, dtype=torch.float32)
        yv, xv = torch.meshgrid(y, x, indexing="ij")
        return (torch.stack((xv, yv), 2) - 0.5).view(1, 1, ny, nx, 2).to(like.dtype)


# name in a YAML row -> (constructor, rule(args, RowInputs) -> (constructor args, c_out, repeats))
MODULES: dict = {}


def register_module(name: str, constructor, rule=None) -> None:
    """Make ``name`` usable in model YAMLs; ``rule`` defaults to ``constructor.yaml_args``."""
    MODULES[name] = (constructor, rule or constructor.yaml_args)


for _block in (Conv, DWConv, Bottleneck, BottleneckCSP, CrossConv, C3, C3x, C3TR, C3SPP, C3Ghost, SPP, SPPF,
               Focus, GhostConv, GhostBottleneck, Contract, Expand, Concat, MixConv2d, DWConvTranspose2d, Detect):
    register_module(_block.__name__, _block)
for _layer in (Upsample, nn.MaxPool2d, nn.ZeroPad2d, nn.Identity, nn.Dropout):  # Upsample: nn.Upsample's subclass
    register_module(f"nn.{_layer.__name__}", _layer, SameChannels.yaml_args)
register_module("nn.BatchNorm2d", nn.BatchNorm2d, BatchNormRow.yaml_args)
register_module("nn.ConvTranspose2d", nn.ConvTranspose2d, ScaledChannels.yaml_args)


class _Unresolved(Exception):
    """A string argument that is not an expression we evaluate: it stays a plain string."""


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise _Unresolved


def _literal(node, symbols: dict):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _literal(node.operand, symbols)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(element, symbols) for element in node.elts]
    if isinstance(node, ast.Name) and node.id in symbols:
        return symbols[node.id]
    if isinstance(node, ast.Call):
        name = _dotted(node.func)
        if name not in ACTIVATIONS:
            raise ValueError(f"'{name}' is not an allowed constructor (allowed: {', '.join(ACTIVATIONS)})")
        args = [_literal(a, {}) for a in node.args]
        kwargs = {k.arg: _literal(k.value, {}) for k in node.keywords}
        return ACTIVATIONS[name](*args, **kwargs)
    raise _Unresolved


def resolve_symbol(text: str, symbols: dict):
    """Value of a YAML string argument: a symbol, number or allowed constructor call, else the string."""
    if len(text) > MAX_SYMBOL_LENGTH:
        return text
    try:
        tree = ast.parse(text.strip(), mode="eval")
        return _literal(tree.body, {"None": None, "True": True, "False": False, **symbols})
    except (SyntaxError, _Unresolved):
        return text


def load_model_config(cfg) -> tuple[dict, str]:
    """(config dict, file name) from a dict or a YAML path (bare names also looked up in models/)."""
    if isinstance(cfg, dict):
        return deepcopy(cfg), cfg.get("yaml_file", "")
    path = Path(cfg)
    if not path.exists():
        for folder in (MODELS_DIR, MODELS_DIR / "hub"):
            if (folder / path.name).exists():
                path = folder / path.name
                break
    if not path.is_file():
        raise ModelConfigError(f"{cfg}: model YAML not found")
    data = read_yaml_as(path, ModelConfigError)
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: a model YAML must be a mapping with keys {', '.join(REQUIRED_KEYS)}")
    data["yaml_file"] = path.name
    return data, path.name


def _check_config(d: dict, source: str) -> None:
    """Bounds of the top-level keys (models.bounds), before any row is looked at."""
    try:
        check_config(d)
    except ValueError as error:
        raise ModelConfigError(f"{source}: {error}") from None


def _model_activation(d: dict, source: str) -> nn.Module:
    act = d.get("activation")
    if not act:
        return nn.SiLU()
    try:
        module = resolve_symbol(act, {}) if isinstance(act, str) else None
    except (ValueError, TypeError):
        module = None
    if not isinstance(module, nn.Module):
        raise ModelConfigError(f"{source}: activation {shorten(act)} is not an allowed constructor "
                               f"({', '.join(ACTIVATIONS)})")
    return module


def _check_row(row, index: int):
    """Validate the row shape; return (from list, number, module name, args)."""
    if not isinstance(row, list) or len(row) != 4:
        raise ValueError("expected [from, number, module, args]")
    origin, number, name, args = row
    origins = [origin] if isinstance(origin, int) and not isinstance(origin, bool) else origin
    if not isinstance(origins, list) or not 0 < len(origins) <= MAX_ARGUMENT or \
            not all(isinstance(j, int) for j in origins):
        raise ValueError(f"'from' must be an integer or a list of at most {MAX_ARGUMENT} integers, "
                         f"got {shorten(origin)}")
    for j in origins:
        if not (-index <= j < index) and not (index == 0 and j == -1):
            raise ValueError(f"'from' {shorten(j)} does not name an earlier layer")
    if not is_count(number, 1, MAX_REPEATS):
        raise ValueError(f"'number' must be a positive integer (at most {MAX_REPEATS}), got {shorten(number)}")
    if not isinstance(name, str) or name not in MODULES:
        raise ValueError(f"unknown module {shorten(name)} (known: {', '.join(sorted(MODULES))})")
    if not isinstance(args, list):
        raise ValueError(f"'args' must be a list, got {shorten(args)}")
    return origins, number, name, args


def _build_layer(name: str, args: list, inputs: RowInputs):
    """(module, output channels) for one row; constructor errors name the module."""
    constructor, rule = MODULES[name]
    args, c_out, repeats = rule(args, inputs)
    if not is_count(c_out, 1, MAX_CHANNELS):
        raise ValueError(f"{name} would output {shorten(c_out)} channels, outside [1, {MAX_CHANNELS}]")
    try:
        layer = (nn.Sequential(*(constructor(*args) for _ in range(repeats))) if repeats > 1
                 else constructor(*args))
    except (ValueError, TypeError, IndexError, RuntimeError) as error:
        raise ValueError(f"{name}{shorten(args, 120)} cannot be built: {shorten(str(error), 200)}") from None
    return layer, c_out


def parse_model(d: dict, ch: list, source: str = "model", on_layer=None):
    """Build (nn.Sequential of layers, sorted save indices) from a model config dict.

    ``on_layer(index, layer)``, when given, sees each layer as soon as it is built (the size check)."""
    _check_config(d, source)
    anchors, nc, depth, width = d["anchors"], d["nc"], d["depth_multiple"], d["width_multiple"]
    na = anchors if isinstance(anchors, int) else len(anchors[0]) // 2
    symbols = {"nc": nc, "anchors": anchors}
    rows = [("backbone", j, row) for j, row in enumerate(d["backbone"])] + \
           [("head", j, row) for j, row in enumerate(d["head"])]
    layers, save = [], []
    with default_activation(_model_activation(d, source)):
        for i, (section, j, row) in enumerate(rows):
            try:
                origins, number, name, args = _check_row(row, i)
                args = [resolve_symbol(a, symbols) if isinstance(a, str) else a for a in args]
                if not getattr(MODULES[name][0], "checks_own_arguments", False):
                    check_arguments(name, args)
                inputs = RowInputs([ch[k] for k in origins], scaled_repeats(number, depth), width, na * (nc + 5))
                layer, c_out = _build_layer(name, args, inputs)
            except (ValueError, TypeError, IndexError, RuntimeError) as error:
                message = str(error).splitlines()[0][:500] if str(error) else type(error).__name__
                raise ModelConfigError(f"{source}: layer {i} ({section} row {j}): {message}") from None
            if on_layer is not None:
                on_layer(i, layer)
            origin = row[0]
            layer.i, layer.f, layer.type = i, origin, name
            layer.np = sum(p.numel() for p in layer.parameters())
            save.extend(k % i for k in origins if k != -1)
            layers.append(layer)
            if i == 0:
                ch = []
            ch.append(c_out)
    return nn.Sequential(*layers), sorted(set(save))


class _SizeCount:
    """``on_layer`` for the meta build: counts parameters and modules, refuses past the limits."""

    def __init__(self, source: str):
        self.source, self.parameters, self.modules = source, 0, 0

    def __call__(self, index: int, layer: nn.Module) -> None:
        self.parameters += sum(p.numel() for p in layer.parameters())
        self.modules += sum(1 for _ in layer.modules())
        if self.parameters > MAX_PARAMETERS:
            raise ModelConfigError(f"{self.source}: more than {MAX_PARAMETERS / 1e6:.0f} M parameters by layer "
                                   f"{index} (yolov5x6 has 141 M)")
        if self.modules > MAX_MODEL_MODULES:
            raise ModelConfigError(f"{self.source}: more than {MAX_MODEL_MODULES} modules by layer {index}")


def check_model_size(d: dict, ch: int, source: str) -> None:
    """Build ``d`` on the meta device (shapes only: no memory, no random numbers drawn) and refuse it
    when its parameters or modules exceed MAX_PARAMETERS / MAX_MODEL_MODULES, before the real build."""
    with torch.device("meta"):
        parse_model(deepcopy(d), ch=[ch], source=source, on_layer=_SizeCount(source))


def _building_on_meta() -> bool:
    return torch.empty(0).device.type == "meta"


def check_anchor_order(detect: Detect) -> None:
    """Anchors (pixels) must grow with stride; flip the level order when they run the other way."""
    area = detect.anchors.prod(-1).mean(-1).view(-1)
    delta_area = area[-1] - area[0]
    delta_stride = detect.stride[-1] - detect.stride[0]
    if delta_area and delta_area.sign() != delta_stride.sign():
        LOGGER.info("Reversing anchor order to match strides")
        detect.anchors[:] = detect.anchors.flip(0)


INPLACE_ACTIVATIONS = (nn.Hardswish, nn.LeakyReLU, nn.ReLU, nn.ReLU6, nn.SiLU)  # the ones with an ``inplace`` switch


def initialize_weights(model: nn.Module) -> None:
    """YOLOv5's BatchNorm settings (eps 1e-3, momentum 0.03) and in-place activations."""
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eps = 1e-3
            module.momentum = 0.03
        elif isinstance(module, INPLACE_ACTIVATIONS):
            module.inplace = True


def activations_out_of_place(model: nn.Module) -> nn.Module:
    """Turn off ``initialize_weights``' in-place activations, for the model that trains.

    In place is right for inference (one pass over the BatchNorm's output, no new buffer), but when autograd
    records, an in-place activation whose backward needs its input makes it copy that input first: a clone
    plus the in-place pass, where out of place is one pass. The values and gradients are the same; the fp32
    training step of yolov5n on AVX2 kernels took 0.95x the time (192 and 320 px, batch 16, 2 cores).
    """
    for module in model.modules():
        if isinstance(module, INPLACE_ACTIVATIONS):
            module.inplace = False
    return model


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def count_flops(model: nn.Module, imgsz=640) -> float:
    """GFLOPs (2 x multiply-adds, as YOLOv5 reports) at ``imgsz``, counted with torch's FlopCounterMode
    on a stride-sized input and scaled by area. Returns 0.0 when counting is not possible."""
    from torch.utils.flop_counter import FlopCounterMode

    height, width = (imgsz, imgsz) if isinstance(imgsz, int) else imgsz
    stride = max(int(model.stride.max()), 32) if hasattr(model, "stride") else 32
    param = next(model.parameters())
    channels = model.yaml.get("ch", 3) if hasattr(model, "yaml") else 3
    image = torch.zeros(1, channels, stride, stride, device=param.device, dtype=param.dtype)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(image)
        return counter.get_total_flops() / 1e9 * (height / stride) * (width / stride)
    except RuntimeError as error:
        LOGGER.debug("FLOPs not counted: %s", error)
        return 0.0
    finally:
        model.train(was_training)


class DetectionModel(nn.Module):
    """YOLOv5 detector built from a model YAML (path or dict)."""

    def __init__(self, cfg="yolov5s.yaml", ch=3, nc=None, anchors=None):
        super().__init__()
        self.yaml, self.yaml_file = load_model_config(cfg)
        source = str(cfg) if not isinstance(cfg, dict) else (self.yaml_file or "model dict")
        ch = self.yaml["ch"] = self.yaml.get("ch", ch)
        if nc and nc != self.yaml.get("nc"):
            LOGGER.info("Overriding model.yaml nc=%s with nc=%s", shorten(self.yaml.get("nc")), nc)
            self.yaml["nc"] = nc
        if anchors:
            LOGGER.info("Overriding model.yaml anchors with anchors=%s", shorten(anchors))
            self.yaml["anchors"] = round(anchors) if isinstance(anchors, (int, float)) else anchors
        if not _building_on_meta():
            check_model_size(self.yaml, ch, source)
        self.model, self.save = parse_model(deepcopy(self.yaml), ch=[ch], source=source)
        self.names = [str(i) for i in range(self.yaml["nc"])]
        self.anchors_placeholder = isinstance(self.yaml["anchors"], int)  # AutoAnchor must set real ones
        detect = self.model[-1]
        if isinstance(detect, Detect):
            self._init_detect(detect, ch)
        initialize_weights(self)

    def _init_detect(self, detect: Detect, ch: int) -> None:
        """Strides from a probe forward pass, anchors to grid units, YOLOv5's output bias priors."""
        device = detect.anchors.device
        if device.type == "meta":  # shape-only build (e.g. counting parameters): nothing to compute
            return
        detect.stride.copy_(torch.tensor(self._probe_strides(ch, device), device=device))
        check_anchor_order(detect)
        detect.anchors /= detect.stride.view(-1, 1, 1)
        self._initialize_biases()

    def _probe_strides(self, ch: int, device) -> list:
        """Input size / output size of each Detect level, from the smallest square probe (64, 128,
        256, 512) whose every level is at least 2 cells high, so no level can be clamped. Each probe
        pass runs under an ActivationBudget, so a model that would need too much memory stops early."""
        name = self.yaml_file or "model"

        def exceeded(index, total):
            raise ModelConfigError(f"{name}: the probe forward pass would produce more than {total / 1e6:.0f} M "
                                   f"values by layer {index} (limit {MAX_PROBE_VALUES / 1e6:.0f} M)")

        self.eval()
        try:
            with ActivationBudget(self, exceeded) as budget:
                for size in (64, 128, 256, 512):
                    budget.reset()
                    try:
                        with torch.no_grad():
                            _, raw = self.forward(torch.zeros(1, ch, size, size, device=device))
                    except ModelConfigError:
                        raise
                    except (RuntimeError, ValueError, TypeError, IndexError) as error:  # e.g. a Concat of
                        # mismatched sizes: too small a probe
                        if size == 512:
                            raise ModelConfigError(f"{name}: forward pass fails "
                                                   f"({str(error).splitlines()[0][:300]})") from None
                        continue
                    if min(level.shape[2] for level in raw) >= 2:
                        break
            return [size / level.shape[2] for level in raw]
        finally:
            self.train()

    def _initialize_biases(self) -> None:
        detect = self.model[-1]
        with torch.no_grad():
            for conv, stride in zip(detect.m, detect.stride.tolist()):
                bias = conv.bias.view(detect.na, -1)
                bias[:, 4] += math.log(8 / (640 / stride) ** 2)  # about 8 objects per 640 image
                bias[:, 5:5 + detect.nc] += math.log(0.6 / (detect.nc - 0.99999))

    @property
    def stride(self) -> torch.Tensor:
        detect = self.model[-1]
        return detect.stride if isinstance(detect, Detect) else torch.tensor([32.0])

    def forward(self, x, augment: bool = False, profile: bool = False, visualize=False):
        """The layers on ``x``: training mode, each level's raw output; eval mode, ``(pred, raw)``. YOLOv5's
        ``augment``, ``profile`` and ``visualize`` (a folder): models/forward_options.py."""
        if augment or profile or visualize:
            from models.forward_options import forward_with

            return forward_with(self, x, augment, profile, visualize)
        outputs = []
        for layer in self.model:
            if layer.f != -1:
                x = outputs[layer.f] if isinstance(layer.f, int) else \
                    [x if j == -1 else outputs[j] for j in layer.f]
            x = layer(x)
            outputs.append(x if layer.i in self.save else None)
        return x

    def fuse(self, verbose: bool = True) -> DetectionModel:
        """Fold every Conv's BatchNorm into its convolution. The result is for inference only, so no
        parameter keeps requiring gradients (the summary then reports 0 gradients)."""
        for module in self.modules():
            if isinstance(module, Conv) and module.bn is not None:
                module.conv = fuse_conv_and_bn(module.conv, module.bn)
                module.bn = None
        self.requires_grad_(False)
        if verbose:
            LOGGER.info("Fused Conv + BatchNorm layers")
        return self

    def info(self, verbose: bool = False, img_size=640) -> str:
        """One summary line like YOLOv5's: layers, parameters, gradients, GFLOPs at ``img_size``; ``verbose``: each
        parameter's row first (models/model_cli.py)."""
        if verbose:
            from models.model_cli import parameter_table

            for line in parameter_table(self):
                LOGGER.info(line)
        name = Path(self.yaml_file).stem.replace("yolov5", "YOLOv5") if self.yaml_file else "Model"
        flops = count_flops(self, img_size)
        summary = (f"{name} summary: {len(list(self.modules()))} layers, {count_parameters(self)} parameters, "
                   f"{count_parameters(self, trainable_only=True)} gradients"
                   + (f", {flops:.1f} GFLOPs" if flops else ""))
        LOGGER.info(summary)
        return summary


Model = DetectionModel  # YOLOv5's alias


if __name__ == "__main__":  # python models/yolo.py --cfg yolov5n.yaml [--profile] [--line-profile] [--test]
    from models.model_cli import main

    sys.exit(main(DetectionModel))
