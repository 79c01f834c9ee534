"""What the resumable last.pt costs per save: building and writing the full training checkpoint (model, EMA,
optimizer, scaler, scheduler, run state, generator states; the previous last.pt kept as a link) against the
model + EMA + optimizer checkpoint written before exact resume existed. Alternating, median of N each.

    python benchmarks/bench_checkpoint.py --cfg models/yolov5n.yaml --nc 3 --repeats 20
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg", default=str(ROOT / "models/yolov5n.yaml"))
    parser.add_argument("--nc", type=int, default=3)
    parser.add_argument("--imgsz", type=int, default=320)
    parser.add_argument("--repeats", type=int, default=20)
    return parser.parse_args()


def training_parts(cfg: str, nc: int, imgsz: int):
    """A model one optimizer step into training (momentum buffers exist), with its EMA, scaler, scheduler."""
    import torch

    from models.yolo import DetectionModel
    from utils.config import Hyp
    from utils.loss import DetectionLoss
    from utils.trainer.ema import ModelEMA
    from utils.trainer.optim import EpochSchedule, build_optimizer, lr_lambda

    model = DetectionModel(cfg, nc=nc).to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, "SGD", 0.01, 0.937, 5e-4)
    scheduler = EpochSchedule(optimizer, lr_lambda(100, 0.01))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    images = torch.rand(2, 3, imgsz, imgsz).contiguous(memory_format=torch.channels_last)
    targets = torch.tensor([[0, 0, 0.5, 0.5, 0.2, 0.2], [1, 1, 0.3, 0.3, 0.1, 0.2]])
    loss, _ = DetectionLoss(model, Hyp())(model(images), targets)
    loss.backward()
    optimizer.step()
    return model, ModelEMA(model), optimizer, scaler, scheduler


def main():
    args = parse_args()
    import torch

    from utils.checkpoint import model_state, save_checkpoint, training_checkpoint
    from utils.config import Hyp, TrainConfig
    from utils.memory import keep_freed_memory
    from utils.rng import capture_rng
    from utils.trainer.state import RunState

    keep_freed_memory()
    model, ema, optimizer, scaler, scheduler = training_parts(args.cfg, args.nc, args.imgsz)
    config, hyp, state = TrainConfig().to_dict(), Hyp().to_dict(), RunState(epoch=5)
    state.results = [{"epoch": e, "x": 0.0} for e in range(5)]

    def before(path):  # the checkpoint written before exact resume: weights, EMA and optimizer only
        save_checkpoint({"model": model_state(model), "ema": model_state(ema.ema), "ema_updates": ema.updates,
                         "optimizer": optimizer.state_dict(), "epoch": 4, "best_fitness": 0.0, "config": config,
                         "hyp": hyp}, path)

    def now(path):  # what the trainer writes at each epoch end
        checkpoint = training_checkpoint(model, ema, optimizer, scaler, scheduler, state.to_dict(), [capture_rng()],
                                         config, hyp)
        save_checkpoint(checkpoint, path, keep_previous=True)

    times = {"before": [], "now": []}
    with tempfile.TemporaryDirectory() as folder:
        paths = {name: Path(folder) / name / "last.pt" for name in times}
        for _ in range(3):  # warm-up (allocator, page cache)
            before(paths["before"]), now(paths["now"])
        for _ in range(args.repeats):
            for name, save in (("before", before), ("now", now)):
                start = time.perf_counter()
                save(paths[name])
                times[name].append((time.perf_counter() - start) * 1e3)
        sizes = {name: path.stat().st_size / 1e6 for name, path in paths.items()}
    print(f"torch {torch.__version__}, {args.cfg}, nc {args.nc}, {args.repeats} alternating saves each")
    for name, values in times.items():
        print(f"{name:>7}: median {statistics.median(values):6.1f} ms (min {min(values):.1f}, max {max(values):.1f}), "
              f"{sizes[name]:.2f} MB")
    print(f"per-save overhead of the resumable checkpoint: "
          f"{statistics.median(times['now']) - statistics.median(times['before']):+.1f} ms")


if __name__ == "__main__":
    main()
