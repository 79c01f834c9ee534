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
from utils.data.old_caches import SHOWN_FILES, report, survey


def image_npy(path, height=4, width=5):
    """An image cache as YOLOv5 and earlier --cache disk write it: np.save of a uint8 H x W x 3 array."""
    with open(path, "wb") as file:
        np.save(file, np.full((height, width, 3), 7, np.uint8), allow_pickle=False)
    return path.stat().st_size


@pytest.fixture
def folder(tmp_path):
    """Images a.jpg, b.png, c.jpg with: YOLOv5's a.npy, ours b.png.npy, ours for a deleted image gone.jpg.npy
    (image arrays of different sizes), and files that are none of these (another tool's features.npy,
    c.jpg.npy.bak)."""
    images = tmp_path / "images"
    images.mkdir()
    for name in ("a.jpg", "b.png", "c.jpg"):
        cv2.imwrite(str(images / name), np.zeros((8, 8, 3), np.uint8))
    for name, height in (("a.npy", 10), ("b.png.npy", 20), ("gone.jpg.npy", 30), ("features.npy", 1),
                         ("c.jpg.npy.bak", 1)):
        image_npy(images / name, height)
    return images


def test_the_survey_sorts_npy_files_by_kind(folder):
    found = survey([folder / "a.jpg", folder / "b.png", folder / "c.jpg"])
    assert found.yolov5.files == {str(folder): ["a.npy"]} and found.yolov5.size == 128 + 10 * 5 * 3
    assert found.ours.files == {str(folder): ["b.png.npy"]} and found.ours.size == 128 + 20 * 5 * 3
    assert found.orphans.files == {str(folder): ["gone.jpg.npy"]} and found.orphans.size == 128 + 30 * 5 * 3


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
        image_npy(image.with_suffix(".npy"), 2, 2)
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
    size = image_npy(tmp_path / "a.npy")  # YOLOv5's cache of a.jpg
    monkeypatch.chdir(tmp_path)
    found = survey(["a.jpg", str(tmp_path / "b.jpg"), f"../{tmp_path.name}/a.jpg"])
    assert found.yolov5.files == {str(tmp_path): ["a.npy"]} and found.yolov5.size == size


def write_header_then(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data)


def test_only_uint8_height_width_3_arrays_count_as_image_caches(tmp_path):
    """A user's depth map (float32 H x W) or mask (uint8 H x W) named a.npy beside a.jpg stays unlisted, as do a
    broken header, an object array (never unpickled), a truncated or padded image array, a format 3.0 file and a
    link; each kind is checked the same way (YOLOv5's a.npy, ours a.jpg.npy, orphans gone.jpg.npy)."""
    images = [tmp_path / f"{stem}.jpg" for stem in "abcdefghij"]
    for image in images:
        image.write_bytes(b"x")
    np.save(tmp_path / "a.npy", np.ones((6, 7), np.float32))  # depth map
    np.save(tmp_path / "b.npy", np.ones((6, 7), np.uint8))  # mask
    np.save(tmp_path / "c.npy", np.ones((6, 7, 3), np.float32))  # float image
    np.save(tmp_path / "d.npy", np.array([{"pickled": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "e.npy").write_bytes(b"\x93NUMPY\x01\x00\xff\xff{'descr': '|u1'")  # header cut short
    write_header_then(tmp_path / "f.npy", b"{'descr': '|u1', 'fortran_order': False, 'shape': (2, 2, 3), }" +
                      b" " * 56 + b"\n", bytes(11))  # one byte short of 2 * 2 * 3
    image_npy(tmp_path / "g.npy", 2, 2)
    (tmp_path / "g.npy").write_bytes((tmp_path / "g.npy").read_bytes() + b"more")  # something after the array
    np.lib.format.write_array((tmp_path / "h.npy").open("wb"), np.ones((2, 2, 3), np.uint8), version=(3, 0))
    image_npy(tmp_path / "elsewhere.array")
    (tmp_path / "i.npy").symlink_to(tmp_path / "elsewhere.array")
    image_npy(tmp_path / "j.npy", 3, 3)  # the only image cache among them
    image_npy(tmp_path / "j.jpg.npy", 3, 3)  # ours
    image_npy(tmp_path / "gone.jpg.npy", 3, 3)  # an orphan
    for bad in "abe":  # the same bad contents under the names of ours and of orphans
        for name in (f"{bad}.jpg.npy", f"gone-{bad}.jpg.npy"):
            (tmp_path / name).write_bytes((tmp_path / f"{bad}.npy").read_bytes())
    (tmp_path / "i.jpg.npy").symlink_to(tmp_path / "elsewhere.array")
    found = survey(images)
    assert found.yolov5.files == {str(tmp_path): ["j.npy"]}
    assert found.ours.files == {str(tmp_path): ["j.jpg.npy"]}
    assert found.orphans.files == {str(tmp_path): ["gone.jpg.npy"]}


def test_many_files_are_listed_in_a_file_and_the_command_removes_exactly_them(tmp_path, caplog):
    """More than SHOWN_FILES: the one-line command reads their list (NUL-separated, so names with spaces,
    quotes or a newline are fine) from the user cache folder; a depth map among them stays."""
    images = []
    for index in range(SHOWN_FILES + 5):
        image = tmp_path / f"img {index}'$x.jpg"
        image.write_bytes(b"x")
        images.append(image)
        image_npy(image.with_suffix(".npy"))
    (tmp_path / "new\nline.jpg").write_bytes(b"x")
    image_npy(tmp_path / "new\nline.npy")
    (tmp_path / "depth.jpg").write_bytes(b"x")
    np.save(tmp_path / "depth.npy", np.ones((4, 5), np.float32))
    caplog.set_level(logging.WARNING)
    report(images + [tmp_path / "new\nline.jpg", tmp_path / "depth.jpg"])
    (line,) = [record.getMessage() for record in caplog.records if record.name == "utils.data.old_caches"]
    assert "\n" not in line and f"{SHOWN_FILES + 6} YOLOv5 disk-cache files" in line
    command = removal_command(line)
    assert command.startswith("xargs -0 rm -f -- < ") and "old-caches" in command
    subprocess.run(["bash", "-c", command], check=True)
    assert sorted(path.name for path in tmp_path.glob("*.npy")) == ["depth.npy"]
    assert len(list(tmp_path.glob("*.jpg"))) == SHOWN_FILES + 7


def test_without_a_list_file_the_command_names_the_first_files_and_counts_the_rest(tmp_path, caplog, monkeypatch):
    import utils.data.old_caches as old_caches

    def refuse(*args):
        raise PermissionError(13, "Permission denied", "/home/user/.cache/yolo-trainer/old-caches")

    monkeypatch.setattr(old_caches, "private_cache_folder", refuse)
    images = []
    for index in range(SHOWN_FILES + 3):
        images.append(tmp_path / f"{index:02d}.jpg")
        images[-1].write_bytes(b"x")
        image_npy(images[-1].with_suffix(".npy"))
    caplog.set_level(logging.WARNING)
    report(images)
    (line,) = [record.getMessage() for record in caplog.records if record.name == "utils.data.old_caches"]
    assert line.endswith("; and 3 more files not named here (their list could not be written: [Errno 13] "
                         "Permission denied: '/home/user/.cache/yolo-trainer/old-caches')")
    subprocess.run(["bash", "-c", removal_command(line).split(" ; and ")[0]], check=True)
    assert sorted(path.name for path in tmp_path.glob("*.npy")) == [f"{index}.npy" for index in (20, 21, 22)]
