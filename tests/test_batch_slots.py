"""Reused shared-memory batch buffers: a slot comes back only when nothing views it, and a consumer that
keeps its batches never sees them overwritten (the workers fall back to fresh buffers)."""
from __future__ import annotations

import gc
import threading
import time
from types import SimpleNamespace

import pytest
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
    batch_slots.track(first.permute(0, 3, 1, 2))
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
    batch_slots.track(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))
    batch_slots.track(torch.zeros(2, 3, 4, 4))
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


def test_a_slot_grows_with_headroom_and_is_reused_when_large_enough(monkeypatch):
    monkeypatch.setattr(batch_slots, "get_worker_info", lambda: SimpleNamespace(id=0))
    slots = BatchSlots(num_workers=1, per_worker=1)
    first = slots.buffer(100, headroom=1.25)
    assert first.numel() == 100 and first.untyped_storage().nbytes() == 125 + batch_slots.TRAILER
    assert slots.buffer(10) is None  # its only slot is taken
    slots.flags.zero_()
    smaller = slots.buffer(90, headroom=1.25)
    assert smaller.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()  # fits: the same memory
    slots.flags.zero_()
    larger = slots.buffer(200, headroom=1.25)
    assert larger.untyped_storage().nbytes() == 250 + batch_slots.TRAILER and slot_of(larger) == 0


def plan_batches(split, workers: int, epochs: int = 3):
    """Every batch of plans over ``epochs`` (decoded JPEG sources included) rendered on the CPU, with the slot each came
    in and whether its JPEG bytes travelled in the same buffer."""
    from utils.data.device_augment import render_plans

    loader, _ = create_dataloader(None, 160, 2, 32, hyp=Hyp(), augment=True, workers=workers, shuffle=True, seed=5,
                                  labels=split, augment_device=True, decode_device=True)
    out = []
    for epoch in range(epochs):
        set_loader_epoch(loader, epoch)
        for batch, targets, _, _ in loader:
            together = batch.sources.untyped_storage().data_ptr() == batch.pixels.untyped_storage().data_ptr()
            out.append((render_plans(batch), targets.clone(), slot_of(batch.pixels), batch.sources.numel(), together))
            del batch
    return out


def test_plans_travel_in_reused_slots_and_render_as_in_the_main_process(tmp_path):
    """--augment-device's batches (with --decode-device's JPEG bytes) come in reused buffers, and render to the bit as
    the batches collated in the training process."""
    split = make_split(tmp_path, SIZES * 2, suffix=".jpg")  # 12 images, 4 of them at 160 (decoded on the device)
    reference = plan_batches(split, workers=0)
    reused = plan_batches(split, workers=2)
    slots = [slot for _, _, slot, _, _ in reused]
    assert all(slot is not None for slot in slots) and len(set(slots)) < len(slots)  # 18 batches, 12 slots
    assert any(count for _, _, _, count, _ in reused)  # some batches carried JPEG bytes ...
    assert all(together for _, _, _, count, together in reused if count)  # ... in the pixels' slot
    for (a_images, a_targets, *_), (b_images, b_targets, *_) in zip(reference, reused, strict=True):
        assert torch.equal(a_images, b_images) and torch.equal(a_targets, b_targets)


@pytest.mark.parametrize("plans", [False, True])
def test_a_pinned_batch_gives_its_slot_back_once_copied(tmp_path, monkeypatch, plans):
    """With pinned memory (CUDA) the DataLoader's pin thread takes each batch before the loader sees it: torch's
    pin_memory() calls the SlotBatch's pin_memory(), which copies the batch out of its slot, and the slot comes back
    once the unpinned batch is gone. Pinning needs a GPU: here a copy stands in for it."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from utils.data.dataset import YoloDataset, collate
    from utils.data.plans import PlanBatch, PlanDataset, collate_plans

    monkeypatch.setattr(batch_slots, "get_worker_info", lambda: SimpleNamespace(id=0))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args: self.clone())
    split = make_split(tmp_path, SIZES)
    dataset = (PlanDataset if plans else YoloDataset)(split, imgsz=64, batch_size=2, augment=True, hyp=Hyp())
    items = [dataset[(i, 0)] for i in range(2)]
    slots = BatchSlots(num_workers=1, per_worker=2)
    handed = (collate_plans if plans else collate)(items, slots=slots)
    assert isinstance(handed, batch_slots.SlotBatch) and slots.flags.tolist() == [1, 0]
    slots._storages.clear()  # in a real run the worker's own reference is in another process
    pinned = pin_memory(handed)
    assert isinstance(pinned, tuple)
    expected = (collate_plans if plans else collate)(items)  # the same batch collated in this process
    if plans:
        assert isinstance(pinned[0], PlanBatch) and torch.equal(pinned[0].pixels, expected[0].pixels)
        assert slot_of(pinned[0].pixels) is None
    else:
        assert torch.equal(pinned[0], expected[0]) and slot_of(pinned[0]) is None
    assert torch.equal(pinned[1], expected[1])
    assert slots.flags.tolist() == [1, 0]  # the unpinned batch is still alive
    del handed
    gc.collect()
    assert slots.flags.tolist() == [0, 0]


def test_a_slot_loaders_worker_hands_every_batch_over_as_a_slot_batch(monkeypatch):
    """A batch in a slot and one in a fresh buffer both come as SlotBatches from a SlotDataLoader's worker (so the pin
    thread pins each through SlotBatch.pin_memory, under the capture lock); without slots, the batch as it is."""
    monkeypatch.setattr(batch_slots, "get_worker_info", lambda: SimpleNamespace(id=0))
    slots = BatchSlots(num_workers=1, per_worker=1)
    buffer = slots.buffer(8)
    batch = (buffer, "targets")
    handed = batch_slots.handed_over(batch, buffer, slots)
    assert isinstance(handed, batch_slots.SlotBatch) and handed.batch is batch and handed.view is buffer
    fresh = batch_slots.handed_over(batch, None, slots)  # a fresh buffer: nothing to give back
    assert isinstance(fresh, batch_slots.SlotBatch) and fresh.batch is batch and fresh.view is None
    assert batch_slots.handed_over(batch, None, None) is batch  # no SlotDataLoader to unwrap it
    slots._storages.clear()
    assert batch_slots.unwrapped(fresh) is batch and slots.flags.tolist() == [1]
    assert batch_slots.unwrapped(handed) is batch and batch_slots.unwrapped(batch) is batch
    del handed, fresh, batch, buffer
    gc.collect()
    assert slots.flags.tolist() == [0]  # unwrapped: tracked, and back once the batch is gone


def test_pinning_waits_while_a_cuda_graph_is_captured(monkeypatch):
    """The pin thread's SlotBatch.pin_memory takes the capture lock (utils/cuda_capture.py): while the training
    thread holds it, no batch is pinned (no CUDA call), and pinning goes on once it is released. Pinning needs a GPU:
    here a copy stands in for it."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from utils.cuda_capture import CUDA_CAPTURE_LOCK

    pinned_at = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args: pinned_at.append(time.monotonic()) or self.clone())
    batch = batch_slots.SlotBatch((torch.arange(4), "paths"), None)
    started, results = threading.Event(), []

    def pin_thread():
        started.set()
        results.append(pin_memory(batch))

    with CUDA_CAPTURE_LOCK:
        thread = threading.Thread(target=pin_thread)
        thread.start()
        assert started.wait(10)
        time.sleep(0.2)
        assert pinned_at == [] and results == []  # waiting for the capture
        released = time.monotonic()
    thread.join(10)
    assert len(pinned_at) == 1 and pinned_at[0] >= released
    assert torch.equal(results[0][0], torch.arange(4)) and results[0][1] == "paths"


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")  # the case itself
def test_slot_batches_arrive_as_batches_when_no_pin_thread_takes_them(tmp_path, monkeypatch):
    """Where the loader is built to pin but the DataLoader then does not (here: CUDA reported, no device to pin for),
    the loader unwraps the workers' SlotBatches itself and the slots still come back."""
    split = make_split(tmp_path, SIZES * 2)
    reference, _ = epochs_of_batches(split, workers=0, keep=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)  # the DataLoader's own check: no pinning
    reused, seen = epochs_of_batches(split, workers=2, keep=False)
    assert all(slot is not None for slot in seen) and len(set(seen)) < len(seen)
    for (a_images, a_targets), (b_images, b_targets) in zip(reference, reused, strict=True):
        assert torch.equal(a_images, b_images) and torch.equal(a_targets, b_targets)
