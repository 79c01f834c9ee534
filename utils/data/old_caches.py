"""Disk-cache files beside a dataset's images that nothing reads: found and reported, never left unnoticed.

``--cache disk`` keeps a split's resized images in one store in the user cache folder
(``utils.data.image_cache``); it writes nothing beside the images. Earlier versions kept the pixels of
``a.jpg`` as ``a.jpg.npy`` beside it, and YOLOv5 keeps them as ``a.npy``. Three kinds of .npy files beside
images take disk space without being read:

- YOLOv5's cache, ``a.npy`` beside ``a.jpg``: this trainer never reads it (the name is ambiguous: a.jpg and
  a.png would share it);
- an earlier version's, ``a.jpg.npy`` beside ``a.jpg``;
- an earlier version's for images that are gone, ``x.jpg.npy`` without ``x.jpg``.

A .npy file counts only when its header says it holds what those caches hold, an image's pixels: one uint8
H x W x 3 array, and nothing after it (``image_array``: the header alone is read, never the data, never a pickle).
A user's depth map or features named ``a.npy`` beside ``a.jpg`` are not leftovers, and a file whose header cannot
be read is not one either.

Each kind found is one log line per split, with the count, the size, the folders and a shell command that removes
exactly those files, by name: ``(cd FOLDER && rm -f -- NAME ...)`` for up to ``SHOWN_FILES`` files, else
``xargs -0 rm -f -- < LIST``, LIST a file of their paths (NUL-separated) in ``user_cache_folder("old-caches")``.
Nothing is deleted: the files may be another tool's or another run's, and the dataset folder is the user's.
``survey`` finds them (one listing per image folder, one header read per candidate); ``report`` logs them.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from utils.data.cache_folders import private_cache_folder, user_cache_folder
from utils.data.images import IMG_EXTENSIONS
from utils.errors import UserError
from utils.files import atomic_write, open_regular

LOGGER = logging.getLogger(__name__)
SHOWN_FOLDERS = 2  # folders named in a line (the rest counted)
SHOWN_FILES = 20  # files a removal command names at most; more are listed in a file (see _command)
LISTS = "old-caches"  # user_cache_folder(LISTS): those lists


@dataclass
class Found:
    """One kind of leftover: file names per folder and their total size in bytes."""
    files: dict[str, list[str]] = field(default_factory=dict)
    size: int = 0

    def add(self, folder: str, name: str) -> None:
        """Count ``folder/name`` when it is an image array (``image_array``)."""
        size = image_array(os.path.join(folder, name))
        if size is None:
            return
        self.size += size
        self.files.setdefault(folder, []).append(name)

    @property
    def count(self) -> int:
        return sum(len(names) for names in self.files.values())


def image_array(path: str) -> int | None:
    """The size in bytes of ``path`` when it is a regular .npy file holding one uint8 H x W x 3 array and nothing
    else (the header's length plus H * W * 3 bytes), as YOLOv5's and earlier --cache disk files are; else None
    (another array, a broken header, a link, not a regular file). Only the header is read (numpy.lib.format,
    versions 1.0 and 2.0): never the data, never a pickle."""
    try:
        with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as file:
            version = np.lib.format.read_magic(file)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(file)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(file)
            else:
                return None
            size = os.fstat(file.fileno()).st_size
            data_offset = file.tell()
    except (OSError, ValueError, EOFError):
        return None
    if dtype != np.uint8 or len(shape) != 3 or shape[2] != 3 or min(shape) <= 0:
        return None
    return size if size == data_offset + shape[0] * shape[1] * 3 else None


@dataclass
class Survey:
    yolov5: Found = field(default_factory=Found)  # a.npy beside a.jpg
    orphans: Found = field(default_factory=Found)  # x.jpg.npy without x.jpg (an earlier version's)
    ours: Found = field(default_factory=Found)  # a.jpg.npy beside a.jpg (an earlier version's)


def survey(im_files) -> Survey:
    """The image-array .npy files beside the images ``im_files`` (one listing of each of their folders). The
    per-image work is grouping by folder (string operations: 100k images in ~0.1 s); the rest is per folder, and
    per image only in a folder that holds .npy files: one header read per .npy file of one of the three kinds."""
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
        stems = {os.path.splitext(name)[0] for name in images}
        for name in npy:
            base = name[: -len(".npy")]
            suffix = Path(base).suffix
            if base in images:
                found.ours.add(folder, name)
            elif suffix[1:].lower() in IMG_EXTENSIONS:
                if base not in names:
                    found.orphans.add(folder, name)
            elif base in stems:
                found.yolov5.add(folder, name)
    return found


def report(im_files, prefix: str = "") -> Survey:
    """Log one line per kind of leftover found beside ``im_files`` (see the module docstring); returns the survey."""
    found = survey(im_files)
    if found.yolov5.count:
        LOGGER.warning("%sWARNING: %s: never read by this trainer (it caches a.jpg as a.jpg.npy); remove them with: %s",
                       prefix, _described(found.yolov5, "YOLOv5 disk-cache files (a.npy beside a.jpg)"),
                       _command(found.yolov5, "yolov5"))
    if found.orphans.count:
        LOGGER.warning("%sWARNING: %s: their images are gone; remove them with: %s", prefix,
                       _described(found.orphans, "--cache disk files (x.jpg.npy)"), _command(found.orphans, "orphans"))
    if found.ours.count:
        LOGGER.warning("%sWARNING: %s: never read (--cache disk now keeps one file per split in %s); remove them "
                       "with: %s", prefix, _described(found.ours, "files of an earlier --cache disk (a.jpg.npy)"),
                       user_cache_folder("images"), _command(found.ours, "ours"))
    return found


def _described(found: Found, what: str) -> str:
    folders = list(found.files)
    shown = ", ".join(folders[:SHOWN_FOLDERS]) + (f" and {len(folders) - SHOWN_FOLDERS} more folders"
                                                 if len(folders) > SHOWN_FOLDERS else "")
    return f"{found.count} {what}, {found.size / 1e6:.1f} MB, in {shown}"


def _command(found: Found, kind: str) -> str:
    """A shell command on one line that removes the files found and nothing else, naming them: per folder
    ``(cd FOLDER && rm -f -- NAME ...)``, quoted, for up to SHOWN_FILES files with printable names; else
    ``xargs -0 rm -f -- < LIST`` over a list of their paths (``_write_list``). Where that list cannot be
    written: the first SHOWN_FILES printable ones, and how many more there are."""
    if found.count <= SHOWN_FILES and all(_printable(folder, names) for folder, names in found.files.items()):
        return _remove_by_name(found.files)
    try:
        listing = _write_list(found, kind)
    except (OSError, UserError) as error:
        shown, left = {}, SHOWN_FILES
        for folder, names in found.files.items():
            names = [name for name in names if _printable(folder, [name])][:left] if folder.isprintable() else []
            if names:
                shown[folder], left = names, left - len(names)
        listed = sum(len(names) for names in shown.values())
        return (f"{_remove_by_name(shown)} ; and {found.count - listed} more files not named here (their list "
                f"could not be written: {error})")
    return f"xargs -0 rm -f -- < {shlex.quote(str(listing))}"


def _printable(folder: str, names) -> bool:
    return folder.isprintable() and all(name.isprintable() for name in names)


def _remove_by_name(files: dict[str, list[str]]) -> str:
    return " ; ".join(f"(cd {shlex.quote(folder)} && rm -f -- {' '.join(shlex.quote(name) for name in names)})"
                      for folder, names in files.items())


def _write_list(found: Found, kind: str) -> Path:
    """The paths of the files found, NUL-separated, in ``user_cache_folder(LISTS)`` (this user's alone), named by
    the kind and the list's digest: the same leftovers give the same file."""
    paths = b"".join(os.fsencode(os.path.join(folder, name)) + b"\0"
                     for folder, names in found.files.items() for name in names)
    return atomic_write(private_cache_folder(LISTS) / f"{kind}-{hashlib.sha256(paths).hexdigest()[:16]}.list", paths)
