"""Helpers shared by the export format tests (tests/test_export_<format>.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch


# export.py's parity line for an int8 export at 64x96 (the tests' size) of 8 calibration images (int8.PARITY_IMAGES)
INT8_PARITY = r"\d+ detections \(conf > 0\.25\).* at 8x3x64x96[: ].*; bounds 90%, 0\.7, 0\.1$"


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


def check_int8_tracks(got: torch.Tensor, expected: torch.Tensor, height: int, width: int) -> None:
    """An int8 export's output ``got`` against the PyTorch model's ``expected`` on images it was not calibrated on:
    float, passing the int8 parity check (models/formats/int8.py), close on average, scores not collapsed and
    ranked alike, boxes in pixels; and the same output with every box moved 200 px, or every score cut by 40%,
    refused by that check."""
    import pytest

    from models.formats.int8 import compare_detections

    assert got.dtype == torch.float32
    shape = (got.shape[0], 3, height, width)
    figure = compare_detections(expected, got, shape)
    assert figure.ok, figure.describe()
    assert float((got - expected)[..., 4:].abs().mean()) <= 0.01
    confidence = [(pred[..., 4] * pred[..., 5:].max(-1).values).flatten() for pred in (expected, got)]
    assert float(confidence[1].max()) == pytest.approx(float(confidence[0].max()), rel=0.1)  # not collapsed to 0
    assert float(torch.corrcoef(torch.stack(confidence))[0, 1]) >= 0.99
    assert got[..., 0].max() > width / 2 and got[..., 1].max() > height / 2  # boxes in pixels
    shifted, cut = got.clone(), got.clone()
    shifted[..., :2] += 200
    cut[..., 4:] *= 0.6
    for broken in (shifted, cut):
        assert not compare_detections(expected, broken, shape).ok


def empty_dataset(folder: Path) -> Path:
    """A dataset YAML whose train and val folders hold no image (nothing to calibrate --int8 with)."""
    for split in ("train", "val"):
        (folder / "images" / split).mkdir(parents=True)
    data = folder / "data.yaml"
    data.write_text(f"path: {folder}\ntrain: images/train\nval: images/val\nnames: [a, b]\n")
    return data


def check_int8_export(path: Path, weights: Path, data: Path, height: int, width: int, stored: Path) -> None:
    """An int8 export of ``weights`` at ``path``: its metadata says int8 (what picks export.py's int8 parity check),
    it tracks the PyTorch model on the val images of ``data`` (check_int8_tracks), and ``stored`` (the file holding
    the weights) takes less than half the float weights' bytes (1 byte per body weight, not 4)."""
    from models import for_inference, load_model
    from models.backends import load_backend

    backend = load_backend(path)
    assert backend.info.int8 and not backend.info.half
    images = letterboxed(data, "val", (height, width))  # images it was not calibrated on
    model = for_inference(load_model(weights))
    check_int8_tracks(backend(images)[0], eager_output(model, images), height, width)
    assert stored.stat().st_size < 0.5 * 4 * sum(p.numel() for p in model.parameters())


def label_rows(save_dir: Path) -> dict:
    """{file name: sorted rows of class, cx, cy, w, h, conf} from a --save-txt --save-conf run."""
    return {path.name: sorted(tuple(float(v) for v in line.split()) for line in path.read_text().splitlines())
            for path in sorted((save_dir / "labels").glob("*.txt"))}


def detect_labels(weights: Path, source: Path, imgsz: tuple, project: Path, name: str) -> dict:
    """label_rows of detect.py on ``source`` with ``weights`` (fp32 on the CPU; a low threshold and a few boxes
    per image, as the tiny models' scores are small)."""
    import detect

    assert detect.main(["--weights", str(weights), "--source", str(source), "--imgsz", *map(str, imgsz), "--device",
                        "cpu", "--amp", "off", "--conf-thres", "0.001", "--max-det", "20", "--save-txt", "--save-conf",
                        "--nosave", "--project", str(project), "--name", name]) == 0
    return label_rows(project / name)


def check_same_labels(expected: dict, got: dict, box_tolerance: float) -> None:
    """Two detect.py runs found the same boxes: the same files and classes, the boxes (normalised) within
    ``box_tolerance``, the confidences within 1e-3."""
    import numpy as np

    assert expected and got.keys() == expected.keys()
    for name, rows in expected.items():
        rows, other = np.array(rows), np.array(got[name])
        assert other.shape == rows.shape and np.array_equal(other[:, 0], rows[:, 0]), name
        assert np.abs(other[:, 1:5] - rows[:, 1:5]).max() <= box_tolerance
        assert np.abs(other[:, 5] - rows[:, 5]).max() <= 1e-3
