"""Eval-mode inference time per image for yolov5n / yolov5s at 640 on this machine's CPU.

Batch 1, Conv+BN fused, channels_last (as val.py and detect.py run it), float32, torch's default thread count, warm-up runs first, then the
median of N timed runs. Random weights: speed does not depend on the values.

    python benchmarks/bench_inference.py [--models n s] [--imgsz 640] [--runs 20] [--warmup 3]
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import for_inference  # noqa: E402
from models.fused import fuse_silu  # noqa: E402
from models.yolo import DetectionModel  # noqa: E402

MODELS = Path(__file__).resolve().parents[1] / "models"


def time_model(size: str, imgsz: int, runs: int, warmup: int) -> dict:
    model = for_inference(DetectionModel(MODELS / f"yolov5{size}.yaml").eval())  # as val.py / detect.py
    fuse_silu(model)
    image = torch.rand(1, 3, imgsz, imgsz).contiguous(memory_format=torch.channels_last)
    times = []
    with torch.inference_mode():
        for _ in range(warmup):
            model(image)
        for _ in range(runs):
            start = time.perf_counter()
            model(image)
            times.append((time.perf_counter() - start) * 1000)
    return {"model": f"yolov5{size}", "summary": model.info(img_size=imgsz), "median": statistics.median(times),
            "min": min(times), "max": max(times)}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["n", "s"], help="sizes: n s m l x n6 ...")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    from utils.memory import keep_freed_memory

    keep_freed_memory()  # as detect.py does
    print(f"CPU: {cpu_name()} ({os.cpu_count()} logical), torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, batch 1, {args.imgsz}x{args.imgsz}, fused, channels_last, float32, "
          f"median of {args.runs} runs after {args.warmup} warm-up")
    print(f"{'model':<10}{'median ms':>11}{'min ms':>9}{'max ms':>9}   summary")
    for size in args.models:
        row = time_model(size, args.imgsz, args.runs, args.warmup)
        print(f"{row['model']:<10}{row['median']:>11.1f}{row['min']:>9.1f}{row['max']:>9.1f}   {row['summary']}")


if __name__ == "__main__":
    main()
