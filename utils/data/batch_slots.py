"""Reusable shared-memory buffers for the image batches that loader workers send to the training process.

Why: a worker's collated batch lives in shared memory. Allocated fresh for every batch (as torch's
``default_collate`` does), each one costs the kernel a new tmpfs page per 4 KiB, zeroed, and the
training process an unmap when it is freed: about 0.75 ms of CPU per 640x640 image on the 2-core
benchmark machine (``benchmarks/bench_loader.py``), 6% of the loader's work, taken from the cores
the model trains on.

How: each worker owns up to ``per_worker`` shared buffers ("slots"). A one-byte flag per slot in a
small shared array says whether the training process may still be using it. The worker claims a
free slot, writes the batch into it and sets the flag; the training process clears the flag when
the last tensor viewing that buffer is garbage-collected (``track``, called by the loader on every
batch it yields). The slot number travels inside the buffer, in a trailer after the image bytes, so
the batch format is unchanged. A worker that finds no free slot allocates a fresh buffer as before,
so a consumer that keeps batches (or never calls ``track``) costs speed, never correctness.
"""
from __future__ import annotations

import math
import weakref

import numpy as np
import torch
from torch.utils.data import get_worker_info

MAGIC = 0x3146_5542_4F4C_4F59  # b"YOLOBUF1" little-endian
TRAILER = 16  # bytes after the images: int64 magic, int64 slot number


class BatchSlots:
    """Shared flags for ``num_workers * per_worker`` slots; buffers are created lazily in each worker."""

    def __init__(self, num_workers: int, per_worker: int):
        self.per_worker = per_worker
        self.flags = torch.zeros(num_workers * per_worker, dtype=torch.uint8).share_memory_()
        self._storages = {}  # per process (worker side): slot -> UntypedStorage

    def __getstate__(self):  # sent to spawned workers: the shared flags only
        return {"per_worker": self.per_worker, "flags": self.flags}

    def __setstate__(self, state):
        self.per_worker, self.flags = state["per_worker"], state["flags"]
        self._storages = {}

    def images_buffer(self, shape) -> torch.Tensor | None:
        """A uint8 tensor of ``shape`` in a free slot of this worker, or None (main process, none free)."""
        info = get_worker_info()
        if info is None:
            return None
        flags = self.flags.numpy()
        nbytes = math.prod(shape)
        first = info.id * self.per_worker
        for slot in range(first, first + self.per_worker):
            if flags[slot]:
                continue
            storage = self._storages.get(slot)
            if storage is None or storage.nbytes() < nbytes + TRAILER:
                storage = torch.empty(nbytes + TRAILER, dtype=torch.uint8).share_memory_().untyped_storage()
                self._storages[slot] = storage
            trailer = _trailer(storage)
            trailer[0], trailer[1] = MAGIC, slot
            flags[slot] = 1
            return torch.empty(0, dtype=torch.uint8).set_(storage, 0, tuple(shape))
        return None

    def track(self, images: torch.Tensor) -> None:
        """Training-process side: free the slot of ``images`` (if it has one) once nothing views it."""
        slot = slot_of(images)
        if slot is not None and slot < len(self.flags):
            weakref.finalize(images.untyped_storage(), _release, self.flags.numpy(), slot)


def fresh_shared_bytes(nbytes: int) -> torch.Tensor:
    """A new uint8 tensor of ``nbytes`` in shared memory, for a batch a worker builds in place: a tensor made in
    ordinary memory is copied into shared memory when the worker sends it (an 85 MB batch of plans at 640: ~70 ms of
    the worker's CPU on the 2-core benchmark machine, about what building the batch costs), written here once."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes), 0, (nbytes,))


def slot_of(images) -> int | None:
    """The slot a batch's images travelled in (read from the trailer), or None for any other tensor."""
    if not isinstance(images, torch.Tensor) or images.device.type != "cpu" or images.dtype != torch.uint8:
        return None
    storage = images.untyped_storage()
    if storage.nbytes() < images.numel() + TRAILER:
        return None
    magic, slot = (int(v) for v in _trailer(storage))
    return slot if magic == MAGIC and slot >= 0 else None


def _trailer(storage: torch.UntypedStorage) -> np.ndarray:
    """The 2 int64 values (magic, slot) at the end of ``storage``, as a writable numpy view."""
    tail = torch.empty(0, dtype=torch.uint8).set_(storage, storage.nbytes() - TRAILER, (TRAILER,))
    return tail.numpy().view(np.int64)


def _release(flags: np.ndarray, slot: int) -> None:
    flags[slot] = 0
