"""BatchNorm + SiLU in training, forward + backward, on yolov5n's Conv maps: torch's operations against the C kernels.

    python benchmarks/bench_bn_silu.py                        # 320 px, batch 16, this CPU's kernels
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/bench_bn_silu.py   # as an AVX2-only CPU runs both

For each distinct (channels, height, width) of yolov5n's 57 Conv outputs at --imgsz, the time of one
forward + backward of silu(bn(x)) with torch's operations (models.batchnorm.BatchNorm2d, torch's SiLU out of
place, as the trainer runs them) and with models.bn_silu's kernels, each the median of --repeat runs with the
CPU caches flushed before each (a training step reaches every map from memory), times the number of Convs with
that shape. Prints the table and the totals; both paths' results are checked against each other first.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

FLUSH_BYTES = 512 * 1024 * 1024


def conv_shapes(imgsz: int, batch: int) -> Counter:
    from models.common import Conv
    from models.yolo import DetectionModel

    model = DetectionModel(str(ROOT / "models/yolov5n.yaml"), nc=80).train()
    shapes = Counter()
    hooks = [module.register_forward_hook(lambda m, i, o: shapes.update([tuple(o.shape)]))
             for module in model.modules() if isinstance(module, Conv)]
    with torch.no_grad():
        model(torch.zeros(1, 3, imgsz, imgsz))
    for hook in hooks:
        hook.remove()
    return Counter({(batch, *shape[1:]): count for shape, count in shapes.items()})


def timed(run, flush: torch.Tensor, repeat: int) -> float:
    run()
    times = []
    for _ in range(repeat):
        flush.add_(1.0)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--imgsz", type=int, default=320)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    from models.batchnorm import BatchNorm2d
    from models.bn_silu import bn_silu, usable
    from models.native import bn_silu_library
    from utils.memory import keep_freed_memory

    keep_freed_memory()  # as train.py
    if bn_silu_library() is None:
        sys.exit("the native kernels are not built here (no C compiler, not Linux or not libgomp): nothing to compare")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ATen CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; yolov5n Conv maps at {args.imgsz} px, batch {args.batch_size}")
    flush = torch.zeros(FLUSH_BYTES // 4)
    print(f"{'map (N, C, H, W)':>24} {'Convs':>5} {'torch ms':>9} {'kernels ms':>10} {'ratio':>6}")
    totals = [0.0, 0.0]
    for shape, count in sorted(conv_shapes(args.imgsz, args.batch_size).items(), key=lambda item: -item[0][2]):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=generator).contiguous(memory_format=torch.channels_last).requires_grad_()
        grad = torch.randn(shape, generator=generator).contiguous(memory_format=torch.channels_last)
        bn = BatchNorm2d(shape[1]).train()
        act = nn.SiLU()
        assert usable(x, bn, act)
        outputs = []
        for path in (lambda: act(bn(x)), lambda: bn_silu(x, bn)):
            out = path()
            outputs.append((out, *torch.autograd.grad(out, (x, bn.weight), grad)))
        for a, b in zip(*outputs):
            error = ((a - b).abs().max() / b.abs().max()).item()
            assert error < 1e-4, f"{shape}: the two paths disagree ({error:.1e})"
        times = [timed(lambda: torch.autograd.grad(path(), (x, bn.weight, bn.bias), grad), flush, args.repeat)
                 for path in (lambda: act(bn(x)), lambda: bn_silu(x, bn))]
        totals[0] += times[0] * count
        totals[1] += times[1] * count
        print(f"{str(shape):>24} {count:>5} {times[0]:>9.2f} {times[1]:>10.2f} {times[1] / times[0]:>6.2f}")
    print(f"{'all 57 Convs':>24} {'':>5} {totals[0]:>9.1f} {totals[1]:>10.1f} {totals[1] / totals[0]:>6.2f}")


if __name__ == "__main__":
    main()
