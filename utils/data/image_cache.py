"""One image cache per machine: where the store file of a split lives, who fills it, and when it goes away.

``shared_image_store(request, mode)`` is called by every process of a run at the same point (it uses the
process group's collectives when there is one) and returns an ``ImageStore`` mapped by that process:

- ``--cache ram``: a file in the machine's shared memory (``/dev/shm``; when that is too small, a file in
  ``user_cache_folder("ram")``, still mapped once). It is made for the run: the first process of each
  machine (the lowest rank among those that see the same folder) creates it, the processes of that machine
  fill it together, each its share with a thread per CPU it has (decoding and resizing release the GIL),
  and every process and loader worker maps it. Its creator holds a lock on it (``utils.files.FolderLock``)
  and removes it when the run ends (Ctrl-C and SIGTERM included: the interpreter's exit). A file left by a
  process that was killed is unlocked: the next run on the machine removes it (``remove_stale``) before it
  measures anything, so a killed run's file never counts against the free shared memory or the available
  memory. ``/dev/shm`` must hold the store (``RAM_MARGIN``) and the batches the split's loaders keep there
  (``StoreRequest.loader_bytes``, plus those of the splits this process cached before): the loader's own
  shared memory is what fails first in a container's 64 MB ``/dev/shm``.
- ``--cache disk``: a file in ``user_cache_folder("images")`` named by the split's image files (their real
  paths), the image size and the resize method, and keyed by every image's identity (device, inode, size,
  mtime), so a restart finds it and a changed dataset gets a new one (the older one of the same files is
  then removed). Nothing is written in the dataset's folders, which may be read-only. It is filled under a
  temporary name and renamed when complete; machines sharing the folder may each fill one (the last rename
  wins; the files are identical).

Every store is this user's alone: files 0600, and the user cache folders that hold them 0700
(``utils.data.cache_folders.private_cache_folder``); a dataset's pixels are not for the machine's other users.

Filling runs in rounds: after each round every process says how many images it has left (one small
all-reduce), so a process with nothing (or nothing more) to do waits one round at most at a time, never
for a whole fill in one collective call (whose timeout would end the run), and the main process's bar
counts every process's images.
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from utils import dist
from utils.data.cache_folders import RAM_FOLDER, private_cache_folder, user_cache_folder
from utils.data.image_store import CacheError, ImageStore, StoreMismatch, create_store, layout
from utils.files import FolderBusy, FolderLock, fsync_folder

LOGGER = logging.getLogger(__name__)

STORE_VERSION = 1
RAM_PREFIX = "yolo-trainer-images-"  # run-scoped stores: <prefix><family>-<pid>-<random>.images
SUFFIX = ".images"
RAM_PATTERN = f"{RAM_PREFIX}*{SUFFIX}"
TEMP_SUFFIX = ".filling"
STALE_SECONDS = 60  # an unlocked store younger than this may be one its creator has not locked yet
RAM_MARGIN = 1.05  # shared memory must have this many times the store's size free, plus the loaders' room
ROUND_IMAGES = 32  # images per filling thread per round


@dataclass
class StoreRequest:
    """What a split's cache holds: ``files`` (the image paths, a sequence of str), ``sizes_hw`` (N, 2) resized
    (height, width), ``load(i)`` -> image i resized, exactly of that size, ``variant`` (image size and resize
    method: the same files cached differently), ``prefix`` (of log lines), ``loader_bytes``: the shared memory that
    the split's loaders on this machine hold at most (``utils.data.loader.loader_shared_bytes``), kept free in
    ``/dev/shm`` beside a RAM store."""
    files: object
    sizes_hw: np.ndarray
    load: Callable[[int], np.ndarray]
    variant: str
    prefix: str = ""
    loader_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return layout(self.sizes_hw)[2]


# ---------------------------------------------------------------------------------------- names and keys
def family_of(request: StoreRequest) -> str:
    """Which images at which size and resize method (a hash of the real paths): the stable part of a name."""
    digest = hashlib.sha256(f"{STORE_VERSION}\t{request.variant}\t{len(request.sizes_hw)}\n".encode())
    folders: dict[str, str] = {}
    for file in request.files:
        folder, name = os.path.split(file)
        if folder not in folders:
            folders[folder] = os.path.realpath(folder)
        digest.update(f"{folders[folder]}/{name}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:20]


def content_key(request: StoreRequest, family: str) -> str:
    """The family plus every image's identity (device, inode, size, mtime): a changed image gives another key."""
    digest = hashlib.sha256(family.encode())
    for file in tqdm(request.files, desc=f"{request.prefix}checking the image cache", unit="file", disable=None,
                     leave=False, mininterval=1.0) if len(request.files) >= 20000 else request.files:
        try:
            info = os.stat(file)
            digest.update(f"{info.st_dev}\t{info.st_ino}\t{info.st_size}\t{info.st_mtime_ns}\n".encode())
        except OSError:
            digest.update(b"-\n")
    return digest.hexdigest()


def machine_of(folder: Path) -> str:
    """What processes that see the same ``folder`` share: the machine (boot id) and the folder itself."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        boot = os.uname().nodename
    info = os.stat(folder)
    return f"{boot}:{info.st_dev}:{info.st_ino}"


# ---------------------------------------------------------------------------------------- cleanup
def remove_stale(folder: Path, pattern: str) -> int:
    """Remove the store files matching ``pattern`` in ``folder`` that no live process holds (their creator
    was killed); returns how many. A file is never removed while its creator's lock is held."""
    removed = 0
    for path in folder.glob(pattern):
        try:
            if time.time() - path.lstat().st_mtime < STALE_SECONDS:
                continue
            lock = FolderLock(folder, path.name)
            lock.acquire()
        except (FolderBusy, OSError):
            continue
        lock.release(remove=True)
        removed += 1
    if removed:
        LOGGER.info("removed %d image cache file%s left in %s by runs that were killed", removed,
                    "s" * (removed > 1), folder)
    return removed


def _claim(path: Path) -> FolderLock:
    """Lock the store file just created at ``path`` (FolderLock checks that it is still the same file)."""
    lock = FolderLock(path.parent, path.name)
    lock.acquire()
    return lock


# ---------------------------------------------------------------------------------------- placement
_LOADER_ROOM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # this process's stores -> loader_bytes


def shared_memory_need(store_bytes: int, loader_bytes: int) -> float:
    """Free bytes ``/dev/shm`` must have for a RAM store of ``store_bytes``: the store with RAM_MARGIN, plus
    ``loader_bytes`` kept for the loaders' batches (the split's, and those of the stores this process holds)."""
    return store_bytes * RAM_MARGIN + loader_bytes + sum(_LOADER_ROOM.values())


def fits_shared_memory(store_bytes: int, loader_bytes: int) -> bool:
    """Whether ``/dev/shm`` has room for a RAM store of ``store_bytes`` now (``shared_memory_need``)."""
    return _free_bytes(RAM_FOLDER) >= shared_memory_need(store_bytes, loader_bytes)


class Placement:
    """Where one mode keeps its store: ``clean()`` what killed runs left (before anything is measured), ``find()`` a
    usable one (disk only), ``create()`` a new one to fill (its creator holds its lock), ``publish(path, store)``
    once filled -> the path every process then opens, ``adopt(store)`` / ``abandon()``: the creator's lock ends
    with its mapping of the store, or at once."""

    in_memory = False

    def __init__(self, request: StoreRequest):
        self.request = request
        self.family = family_of(request)
        self.lock: FolderLock | None = None

    def folder(self) -> Path:
        raise NotImplementedError

    def clean(self) -> None:
        raise NotImplementedError

    def find(self) -> ImageStore | None:
        return None

    def create(self) -> Path:
        raise NotImplementedError

    def publish(self, path: Path, store: ImageStore) -> Path:
        raise NotImplementedError

    def adopt(self, store: ImageStore) -> None:
        """The store (if this process created it) lasts as long as this process maps it: it is removed when
        ``store`` is freed or the interpreter exits (Ctrl-C, SIGTERM and errors included)."""
        if self.lock is not None:
            weakref.finalize(store, _release, self.lock, os.getpid())
            self.lock = None

    def abandon(self) -> None:
        """The fill failed or was interrupted: remove what this process created."""
        if self.lock is not None:
            _release(self.lock, os.getpid())
            self.lock = None


def _release(lock: FolderLock, pid: int) -> None:
    if os.getpid() == pid:  # never in a forked child: the store belongs to its parent
        lock.release(remove=True)


class RamPlacement(Placement):
    """A run's store in shared memory (see the module docstring)."""

    in_memory = True

    def __init__(self, request: StoreRequest):
        super().__init__(request)
        self.key = self.family  # filled by this run: the file names are the whole key
        self._folder = None

    def clean(self) -> None:
        """Remove killed runs' stores from shared memory and from the fallback folder, before ``folder()`` reads the
        free space and the memory check the available memory: those files' bytes would count against both."""
        for folder in (RAM_FOLDER, user_cache_folder("ram")):
            if folder.is_dir():
                remove_stale(folder, RAM_PATTERN)

    def folder(self) -> Path:
        if self._folder is None:
            need = shared_memory_need(self.request.nbytes, self.request.loader_bytes)
            free = _free_bytes(RAM_FOLDER)
            if free >= need:
                self._folder = RAM_FOLDER
            else:
                self._folder = private_cache_folder("ram")
                LOGGER.info("%s%s has %.2f GB free, the image cache needs %.2f GB (%.2f GB of it for the loaders' "
                            "batches): it is a mapped file in %s", self.request.prefix, RAM_FOLDER, free / 1e9,
                            need / 1e9, (need - self.request.nbytes * RAM_MARGIN) / 1e9, self._folder)
        return self._folder

    def create(self) -> Path:
        folder = self.folder()
        path = folder / f"{RAM_PREFIX}{self.family}-{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}"
        create_store(path, self.key, self.request.sizes_hw)
        self.lock = _claim(path)
        return path

    def publish(self, path: Path, store: ImageStore) -> Path:
        store.finish()
        return path


class DiskPlacement(Placement):
    """A store kept between runs in the user cache folder (see the module docstring)."""

    def __init__(self, request: StoreRequest):
        super().__init__(request)
        self.key = content_key(request, self.family)
        self._folder = private_cache_folder("images")
        self.final = self._folder / f"{self.family}-{self.key[:20]}{SUFFIX}"

    def folder(self) -> Path:
        return self._folder

    def clean(self) -> None:
        remove_stale(self._folder, f"*{TEMP_SUFFIX}")  # what killed fills left, before free space is measured

    def find(self) -> ImageStore | None:
        if not self.final.is_file():
            return None
        try:
            return ImageStore(self.final, self.key, self.request.sizes_hw)
        except (OSError, StoreMismatch) as error:
            LOGGER.warning("%sWARNING: %s: unusable image cache (%s), filling it again", self.request.prefix,
                           self.final, error)
            return None

    def create(self) -> Path:
        folder = self.folder()
        need = self.request.nbytes
        if _free_bytes(folder) < need:
            raise CacheError(f"{self.request.prefix}--cache disk: {folder} has {_free_bytes(folder) / 1e9:.2f} GB "
                             f"free, the image cache needs {need / 1e9:.2f} GB; free some space, or use --cache ram "
                             "or no cache")
        path = folder / f"{self.final.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        create_store(path, self.key, self.request.sizes_hw)  # 0600: this user's alone
        self.lock = _claim(path)
        return path

    def publish(self, path: Path, store: ImageStore) -> Path:
        store.finish(durable=True)
        os.replace(path, self.final)
        fsync_folder(self.final.parent)
        self.lock.release()  # kept between runs: its temp name, the one the lock would remove, is gone anyway
        self.lock = None
        for older in self.final.parent.glob(f"{self.family}-*{SUFFIX}"):  # the same files before they changed
            if older != self.final:
                older.unlink(missing_ok=True)
        LOGGER.info("%simage cache saved: %s (%.2f GB)", self.request.prefix, self.final, self.request.nbytes / 1e9)
        return self.final


def _free_bytes(folder: Path) -> int:
    """Bytes free for us in ``folder``'s file system; 0 where there is no such folder."""
    try:
        info = os.statvfs(folder)
    except OSError:
        return 0
    return info.f_bavail * info.f_frsize


PLACEMENTS = {"ram": RamPlacement, "disk": DiskPlacement}


# ---------------------------------------------------------------------------------------- the protocol
def shared_image_store(request: StoreRequest, mode: str, check_memory: Callable[[], None] | None = None
                       ) -> ImageStore:
    """This process's mapping of the split's store (``mode`` "ram" or "disk"), filled once per machine. Every
    process of the run calls it at the same point. ``check_memory``: called by a store's creator before it
    creates it (raises when the machine cannot hold it). What killed runs left is removed first, by every process,
    before any of them measures free space or memory (the barrier: one process's removal is seen by all)."""
    placement = PLACEMENTS[mode](request)
    placement.clean()
    dist.barrier("remove the image caches of killed runs")
    store = _agree_and_fill(placement, mode, check_memory)
    _LOADER_ROOM[store] = request.loader_bytes  # kept in /dev/shm while this store lives (shared_memory_need)
    return store


def _agree_and_fill(placement: Placement, mode: str, check_memory: Callable[[], None] | None) -> ImageStore:
    """The machines agree which of them fill a store; each such machine's processes fill it together."""
    request = placement.request
    found = placement.find()
    rank = dist.get_rank()
    entries = dist.gather_object((machine_of(_existing(placement.folder())), found is not None),
                                 phase="agree on the image cache")
    leaders = {}
    for other, (machine, _) in enumerate(entries):
        leaders.setdefault(machine, other)
    filling = {machine for machine, leader in leaders.items() if not entries[leader][1]}  # its leader found none
    machine = entries[rank][0]
    if machine not in filling:  # every process decides alike from the same entries: no collective below
        if filling:
            _fill_elsewhere(request, mode, len(filling))
        return found if found is not None else _open_found(placement)
    group = [other for other, (where, _) in enumerate(entries) if where == machine]
    leader = leaders[machine]
    try:
        created = None
        if rank == leader:
            if check_memory is not None:
                check_memory()
            created = str(placement.create())
        names = dist.gather_object(created, phase="create the image cache")
        writer = ImageStore(names[leader], placement.key, request.sizes_hw, writable=True,
                            in_memory=placement.in_memory)
        mine = np.arange(group.index(rank), len(request.sizes_hw), len(group))
        _fill_in_rounds(writer, mine, request, mode, total=len(request.sizes_hw) * len(filling), processes=len(group))
        final = placement.publish(Path(names[leader]), writer) if rank == leader else None
        final = dist.gather_object(None if final is None else str(final), phase="publish the image cache")[leader]
        del writer
        store = ImageStore(final, placement.key, request.sizes_hw, in_memory=placement.in_memory)
    except BaseException:
        placement.abandon()
        raise
    placement.adopt(store)
    return store


def _fill_elsewhere(request: StoreRequest, mode: str, machines: int) -> None:
    """A process whose machine has its store: it takes part in the collectives of the machines that fill theirs."""
    dist.gather_object(None, phase="create the image cache")
    _fill_in_rounds(None, np.zeros(0, np.int64), request, mode, total=len(request.sizes_hw) * machines, processes=1)
    dist.gather_object(None, phase="publish the image cache")


def _open_found(placement: Placement) -> ImageStore:
    store = placement.find()
    if store is None:
        raise CacheError(f"{placement.request.prefix}the image cache that another process of this machine found "
                         f"cannot be opened here ({getattr(placement, 'final', placement.folder())})")
    return store


def _existing(folder: Path) -> Path:
    """``folder``, or its nearest existing parent (the disk cache's folder is made when first filled)."""
    folder = Path(os.path.abspath(folder))
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def _fill_in_rounds(store: ImageStore | None, indices: np.ndarray, request: StoreRequest, mode: str, total: int,
                    processes: int) -> None:
    """Write images ``indices`` into ``store`` with a thread per CPU of this process's share, in rounds that
    end with every process's count of images left (see the module docstring)."""
    from multiprocessing.pool import ThreadPool

    from utils.device import usable_cpus
    from utils.files import read_ahead

    threads = max(1, usable_cpus() // max(processes, 1))
    per_round = threads * ROUND_IMAGES
    description = f"{request.prefix}caching images ({mode})"
    bar = tqdm(total=total, desc=description, unit="img", disable=None if dist.is_main_process() else True,
               leave=False)

    def fill(i: int) -> None:
        store.write(int(i), request.load(int(i)))

    position = 0
    with ThreadPool(threads) as pool:
        while True:
            part = indices[position:position + per_round]
            if len(part):
                read_ahead(request.files[int(i)] for i in part)  # on a cold disk, the round's reads overlap
                pool.map(fill, part)
                position += len(part)
            done, left = dist.all_reduce_sum(torch.tensor([len(part), len(indices) - position]),
                                             phase="fill the image cache").tolist()
            bar.update(done)
            if left == 0:
                break
    bar.close()

