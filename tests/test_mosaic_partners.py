"""--mosaic-partners: a mosaic's other three images from the same batch (default: each image decoded once per
batch) or from the whole split (YOLOv5's draw); the option on the command line, in configs and on resume. That
the worker count does not change such batches: tests/test_dataset.py."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from tests.test_dataset import SIZES, make_split
from utils.config import ConfigError, Hyp, TrainConfig
from utils.data.dataset import YoloDataset

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


def same_items(a, b) -> bool:
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] for x, y in zip(a, b, strict=True))


def test_batch_partners_decode_each_batch_image_at_most_once_and_no_other(split, monkeypatch):
    data = YoloDataset(split, imgsz=64, augment=True, hyp=Hyp(mosaic=1.0))
    decoded = record_decodes(data, monkeypatch)
    items = data.__getitems__([(i, 2) for i in BATCH])
    assert len(items) == len(BATCH) and data.decoded is None  # nothing kept after the batch
    assert set(decoded) <= set(BATCH) and max(Counter(decoded).values()) == 1
    decoded.clear()
    for i in BATCH:  # the same mosaics drawn from the whole split: images outside the batch, decoded again
        data[(i, 2)]
    assert not set(decoded) <= set(BATCH) or max(Counter(decoded).values()) > 1


@pytest.mark.parametrize("hyp", [Hyp(mosaic=1.0), Hyp(mosaic=0.5, mixup=0.5)])
def test_images_kept_for_the_batch_are_never_changed(split, hyp):
    """Each item of a batch equals the same item built alone from the same partners (nothing kept between
    them): augmenting one item (HSV in place, letterboxed items, mixup) never alters an image kept for the next."""
    data = YoloDataset(split, imgsz=64, augment=True, hyp=hyp)
    for epoch in range(3):
        items = data.__getitems__([(i, epoch) for i in BATCH])
        alone = [data.item((i, epoch), np.delete(np.array(BATCH), k)) for k, i in enumerate(BATCH)]
        assert same_items(items, alone)


def test_dataset_partners_and_small_batches_draw_from_the_whole_split(split):
    whole = YoloDataset(split, imgsz=64, augment=True, hyp=Hyp(), mosaic_partners="dataset")
    assert same_items(whole.__getitems__([(i, 1) for i in BATCH]), [whole[(i, 1)] for i in BATCH])
    batch = YoloDataset(split, imgsz=64, augment=True, hyp=Hyp())
    assert same_items(batch.__getitems__([(i, 1) for i in BATCH[:3]]), [whole[(i, 1)] for i in BATCH[:3]])
    assert not same_items(batch.__getitems__([(i, 1) for i in BATCH]), [whole[(i, 1)] for i in BATCH])
    with pytest.raises(ValueError, match="mosaic_partners"):
        YoloDataset(split, imgsz=64, augment=True, mosaic_partners="epoch")


def test_option_on_the_command_line_in_configs_and_on_resume():
    import train

    assert train.config_from_args(train.parse_args([])).mosaic_partners == "batch"
    assert train.config_from_args(train.parse_args(["--mosaic-partners", "dataset"])).mosaic_partners == "dataset"
    stored = TrainConfig().to_dict()
    del stored["mosaic_partners"]  # a run saved before the option existed drew from the whole split
    assert TrainConfig.from_stored(stored).mosaic_partners == "dataset"
    assert TrainConfig.from_stored({**stored, "mosaic_partners": "batch"}).mosaic_partners == "batch"
    with pytest.raises(ConfigError, match="option 'mosaic_partners'"):
        TrainConfig.from_stored({**stored, "mosaic_partners": "../x"}, "last.pt")
