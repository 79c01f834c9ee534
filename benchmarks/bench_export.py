"""Export figures: size, export time, parity, val.py mAP50-95 and inference speed: .pt, TorchScript, ONNX, OpenVINO.

    python benchmarks/bench_export.py --weights runs/train/exp/weights/best.pt --data path/to/bccd/data.yaml
    python benchmarks/bench_export.py --weights best.pt --data data.yaml --speed-imgsz 640 320 --runs 50

The weights are copied into --out (default: a temporary folder) and exported there with export.py's own
code, --dynamic so one file serves every size below; OpenVINO twice, fp32 and --half (fp16 weights), when
the openvino package is installed (else its rows say so). mAP50-95 is val.py's (``val.run``) at --val-imgsz
with rectangular batches. Speed is one forward pass at batch 1 through models/backends.py (what val.py and
detect.py run): eager = the checkpoint fused and channels_last; TorchScript; ONNX Runtime and OpenVINO
(fp32 compute) on as many threads as torch. --warmup passes first (TorchScript's profiling executor
re-optimises its graph over the first calls: keep at least 3), then the median (min-max) of --runs. Input
preparation and NMS are not timed. The table goes to stdout, val.py's progress bars to stderr. Run it on an
otherwise idle machine: timings on a shared one are not comparable.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (row title, export.py format or None for the checkpoint, --half)
ROWS = (("PyTorch", None, False), ("TorchScript", "torchscript", False), ("ONNX Runtime", "onnx", False),
        ("OpenVINO", "openvino", False), ("OpenVINO fp16", "openvino", True))


def openvino_available() -> bool:
    from models.backends import BackendError, import_openvino

    try:
        import_openvino("the OpenVINO rows")
    except BackendError:
        return False
    return True


def export_files(weights: Path, folder: Path, imgsz: int, openvino: bool) -> dict:
    """{row title: (path, ExportResult or None for the checkpoint)}: each format exported --dynamic beside a
    copy of ``weights`` (the fp16 OpenVINO one beside a second copy, so the folders differ)."""
    import export

    folder.mkdir(parents=True, exist_ok=True)
    rows = {}
    for title, fmt, half in ROWS:
        if fmt == "openvino" and not openvino:
            continue
        copy = Path(shutil.copy(weights, folder / ("model_fp16.pt" if half else "model.pt")))
        if fmt is None:
            rows[title] = (copy, None)
            continue
        result, = export.run(export.ExportConfig(weights=str(copy), imgsz=(imgsz, imgsz), include=(fmt,),
                                                 dynamic=True, half=half))
        rows[title] = (result.path, result)
    return rows


def time_inference(backend, imgsz: int, runs: int, warmup: int) -> tuple[float, float, float]:
    """(median, min, max) ms of one batch-1 forward pass at imgsz x imgsz."""
    image = torch.rand(1, 3, imgsz, imgsz, generator=torch.Generator().manual_seed(0))
    image = image.contiguous(memory_format=torch.channels_last)  # as val.py / detect.py feed it
    times = []
    with torch.inference_mode():
        for _ in range(warmup):
            backend(image)
        for _ in range(runs):
            start = time.perf_counter()
            backend(image)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), max(times)


def validate_file(path: Path, data: str, imgsz: int, batch_size: int, workers: int, folder: Path,
                  title: str) -> float:
    import val

    result = val.run(data=data, weights=str(path), imgsz=imgsz, batch_size=batch_size, workers=workers, plots=False,
                     project=folder / "val", name=title.lower().replace(" ", "-"), device="cpu")
    return result.map


def describe_export(result) -> str:
    if result is None:
        return f"{'-':>9}{'-':>26}"
    worst_boxes = max(figure.box_pixels for figure in result.parity)
    worst_scores = max(figure.scores for figure in result.parity)
    return f"{result.seconds:>8.1f}s{f'{worst_boxes:.2g} px / {worst_scores:.2g}':>26}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", required=True, help="checkpoint (e.g. a BCCD-trained best.pt)")
    parser.add_argument("--data", required=True, help="dataset YAML for the mAP column")
    parser.add_argument("--out", default="", help="folder for the copies and exports (default: temporary)")
    parser.add_argument("--export-imgsz", type=int, default=640, help="example size the exports are traced at")
    parser.add_argument("--val-imgsz", type=int, default=320)
    parser.add_argument("--batch-size", type=int, default=32, help="val.py batch size")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--speed-imgsz", type=int, nargs="+", default=[640, 320])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch (and ONNX Runtime) threads; 0: torch's default")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from export import size_bytes
    from models.backends import load_backend
    from utils.memory import keep_freed_memory

    keep_freed_memory()  # as val.py and detect.py do
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(args.out or temporary)
        openvino = openvino_available()
        exports = export_files(Path(args.weights), folder, args.export_imgsz, openvino)
        print(f"{args.weights}: {os.cpu_count()} logical CPUs, torch {torch.__version__}, {torch.get_num_threads()} "
              f"threads; exports --dynamic traced at {args.export_imgsz}; speed: batch 1, median (min-max) of "
              f"{args.runs} after {args.warmup} warm-up; mAP50-95: val.py at {args.val_imgsz}, batch {args.batch_size}")
        speed_header = "".join(f"{f'ms @{size}':>22}" for size in args.speed_imgsz)
        print(f"{'format':<14}{'MB':>7}{'export':>9}{'parity boxes / scores':>26}{'mAP50-95':>10}{speed_header}")
        for title, (path, result) in exports.items():
            backend = load_backend(path)
            speeds = [time_inference(backend, size, args.runs, args.warmup) for size in args.speed_imgsz]
            score = validate_file(path, args.data, args.val_imgsz, args.batch_size, args.workers, folder, title)
            speed_cells = "".join(f"{f'{m:.1f} ({lo:.1f}-{hi:.1f})':>22}" for m, lo, hi in speeds)
            print(f"{title:<14}{size_bytes(path) / 1e6:>7.1f}{describe_export(result)}{score:>10.4f}{speed_cells}")
        if not openvino:
            print("OpenVINO      not installed: pip install openvino (requirements-export.txt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
