"""An epoch's batches as the training step takes them: on the training device, images float in [0, 1].

``BatchFeed`` applies the loop's batch transform and hook to each loader batch, copies its images and targets to the
device and turns the uint8 images into floats in [0, 1]. On CUDA it copies one batch ahead: when the loop takes batch
i, batch i+1's copy is already queued on a side stream, so it runs while batch i trains. Issued on the training
stream, as before, the copy ran between two steps with the GPU's compute waiting for it: the "copy" phase of a step
was 1.8 ms of GPU time out of 39 (yolov5s, batch 64 at 640, fp16, an H200; the 2026-11-28 profile in
benchmarks/results/gpu_profile_2026-11-28_h200.json), most of it the host-to-device copy of 64 uint8 images.

The training stream waits for each batch's own copy with an event (no host synchronisation; waiting for the side
stream as a whole would wait for the next batch's copy too, queued by then: the H200 profile of 8a68420, which did,
still had the 1.9 ms wait in its "data" phase), and the copied tensors are marked as used on the training stream
(``record_stream``), so their memory is not reused while a step still reads them. The side stream does not wait for
the training stream: a batch from the host depends on nothing queued there. The conversion to floats runs on the
training stream when the batch is taken: done ahead, it would hold one float batch more (315 MB at 64 x 640 x 640,
against the uint8 batch's 79 MB). Nothing a run computes changes: the same tensors reach the step in the same order
(the loader's order; each batch's transform and hook called once, in order, with its own index).

Going ahead means asking the loader for batch i+1 before batch i trains. On the CPU that gains nothing (the copy is
the identity), so the CPU goes one batch at a time as before (``copies_run_ahead``); the tests force the other way on
the CPU to check that its order and results are the same.
"""
from __future__ import annotations

import torch


def copies_run_ahead(device: torch.device) -> bool:
    """Whether the next batch's copy to ``device`` is issued while the current batch trains (``BatchFeed``)."""
    return torch.device(device).type == "cuda"


def to_unit_range(images: torch.Tensor) -> torch.Tensor:
    """``images`` (uint8 0-255, or floats on that scale) as float32 in [0, 1]: a uint8 batch in one pass (the
    division converts; the values equal ``images.float() / 255``'s to the bit), a float batch divided in place."""
    if images.is_floating_point():
        return images.float().div_(255)
    return images.div(255)


class BatchFeed:
    """Iterate ``(images, targets, paths, shapes)`` of ``batches`` with images and targets on ``device`` (module
    docstring). ``prepare(batch_index, batch)`` -> batch runs first on each (the loop's transform and hook); indices
    count from ``first_batch``. ``ahead``: issue the next batch's copy before handing over the current one (on CUDA
    on a side stream; elsewhere the same order of calls, done at once)."""

    def __init__(self, batches, device: torch.device, prepare=None, first_batch: int = 0, ahead: bool = False):
        self.batches, self.device, self.prepare = batches, torch.device(device), prepare
        self.first_batch, self.ahead = first_batch, ahead
        use_stream = ahead and self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if use_stream else None

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        pending = None
        for batch_index, batch in enumerate(self.batches, start=self.first_batch):
            if self.prepare is not None:
                batch = self.prepare(batch_index, batch)
            if not self.ahead:
                yield self._take(self._copy(batch))
                continue
            issued = self._issue(batch)
            if pending is not None:
                yield self._take(*pending)
            pending = issued
        if pending is not None:
            yield self._take(*pending)

    def _copy(self, batch) -> tuple:
        images, targets, paths, shapes = batch
        return images.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True), paths, shapes

    def _issue(self, batch) -> tuple:
        """(the batch's copy, the event its copy ends with): a batch from the host is copied on the side stream, at
        once (the host's pinned memory is kept until its copy has run: torch's pinned allocator records the copy);
        a batch that a transform made on the device (--augment-device) has nothing to copy ahead, so it is taken in
        the training stream's order (event None)."""
        if self.stream is None or not all(tensor.device.type == "cpu" for tensor in batch[:2]):
            return self._copy(batch), None
        with torch.cuda.stream(self.stream):
            copied = self._copy(batch)
            done = torch.cuda.Event()
            done.record(self.stream)
        return copied, done

    def _take(self, copied: tuple, done=None) -> tuple:
        """The batch to train: the training stream waits for its own copy (``done``; not for the side stream, where
        the next batch's copy is queued already), its tensors marked as used there, then the images are converted
        there."""
        images, targets, paths, shapes = copied
        if done is not None:
            training = torch.cuda.current_stream(self.device)
            training.wait_event(done)
            images.record_stream(training)
            targets.record_stream(training)
        return to_unit_range(images), targets, paths, shapes
