"""``--quad``: YOLOv5's quad collate (its ``collate_fn4``), applied to each training batch as it arrives.

Every group of 4 images of a batch becomes one image of twice the side: with probability 0.5 the group's first
image upscaled 2x (bilinear, its labels unchanged), else the four tiled 2x2 (the first top left, the second below
it, the third top right, the fourth below that; their labels moved into their quarter). A batch of B images
trains as B // 4 images (a remainder of B % 4 is left out, as YOLOv5 leaves it); a batch of fewer than 4 images
(a last, short batch) trains as it is. YOLOv5 multiplies the loss by 4 with --quad (TrainStep.loss_scale).

The draws are a function of (seed, process rank, epoch, batch index), so a resumed run draws what the
uninterrupted one drew.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

QUAD_STREAM = 4  # keeps these draws apart from the dataset's per-image streams (seed, epoch, index)
LOSS_SCALE = 4.0  # YOLOv5: loss *= 4 with --quad


def quad_draws(seed: int, rank: int, epoch: int, batch_index: int, groups: int) -> np.ndarray:
    """True for each group that is its first image upscaled, False for a 2x2 tile."""
    rng = np.random.default_rng((seed, QUAD_STREAM, max(rank, 0), epoch, batch_index))
    return rng.random(groups) < 0.5


def quad_batch(images: torch.Tensor, targets: torch.Tensor, upscale) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 3, H, W) uint8 images and (n, 6) [image, class, cx, cy, w, h] targets -> (B // 4, 3, 2H, 2W) and their
    targets; ``upscale[g]`` chooses group g's form (module doc)."""
    groups = images.shape[0] // 4
    shift_down = targets.new_tensor([0.0, 0, 0, 1, 0, 0])
    shift_right = targets.new_tensor([0.0, 0, 1, 0, 0, 0])
    halve = targets.new_tensor([1.0, 1, 0.5, 0.5, 0.5, 0.5])
    out_images, out_targets = [], []
    for group in range(groups):
        first = group * 4
        mine = [targets[targets[:, 0] == first + k] for k in range(4)]
        if upscale[group]:
            scaled = F.interpolate(images[first:first + 1].float(), scale_factor=2.0, mode="bilinear",
                                   align_corners=False)
            out_images.append(scaled[0].to(images.dtype))  # truncated back to uint8, as YOLOv5's .type() does
            labels = mine[0].clone()
        else:
            left = torch.cat((images[first], images[first + 1]), 1)
            right = torch.cat((images[first + 2], images[first + 3]), 1)
            out_images.append(torch.cat((left, right), 2))
            labels = torch.cat((mine[0], mine[1] + shift_down, mine[2] + shift_right,
                                mine[3] + shift_down + shift_right), 0) * halve
        labels[:, 0] = group
        out_targets.append(labels)
    stacked = torch.stack(out_images).contiguous(memory_format=torch.channels_last)
    return stacked, torch.cat(out_targets, 0) if out_targets else targets[:0]


class QuadBatches:
    """train_one_epoch's ``batch_transform`` for --quad: (epoch, batch index, images, targets, paths) -> the quad
    batch (with the first B // 4 paths, as YOLOv5 keeps ``path[:n]``)."""

    def __init__(self, seed: int, rank: int):
        self.seed, self.rank = seed, rank

    def __call__(self, epoch: int, batch_index: int, images, targets, paths):
        groups = images.shape[0] // 4
        if groups == 0:
            return images, targets, paths
        upscale = quad_draws(self.seed, self.rank, epoch, batch_index, groups)
        images, targets = quad_batch(images, targets, upscale)
        return images, targets, list(paths)[:groups]
