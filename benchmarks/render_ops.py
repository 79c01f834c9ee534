"""--augment-device's rendering (utils/data/device_augment.py, ``render_plans``) on ``--device`` (the CPU by default):
torch operations per batch (every operation through the dispatcher, counted with a TorchDispatchMode: on CUDA each
costs host time, and most launch a kernel), the bytes they read and write (what bounds the rendering's kernels, which
are memory-bound), wall time per batch, and a digest of the rendered images (equal digests: equal images). A timing:
run it on an otherwise idle machine. On CUDA each timed render ends with a synchronisation, and
the plans are copied to the device inside the timing, as in training.

    python benchmarks/render_ops.py --data ../shared/datasets/bccd/data.yaml [--imgsz 320] [--batch-size 32]
        [--batches 4] [--rounds 3] [--device cuda:0]
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_device_augment import loader  # noqa: E402
from benchmarks.bench_memory import cpu_name  # noqa: E402
from benchmarks.dispatch_count import OperationCount  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="a data.yaml (its train split is read)")
    parser.add_argument("--imgsz", type=int, default=320)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="timed passes over the batches per form")
    parser.add_argument("--hyp", default="hyp.scratch-low.yaml")
    parser.add_argument("--device", default="cpu", help="where the plans are rendered: cpu, cuda:0")
    parser.add_argument("--kinds", type=int, default=12, help="operation kinds listed by the bytes they move")
    args = parser.parse_args()
    import torch

    from utils.data import device_augment
    from utils.data.dataset_yaml import load_data_config
    from utils.data.plans import collate_plans

    config = load_data_config(args.data)
    cell = {"images": config.split("train")[0], "nc": len(config.names), "imgsz": args.imgsz,
            "batch_size": args.batch_size, "hyp": args.hyp, "cache": "ram", "workers": 0}
    planned = loader(cell, True).dataset
    size = args.batch_size
    batches = [collate_plans([planned[(i % len(planned), 0)] for i in range(b * size, (b + 1) * size)])[0]
               for b in range(args.batches)]
    device = torch.device(args.device)
    device_augment.hsv_tables(device)  # made once per run, not part of a batch
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"# {where}; {args.data} train, {args.imgsz} px, batches of {size}, {args.hyp}; tiles per batch: "
          f"{[len(batch.tiles) for batch in batches]}")
    digest, operations, seconds, traffic = hashlib.sha256(), [], [], []
    for batch in batches:
        with OperationCount() as count:
            rendered = device_augment.render_plans(batch, device)
        operations.append(count.operations)
        traffic.append(count)
        digest.update(rendered.contiguous().cpu().numpy().tobytes())
    for _ in range(args.rounds):
        for batch in batches:
            start = time.perf_counter()
            device_augment.render_plans(batch, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
    print(f"render: operations per batch {operations}; {statistics.median(seconds) * 1e3:.1f} ms a batch (median "
          f"of {len(seconds)}); images digest {digest.hexdigest()[:16]}")
    print(f"  read and written per batch: {statistics.mean(c.total_bytes() for c in traffic) / 1e9:.2f} GB "
          f"(the images: {rendered.numel() / 1e9:.3f} GB); by operation, the first batch: " + "; ".join(
              f"{kind} {count} x {moved / 1e9:.2f} GB" for kind, (count, moved)
              in sorted(traffic[0].bytes_by_kind.items(), key=lambda item: -item[1][1])[:args.kinds]))


if __name__ == "__main__":
    main()
