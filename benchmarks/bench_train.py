"""Where a training epoch's time goes, and how close it is to the compute floor.

Runs the real trainer (train.py's code path) for a few epochs and prints, per epoch: data wait,
forward+backward, optimizer+EMA, validation, wall time. Then measures the compute floor:
forward+loss+backward+optimizer step on pre-collated batches held in memory (no loader), for the
same number of iterations, and prints epoch time / floor.

    python benchmarks/bench_train.py --data ../shared/datasets/bccd/data.yaml --imgsz 320 --epochs 3
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT.parent / "shared/datasets/bccd/data.yaml"))
    parser.add_argument("--cfg", default=str(ROOT / "models/yolov5n.yaml"))
    parser.add_argument("--imgsz", type=int, default=320)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--amp", default="auto", choices=("auto", "bf16", "off"))
    parser.add_argument("--channels-last", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--project", default=str(ROOT / "runs/bench"))
    return parser.parse_args()


def run_trainer(args) -> list:
    from utils.config import Hyp, TrainConfig
    from utils.loggers import setup_logging
    from utils.paths import increment_path
    from utils.trainer import train
    from utils.trainer.callbacks import Callbacks

    setup_logging(verbose=False)
    config = TrainConfig(data=args.data, cfg=args.cfg, weights="", imgsz=args.imgsz, batch_size=args.batch_size,
                         epochs=args.epochs, workers=args.workers, device="cpu", noplots=True, noautoanchor=True,
                         amp=args.amp, channels_last=args.channels_last, project=args.project)
    config.save_dir = str(increment_path(Path(args.project) / "exp", mkdir=True))
    epochs, last_tick = [], [time.perf_counter()]

    def record(epoch, values, fitness, stats):
        now = time.perf_counter()
        epochs.append((epoch, stats, now - last_tick[0], values))
        last_tick[0] = now

    callbacks = Callbacks()
    callbacks.register("on_fit_epoch_end", record)
    callbacks.register("on_train_start", lambda **_: last_tick.__setitem__(0, time.perf_counter()))
    train(config, Hyp.load("hyp.scratch-low.yaml"), callbacks)
    return epochs, config


def compute_floor(config, iterations: int) -> float:
    """Seconds for ``iterations`` steps of forward+loss+backward+optimizer(+EMA) on in-memory batches,
    after 3 untimed warm-up steps (the trainer's epochs compared with it are steady ones too)."""
    import torch

    from utils.config import Hyp
    from utils.data.dataset_yaml import load_data_config
    from utils.data.loader import create_dataloader
    from utils.loss import ComputeLoss
    from utils.trainer.amp import choose_precision, use_channels_last
    from utils.trainer.ema import ModelEMA
    from utils.trainer.loop import TrainStep
    from utils.trainer.optim import accumulate_steps, build_optimizer, scaled_weight_decay
    from utils.trainer.setup import build_training_model

    hyp = Hyp.load("hyp.scratch-low.yaml")
    data = load_data_config(config.data)
    model, _ = build_training_model(config.cfg, "", len(data.names), data.names)
    channels_last = use_channels_last(config.channels_last, torch.device("cpu"))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    loader, _ = create_dataloader(data.train, config.imgsz, config.batch_size, 32, hyp=hyp, augment=True,
                                  workers=config.workers, shuffle=True, names=data.names)
    batches = [(images.float() / 255, targets) for images, targets, _, _ in loader]
    accumulate = accumulate_steps(config.batch_size)
    optimizer = build_optimizer(model, "SGD", hyp.lr0, hyp.momentum,
                                scaled_weight_decay(hyp.weight_decay, config.batch_size, accumulate))
    step = TrainStep(model, optimizer, ComputeLoss(model, hyp, imgsz=config.imgsz),
                     choose_precision(config.amp, torch.device("cpu"), model), ModelEMA(model), channels_last)
    model.train()
    warmup = 3  # untimed: the first steps of a new model pay one-off kernel selection and allocation costs
    for i in range(warmup + iterations):
        if i == warmup:
            start = time.perf_counter()
        images, targets = batches[i % len(batches)]
        step.forward_backward(images, targets)
        if (i + 1) % accumulate == 0:
            step.optimizer_step()
        step.counters.global_step += 1
    return time.perf_counter() - start


def main():
    args = parse_args()
    import torch

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, data {args.data}, imgsz {args.imgsz}, "
          f"batch {args.batch_size}, workers {args.workers}, amp {args.amp}, channels_last {args.channels_last}")
    epochs, config = run_trainer(args)
    print(f"\n{'epoch':>5} {'iters':>5} {'data':>7} {'fwd+bwd':>8} {'opt+EMA':>8} {'val':>7} {'wall':>7}  mAP50 mAP50-95")
    for epoch, stats, wall, values in epochs:
        print(f"{epoch:>5} {stats.iterations:>5} {stats.data_time:>7.2f} {stats.compute_time:>8.2f} "
              f"{stats.optimizer_time:>8.2f} {stats.validation_time:>7.2f} {wall:>7.2f}  "
              f"{values['metrics/mAP_0.5']:.3f} {values['metrics/mAP_0.5:0.95']:.3f}")
    steady = epochs[1:] or epochs
    iterations = steady[0][1].iterations
    train_time = sum(s.data_time + s.compute_time + s.optimizer_time for _, s, _, _ in steady) / len(steady)
    wall = sum(w for _, _, w, _ in steady) / len(steady)
    floor = compute_floor(config, iterations)
    print(f"\ncompute floor (no loader, {iterations} iterations): {floor:.2f} s")
    print(f"train part of epoch (excl. validation): {train_time:.2f} s -> ratio {train_time / floor:.2f}")
    print(f"whole epoch incl. validation: {wall:.2f} s -> ratio {wall / floor:.2f}")


if __name__ == "__main__":
    main()
