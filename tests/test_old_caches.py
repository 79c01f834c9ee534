"""utils/data/old_caches.py: .npy files beside a dataset's images that the run will not read are reported (count,
size, a command removing exactly them), never silently left behind; nothing is deleted by the trainer."""
from __future__ import annotations

import logging
import re
import subprocess

import cv2
import numpy as np
import pytest

from tests.conftest import make_tiny_dataset
from utils.data.old_caches import report, survey


@pytest.fixture
def folder(tmp_path):
    """Images a.jpg, b.png, c.jpg with: YOLOv5's a.npy, ours b.png.npy, ours for a deleted image gone.jpg.npy,
    and files that are none of these (another tool's features.npy, c.jpg.npy.bak)."""
    images = tmp_path / "images"
    images.mkdir()
    for name in ("a.jpg", "b.png", "c.jpg"):
        cv2.imwrite(str(images / name), np.zeros((8, 8, 3), np.uint8))
    for name, size in (("a.npy", 1000), ("b.png.npy", 2000), ("gone.jpg.npy", 3000), ("features.npy", 10),
                       ("c.jpg.npy.bak", 10)):
        (images / name).write_bytes(b"x" * size)
    return images


def test_the_survey_sorts_npy_files_by_kind(folder):
    found = survey([folder / "a.jpg", folder / "b.png", folder / "c.jpg"])
    assert found.yolov5.files == {str(folder): ["a.npy"]} and found.yolov5.size == 1000
    assert found.ours.files == {str(folder): ["b.png.npy"]} and found.ours.size == 2000
    assert found.orphans.files == {str(folder): ["gone.jpg.npy"]} and found.orphans.size == 3000


def removal_command(line: str) -> str:
    return re.search(r"(?:remove them with|to remove them): (.*)$", line).group(1)


def test_each_kind_is_one_line_whose_command_removes_exactly_those_files(folder, caplog):
    caplog.set_level(logging.INFO)
    report([folder / "a.jpg", folder / "b.png", folder / "c.jpg"], prefix="train: ")
    lines = [record.getMessage() for record in caplog.records if record.name == "utils.data.old_caches"]
    assert len(lines) == 3 and all(line.startswith("train: ") and "\n" not in line for line in lines)
    yolov5, orphans, ours = lines
    assert "1 YOLOv5 disk-cache files" in yolov5 and "0.0 MB" in yolov5 and str(folder) in yolov5
    assert "1 --cache disk files (x.jpg.npy), 0.0 MB" in orphans and "images are gone" in orphans
    assert "1 files of an earlier --cache disk" in ours and "never read" in ours
    before = {path.name for path in folder.iterdir()}
    for line, removed in ((yolov5, "a.npy"), (orphans, "gone.jpg.npy"), (ours, "b.png.npy")):
        subprocess.run(["bash", "-c", removal_command(line)], check=True)
        before.discard(removed)
        assert {path.name for path in folder.iterdir()} == before  # that file only: images and others stay


def test_nothing_is_reported_without_npy_files(folder, caplog):
    caplog.set_level(logging.INFO)
    for name in ("a.npy", "gone.jpg.npy", "b.png.npy"):
        (folder / name).unlink()
    report([folder / "a.jpg", folder / "b.png", folder / "c.jpg"])
    assert [record for record in caplog.records if record.name == "utils.data.old_caches"] == []


def test_a_dataset_reports_the_yolov5_cache_beside_its_images(tmp_path, caplog):
    """What a user coming from YOLOv5 sees: its a.npy files are named once, at dataset creation."""
    from utils.data.dataset import YoloDataset
    from utils.data.verify import scan_split

    data = make_tiny_dataset(tmp_path / "data", num_train=4, num_val=2)
    images = data.parent / "images" / "train"
    for image in images.glob("*.jpg"):
        np.save(image.with_suffix(".npy"), np.zeros((2, 2), np.uint8))
    split = scan_split([str(images)], nc=2)
    caplog.set_level(logging.WARNING)
    YoloDataset(split, imgsz=64, prefix="train: ")
    assert [record.getMessage().split(",")[0] for record in caplog.records if record.name == "utils.data.old_caches"] == [
        "train: WARNING: 4 YOLOv5 disk-cache files (a.npy beside a.jpg)"]


def test_the_same_folder_written_differently_is_surveyed_once(tmp_path, monkeypatch):
    """Images named relative to the working folder, absolutely and through '..' are one folder: each leftover is
    found once."""
    (tmp_path / "a.jpg").write_bytes(b"x")
    (tmp_path / "b.jpg").write_bytes(b"x")
    (tmp_path / "a.npy").write_bytes(b"y" * 10)  # YOLOv5's cache of a.jpg
    monkeypatch.chdir(tmp_path)
    found = survey(["a.jpg", str(tmp_path / "b.jpg"), f"../{tmp_path.name}/a.jpg"])
    assert found.yolov5.files == {str(tmp_path): ["a.npy"]} and found.yolov5.size == 10
