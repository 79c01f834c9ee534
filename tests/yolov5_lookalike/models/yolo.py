"""Look-alikes of YOLOv5 v7's Detect head and DetectionModel, with a small model-YAML parser."""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

from models.common import C3, SPPF, Concat, Conv

STRIDE_PROBE = 256  # side of the blank image whose output sizes give the strides


class Detect(nn.Module):
    """One 1x1 conv per level. Training: raw maps (bs, na, ny, nx, no). Eval: (decoded rows, raw maps),
    rows ``cx, cy, w, h`` in input pixels, objectness, class scores (all after the sigmoid)."""
    stride = None

    def __init__(self, nc=80, anchors=(), ch=(), inplace=True):
        super().__init__()
        self.nc = nc
        self.no = nc + 5
        self.nl = len(anchors)
        self.na = len(anchors[0]) // 2
        self.grid = [torch.empty(0) for _ in range(self.nl)]
        self.anchor_grid = [torch.empty(0) for _ in range(self.nl)]
        self.register_buffer("anchors", torch.tensor(anchors).float().view(self.nl, -1, 2))  # pixels, then grid units
        self.m = nn.ModuleList(nn.Conv2d(c, self.no * self.na, 1) for c in ch)
        self.inplace = inplace

    def forward(self, x):
        rows = []
        for level in range(self.nl):
            x[level] = self.m[level](x[level])
            batch, _, ny, nx = x[level].shape
            x[level] = x[level].view(batch, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
            if not self.training:
                self.grid[level], self.anchor_grid[level] = self.make_grid(nx, ny, level)
                xy, wh, scores = x[level].sigmoid().split((2, 2, self.nc + 1), 4)
                xy = (xy * 2 + self.grid[level]) * self.stride[level]
                wh = (wh * 2) ** 2 * self.anchor_grid[level]
                rows.append(torch.cat((xy, wh, scores), 4).view(batch, -1, self.no))
        return x if self.training else (torch.cat(rows, 1), x)

    def make_grid(self, nx, ny, level):
        """Cell offsets (cell corner - 0.5) and anchor sizes in pixels, both (1, na, ny, nx, 2)."""
        anchors = self.anchors[level]
        ys, xs = torch.meshgrid(torch.arange(ny, dtype=anchors.dtype), torch.arange(nx, dtype=anchors.dtype),
                                indexing="ij")
        grid = torch.stack((xs, ys), 2).expand(1, self.na, ny, nx, 2) - 0.5
        anchor_grid = (anchors * self.stride[level]).view(1, self.na, 1, 1, 2).expand(1, self.na, ny, nx, 2)
        return grid, anchor_grid


class DetectionModel(nn.Module):
    def __init__(self, cfg: dict, ch: int = 3, nc: int | None = None):
        super().__init__()
        self.yaml = copy.deepcopy(cfg)
        self.yaml["ch"] = ch
        if nc is not None:
            self.yaml["nc"] = nc
        self.model, self.save = parse_model(copy.deepcopy(self.yaml), [ch])
        self.names = [str(index) for index in range(self.yaml["nc"])]
        self.inplace = self.yaml.get("inplace", True)
        detect = self.model[-1]
        detect.inplace = self.inplace
        detect.stride = torch.tensor([STRIDE_PROBE / out.shape[-3] for out in self.forward(
            torch.zeros(1, ch, STRIDE_PROBE, STRIDE_PROBE))])
        detect.anchors /= detect.stride.view(-1, 1, 1)
        self.stride = detect.stride

    def _apply(self, fn, *args, **kwargs):
        """As YOLOv5 does: .half() / .to() also convert the head's stride and cached grids (plain
        attributes, not buffers); the model-level stride keeps its dtype."""
        self = super()._apply(fn, *args, **kwargs)
        detect = self.model[-1]
        detect.stride = fn(detect.stride)
        detect.grid = [fn(grid) for grid in detect.grid]
        detect.anchor_grid = [fn(grid) for grid in detect.anchor_grid]
        return self

    def forward(self, x):
        kept = []
        for layer in self.model:
            if layer.f != -1:
                x = kept[layer.f] if isinstance(layer.f, int) else [x if j == -1 else kept[j] for j in layer.f]
            x = layer(x)
            kept.append(x if layer.i in self.save else None)
        return x


def make_divisible(value: float, divisor: int = 8) -> int:
    return math.ceil(value / divisor) * divisor


BLOCKS = {"Conv": Conv, "C3": C3, "SPPF": SPPF, "Concat": Concat, "Detect": Detect, "nn.Upsample": nn.Upsample}


def parse_model(config: dict, ch: list[int]) -> tuple[nn.Sequential, list[int]]:
    """The layers of a YOLOv5 model YAML (rows ``[from, number, module, args]``), scaled by
    depth_multiple / width_multiple, each tagged with i (index), f (from), type and np (parameters)."""
    nc, anchors = config["nc"], config["anchors"]
    outputs = (len(anchors[0]) // 2) * (nc + 5)
    symbols = {"nc": nc, "anchors": anchors, "None": None}
    layers, save = [], []
    for index, (source, number, name, args) in enumerate(config["backbone"] + config["head"]):
        args = [symbols.get(a, a) if isinstance(a, str) else a for a in args]
        number = max(round(number * config["depth_multiple"]), 1) if number > 1 else number
        if name in ("Conv", "C3", "SPPF"):
            c1, c2 = ch[source], args[0]
            c2 = make_divisible(c2 * config["width_multiple"]) if c2 != outputs else c2
            args = [c1, c2, *args[1:]]
            if name == "C3":
                args.insert(2, number)
                number = 1
        elif name == "Concat":
            c2 = sum(ch[j] for j in source)
        elif name == "Detect":
            args.append([ch[j] for j in source])
        else:
            c2 = ch[source]
        block = BLOCKS[name]
        layer = nn.Sequential(*(block(*args) for _ in range(number))) if number > 1 else block(*args)
        layer.i, layer.f, layer.type = index, source, f"{block.__module__}.{block.__name__}"
        layer.np = sum(p.numel() for p in layer.parameters())
        save.extend(j % index for j in ([source] if isinstance(source, int) else source) if j != -1)
        layers.append(layer)
        if index == 0:
            ch = []
        ch.append(c2)
    return nn.Sequential(*layers), sorted(save)
