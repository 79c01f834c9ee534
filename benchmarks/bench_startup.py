"""Time from ``python train.py`` to the first training step on a large generated dataset, first start and restart,
ours against YOLOv5 v7 on the same files (a timing: run it on an otherwise idle machine).

    python benchmarks/bench_startup.py [--images 100000] [--root /tmp/yolo-bench-100k] [--workers 2] [--imgsz 640]
        [--cache off] [--yolov5 ~/.cache/yolov5-ref-venv/bin/python] [--repeat 1] [--restarts 1] [--cold]

The dataset (``benchmarks/generated_dataset.py``: 96-px JPEGs with 1-3 boxes, and 500 validation images) is made
once under ``--root``. Each run trains yolov5n from scratch, batch 16, 1 epoch, on the CPU, no AutoAnchor, no
plots, and is stopped (its process group killed) as soon as its training bar shows the first batch done; the
time is from starting the process to that moment. "first start": the label caches (ours beside the labels or in
the user cache folder, YOLOv5's ``labels/*.cache``) and our disk image caches removed first; "restart": the same
command again, with the caches the first start left. Ours and YOLOv5 alternate, ``--repeat`` rounds. YOLOv5 runs
in its own environment (benchmarks/reference/README.md); without it only our rows are printed.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_memory import cpu_name  # noqa: E402
from benchmarks.generated_dataset import make_dataset  # noqa: E402

TRAIN_BAR = re.compile(r"[\d.]+G\s.*\|\s*1/\d+ \[")  # the training bar (its memory column) with one batch done
TIMEOUT = 3600


def clear_caches(data: Path, user_cache: Path) -> None:
    for cache in (data.parent / "labels").glob("*.cache*"):  # ours (train.cache.npz) and YOLOv5's (train.cache)
        cache.unlink()
    shutil.rmtree(user_cache, ignore_errors=True)


def time_to_first_step(command: list[str], env: dict, cwd: Path) -> tuple[float | None, str]:
    """Seconds from start to the first batch done (None if the run ended first), and the output's end."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    tail, elapsed = "", None
    try:
        for chunk in iter(lambda: process.stdout.read1(4096), b""):
            text = chunk.decode("utf-8", "replace")
            tail = (tail + text)[-3000:]
            if any(TRAIN_BAR.search(line) for line in re.split(r"[\r\n]", tail)):
                elapsed = time.perf_counter() - start
                break
            if time.perf_counter() - start > TIMEOUT:
                break
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    return elapsed, tail


def drop_page_cache() -> None:
    """Write back and drop the kernel's page cache (needs root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        sys.exit(f"--cold: cannot drop the page cache ({e.strerror or e}); run as root or without --cold")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=100000)
    parser.add_argument("--root", default="/tmp/yolo-bench-100k")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--cache", default="off", help="our --cache (YOLOv5 runs without a cache)")
    parser.add_argument("--yolov5", default=str(Path.home() / ".cache" / "yolov5-ref-venv" / "bin" / "python"),
                        help="the YOLOv5 v7 environment's python ('' for our rows only)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--restarts", type=int, default=1,
                        help="restarts timed after each first start (the first right after it: its files just written)")
    parser.add_argument("--cold", action="store_true",
                        help="empty the page cache before each first start, so every trainer reads the files from disk "
                             "(root only; without it whoever runs first pays the disk reads)")
    args = parser.parse_args()
    data = make_dataset(Path(args.root), args.images)
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    user_cache = work / "user-cache"
    common = ["--data", str(data), "--weights", "", "--imgsz", str(args.imgsz), "--batch-size", "16", "--epochs", "1",
              "--workers", str(args.workers), "--device", "cpu", "--noautoanchor", "--noplots", "--project",
              str(work / "runs")]
    ours = [sys.executable, str(ROOT / "train.py"), "--cfg", str(ROOT / "models" / "yolov5n.yaml"), "--cache",
            args.cache, "--no-tensorboard", *common]
    theirs = [args.yolov5, "-m", "yolov5.train", "--cfg", "yolov5n.yaml", *common]
    env = {**os.environ, "YOLO_TRAINER_CACHE": str(user_cache)}
    their_env = {**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    runners = [("ours", ours, env, ROOT)]
    if args.yolov5 and Path(args.yolov5).exists():
        runners.append(("YOLOv5 v7", theirs, their_env, work))
    print(f"# time to the first training step: {args.images} images ({args.root}), imgsz {args.imgsz}, "
          f"{args.workers} workers, our --cache {args.cache}{', page cache dropped before each first start' if args.cold else ''}; "
          f"{cpu_name()}")
    print("| round | trainer | first start (s) | restart (s) |")
    print("|---|---|---|---|")
    for round_number in range(1, args.repeat + 1):
        for name, command, environment, cwd in runners:
            clear_caches(data, user_cache)
            if args.cold:
                drop_page_cache()
            times = []
            for attempt in range(1 + args.restarts):
                seconds, tail = time_to_first_step(command + ["--name", f"{name[:4]}-{round_number}-{attempt}"],
                                                   environment, cwd)
                times.append("-" if seconds is None else f"{seconds:.1f}")
                if seconds is None:
                    print(f"  {name}: no training step seen; output's end: {tail[-800:]!r}")
            print(f"| {round_number} | {name} | {times[0]} | {', '.join(times[1:])} |", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
