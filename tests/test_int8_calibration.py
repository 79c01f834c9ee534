"""The calibration images of export.py --int8 (models/formats/int8.py, shared by LiteRT and ExecuTorch): the train
images of --data, sorted and capped, letterboxed as detect.py letterboxes for a fixed-size export. Needs no optional
package."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from models.formats import int8
from tests.conftest import make_tiny_dataset
from tests.export_helpers import empty_dataset, letterboxed
from utils.errors import ArgumentError

HEIGHT, WIDTH = 64, 96  # non-square, as phones' camera frames


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tiny_dataset(tmp_path_factory.mktemp("calibration"), num_train=16, num_val=4, size=96)


def test_calibration_images_go_through_the_inference_letterbox(data):
    """Each calibration batch is what detect.py feeds a fixed-size export; the last batch is filled up with the first
    images."""
    batches = list(int8.calibration_batches(str(data), (HEIGHT, WIDTH), 3))
    assert [tuple(batch.shape) for batch in batches] == [(3, 3, HEIGHT, WIDTH)] * 6  # 16 images + 2 repeated
    images = letterboxed(data, "train", (HEIGHT, WIDTH))
    assert torch.equal(torch.cat(batches)[:16], images) and torch.equal(batches[-1][1:], images[:2])
    assert torch.all(images[..., :9] == 114 / 255)  # 96x112 images in 64x96: grey bars at the sides


def test_at_most_calibration_images_are_taken_in_name_order(data, monkeypatch):
    monkeypatch.setattr(int8, "CALIBRATION_IMAGES", 5)
    files = int8.calibration_files(str(data))
    assert files == sorted(str(path) for path in (data.parent / "images" / "train").iterdir())[:5]
    assert sum(batch.shape[0] for batch in int8.calibration_batches(str(data), (HEIGHT, WIDTH), 2)) == 6


def test_the_parity_check_of_an_int8_file_takes_its_first_calibration_images_in_whole_batches(data):
    """PARITY_IMAGES (8) calibration images, rounded up to whole batches of the export's batch size (3: 9)."""
    images = int8.parity_inputs(SimpleNamespace(data=str(data)), (3, 3, HEIGHT, WIDTH))
    assert int8.PARITY_IMAGES == 8 and torch.equal(images, letterboxed(data, "train", (HEIGHT, WIDTH))[:9])
    assert int8.parity_inputs(SimpleNamespace(data=str(data)), (1, 3, HEIGHT, WIDTH)).shape[0] == 8


def test_a_dataset_without_train_images_is_one_line(tmp_path):
    with pytest.raises(ArgumentError, match=r"^--data .*data\.yaml: no train images to calibrate --int8 with$"):
        int8.calibration_files(str(empty_dataset(tmp_path)))
