"""Same-machine reference: YOLOv5 v7's training loader (PyPI yolov5 7.0.14), timed like benchmarks/bench_loader.py.

    python benchmarks/reference/yolov5_loader.py --images DIR [--imgsz 640] [--workers 2] [--seconds 30]

Runs only in the separate environment described in benchmarks/reference/README.md (bench_loader.py starts it
there); the project never imports it. The timing is benchmarks/loader_timing.py's, the same as ours.
Batch 16, hyp.scratch-low, augment (mosaic + full augmentation), shuffle, no cache; prints one JSON line.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: YOLOv5 has a module of that name

import yaml  # noqa: E402
import yolov5  # noqa: E402
from loader_timing import time_loader  # noqa: E402
from yolov5.utils.dataloaders import create_dataloader  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", required=True)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    hyp = yaml.safe_load((Path(yolov5.__file__).parent / "data/hyps/hyp.scratch-low.yaml").read_text())
    loader, _ = create_dataloader(args.images, args.imgsz, args.batch_size, 32, hyp=hyp, augment=True,
                                  workers=args.workers, shuffle=True, seed=0)

    def batches():
        while True:  # InfiniteDataLoader: its workers persist across these passes
            for batch in loader:
                yield batch[0].shape[0]

    print(json.dumps(time_loader(loader, batches(), args.seconds)), flush=True)


if __name__ == "__main__":
    main()
