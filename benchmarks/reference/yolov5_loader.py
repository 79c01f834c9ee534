"""Same-machine reference: YOLOv5 v7's training loader (PyPI yolov5 7.0.14), measured like benchmarks/bench_loader.py.

    python benchmarks/reference/yolov5_loader.py [--images ../shared/datasets/bccd/images/train] [--imgsz 640 320]
                                                 [--workers 0 2]

Runs only in the separate environment described in benchmarks/reference/README.md; the project never imports it.
Batch 16, hyp.scratch-low, augment (mosaic + full augmentation), shuffle, no cache; one warm-up epoch, then
3 timed epochs, for imgsz 640 and 320 with 0 and 2 workers.
"""
import argparse
import time
from pathlib import Path

import yaml
import yolov5
from yolov5.utils.dataloaders import create_dataloader

ROOT = Path(__file__).resolve().parents[2]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", default=str(ROOT.parent / "shared/datasets/bccd/images/train"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--imgsz", type=int, nargs="+", default=[640, 320])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args()
    hyp = yaml.safe_load((Path(yolov5.__file__).parent / "data/hyps/hyp.scratch-low.yaml").read_text())
    for imgsz in args.imgsz:
        for workers in args.workers:
            loader, _ = create_dataloader(args.images, imgsz, 16, 32, hyp=hyp, augment=True, workers=workers,
                                          shuffle=True, seed=0)
            for _ in loader:  # warm-up epoch (worker start-up, page cache)
                pass
            count, start = 0, time.perf_counter()
            for _ in range(args.epochs):
                for batch in loader:
                    count += batch[0].shape[0]
            rate = count / (time.perf_counter() - start)
            print(f"YOLOv5 loader imgsz {imgsz} workers {workers}: {rate:.1f} images/s", flush=True)


if __name__ == "__main__":
    main()
