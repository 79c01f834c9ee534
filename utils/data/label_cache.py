"""The verified labels of a split (``SplitLabels``) and their on-disk cache.

The cache is an ``.npz`` file without pickles (arrays + a JSON metadata string), written atomically.

Where: beside the labels folder (``<labels folder>.cache.npz``, as YOLOv5) only when the split is a
dataset, i.e. at least one of its label files exists, and that folder is writable; otherwise in the
user cache folder (``~/.cache/yolo-trainer/labels`` or ``cache_dir``), under a name derived from the
real path of the labels folder. Scanning a folder that is not a dataset (a data YAML pointing at a
system folder of images) never writes into it.

Key: a hash of the real path (symlinks resolved), device, inode, size and mtime of every image and
label file, in real-path order, with nc, single_cls and the cache version. Two checkouts that reach
one dataset through different paths therefore compute the same key and share one cache instead of
rewriting each other's; the cache stores real paths and each reader gets its own paths back.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from utils.files import atomic_write

LOGGER = logging.getLogger(__name__)

CACHE_VERSION = "verify-2"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "yolo-trainer" / "labels"


@dataclass
class SplitLabels:
    im_files: list[str]
    labels: list[np.ndarray]  # (n, 5) float32: class, cx, cy, w, h normalised
    segments: list[list[np.ndarray]]  # per image: (k, 2) float32 normalised polygons, or []
    shapes: np.ndarray  # (N, 2) int64: width, height after EXIF orientation
    stats: dict = field(default_factory=dict)  # counts: found, missing, empty, corrupt, duplicates, images
    messages: list[str] = field(default_factory=list)  # "file: reason" lines
    problems: list[dict] = field(default_factory=list)  # {"file", "category", "detail", "action"}


def problem_message(problem: dict) -> str:
    action = " (image skipped)" if problem["action"] == "skipped" else ""
    return f"{problem['file']}: {problem['detail']}{action}"


# ----------------------------------------------------------------------------- identity and place
def real_paths(files: list[str]) -> list[str]:
    """The real path of each file (each folder resolved once; a symlinked file resolved itself)."""
    folders: dict[str, str] = {}
    result = []
    for file in files:
        folder, name = os.path.split(file)
        if folder not in folders:
            folders[folder] = os.path.realpath(folder)
        path = os.path.join(folders[folder], name)
        result.append(os.path.realpath(path) if os.path.islink(path) else path)
    return result


def _identity(path: str) -> str:
    try:
        stat = os.stat(path)
    except (OSError, ValueError):
        return f"{path}\t-"
    return f"{path}\t{stat.st_dev}\t{stat.st_ino}\t{stat.st_size}\t{stat.st_mtime_ns}"


def split_key(real_images: list[str], real_labels: list[str], nc: int, single_cls: bool) -> str:
    """Hash of every image and label file's identity (see the module docstring) and the options."""
    digest = hashlib.sha256(f"{CACHE_VERSION}\t{nc}\t{single_cls}\n".encode())
    for image, label in sorted(zip(real_images, real_labels)):
        digest.update(f"{_identity(image)}\n{_identity(label)}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def user_cache_path(labels_folder: str, cache_dir=None) -> Path:
    """<cache_dir>/<hash of the labels folder's real path>.npz: the same for every path to one dataset."""
    folder = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    real = os.path.realpath(labels_folder) + ".cache.npz"
    return folder / (hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:20] + ".npz")


class LabelCache:
    """The cache of one split as seen from one set of paths: ``load()`` and ``save(result)``."""

    def __init__(self, im_files: list[str], label_files: list[str], nc: int, single_cls: bool, cache_dir=None):
        real_images = real_paths(im_files)
        self.real_of = dict(zip(im_files, real_images))
        self.path_of = {real: path for path, real in self.real_of.items()}
        if len(self.path_of) != len(self.real_of):  # two paths to one file inside the split: no sharing
            self.real_of = self.path_of = {path: path for path in im_files}
            real_images = im_files
        self.key = split_key(real_images, real_paths(label_files), nc, single_cls)
        labels_folder = os.path.dirname(label_files[0])
        is_dataset = os.path.isdir(labels_folder) and any(os.path.isfile(file) for file in label_files)
        self.beside = Path(os.path.realpath(labels_folder) + ".cache.npz") if is_dataset else None
        self.user = user_cache_path(labels_folder, cache_dir)

    @property
    def locations(self) -> list[Path]:
        return [path for path in (self.beside, self.user) if path is not None]

    def load(self) -> SplitLabels | None:
        """The cached result with this reader's paths, or None (a corrupt file is warned about)."""
        for path in self.locations:
            result = _read(path, self.key)
            if result is not None and all(file in self.path_of for file in result.im_files):
                LOGGER.debug(f"{path}: label cache hit")
                return _renamed(result, self.path_of)
        return None

    def save(self, result: SplitLabels) -> Path | None:
        """Write atomically beside the labels when that is allowed and possible, else to the user
        cache folder; returns the path written (None when neither is writable)."""
        arrays = cache_arrays(_renamed(result, self.real_of), self.key)
        for path in self.locations:
            if not is_writable_folder(path.parent):
                continue
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, lambda file: np.savez(file, **arrays))  # utils.files: temp, fsync, rename
            except OSError as e:
                LOGGER.debug(f"{path}: cannot write label cache ({e})")
                continue
            if path != self.beside and self.beside is not None:
                LOGGER.info(f"{self.beside.parent} is not writable, label cache saved to {path}")
            return path
        LOGGER.warning(f"label cache not saved: neither of {', '.join(map(str, self.locations))} is writable")
        return None


def _renamed(result: SplitLabels, mapping: dict[str, str]) -> SplitLabels:
    """``result`` with every file named through ``mapping``, usable images in the order of their new names."""
    names = [mapping[file] for file in result.im_files]
    order = sorted(range(len(names)), key=names.__getitem__)
    problems = sorted(({**problem, "file": mapping.get(problem["file"], problem["file"])}
                       for problem in result.problems), key=lambda problem: problem["file"])
    renamed = SplitLabels([names[i] for i in order], [result.labels[i] for i in order],
                          [result.segments[i] for i in order], result.shapes[order].reshape(-1, 2),
                          dict(result.stats), problems=problems)
    renamed.messages = [problem_message(problem) for problem in problems]
    return renamed


# ----------------------------------------------------------------------------- file format
def _offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int64)


def cache_arrays(result: SplitLabels, key: str) -> dict[str, np.ndarray]:
    """Plain numeric arrays (no objects) holding ``result``; metadata as a UTF-8 JSON byte array."""
    polygons = [polygon for segments in result.segments for polygon in segments]
    meta = {"version": CACHE_VERSION, "hash": key, "im_files": result.im_files, "stats": result.stats,
            "problems": result.problems}
    return {
        "meta": np.frombuffer(json.dumps(meta).encode("utf-8", "surrogateescape"), dtype=np.uint8),
        "labels": np.concatenate(result.labels + [np.zeros((0, 5), np.float32)]).astype(np.float32),
        "label_offsets": _offsets([len(x) for x in result.labels]),
        "shapes": result.shapes.astype(np.int64),
        "points": np.concatenate(polygons + [np.zeros((0, 2), np.float32)]).astype(np.float32),
        "point_offsets": _offsets([len(p) for p in polygons]),
        "segment_offsets": _offsets([len(s) for s in result.segments]),
    }


def result_from_arrays(arrays, key: str) -> SplitLabels | None:
    """The SplitLabels stored in ``arrays``, or None when it belongs to another file list/version."""
    meta = json.loads(bytes(arrays["meta"]).decode("utf-8", "surrogateescape"))
    if meta.get("version") != CACHE_VERSION or meta.get("hash") != key:
        return None
    labels, label_offsets = arrays["labels"], arrays["label_offsets"]
    points, point_offsets, segment_offsets = arrays["points"], arrays["point_offsets"], arrays["segment_offsets"]
    polygons = [points[point_offsets[i]:point_offsets[i + 1]] for i in range(len(point_offsets) - 1)]
    count = len(meta["im_files"])
    result = SplitLabels(
        im_files=meta["im_files"],
        labels=[labels[label_offsets[i]:label_offsets[i + 1]].copy() for i in range(count)],
        segments=[polygons[segment_offsets[i]:segment_offsets[i + 1]] for i in range(count)],
        shapes=np.asarray(arrays["shapes"], np.int64).reshape(-1, 2),
        stats=meta["stats"], problems=meta["problems"])
    if len(result.shapes) != count or len(label_offsets) != count + 1 or len(segment_offsets) != count + 1:
        raise ValueError("inconsistent array lengths")
    result.messages = [problem_message(p) for p in result.problems]
    return result


def _read(path: Path, key: str) -> SplitLabels | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as arrays:
            return result_from_arrays(arrays, key)
    except Exception as e:  # zip, JSON, key and shape errors all mean "rebuild"
        LOGGER.warning(f"{path}: label cache unreadable ({type(e).__name__}: {e}), rebuilding")
        return None


def is_writable_folder(folder: Path) -> bool:
    """Whether files may be created in ``folder`` (or its nearest existing parent).

    A folder whose mode has no write bit counts as read-only even for root, who bypasses permissions:
    a dataset shipped read-only is never written into.
    """
    folder = Path(os.path.abspath(folder))
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    try:
        mode = folder.stat().st_mode
    except OSError:
        return False
    return folder.is_dir() and bool(mode & 0o222) and os.access(folder, os.W_OK | os.X_OK)
