"""Where one training step's time goes: the trainer's own epoch loop (utils/trainer/loop.py: train_one_epoch and
TrainStep) over real augmented batches, timed phase by phase, then torch.profiler over the same steps.

    python benchmarks/profile_train_step.py --imgsz 256 --amp off            # fp32, this CPU's kernels
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/profile_train_step.py --amp off
                                                                             # fp32 as an AVX2-only CPU runs it
    python benchmarks/profile_train_step.py --device 0 --cfg models/yolov5s.yaml --imgsz 640 --batch-size 64 \
        --amp auto --source loader --workers 8 --json out.json              # a GPU, batches from the loader

Prints the mean step time over ``--steps`` timed steps (after 3 warm-up steps) and the phase table: waiting for
data, the host-to-device copy, forward, loss, backward, gradient clipping (with its finite check), the optimizer
step, EMA and the progress bar's logging. Each phase ends at a mark the loop makes (TrainStep.phase); the host's
time per phase comes from the clock, and on CUDA the GPU's from CUDA events recorded at the same marks (no
synchronisation is added inside a step: the events are read after the timed steps). Then the profiled steps:
on CUDA, kernels launched and host-device synchronisations per step and the kernels' own time by family
(convolution passes, BatchNorm, SiLU, layout conversions, copies...: what faster kernels would have to cut); on the
CPU, the host's reads of tensor values
per step by place (benchmarks/host_reads.py), the operators grouped into families (convolution forward/backward,
BatchNorm, SiLU, loss, optimizer, EMA, copies and allocation, other) and the top operators by self time.

``--source memory`` (the default) collates ``--hold`` batches once and replays them from memory (the compute alone,
plus the copy to the device); ``--source loader`` reads the training loader with ``--workers`` processes.
"""
from __future__ import annotations

import argparse
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

# CUDA kernel name fragments (lower case) -> family, first match wins: cuDNN's convolution kernels name their pass
# (fprop, dgrad, wgrad) or are implicit GEMMs; its BatchNorm kernels say bn_ or batchnorm; torch's SiLU is an
# elementwise kernel whose template names silu
KERNEL_FAMILIES = (
    ("convolution, input gradient", ("dgrad",)),
    ("convolution, weight gradient", ("wgrad",)),
    ("convolution", ("fprop", "implicit_gemm", "implicit_convolve", "conv")),
    ("BatchNorm", ("batch_norm", "batchnorm", "bn_fw", "bn_bw", "welford")),
    ("SiLU", ("silu",)),
    ("layout conversions", ("nchwtonhwc", "nhwctonchw", "transpose")),
    ("upsample / concat / pooling", ("upsample", "catarray", "max_pool")),
    ("foreach (optimizer, EMA, clipping)", ("multi_tensor_apply",)),
    ("copies / fills", ("memcpy", "memset", "copy", "fill")),
    ("reductions", ("reduce",)),
    ("other elementwise", ("elementwise",)),
    ("GEMM", ("gemm",)),
)


def kernel_family(name: str) -> str:
    lower = name.lower()
    for label, fragments in KERNEL_FAMILIES:
        if any(fragment in lower for fragment in fragments):
            return label
    return "other"


def device_events(events):
    """(name, microseconds) of the profiler's device-side events (kernels, copies, fills)."""
    from torch.autograd import DeviceType

    for event in events:
        if getattr(event, "device_type", None) == DeviceType.CUDA:
            micros = getattr(event, "self_device_time_total", None)
            yield event.key, micros if micros is not None else event.self_cuda_time_total


def kernel_time_by_family(events, steps: int) -> dict:
    """{family: GPU ms per step} over the profiler's device-side events, largest first."""
    spent = defaultdict(float)
    for name, micros in device_events(events):
        spent[kernel_family(name)] += micros
    return {label: us / 1e3 / steps for label, us in sorted(spent.items(), key=lambda item: -item[1])}


EXAMINED_FAMILIES = ("copies / fills", "other", "other elementwise")  # families whose kernels a name alone leaves open


def top_kernels(events, steps: int, families=EXAMINED_FAMILIES, count: int = 4, width: int = 90) -> dict:
    """{family: [(kernel name cut to ``width``, GPU ms per step)]}: the ``count`` costliest kernels of each of
    ``families`` (what the 2026-11-28 H200 profile's 5 ms a step of copies and fills are, for one)."""
    kernels = defaultdict(float)
    for name, micros in device_events(events):
        if kernel_family(name) in families:
            kernels[name] += micros
    found = {family: [] for family in families}
    for name, micros in sorted(kernels.items(), key=lambda item: -item[1]):
        listed = found[kernel_family(name)]
        if len(listed) < count:
            listed.append((name[:width], micros / 1e3 / steps))
    return {family: listed for family, listed in found.items() if listed}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="", help="dataset YAML ('' = the embedded default dataset)")
    parser.add_argument("--cfg", default=str(ROOT / "models/yolov5n.yaml"))
    parser.add_argument("--imgsz", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--amp", default="off", choices=("auto", "bf16", "off"))
    parser.add_argument("--channels-last", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--device", default="cpu", help="cpu, or a CUDA device (0)")
    parser.add_argument("--source", default="memory", choices=("memory", "loader"))
    parser.add_argument("--workers", type=int, default=0, help="loader processes (also to collate --source memory's)")
    parser.add_argument("--sync-debug", type=int, default=0, metavar="N",
                        help="CUDA: N more steps under torch.cuda.set_sync_debug_mode('warn'); prints where each "
                             "host-device synchronisation was asked for (the innermost frames of this project)")
    runner = parser.add_mutually_exclusive_group()  # as train.py: the two are not combined
    runner.add_argument("--cuda-graphs", action="store_true",
                        help="the forward, the loss and the backward replayed as CUDA graphs (train.py --cuda-graphs)")
    runner.add_argument("--cuda-graphs-model", action="store_true",
                        help="--cuda-graphs with the model alone graphed, the loss eager after it (as before the loss "
                             "was graphed too: what graphing the loss gains)")
    runner.add_argument("--compile", action="store_true",
                        help="the forward and backward compiled by torch.compile (train.py --compile); the timed "
                             "steps start after the warm-up steps, which compile")
    parser.add_argument("--copies", default="as-trained", choices=("as-trained", "ahead", "inline"),
                        help="each batch's copy to the device: as training does it (ahead on CUDA: issued on a side "
                             "stream while the batch before trains, utils/trainer/feed.py), or forced 'ahead' or "
                             "'inline' (on the training stream, between two steps: as before 8d3a8ea)")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="torch.backends.cudnn.benchmark = True (cuDNN times its algorithms per shape)")
    parser.add_argument("--hold", type=int, default=8, help="batches held in memory (--source memory)")
    parser.add_argument("--json", default="", help="also write the figures to this JSON file")
    parser.add_argument("--no-profile", action="store_true", help="only the step times")
    parser.add_argument("--steps", type=int, default=12, help="timed steps (then as many profiled)")
    parser.add_argument("--top", type=int, default=25, help="operators listed by self time")
    return parser.parse_args()


def build(args, device):
    """(TrainStep, accumulate, loader batches or the loader) as the trainer builds them, on ``device``."""
    import torch

    from utils.config import Hyp
    from utils.data.dataset_yaml import load_data_config
    from utils.data.loader import create_dataloader
    from utils.loss import DetectionLoss
    from utils.trainer.amp import choose_precision, use_channels_last
    from utils.trainer.ema import ModelEMA
    from utils.trainer.loop import TrainStep
    from utils.trainer.optim import accumulate_steps, build_optimizer, scaled_weight_decay
    from utils.trainer.setup import build_training_model, resolve_data
    from utils.trainer.step_checks import StepChecks
    from models.yolo import activations_out_of_place

    hyp = Hyp.load("hyp.scratch-low.yaml")
    data = load_data_config(resolve_data(args.data))
    model = build_training_model(args.cfg, "", len(data.names), data.names).to(device)
    channels_last = use_channels_last(args.channels_last, device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    loader, _ = create_dataloader(data.train, args.imgsz, args.batch_size, 32, hyp=hyp, augment=True,
                                  workers=args.workers, shuffle=True, names=data.names)
    if args.source == "memory":
        batches = []
        for batch in loader:
            batches.append(batch)
            if len(batches) == args.hold:
                break
        if device.type == "cuda":  # as the loader hands them over on a CUDA machine
            batches = [(images.pin_memory(), targets.pin_memory(), paths, shapes)
                       for images, targets, paths, shapes in batches]
        loader = batches
    accumulate = accumulate_steps(args.batch_size)
    optimizer = build_optimizer(model, "SGD", hyp.lr0, hyp.momentum,
                                scaled_weight_decay(hyp.weight_decay, args.batch_size, accumulate))
    ema = ModelEMA(model)
    activations_out_of_place(model)  # as utils.trainer.trainer.build_step: after the EMA's copy
    checks = StepChecks.chosen(device, optimizer)  # as build_step: deferred on CUDA (YOLO_TRAINER_STEP_CHECKS)
    step = TrainStep(model, optimizer, DetectionLoss(model, hyp, imgsz=args.imgsz, fixed_shapes=checks is not None),
                     choose_precision(args.amp, device, model), ema, channels_last, checks=checks)
    if args.cuda_graphs or args.cuda_graphs_model:
        from utils.trainer.cuda_graphs import graphed_model

        step.runner = graphed_model(True, model, step.precision, args.batch_size, device, distributed=False,
                                    compute_loss=None if args.cuda_graphs_model else step.compute_loss)
    elif args.compile:
        from utils.trainer.compiled import compiled_model

        step.runner = compiled_model(True, model, step.precision, args.batch_size, device)
    model.train()
    return step, accumulate, loader


class Batches:
    """``count`` batches for train_one_epoch: the held ones in turn, or the loader's (restarted when it ends)."""

    def __init__(self, source, count: int):
        self.source, self.count = source, count
        self.iterator = None

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        for _ in range(self.count):
            if isinstance(self.source, list):
                yield self.source[0]
                self.source.append(self.source.pop(0))
                continue
            try:
                batch = next(self.iterator) if self.iterator is not None else None
            except StopIteration:
                batch = None
            if batch is None:
                self.iterator = iter(self.source)
                batch = next(self.iterator)
            yield batch


class PhaseTimer:
    """TrainStep.phase: at each mark, the host's clock and, on CUDA, an event on the current stream."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch
        self.marks = []  # (name, host seconds, event or None)

    def __call__(self, name: str) -> None:
        event = None
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((name, time.perf_counter(), event))

    def phases(self, steps: int) -> dict:
        """{phase: {"host_ms": per step, "gpu_ms": per step or None}}: each span between two marks belongs to the
        later mark's phase (the first mark of a step, "data", covers the wait since the last step's logging)."""
        if self.cuda:
            self.torch.cuda.synchronize()
        host, gpu = defaultdict(float), defaultdict(float)
        for (_, before, start), (name, after, end) in zip(self.marks, self.marks[1:]):
            host[name] += (after - before) * 1000
            if start is not None:
                gpu[name] += start.elapsed_time(end)
        order = [name for name in PHASES if name in host] + [name for name in host if name not in PHASES]
        return {name: {"host_ms": host[name] / steps, "gpu_ms": gpu[name] / steps if self.cuda else None}
                for name in order}


PHASES = ("data", "copy", "forward", "loss", "backward", "clip", "optimizer", "ema", "logging")


def run_steps(step, accumulate, source, count: int, device, timer=None) -> float:
    """Train ``count`` batches through train_one_epoch (an optimizer step every ``accumulate``); seconds taken."""
    import torch

    from utils.trainer.loop import train_one_epoch
    from utils.trainer.state import RunState

    step.phase = timer
    if timer is not None:
        timer("start")
    start = time.perf_counter()
    train_one_epoch(step, Batches(source, count), RunState(), None, device, lambda *args: accumulate)
    if device.type == "cuda":
        torch.cuda.synchronize()
    step.phase = None
    return time.perf_counter() - start


def family(name: str) -> str:
    for label, fragments in FAMILIES:
        if any(fragment in name for fragment in fragments):
            return label
    return "other"


def profile_steps(step, accumulate, source, args, device) -> dict:
    """torch.profiler over ``--steps`` steps: on CUDA kernels and synchronisations per step, on the CPU operator
    families and the host's reads per step; printed, and returned for --json."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.host_reads import HostReads

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with HostReads() as reads, profile(activities=activities) as prof:
        run_steps(step, accumulate, source, args.steps, device)
    events = prof.key_averages()
    figures = {"host_reads_per_step": {place: count / args.steps for place, count in reads.by_place().items()}}
    if device.type == "cuda":
        kernels = sum(e.count for e in events if "LaunchKernel" in e.key)
        syncs = {e.key: e.count / args.steps for e in events if "Synchronize" in e.key}
        by_family = kernel_time_by_family(events, args.steps)
        figures.update(kernels_per_step=kernels / args.steps, syncs_per_step=syncs,
                       gpu_ms_per_step_by_kernel_family=by_family,
                       gpu_ms_per_step_top_kernels=top_kernels(events, args.steps))
        print(f"\nper step: {kernels / args.steps:.0f} kernels launched; synchronisations: "
              + (", ".join(f"{name} {count:.1f}" for name, count in syncs.items()) or "none"))
        print(f"GPU time by kernel family ({sum(by_family.values()):.1f} ms per step): "
              + ", ".join(f"{label} {ms:.1f}" for label, ms in by_family.items()))
        for kind, listed in figures["gpu_ms_per_step_top_kernels"].items():
            print(f"  {kind}: " + "; ".join(f"{name} {ms:.2f}" for name, ms in listed))
    print("host reads of tensor values per step: " + (", ".join(
        f"{place} {count:.1f}" for place, count in figures["host_reads_per_step"].items()) or "none"))
    total = sum(e.self_cpu_time_total for e in events)
    groups = defaultdict(float)
    for event in events:
        groups[family(event.key)] += event.self_cpu_time_total
    print(f"\nself CPU time by family over {args.steps} profiled steps ({total / 1e3 / args.steps:.1f} ms per step, "
          "profiler overhead included):")
    for label, spent in sorted(groups.items(), key=lambda item: -item[1]):
        print(f"  {label:30s} {spent / 1e3 / args.steps:8.1f} ms  {spent / total:6.1%}")
    print()
    print(events.table(sort_by="self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total",
                       row_limit=args.top))
    if device.type == "cuda":  # the host's side: what keeps it from running ahead of the GPU
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
        figures["host_ms_per_step_by_operator"] = {
            e.key: e.self_cpu_time_total / 1e3 / args.steps
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]}
    return figures


def sync_sites(step, accumulate, source, count: int, device) -> dict:
    """{"file:line <- file:line": synchronisations per step} over ``count`` steps run under
    ``torch.cuda.set_sync_debug_mode("warn")``: PyTorch warns at each call that waits for the device, and the warning's
    Python stack names who asked (the two innermost frames under this repository)."""
    import traceback
    import warnings

    import torch

    sites = defaultdict(int)
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return original(message, category, filename, lineno, file, line)
        frames = [f"{Path(frame.filename).resolve().relative_to(ROOT)}:{frame.lineno}"
                  for frame in traceback.extract_stack()[:-1]
                  if Path(frame.filename).resolve().is_relative_to(ROOT) and "profile_train_step" not in frame.filename]
        sites[" <- ".join(reversed(frames[-2:])) or f"{filename}:{lineno}"] += 1

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            run_steps(step, accumulate, source, count, device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = original
    per_step = {site: number / count for site, number in sorted(sites.items(), key=lambda item: -item[1])}
    print(f"\nsynchronisations per step by site, over {count} steps under set_sync_debug_mode('warn') "
          "(the train_one_epoch call's own start and end included):")
    for site, number in per_step.items():
        print(f"  {number:6.2f}  {site}")
    if not per_step:
        print("  none")
    return per_step


def main():
    args = parse_args()
    import json
    import os

    import torch

    from utils.device import select_device
    from utils.memory import keep_freed_memory

    device = select_device(args.device)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    if device.type == "cpu":
        keep_freed_memory()  # as train.py does on the CPU
    capability = torch.backends.cpu.get_cpu_capability()
    where = (torch.cuda.get_device_name(device) if device.type == "cuda" else
             f"{torch.get_num_threads()} threads, ATen CPU capability {capability}, oneDNN max ISA "
             f"{os.environ.get('ONEDNN_MAX_CPU_ISA', 'default')}")
    print(f"torch {torch.__version__}, {where}; {Path(args.cfg).stem} {args.imgsz} px, batch {args.batch_size}, "
          f"amp {args.amp}, channels_last {args.channels_last}, batches from {args.source}, cudnn.benchmark "
          f"{args.cudnn_benchmark}")
    from utils.trainer import loop

    if args.copies != "as-trained":  # train_one_epoch reads it from its module
        loop.copies_run_ahead = lambda device, ahead=args.copies == "ahead": ahead
    step, accumulate, source = build(args, device)
    run_steps(step, accumulate, source, 3, device)  # warm-up (cuDNN's algorithm search, the allocator)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer = PhaseTimer(device)
    seconds = run_steps(step, accumulate, source, args.steps, device, timer)
    phases = timer.phases(args.steps)
    result = {"device": where, "cfg": Path(args.cfg).stem, "imgsz": args.imgsz, "batch": args.batch_size,
              "amp": step.precision.name, "source": args.source, "steps": args.steps,
              "channels_last": step.channels_last, "cudnn_benchmark": args.cudnn_benchmark,
              "cuda_graphs": (args.cuda_graphs or args.cuda_graphs_model) and step.runner is not None,
              "loss_graphed": getattr(step.runner, "compute_loss", None) is not None,
              "compile": args.compile and step.runner is not None,
              "copies_ahead": loop.copies_run_ahead(device),
              "step_ms": seconds * 1000 / args.steps, "images_per_s": args.batch_size * args.steps / seconds,
              "phases": phases}
    if device.type == "cuda":
        result["max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 1e9
    print(f"step: {result['step_ms']:.1f} ms on average over {args.steps} ({result['images_per_s']:.0f} images/s; "
          f"every {accumulate}th with the optimizer step and EMA)")
    print(f"\n{'phase':10s} {'host ms':>9s} {'GPU ms':>9s}")
    for name, times in phases.items():
        gpu = f"{times['gpu_ms']:9.2f}" if times["gpu_ms"] is not None else f"{'-':>9s}"
        print(f"{name:10s} {times['host_ms']:9.2f} {gpu}")
    if not args.no_profile:
        result.update(profile_steps(step, accumulate, source, args, device))
    if args.sync_debug and device.type == "cuda":
        result["sync_sites_per_step"] = sync_sites(step, accumulate, source, args.sync_debug, device)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
