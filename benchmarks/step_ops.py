"""Torch operations the host issues in one training step, by phase, outside any CUDA graph: the step eager, with
``--cuda-graphs`` graphing the model alone (the loss eager after it), and graphing the model and its loss. On CUDA
each operation costs host time and most launch a kernel, while a graph's replay is one launch; so these counts are
the host's share of a step that a GPU would wait for.

Counted on the CPU (every operation through the dispatcher, benchmarks/dispatch_count.py) with the stand-in capture
(benchmarks/graph_stand_in.py), whose replays are left out of the count. The step is CUDA's: the fixed-shape loss,
the deferred step checks, the project's SGD, clipping and the EMA; fp32 (CUDA's fp16 adds the GradScaler's few
operations). Counts do not depend on the image size or the number of targets; the model's do on its depth. Views
(``detach``, ``view``, ``expand``: no kernel, a few microseconds of host time each) are counted apart. The stand-in
takes its inputs as they are; the real graphs copy each input into their static buffer first (one more operation
per input).

    python benchmarks/step_ops.py [--cfg models/yolov5s.yaml] [--imgsz 128] [--batch-size 4] [--targets 8]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PHASES = ("forward", "loss", "backward", "clip", "optimizer", "ema")
MODES = ("eager", "model graphed", "model and loss graphed")


def build_step(cfg: str, mode: str, capture):
    import torch

    from models.yolo import DetectionModel, activations_out_of_place
    from utils.config import Hyp
    from utils.loss import DetectionLoss
    from utils.trainer.amp import choose_precision
    from utils.trainer.cuda_graphs import GraphedModel
    from utils.trainer.ema import ModelEMA
    from utils.trainer.loop import TrainStep
    from utils.trainer.optim import build_optimizer
    from utils.trainer.step_checks import StepChecks

    torch.manual_seed(0)
    model = DetectionModel(cfg).train()
    optimizer = build_optimizer(model, "SGD", 0.01, 0.937, 5e-4)
    ema = ModelEMA(model)
    activations_out_of_place(model)  # as the trainer's build_step: after the EMA's copy
    precision = choose_precision("off", torch.device("cpu"), model)
    step = TrainStep(model, optimizer, DetectionLoss(model, Hyp(), imgsz=640, fixed_shapes=True), precision, ema,
                     checks=StepChecks())
    if mode != "eager":
        step.runner = GraphedModel(model, precision, batch_size=None, capture=capture,
                                   compute_loss=step.compute_loss if mode == "model and loss graphed" else None)
    return step


def batch(batch_size: int, imgsz: int, per_image: int):
    import torch

    generator = torch.Generator().manual_seed(1)
    images = torch.rand(batch_size, 3, imgsz, imgsz, generator=generator)
    n = batch_size * per_image
    targets = torch.cat((torch.arange(batch_size).repeat_interleave(per_image)[:, None].float(),
                         torch.zeros(n, 1), torch.rand(n, 2, generator=generator) * 0.8 + 0.1,
                         torch.rand(n, 2, generator=generator) * 0.3 + 0.05), 1)
    return images, targets


def count_step(step, images, targets, capture, rounds: int) -> dict[str, float]:
    """Operations per step by phase, the mean over ``rounds`` steps after two unmeasured ones (the capture, the
    device's constants)."""
    from dispatch_count import OperationCount

    class OutsideGraphs(OperationCount):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(graph.replaying for graph in capture.graphs):
                return func(*args, **(kwargs or {}))
            self.views += func.is_view
            return super().__torch_dispatch__(func, types, args, kwargs)

    step.runner and setattr(step.runner, "batch_size", images.shape[0])
    for _ in range(2):
        step.forward_backward(images, targets)
        step.optimizer_step()
        step.counters.global_step += 1
    totals = dict.fromkeys(PHASES, 0)
    with OutsideGraphs() as counter:
        counter.views = 0
        last = [0]

        def mark(name: str) -> None:
            totals[name] += counter.operations - last[0]
            last[0] = counter.operations

        step.phase = mark
        for _ in range(rounds):
            step.forward_backward(images, targets)
            step.optimizer_step()
            step.counters.global_step += 1
        step.phase = None
    return {**{name: value / rounds for name, value in totals.items()}, "views": counter.views / rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cfg", default=str(ROOT / "models" / "yolov5s.yaml"))
    parser.add_argument("--imgsz", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--targets", type=int, default=8, help="boxes per image")
    parser.add_argument("--rounds", type=int, default=3, help="counted steps per mode")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from graph_stand_in import StandInCapture

    images, targets = batch(args.batch_size, args.imgsz, args.targets)
    print(f"{Path(args.cfg).name}, {args.imgsz} px, batch {args.batch_size}, {args.targets} targets an image; "
          f"operations per step issued by the host outside graphs (mean of {args.rounds} steps)")
    print("| mode | " + " | ".join(PHASES) + " | step | of which views (no kernel) |")
    print("|---" * (len(PHASES) + 3) + "|")
    for mode in MODES:
        capture = StandInCapture()
        step = build_step(args.cfg, mode, capture)
        counts = count_step(step, images, targets, capture, args.rounds)
        replays = "" if step.runner is None else f" ({step.runner.replays} replays, {step.runner.eager} eager)"
        print(f"| {mode}{replays} | " + " | ".join(f"{counts[name]:g}" for name in PHASES)
              + f" | {sum(counts[name] for name in PHASES):g} | {counts['views']:g} |")


if __name__ == "__main__":
    main()
