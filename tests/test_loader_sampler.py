"""The training order under several processes (utils/data/loader.py EpochSampler through create_dataloader): every
image once per epoch across the ranks, a different order every epoch (0 and 1 included), the order a function of
(seed, epoch) so that a resumed epoch continues it, on every rank."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import make_tiny_dataset
from utils.data.loader import EpochSampler, create_dataloader, set_loader_epoch
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
