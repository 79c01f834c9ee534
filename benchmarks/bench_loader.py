"""Training-loader throughput with the default augmentation (mosaic, perspective, HSV, flips), ours beside
YOLOv5 v7's loader on the same files in the same run (a timing: run it on an otherwise idle machine).

    python benchmarks/bench_loader.py                 # three kinds of generated data, 640, 1..N workers
    python benchmarks/bench_loader.py --data path/to/data.yaml --imgsz 640 320 --workers 0 2
    python benchmarks/bench_loader.py --profile       # where one worker's time goes, per stage

Kinds (``benchmarks/generated_dataset.py``, made once under ``--root``): ``coco`` 640x480 JPEGs, ``phone``
12-megapixel JPEGs, ``png`` 640x480 PNGs. Workers: 1, 2, 4, ... up to the CPU count (``--workers`` to choose).
Each row is one fresh process (``--cell``): batch 16, hyp.scratch-low, shuffle, no cache unless the row says
so, mosaic partners from the dataset (YOLOv5's draw, our default; ``--partners dataset batch`` adds rows with the
``--mosaic-partners batch`` opt-in); the prefetched batches are drained, then images are counted over >= ``--seconds``
(loader_timing.py).
"images per CPU-s" counts the CPU time of the main process and every worker: the per-core figure, so a
machine with C cores makes about C times that many images a second. YOLOv5 runs in its own environment
(benchmarks/reference/README.md, ``--yolov5``); without it only our rows are printed. The two alternate
cell by cell, ``--rounds`` times; the summary takes each side's median.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_memory import cpu_name  # noqa: E402
from benchmarks.generated_dataset import PHOTO_KINDS, make_photo_dataset  # noqa: E402
from benchmarks.loader_timing import time_loader  # noqa: E402

KIND_IMAGES = {"coco": 512, "phone": 128, "png": 512}  # enough for several epochs' worth of distinct mosaics
REFERENCE = ROOT / "benchmarks" / "reference" / "yolov5_loader.py"


def default_workers() -> list[int]:
    cpus = os.cpu_count() or 1
    counts = [1]
    while counts[-1] * 2 <= cpus:
        counts.append(counts[-1] * 2)
    return counts + ([cpus] if counts[-1] != cpus else [])


def train_images(data_yaml: Path) -> tuple[Path, int]:
    """The train split's image folder (as YOLOv5 takes it) and the class count."""
    from utils.safe_yaml import read_yaml

    config = read_yaml(data_yaml)
    root = (data_yaml.parent / config.get("path", ".")).resolve()
    return root / config["train"], len(config["names"])


def warm_page_cache(folder: Path) -> None:
    """Read every file once, so that no row pays the first read from disk."""
    for path in folder.parent.parent.rglob("*"):
        if path.is_file():
            path.read_bytes()


def our_loader(images: Path, nc: int, imgsz: int, workers: int, cache: str | None, batch_size: int,
               partners: str = "dataset"):
    """(loader, endless iterator of batch sizes) for our training loader."""
    from utils.config import Hyp
    from utils.data.loader import create_dataloader, set_loader_epoch
    from utils.data.verify import scan_split

    split = scan_split([str(images)], nc)
    loader, _ = create_dataloader(None, imgsz, batch_size, 32, hyp=Hyp.load("hyp.scratch-low.yaml"), augment=True,
                                  cache=cache, workers=workers, shuffle=True, seed=0, labels=split,
                                  mosaic_partners=partners)

    def batches():
        epoch = 0
        while True:
            set_loader_epoch(loader, epoch)
            for batch in loader:
                yield batch[0].shape[0]
            epoch += 1

    return loader, batches()


def run_cell(args) -> None:
    """One row, in this (fresh) process: prints one JSON line."""
    cell = json.loads(args.cell)
    loader, batches = our_loader(Path(cell["images"]), cell["nc"], cell["imgsz"], cell["workers"], cell["cache"],
                                 cell["batch_size"], cell.get("partners", "dataset"))
    print(json.dumps(time_loader(loader, batches, cell["seconds"])), flush=True)


def measure(partners: str | None, python: str, cell: dict) -> dict | None:
    """Run one cell in a fresh process: ours with mosaic partners ``partners``, or YOLOv5 v7 (None); None (and the
    reason printed) when it failed."""
    if partners is not None:
        command = [sys.executable, __file__, "--cell", json.dumps({**cell, "partners": partners})]
    else:
        command = [python, str(REFERENCE), "--images", cell["images"], "--imgsz", str(cell["imgsz"]), "--workers",
                   str(cell["workers"]), "--seconds", str(cell["seconds"]), "--batch-size", str(cell["batch_size"])]
    completed = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    if completed.returncode or not lines:
        side = "this project's loader" if partners is not None else "YOLOv5's loader"
        print(f"  {side} failed (exit {completed.returncode}): {(completed.stderr or completed.stdout)[-600:]}")
        return None
    return json.loads(lines[-1])


STAGES = {  # label: (function name, file suffix)
    "decode": ("read_jpeg", "dataset.py"),
    "exif header": ("exif_orientation", "images.py"),
    "load+resize": ("_load_resized", "dataset.py"),
    "mosaic tiles": ("mosaic4", "transforms.py"),
    "warp": ("warp_image", "transforms.py"),
    "boxes": ("transform_boxes", "transforms.py"),
    "hsv": ("augment_hsv", "transforms.py"),
    "flips": ("random_flips", "transforms.py"),
    "to tensor": ("to_rgb_tensor", "dataset.py"),
    "collate": ("collate", "dataset.py"),
}


def profile(label: str, images: Path, nc: int, imgsz: int, batch_size: int, batches: int,
            partners: str = "dataset") -> None:
    """Where one worker's time goes: single process, single-threaded like a loader worker."""
    import cv2
    import torch

    from utils.config import Hyp
    from utils.data.dataset import YoloDataset, collate
    from utils.data.verify import scan_split
    from utils.memory import keep_freed_memory

    cv2.setNumThreads(0)  # as in a loader worker
    torch.set_num_threads(1)
    keep_freed_memory()
    dataset = YoloDataset(scan_split([str(images)], nc), imgsz=imgsz, batch_size=batch_size, augment=True,
                          hyp=Hyp.load("hyp.scratch-low.yaml"), mosaic_partners=partners)
    for i in range(min(len(dataset), batch_size)):  # warm-up: buffers, imports
        dataset[(i, 1)]
    profiler = cProfile.Profile(time.process_time)  # CPU time: robust when others share the machine
    start = time.process_time()
    profiler.enable()
    count = 0
    for b in range(batches):
        batch = range(b * batch_size, (b + 1) * batch_size)
        items = dataset.__getitems__([(int(i) % len(dataset), 0) for i in batch])
        collate(items)
        count += len(items)
    profiler.disable()
    total = (time.process_time() - start) / count * 1e3
    stats = pstats.Stats(profiler).stats
    print(f"\nprofile {label}, imgsz {imgsz}, mosaic partners from the {partners}, 1 process, {count} images: "
          f"{total:.2f} ms/image CPU "
          "(cProfile overhead included)")
    cumulative = {name: sum(v[3] for k, v in stats.items() if k[2] == function and k[0].endswith(suffix))
                  for name, (function, suffix) in STAGES.items()}
    cumulative["mosaic tiles"] -= cumulative["load+resize"]  # images are loaded lazily inside mosaic4
    for name, seconds in cumulative.items():
        print(f"  {name:13s} {seconds / count * 1e3:6.2f} ms/image")
    print("  (load+resize includes decode and the exif header; warp includes the BGR<->BGRA conversions)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="a data.yaml of yours instead of the generated kinds")
    parser.add_argument("--kinds", nargs="+", default=list(PHOTO_KINDS), choices=list(PHOTO_KINDS))
    parser.add_argument("--root", default="/tmp/yolo-bench-loader", help="where the generated kinds are made")
    parser.add_argument("--imgsz", type=int, nargs="+", default=[640])
    parser.add_argument("--workers", type=int, nargs="+", default=default_workers())
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0, help="timed window per row")
    parser.add_argument("--rounds", type=int, default=1, help="alternations of ours and YOLOv5 per row")
    parser.add_argument("--cache-rows", action="store_true", help="add our --cache ram rows (most workers)")
    parser.add_argument("--partners", nargs="+", default=["dataset"], choices=("dataset", "batch"),
                        help="our --mosaic-partners setting(s): a row of ours for each")
    parser.add_argument("--yolov5", default=str(Path.home() / ".cache/yolov5-ref-venv/bin/python"),
                        help="the YOLOv5 v7 environment's python ('' for our rows only)")
    parser.add_argument("--profile", action="store_true", help="print where one worker's time goes, per kind")
    parser.add_argument("--profile-batches", type=int, default=8)
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        return run_cell(args)

    if args.data:
        datasets = [(Path(args.data).stem, Path(args.data))]
    else:
        datasets = [(kind, make_photo_dataset(Path(args.root) / kind, kind, KIND_IMAGES[kind])) for kind in args.kinds]
    trainers = {f"ours ({partners})": partners for partners in args.partners}  # row label -> our partners
    if args.yolov5 and Path(args.yolov5).exists():
        trainers["YOLOv5 v7"] = None
    load = os.getloadavg()[0]
    print(f"# training loader, batch {args.batch_size}, hyp.scratch-low, >= {args.seconds:.0f} s per row, "
          f"{args.rounds} round(s); {cpu_name()}, load average {load:.2f} before the run")
    print("| data | imgsz | workers | cache | trainer | images/s | CPU ms/image (system, main) | images per CPU-s |")
    print("|---|---|---|---|---|---|---|---|")
    summary = []
    for label, data in datasets:
        images, nc = train_images(data)
        warm_page_cache(images)
        cells = [(imgsz, workers, None) for imgsz in args.imgsz for workers in args.workers]
        if args.cache_rows:
            cells += [(imgsz, max(args.workers), "ram") for imgsz in args.imgsz]
        for imgsz, workers, cache in cells:
            cell = {"images": str(images), "nc": nc, "imgsz": imgsz, "workers": workers, "cache": cache,
                    "seconds": args.seconds, "batch_size": args.batch_size}
            per_core = {}
            for _ in range(args.rounds):
                for trainer in list(trainers) if cache is None else list(trainers)[:1]:
                    result = measure(trainers[trainer], args.yolov5, cell)
                    if result is None:
                        continue
                    per_core.setdefault(trainer, []).append(result["images_per_cpu_s"])
                    print(f"| {label} | {imgsz} | {workers} | {cache or 'none'} | {trainer} | "
                          f"{result['images_per_s']:.1f} | {result['cpu_ms']:.1f} ({result['system_ms']:.1f}, "
                          f"{result['main_ms']:.1f}) | {result['images_per_cpu_s']:.2f} |", flush=True)
            theirs = statistics.median(per_core["YOLOv5 v7"]) if "YOLOv5 v7" in per_core else None
            for trainer in [label for label, partners in trainers.items() if partners] if theirs else []:
                if trainer in per_core:
                    ours = statistics.median(per_core[trainer])
                    summary.append(f"| {label} | {imgsz} | {workers} | {trainer} | {ours:.2f} | {theirs:.2f} | "
                                   f"{ours / theirs:.2f}x |")
    if summary:
        print("\n| data | imgsz | workers | ours (mosaic partners) | images per CPU-s | YOLOv5 v7 | ours / YOLOv5 |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(summary))
    if args.profile:
        for label, data in datasets:
            images, nc = train_images(data)
            for imgsz in args.imgsz:
                for partners in args.partners:
                    profile(label, images, nc, imgsz, args.batch_size, args.profile_batches, partners)


if __name__ == "__main__":
    main()
