"""The one home of file safety: how the project writes, appends to, reads and locks the files it keeps.

- ``AtomicFile`` / ``atomic_write``: the one temp-then-rename writer. A new temp file beside the target (random
  name, created with O_EXCL | O_NOFOLLOW, so never an existing file or a planted link), written, fsynced, renamed
  over the target with ``os.replace`` (a link at the target is replaced, not followed), the folder fsynced. Any
  failure removes the temp file and leaves the target as it was. New files get 0o666 minus the umask.
- ``replace_with_link(source, target)``: ``target`` holds ``source``'s bytes atomically (a hard link, else a copy
  through ``AtomicFile``); ``remove_stale_temps(path)`` removes what a killed writer of ``path`` left.
- ``create_temp``: THE temp file beside a target (``.NAME.<random>.tmp.SUFFIX``): created with O_EXCL | O_NOFOLLOW
  and held under ``flock`` while its writer lives, so ``remove_stale_temps`` can tell a dead writer's leftover
  from a live download; mode 0o666 minus the umask (files in folders the user names), or 0o600 with ``private``.
- ``current_umask`` / ``new_mode``: the umask read without setting it (no process-wide ``os.umask(0)`` window in
  which another thread's new file would get mode 0o666).
- ``append_text``: O_APPEND, never through a link.
- ``read_regular``: THE safe read of a file of ours that others may have touched: never through a link, never
  blocking on a FIFO, only a regular file, at most ``limit`` bytes (``FileTooLarge`` past it).
- ``FolderLock``: THE lock between processes: ``flock`` of a lock file, see its docstring.
- ``file_identity``: what a file is now (device, inode, size, mtime), to notice that it was replaced.
- ``read_ahead``: ask the kernel to start reading files we are about to read (dataset scans, cache fills).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path

from utils.errors import UserError

LOGGER = logging.getLogger(__name__)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
LINK_ERRNOS = {errno.ELOOP, errno.EMLINK}  # what open(O_NOFOLLOW) reports for a symbolic link (EMLINK: BSDs)
TEMP_MARK = ".tmp"
RECORD_BYTES = 512  # at most this much of a lock file is read


class NotRegularFile(OSError):
    """A symbolic link or a special file (FIFO, device, folder) where a regular file of ours belongs."""


class FileTooLarge(OSError):
    """A file larger than its reader allows."""


class FolderBusy(UserError):
    """Another live process holds a lock; ``record`` is what its lock file says about the holder."""

    def __init__(self, message: str, record: str = ""):
        super().__init__(message)
        self.record = record


# ---------------------------------------------------------------------- opening and reading

def open_regular(path, flags: int, mode: int = 0o666) -> int:
    """``os.open`` of a regular file, never through a symbolic link and never blocking on a FIFO planted under
    the name (O_NONBLOCK; a regular file ignores it). NotRegularFile otherwise; other OSErrors as raised."""
    try:
        handle = os.open(path, flags | NOFOLLOW | CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as error:
        if error.errno in LINK_ERRNOS:
            raise NotRegularFile(errno.ELOOP, "it is a symbolic link", str(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(handle).st_mode):
        os.close(handle)
        raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
    return handle


def read_regular(path, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (``open_regular``), refused with FileTooLarge when it holds more
    than ``limit`` bytes (at most limit + 1 are read). FileNotFoundError when missing."""
    handle = open_regular(path, os.O_RDONLY)
    with os.fdopen(handle, "rb") as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise FileTooLarge(errno.EFBIG, f"larger than {limit:,} bytes", str(path))
    return data


def file_identity(path) -> tuple[int, int, int, int] | None:
    """(device, inode, size, mtime in ns) of ``path`` itself (a link is not followed), None when missing: every
    atomic replacement gives a new inode, so a changed identity means the file was rewritten."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


# ---------------------------------------------------------------------- writing

def read_ahead(paths) -> None:
    """Ask the kernel to start reading ``paths`` now (posix_fadvise WILLNEED; where that does not exist, nothing),
    so that on a cold disk many reads are in flight while the caller works through earlier files: a 100k-image
    scan from a cold page cache ran 2.7x faster. Never blocks on a FIFO; a path that cannot be opened is skipped
    (its reader reports it)."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK | CLOEXEC)
        except OSError:
            continue
        try:
            os.posix_fadvise(handle, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(handle)


def temp_path(path: Path) -> Path:
    """A fresh hidden temp name beside ``path`` (same suffix, so readers that go by it can check the temp file)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(8)}{TEMP_MARK}{path.suffix}")


def current_umask() -> int:
    """The process's umask without changing it: Linux reports it in /proc/self/status. Elsewhere it can only be
    read by setting it (``os.umask``), so there it is set back to the value it had at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def new_mode(folder: bool = False) -> int:
    """The mode a new file (or folder) gets here: 0o666 (0o777) minus the umask."""
    return (0o777 if folder else 0o666) & ~current_umask()


def create_temp(path, private: bool = False) -> tuple[int, Path]:
    """(handle, temp path): a new temp file beside ``path`` (``temp_path``), opened for writing with O_EXCL and
    O_NOFOLLOW and locked (``flock``) by the handle until it is closed, so that ``remove_stale_temps`` leaves a
    live writer's file alone. Mode 0o666 minus the umask, or 0o600 with ``private`` (a private cache's file)."""
    path = Path(path)
    for _ in range(10):
        temp = temp_path(path)
        try:
            handle = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC,
                             0o600 if private else 0o666)
        except FileExistsError:
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a file system without locks: the age rule of remove_stale_temps still protects it
            pass
        return handle, temp
    raise FileExistsError(errno.EEXIST, "no free temp name", str(path))


def write_temp(path, data: bytes) -> Path:
    """A ``create_temp`` file beside ``path`` holding ``data``, for a caller that checks it before it takes the
    name (export.py's formats); removed again when the write fails."""
    handle, temp = create_temp(path)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp


STALE_AGE = 10.0  # seconds: a temp file younger than this is never removed (its writer may not hold its lock yet)


def remove_stale_temps(path) -> list[Path]:
    """Remove the temp files (``create_temp``/``AtomicFile``) that killed writers of ``path`` left beside it and
    return them: only a file whose lock this process can take (its writer is gone: the kernel drops a flock
    with the last handle, however the process ended) and that is older than STALE_AGE seconds. A live writer's
    file, even another process's, is left alone."""
    import time

    path = Path(path)
    removed = []
    for stale in path.parent.glob(f".{_glob_escape(path.name)}.*{TEMP_MARK}{_glob_escape(path.suffix)}"):
        try:
            handle = os.open(stale, os.O_RDONLY | NOFOLLOW | CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            info = os.fstat(handle)
            if not stat.S_ISREG(info.st_mode) or time.time() - info.st_mtime < STALE_AGE:
                continue
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno in (errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK):
                    continue  # a live writer holds it
            if _same_file(handle, stale):
                stale.unlink(missing_ok=True)
                removed.append(stale)
        finally:
            os.close(handle)
    return removed


def _glob_escape(text: str) -> str:
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in text)


class AtomicFile:
    """``with AtomicFile(path) as out: out.write(data)`` (or ``out.file``, a binary file): ``path`` holds exactly
    what was written once the block ends, and is untouched when it raises. ``out.temp`` is the file being
    written (complete once flushed), for a caller that checks it before it takes the name (export.py)."""

    def __init__(self, path):
        self.path = Path(path)
        self.temp = None  # the create_temp file, from __enter__ on
        self.file = None

    def __enter__(self) -> "AtomicFile":
        handle, self.temp = create_temp(self.path)
        self.file = os.fdopen(handle, "wb")
        return self

    def write(self, data) -> None:
        self.file.write(data.encode("utf-8") if isinstance(data, str) else data)

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if kind is None:  # complete: make it durable, then give it the name
                self.file.flush()
                os.fsync(self.file.fileno())
                self.file.close()
                os.replace(self.temp, self.path)
                fsync_folder(self.path.parent)
        finally:
            if not self.file.closed:
                try:
                    self.file.close()
                except OSError:  # the write already failed (e.g. a full disk): that error is the one raised
                    pass
            self.temp.unlink(missing_ok=True)  # gone after the rename; what a failure left otherwise


def atomic_write(path, data) -> Path:
    """Make ``path`` hold ``data`` (bytes, str, or a function writing to a binary file) through ``AtomicFile``."""
    with AtomicFile(path) as out:
        data(out.file) if callable(data) else out.write(data)
    return Path(path)


def replace_with_link(source, target) -> None:
    """Make ``target`` hold ``source``'s bytes atomically: a hard link renamed over it (instant; ``source`` is
    only ever replaced by a new file, never written in place, so the link keeps these bytes), else a copy
    written through ``AtomicFile`` (no hard links on this file system, or across devices)."""
    source, target = Path(source), Path(target)
    temp = temp_path(target)
    try:
        os.link(source, temp)
    except OSError:
        with open(source, "rb") as reader, AtomicFile(target) as out:
            shutil.copyfileobj(reader, out.file)
        return
    try:
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_folder(target.parent)


def append_text(path, text: str) -> None:
    """Append ``text`` to ``path`` (created if missing), never through a symbolic link (NotRegularFile)."""
    handle = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(handle, "a", encoding="utf-8") as file:
        file.write(text)


def fsync_folder(folder) -> None:
    """Make a rename in ``folder`` durable (a crash right after must not bring the old name back)."""
    try:
        handle = os.open(folder, os.O_RDONLY | CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


# ---------------------------------------------------------------------- the lock

class FolderLock:
    """An exclusive lock between processes on ``folder/name``: ``flock`` of that file, opened without following
    a link (a link or a special file under the name is refused: NotRegularFile).

    flock, not POSIX record locks (lockf / fcntl F_SETLK): a record lock belongs to the process and the kernel
    drops it as soon as the process closes *any* handle of the file (anything that reads it), while a flock
    belongs to the open handle, so only ``release`` or the handle's closing drops it, and the kernel does that
    when the process ends however it ends (SIGKILL included). Processes forked while it is held (loader workers)
    close their copy of the handle at once, so the lock never outlives the process that took it.

    The file may carry a short text (``read`` / ``write``): the holder's record (``acquire(record=...)``, shown
    in FolderBusy), or the next proposal number of an evolve folder. As a context manager it waits for the lock.
    """

    def __init__(self, folder, name: str):
        self.folder = Path(folder)
        self.path = self.folder / name
        self.handle: int | None = None

    def acquire(self, record: str | None = None, wait: bool = False) -> str:
        """Take the lock (waiting for it with ``wait``, else FolderBusy while another process holds it); returns
        what the file held (the record of a holder that died without releasing); with ``record`` the file then
        holds that line instead."""
        if self.handle is not None:
            raise FolderBusy(f"{self.path}: this process holds this lock already")
        for _ in range(10):  # the holder may remove the file between our open and our lock: try the new one
            handle = open_regular(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if not self._lock(handle, wait):
                    os.close(handle)
                    continue
                previous = _first_line(os.pread(handle, RECORD_BYTES, 0))
                if record is not None:
                    _rewrite(handle, record + "\n")
            except BaseException:
                os.close(handle)
                raise
            self.handle = handle
            _held_locks().add(self)
            return previous
        raise FolderBusy(f"{self.path}: could not take this lock (the file keeps being replaced)")

    def release(self, remove: bool = False) -> None:
        """Drop the lock; with ``remove`` the file is deleted first (when it is still the one locked)."""
        if self.handle is None:
            return
        handle, self.handle = self.handle, None
        _held_locks().discard(self)
        try:
            if remove and _same_file(handle, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(handle)

    def read(self) -> str:
        """The lock file's text (at most RECORD_BYTES), while holding the lock."""
        return os.pread(self.handle, RECORD_BYTES, 0).decode("utf-8", errors="replace")

    def write(self, text: str) -> None:
        """Replace the lock file's text, while holding the lock."""
        _rewrite(self.handle, text)

    def __enter__(self) -> "FolderLock":
        self.acquire(wait=True)
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _lock(self, handle: int, wait: bool) -> bool:
        """True when this handle now holds the lock of the file still at ``self.path``; False to try again."""
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks
                LOGGER.warning("WARNING: %s: cannot lock (%s); make sure no other process uses %s at the same time",
                               self.path, error.strerror or error, self.folder)
                return True
            record = _first_line(os.pread(handle, RECORD_BYTES, 0))
            raise FolderBusy(f"{self.folder}: in use by another process ({record or 'no record'}; lock file "
                             f"{self.path})", record) from None
        return _same_file(handle, self.path)


def _rewrite(handle: int, text: str) -> None:
    os.ftruncate(handle, 0)
    os.pwrite(handle, text.encode("utf-8"), 0)


def _same_file(handle: int, path: Path) -> bool:
    try:
        here, there = os.fstat(handle), os.lstat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _first_line(data: bytes, limit: int = 200) -> str:
    """The first line of a lock file's text, printable characters only (file content goes into messages)."""
    text = data.decode("utf-8", errors="replace").strip()
    line = text.splitlines()[0] if text else ""
    return "".join(ch if ch.isprintable() else "?" for ch in line[:limit])


_HELD: list = []  # [set of the FolderLocks this process holds], made with the fork hook on the first acquire


def _held_locks() -> set:
    """The locks held (kept referenced while held: dropping the object does not drop the lock)."""
    if not _HELD:
        _HELD.append(set())
        os.register_at_fork(after_in_child=_forget_in_child)
    return _HELD[0]


def _forget_in_child() -> None:
    """In a forked child: close the inherited handles of held locks without unlocking them (LOCK_UN would drop
    the parent's lock: the handle is shared), so the lock ends with the process that took it."""
    for lock in list(_HELD[0]):
        try:
            os.close(lock.handle)
        except (OSError, TypeError):
            pass
        lock.handle = None
    _HELD[0] = set()
