"""Validation speed per image (pre-process, inference, NMS) as val.py prints it, plus the wall time of a pass.

    python benchmarks/bench_val.py                                   # BCCD val, yolov5n (random init), 320, b32, CPU
    python benchmarks/bench_val.py --weights runs/train/exp/weights/best.pt --passes 3

YOLOv5 v7 on BCCD val (imgsz 320, batch 32, CPU): 0.7 ms pre-process, 11.7 ms inference, 7.4 ms NMS per
image (19.8 ms); the target is <= 2/3 of that (13.2 ms). A random-init model is slower in NMS than a
trained one at conf 0.001 (it scores everything near the threshold), so pass trained weights for the
comparable figure. The best of ``--passes`` passes is reported (the first also warms the model up).
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

YOLOV5_MS = (0.7, 11.7, 7.4)


def build_model(weights: str | None, nc: int, device, channels_last: bool):
    """The model as val.py prepares it (fused, channels_last, Conv + SiLU in one call on the CPU), or fused
    only for comparison. Runs fp32 (val.py's --amp off)."""
    from models import for_inference, load_model
    from models.fused import fuse_silu
    from models.yolo import DetectionModel
    model = load_model(weights, device=device) if weights else \
        DetectionModel(str(ROOT / "models" / "yolov5n.yaml"), nc=nc).to(device).eval()
    if not channels_last:
        return model.fuse()
    model = for_inference(model)
    fuse_silu(model)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "datasets" / "bccd" / "data.yaml"))
    parser.add_argument("--weights", default="", help="checkpoint (default: yolov5n.yaml, random init)")
    parser.add_argument("--imgsz", type=int, default=320)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--no-channels-last", action="store_true",
                        help="keep contiguous (NCHW) weights instead of val.py's channels_last, for comparison")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    import torch

    from utils.data.dataset_yaml import load_data_config
    from utils.data.loader import create_dataloader
    from utils.device import select_device
    from utils.memory import keep_freed_memory
    from utils.validation import validate

    keep_freed_memory()  # as val.py does
    if args.threads:
        torch.set_num_threads(args.threads)
    device = select_device(args.device)
    config = load_data_config(args.data)
    torch.manual_seed(0)
    model = build_model(args.weights, config.nc, device, channels_last=not args.no_channels_last)
    stride = int(model.stride.max())
    loader, dataset = create_dataloader(config.val, args.imgsz, args.batch_size, stride, rect=True, pad=0.5,
                                        workers=args.workers, names=config.names, prefix="val: ")
    print(f"{len(dataset)} images, imgsz {args.imgsz}, batch {args.batch_size}, {device}, "
          f"{torch.get_num_threads()} threads, weights: {args.weights or 'yolov5n.yaml (random init)'}")
    best = None
    for index in range(args.passes):
        start = time.perf_counter()
        result = validate(model, loader, config.names, device, plots=False)
        wall = (time.perf_counter() - start) * 1e3 / len(dataset)
        speed = result.speed
        print(f"pass {index + 1}: {speed[0]:.1f} ms pre-process, {speed[1]:.1f} ms inference, {speed[2]:.1f} ms NMS "
              f"per image (total {sum(speed):.1f} ms; wall {wall:.1f} ms/img incl. loading and metrics); "
              f"mAP50 {result.map50:.4f} mAP50-95 {result.map:.4f}")
        if best is None or sum(speed) < sum(best):
            best = speed
    reference = sum(YOLOV5_MS)
    print(f"best: {best[0]:.1f} / {best[1]:.1f} / {best[2]:.1f} ms = {sum(best):.1f} ms per image; YOLOv5 v7 "
          f"{YOLOV5_MS[0]} / {YOLOV5_MS[1]} / {YOLOV5_MS[2]} = {reference:.1f} ms; ratio {sum(best) / reference:.2f} "
          f"(target <= 0.67)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
