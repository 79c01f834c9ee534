"""Why train.py --compile is ignored on the CPU: a training step's forward and backward, eager against torch.compile.

    python benchmarks/bench_compile_cpu.py --cfg models/yolov5n.yaml --imgsz 320 --batch-size 8

Runs each mode in a fresh process (the compiler's caches and threads stay out of the other's timing), one after the
other: the first step (which compiles), then the mean of ``--steps`` steps after one more. A step is the model's
training forward on a random channels_last batch, a loss (the mean square of the outputs) and its backward; eager is
the model as training runs it (this project's BatchNorm + SiLU C kernels where they are built), compiled is
``torch.compile(model)`` (inductor's C++ code, with a C compiler; ``--backend`` for another). fp32.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_mode(cfg: str, imgsz: int, batch_size: int, steps: int, backend: str | None) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from models.yolo import Model

    torch.manual_seed(0)
    model = Model(cfg, ch=3, nc=80).train().to(memory_format=torch.channels_last)
    images = torch.rand(batch_size, 3, imgsz, imgsz).contiguous(memory_format=torch.channels_last)
    forward = torch.compile(model, backend=backend) if backend else model

    def step() -> None:
        loss = sum(output.float().square().mean() for output in forward(images))
        loss.backward()
        for parameter in model.parameters():
            parameter.grad = None

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return {"mode": backend or "eager", "first_step_s": first, "step_s": (time.perf_counter() - start) / steps}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cfg", default=str(ROOT / "models" / "yolov5n.yaml"))
    parser.add_argument("--imgsz", type=int, default=320)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend for the compiled mode")
    parser.add_argument("--mode", choices=("eager", "compiled"), help=argparse.SUPPRESS)  # one mode, in a child
    args = parser.parse_args(argv)
    if args.mode:
        print(json.dumps(one_mode(args.cfg, args.imgsz, args.batch_size, args.steps,
                                  args.backend if args.mode == "compiled" else None)))
        return 0
    import platform

    print(f"{Path(args.cfg).stem}, {args.imgsz} px, batch {args.batch_size}, fp32, {platform.processor() or 'CPU'}")
    for mode in ("eager", "compiled"):
        done = subprocess.run([sys.executable, __file__, "--mode", mode, "--cfg", args.cfg, "--imgsz", str(args.imgsz),
                               "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                               "--backend", args.backend], capture_output=True, text=True)
        if done.returncode:
            print(f"{mode}: failed\n{done.stderr[-2000:]}")
            return 1
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{mode:9s} first step {result['first_step_s']:6.1f} s, then {result['step_s']:.3f} s a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
