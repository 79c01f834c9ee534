"""utils/trainer/feed.py: batches on the training device, images in [0, 1], copied one batch ahead on CUDA."""
import pytest
import torch

from tests.conftest import NO_CUDA
from utils.trainer.feed import BatchFeed, copies_run_ahead, to_unit_range


def test_a_uint8_batch_in_one_pass_equals_float_then_divide_to_the_bit_and_keeps_its_layout():
    values = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(to_unit_range(values), values.float().div_(255))
    images = torch.randint(0, 256, (2, 3, 8, 6), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    unit = to_unit_range(images)
    assert unit.dtype == torch.float32 and unit.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(unit, images.float() / 255)
    scaled = images.float()  # a transform's float batch (--quad) is divided in place, as before
    assert to_unit_range(scaled).data_ptr() == scaled.data_ptr()
    assert torch.equal(scaled, unit)


class Loader:
    """Batches of (images, targets, paths, shapes), recording each request."""

    def __init__(self, count: int):
        self.count, self.log = count, []

    def __len__(self):
        return self.count

    def __iter__(self):
        for index in range(self.count):
            self.log.append(("loaded", index))
            images = torch.full((2, 3, 4, 4), index, dtype=torch.uint8)
            yield images, torch.tensor([[0.0, index, 0.5, 0.5, 0.1, 0.1]]), [f"{index}.jpg"], None


def consume(feed, log, stop=None):
    taken = []
    for images, targets, paths, _ in feed:
        log.append(("trained", int(targets[0, 1])))
        taken.append((images, targets, paths))
        if stop is not None and len(taken) == stop:
            break
    return taken


@pytest.mark.parametrize("ahead", [False, True])
def test_the_feed_hands_over_every_batch_in_order_once_prepared_and_converted(ahead):
    loader, prepared = Loader(4), []

    def prepare(batch_index, batch):
        prepared.append(batch_index)
        loader.log.append(("prepared", batch_index))
        images, targets, paths, shapes = batch
        return images + 1, targets, paths, shapes

    feed = BatchFeed(loader, torch.device("cpu"), prepare, first_batch=3, ahead=ahead)
    assert len(feed) == 4
    taken = consume(feed, loader.log)
    assert prepared == [3, 4, 5, 6]  # each once, in order, with the epoch's own indices
    assert [int(targets[0, 1]) for _, targets, _ in taken] == [0, 1, 2, 3]
    for index, (images, _, paths) in enumerate(taken):
        assert images.dtype == torch.float32 and torch.equal(images, torch.full((2, 3, 4, 4), (index + 1) / 255))
        assert paths == [f"{index}.jpg"]
    if ahead:  # batch i+1 is loaded (and its copy issued) before batch i is handed over
        assert loader.log[:6] == [("loaded", 0), ("prepared", 3), ("loaded", 1), ("prepared", 4), ("trained", 0),
                                  ("loaded", 2)]
    else:
        assert loader.log[:4] == [("loaded", 0), ("prepared", 3), ("trained", 0), ("loaded", 1)]


def test_an_epoch_stopped_early_loads_one_batch_ahead_and_no_more():
    loader = Loader(6)
    consume(BatchFeed(loader, torch.device("cpu"), ahead=True), loader.log, stop=2)
    assert [entry for entry in loader.log if entry[0] == "loaded"] == [("loaded", 0), ("loaded", 1), ("loaded", 2)]


def test_only_cuda_copies_ahead():
    assert copies_run_ahead(torch.device("cuda", 0)) and copies_run_ahead("cuda")
    assert not copies_run_ahead(torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_on_cuda_the_side_stream_copies_equal_the_direct_ones_without_a_host_wait_or_a_reused_buffer():
    """Pinned batches as the loader hands them over, copied one ahead on a side stream and converted on the training
    stream: every batch equals the one made on the CPU, no host synchronisation while feeding, and a training stream
    held back (a sleep kernel after each batch) does not let a later copy reuse the memory of a batch it has not yet
    converted (record_stream)."""
    device = torch.device("cuda", 0)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (8, 3, 64, 64), dtype=torch.uint8, generator=generator)
                .contiguous(memory_format=torch.channels_last).pin_memory(),
                torch.rand(5, 6, generator=generator).pin_memory(), [str(i)], None) for i in range(8)]
    expected = [to_unit_range(images.to(device)) for images, _, _, _ in batches]  # one at a time, on CUDA
    torch.cuda.synchronize()
    taken, layouts, targets_taken = [], [], []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for images, targets, _, _ in BatchFeed(batches, device, ahead=True):
            layouts.append(images.is_contiguous(memory_format=torch.channels_last))
            taken.append(images.clone())
            targets_taken.append(targets)
            torch.cuda._sleep(2_000_000)  # the training stream falls behind the side stream's copies
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert all(layouts) and len(taken) == len(expected)
    for images, targets, want, (_, want_targets, _, _) in zip(taken, targets_taken, expected, batches):
        assert torch.equal(images, want)  # a reused buffer would give another batch's pixels
        assert torch.equal(targets.cpu(), want_targets)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_on_cuda_a_uint8_batch_in_one_pass_equals_float_then_divide_to_the_bit():
    """The one-pass conversion changes no CUDA result. CUDA's quotients are compared with CUDA's: they need not equal
    the CPU's to the last bit (on an H200 a batch's sum differed from the CPU's by 4e-8, relative)."""
    values = torch.arange(256, dtype=torch.uint8, device="cuda")
    assert torch.equal(to_unit_range(values), values.float().div_(255))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_on_cuda_a_batch_waits_for_its_own_copy_not_for_the_next_ones():
    """Batch 0 is taken after batch 1's copy is queued on the side stream: the training stream must wait for batch
    0's copy alone. Batch 1's copy is held back here by a long sleep on the side stream before it; the training
    stream, given batch 0, finishes while that sleep still runs (waiting for the side stream as a whole, it would not:
    the copy would run between two steps again)."""
    device = torch.device("cuda", 0)
    batches = [(torch.full((2, 3, 8, 8), i, dtype=torch.uint8).pin_memory(), torch.zeros(1, 6).pin_memory(), [], None)
               for i in range(3)]

    class HeldBack(BatchFeed):
        def _copy(self, batch):
            if batch is batches[1]:
                torch.cuda._sleep(1_000_000_000)  # on the side stream: about half a second before batch 1's copy
            return super()._copy(batch)

    feed = HeldBack(batches, device, ahead=True)
    taken = iter(feed)
    images, _, _, _ = next(taken)  # batch 1's copy is queued behind the sleep by now
    torch.cuda.current_stream(device).synchronize()
    still_copying = not feed.stream.query()
    assert still_copying and torch.equal(images.cpu(), torch.zeros(2, 3, 8, 8))
    assert [round(float(images[0, 0, 0, 0]) * 255) for images, _, _, _ in taken] == [1, 2]
