"""The files of an evolve folder that several processes share (one per GPU, or containers on one volume):
never read or written through a symbolic link, never a half-written file, never a name two processes draw.

- ``open_folder_file`` opens with ``O_NOFOLLOW`` and refuses anything but a regular file (a planted link is
  an EvolveError naming it; a FIFO planted under the name cannot block the reader).
- ``read_folder_file`` reads at most ``MAX_CSV_BYTES``.
- ``FolderLock``: exclusive ``flock`` of ``evolve.csv.lock``, which also holds the next proposal number.
- ``replace_file`` writes a new file under a random name (``O_EXCL``) and renames it into place, which replaces
  a link planted under the final name instead of writing through it.
- ``make_scratch_folder``: ``.generation-<number>-<random>`` made by ``mkdir`` (process ids repeat across
  containers); ``remove_scratch_folder`` removes a link put in its place without following it.
"""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
from pathlib import Path

from utils.errors import UserError

CSV_NAME, LOCK_NAME = "evolve.csv", "evolve.csv.lock"
MAX_CSV_BYTES = 64 << 20  # evolve.csv: a row takes 756 bytes, so room for about 88,000 generations
SCRATCH_PREFIX = ".generation-"
LINK_ERRNOS = {errno.ELOOP, errno.EMLINK}  # what open(O_NOFOLLOW) reports for a symbolic link


class EvolveError(UserError):
    """A search-space file or evolve.csv that cannot be used; one line naming the file and the reason."""


def open_folder_file(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a regular file in the evolve folder, never through a symbolic link (``O_NOFOLLOW``) and
    never blocking on a FIFO planted under the name; EvolveError naming the file otherwise."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as error:
        if error.errno in LINK_ERRNOS:
            raise EvolveError(f"{path}: is a symbolic link; files in an evolve folder are never used through "
                              "links (remove it)") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise EvolveError(f"{path}: not a regular file (remove it)")
    return fd


def read_folder_file(path: Path, limit: int = MAX_CSV_BYTES) -> str:
    """The text of a file of the evolve folder ("" when missing), at most ``limit`` bytes."""
    try:
        fd = open_folder_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return ""
    except OSError as error:
        raise EvolveError(f"{path}: cannot read ({error.strerror or type(error).__name__})") from None
    with os.fdopen(fd, "rb") as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise EvolveError(f"{path}: larger than {limit >> 20} MB, more than an evolve.csv holds "
                          f"(about {limit // 756:,} generations); start a new evolve folder (--name)")
    return data.decode("utf-8", errors="replace")


class FolderLock:
    """Exclusive flock of ``evolve.csv.lock`` (a context manager); the file holds the next proposal number."""

    def __init__(self, folder):
        self.path = Path(folder) / LOCK_NAME
        self.fd = -1

    def __enter__(self) -> "FolderLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = open_folder_file(self.path, os.O_RDWR | os.O_CREAT)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1

    def _next(self) -> int:
        text = os.pread(self.fd, 32, 0).decode("ascii", errors="replace").strip()
        return int(text) if text.isdigit() and len(text) <= 12 else 1

    def _store(self, number: int) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{number}\n".encode("ascii"), 0)

    def claim(self, row_count: int) -> int:
        """The next proposal number: at least row_count + 1, never one claimed before (unless given back)."""
        number = max(self._next(), row_count + 1)
        self._store(number + 1)
        return number

    def give_back(self, number: int) -> None:
        """Return a failed proposal's number when it is the last claimed, so a restart reuses it."""
        if self._next() == number + 1:
            self._store(number)


def make_scratch_folder(folder, number: int) -> Path:
    """A new empty folder for one generation's training in ``folder``: ``.generation-<number>-<random>``,
    made by ``mkdir``, which fails rather than follow anything already under the name (a new name is drawn)."""
    for _ in range(8):
        path = Path(folder) / f"{SCRATCH_PREFIX}{number}-{secrets.token_hex(8)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise EvolveError(f"{folder}: could not create a generation folder (8 random names were taken)")


def remove_scratch_folder(path) -> None:
    """Remove a generation's folder; a symbolic link put in its place is removed itself, never followed."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def replace_file(folder: Path, name: str, write, sync: bool = False) -> Path:
    """``write(binary file)`` into a new temp file, then rename it over ``folder/name``: readers never see half
    a file, and a link planted under ``name`` is replaced, not written through. The temp file gets a random
    name, is created exclusively (``O_EXCL`` never follows a link) with the umask's permissions, like any
    file the run writes, and is fsynced first when ``sync``."""
    temp = folder / f".{name}.{secrets.token_hex(8)}{Path(name).suffix}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            if sync:
                os.fsync(file.fileno())
        os.replace(temp, folder / name)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return folder / name
