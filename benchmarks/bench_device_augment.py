"""--augment-device against today's loader: images/s of the training loader with its images made by OpenCV in the
workers (today), of the plan loader plus the rendering on the training device (``render_plans``) and of the plan
loader alone (``--paths plans``), and how far the two paths' images are apart, with the same draws (a timing: run it
on an otherwise idle machine).

    python benchmarks/bench_device_augment.py --data ../shared/datasets/bccd/data.yaml          # CPU, 640
    python benchmarks/bench_device_augment.py --data DATA --device 0 --workers 4 8 --cache off ram
    python benchmarks/bench_device_augment.py --data DATA --tolerance 8                         # image differences

Each row is one fresh process: batch ``--batch-size``, ``--hyp`` (default hyp.scratch-low), shuffle; the
prefetched batches are drained, then images are counted over >= ``--seconds`` (loader_timing.py). "render" rows
include the copy of the plans to the device and the rendering, synchronised per batch on CUDA. The two paths alternate row by row, ``--rounds`` times; the
summary takes each path's median.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_loader import train_images, warm_page_cache  # noqa: E402
from benchmarks.bench_memory import cpu_name  # noqa: E402
from benchmarks.loader_timing import time_loader  # noqa: E402

PATHS = ("opencv", "render", "plans")  # plans: the plan loader alone, what the workers must sustain on a GPU node


def loader(cell: dict, augment_device: bool):
    from utils.config import Hyp
    from utils.data.loader import create_dataloader
    from utils.data.verify import scan_split

    split = scan_split([cell["images"]], cell["nc"])
    cache = None if cell["cache"] == "off" else cell["cache"]
    made, _ = create_dataloader(None, cell["imgsz"], cell["batch_size"], 32, hyp=Hyp.load(cell["hyp"]),
                                augment=True, cache=cache, workers=cell["workers"], shuffle=True, seed=0,
                                labels=split, augment_device=augment_device)
    return made


def run_cell(cell: dict) -> dict:
    """One row, in this (fresh) process."""
    import torch

    from utils.data.device_augment import hsv_tables, render_plans
    from utils.data.loader import set_loader_epoch

    device = torch.device(cell["device"])
    plans, render = cell["path"] != "opencv", cell["path"] == "render"
    made = loader(cell, plans)
    if render:
        hsv_tables(device)  # made once per run: not part of the steady state

    def batches():
        epoch = 0
        while True:
            set_loader_epoch(made, epoch)
            for images, *_ in made:
                if render:
                    images = render_plans(images, device)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                yield len(images)
            epoch += 1

    return time_loader(made, batches(), cell["seconds"])


def tolerance(cell: dict, batches: int) -> None:
    """Per image, the two paths' images with the same draws: mean absolute difference, 99.9th percentile, largest;
    and the bytes of source pixels a plan sends to the device."""
    import torch

    from utils.data.dataset import collate
    from utils.data.device_augment import render_plans
    from utils.data.plans import collate_plans

    cell = {**cell, "workers": 0}
    opencv, planned = loader(cell, False).dataset, loader(cell, True).dataset
    rows, sent = [], 0
    for b in range(batches):
        items = [(i % len(opencv), 0) for i in range(b * cell["batch_size"], (b + 1) * cell["batch_size"])]
        expected = collate([opencv[item] for item in items])
        batch = collate_plans([planned[item] for item in items])
        assert torch.equal(batch[1], expected[1]), "the boxes differ"
        sent += batch[0].pixels.numel()
        for got, want in zip(render_plans(batch[0], cell["device"]).cpu(), expected[0]):
            diff = (got.int() - want.int()).abs().flatten().float()
            rows.append((float(diff.mean()), float(torch.quantile(diff, 0.999)), float(diff.max()),
                         float((diff > 0).float().mean())))
    worst = [max(r[k] for r in rows) for k in range(4)]
    print(f"{len(rows)} images at {cell['imgsz']}, {cell['hyp']}: boxes identical; per image, worst mean |diff| {worst[0]:.5f}, "
          f"worst 99.9th percentile {worst[1]:g}, largest {worst[2]:g}, worst share of values that differ "
          f"{worst[3]:.5f}; mean over images {statistics.mean(r[0] for r in rows):.5f}; source pixels sent "
          f"{sent / len(rows) / 1e6:.2f} MB per image (the image made: {3 * cell['imgsz'] ** 2 / 1e6:.2f} MB)")


def measure(cell: dict) -> dict | None:
    completed = subprocess.run([sys.executable, __file__, "--cell", json.dumps(cell)], capture_output=True, text=True,
                               cwd=ROOT)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    if completed.returncode or not lines:
        print(f"  failed (exit {completed.returncode}): {(completed.stderr or completed.stdout)[-600:]}")
        return None
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="a data.yaml (its train split is read)")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--hyp", default="hyp.scratch-low.yaml", help="hyperparameters (no copy-paste)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--cache", nargs="+", default=["ram"], choices=("off", "ram"))
    parser.add_argument("--device", default="cpu", help="where plans are rendered: cpu, 0, cuda:0")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed window per row")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the paths per row")
    parser.add_argument("--paths", nargs="+", default=["opencv", "render"], choices=PATHS,
                        help="opencv: today's loader; render: the plan loader + render_plans; plans: the plan loader")
    parser.add_argument("--tolerance", type=int, default=0, metavar="BATCHES",
                        help="only compare the two paths' images over this many batches")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(run_cell(json.loads(args.cell))), flush=True)
        return
    if not args.data:
        parser.error("--data is required")
    images, nc = train_images(Path(args.data))
    device = f"cuda:{args.device}" if args.device.isdigit() else args.device
    base = {"images": str(images), "nc": nc, "imgsz": args.imgsz, "batch_size": args.batch_size, "device": device,
            "seconds": args.seconds, "hyp": args.hyp}
    if args.tolerance:
        tolerance({**base, "cache": "off"}, args.tolerance)
        return
    warm_page_cache(images)
    print(f"# {images}, {args.imgsz}, batch {args.batch_size}, render on {device}; {cpu_name()}, "
          f"load average {os.getloadavg()[0]:.2f} before the run")
    print("| cache | workers | path | images/s (median) | each round | CPU ms/image |")
    print("|---|---|---|---|---|---|")
    for cache in args.cache:
        for workers in args.workers:
            results = {path: [] for path in args.paths}
            for _ in range(args.rounds):
                for path in args.paths:
                    row = measure({**base, "cache": cache, "workers": workers, "path": path})
                    if row is not None:
                        results[path].append(row)
            for path in args.paths:
                rows = results[path]
                if rows:
                    rates = [r["images_per_s"] for r in rows]
                    print(f"| {cache} | {workers} | {path} | {statistics.median(rates):.1f} | "
                          f"{', '.join(f'{r:.1f}' for r in rates)} | "
                          f"{statistics.median(r['cpu_ms'] for r in rows):.1f} |", flush=True)


if __name__ == "__main__":
    main()
