"""The training order under several processes (utils/data/loader.py EpochSampler through create_dataloader): every
image once per epoch across the ranks, a different order every epoch (0 and 1 included), the order a function of
(seed, epoch) so that a resumed epoch continues it, on every rank. One iterator across epochs (EpochStream) gives
each epoch what its own iterator gives, and asks the workers for the next epoch's batches ahead."""
from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import make_tiny_dataset
from utils.config import Hyp
from utils.data.loader import EpochSampler, EpochStream, create_dataloader, set_loader_epoch
from utils.data.verify import scan_split


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    data = make_tiny_dataset(tmp_path_factory.mktemp("sampler") / "data", num_train=11, num_val=1)
    return scan_split([str(data.parent / "images" / "train")], nc=2)


def rank_loaders(split, world_size=2, seed=5, **options):
    return [create_dataloader(None, 64, 2, 32, shuffle=True, workers=0, seed=seed, rank=rank, world_size=world_size,
                              labels=split, **options)[0] for rank in range(world_size)]


def epoch_paths(loader, epoch, start_batch=0) -> list[str]:
    set_loader_epoch(loader, epoch, start_batch)
    return [path for _, _, paths, _ in loader for path in paths]


def test_two_ranks_cover_every_image_once_per_epoch_in_a_new_order(split):
    loaders = rank_loaders(split)
    files = list(split.im_files)
    orders = []
    for epoch in (0, 1, 2):
        parts = [epoch_paths(loader, epoch) for loader in loaders]
        assert len(parts[0]) == len(parts[1]) == 6  # 11 images: 12 slots, one image repeated to pad
        together = parts[0] + parts[1]
        assert sorted(set(together)) == sorted(files) and len(together) - len(set(together)) == 1
        orders.append(together)
    assert orders[0] != orders[1] != orders[2] and orders[0] != orders[2]


def test_the_order_is_a_function_of_seed_and_epoch(split):
    first, again = rank_loaders(split), rank_loaders(split)  # e.g. a restarted process group
    for epoch in (0, 1):
        for a, b in zip(first, again):
            assert epoch_paths(a, epoch) == epoch_paths(b, epoch)
    other_seed = rank_loaders(split, seed=6)
    assert epoch_paths(other_seed[0], 1) != epoch_paths(first[0], 1)


@pytest.mark.parametrize("start_batch", [1, 2])
def test_a_resumed_epoch_continues_the_same_order_on_every_rank(split, start_batch):
    straight = [epoch_paths(loader, 1) for loader in rank_loaders(split)]
    resumed = [epoch_paths(loader, 1, start_batch) for loader in rank_loaders(split)]
    for whole, rest in zip(straight, resumed):
        assert rest == whole[start_batch * 2:]
    nxt = [epoch_paths(loader, 2) for loader in rank_loaders(split)]
    assert nxt != straight  # and the epoch after the resumed one reshuffles


def test_sampler_shards_without_shuffle_and_with_weights():
    """--rect (no shuffle): contiguous blocks, every index once; image weights: the same draw on all ranks, dealt
    out without overlap of positions."""
    blocks = [EpochSampler(10, shuffle=False, rank=r, world_size=2).indices() for r in range(2)]
    assert blocks[0].tolist() == [0, 1, 2, 3, 4] and blocks[1].tolist() == [5, 6, 7, 8, 9]
    weighted = [EpochSampler(10, shuffle=True, seed=1, rank=r, world_size=2) for r in range(2)]
    for sampler in weighted:
        sampler.set_weights(np.arange(10, dtype=float))
        sampler.set_epoch(3)
    drawn = EpochSampler(10, shuffle=True, seed=1)
    drawn.set_weights(np.arange(10, dtype=float))
    drawn.set_epoch(3)
    whole = drawn.indices()
    assert [sampler.indices().tolist() for sampler in weighted] == [whole[0::2].tolist(), whole[1::2].tolist()]
    assert 0 not in whole  # weight 0 is never drawn


def test_an_image_drawn_again_in_an_epoch_is_augmented_anew(split):
    """Image weights draw an image several times an epoch: each time is its own item ``(index, epoch, repeat)``,
    augmented anew (YOLOv5's dataset augments each time it is asked), the first time as without weights; the
    repeats are counted over the whole epoch's order, so two ranks give what one process gives."""
    from utils.data.loader import repeat_counts

    assert repeat_counts(np.array([3, 1, 3, 3, 0, 1])).tolist() == [0, 0, 1, 2, 0, 1]
    one = EpochSampler(11, shuffle=True, seed=1)
    one.set_weights(np.r_[np.zeros(10), 1.0])  # image 10 alone, 11 times
    assert list(one) == [(10, 0)] + [(10, 0, r) for r in range(1, 11)]
    ranks = [EpochSampler(11, shuffle=True, seed=1, rank=r, world_size=2) for r in range(2)]
    for sampler in ranks:
        sampler.set_weights(np.r_[np.zeros(10), 1.0])
    dealt, alone = Counter(list(ranks[0]) + list(ranks[1])), Counter(one)
    assert dealt - alone == Counter({(10, 0): 1}) and not alone - dealt  # 12 slots: the first item padded again
    loader = create_dataloader(None, 64, 4, 32, shuffle=True, workers=0, seed=5, labels=split, augment=True,
                               hyp=Hyp.load("hyp.scratch-low.yaml"))[0]
    loader.batch_sampler.sampler.set_weights(np.r_[np.zeros(10), 1.0])
    set_loader_epoch(loader, 0)
    images, _, paths, _ = next(iter(loader))
    assert len(set(paths)) == 1 and not torch.equal(images[0], images[1])
    assert torch.equal(images[0], loader.dataset[(10, 0)][0]) and torch.equal(images[1], loader.dataset[(10, 0, 1)][0])


# --- one iterator across epochs (EpochStream) -------------------------------------------------------------------

def batch_contents(batches) -> list:
    return [(paths, images.clone(), targets.clone()) for images, targets, paths, _ in batches]


def assert_same_batches(got, expected) -> None:
    assert [paths for paths, _, _ in got] == [paths for paths, _, _ in expected]
    for (_, images, targets), (_, images_expected, targets_expected) in zip(got, expected):
        assert torch.equal(images, images_expected) and torch.equal(targets, targets_expected)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_gives_each_epoch_what_its_own_iterator_gives(split, workers):
    """Epochs 0-2 from one iterator (an augmenting loader: mosaics, flips, HSV) are, batch by batch and to the bit,
    what a new iterator for each epoch gives, the epoch's smaller last batch included; a resumed epoch (from batch 2)
    and the epoch after it too."""
    def loader():
        return create_dataloader(None, 64, 4, 32, hyp=Hyp(), augment=True, shuffle=True, workers=workers, seed=3,
                                 labels=split)[0]

    alone = loader()
    expected = {}
    for epoch in (0, 1, 2):
        set_loader_epoch(alone, epoch)
        expected[epoch] = batch_contents(alone)
    assert [len(expected[0][-1][0])] == [3]  # 11 images in batches of 4: the last holds 3
    stream = EpochStream(loader())
    for epoch in (0, 1, 2):
        batches = stream.epoch(epoch, 0, through=2)
        assert len(batches) == 3
        assert_same_batches(batch_contents(batches), expected[epoch])
    resumed = EpochStream(loader())
    assert_same_batches(batch_contents(resumed.epoch(1, 2, through=2)), expected[1][2:])
    assert_same_batches(batch_contents(resumed.epoch(2, 0, through=2)), expected[2])


def test_the_stream_restarts_only_where_it_cannot_go_on(split, monkeypatch):
    """One iterator for epochs 0-2; a new one after an epoch stopped early, for an epoch past the iterator's
    ``through``, and for every epoch with ``through`` the epoch itself (image weights)."""
    stream = EpochStream(create_dataloader(None, 64, 4, 32, shuffle=True, workers=0, seed=3, labels=split)[0])
    starts = []
    restart = stream.restart
    monkeypatch.setattr(stream, "restart", lambda: (starts.append(stream.loader.batch_sampler.sampler.epoch), restart()))
    for epoch in (0, 1, 2):
        list(stream.epoch(epoch, 0, through=3))
    assert starts == [0]
    next(iter(stream.epoch(3, 0, through=3)))  # epoch 3 stopped after a batch
    list(stream.epoch(4, 0, through=5))
    list(stream.epoch(5, 0, through=5))
    list(stream.epoch(6, 0, through=6))  # past the last iterator's through
    assert starts == [0, 4, 6]
    for epoch in (7, 8):
        list(stream.epoch(epoch, 0, through=epoch))
    assert starts == [0, 4, 6, 7, 8]


def test_workers_build_the_next_epochs_first_batch_before_it_is_asked_for(split, tmp_path, monkeypatch):
    """The point of the stream: once an epoch's batches are taken, a worker has already been asked for the next
    epoch's first batch (recorded by the worker as it builds it), before that epoch's iteration begins; a new
    iterator for each epoch asks for nothing ahead."""
    from utils.data.dataset import YoloDataset

    original = YoloDataset.__getitems__

    def recorded(self, items):  # in the worker: its folder from the environment it was forked with
        index, epoch = items[0]
        (Path(os.environ["BUILT_FOLDER"]) / f"{epoch}_{index}").touch()
        return original(self, items)

    monkeypatch.setattr(YoloDataset, "__getitems__", recorded)  # the forked workers inherit it

    def first_of_epoch_1_built(folder: Path, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if any(path.name.startswith("1_") for path in folder.iterdir()):
                return True
            time.sleep(0.05)
        return False

    def loader(folder: Path):
        folder.mkdir()
        monkeypatch.setenv("BUILT_FOLDER", str(folder))
        return create_dataloader(None, 64, 4, 32, shuffle=True, workers=1, seed=3, labels=split,
                                 multiprocessing_context="fork")[0]

    stream = EpochStream(loader(tmp_path / "stream"))
    assert len(list(stream.epoch(0, 0, through=1))) == 3
    assert first_of_epoch_1_built(tmp_path / "stream", 10)
    alone = loader(tmp_path / "alone")
    set_loader_epoch(alone, 0)
    assert len(list(alone)) == 3
    assert not first_of_epoch_1_built(tmp_path / "alone", 1)
