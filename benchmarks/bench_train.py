"""Where a training epoch's time goes, and how close it is to the compute floor.

Runs the real trainer (train.py's code path) for a few epochs and prints, per epoch: data wait,
forward+backward, optimizer+EMA, validation, wall time, and the compute floor (forward+loss+
backward+optimizer step of a second model on pre-collated batches held in memory, no loader) for the
same number of iterations, timed right after that epoch; then the median epoch / floor ratios.

    python benchmarks/bench_train.py --data ../shared/datasets/bccd/data.yaml --imgsz 320 --epochs 6
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
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--amp", default="auto", choices=("auto", "bf16", "off"))
    parser.add_argument("--channels-last", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--cache", default=None, choices=("ram", "disk", "auto", "off"),
                        help="train.py's --cache; default: train.py's default (auto)")
    parser.add_argument("--project", default=str(ROOT / "runs/bench"))
    return parser.parse_args()


def run_trainer(args, floor) -> list:
    """Train for ``args.epochs``; after each epoch (its validation and checkpoints included) time the
    compute floor for as many iterations, so every epoch has a floor measured right beside it (this
    machine's speed drifts by +-15% over minutes; a ratio of two distant measurements drifts with it)."""
    from utils.config import Hyp
    from utils.loggers import setup_logging
    from utils.trainer import setup_process, train
    from utils.callbacks import Callbacks

    setup_logging(verbose=False)
    epochs, last_tick = [], [time.perf_counter()]

    def record(epoch, values, fitness, stats):
        wall = time.perf_counter() - last_tick[0]
        epochs.append((epoch, stats, wall, values, floor.measure(stats.iterations)))
        last_tick[0] = time.perf_counter()  # the floor's own time is not part of the next epoch

    callbacks = Callbacks()
    callbacks.register_action("on_epoch_stats", callback=record)
    callbacks.register_action("on_train_start", callback=lambda: last_tick.__setitem__(0, time.perf_counter()))
    train(floor.config, Hyp.load("hyp.scratch-low.yaml"), setup_process("cpu"), callbacks=callbacks)
    return epochs


def train_config(args):
    from utils.config import TrainConfig
    from utils.paths import increment_path

    config = TrainConfig(data=args.data, cfg=args.cfg, weights="", imgsz=args.imgsz, batch_size=args.batch_size,
                         epochs=args.epochs, workers=args.workers, device="cpu", noplots=True, noautoanchor=True,
                         amp=args.amp, channels_last=args.channels_last, project=args.project,
                         **({"cache": args.cache} if args.cache else {}))
    config.save_dir = str(increment_path(Path(args.project) / "exp", mkdir=True))
    return config


class ComputeFloor:
    """Forward+loss+backward+optimizer(+EMA) steps of a second model on batches held in memory (one
    epoch of the training loader, collated once): what an epoch would cost with free data loading and
    no validation. Built before training, with 3 untimed warm-up steps (a new model's first steps pay
    one-off kernel selection and allocation costs)."""

    def __init__(self, config):
        import torch

        from utils.config import Hyp
        from utils.data.dataset_yaml import load_data_config
        from utils.data.loader import create_dataloader
        from utils.loss import DetectionLoss
        from utils.trainer.amp import choose_precision, use_channels_last
        from utils.trainer.ema import ModelEMA
        from utils.trainer.loop import TrainStep
        from utils.trainer.optim import accumulate_steps, build_optimizer, scaled_weight_decay
        from utils.trainer.setup import build_training_model

        self.config = config
        hyp = Hyp.load("hyp.scratch-low.yaml")
        data = load_data_config(config.data)
        model = build_training_model(config.cfg, "", len(data.names), data.names)
        channels_last = use_channels_last(config.channels_last, torch.device("cpu"))
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        loader, _ = create_dataloader(data.train, config.imgsz, config.batch_size, 32, hyp=hyp, augment=True,
                                      workers=config.workers, shuffle=True, names=data.names)
        self.batches = [(images.float() / 255, targets) for images, targets, _, _ in loader]
        del loader  # its workers exit
        self.accumulate = accumulate_steps(config.batch_size)
        optimizer = build_optimizer(model, "SGD", hyp.lr0, hyp.momentum,
                                    scaled_weight_decay(hyp.weight_decay, config.batch_size, self.accumulate))
        self.step = TrainStep(model, optimizer, DetectionLoss(model, hyp, imgsz=config.imgsz),
                              choose_precision(config.amp, torch.device("cpu"), model), ModelEMA(model), channels_last)
        model.train()
        self.done = 0
        self._run(3)

    def _run(self, iterations: int) -> None:
        for _ in range(iterations):
            images, targets = self.batches[self.done % len(self.batches)]
            self.step.forward_backward(images, targets)
            if (self.done + 1) % self.accumulate == 0:
                self.step.optimizer_step()
            self.step.counters.global_step += 1
            self.done += 1

    def measure(self, iterations: int) -> float:
        start = time.perf_counter()
        self._run(iterations)
        return time.perf_counter() - start


def main():
    args = parse_args()
    import statistics

    import torch

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, data {args.data}, imgsz {args.imgsz}, "
          f"batch {args.batch_size}, workers {args.workers}, cache {args.cache or 'default'}, amp {args.amp}, "
          f"channels_last {args.channels_last}")
    from utils.memory import keep_freed_memory

    keep_freed_memory()  # as train.py does; the floor runs in this process too, so it gets the same
    floor = ComputeFloor(train_config(args))
    epochs = run_trainer(args, floor)
    print(f"\n{'epoch':>5} {'iters':>5} {'data':>7} {'fwd+bwd':>8} {'opt+EMA':>8} {'val':>7} {'wall':>7} {'floor':>7} "
          f"{'train/fl':>8} {'wall/fl':>8}  mAP50 mAP50-95")
    rows = []
    for epoch, stats, wall, values, floor_time in epochs:
        train_time = stats.data_time + stats.compute_time + stats.optimizer_time
        rows.append((train_time / floor_time, wall / floor_time))
        print(f"{epoch:>5} {stats.iterations:>5} {stats.data_time:>7.2f} {stats.compute_time:>8.2f} "
              f"{stats.optimizer_time:>8.2f} {stats.validation_time:>7.2f} {wall:>7.2f} {floor_time:>7.2f} "
              f"{rows[-1][0]:>8.2f} {rows[-1][1]:>8.2f}  "
              f"{values['metrics/mAP_0.5']:.3f} {values['metrics/mAP_0.5:0.95']:.3f}")
    steady = rows[1:] or rows  # epoch 0 pays worker start-up, first-use allocations and the val loader's start
    print(f"\nsteady epochs (1-{len(rows) - 1}), median of per-epoch ratios to the floor measured right after each:")
    print(f"train part (excl. validation) / floor: {statistics.median(r[0] for r in steady):.2f}")
    print(f"whole epoch (incl. validation, checkpoints) / floor: {statistics.median(r[1] for r in steady):.2f}")


if __name__ == "__main__":
    main()
