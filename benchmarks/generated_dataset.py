"""A generated YOLO dataset of many small JPEGs, for the memory and start-up benchmarks (bench_memory.py,
bench_startup.py): ``make_dataset(root, count)`` writes ``root/images/{train,val}``, ``root/labels/...`` and
``root/data.yaml`` (absolute ``path:``, so YOLOv5 reads the same files), once; a second call with the same count
finds it and writes nothing.

Each image is ``size`` x ``size`` px of noise with 1-3 filled rectangles of 3 classes, labelled exactly.
"""
from __future__ import annotations

import os
from multiprocessing import Pool
from pathlib import Path

import cv2
import numpy as np

NAMES = ["red", "green", "blue"]
COLOURS = [(0, 0, 255), (0, 255, 0), (255, 0, 0)]


def _write(job: tuple[str, str, int, int, int]) -> None:
    images, labels, start, stop, size = job
    for i in range(start, stop):
        rng = np.random.default_rng(i)
        image = rng.integers(0, 90, (size, size, 3), dtype=np.uint8)
        rows = []
        for _ in range(int(rng.integers(1, 4))):
            cls = int(rng.integers(0, 3))
            w, h = (int(v) for v in rng.integers(size // 8, size // 2, 2))
            x, y = int(rng.integers(0, size - w)), int(rng.integers(0, size - h))
            cv2.rectangle(image, (x, y), (x + w, y + h), COLOURS[cls], -1)
            rows.append(f"{cls} {(x + w / 2) / size:.6f} {(y + h / 2) / size:.6f} {w / size:.6f} {h / size:.6f}")
        cv2.imwrite(os.path.join(images, f"{i:07d}.jpg"), image, [cv2.IMWRITE_JPEG_QUALITY, 90])
        with open(os.path.join(labels, f"{i:07d}.txt"), "w", encoding="ascii") as file:
            file.write("\n".join(rows) + "\n")


def make_dataset(root: Path, count: int, val: int = 500, size: int = 96, processes: int | None = None) -> Path:
    """The dataset's data.yaml (made when missing or of another size)."""
    root = Path(root).resolve()
    data = root / "data.yaml"
    marker = root / f".complete-{count}-{val}-{size}"
    if marker.exists():
        return data
    jobs = []
    for split, total in (("train", count), ("val", val)):
        images, labels = root / "images" / split, root / "labels" / split
        images.mkdir(parents=True, exist_ok=True)
        labels.mkdir(parents=True, exist_ok=True)
        offset = 0 if split == "train" else count
        step = 2000
        jobs += [(str(images), str(labels), offset + start, offset + min(start + step, total), size)
                 for start in range(0, total, step)]
    with Pool(processes) as pool:
        pool.map(_write, jobs)
    names = "\n".join(f"  {i}: {name}" for i, name in enumerate(NAMES))
    data.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n{names}\n")
    marker.touch()
    return data
