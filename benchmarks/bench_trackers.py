"""What experiment tracking costs a training run: per-epoch time, the trackers' start, and the whole run, with the
trackers on and with --no-trackers, taking turns on the same command (a timing: run it on an otherwise idle machine;
needs requirements-trackers.txt). On: MLflow (a real ``mlflow server`` on 127.0.0.1, SQLite store) and, with
``--all``, W&B (WANDB_MODE=offline), Comet (COMET_MODE=offline) and ClearML (CLEARML_OFFLINE_MODE=1) too, their
files in each run folder.

    python benchmarks/bench_trackers.py [--data data.yaml] [--imgsz 96] [--epochs 10] [--repeat 2] [--images 64]
        [--kill-at 3] [--all]

Without --data a generated dataset (benchmarks/generated_dataset.py: ``--images`` 96-px JPEGs, 16 val) is made under
a temporary folder. Each run trains yolov5n from scratch on the CPU in this process (train.run), no plots, no
TensorBoard; epoch times are measured around each epoch (training, validation, results row, checkpoint), the
"tracker start" around the Recorder's start (MLflow's import on the first run, its experiment and run created), and
the import of each tracker's package alone in a fresh interpreter. Where the CPU goes: each thread's and each child
process's CPU seconds per epoch (psutil, at each epoch's end; the training thread is MainThread, the trackers' worker
threads tracker-<name>, the packages' own threads by their names, the loopback server and wandb-core as processes). A first untracked run warms the caches and is not
counted. ``--kill-at N`` adds one MLflow run whose server is killed (SIGKILL) as epoch N's row is about to be logged,
with MLflow's default retries: its epoch times before and after, and the whole run (the end waits for the queue).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_memory import cpu_name  # noqa: E402
from benchmarks.generated_dataset import make_dataset  # noqa: E402


def timed(owner, name: str, times: list, after=None):
    """``owner.name`` timed into ``times`` (and ``after()`` called after each call); returns the original."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)
            if after is not None:
                after()
    setattr(owner, name, wrapper)
    return original


TRAINING_THREADS = ("MainThread", "other threads")  # the training thread, torch's intra-op threads (no Python name)


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of each thread of this process (by name: the training thread is
    MainThread) and of each process below it (by name: the loopback mlflow server, wandb-core, ...)."""
    import threading

    import psutil

    names = {thread.native_id: re.sub(r"-\d+|\(experiment=[^)]*\)", "", thread.name)  # Thread-118 -> Thread
             for thread in threading.enumerate()}
    me = psutil.Process()
    seconds: dict[str, float] = {}
    for thread in me.threads():
        name = names.get(thread.id, "other threads")
        seconds[name] = seconds.get(name, 0.0) + thread.user_time + thread.system_time
    for child in me.children(recursive=True):
        try:
            times, name = child.cpu_times(), child.name()
        except psutil.Error:
            continue
        seconds[f"process {name}"] = seconds.get(f"process {name}", 0.0) + times.user + times.system
    return seconds


def one_run(options: dict, tracked: bool) -> dict:
    import train
    from utils.trainer import recorder, trainer

    epochs, starts, snapshots = [], [], []  # snapshots: CPU of every thread and child process at each epoch's end
    run_epoch = timed(trainer.Trainer, "_run_epoch", epochs, after=lambda: snapshots.append(cpu_seconds()))
    restart = timed(recorder.Recorder, "restart_results", starts)
    begin = time.perf_counter()
    try:
        train.run(**options, no_trackers=not tracked)
    finally:
        trainer.Trainer._run_epoch, recorder.Recorder.restart_results = run_epoch, restart
    # CPU seconds per epoch after the first, by thread or process (one that started later counts from 0)
    first, last = snapshots[0], snapshots[-1]
    per_epoch = {name: (last[name] - first.get(name, 0.0)) / max(len(snapshots) - 1, 1) for name in last}
    return {"epochs": epochs, "start": starts[0], "wall": time.perf_counter() - begin, "cpu": per_epoch}


SETTLE_SECONDS = 5  # let a new mlflow server's start-up work end before the run starts


def killed_run(options: dict, folder: Path, epoch: int, mlflow_server, stop) -> dict:
    """One MLflow run whose server is killed just before ``epoch``'s row is logged."""
    from utils.trainer import recorder

    log = recorder.Recorder.log
    with mlflow_server(folder / "doomed") as (uri, process):
        os.environ["MLFLOW_TRACKING_URI"] = uri
        time.sleep(SETTLE_SECONDS)

        def log_then_kill(self, at, values):
            if at == epoch:
                stop(process)
            log(self, at, values)
        recorder.Recorder.log = log_then_kill
        try:
            return one_run(options, True)
        finally:
            recorder.Recorder.log = log


OFFLINE = {"WANDB_MODE": "offline", "COMET_MODE": "offline", "CLEARML_OFFLINE_MODE": "1"}
IMPORTS = {"mlflow": "mlflow.tracking", "wandb": "wandb", "comet": "comet_ml", "clearml": "clearml"}


def import_seconds(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def tracker_environment(folder: Path, every: bool) -> None:
    """The offline trackers on (``every``) or off, their own home folders under ``folder``."""
    for name in ("WANDB_API_KEY", "COMET_API_KEY", "CLEARML_API_ACCESS_KEY", *OFFLINE):
        os.environ.pop(name, None)
    if every:
        os.environ.update(OFFLINE)
        for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            os.environ[name] = str(folder / "home" / name.lower())
        os.environ["COMET_CONFIG"] = os.environ["CLEARML_CONFIG_FILE"] = str(folder / "home" / "none")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="")
    parser.add_argument("--imgsz", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--kill-at", type=int, default=0, help="also a run whose server dies at this epoch (0: none)")
    parser.add_argument("--all", action="store_true", help="W&B, Comet and ClearML (offline) on beside MLflow")
    parser.add_argument("--bbox-interval", type=int, default=-1,
                        help="train.py's --bbox_interval (-1: its default, val images every epoch up to 10 epochs)")
    args = parser.parse_args()
    from tests.test_trackers import mlflow_server, stop  # the tests' loopback server

    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        tracker_environment(folder, args.all)
        data = args.data or str(make_dataset(folder / "data", args.images, val=16))
        options = dict(data=data, cfg="models/yolov5n.yaml", weights="", imgsz=args.imgsz, epochs=args.epochs,
                       batch_size=16, workers=2, device="cpu", noautoanchor=True, noplots=True, no_tensorboard=True,
                       project=str(folder / "runs"), bbox_interval=args.bbox_interval)
        with mlflow_server(folder / "mlflow") as (uri, _):
            os.environ["MLFLOW_TRACKING_URI"] = uri
            one_run(options, False)  # warm-up, not counted: label cache, image cache, first imports
            rows = {False: [], True: []}
            for _ in range(args.repeat):
                for tracked in (False, True):
                    rows[tracked].append(one_run(options, tracked))
        killed = killed_run(options, folder, args.kill_at, mlflow_server, stop) if args.kill_at else None
    on = "MLflow, W&B, Comet, ClearML" if args.all else "MLflow"
    print(f"# {cpu_name()}; {args.epochs} epochs of yolov5n at {args.imgsz}, {data}, {args.repeat} runs each; on: {on}")
    for tracked, runs in rows.items():
        later = [t for run in runs for t in run["epochs"][1:]]
        starts = ", ".join(f"{run['start']:.2f}" for run in runs)
        walls = ", ".join(f"{run['wall']:.1f}" for run in runs)
        print(f"{'on  ' if tracked else 'none'}: epoch median {statistics.median(later):.3f} s "
              f"(mean {statistics.mean(later):.3f}, {len(later)} epochs after each run's first); "
              f"tracker start {starts} s; whole run {walls} s")
        cpu: dict[str, list] = {}
        for run in runs:
            for name, seconds in run["cpu"].items():
                cpu.setdefault(name, []).append(seconds)
        shown = sorted(((statistics.median(values), name) for name, values in cpu.items()), reverse=True)
        training = sum(seconds for seconds, name in shown if name in TRAINING_THREADS)
        print(f"      CPU s per epoch after the first (median of runs): training {training:.3f} (MainThread and "
              f"torch's threads), the rest {sum(s for s, name in shown if name not in TRAINING_THREADS):.3f}: "
              + ", ".join(f"{name} {seconds:.3f}" for seconds, name in shown
                          if seconds >= 0.005 and name not in TRAINING_THREADS))
    for name, module in IMPORTS.items() if args.all else [("mlflow", "mlflow.tracking")]:
        print(f"import {module} in a fresh interpreter: {import_seconds(module):.2f} s")
    if killed:
        before, after = killed["epochs"][1:args.kill_at], killed["epochs"][args.kill_at:]
        print(f"MLflow, server killed at epoch {args.kill_at}: epoch median {statistics.median(before):.3f} s before "
              f"(epochs 1-{args.kill_at - 1}), {statistics.median(after):.3f} s from then on; whole run "
              f"{killed['wall']:.1f} s")


if __name__ == "__main__":
    main()
