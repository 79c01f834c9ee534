"""Relative error of fp32 gradients against float64, NCHW against channels_last: yolov5n and its blocks.

    python benchmarks/check_channels_last_numerics.py                      # yolov5n, batch 8, 320
    python benchmarks/check_channels_last_numerics.py --blocks             # + each block on its own
    python benchmarks/check_channels_last_numerics.py --native-batchnorm   # torch's BatchNorm2d kernel throughout

One training-mode forward + backward of a randomly initialised model on random input, loss = sum of
the squared raw outputs (accumulated in float64). The error of a tensor is ||fp32 - fp64|| / ||fp64||;
the table gives its median and maximum over each parameter group. The reference is the same model
and input in float64, NCHW.

Measured on a 2-core AMD EPYC (Zen 4, AVX-512), torch 2.14.1, OMP_NUM_THREADS=1, yolov5n, batch 8, 320
(parameter-gradient error, median / max over the group):

    group (count)       NCHW                channels_last, torch's BN   channels_last, models.batchnorm
    all (177)           1.6e-5 / 3.8e-5     3.5e-3 / 1.1e-2             1.7e-5 / 3.8e-5
    conv.weight (57)    1.6e-5 / 3.8e-5     3.6e-3 / 4.9e-3             1.8e-5 / 3.8e-5
    bn.weight (57)      1.5e-5 / 3.5e-5     3.4e-3 / 7.0e-3             1.6e-5 / 3.4e-5
    bn.bias (57)        1.6e-5 / 2.9e-5     4.5e-3 / 1.1e-2             1.7e-5 / 2.9e-5
    detect (6)          1.5e-7 / 1.4e-6     1.6e-6 / 1.5e-5             1.5e-7 / 1.4e-6

With BatchNorm in eval mode (running statistics) the two layouts agree on the convolution weights
(4e-7 median both), and on their own Conv2d, SiLU, MaxPool2d, Upsample, Concat and Detect's
view/permute agree to <= 4e-6; a training-mode BatchNorm2d on 8 x 16 x 160 x 160 is off by 2.5e-5 in
channels_last against 6e-8 in NCHW (--blocks). The loss of precision is torch's training-mode BatchNorm
kernel for channels_last inputs, which models/batchnorm.py replaces.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from models.batchnorm import BatchNorm2d  # noqa: E402

VARIANTS = (("NCHW", False), ("channels_last", True))


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    scale = float(reference.norm())
    return float((value.double() - reference).norm()) / scale if scale else float((value.double()).norm())


def with_native_batchnorm(module: nn.Module) -> nn.Module:
    """The module with every models.batchnorm.BatchNorm2d turned back into torch's nn.BatchNorm2d (in place)."""
    for child in module.modules():
        if isinstance(child, BatchNorm2d):
            child.__class__ = nn.BatchNorm2d
    return module


def as_format(tensor: torch.Tensor, channels_last: bool) -> torch.Tensor:
    if tensor.dim() != 4:
        return tensor
    return tensor.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def flat_outputs(output) -> list:
    if isinstance(output, torch.Tensor):
        return [output]
    return [tensor for item in output for tensor in flat_outputs(item)]


def run_backward(module: nn.Module, inputs: list, dtype: torch.dtype, channels_last: bool, train: bool = True,
                 projections: list | None = None):
    """(outputs, input gradients, {parameter name: gradient}) for a copy of ``module``.

    The loss is sum(outputs ** 2) (the model check), or sum(outputs * projections) with fixed random
    projections for single blocks (a BatchNorm's sum of squares does not depend on its input).
    ``train=False`` is for a DetectionModel: eval-mode BatchNorm, loss on its raw outputs."""
    module = copy.deepcopy(module).to(dtype).train(train)
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    leaves = [as_format(x.to(dtype), channels_last).detach().requires_grad_(True) for x in inputs]
    output = module(*leaves)
    outputs = flat_outputs(output if train else output[1])
    if projections is None:
        loss = sum((out.double() ** 2).sum() for out in outputs)
    else:
        loss = sum((out.double() * weight).sum() for out, weight in zip(outputs, projections))
    loss.backward()
    grads = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
    return [o.detach() for o in outputs], [x.grad for x in leaves], grads


def compare(module: nn.Module, inputs: list, train: bool = True, project: bool = False) -> list:
    """Per layout: (layout, output error, input-gradient error, {parameter name: gradient error})."""
    projections = None
    if project:
        with torch.no_grad():
            shapes = [out.shape for out in flat_outputs(copy.deepcopy(module).double().train(train)(*inputs))]
        generator = torch.Generator().manual_seed(3)
        projections = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    ref_out, ref_in, ref_params = run_backward(module, inputs, torch.float64, False, train, projections)
    rows = []
    for layout, channels_last in VARIANTS:
        out, grad_in, params = run_backward(module, inputs, torch.float32, channels_last, train, projections)
        rows.append((layout, max(relative_error(a, b) for a, b in zip(out, ref_out)),
                     max(relative_error(a, b) for a, b in zip(grad_in, ref_in)),
                     {name: relative_error(params[name], ref_params[name]) for name in ref_params}))
    return rows


def parameter_group(name: str, detect_prefix: str) -> str:
    if name.startswith(detect_prefix):
        return "detect"
    for suffix in ("bn.weight", "bn.bias", "conv.weight"):
        if name.endswith(suffix):
            return suffix
    return "other"


def model_table(cfg: str, batch: int, imgsz: int, native: bool, train: bool = True) -> None:
    from models.yolo import DetectionModel

    torch.manual_seed(0)
    model = DetectionModel(cfg, nc=80)
    if native:
        with_native_batchnorm(model)
    images = torch.rand(batch, 3, imgsz, imgsz, generator=torch.Generator().manual_seed(1))
    detect_prefix = f"model.{len(model.model) - 1}."
    mode = "train" if train else "eval (running BN statistics)"
    print(f"\n{Path(cfg).stem}, batch {batch}, {imgsz}x{imgsz}, BatchNorm {mode}, "
          f"{'torch nn.BatchNorm2d' if native else 'models.batchnorm.BatchNorm2d'}: parameter-gradient error "
          "vs float64 (median / max)")
    print(f"{'group':>14s}{'count':>7s}" + "".join(f"{layout:>24s}" for layout, _ in VARIANTS))
    rows = compare(model, [images], train)
    groups = {}
    for name in rows[0][3]:
        groups.setdefault(parameter_group(name, detect_prefix), []).append(name)
    groups["all"] = list(rows[0][3])
    for group, names in groups.items():
        cells = [f"{statistics.median(r[3][n] for n in names):.1e} / {max(r[3][n] for n in names):.1e}" for r in rows]
        print(f"{group:>14s}{len(names):>7d}" + "".join(f"{cell:>24s}" for cell in cells))


class ListInput(nn.Module):
    """Calls ``block`` with its inputs as one list (Concat, Detect)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *inputs):
        return self.block(list(inputs))


class ConcatConv(nn.Module):
    def __init__(self, c1: int, c2: int):
        super().__init__()
        from models.common import Concat, Conv
        self.cat, self.conv = Concat(1), Conv(c1 * 2, c2, 1, 1)

    def forward(self, a, b):
        return self.conv(self.cat([a, b]))


def block_cases(batch: int, imgsz: int) -> list:
    """(name, module, input shapes): yolov5n's blocks at their sizes for ``imgsz``, plus single layers."""
    from models.common import C3, SPPF, Concat, Conv
    from models.yolo import Detect

    s = imgsz
    anchors = [[10, 13, 16, 30, 33, 23], [30, 61, 62, 45, 59, 119], [116, 90, 156, 198, 373, 326]]
    return [
        ("BatchNorm2d train (model's)", BatchNorm2d(16), [(batch, 16, s // 2, s // 2)]),
        ("nn.BatchNorm2d train (torch)", nn.BatchNorm2d(16), [(batch, 16, s // 2, s // 2)]),
        ("Conv2d 3x3 s2", nn.Conv2d(16, 32, 3, 2, 1, bias=False), [(batch, 16, s // 2, s // 2)]),
        ("SiLU", nn.SiLU(), [(batch, 32, s // 4, s // 4)]),
        ("MaxPool2d k5 (SPPF)", nn.MaxPool2d(5, 1, 2), [(batch, 128, s // 32, s // 32)]),
        ("Upsample nearest x2", nn.Upsample(None, 2, "nearest"), [(batch, 128, s // 32, s // 32)]),
        ("Concat", ListInput(Concat(1)), [(batch, 64, s // 16, s // 16)] * 2),
        ("Concat + Conv 1x1", ConcatConv(64, 64), [(batch, 64, s // 16, s // 16)] * 2),
        ("Conv k6 s2 (first layer)", Conv(3, 16, 6, 2, 2), [(batch, 3, s, s)]),
        ("C3 32ch n=1", C3(32, 32, 1), [(batch, 32, s // 4, s // 4)]),
        ("SPPF 256ch", SPPF(256, 256, 5), [(batch, 256, s // 32, s // 32)]),
        ("Detect (view/permute)", ListInput(Detect(80, anchors, (64, 128, 256))),
         [(batch, 64, s // 8, s // 8), (batch, 128, s // 16, s // 16), (batch, 256, s // 32, s // 32)]),
    ]


def blocks_table(batch: int, imgsz: int, native: bool) -> None:
    print(f"\nBlocks in training mode, batch {batch} at yolov5n's sizes for {imgsz}: error vs float64 "
          "(output, input gradient, parameter gradients max)")
    print(f"{'block':>28s}" + "".join(f"{layout:>36s}" for layout, _ in VARIANTS))
    for name, module, shapes in block_cases(batch, imgsz):
        if native:
            with_native_batchnorm(module)
        generator = torch.Generator().manual_seed(2)
        inputs = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
        rows = compare(module, inputs, project=True)
        cells = [f"{out:.1e} {grad:.1e} {max(params.values(), default=0.0):.1e}" for _, out, grad, params in rows]
        print(f"{name:>28s}" + "".join(f"{cell:>36s}" for cell in cells))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cfg", default=str(ROOT / "models" / "yolov5n.yaml"))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--imgsz", type=int, default=320)
    parser.add_argument("--blocks", action="store_true", help="also each block on its own, and eval-mode BatchNorm")
    parser.add_argument("--native-batchnorm", action="store_true",
                        help="torch's nn.BatchNorm2d kernel everywhere (the numbers before models/batchnorm.py)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    model_table(args.cfg, args.batch_size, args.imgsz, args.native_batchnorm)
    if args.blocks:
        model_table(args.cfg, args.batch_size, args.imgsz, args.native_batchnorm, train=False)
        blocks_table(args.batch_size, args.imgsz, args.native_batchnorm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
