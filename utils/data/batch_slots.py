"""Reusable shared-memory buffers for the batches that loader workers send to the training process.

Why: a worker's collated batch lives in shared memory. Allocated fresh for every batch (as torch's
``default_collate`` does), each one costs the kernel a new tmpfs page per 4 KiB, zeroed, and the
training process an unmap when it is freed: about 0.75 ms of CPU per 640x640 image on the 2-core
benchmark machine (``benchmarks/bench_loader.py``), 6% of the loader's work, taken from the cores
the model trains on. For ``--augment-device``'s plans, where a worker does little else, a fresh buffer was most of a
worker's time (docs/benchmarks.md, 2026-11-28: 1.9 ms of 2.0 ms an image at 640 against 0.7 ms reused).

How: each worker owns up to ``per_worker`` shared buffers ("slots"). A one-byte flag per slot in a
small shared array says whether the training process may still be using it. The worker claims a
free slot, writes the batch into it and sets the flag; the training process clears the flag when
the last tensor viewing that buffer is garbage-collected (``track``). The slot number and its owner (the
``BatchSlots``' token, looked up in the training process) travel inside the buffer, in a trailer after the bytes,
so the batch format is unchanged. A worker that finds no free slot allocates a fresh buffer as before,
so a consumer that keeps batches (or never calls ``track``) costs speed, never correctness.

A worker hands a batch over as a ``SlotBatch`` (the batch and a tensor in its slot, None for a fresh buffer), and
whoever takes it first calls ``track``: with pinned memory (CUDA) the DataLoader's pin-memory thread, through
``SlotBatch.pin_memory``, which copies the batch out of the slot, so the slot comes back as soon as the copies exist
(or, for what is not copied, ``--decode-device``'s JPEG bytes, once the batch is gone); otherwise the loader, which
unwraps the batch before yielding it. A batch in a fresh buffer comes as a SlotBatch too, so that every batch is
pinned through ``SlotBatch.pin_memory``, which waits while a CUDA graph is being captured (utils/cuda_capture.py).
"""
from __future__ import annotations

import math
import os
import weakref

import numpy as np
import torch
from torch.utils.data import get_worker_info

from utils.cuda_capture import CUDA_CAPTURE_LOCK

MAGIC = 0x3146_5542_4F4C_4F59  # b"YOLOBUF1" little-endian
TRAILER = 24  # bytes after the batch: int64 magic, int64 slot number, int64 owner token
_OWNERS: "weakref.WeakValueDictionary[int, BatchSlots]" = weakref.WeakValueDictionary()  # token -> slots (trainer)


class BatchSlots:
    """Shared flags for ``num_workers * per_worker`` slots; buffers are created lazily in each worker."""

    def __init__(self, num_workers: int, per_worker: int):
        self.per_worker = per_worker
        self.flags = torch.zeros(num_workers * per_worker, dtype=torch.uint8).share_memory_()
        self.token = int.from_bytes(os.urandom(7), "little")  # names these slots in a buffer's trailer
        self._storages = {}  # per process (worker side): slot -> UntypedStorage
        _OWNERS[self.token] = self

    def __getstate__(self):  # sent to spawned workers: the shared flags and the names
        return {"per_worker": self.per_worker, "flags": self.flags, "token": self.token}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._storages = {}

    def buffer(self, nbytes: int, headroom: float = 1.0) -> torch.Tensor | None:
        """A flat uint8 tensor of ``nbytes`` in a free slot of this worker, or None (main process, none free). A slot
        too small for it is replaced by one of ``headroom`` times the size (batches whose sizes vary: plans)."""
        info = get_worker_info()
        if info is None:
            return None
        flags = self.flags.numpy()
        first = info.id * self.per_worker
        for slot in range(first, first + self.per_worker):
            if flags[slot]:
                continue
            storage = self._storages.get(slot)
            if storage is None or storage.nbytes() < nbytes + TRAILER:
                size = max(nbytes, math.ceil(nbytes * headroom)) + TRAILER
                storage = torch.empty(size, dtype=torch.uint8).share_memory_().untyped_storage()
                self._storages[slot] = storage
            _trailer(storage)[:] = MAGIC, slot, self.token
            flags[slot] = 1
            return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))
        return None

    def images_buffer(self, shape) -> torch.Tensor | None:
        """A uint8 tensor of ``shape`` in a free slot of this worker, or None (main process, none free)."""
        flat = self.buffer(math.prod(shape))
        return None if flat is None else flat.view(shape)

class SlotBatch:
    """A worker's batch whose tensor ``view`` is in one of its slots, on its way to the training process (see the
    module docstring). Not a sequence on purpose: torch's pin_memory() recurses into sequences, and calls this
    ``pin_memory`` on other objects."""

    def __init__(self, batch: tuple, view: torch.Tensor | None):
        self.batch, self.view = batch, view  # view None: a batch in a fresh buffer (nothing to give back)

    def pin_memory(self, device=None) -> tuple:
        """The batch with its tensors (and objects with a ``pin_memory``) copied to pinned memory; the slot is tracked,
        so it comes back once this object and the unpinned batch are gone. Pinning holds ``CUDA_CAPTURE_LOCK``: it
        must not run while the training thread captures a CUDA graph (utils/cuda_capture.py)."""
        with CUDA_CAPTURE_LOCK:
            pinned = tuple(item.pin_memory() if hasattr(item, "pin_memory") else item for item in self.batch)
        if self.view is not None:
            track(self.view)
        return pinned


def handed_over(batch: tuple, slot: torch.Tensor | None, slots: BatchSlots | None):
    """What a worker returns for ``batch``: with ``slots`` (a SlotDataLoader's worker, whose batches the loader or the
    pin thread unwraps) a ``SlotBatch``, whose ``slot`` (a tensor in one of them) is None for a batch in a fresh
    buffer, so that every batch is pinned through ``SlotBatch.pin_memory``; without, the batch as it is."""
    return batch if slots is None else SlotBatch(batch, slot)


def unwrapped(batch):
    """Training-process side, for a batch the pin thread did not take: the batch, its slot tracked."""
    if isinstance(batch, SlotBatch):
        if batch.view is not None:
            track(batch.view)
        return batch.batch
    return batch


def track(tensor) -> None:
    """Training-process side: free the slot of ``tensor`` (if it views one of a live ``BatchSlots``) once nothing
    views it."""
    found = _slot_and_owner(tensor)
    owner = _OWNERS.get(found[1]) if found is not None else None
    if owner is not None and found[0] < len(owner.flags):
        weakref.finalize(tensor.untyped_storage(), _release, owner.flags.numpy(), found[0])


def fresh_shared_bytes(nbytes: int) -> torch.Tensor:
    """A new uint8 tensor of ``nbytes`` in shared memory, for a batch a worker builds in place: a tensor made in
    ordinary memory is copied into shared memory when the worker sends it (an 85 MB batch of plans at 640: ~70 ms of
    the worker's CPU on the 2-core benchmark machine, about what building the batch costs), written here once."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes), 0, (nbytes,))


def slot_of(tensor) -> int | None:
    """The slot a batch's tensor travelled in (read from the trailer), or None for any other tensor."""
    found = _slot_and_owner(tensor)
    return None if found is None else found[0]


def _slot_and_owner(tensor) -> tuple[int, int] | None:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or tensor.dtype != torch.uint8:
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() < tensor.numel() + TRAILER:
        return None
    magic, slot, token = (int(v) for v in _trailer(storage))
    return (slot, token) if magic == MAGIC and slot >= 0 else None


def _trailer(storage: torch.UntypedStorage) -> np.ndarray:
    """The 3 int64 values (magic, slot, owner token) at the end of ``storage``, as a writable numpy view."""
    tail = torch.empty(0, dtype=torch.uint8).set_(storage, storage.nbytes() - TRAILER, (TRAILER,))
    return tail.numpy().view(np.int64)


def _release(flags: np.ndarray, slot: int) -> None:
    flags[slot] = 0
