"""One file of resized images (``ImageStore``): the format behind ``--cache ram`` and ``--cache disk``.

Layout (little-endian): a 4 KiB header (``HEADER``: magic, image count, data offset, total size, key, and
a "complete" byte set last by the filler), the index (int32 (N, 2) height, width per image, then int64
(N + 1) byte offsets into the data), then the pixels: image i is ``data[offsets[i]:offsets[i + 1]]`` as
uint8 (h, w, 3) BGR, exactly as ``YoloDataset`` returns it resized.

Every process maps the file (``mmap``, shared): the pixels are in memory once per machine whatever the
number of training processes and loader workers, and whatever the start method of the workers: a
pickled ``ImageStore`` holds the file's path and identity only, and the receiving process maps the same
file again (checked to be the same inode). Readers map it read-only, so an in-place operation on a cached
image fails instead of changing the cache. Where the file lives and who fills it is ``utils.data.image_cache``.
"""
from __future__ import annotations

import errno
import mmap
import os
import struct

import numpy as np

from utils.errors import UserError
from utils.files import CLOEXEC, NOFOLLOW, open_regular

MAGIC = b"YOLOIMG1"
HEADER = struct.Struct("<8sQQQ64s")  # magic, count, data offset, total bytes, key (ASCII, NUL-padded)
COMPLETE_AT = HEADER.size  # one byte: 1 once every image is written
PAGE = 4096


class CacheError(UserError):
    """An image cache that cannot be built or read (not enough memory or disk, removed while in use); one line."""


class StoreMismatch(ValueError):
    """A store file that is not the one expected (another key, another layout, incomplete, truncated)."""


def layout(sizes_hw: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(offsets (N + 1,) int64 into the data, data offset, total file size) for images of ``sizes_hw`` (h, w)."""
    sizes_hw = np.asarray(sizes_hw, np.int64).reshape(-1, 2)
    offsets = np.zeros(len(sizes_hw) + 1, np.int64)
    np.cumsum(sizes_hw[:, 0] * sizes_hw[:, 1] * 3, out=offsets[1:])
    index_bytes = len(sizes_hw) * 2 * 4 + len(offsets) * 8
    data_offset = -(-(PAGE + index_bytes) // PAGE) * PAGE
    return offsets, data_offset, data_offset + int(offsets[-1])


def create_store(path, key: str, sizes_hw: np.ndarray, mode: int = 0o600) -> None:
    """Create ``path`` (never an existing file or a link) with the header and index for ``sizes_hw`` and its
    full size reserved, so that filling it never meets a full file system (CacheError now instead: a write
    to a mapped page that the file system cannot back would kill the process with SIGBUS)."""
    offsets, data_offset, total = layout(sizes_hw)
    handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, mode)
    try:
        try:
            _reserve(handle, total)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            raise CacheError(f"{path}: not enough space for the image cache ({total / 1e9:.2f} GB): "
                             f"{error.strerror}") from None
        header = HEADER.pack(MAGIC, len(offsets) - 1, data_offset, total, key.encode("ascii"))
        os.pwrite(handle, header, 0)
        os.pwrite(handle, np.asarray(sizes_hw, np.int32).tobytes() + offsets.tobytes(), PAGE)
    except BaseException:
        os.close(handle)
        os.unlink(path)
        raise
    os.close(handle)


def _reserve(handle: int, total: int) -> None:
    """Give the file ``total`` bytes with its blocks allocated where the system can (posix_fallocate), else sized
    only (no posix_fallocate on macOS; a file system that refuses it)."""
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(handle, 0, total)
            return
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
    os.ftruncate(handle, total)


class ImageStore:
    """The images of one store file, mapped: ``store[i]`` is image i as a (h, w, 3) uint8 view (read-only
    unless opened ``writable`` by its filler). ``in_memory``: the file is in shared memory (``--cache ram``),
    not on a disk."""

    def __init__(self, path, key: str, sizes_hw: np.ndarray, writable: bool = False, in_memory: bool = False):
        self.path, self.key, self.in_memory, self.writable = str(path), key, in_memory, writable
        self.sizes = np.asarray(sizes_hw, np.int64).reshape(-1, 2)
        self.offsets, self.data_offset, self.total = layout(self.sizes)
        handle = open_regular(self.path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            info = os.fstat(handle)
            self.identity = (info.st_dev, info.st_ino)
            if info.st_size != self.total:
                raise StoreMismatch(f"{info.st_size} bytes, expected {self.total}")
            self._map = mmap.mmap(handle, self.total, mmap.MAP_SHARED,
                                  mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        finally:
            os.close(handle)
        self._check_header()
        self.pixels = np.frombuffer(self._map, np.uint8, count=int(self.offsets[-1]), offset=self.data_offset)
        if not writable:
            self.pixels.flags.writeable = False

    def _check_header(self) -> None:
        magic, count, data_offset, total, key = HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or key.rstrip(b"\0").decode("ascii", "replace") != self.key:
            raise StoreMismatch("another store (magic or key differs)")
        if (count, data_offset, total) != (len(self.sizes), self.data_offset, self.total):
            raise StoreMismatch("another layout")
        index = np.frombuffer(self._map, np.uint8, count=self.data_offset - PAGE, offset=PAGE)
        expected = self.sizes.astype(np.int32).tobytes() + self.offsets.tobytes()
        if index[:len(expected)].tobytes() != expected:
            raise StoreMismatch("other image sizes")
        if not self.writable and not self.complete:
            raise StoreMismatch("incomplete (its filler stopped before the end)")

    @property
    def complete(self) -> bool:
        return self._map[COMPLETE_AT] == 1

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        height, width = self.sizes[i]
        return self.pixels[self.offsets[i]:self.offsets[i + 1]].reshape(height, width, 3)

    def write(self, i: int, image: np.ndarray) -> None:
        """The filler: image i (exactly its (h, w, 3) uint8 size)."""
        target = self[i]
        if image.shape != target.shape or image.dtype != np.uint8:
            raise ValueError(f"image {i} is {image.shape} {image.dtype}, the store holds {target.shape} uint8")
        np.copyto(target, image)

    def finish(self, durable: bool = False) -> None:
        """The filler, once every image is written: mark the store complete (``durable``: on disk before that)."""
        if durable:
            self._map.flush()
        self._map[COMPLETE_AT] = 1
        if durable:
            self._map.flush()

    # a pickled store (a spawned loader worker's dataset) is its file's name: the receiver maps the same file
    def __getstate__(self) -> dict:
        return {"path": self.path, "key": self.key, "sizes": self.sizes, "identity": self.identity,
                "in_memory": self.in_memory}

    def __setstate__(self, state: dict) -> None:
        try:
            self.__init__(state["path"], state["key"], state["sizes"], in_memory=state["in_memory"])
        except (OSError, StoreMismatch) as error:
            raise CacheError(f"{state['path']}: the image cache is gone or changed while the run uses it "
                             f"({error})") from None
        if self.identity != tuple(state["identity"]):
            raise CacheError(f"{state['path']}: the image cache was replaced while the run uses it")
