"""Would validating on a second thread, while the next epoch trains, shorten an epoch on this machine?

Times one epoch's worth of training steps of the compute floor (bench_train.py's ComputeFloor: BCCD batches
held in memory, fp32 or the --amp choice) and one validation of the val set, first one after the other, then
with the validation on a second thread (``--val-threads`` compute threads) while the steps run. On a CPU
whose cores the training already keeps busy the overlapped total is no shorter.

First it prints the steps' parallel efficiency (their time on 1 thread / (2 x their time on 2)): what is not
efficient is time a core spends spinning at OpenMP barriers or waiting on the main thread's Python, the only
room a second thread could use. ``--val-sched idle`` runs the validation thread under SCHED_IDLE (Linux), so
it gets a core only when nothing else wants it; GOMP_SPINCOUNT / OMP_WAIT_POLICY in the environment change how
long the training's idle threads spin before sleeping.

    python benchmarks/bench_val_overlap.py --repeats 4
    GOMP_SPINCOUNT=10000 python benchmarks/bench_val_overlap.py --val-sched idle --amp auto
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT.parent / "shared/datasets/bccd/data.yaml"))
    parser.add_argument("--imgsz", type=int, default=320)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--amp", default="off", choices=("auto", "bf16", "off"))
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--val-threads", type=int, default=1, help="compute threads of the validation thread")
    parser.add_argument("--val-sched", default="other", choices=("other", "idle"),
                        help="scheduling policy of the validation thread (idle: SCHED_IDLE)")
    return parser.parse_args()


def main():
    args = parse_args()
    import torch

    from bench_train import ComputeFloor, train_config
    from models.fused import FusedCopy
    from utils.config import Hyp
    from utils.data.dataset_yaml import load_data_config
    from utils.data.loader import create_dataloader
    from utils.loggers import setup_logging
    from utils.memory import keep_freed_memory
    from utils.validation import validate

    keep_freed_memory()
    setup_logging(verbose=False)
    options = argparse.Namespace(data=args.data, cfg=str(ROOT / "models/yolov5n.yaml"), imgsz=args.imgsz,
                                 batch_size=args.batch_size, epochs=1, workers=2, amp=args.amp, channels_last="auto",
                                 cache=None, project=str(ROOT / "runs/bench"))
    floor = ComputeFloor(train_config(options))
    data = load_data_config(args.data)
    val_loader, _ = create_dataloader(data.val, args.imgsz, args.batch_size * 2, 32, hyp=Hyp.load("hyp.scratch-low.yaml"),
                                      augment=False, rect=True, pad=0.5, workers=0, names=data.names, cache="ram")
    fused = FusedCopy(floor.step.ema.ema)
    iterations = len(floor.batches)

    def validation(threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)  # this thread's team; torch's default too, restored after
            if args.val_sched == "idle":
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread (Linux)
        with floor.step.precision.autocast():
            validate(fused.refresh(), val_loader, data.names, torch.device("cpu"), plots=False)

    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
        one = min(floor.measure(iterations) for _ in range(2))
        torch.set_num_threads(threads)
        many = min(floor.measure(iterations) for _ in range(2))
        print(f"{iterations} training steps: {one:.2f} s on 1 thread, {many:.2f} s on {threads}: parallel efficiency "
              f"{one / (threads * many):.0%}")
    validation()  # warm-up
    print(f"{iterations} training steps + one validation of {len(val_loader.dataset)} images, "
          f"{torch.get_num_threads()} threads for training, amp {args.amp}")
    for _ in range(args.repeats):
        start = time.perf_counter()
        floor.measure(iterations)
        validation()
        in_line = time.perf_counter() - start
        start = time.perf_counter()
        worker = threading.Thread(target=validation, args=(args.val_threads,))
        worker.start()
        floor.measure(iterations)
        worker.join()
        torch.set_num_threads(threads)  # the process-wide default the worker changed
        overlapped = time.perf_counter() - start
        print(f"one after the other {in_line:.2f} s, validation on a second thread {overlapped:.2f} s "
              f"({overlapped / in_line:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
