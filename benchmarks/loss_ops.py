"""The training loss (utils/loss.py) on ``--device``, in both forms (compact: the CPU's; fixed shapes: CUDA's with
deferred step checks): torch operations per call, forward and backward apart (every operation through the
dispatcher, counted with a TorchDispatchMode: on CUDA each costs host time, and most launch a kernel), wall time of
a forward and backward, and the loss's value. The predictions are random tensors shaped as ``--cfg``'s head gives
them at ``--imgsz`` and ``--batch-size``, with ``--targets`` random boxes per image, so only the loss is measured.
A timing: run it on an otherwise idle machine. On CUDA each timed call ends with a synchronisation.

    python benchmarks/loss_ops.py [--cfg models/yolov5s.yaml] [--imgsz 640] [--batch-size 64] [--device cuda:0]
    python benchmarks/loss_ops.py --root /path/to/another/checkout    # that checkout's utils/loss.py, same inputs
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default=str(ROOT / "models" / "yolov5s.yaml"))
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--targets", type=int, default=8, help="boxes per image")
    parser.add_argument("--nc", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=20, help="timed calls per form")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--root", default=str(ROOT), help="the checkout whose code is measured")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dispatch_count import OperationCount  # this checkout's counter, whichever checkout is measured

    sys.path.insert(0, str(Path(args.root).resolve()))
    import torch

    from models.yolo import DetectionModel
    from utils.config import Hyp
    from utils.loss import DetectionLoss

    device = torch.device(args.device)
    model = DetectionModel(args.cfg, nc=args.nc).to(device)
    detect = model.model[-1]
    generator = torch.Generator().manual_seed(0)
    grids = [args.imgsz // int(s) for s in detect.stride]
    preds = [(torch.randn(args.batch_size, detect.na, g, g, detect.no, generator=generator) * 2).to(device)
             .requires_grad_() for g in grids]
    n = args.batch_size * args.targets
    targets = torch.cat((torch.arange(args.batch_size).repeat_interleave(args.targets)[:, None].float(),
                         torch.randint(0, args.nc, (n, 1), generator=generator).float(),
                         torch.rand(n, 2, generator=generator) * 0.8 + 0.1,
                         torch.rand(n, 2, generator=generator) * 0.3 + 0.02), 1).to(device)

    def call(loss):
        for p in preds:
            p.grad = None
        total, items = loss(preds, targets)
        total.backward()
        return total, items

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {args.root}: {Path(args.cfg).name} head, {args.imgsz} px, batch {args.batch_size}, {n} targets, "
          f"nc {args.nc}, {where}")
    for name, fixed in (("compact", False), ("fixed shapes", True)):
        loss = DetectionLoss(model, Hyp(), imgsz=args.imgsz, fixed_shapes=fixed)
        call(loss)  # first call: constants made, kernels loaded
        with OperationCount() as forward:
            total, items = loss(preds, targets)
        with OperationCount() as backward:
            total.backward()
        seconds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            call(loss)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        print(f"{name}: operations forward {forward.operations}, backward {backward.operations}; "
              f"{statistics.median(seconds) * 1e3:.2f} ms a call (median of {args.rounds}); "
              f"loss {total.item():.6g}, items {[round(v, 6) for v in items.tolist()]}")


if __name__ == "__main__":
    main()
