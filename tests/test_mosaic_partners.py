"""--mosaic-partners: a mosaic's other three images from the whole split (the default, YOLOv5's draw) or, opted in,
from the batch's distinct other images (each image decoded once per batch); the option on the command line, in the
Python API, in configs and on resume. That the worker count does not change such batches: tests/test_dataset.py."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from tests.test_dataset import SIZES, make_split
from utils.config import ConfigError, Hyp, TrainConfig
from utils.data.dataset import YoloDataset
from utils.data.loader import create_dataloader

BATCH = [0, 3, 5, 7, 9]


@pytest.fixture
def split(tmp_path):
    return make_split(tmp_path, sizes=SIZES * 2)  # 12 images: a batch of 5 is well short of the split


def record_decodes(data: YoloDataset, monkeypatch) -> list:
    decoded = []
    load = data._load_resized

    def recording(i):
        decoded.append(i)
        return load(i)

    monkeypatch.setattr(data, "_load_resized", recording)
    return decoded


class RecordedLabels:
    """``data.labels`` that records the images asked for: a mosaic reads its four images' labels in a row."""

    def __init__(self, labels):
        self.labels, self.read = labels, []

    def __getitem__(self, i):
        self.read.append(int(i))
        return self.labels[i]


def mosaic_images(data: YoloDataset, items: list, per_item: int = 4) -> list[list[int]]:
    """The images of each item's mosaic(s) (``per_item`` reads of labels: 4 a mosaic), with ``hyp.mosaic`` 1."""
    data.labels = RecordedLabels(data.labels)
    try:
        data.__getitems__(items)
        read = data.labels.read
    finally:
        data.labels = data.labels.labels
    assert len(read) == per_item * len(items)
    return [read[k:k + per_item] for k in range(0, len(read), per_item)]


def same_items(a, b) -> bool:
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] for x, y in zip(a, b, strict=True))


def others(index: int, batch) -> np.ndarray:
    return np.array(sorted(set(batch) - {index}))


def test_yolov5s_draw_is_the_default_everywhere(split):
    import train
    from utils.api import keyword_argv

    assert train.config_from_args(train.parse_args([])).mosaic_partners == "dataset"
    api_args = train.parse_args(keyword_argv(train.build_parser(), {"epochs": 1}))  # what train.run(epochs=1) trains
    assert train.config_from_args(api_args).mosaic_partners == "dataset"
    assert TrainConfig().mosaic_partners == "dataset"
    data = YoloDataset(split, imgsz=64, augment=True, hyp=Hyp(mosaic=1.0))
    _, loaded = create_dataloader(None, 64, 4, 32, hyp=Hyp(), augment=True, workers=0, labels=split)
    assert data.mosaic_partners == loaded.mosaic_partners == "dataset"
    assert same_items(data.__getitems__([(i, 1) for i in BATCH]), [data[(i, 1)] for i in BATCH])
    assert any(not set(images) <= set(BATCH) for images in mosaic_images(data, [(i, 1) for i in BATCH]))


def test_batch_partners_decode_each_batch_image_at_most_once_and_no_other(split, monkeypatch):
    data = YoloDataset(split, imgsz=64, augment=True, hyp=Hyp(mosaic=1.0), mosaic_partners="batch")
    decoded = record_decodes(data, monkeypatch)
    items = data.__getitems__([(i, 2) for i in BATCH])
    assert len(items) == len(BATCH) and data.decoded is None  # nothing kept after the batch
    assert set(decoded) <= set(BATCH) and max(Counter(decoded).values()) == 1
    decoded.clear()
    for i in BATCH:  # the same mosaics drawn from the whole split: images outside the batch, decoded again
        data[(i, 2)]
    assert not set(decoded) <= set(BATCH) or max(Counter(decoded).values()) > 1


@pytest.mark.parametrize("batch", [BATCH, [0, 1, 2, 3], [3, 3, 9, 0, 3, 5, 9]])
def test_batch_partners_are_three_distinct_other_images_of_the_batch(split, batch):
    """The image itself is never its own partner and no partner comes twice, also when image weights put an image
    in the batch more than once ([3, 3, 9, 0, 3, 5, 9]: 3's partners are three of 0, 5, 9)."""
    data = YoloDataset(split, imgsz=64, augment=True, hyp=Hyp(mosaic=1.0), mosaic_partners="batch")
    for epoch in range(4):
        for index, images in zip(batch, mosaic_images(data, [(i, epoch) for i in batch]), strict=True):
            assert images.count(index) == 1 and len(set(images)) == 4 and set(images) <= set(batch)


def test_batch_partners_do_not_depend_on_the_items_order(split):
    data = YoloDataset(split, imgsz=64, augment=True, hyp=Hyp(mosaic=0.5, mixup=0.5), mosaic_partners="batch")
    batch = [9, 3, 3, 0, 7, 5]
    items = data.__getitems__([(i, 1) for i in batch])
    assert same_items(data.__getitems__([(i, 1) for i in batch[::-1]]), items[::-1])
    assert same_items(items, data.__getitems__([(i, 1) for i in batch]))  # and again: the same per seed


def test_batch_mixup_blends_a_mosaic_of_another_batch_image(split):
    """Mixup's second mosaic: one of the item's partners, with the batch's remaining images as its partners."""
    data = YoloDataset(split, imgsz=64, augment=True, hyp=Hyp(mosaic=1.0, mixup=1.0), mosaic_partners="batch")
    for index, images in zip(BATCH, mosaic_images(data, [(i, 2) for i in BATCH], per_item=8), strict=True):
        first, second = images[:4], images[4:]
        assert index in first and len(set(first)) == 4 and set(first) <= set(BATCH)
        assert sorted(second) == list(others(index, BATCH))  # 5 images: the other four, each once


@pytest.mark.parametrize("hyp", [Hyp(mosaic=1.0), Hyp(mosaic=0.5, mixup=0.5)])
def test_images_kept_for_the_batch_are_never_changed(split, hyp):
    """Each item of a batch equals the same item built alone from the same partners (nothing kept between
    them): augmenting one item (HSV in place, letterboxed items, mixup) never alters an image kept for the next."""
    data = YoloDataset(split, imgsz=64, augment=True, hyp=hyp, mosaic_partners="batch")
    for epoch in range(3):
        items = data.__getitems__([(i, epoch) for i in BATCH])
        alone = [data.item((i, epoch), others(i, BATCH)) for i in BATCH]
        assert same_items(items, alone)


@pytest.mark.parametrize("batch", [[4], [0, 3, 5], [3, 3, 3, 9, 9, 0]])
def test_batches_of_fewer_than_four_distinct_images_draw_from_the_whole_split(split, batch):
    """Batch 1, small batches, or image weights drawing the same images: no item has three distinct others in the
    batch, so every item is YOLOv5's (partners from the split, the image itself possible)."""
    whole = YoloDataset(split, imgsz=64, augment=True, hyp=Hyp(mosaic=1.0), mosaic_partners="dataset")
    data = YoloDataset(split, imgsz=64, augment=True, hyp=Hyp(mosaic=1.0), mosaic_partners="batch")
    outside = []
    for epoch in range(3):
        items = [(i, epoch) for i in batch]
        assert same_items(data.__getitems__(items), [whole[item] for item in items])
        outside += [not set(images) <= set(batch) for images in mosaic_images(data, items)]
    assert any(outside)
    assert not same_items(data.__getitems__([(i, 1) for i in BATCH]), [whole[(i, 1)] for i in BATCH])
    with pytest.raises(ValueError, match="mosaic_partners"):
        YoloDataset(split, imgsz=64, augment=True, mosaic_partners="epoch")


def test_option_on_the_command_line_in_configs_and_on_resume():
    import train

    assert train.config_from_args(train.parse_args(["--mosaic-partners", "batch"])).mosaic_partners == "batch"
    stored = TrainConfig().to_dict()
    del stored["mosaic_partners"]  # a run saved before the option existed drew from the whole split
    assert TrainConfig.from_stored(stored).mosaic_partners == "dataset"
    assert TrainConfig.from_stored({**stored, "mosaic_partners": "batch"}).mosaic_partners == "batch"
    with pytest.raises(ConfigError, match="option 'mosaic_partners'"):
        TrainConfig.from_stored({**stored, "mosaic_partners": "../x"}, "last.pt")
