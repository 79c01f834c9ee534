"""Test-time augmentation and ensembles (models/composite.py), as YOLOv5 v7 defines them, and their use by val.py,
detect.py and the hub model."""
from __future__ import annotations

import pytest
import torch

from models.composite import (PAD_VALUE, AugmentedBackend, EnsembleBackend, augmented_forward, level_rows,
                              load_models, scale_images)
from tests.conftest import make_tiny_run, save_random_checkpoint


def test_level_rows_split_a_p3_p5_output():
    # 64 px, 3 anchors: P3 8x8, P4 4x4, P5 2x2 grid points
    assert level_rows(3 * (64 + 16 + 4), 3) == [192, 48, 12]
    assert level_rows(3 * (256 + 64 + 16 + 4), 4) == [768, 192, 48, 12]  # P6 models


def test_scaled_images_keep_a_multiple_of_the_stride_and_grey_padding():
    images = torch.rand(2, 3, 64, 96)
    assert scale_images(images, 1.0, 32) is images
    scaled = scale_images(images, 0.83, 32)
    assert scaled.shape == (2, 3, 64, 96)  # 53x79 resized, padded to 64x96
    assert torch.all(scaled[:, :, 53:, :] == PAD_VALUE) and torch.all(scaled[:, :, :, 79:] == PAD_VALUE)
    assert scale_images(images, 0.67, 32).shape == (2, 3, 64, 96)  # 42x64 -> 64x96 (64.3 rounds up to 96)
    assert scale_images(torch.rand(1, 3, 128, 128), 0.67, 32).shape == (1, 3, 96, 96)  # 85.8 -> 96


def stripe_finder(levels=3):
    """A stand-in model: every row is a box centred on the brightest column, in the input's pixels."""
    def run(batch):
        column = batch[:, 0].mean(1).argmax(1).float() + 0.5
        rows = 21 if levels == 3 else 85
        pred = torch.zeros(batch.shape[0], rows, 7)
        pred[..., 0] = column[:, None]
        pred[..., 1] = batch.shape[2] / 2
        pred[..., 2:4] = 8.0
        pred[..., 4] = torch.arange(rows, dtype=torch.float32)  # the row's index, to follow the clipping
        return pred
    return run


def test_each_pass_is_descaled_unflipped_and_clipped():
    images = torch.zeros(1, 3, 64, 128)
    images[:, :, :, 18:23] = torch.tensor([0.5, 0.8, 1.0, 0.8, 0.5])  # a bright stripe centred on x = 20
    out = augmented_forward(stripe_finder(), images, 32, 3)
    # full scale keeps rows 0-19 (drops P5's 1 row of 21); 0.83 flipped keeps 21; 0.67 keeps rows 16-20 (drops P3)
    assert out.shape[1] == 20 + 21 + 5
    assert out[0, :20, 4].tolist() == list(range(20)) and out[0, 41:, 4].tolist() == [16, 17, 18, 19, 20]
    assert torch.allclose(out[0, :, 0], torch.full((46,), 20.5), atol=1.6)  # found where it is, in every pass
    assert torch.allclose(out[0, 20:41, 2], torch.full((21,), 8 / 0.83))  # sizes descaled too


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("composite")
    data, _ = make_tiny_run(root)
    first = save_random_checkpoint(root / "a.pt", ["a", "b"], seed=1, confident=True)
    second = save_random_checkpoint(root / "b.pt", ["a", "b"], seed=2, confident=True)
    return data, first, second, root


def test_tta_and_ensemble_backends_on_checkpoints(checkpoints):
    _, first, second, _ = checkpoints
    images = torch.rand(2, 3, 64, 64)
    one = load_models(first)
    plain = one(images)[0]
    augmented = AugmentedBackend(one)(images)[0]
    rows = level_rows(plain.shape[1], 3)
    assert augmented.shape[1] == plain.shape[1] - rows[-1] + plain.shape[1] + plain.shape[1] - rows[0]
    assert torch.equal(augmented[:, :plain.shape[1] - rows[-1]], plain[:, :-rows[-1]])  # the full-scale pass
    both = load_models([first, second])
    assert isinstance(both, EnsembleBackend) and both.names == ["a", "b"]
    assert torch.equal(both(images)[0], torch.cat([plain, load_models(second)(images)[0]], 1))
    assert load_models([first, second], augment=True)(images)[0].shape[1] == 2 * augmented.shape[1]


def test_an_ensemble_of_other_class_counts_or_exported_files_is_one_line(checkpoints, tmp_path):
    from models.backends import BackendError
    from tests.conftest import TINY_MODEL_YAML

    _, first, _, _ = checkpoints
    cfg = tmp_path / "three.yaml"
    cfg.write_text(TINY_MODEL_YAML.replace("nc: 2", "nc: 3"))
    three = save_random_checkpoint(tmp_path / "three.pt", ["a", "b", "c"], cfg=cfg)
    with pytest.raises(BackendError, match="a.pt has 2 classes, three.pt 3: the models must detect the same"):
        load_models([first, three])
    backend = load_models(first)
    backend.__class__ = type("Exported", (type(backend).__mro__[1],), {})  # any backend that is not a checkpoint
    with pytest.raises(BackendError, match="works with .pt checkpoints only"):
        AugmentedBackend(backend)


def test_val_and_detect_take_augment_and_several_weights(checkpoints, tmp_path):
    import detect
    import val

    data, first, second, _ = checkpoints
    common = dict(data=str(data), imgsz=64, batch_size=4, workers=0, device="cpu", plots=False,
                  project=str(tmp_path / "val"))
    plain = val.run(weights=str(first), **common)
    augmented = val.run(weights=str(first), augment=True, **common)
    ensemble = val.run(weights=[str(first), str(second)], **common)
    for result in (plain, augmented, ensemble):
        assert 0.0 <= result.map50 <= 1.0 and len(result.per_class) == 2
    assert val.main(["--data", str(data), "--weights", str(first), str(second), "--img", "64", "--workers", "0",
                     "--device", "cpu", "--project", str(tmp_path / "cli")]) == 0
    assert len(list((tmp_path / "cli").iterdir())) == 1  # the command line too: one ensemble, one run folder
    found = detect.run(weights=[str(first), str(second)], source=str(data.parent / "images" / "val"), imgsz=64,
                       augment=True, device="cpu", project=str(tmp_path / "detect"), nosave=True)
    assert len(found.detections) == 4
