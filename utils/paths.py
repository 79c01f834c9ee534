"""Output folders and the files written in them.

- Run folders: runs/<task>/exp, exp2, exp3, ... never overwriting an earlier run (``increment_path``).
- Names taken from files (class names of a model) become one safe path component (``safe_component``) and
  the folder they name must resolve inside the output folder (``inside``); ``crop_folder`` is detect.py's
  crops/<class>/ folder.
- Files in a run folder are written without following symbolic links: ``replace_text`` (temp file created
  with O_EXCL | O_NOFOLLOW beside the target, fsync, atomic rename) and ``append_text`` (O_NOFOLLOW); a run
  folder that holds symbolic links is refused before a resumed run writes into it (``symlinks_in``).
- ``FolderLock``: a lock file owned by the running process (a POSIX record lock, which the kernel releases
  when the process ends however it ends), so two processes never train in one run folder at once.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import threading
import time
from pathlib import Path

from utils.errors import UserError, WriteError

LOGGER = logging.getLogger(__name__)
MAX_COMPONENT = 100  # characters kept of a name used as a folder name
UNSAFE_CHARACTERS = '/\\:*?"<>|'  # separators here or on Windows, and characters Windows refuses in names
LOCK_NAME = ".run.lock"
RECORD_BYTES = 512  # at most this much of a lock or marker file is read


class OutsideFolderError(UserError):
    """A name from a file would place an output outside the folder the user asked for."""


class FolderBusy(UserError):
    """Another live process holds a run folder's lock."""


def increment_path(path: str | os.PathLike, exist_ok: bool = False, mkdir: bool = False) -> Path:
    """Return ``path`` if it is free (or ``exist_ok``), else the first free ``path2``, ``path3``, ...

    With ``mkdir`` the folder is created atomically (``os.mkdir`` fails if another process took the
    name first, and the next number is tried), so concurrent runs never share a folder.
    """
    path = Path(path)
    if exist_ok:
        if mkdir:
            path.mkdir(parents=True, exist_ok=True)
        return path
    stem, suffix = (path.stem, path.suffix) if path.suffix and not mkdir else (path.name, "")
    for number in range(1, 100000):
        candidate = path if number == 1 else path.with_name(f"{stem}{number}{suffix}")
        if candidate.exists():
            continue
        if not mkdir:
            return candidate
        candidate.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(candidate)
        except FileExistsError:  # another process took it between the check and the mkdir
            continue
        return candidate
    raise RuntimeError(f"no free run folder next to {path}")


# ---------------------------------------------------------------------- names from files

def safe_component(name, fallback: str) -> str:
    """``name`` as one file-name component: separators, control and Windows-reserved characters become
    "_", leading dots and spaces are dropped, at most MAX_COMPONENT characters; ``fallback`` (e.g. the class
    index) when nothing usable is left or ``name`` is not a string. "../../x" -> "_.._x", "/abs/x" -> "_abs_x"."""
    if not isinstance(name, str):
        return fallback
    cleaned = "".join("_" if ch in UNSAFE_CHARACTERS or not ch.isprintable() else ch for ch in name[:MAX_COMPONENT])
    cleaned = cleaned.lstrip(". ").rstrip(" ")
    return cleaned if cleaned and cleaned not in (".", "..") else fallback


def inside(folder: Path, *parts: str) -> Path:
    """``folder / parts``, refused (OutsideFolderError) unless it resolves inside ``folder`` (following any
    symbolic link already on disk)."""
    base = Path(folder).resolve()
    target = Path(folder).joinpath(*parts)
    if not target.resolve().is_relative_to(base):
        raise OutsideFolderError(f"{target}: resolves outside {folder}; refusing to write there")
    return target


def crop_folder(save_dir: Path, names, index: int) -> Path:
    """detect.py --save-crop's folder for class ``index``: crops/<class name as one safe component>, or
    crops/<index> when the name has nothing usable (or the index has no name)."""
    name = names[index] if 0 <= index < len(names) else None
    return inside(Path(save_dir) / "crops", safe_component(name, str(index)))


# ---------------------------------------------------------------------- files in run folders

def replace_text(path: Path, text: str) -> None:
    """Make ``path`` hold ``text`` atomically, never writing through a symbolic link: a temp file beside it
    (created anew, O_EXCL | O_NOFOLLOW), fsync, rename over ``path`` (a link at ``path`` is replaced, not
    followed). WriteError names the file when that fails."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        temp.unlink(missing_ok=True)  # a leftover (or a planted link): removed, never opened
        handle = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o666)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(text)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
    except OSError as error:
        raise WriteError(f"could not write {path}: {error.strerror or error}") from None


def append_text(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` (created if missing), refusing to write through a symbolic link."""
    try:
        handle = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o666)
    except OSError as error:
        reason = "it is a symbolic link" if error.errno == errno.ELOOP else error.strerror or str(error)
        raise WriteError(f"could not write {path}: {reason}") from None
    with os.fdopen(handle, "a", encoding="utf-8") as file:
        file.write(text)


def read_small(path: Path, limit: int = RECORD_BYTES) -> str | None:
    """The first ``limit`` bytes of a regular file as text, without following a symbolic link (None when
    ``path`` is a link, not a regular file, or unreadable): for markers and lock records only."""
    try:
        handle = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return None
        return os.read(handle, limit).decode("utf-8", errors="replace")
    except OSError:
        return None
    finally:
        os.close(handle)


def symlinks_in(folder: Path, subfolders: tuple[str, ...] = ("weights",)) -> list[str]:
    """Names of the symbolic links directly in ``folder`` and in its ``subfolders`` ("weights/last.pt")."""
    found = []
    for prefix in ("", *subfolders):
        where = Path(folder) / prefix if prefix else Path(folder)
        if prefix and (where.is_symlink() or not where.is_dir()):
            continue  # a linked subfolder is reported as an entry of the folder itself
        try:
            entries = list(os.scandir(where))
        except OSError:
            continue
        found += [f"{prefix}/{entry.name}" if prefix else entry.name for entry in entries if entry.is_symlink()]
    return sorted(found)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


# ---------------------------------------------------------------------- the run folder lock

class FolderLock:
    """``<folder>/.run.lock``, held by this process while it trains in ``folder``.

    The lock is a POSIX record lock on that file: it belongs to this process only (not to the dataloader
    workers it forks) and the kernel drops it when the process ends, even by SIGKILL. The file holds a
    one-line record of the owner (pid, host, start time, what it does) for the messages. ``acquire`` raises
    FolderBusy while a live process holds the lock; a file left by a dead one is taken over (its record is
    returned, for a log line). ``release`` removes the file and drops the lock.
    """

    def __init__(self, folder: Path, name: str = LOCK_NAME):
        self.folder = Path(folder)
        self.path = self.folder / name
        self.handle: int | None = None

    def acquire(self, purpose: str = "training") -> str | None:
        """Take the lock; the record of the dead owner taken over, or None when the lock was free."""
        for _ in range(10):  # the holder may remove the file between our open and our lock: try the new one
            handle = self._open()
            try:
                if not self._lock(handle):
                    os.close(handle)
                    continue
                previous = _record(handle)
                record = (f"pid {os.getpid()} on {socket.gethostname()}, {purpose}, "
                          f"since {time.strftime('%Y-%m-%d %H:%M:%S')}")
                os.ftruncate(handle, 0)
                os.pwrite(handle, (record + "\n").encode("utf-8"), 0)
            except BaseException:
                os.close(handle)
                raise
            self.handle = handle
            return previous or None
        raise FolderBusy(f"{self.folder}: could not take the run folder's lock {self.path} (it keeps changing)")

    def release(self) -> None:
        """Remove the lock file (when it is still ours) and drop the lock."""
        if self.handle is None:
            return
        handle, self.handle = self.handle, None
        try:
            if _same_file(handle, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(handle)

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o644)
        except OSError as error:
            reason = "it is a symbolic link" if error.errno == errno.ELOOP else error.strerror or str(error)
            raise WriteError(f"could not write {self.path}: {reason}") from None

    def _lock(self, handle: int) -> bool:
        """True when this process now holds the lock on ``handle``'s file and that file is still at
        ``self.path``; False to try again (the caller closes ``handle``); FolderBusy when another process
        holds it."""
        try:
            import fcntl
        except ImportError:  # no POSIX locks on this platform: the file records the owner, nothing enforces it
            return True
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks
                LOGGER.warning("WARNING: %s: cannot lock (%s); make sure no other process trains in %s", self.path,
                               error.strerror or error, self.folder)
                return True
            raise FolderBusy(f"{self.folder}: this run folder is in use by another process "
                             f"({_record(handle) or 'no record'}; lock file {self.path}); two processes cannot "
                             "train in one run folder at once: wait for it to end or stop it") from None
        return _same_file(handle, self.path)


def _same_file(handle: int, path: Path) -> bool:
    try:
        here, there = os.fstat(handle), os.lstat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _record(handle: int) -> str:
    """The owner record in a lock file: its first line, printable characters only."""
    try:
        text = os.pread(handle, RECORD_BYTES, 0).decode("utf-8", errors="replace")
    except OSError:
        return ""
    return _printable(text)


def _printable(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return "".join(ch if ch.isprintable() else "?" for ch in line[:limit])
