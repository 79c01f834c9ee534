"""Folders only this user can change, for files the project later loads or that hold a user's data.

``private_folder(path)`` creates ``path`` (and missing parents) with mode 0700 and returns it, or raises
``UnsafeFolder`` with a one-line reason when anyone else could change what is in it:
- the folder (and every folder it creates) must be owned by this user and not writable by others; one of ours
  that others may read is made 0700;
- each existing folder above it must be owned by this user or root and writable by nobody else, unless it is
  sticky (a world-writable ``/tmp`` is fine: others cannot rename or remove what is ours inside it).
Without POSIX ownership (Windows) the folder is created and returned as it is.
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

LOGGER = logging.getLogger(__name__)
PRIVATE_MODE = 0o700


class UnsafeFolder(OSError):
    """A folder others could change; the message names it and says why."""


def private_folder(path: str | os.PathLike) -> Path:
    folder = Path(os.path.abspath(os.fspath(path)))
    if not hasattr(os, "getuid"):
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    missing = []
    existing = folder
    while not existing.exists():
        missing.append(existing)
        existing = existing.parent
    if not missing:
        _check_own(folder)
    for ancestor in ((existing, *existing.parents) if missing else folder.parents):
        _check_above(ancestor)
    for created in reversed(missing):
        try:
            os.mkdir(created, PRIVATE_MODE)
            os.chmod(created, PRIVATE_MODE)  # the umask may have taken bits away; never adds any
        except FileExistsError:  # made by a process beside this one (or put there): checked below, links refused
            pass
    for created in reversed(missing):
        _check_own(created)
    return folder


def _check_above(folder: Path) -> None:
    """A folder above ours: owned by this user or root; writable by others only when sticky."""
    info = os.stat(folder)  # links above are followed: /home -> /data/home is common and harmless
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolder(f"{folder} is not a folder")
    if info.st_uid not in (os.getuid(), 0):
        raise UnsafeFolder(f"{folder} belongs to another user (uid {info.st_uid}), who could replace what is below it")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise UnsafeFolder(f"{folder} may be written by other users (mode {stat.S_IMODE(info.st_mode):o}, not sticky)")


def _check_own(folder: Path) -> None:
    """One of the project's own folders: a real folder (no link), this user's, nobody else may write it; made 0700."""
    info = os.lstat(folder)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolder(f"{folder} is a link or not a folder")
    if info.st_uid != os.getuid():
        raise UnsafeFolder(f"{folder} belongs to another user (uid {info.st_uid})")
    if info.st_mode & 0o022:
        raise UnsafeFolder(f"{folder} may be written by other users (mode {stat.S_IMODE(info.st_mode):o})")
    if stat.S_IMODE(info.st_mode) != PRIVATE_MODE:
        os.chmod(folder, PRIVATE_MODE)
        LOGGER.info("%s: was mode %03o, others could read what is in it: now %03o (this user's alone)", folder,
                    stat.S_IMODE(info.st_mode), PRIVATE_MODE)
