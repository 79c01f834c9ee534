"""Helpers shared by the export format tests (tests/test_export_<format>.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch


def copy_weights(weights: Path, folder: Path) -> Path:
    """``weights`` copied to ``folder/best.pt``: each export test writes beside its own copy."""
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(weights, folder / "best.pt"))


def eager_output(model, images: torch.Tensor) -> torch.Tensor:
    """The PyTorch model's decoded output, channels_last as export.py traces it."""
    with torch.no_grad():
        return model(images.contiguous(memory_format=torch.channels_last))[0]


def max_differences(exported: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(boxes in pixels, scores) max |diff|."""
    assert exported.shape == reference.shape
    difference = (exported - reference).abs()
    return float(difference[..., :4].max()), float(difference[..., 4:].max())


def letterboxed(data: Path, split: str, imgsz: tuple) -> torch.Tensor:
    """The split's images (sorted) as detect.py feeds a fixed-size export (utils.inference.prepare_image,
    auto=False)."""
    from utils.data.images import read_image
    from utils.inference import prepare_image

    files = sorted((data.parent / "images" / split).iterdir())
    return torch.cat([prepare_image(read_image(file), imgsz, 32, "cpu", False, auto=False) for file in files])
