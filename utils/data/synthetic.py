"""The embedded default dataset: coloured, textured shapes on cluttered backgrounds, made by our own code.

``ensure_default_dataset()`` returns the data YAML of ``shapes-v2``, generating it on first use (no
network, deterministic: the same seed gives the same bytes, whatever the order images are made in).
It lives outside the git tree, in ``~/.cache/yolo-trainer/datasets/shapes-v2`` (the environment
variable ``YOLO_TRAINER_DATASETS`` replaces the parent folder). It is built in a temporary sibling
folder that is renamed into place only once complete, so an interrupted run never leaves half a
dataset; a ``generator.json`` marker records what was built and makes reuse safe.

Content, per image: a smooth colour field, blotchy noise, blurred irregular blobs and thin lines
(clutter, never labelled), then 3..10 objects of six classes told apart by shape and by a class hue band (each class owns a
sixth of the hue circle, +/- 8 degrees of OpenCV hue; saturation, brightness and texture vary: solid,
stripes, gradient, noise; backgrounds are half-desaturated), long side 8 px to half the short image side,
varied aspect ratio and rotation, then mild sensor noise and JPEG encoding. Objects may overlap and
run off the image edge. Labelling rule: every object keeps at least ``MIN_VISIBLE`` of its pixels
visible (a placement that would hide more of any object, or show less of itself, is retried
elsewhere or not drawn), so every drawn object is labelled, and each box is the bounding box of that
object's *visible* pixels.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np

LOGGER = logging.getLogger(__name__)

DATASET_NAME = "shapes-v2"
GENERATOR_VERSION = 2
CLASS_NAMES = ("circle", "rectangle", "triangle", "star", "cross", "ring")
MIN_VISIBLE = 0.7  # fraction of an object's pixels that must stay visible
ENV_VAR = "YOLO_TRAINER_DATASETS"
MARKER = "generator.json"
SPLIT_IDS = {"train": 0, "val": 1}
JPEG_QUALITY = 90
_CIRCLE = np.stack([np.cos(np.linspace(0, 2 * np.pi, 48, endpoint=False)),
                    np.sin(np.linspace(0, 2 * np.pi, 48, endpoint=False))], 1)


# ----------------------------------------------------------------------------- shapes


def _rotate(points: np.ndarray, angle: float) -> np.ndarray:
    cos, sin = np.cos(angle), np.sin(angle)
    return points @ np.array([[cos, sin], [-sin, cos]])


def _shape_polygons(rng: np.random.Generator, cls: int, length: float) -> list[np.ndarray]:
    """Polygons (first filled, later ones cut out) of one object, centred at 0, long side ``length``."""
    aspect = float(np.exp(rng.uniform(-np.log(2.2), np.log(2.2))))
    half_w, half_h = length / 2 * min(1.0, aspect), length / 2 * min(1.0, 1 / aspect)
    name = CLASS_NAMES[cls]
    if name == "circle":
        return [_CIRCLE * length / 2]
    if name == "ring":
        aspect = float(np.exp(rng.uniform(-np.log(1.4), np.log(1.4))))
        outer = _rotate(_CIRCLE * [length / 2 * min(1.0, aspect), length / 2 * min(1.0, 1 / aspect)],
                        rng.uniform(0, np.pi))
        return [outer, outer * rng.uniform(0.4, 0.6)]
    if name == "rectangle":
        unit = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], np.float64)
        return [_rotate(unit * [half_w, half_h], rng.uniform(-0.35, 0.35))]
    if name == "triangle":
        apex = rng.uniform(-0.4, 0.4)
        unit = np.array([[apex, -1], [1, 1], [-1, 1]], np.float64)
        return [_rotate(unit * [half_w, half_h], rng.uniform(0, 2 * np.pi))]
    if name == "star":
        inner = rng.uniform(0.38, 0.5)
        angles = np.linspace(0, 2 * np.pi, 10, endpoint=False) - np.pi / 2
        radii = np.where(np.arange(10) % 2 == 0, 1.0, inner)
        unit = np.stack([np.cos(angles) * radii, np.sin(angles) * radii], 1)
        scale = length / 2 * np.array([min(1.0, aspect), min(1.0, 1 / aspect)]) ** 0.5
        return [_rotate(unit * scale, rng.uniform(0, 2 * np.pi))]
    # cross: a plus sign whose arms are ``t`` (relative thickness) wide
    t = rng.uniform(0.22, 0.4)
    unit = np.array([[-t, -1], [t, -1], [t, -t], [1, -t], [1, t], [t, t], [t, 1], [-t, 1], [-t, t],
                     [-1, t], [-1, -t], [-t, -t]], np.float64)
    return [_rotate(unit * [half_w, half_h], rng.uniform(-0.35, 0.35))]


def _shape_mask(polygons: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Rasterise polygons (centred at 0) -> (bool mask, offset of the mask's top-left from the centre)."""
    low = np.floor(polygons[0].min(0)) - 1
    size = (np.ceil(polygons[0].max(0)) + 2 - low).astype(int)
    mask = np.zeros((size[1], size[0]), np.uint8)
    for value, polygon in zip((1, 0), polygons):
        points = np.round((polygon - low) * 16).astype(np.int32)  # 4 fractional bits
        cv2.fillPoly(mask, [points], value, lineType=cv2.LINE_8, shift=4)
    return mask.astype(bool), low


# ----------------------------------------------------------------------------- textures


def _class_colour(rng: np.random.Generator, cls: int, value_scale: float = 1.0) -> np.ndarray:
    """A BGR colour in class ``cls``'s hue band with random saturation and brightness."""
    hue = (cls * 180 / len(CLASS_NAMES) + rng.uniform(-8, 8)) % 180
    hsv = np.array([[[hue, rng.uniform(150, 255), rng.uniform(150, 255) * value_scale]]], np.float32)
    return cv2.cvtColor(hsv.clip(0, [179, 255, 255]).astype(np.uint8), cv2.COLOR_HSV2BGR)[0, 0].astype(np.float32)


def _texture(rng: np.random.Generator, height: int, width: int, cls: int) -> np.ndarray:
    """A (height, width, 3) float32 patch in the class hue band: solid, stripes, gradient or noisy colour."""
    first, second = _class_colour(rng, cls), _class_colour(rng, cls, value_scale=rng.uniform(0.45, 0.8))
    kind = rng.choice(4, p=[0.4, 0.2, 0.2, 0.2])
    if kind == 0:
        return np.broadcast_to(first, (height, width, 3))
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = rng.uniform(0, np.pi)
    along = xs * np.cos(angle) + ys * np.sin(angle)
    if kind == 1:  # stripes
        period = rng.uniform(3, max(4.0, max(height, width) / 3))
        stripe = ((along / period) % 2 < 1)[..., None]
        return np.where(stripe, first, second)
    if kind == 2:  # linear gradient
        span = max(float(along.max() - along.min()), 1.0)
        weight = ((along - along.min()) / span)[..., None]
        return first * (1 - weight) + second * weight
    noise = rng.normal(0, rng.uniform(10, 30), (height, width, 1)).astype(np.float32)
    return first + noise


def _background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Cluttered float32 background: soft colour field with blobs, blotchy noise, thin lines.

    Blobs are drawn at 1/8 resolution and upsampled, so their edges are soft and never look like
    the sharp-edged objects.
    """
    small_w, small_h = max(width // 8, 4), max(height // 8, 4)
    grid = rng.uniform(30, 225, (rng.integers(2, 6), rng.integers(2, 6), 3)).astype(np.float32)
    small = cv2.resize(grid, (small_w, small_h), interpolation=cv2.INTER_CUBIC)
    for _ in range(rng.integers(1, 8)):
        centre = rng.uniform(0, [small_w, small_h])
        count = rng.integers(8, 14)
        angles = np.sort(rng.uniform(0, 2 * np.pi, count))
        radii = rng.uniform(0.5, 1.0, count) * rng.uniform(1.5, max(small_w, small_h) / 4)
        points = centre + np.stack([np.cos(angles), np.sin(angles)], 1) * radii[:, None]
        cv2.fillPoly(small, [np.round(points).astype(np.int32)], rng.uniform(20, 235, 3).tolist())
    small = cv2.GaussianBlur(small, (0, 0), rng.uniform(0.7, 1.5))
    image = cv2.resize(small, (width, height), interpolation=cv2.INTER_CUBIC)
    cell = int(rng.choice([2, 4, 8, 16]))
    blotches = rng.normal(0, rng.uniform(5, 25), (height // cell + 2, width // cell + 2, 3))
    image += cv2.resize(blotches.astype(np.float32), (width, height), interpolation=cv2.INTER_LINEAR)
    for _ in range(rng.integers(1, 12)):  # thin lines (never as thick as a shape)
        start, end = rng.uniform(0, [width, height], (2, 2)).round().astype(int)
        colour = rng.uniform(0, 255, 3).tolist()
        cv2.line(image, tuple(map(int, start)), tuple(map(int, end)), colour, int(rng.integers(1, 3)),
                 cv2.LINE_AA)
    gray = image.mean(2, keepdims=True)
    return 0.5 * image + 0.5 * gray  # half-desaturated, so class hues stand out from the clutter


# ----------------------------------------------------------------------------- one image


class _Scene:
    """An image being drawn, with ``owner``: per pixel, 1 + index of the object seen there (0 = none)."""

    def __init__(self, image: np.ndarray):
        self.image = image
        self.owner = np.zeros(image.shape[:2], np.int32)
        self.areas: list[int] = []
        self.visible: list[int] = []
        self.regions: list[tuple[slice, slice]] = []
        self.classes: list[int] = []

    def try_place(self, rng: np.random.Generator, mask: np.ndarray, offset: np.ndarray, cls: int) -> bool:
        """Draw ``mask`` at a random spot that keeps every object >= MIN_VISIBLE visible (5 tries)."""
        height, width = self.owner.shape
        area = int(mask.sum())
        for _ in range(5):
            x0, y0 = np.round(rng.uniform(0, [width, height]) + offset).astype(int)
            left, top = max(x0, 0), max(y0, 0)
            right, bottom = min(x0 + mask.shape[1], width), min(y0 + mask.shape[0], height)
            if right - left < 3 or bottom - top < 3:
                continue
            crop = mask[top - y0:bottom - y0, left - x0:right - x0]
            shown = int(crop.sum())
            if shown < MIN_VISIBLE * area or not (crop.any(0).sum() >= 3 and crop.any(1).sum() >= 3):
                continue
            region = (slice(top, bottom), slice(left, right))
            hidden = np.bincount(self.owner[region][crop], minlength=len(self.areas) + 1)[1:]
            remaining = np.asarray(self.visible, np.int64) - hidden
            if np.any(remaining < MIN_VISIBLE * np.asarray(self.areas)):
                continue
            self._draw(rng, region, crop, remaining, area, shown, cls)
            return True
        return False

    def _draw(self, rng, region, crop, remaining, area, shown, cls) -> None:
        self.visible = remaining.tolist() + [shown]
        self.areas.append(area)
        self.regions.append(region)
        self.owner[region][crop] = len(self.areas)
        patch = self.image[region]
        texture = _texture(rng, patch.shape[0], patch.shape[1], cls)
        patch[crop] = texture[crop]

    def labels(self) -> np.ndarray:
        """(n, 5) float32 [class, cx, cy, w, h] normalised, boxes around each object's visible pixels."""
        height, width = self.owner.shape
        rows = []
        for index, (region, cls) in enumerate(zip(self.regions, self.classes), start=1):
            ys, xs = np.nonzero(self.owner[region] == index)
            x0, x1 = xs.min() + region[1].start, xs.max() + 1 + region[1].start
            y0, y1 = ys.min() + region[0].start, ys.max() + 1 + region[0].start
            rows.append([cls, (x0 + x1) / 2 / width, (y0 + y1) / 2 / height,
                         (x1 - x0) / width, (y1 - y0) / height])
        return np.array(rows, np.float32).reshape(-1, 5)


def _image_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height): long side 256..416, aspect 0.65..1, either orientation."""
    long_side = int(rng.choice([256, 288, 320, 352, 384, 416]))
    short_side = int(round(long_side * rng.uniform(0.65, 1.0) / 16) * 16)
    return (long_side, short_side) if rng.random() < 0.5 else (short_side, long_side)


def render_image(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic image -> (uint8 BGR HxWx3, labels (n, 5) float32 [class, cx, cy, w, h] normalised)."""
    width, height = _image_size(rng)
    scene = _Scene(_background(rng, height, width))
    for _ in range(rng.integers(3, 11)):
        cls = int(rng.integers(len(CLASS_NAMES)))
        lowest = 8.0 if rng.random() < 0.1 else 16.0
        length = float(np.exp(rng.uniform(np.log(lowest), np.log(min(width, height) / 2))))
        polygons = _shape_polygons(rng, cls, length)
        mask, offset = _shape_mask(polygons)
        if scene.try_place(rng, mask, offset, cls):
            scene.classes.append(cls)
    _add_sensor_noise(rng, scene.image)
    return np.clip(scene.image, 0, 255).astype(np.uint8), scene.labels()


def _add_sensor_noise(rng: np.random.Generator, image: np.ndarray) -> None:
    """Add mild per-pixel noise in place: a 61x67 normal patch, tiled (much cheaper than full-size)."""
    height, width = image.shape[:2]
    patch = rng.standard_normal((61, 67, 3), np.float32) * rng.uniform(2, 7)
    tiles = np.tile(patch, (height // 61 + 1, width // 67 + 1, 1))
    image += tiles[:height, :width]


# ----------------------------------------------------------------------------- dataset on disk


def image_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator of one image: depends only on (seed, split, index), so order never matters."""
    return np.random.default_rng([seed, SPLIT_IDS[split], index])


def _write_one(out_dir: Path, seed: int, split: str, index: int) -> int:
    image, labels = render_image(image_rng(seed, split, index))
    ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
    if not ok:
        raise OSError(f"JPEG encoding failed for synthetic image {split}/{index}")
    (out_dir / "images" / split / f"{index:05d}.jpg").write_bytes(encoded.tobytes())
    lines = "".join(f"{int(row[0])} {row[1]:.6f} {row[2]:.6f} {row[3]:.6f} {row[4]:.6f}\n" for row in labels)
    (out_dir / "labels" / split / f"{index:05d}.txt").write_text(lines)
    return len(labels)


def _data_yaml_text(dataset_path: Path) -> str:
    names = "\n".join(f"  {index}: {name}" for index, name in enumerate(CLASS_NAMES))
    return (f"# {DATASET_NAME}: synthetic shapes generated by utils/data/synthetic.py (do not edit)\n"
            f"path: {json.dumps(str(dataset_path))}\ntrain: images/train\nval: images/val\n"
            f"nc: {len(CLASS_NAMES)}\nnames:\n{names}\n")


def _default_workers() -> int:
    """Threads for generation: usable CPUs (process affinity), at most 4 (the GIL caps the gain)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 4))


def generate_dataset(out_dir: str | os.PathLike, train_count: int = 500, val_count: int = 100,
                     seed: int = 0, workers: int | None = None,
                     dataset_path: str | os.PathLike | None = None) -> Path:
    """Write the dataset into ``out_dir`` (directly, not atomically) and return its data YAML path.

    ``dataset_path`` is the folder the YAML's ``path`` names (default ``out_dir``; the atomic builder
    passes the final folder). Threads share the work; each image depends only on (seed, split, index).
    """
    out_dir = Path(out_dir)
    jobs = [(split, index) for split, count in (("train", train_count), ("val", val_count))
            for index in range(count)]
    for kind in ("images", "labels"):
        for split in SPLIT_IDS:
            (out_dir / kind / split).mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(workers or _default_workers()) as pool:
        counts = list(pool.map(lambda job: _write_one(out_dir, seed, *job), jobs))
    yaml_path = out_dir / "data.yaml"
    yaml_path.write_text(_data_yaml_text(Path(dataset_path or out_dir).resolve()))
    LOGGER.debug("%s: %d images, %d objects", out_dir, len(jobs), sum(counts))
    return yaml_path


# ----------------------------------------------------------------------------- first-use cache


def default_datasets_dir() -> Path:
    """Parent folder of generated datasets: $YOLO_TRAINER_DATASETS or ~/.cache/yolo-trainer/datasets."""
    configured = os.environ.get(ENV_VAR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "yolo-trainer" / "datasets"


def _marker(train_count: int, val_count: int, seed: int) -> dict:
    return {"name": DATASET_NAME, "version": GENERATOR_VERSION, "train": train_count, "val": val_count,
            "seed": seed, "classes": list(CLASS_NAMES)}


def _is_complete(folder: Path, expected: dict) -> bool:
    """True when ``folder`` holds a finished build matching ``expected`` (marker, YAML, file counts)."""
    try:
        if json.loads((folder / MARKER).read_text()) != expected or not (folder / "data.yaml").is_file():
            return False
        return all(len(os.listdir(folder / kind / split)) == expected[split]
                   for kind in ("images", "labels") for split in SPLIT_IDS)
    except (OSError, ValueError):
        return False


def _install(built: Path, final: Path, expected: dict) -> None:
    """Move a finished build into place; a concurrent finished build of the same content wins."""
    if final.exists():
        if _is_complete(final, expected):
            return
        stale = final.with_name(f".{final.name}.stale-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(final, stale)  # out of the way in one step, then removed
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(built, final)
    except OSError:
        if not _is_complete(final, expected):  # lost a race only if the winner is complete
            raise


def _remove_abandoned_builds(parent: Path, max_age_s: float = 3600.0) -> None:
    """Delete temporary build folders left by interrupted runs (older than ``max_age_s``)."""
    for leftover in parent.glob(f".{DATASET_NAME}.*"):
        try:
            if time.time() - leftover.stat().st_mtime > max_age_s:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue


def ensure_default_dataset(root: str | os.PathLike | None = None, train_count: int = 500, val_count: int = 100,
                           seed: int = 0, workers: int | None = None) -> Path:
    """Data YAML of the default dataset in ``<root>/shapes-v2``, generated on first use.

    ``root`` is the parent folder (default ``default_datasets_dir()``). The build goes to a temporary
    sibling folder, gets its marker last, and is renamed into place, so readers only ever see a
    complete dataset; a folder whose marker does not match the requested counts/seed is rebuilt.
    """
    parent = Path(root).expanduser() if root is not None else default_datasets_dir()
    final = parent / DATASET_NAME
    expected = _marker(train_count, val_count, seed)
    if _is_complete(final, expected):
        return final / "data.yaml"
    parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(parent)
    LOGGER.info("Generating the default dataset %s (%d train + %d val images) in %s ...",
                DATASET_NAME, train_count, val_count, final)
    start = time.perf_counter()
    build = Path(tempfile.mkdtemp(prefix=f".{DATASET_NAME}.build-", dir=parent))
    try:
        generate_dataset(build, train_count, val_count, seed, workers, dataset_path=final)
        (build / MARKER).write_text(json.dumps(expected, indent=1) + "\n")
        _install(build, final, expected)
    finally:
        shutil.rmtree(build, ignore_errors=True)  # no-op after a successful rename
    LOGGER.info("Default dataset ready in %.1f s: %s", time.perf_counter() - start, final / "data.yaml")
    return final / "data.yaml"
