"""The verified labels of a split (``SplitLabels``) and their on-disk cache.

The cache is an ``.npz`` file without pickles: the split's flat arrays (``utils.data.flat_labels``, file
names included) and a JSON metadata string (version, key, counts, problems), written atomically. Reading
it back gives the flat arrays as they are: no per-image objects are built, so a restart on a large split
is a file read.

Where: beside the labels folder (``<labels folder>.cache.npz``, as YOLOv5) only when the split is a
dataset, i.e. at least one of its label files exists, and that folder is writable; otherwise in the
user cache folder (``utils.data.cache_folders.user_cache_folder("labels")`` or ``cache_dir``), under a
name derived from the real path of the labels folder. Scanning a folder that is not a dataset (a data YAML pointing at a
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
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from utils.data.cache_folders import user_cache_folder
from utils.data.flat_labels import ARRAY_NAMES, FlatLabels
from utils.files import atomic_write

LOGGER = logging.getLogger(__name__)

CACHE_VERSION = "verify-6"  # 4: EXIF orientations; 5: headers by utils/data/headers.py; 6: polygons' boxes checked
FILE_KEYS = {"boxes": "labels", "box_offsets": "label_offsets"}  # names in the file, as earlier versions had them


@dataclass
class SplitLabels:
    """A split's usable images (``flat``: names, labels, segments, shapes) and the scan's report.

    ``im_files``, ``labels``, ``segments`` and ``shapes`` read ``flat`` (list-like views: ``labels[i]`` is an
    (n, 5) float32 ``[class, cx, cy, w, h]`` array, ``segments[i]`` a list of (k, 2) polygons, ``shapes`` (N, 2)
    width, height after EXIF orientation)."""
    flat: FlatLabels
    stats: dict = field(default_factory=dict)  # counts: found, missing, empty, corrupt, duplicates, images
    messages: list[str] = field(default_factory=list)  # "file: reason" lines
    problems: list[dict] = field(default_factory=list)  # {"file", "category", "detail", "action"}

    @property
    def im_files(self):
        return self.flat.im_files

    @property
    def labels(self):
        return self.flat.labels

    @property
    def segments(self):
        return self.flat.segments

    @property
    def shapes(self) -> np.ndarray:
        return self.flat.shapes


def problem_message(problem: dict) -> str:
    action = " (image skipped)" if problem["action"] == "skipped" else ""
    return f"{problem['file']}: {problem['detail']}{action}"


# ----------------------------------------------------------------------------- identity and place
def resolve(files: list[str], description: str = "") -> tuple[list[str], list[str]]:
    """(the real path of each file, its identity line) with one ``lstat`` per file: each folder resolved once,
    a symlinked file resolved itself (and its target's identity taken)."""
    folders: dict[str, str] = {}  # a file's folder as written (with its trailing separator) -> real folder + separator
    paths, identities = [], []
    lstat, is_link = os.lstat, stat.S_ISLNK
    for file in _progress(files, description):
        head, sep, name = file.rpartition(os.sep)  # string operations only: this loop runs once per file
        folder = head + sep
        real = folders.get(folder)
        if real is None:
            real = folders[folder] = os.path.join(os.path.realpath(folder or os.curdir), "")
        path = real + name
        try:
            info = lstat(path)
            if is_link(info.st_mode):
                path = os.path.realpath(path)
                info = os.stat(path)
        except (OSError, ValueError):
            info = None
        paths.append(path)
        identities.append(f"{path}\t-" if info is None else
                          f"{path}\t{info.st_dev}\t{info.st_ino}\t{info.st_size}\t{info.st_mtime_ns}")
    return paths, identities


def split_key(real_images: list[str], image_identities: list[str], real_labels: list[str],
              label_identities: list[str], nc: int, single_cls: bool) -> str:
    """Hash of every image and label file's identity (see the module docstring) and the options."""
    digest = hashlib.sha256(f"{CACHE_VERSION}\t{nc}\t{single_cls}\n".encode())
    order = sorted(range(len(real_images)), key=lambda i: (real_images[i], real_labels[i]))
    for i in order:
        digest.update(f"{image_identities[i]}\n{label_identities[i]}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _progress(items, description: str):
    """``items`` with a progress bar when there are many (a split of 100k images takes seconds here)."""
    if not description or len(items) < 20000:
        return items
    return tqdm(items, desc=description, unit="file", disable=None, leave=False)


def user_cache_path(labels_folder: str, cache_dir=None) -> Path:
    """<cache_dir>/<hash of the labels folder's real path>.npz: the same for every path to one dataset."""
    folder = Path(cache_dir) if cache_dir is not None else user_cache_folder("labels")
    real = os.path.realpath(labels_folder) + ".cache.npz"
    return folder / (hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:20] + ".npz")


class LabelCache:
    """The cache of one split as seen from one set of paths: ``load()`` and ``save(result)``."""

    def __init__(self, im_files: list[str], label_files: list[str], nc: int, single_cls: bool, cache_dir=None):
        real_images, image_identities = resolve(im_files, "resolving image paths")
        self.identity = real_images == im_files  # the usual case: no link on the way, nothing to rename
        self.real_of = dict(zip(im_files, real_images))
        self.path_of = {real: path for path, real in self.real_of.items()}
        if len(self.path_of) != len(self.real_of):  # two paths to one file inside the split: no sharing
            self.real_of = self.path_of = {path: path for path in im_files}
            real_images, self.identity = im_files, True
        real_labels, label_identities = resolve(label_files, "resolving label paths")
        self.key = split_key(real_images, image_identities, real_labels, label_identities, nc, single_cls)
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
            if result is None:
                continue
            try:
                renamed = result if self.identity else _renamed(result, self.path_of)
            except KeyError:  # a file the key covered is not ours: cannot happen unless the hash collides
                continue
            LOGGER.debug(f"{path}: label cache hit")
            return renamed
        return None

    def save(self, result: SplitLabels) -> Path | None:
        """Write atomically beside the labels when that is allowed and possible, else to the user
        cache folder; returns the path written (None when neither is writable)."""
        arrays = cache_arrays(result if self.identity else _renamed(result, self.real_of), self.key)
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
    renamed = SplitLabels(result.flat.with_files(names).take(order), dict(result.stats), problems=problems)
    renamed.messages = [problem_message(problem) for problem in problems]
    return renamed


# ----------------------------------------------------------------------------- file format
def cache_arrays(result: SplitLabels, key: str) -> dict[str, np.ndarray]:
    """Plain numeric arrays (no objects) holding ``result``; metadata as a UTF-8 JSON byte array."""
    meta = {"version": CACHE_VERSION, "hash": key, "stats": result.stats, "problems": result.problems}
    arrays = {FILE_KEYS.get(name, name): array for name, array in result.flat.arrays().items()}
    return {"meta": np.frombuffer(json.dumps(meta).encode("utf-8", "surrogateescape"), dtype=np.uint8), **arrays}


def result_from_arrays(arrays, key: str) -> SplitLabels | None:
    """The SplitLabels stored in ``arrays``, or None when it belongs to another file list/version; ValueError
    (or KeyError) when the arrays do not fit together."""
    meta = json.loads(bytes(arrays["meta"]).decode("utf-8", "surrogateescape"))
    if meta.get("version") != CACHE_VERSION or meta.get("hash") != key:
        return None
    flat = FlatLabels.from_arrays({name: arrays[FILE_KEYS.get(name, name)] for name in ARRAY_NAMES})
    result = SplitLabels(flat, stats=meta["stats"], problems=meta["problems"])
    result.messages = [problem_message(p) for p in result.problems]
    return result


def _read(path: Path, key: str) -> SplitLabels | None:
    if not path.is_file():
        return None
    try:
        with zipfile.ZipFile(path) as archive:  # np.savez stores its arrays: reading costs at most the file's size
            packed = next((info.filename for info in archive.infolist() if info.compress_type != zipfile.ZIP_STORED),
                          None)
        if packed is not None:
            raise ValueError(f"{packed} is compressed, as np.savez never writes it")
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
