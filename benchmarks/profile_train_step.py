"""Where one training step's time goes: torch.profiler over the trainer's own step (TrainStep: forward, loss,
backward, and an optimizer step + EMA every ``accumulate`` batches) of yolov5n on real augmented batches.

    python benchmarks/profile_train_step.py --imgsz 256 --amp off            # fp32, this CPU's kernels
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/profile_train_step.py --amp off
                                                                             # fp32 as an AVX2-only CPU runs it

Prints the median step time over ``--steps`` timed steps (after 3 warm-up steps), then the profiled steps'
operators grouped into families (convolution forward/backward, BatchNorm, SiLU, loss, optimizer, EMA,
copies and allocation, other), and the top operators by self time. The batches come from the embedded
default dataset (or --data) through the training loader, collated once and held in memory, so the figures
are the compute alone.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# operator name fragments -> family, first match wins (aten names as the profiler reports them)
FAMILIES = (
    ("convolution backward", ("convolution_backward", "mkldnn_convolution_backward")),
    ("convolution", ("convolution", "conv2d", "mkldnn_convolution", "_convolution")),
    ("BatchNorm + SiLU (C kernels)", ("BatchNormSiLU",)),
    ("BatchNorm", ("batch_norm", "GroupedBatchNorm", "native_batch_norm")),
    ("SiLU", ("silu",)),
    ("upsample / concat / pooling", ("upsample", "cat", "max_pool")),
    ("optimizer", ("sgd", "_foreach", "clip_grad", "Optimizer.step", "_single_tensor", "_multi_tensor")),
    ("copies / fill / allocation", ("copy_", "to", "empty", "zero_", "fill_", "clone", "contiguous", "zeros")),
)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="", help="dataset YAML ('' = the embedded default dataset)")
    parser.add_argument("--cfg", default=str(ROOT / "models/yolov5n.yaml"))
    parser.add_argument("--imgsz", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--amp", default="off", choices=("auto", "bf16", "off"))
    parser.add_argument("--channels-last", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--no-profile", action="store_true", help="only the step times")
    parser.add_argument("--steps", type=int, default=12, help="timed steps (then as many profiled)")
    parser.add_argument("--top", type=int, default=25, help="operators listed by self time")
    return parser.parse_args()


def build(args):
    """(TrainStep, accumulate, batches) as the trainer builds them."""
    import torch

    from utils.config import Hyp
    from utils.data.dataset_yaml import load_data_config
    from utils.data.loader import create_dataloader
    from utils.loss import ComputeLoss
    from utils.trainer.amp import choose_precision, use_channels_last
    from utils.trainer.ema import ModelEMA
    from utils.trainer.loop import TrainStep
    from utils.trainer.optim import accumulate_steps, build_optimizer, scaled_weight_decay
    from utils.trainer.setup import build_training_model, resolve_data
    from models.yolo import activations_out_of_place

    hyp = Hyp.load("hyp.scratch-low.yaml")
    data = load_data_config(resolve_data(args.data))
    model = build_training_model(args.cfg, "", len(data.names), data.names)
    channels_last = use_channels_last(args.channels_last, torch.device("cpu"))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    loader, _ = create_dataloader(data.train, args.imgsz, args.batch_size, 32, hyp=hyp, augment=True, workers=0,
                                  shuffle=True, names=data.names)
    batches = []
    for images, targets, _, _ in loader:
        batches.append((images.float() / 255, targets))
        if len(batches) == 8:
            break
    accumulate = accumulate_steps(args.batch_size)
    optimizer = build_optimizer(model, "SGD", hyp.lr0, hyp.momentum,
                                scaled_weight_decay(hyp.weight_decay, args.batch_size, accumulate))
    ema = ModelEMA(model)
    activations_out_of_place(model)  # as utils.trainer.trainer.build_step: after the EMA's copy
    step = TrainStep(model, optimizer, ComputeLoss(model, hyp, imgsz=args.imgsz),
                     choose_precision(args.amp, torch.device("cpu"), model), ema, channels_last)
    model.train()
    return step, accumulate, batches


def run_steps(step, accumulate, batches, count: int, done: int) -> list[float]:
    times = []
    for index in range(done, done + count):
        images, targets = batches[index % len(batches)]
        start = time.perf_counter()
        step.forward_backward(images, targets)
        if (index + 1) % accumulate == 0:
            step.optimizer_step()
        step.counters.global_step += 1
        times.append(time.perf_counter() - start)
    return times


def family(name: str) -> str:
    for label, fragments in FAMILIES:
        if any(fragment in name for fragment in fragments):
            return label
    return "other"


def main():
    args = parse_args()
    import os

    import torch
    from torch.profiler import ProfilerActivity, profile

    from utils.memory import keep_freed_memory

    keep_freed_memory()  # as train.py does
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ATen CPU capability {capability}, "
          f"oneDNN max ISA {os.environ.get('ONEDNN_MAX_CPU_ISA', 'default')}; yolov5n {args.imgsz} px, batch "
          f"{args.batch_size}, amp {args.amp}, channels_last {args.channels_last}")
    step, accumulate, batches = build(args)
    run_steps(step, accumulate, batches, 3, 0)
    times = run_steps(step, accumulate, batches, args.steps, 3)
    print(f"step: median {statistics.median(times) * 1000:.1f} ms, min {min(times) * 1000:.1f} ms over {len(times)} "
          f"(every {accumulate}th with the optimizer step and EMA)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps(step, accumulate, batches, args.steps, 3 + args.steps)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    groups = defaultdict(float)
    for event in events:
        groups[family(event.key)] += event.self_cpu_time_total
    print(f"\nself CPU time by family over {args.steps} profiled steps ({total / 1e3 / args.steps:.1f} ms per step, "
          "profiler overhead included):")
    for label, spent in sorted(groups.items(), key=lambda item: -item[1]):
        print(f"  {label:30s} {spent / 1e3 / args.steps:8.1f} ms  {spent / total:6.1%}")
    print()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
