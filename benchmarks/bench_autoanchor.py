"""AutoAnchor's report on a dataset: BPR and anchors/target before and after, the anchors, the time taken.

    python benchmarks/bench_autoanchor.py                           # BCCD train split at 320, yolov5n anchors
    python benchmarks/bench_autoanchor.py --data path/data.yaml --imgsz 640
    python benchmarks/bench_autoanchor.py --synthetic-elongated     # generated 10:1 bars the COCO anchors miss
    python benchmarks/bench_autoanchor.py --search                  # also time k-means + the genetic search

The check only searches when BPR < 0.98; ``--search`` runs k-means + the genetic search regardless and
prints its anchors' fit beside the current ones (timing the search on data whose anchors already fit).
Labels are scanned without the label cache, so nothing is written next to the dataset.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "datasets" / "bccd" / "data.yaml"


def dataset_labels(data: str, workers: int):
    """(labels, shapes, nc, description) of a data YAML's train split."""
    from utils.data.dataset_yaml import load_data_config
    from utils.data.verify import scan_split

    config = load_data_config(data)
    split = scan_split(config.train, config.nc, workers=workers, use_cache=False)
    return split.labels, split.shapes, config.nc, f"{config.yaml_file} train ({len(split.labels)} images)"


def elongated_labels(count: int, seed: int):
    """Boxes 10x wider than high on 640x480 images, 8 per image, 16-240 px wide at 640."""
    rng = np.random.default_rng(seed)
    images = max(1, count // 8)
    labels = []
    for _ in range(images):
        width = rng.uniform(16, 240, 8) / 640
        height = width * 640 / 10 / 480
        centre = rng.uniform(0.3, 0.7, (8, 2))
        labels.append(np.c_[np.zeros(8), centre, width, height].astype(np.float32))
    return labels, np.tile([[640, 480]], (images, 1)), 1, f"synthetic 10:1 bars ({images * 8} boxes)"


def fit_line(name: str, anchors, wh, thr: float) -> str:
    from utils.autoanchor import anchor_fit, anchor_fitness

    bpr, per_target = anchor_fit(anchors, wh, thr)
    return f"{name}: BPR {bpr:.4f}, {per_target:.2f} anchors/target, fitness {anchor_fitness(anchors, wh, thr):.4f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--synthetic-elongated", action="store_true", help="generated 10:1 boxes instead of --data")
    parser.add_argument("--boxes", type=int, default=2000, help="number of synthetic boxes")
    parser.add_argument("--cfg", default=str(ROOT / "models" / "yolov5n.yaml"))
    parser.add_argument("--imgsz", type=int, default=320)
    parser.add_argument("--thr", type=float, default=4.0, help="hyp anchor_t")
    parser.add_argument("--generations", type=int, default=1000)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--search", action="store_true", help="also run k-means + the genetic search regardless")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    from models.yolo import DetectionModel
    from utils.autoanchor import anchor_pixels, adapt_anchors, format_anchors, evolve_anchors, label_wh

    if args.synthetic_elongated:
        labels, shapes, nc, description = elongated_labels(args.boxes, args.seed)
    else:
        labels, shapes, nc, description = dataset_labels(args.data, args.workers)
    model = DetectionModel(args.cfg, nc=nc)
    print(f"{description}, imgsz {args.imgsz}, anchor_t {args.thr:g}, {Path(args.cfg).name}")
    print("before: " + format_anchors(model))
    current = anchor_pixels(model).reshape(-1, 2)
    report = adapt_anchors(model, labels, shapes, args.imgsz, args.thr, args.seed, args.generations,
                           args.time_limit, progress=False)
    before = "n/a" if report.bpr_before is None else f"{report.bpr_before:.4f}"
    print(f"{report.boxes} boxes; BPR before {before}, after {report.bpr_after:.4f}; anchors/target before "
          f"{report.anchors_per_target_before:.2f}, after {report.anchors_per_target_after:.2f}; "
          f"adopted {report.adopted}; {report.seconds:.2f} s")
    print(report.message)
    print("after: " + format_anchors(model))
    if args.search:
        wh = label_wh(labels, shapes, args.imgsz, np.random.default_rng([args.seed, 1]))
        start = time.perf_counter()
        found = evolve_anchors(wh, len(current), args.imgsz, args.thr, args.generations, args.seed,
                              args.time_limit, progress=False)
        seconds = time.perf_counter() - start
        print(fit_line("current anchors", current, wh, args.thr))
        print(fit_line(f"k-means + {args.generations} generations ({seconds:.2f} s)", found, wh, args.thr))
        print("searched anchors: " + ", ".join(f"{w:.1f}x{h:.1f}" for w, h in found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
