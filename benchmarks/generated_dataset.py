"""Generated YOLO datasets for the benchmarks. Each writes ``root/images/{train,val}``, ``root/labels/...`` and
``root/data.yaml`` (absolute ``path:``, so YOLOv5 reads the same files), once; a second call with the same
arguments finds it and writes nothing.

- ``make_dataset(root, count)``: many small JPEGs (``size`` x ``size`` px of noise with 1-3 filled rectangles of
  3 classes, labelled exactly), for the memory and start-up benchmarks (bench_memory.py, bench_startup.py).
- ``make_photo_dataset(root, kind, count)``: photo-sized files for the loader benchmark (bench_loader.py), one of
  ``PHOTO_KINDS``: COCO-like 640x480 JPEGs, 12-megapixel phone JPEGs (4032x3024), 640x480 PNGs. The content
  compresses like a photo (smooth shading, edges, mild sensor noise), so file sizes and decode costs are
  realistic: about 100-200 KB per COCO-like JPEG, 2-4 MB per phone JPEG.
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


PHOTO_KINDS = {  # kind: (width, height, suffix, imwrite parameters)
    "coco": (640, 480, ".jpg", [cv2.IMWRITE_JPEG_QUALITY, 90]),
    "phone": (4032, 3024, ".jpg", [cv2.IMWRITE_JPEG_QUALITY, 90]),
    "png": (640, 480, ".png", [cv2.IMWRITE_PNG_COMPRESSION, 3]),  # OpenCV's default level
}


def _photo(rng: np.random.Generator, width: int, height: int) -> tuple[np.ndarray, list[str]]:
    """A photo-like image: low-frequency shading, 2-8 shaded boxes of 3 classes (labelled), sensor noise."""
    small = rng.integers(40, 200, (6, 8, 3), dtype=np.uint8)
    image = cv2.resize(small, (width, height), interpolation=cv2.INTER_CUBIC)
    rows = []
    for _ in range(int(rng.integers(2, 9))):
        cls = int(rng.integers(0, 3))
        w, h = int(rng.integers(width // 16, width // 3)), int(rng.integers(height // 16, height // 3))
        x, y = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
        tone = np.array(COLOURS[cls], np.float32) * 0.6 + rng.integers(0, 80, 3)
        shade = np.linspace(0.7, 1.0, w, dtype=np.float32)[None, :, None]
        image[y:y + h, x:x + w] = np.clip(tone * shade, 0, 255).astype(np.uint8)
        rows.append(f"{cls} {(x + w / 2) / width:.6f} {(y + h / 2) / height:.6f} {w / width:.6f} {h / height:.6f}")
    noise = rng.normal(0, 7, (height, width, 1)).astype(np.int16)
    return np.clip(image.astype(np.int16) + noise, 0, 255).astype(np.uint8), rows


def _write_photos(job: tuple[str, str, int, int, str]) -> None:
    images, labels, start, stop, kind = job
    width, height, suffix, params = PHOTO_KINDS[kind]
    for i in range(start, stop):
        image, rows = _photo(np.random.default_rng(i), width, height)
        cv2.imwrite(os.path.join(images, f"{i:07d}{suffix}"), image, params)
        with open(os.path.join(labels, f"{i:07d}.txt"), "w", encoding="ascii") as file:
            file.write("\n".join(rows) + "\n")


def _build(root: Path, marker: str, count: int, val: int, writer, extra, step: int, processes: int | None) -> Path:
    """Write train (``count``) and val (``val``) images with ``writer`` in a process pool, once per ``marker``."""
    root = Path(root).resolve()
    data = root / "data.yaml"
    done = root / f".complete-{marker}"
    if done.exists():
        return data
    jobs = []
    for split, total in (("train", count), ("val", val)):
        images, labels = root / "images" / split, root / "labels" / split
        images.mkdir(parents=True, exist_ok=True)
        labels.mkdir(parents=True, exist_ok=True)
        offset = 0 if split == "train" else count
        jobs += [(str(images), str(labels), offset + start, offset + min(start + step, total), extra)
                 for start in range(0, total, step)]
    with Pool(processes) as pool:
        pool.map(writer, jobs)
    names = "\n".join(f"  {i}: {name}" for i, name in enumerate(NAMES))
    data.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n{names}\n")
    done.touch()
    return data


def make_dataset(root: Path, count: int, val: int = 500, size: int = 96, processes: int | None = None) -> Path:
    """The small-JPEG dataset's data.yaml (made when missing or of another size)."""
    return _build(root, f"{count}-{val}-{size}", count, val, _write, size, 2000, processes)


def make_photo_dataset(root: Path, kind: str, count: int, val: int = 16, processes: int | None = None) -> Path:
    """A ``PHOTO_KINDS`` dataset's data.yaml (made when missing or of another kind or size)."""
    if kind not in PHOTO_KINDS:
        raise ValueError(f"unknown kind {kind!r} (one of {', '.join(PHOTO_KINDS)})")
    return _build(root, f"{kind}-{count}-{val}", count, val, _write_photos, kind, 8, processes)
