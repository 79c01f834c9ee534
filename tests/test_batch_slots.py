"""Reused shared-memory batch buffers: a slot comes back only when nothing views it, and a consumer that
keeps its batches never sees them overwritten (the workers fall back to fresh buffers)."""
from __future__ import annotations

import gc
from types import SimpleNamespace

import torch

from tests.test_dataset import SIZES, make_split
from utils.config import Hyp
from utils.data import batch_slots
from utils.data.batch_slots import BatchSlots, slot_of
from utils.data.loader import create_dataloader, set_loader_epoch


def test_slot_is_released_only_when_the_last_view_dies(monkeypatch):
    monkeypatch.setattr(batch_slots, "get_worker_info", lambda: SimpleNamespace(id=1))
    slots = BatchSlots(num_workers=2, per_worker=2)
    first = slots.images_buffer((2, 4, 5, 3))
    second = slots.images_buffer((1, 8, 8, 3))
    assert slots.images_buffer((1, 2, 2, 3)) is None  # worker 1 owns slots 2 and 3, both taken
    assert slots.flags.tolist() == [0, 0, 1, 1]
    assert (slot_of(first), slot_of(second)) == (2, 3)

    slots._storages.clear()  # in a real run the worker's own reference is in another process
    slots.track(first.permute(0, 3, 1, 2))
    view = first[1:]
    del first
    gc.collect()
    assert slots.flags.tolist() == [0, 0, 1, 1]  # a view still uses slot 2
    del view
    assert slots.flags.tolist() == [0, 0, 0, 1]
    again = slots.images_buffer((2, 4, 5, 3))
    assert slot_of(again) == 2 and slots.flags.tolist() == [0, 0, 1, 1]


def test_no_slots_outside_workers_and_plain_tensors_are_ignored():
    slots = BatchSlots(num_workers=1, per_worker=2)
    assert slots.images_buffer((1, 4, 4, 3)) is None  # the main process (workers=0) collates on the heap
    slots.track(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))
    slots.track(torch.zeros(2, 3, 4, 4))
    assert slots.flags.tolist() == [0, 0]


def epochs_of_batches(split, workers, keep, epochs=3):
    """Images and targets of every batch over ``epochs``; ``keep`` holds the loader's own tensors (so no
    slot is ever freed), otherwise each batch is cloned and dropped at once (slots are reused)."""
    loader, _ = create_dataloader(None, 64, 2, 32, hyp=Hyp(), augment=True, workers=workers, shuffle=True,
                                  seed=5, labels=split)
    out, slots_seen = [], []
    for epoch in range(epochs):
        set_loader_epoch(loader, epoch)
        for images, targets, _, _ in loader:
            slots_seen.append(slot_of(images))
            out.append((images, targets) if keep else (images.clone(), targets.clone()))
            del images
    return out, slots_seen


def test_reused_slots_give_the_same_batches_as_the_main_process(tmp_path):
    split = make_split(tmp_path, SIZES * 2)  # 12 images: 6 batches of 2 per epoch, 18 in all
    reference, _ = epochs_of_batches(split, workers=0, keep=False)
    reused, seen = epochs_of_batches(split, workers=2, keep=False)
    assert all(slot is not None for slot in seen)  # every batch came in a reused buffer
    assert len(set(seen)) < len(seen)
    kept, kept_seen = epochs_of_batches(split, workers=2, keep=True)
    assert sum(slot is not None for slot in kept_seen) == 12  # 2 workers x 6 slots, then fresh buffers
    for (a_images, a_targets), (b_images, b_targets), (c_images, c_targets) in zip(reference, reused, kept):
        assert torch.equal(a_images, b_images) and torch.equal(a_targets, b_targets)
        assert torch.equal(a_images, c_images) and torch.equal(a_targets, c_targets)  # never overwritten
