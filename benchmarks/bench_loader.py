"""Training-loader throughput (images/s) with full augmentation (mosaic, perspective, HSV, flips).

    python benchmarks/bench_loader.py [--data ../shared/datasets/bccd/data.yaml] [--epochs 3] [--profile]

Rows: imgsz 640 and 320 x workers 0 and 2, no cache, plus --cache ram rows; batch 16,
hyp.scratch-low, shuffle on, one warm-up epoch (worker start-up, file cache) not timed.
--profile prints where the time goes per image (single process, cProfile).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from utils.config import Hyp  # noqa: E402
from utils.data.dataset import LabelSet, YoloDataset, collate  # noqa: E402
from utils.data.images import IMG_EXTENSIONS  # noqa: E402
from utils.data.loader import create_dataloader, set_loader_epoch  # noqa: E402


def train_labels(data_yaml: Path):
    """The train split's labels: utils.data.verify.scan_split when present, else a plain listing."""
    config = yaml.safe_load(data_yaml.read_text())
    root = (data_yaml.parent / config.get("path", ".")).resolve()
    source = root / config["train"]
    names = config["names"]
    names = [names[k] for k in sorted(names)] if isinstance(names, dict) else list(names)
    try:
        from utils.data.verify import scan_split

        return scan_split([str(source)], len(names)), names
    except ImportError:
        return list_split(source), names


def list_split(folder: Path) -> LabelSet:
    from PIL import Image

    files = sorted(p for p in folder.rglob("*") if p.suffix[1:].lower() in IMG_EXTENSIONS)
    labels, shapes = [], []
    for path in files:
        label_file = Path(str(path.parent).replace("/images", "/labels")) / f"{path.stem}.txt"
        rows = np.loadtxt(label_file, ndmin=2, dtype=np.float32) if label_file.exists() else np.zeros((0, 5))
        labels.append(rows.reshape(-1, 5).astype(np.float32))
        with Image.open(path) as im:
            shapes.append(im.size)
    return LabelSet([str(p) for p in files], labels, np.array(shapes))


def process_cpu_seconds(pid: int) -> np.ndarray:
    """(user, system) CPU seconds of a live process (Linux /proc), zeros when unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return np.array([int(fields[11]), int(fields[12])]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return np.zeros(2)


def measure(split, imgsz, workers, cache, epochs, hyp, batch_size):
    """(images/s wall clock, CPU ms per image over the main process and workers, of which system
    (kernel: page faults, shared memory, file reads), of which main process)."""
    loader, dataset = create_dataloader(None, imgsz, batch_size, 32, hyp=hyp, augment=True, cache=cache,
                                        workers=workers, shuffle=True, seed=0, labels=split)
    count, pids = 0, [os.getpid()]
    for epoch in range(epochs + 1):  # epoch 0 warms up (workers, page cache)
        set_loader_epoch(loader, epoch)
        iterator = iter(loader)
        if epoch == 1:  # persistent workers, started in epoch 0
            pids += [w.pid for w in getattr(getattr(loader, "_iterator", None), "_workers", [])]
            cpu_start = [process_cpu_seconds(pid) for pid in pids]
            start = time.perf_counter()
        for images, _, _, _ in iterator:
            if epoch >= 1:
                count += images.shape[0]
    elapsed = time.perf_counter() - start
    cpu = [process_cpu_seconds(pid) - begin for pid, begin in zip(pids, cpu_start)]
    total = sum(cpu) / count * 1e3
    return count / elapsed, total.sum(), total[1], cpu[0].sum() / count * 1e3


STAGES = {  # label: (function name, file suffix)
    "decode": ("read_jpeg", "dataset.py"),
    "load+resize": ("_load_resized", "dataset.py"),
    "mosaic tiles": ("mosaic4", "transforms.py"),
    "warp": ("warp_image", "transforms.py"),
    "boxes": ("transform_boxes", "transforms.py"),
    "hsv": ("augment_hsv", "transforms.py"),
    "flips": ("random_flips", "transforms.py"),
    "to tensor": ("to_rgb_tensor", "dataset.py"),
    "collate": ("collate", "dataset.py"),
}


def profile(split, imgsz, hyp, batch_size, batches=40):
    """Where one worker's time goes: single process, single-threaded like a loader worker."""
    import cv2
    import torch

    from utils.memory import keep_freed_memory

    cv2.setNumThreads(0)  # as in a loader worker
    torch.set_num_threads(1)
    keep_freed_memory()
    dataset = YoloDataset(split, imgsz=imgsz, batch_size=batch_size, augment=True, hyp=hyp)
    for i in range(len(dataset)):  # warm-up: page cache, per-process EXIF cache, buffers
        dataset[(i, 1)]
    profiler = cProfile.Profile(time.process_time)  # CPU time: robust when others share the machine
    start = time.process_time()
    profiler.enable()
    count = 0
    for b in range(batches):
        items = [dataset[(int(i) % len(dataset), 0)] for i in range(b * batch_size, (b + 1) * batch_size)]
        collate(items)
        count += len(items)
    profiler.disable()
    total = (time.process_time() - start) / count * 1e3
    stats = pstats.Stats(profiler).stats
    print(f"\nprofile imgsz {imgsz}, 1 process, {count} images: {total:.2f} ms/image CPU (cProfile overhead included)")
    cumulative = {label: sum(v[3] for k, v in stats.items() if k[2] == name and k[0].endswith(suffix))
                  for label, (name, suffix) in STAGES.items()}
    cumulative["mosaic tiles"] -= cumulative["load+resize"]  # images are loaded lazily inside mosaic4
    for label, seconds in cumulative.items():
        print(f"  {label:13s} {seconds / count * 1e3:6.2f} ms/image")
    print("  (load+resize includes decode; warp includes the BGR<->BGRA conversions)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT.parent / "shared/datasets/bccd/data.yaml"))
    parser.add_argument("--hyp", default="hyp.scratch-low.yaml")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs after one warm-up epoch")
    parser.add_argument("--imgsz", type=int, nargs="+", default=[640, 320])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--no-cache-row", action="store_true", help="skip the --cache ram rows")
    parser.add_argument("--profile", action="store_true", help="print a per-stage breakdown per image")
    args = parser.parse_args()
    hyp = Hyp.load(args.hyp)
    split, _ = train_labels(Path(args.data))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {os.cpu_count()} CPUs, load average {load:.2f} before the run (others' work skews wall-clock)")
    print(f"{args.data}: {len(split.im_files)} train images, batch {args.batch_size}, {args.hyp}, "
          f"{args.epochs} timed epochs")
    rows = [(s, w, None) for s in args.imgsz for w in args.workers]
    if not args.no_cache_row:
        rows += [(s, max(args.workers), "ram") for s in args.imgsz]
    for imgsz, workers, cache in rows:
        rate, cpu_ms, system_ms, main_ms = measure(split, imgsz, workers, cache, args.epochs, hyp, args.batch_size)
        print(f"imgsz {imgsz:4d}  workers {workers}  cache {cache or 'none':4s}  {rate:7.1f} images/s   "
              f"(CPU {cpu_ms:5.2f} ms/image over all processes, system {system_ms:4.2f}, main {main_ms:5.2f})",
              flush=True)
    if args.profile:
        for imgsz in args.imgsz:
            profile(split, imgsz, hyp, args.batch_size)


if __name__ == "__main__":
    main()
