"""The files of an evolve folder that several processes share (one per GPU, or containers on one volume):
never read or written through a symbolic link, never a half-written file, never a name two processes draw.
Reading, writing and locking go through utils.files; this module adds what is particular to the folder:

- ``read_folder_file``: evolve.csv's text, at most ``MAX_CSV_BYTES``; a planted link or special file (a FIFO
  cannot block the reader) is an EvolveError naming it.
- ``ProposalLock``: the folder's lock (``evolve.csv.lock``, utils.files.FolderLock), whose
  file also holds the next proposal number.
- ``replace_file``: utils.files.atomic_write of a file of the folder (a link planted under the name is
  replaced, not written through).
- ``make_scratch_folder``: ``.generation-<number>-<random>`` made by ``mkdir`` (process ids repeat across
  containers); ``remove_scratch_folder`` removes a link put in its place without following it.
"""
from __future__ import annotations

import errno
import secrets
import shutil
from pathlib import Path

from utils import files
from utils.errors import UserError

CSV_NAME, LOCK_NAME = "evolve.csv", "evolve.csv.lock"
MAX_CSV_BYTES = 64 << 20  # evolve.csv: a row takes 756 bytes, so room for about 88,000 generations
SCRATCH_PREFIX = ".generation-"


class EvolveError(UserError):
    """A search-space file or evolve.csv that cannot be used; one line naming the file and the reason."""


def _refused(path: Path, error: files.NotRegularFile) -> EvolveError:
    if error.errno == errno.ELOOP:
        return EvolveError(f"{path}: is a symbolic link; files in an evolve folder are never used through links "
                           "(remove it)")
    return EvolveError(f"{path}: not a regular file (remove it)")


def read_folder_file(path: Path, limit: int = MAX_CSV_BYTES) -> str:
    """The text of a file of the evolve folder ("" when missing), at most ``limit`` bytes."""
    try:
        data = files.read_regular(path, limit)
    except FileNotFoundError:
        return ""
    except files.NotRegularFile as error:
        raise _refused(path, error) from None
    except files.FileTooLarge:
        raise EvolveError(f"{path}: larger than {limit >> 20} MB, more than an evolve.csv holds "
                          f"(about {limit // 756:,} generations); start a new evolve folder (--name)") from None
    except OSError as error:
        raise EvolveError(f"{path}: cannot read ({error.strerror or type(error).__name__})") from None
    return data.decode("utf-8", errors="replace")


class ProposalLock(files.FolderLock):
    """The evolve folder's lock (a context manager that waits for it); its file holds the next proposal number."""

    def __init__(self, folder):
        super().__init__(folder, LOCK_NAME)

    def __enter__(self) -> "ProposalLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            return super().__enter__()
        except files.NotRegularFile as error:
            raise _refused(self.path, error) from None

    def _next(self) -> int:
        text = self.read().strip()
        return int(text) if text.isdigit() and len(text) <= 12 else 1

    def claim(self, row_count: int) -> int:
        """The next proposal number: at least row_count + 1, never one claimed before (unless given back)."""
        number = max(self._next(), row_count + 1)
        self.write(f"{number + 1}\n")
        return number

    def give_back(self, number: int) -> None:
        """Return a failed proposal's number when it is the last claimed, so a restart reuses it."""
        if self._next() == number + 1:
            self.write(f"{number}\n")




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


def replace_file(folder: Path, name: str, write) -> Path:
    """``write(binary file)`` into ``folder/name`` through utils.files.atomic_write (fsynced): readers never see
    half a file, and a link planted under ``name`` is replaced, not written through."""
    return files.atomic_write(Path(folder) / name, write)
