"""Disk-cache files beside a dataset's images that nothing reads: found and reported, never left unnoticed.

``--cache disk`` keeps a split's resized images in one store in the user cache folder
(``utils.data.image_cache``); it writes nothing beside the images. Earlier versions kept the pixels of
``a.jpg`` as ``a.jpg.npy`` beside it, and YOLOv5 keeps them as ``a.npy``. Three kinds of .npy files beside
images take disk space without being read:

- YOLOv5's cache, ``a.npy`` beside ``a.jpg``: this trainer never reads it (the name is ambiguous: a.jpg and
  a.png would share it);
- an earlier version's, ``a.jpg.npy`` beside ``a.jpg``;
- an earlier version's for images that are gone, ``x.jpg.npy`` without ``x.jpg``.

Each kind found is one log line per split, with the count, the size, the folders and a shell command that removes
exactly those files. Nothing is deleted: the files may be another tool's or another run's, and the dataset
folder is the user's. ``survey`` finds them (one listing per image folder); ``report`` logs them.
"""
from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from utils.data.cache_folders import user_cache_folder
from utils.data.images import IMG_EXTENSIONS

LOGGER = logging.getLogger(__name__)
SHOWN_FOLDERS = 2  # folders named in a line (the rest counted)


@dataclass
class Found:
    """One kind of leftover: file names per folder, their total size in bytes, and per folder the shell patterns
    that list the files the removal command tests (``*.jpg`` for the images, or ``*.jpg.npy``)."""
    files: dict[str, list[str]] = field(default_factory=dict)
    patterns: dict[str, set[str]] = field(default_factory=dict)
    size: int = 0

    def add(self, folder: str, name: str, pattern: str) -> None:
        try:
            self.size += os.stat(os.path.join(folder, name), follow_symlinks=False).st_size
        except OSError:
            return
        self.files.setdefault(folder, []).append(name)
        self.patterns.setdefault(folder, set()).add(pattern)

    @property
    def count(self) -> int:
        return sum(len(names) for names in self.files.values())


@dataclass
class Survey:
    yolov5: Found = field(default_factory=Found)  # a.npy beside a.jpg
    orphans: Found = field(default_factory=Found)  # x.jpg.npy without x.jpg (an earlier version's)
    ours: Found = field(default_factory=Found)  # a.jpg.npy beside a.jpg (an earlier version's)


def survey(im_files) -> Survey:
    """The .npy files beside the images ``im_files`` (one listing of each of their folders). The per-image work
    is grouping by folder (string operations: 100k images in ~0.1 s); the rest is per folder, and per image only in
    a folder that holds .npy files."""
    found = Survey()
    by_head: dict[str, set[str]] = {}
    for file in im_files:
        head, sep, name = os.fspath(file).rpartition(os.sep)
        by_head.setdefault(head + sep, set()).add(name)  # "dir/", "/" or "" (the working folder)
    by_folder: dict[str, set[str]] = {}
    for head, images in by_head.items():
        by_folder.setdefault(os.path.abspath(head or os.curdir), set()).update(images)
    for folder, images in by_folder.items():
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        npy = sorted(name for name in names if name.endswith(".npy"))
        if not npy:
            continue
        names = set(names)
        suffix_of_stem = {os.path.splitext(name)[0]: os.path.splitext(name)[1] for name in sorted(images)}
        for name in npy:
            base = name[: -len(".npy")]
            suffix = Path(base).suffix
            if base in images:
                found.ours.add(folder, name, f"*{suffix}")
            elif suffix[1:].lower() in IMG_EXTENSIONS:
                if base not in names:
                    found.orphans.add(folder, name, f"*{suffix}.npy")
            elif base in suffix_of_stem:
                found.yolov5.add(folder, name, f"*{suffix_of_stem[base]}")
    return found


def report(im_files, prefix: str = "") -> Survey:
    """Log one line per kind of leftover found beside ``im_files`` (see the module docstring); returns the survey."""
    found = survey(im_files)
    if found.yolov5.count:
        LOGGER.warning("%sWARNING: %s: never read by this trainer (it caches a.jpg as a.jpg.npy); remove them with: %s",
                       prefix, _described(found.yolov5, "YOLOv5 disk-cache files (a.npy beside a.jpg)"),
                       _command(found.yolov5, 'rm -f -- "${f%.*}.npy"'))
    if found.orphans.count:
        LOGGER.warning("%sWARNING: %s: their images are gone; remove them with: %s", prefix,
                       _described(found.orphans, "--cache disk files (x.jpg.npy)"),
                       _command(found.orphans, '[ -e "${f%.npy}" ] || rm -f -- "$f"'))
    if found.ours.count:
        LOGGER.warning("%sWARNING: %s: never read (--cache disk now keeps one file per split in %s); remove them "
                       "with: %s", prefix, _described(found.ours, "files of an earlier --cache disk (a.jpg.npy)"),
                       user_cache_folder("images"), _command(found.ours, 'rm -f -- "$f.npy"'))
    return found


def _described(found: Found, what: str) -> str:
    folders = list(found.files)
    shown = ", ".join(folders[:SHOWN_FOLDERS]) + (f" and {len(folders) - SHOWN_FOLDERS} more folders"
                                                 if len(folders) > SHOWN_FOLDERS else "")
    return f"{found.count} {what}, {found.size / 1e6:.1f} MB, in {shown}"


def _command(found: Found, body: str) -> str:
    """A shell command that removes the files found and nothing else: per folder, a loop over the files its
    patterns list, testing each as the survey did (``body``, on ``$f``; an unmatched pattern names no file)."""
    loops = [f"(cd {shlex.quote(folder)} && for f in {' '.join(sorted(found.patterns[folder]))}; do {body}; done)"
             for folder in found.files]
    return " ; ".join(loops[:SHOWN_FOLDERS]) + (f" ; the same in the {len(loops) - SHOWN_FOLDERS} other folders"
                                                if len(loops) > SHOWN_FOLDERS else "")
