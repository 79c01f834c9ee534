"""--quad: YOLOv5's collate_fn4 on each training batch (utils/data/quad.py), its draws a function of (seed, rank,
epoch, batch), and a training run with it."""
from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from tests.conftest import make_tiny_run
from utils.data.quad import QuadBatches, quad_batch, quad_draws


def four_images(size: int = 8):
    """Images 0..3 filled with 10, 20, 30, 40, one box each at its centre (class = image number)."""
    images = torch.stack([torch.full((3, size, size), 10 * (k + 1), dtype=torch.uint8) for k in range(4)])
    targets = torch.tensor([[k, k, 0.5, 0.5, 0.2, 0.4] for k in range(4)])
    return images, targets


def test_a_tile_puts_the_four_images_and_their_boxes_in_yolov5s_quarters():
    images, targets = four_images()
    out, labels = quad_batch(images, targets, [False])
    assert out.shape == (1, 3, 16, 16) and out.dtype == torch.uint8
    quarters = {(top, left): int(out[0, 0, top * 8, left * 8]) for top in (0, 1) for left in (0, 1)}
    assert quarters == {(0, 0): 10, (1, 0): 20, (0, 1): 30, (1, 1): 40}  # 2nd below the 1st, 3rd right of it
    assert torch.equal(labels, torch.tensor([[0, 0, 0.25, 0.25, 0.1, 0.2], [0, 1, 0.25, 0.75, 0.1, 0.2],
                                             [0, 2, 0.75, 0.25, 0.1, 0.2], [0, 3, 0.75, 0.75, 0.1, 0.2]]))


def test_an_upscaled_group_is_its_first_image_at_twice_the_side_with_its_own_boxes():
    images, targets = four_images()
    images[0, :, :, 4:] = 200  # a vertical edge, to see the bilinear interpolation
    out, labels = quad_batch(images, targets, [True])
    expected = torch.nn.functional.interpolate(images[:1].float(), scale_factor=2.0, mode="bilinear",
                                               align_corners=False).to(torch.uint8)
    assert torch.equal(out, expected) and out.shape == (1, 3, 16, 16)
    assert torch.equal(labels, torch.tensor([[0, 0, 0.5, 0.5, 0.2, 0.4]]))  # normalised: unchanged


def test_groups_are_numbered_and_a_remainder_is_left_out():
    images, targets = four_images()
    images = torch.cat([images, images, images[:3]])  # 11 images: two groups, 3 left out (as YOLOv5)
    targets = torch.cat([targets, targets + torch.tensor([4.0, 0, 0, 0, 0, 0]),
                         targets[:3] + torch.tensor([8.0, 0, 0, 0, 0, 0])])
    out, labels = quad_batch(images, targets, [False, True])
    assert out.shape[0] == 2 and sorted(set(labels[:, 0].tolist())) == [0.0, 1.0]
    assert (labels[:, 0] == 1).sum() == 1  # the upscaled group keeps its first image's box only


def test_the_draws_follow_seed_rank_epoch_and_batch_only():
    draws = quad_draws(0, 0, 3, 7, 64)
    assert np.array_equal(draws, quad_draws(0, 0, 3, 7, 64))  # a resumed run draws the same
    assert 20 < draws.sum() < 44  # about half upscaled
    others = [quad_draws(1, 0, 3, 7, 64), quad_draws(0, 1, 3, 7, 64), quad_draws(0, 0, 4, 7, 64),
              quad_draws(0, 0, 3, 8, 64)]
    assert all(not np.array_equal(draws, other) for other in others)
    transform = QuadBatches(seed=0, rank=-1)
    images, targets = four_images()
    small = transform(0, 0, images[:3], targets[:3], ["a", "b", "c"])  # fewer than 4: trains as it is
    assert small[0].shape[0] == 3 and small[2] == ["a", "b", "c"]
    out, _, paths = transform(0, 0, images, targets, ["a", "b", "c", "d"])
    assert out.shape == (1, 3, 16, 16) and paths == ["a"]  # YOLOv5 keeps path[:n]


@pytest.mark.slow
def test_a_quad_run_trains_on_images_of_twice_the_side_with_the_loss_times_four(tmp_path, monkeypatch):
    import train as train_script
    from utils.trainer import loop

    data, cfg = make_tiny_run(tmp_path)
    seen = []
    original = loop.TrainStep.forward_backward

    def spy(self, images, targets, sync=True):
        seen.append((tuple(images.shape), self.loss_scale))
        return original(self, images, targets, sync)
    monkeypatch.setattr(loop.TrainStep, "forward_backward", spy)
    args = ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size", "8",
            "--epochs", "1", "--workers", "0", "--device", "cpu", "--project", str(tmp_path / "runs"),
            "--noautoanchor", "--quad", "--noval"]
    assert train_script.main(args) == 0
    assert seen and all(shape == (2, 3, 128, 128) and scale == 4.0 for shape, scale in seen)
    plot = cv2.imread(str(tmp_path / "runs" / "exp" / "train_batch0.jpg"))
    assert plot is not None  # the plot shows the quad batch
