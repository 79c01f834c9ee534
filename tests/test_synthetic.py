"""The embedded default dataset: deterministic, valid labels glued to drawn pixels, atomic first-use build."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from utils.data import synthetic
from utils.data.synthetic import (CLASS_NAMES, ensure_default_dataset, generate_dataset, image_rng,
                                  render_image)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "data.yaml"}


def _read_labels(path: Path) -> np.ndarray:
    return np.array([line.split() for line in path.read_text().splitlines()], np.float64).reshape(-1, 5)


def test_generation_is_deterministic_whatever_the_thread_count(tmp_path):
    generate_dataset(tmp_path / "a", train_count=5, val_count=2, workers=1)
    generate_dataset(tmp_path / "b", train_count=5, val_count=2, workers=3)
    first, second = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert len(first) == 2 * (5 + 2)
    assert first == second
    other_seed = generate_dataset(tmp_path / "c", train_count=5, val_count=2, seed=1).parent
    assert _files(other_seed) != first


def test_labels_are_valid_and_images_decode(tmp_path):
    import cv2

    yaml_path = generate_dataset(tmp_path, train_count=8, val_count=3)
    config = yaml.safe_load(yaml_path.read_text())
    assert Path(config["path"]) == tmp_path.resolve()
    assert config["train"] == "images/train" and config["val"] == "images/val"
    assert [config["names"][i] for i in range(len(config["names"]))] == list(CLASS_NAMES)
    assert len(CLASS_NAMES) >= 5
    for split, count in (("train", 8), ("val", 3)):
        images = sorted((tmp_path / "images" / split).glob("*.jpg"))
        assert len(images) == count
        for image_path in images:
            image = cv2.imread(str(image_path))
            assert image is not None and image.shape[2] == 3
            assert 160 <= min(image.shape[:2]) and max(image.shape[:2]) <= 416
            labels = _read_labels(tmp_path / "labels" / split / f"{image_path.stem}.txt")
            assert 1 <= len(labels) <= 10
            assert np.all(labels[:, 0] == labels[:, 0].round()) and labels[:, 0].max() < len(CLASS_NAMES)
            boxes = labels[:, 1:]
            assert np.all(boxes[:, 2:] > 0)
            assert np.all(boxes[:, :2] - boxes[:, 2:] / 2 >= -1e-6)
            assert np.all(boxes[:, :2] + boxes[:, 2:] / 2 <= 1 + 1e-6)


def test_boxes_are_the_bounds_of_each_objects_visible_pixels(monkeypatch):
    """Flat black background, each object painted in its own colour: box == bounds of that colour."""
    painted = []

    def flat_texture(rng, height, width, cls):
        painted.append(len(painted) + 1)
        colour = np.array([255, 8 * len(painted), 255 - 8 * len(painted)], np.float32)
        return np.broadcast_to(colour, (height, width, 3))

    monkeypatch.setattr(synthetic, "_texture", flat_texture)
    monkeypatch.setattr(synthetic, "_background", lambda rng, h, w: np.zeros((h, w, 3), np.float32))
    monkeypatch.setattr(synthetic, "_add_sensor_noise", lambda rng, image: None)
    checked = 0
    for index in range(6):
        painted.clear()
        image, labels = render_image(image_rng(0, "train", index))
        assert len(labels) == len(painted)
        height, width = image.shape[:2]
        for number, (cls, cx, cy, w, h) in enumerate(labels, start=1):
            ys, xs = np.nonzero(np.all(image == [255, 8 * number, 255 - 8 * number], axis=2))
            assert len(xs) > 0, "a labelled object must be visible"
            expected = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
            box = [(cx - w / 2) * width, (cy - h / 2) * height, (cx + w / 2) * width, (cy + h / 2) * height]
            np.testing.assert_allclose(box, expected, atol=1e-3)
            checked += 1
        drawn = np.any(image > 0, axis=2)
        assert drawn.sum() > 0
    assert checked >= 12


def test_objects_span_classes_sizes_and_overlap():
    classes, sizes, overlaps = set(), [], 0
    for index in range(30):
        image, labels = render_image(image_rng(0, "train", index))
        height, width = image.shape[:2]
        classes.update(labels[:, 0].astype(int).tolist())
        long_sides = np.maximum(labels[:, 3] * width, labels[:, 4] * height)
        sizes.extend((long_sides / min(height, width)).tolist())
        assert long_sides.min() >= 3
        xyxy = np.concatenate([labels[:, 1:3] - labels[:, 3:] / 2, labels[:, 1:3] + labels[:, 3:] / 2], 1)
        lt = np.maximum(xyxy[:, None, :2], xyxy[None, :, :2])
        rb = np.minimum(xyxy[:, None, 2:], xyxy[None, :, 2:])
        inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
        overlaps += int((np.triu(inter, 1) > 0).sum())
    assert classes == set(range(len(CLASS_NAMES)))
    assert min(sizes) < 0.06 and max(sizes) > 0.3  # ~8-16 px up to about half the image
    assert overlaps > 0


def test_ensure_builds_once_then_reuses(tmp_path, monkeypatch):
    yaml_path = ensure_default_dataset(tmp_path, train_count=3, val_count=2)
    assert yaml_path == tmp_path / "shapes-v2" / "data.yaml" and yaml_path.is_file()
    assert yaml.safe_load(yaml_path.read_text())["path"] == str((tmp_path / "shapes-v2").resolve())
    assert [p.name for p in tmp_path.iterdir()] == ["shapes-v2"]  # no build folder left behind

    def no_generation(*args, **kwargs):
        raise AssertionError("a complete dataset must be reused")

    monkeypatch.setattr(synthetic, "generate_dataset", no_generation)
    assert ensure_default_dataset(tmp_path, train_count=3, val_count=2) == yaml_path


def test_ensure_rebuilds_a_mismatched_or_damaged_folder(tmp_path):
    ensure_default_dataset(tmp_path, train_count=3, val_count=2)
    yaml_path = ensure_default_dataset(tmp_path, train_count=4, val_count=2)
    assert len(list((yaml_path.parent / "images" / "train").iterdir())) == 4
    (yaml_path.parent / "labels" / "val" / "00001.txt").unlink()  # damaged by hand
    ensure_default_dataset(tmp_path, train_count=4, val_count=2)
    assert (yaml_path.parent / "labels" / "val" / "00001.txt").is_file()


def test_interrupted_generation_leaves_nothing(tmp_path, monkeypatch):
    real_write = synthetic._write_one

    def failing_write(out_dir, seed, split, index):
        if split == "val":
            raise KeyboardInterrupt
        return real_write(out_dir, seed, split, index)

    monkeypatch.setattr(synthetic, "_write_one", failing_write)
    with pytest.raises(KeyboardInterrupt):
        ensure_default_dataset(tmp_path, train_count=2, val_count=2, workers=1)
    assert list(tmp_path.iterdir()) == []


def test_environment_variable_sets_the_parent_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("YOLO_TRAINER_DATASETS", str(tmp_path / "elsewhere"))
    assert synthetic.default_datasets_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("YOLO_TRAINER_DATASETS")
    assert synthetic.default_datasets_dir() == Path.home() / ".cache" / "yolo-trainer" / "datasets"
