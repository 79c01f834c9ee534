"""YOLOv5's xView, Argoverse and Objects365 YAMLs by name, their conversions done as data (utils/data/converters.py):
xView and Argoverse downloaded by hand and converted in place on first use, Objects365's archives fetched from a
loopback server; autosplit's draw equal to YOLOv5's; names from the files never steer a write."""
from __future__ import annotations

import json
import logging
import os
import random

import numpy as np
import pytest

from tests.test_dataset_download import Files, repo_copy_with, tar_folder
from utils import downloads
from utils.data import converters, dataset_download
from utils.data.converters import autosplit
from utils.data.dataset_download import DatasetDownloadError, ensure_downloaded, parse_download
from utils.data.dataset_yaml import load_data_config
from utils.data.importers import AnnotationError
from utils.safe_yaml import read_yaml
from tests.test_dataset_download import ROOT, mirror  # noqa: F401 (the fixture)


def image(path, width=100, height=50):
    import cv2

    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), np.full((height, width, 3), 80, np.uint8))


def labels_of(path):
    return [[float(value) for value in line.split()] for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- autosplit


def test_autosplit_draws_as_yolov5_and_writes_relative_lists(tmp_path):
    """12 images: Python's random seeded with 0 draws val for the 11th alone (YOLOv5's autosplit draws the same),
    listed as ./train/NAME beside the folder; no test list when its weight is 0; earlier lists go."""
    for index in range(12):
        image(tmp_path / "images" / "train" / f"{index:02d}.jpg", 8, 8)
    (tmp_path / "images" / "autosplit_test.txt").write_text("./old\n")
    assert autosplit(tmp_path / "images" / "train") == {"autosplit_train.txt": 11, "autosplit_val.txt": 1}
    assert (tmp_path / "images" / "autosplit_val.txt").read_text() == "./train/10.jpg\n"
    assert (tmp_path / "images" / "autosplit_train.txt").read_text().splitlines()[:2] == ["./train/00.jpg",
                                                                                           "./train/01.jpg"]
    assert not (tmp_path / "images" / "autosplit_test.txt").exists()
    draws = random.Random(0).choices([0, 1, 2], weights=(0.5, 0.3, 0.2), k=12)
    autosplit(tmp_path / "images" / "train", weights=(0.5, 0.3, 0.2))
    for index, name in enumerate(converters.AUTOSPLIT_FILES):
        expected = [f"./train/{i:02d}.jpg" for i, draw in enumerate(draws) if draw == index]
        listed = tmp_path / "images" / name
        assert (listed.read_text().splitlines() if listed.exists() else []) == expected


def test_autosplit_annotated_only_leaves_out_images_without_labels(tmp_path):
    for index in range(12):
        image(tmp_path / "images" / f"{index:02d}.jpg", 8, 8)
    (tmp_path / "labels").mkdir()
    (tmp_path / "labels" / "03.txt").write_text("")
    assert autosplit(tmp_path / "images", annotated_only=True) == {"autosplit_train.txt": 1}
    assert (tmp_path / "autosplit_train.txt").read_text() == "./images/03.jpg\n"
    with pytest.raises(AnnotationError, match="weights"):
        autosplit(tmp_path / "images", weights=(0, 0, 0))


# ----------------------------------------------------------------------------- xView


def xview_standin(root, features, count=12):
    for index in range(count):
        image(root / "train_images" / f"{index:02d}.tif")
    image(root / "val_images" / "v0.tif")
    (root / "xView_train.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": [
        {"type": "Feature", "properties": properties} for properties in features]}))


XVIEW_FEATURES = [
    {"image_id": "00.tif", "type_id": 11, "bounds_imcoords": "10,5,30,25"},  # class 0
    {"image_id": "00.tif", "type_id": "94", "bounds_imcoords": "90,40,120,60"},  # class 59, clipped to the image
    {"image_id": "00.tif", "type_id": 75, "bounds_imcoords": "1,1,5,5"},  # no class of the 60: left out
    {"image_id": "01.tif", "type_id": 73, "bounds_imcoords": "0,0,50,50"},  # class 48
    {"image_id": "1395.tif", "type_id": 11, "bounds_imcoords": "1,1,5,5"},  # listed, not downloaded
    {"image_id": "02.tif", "type_id": 11, "bounds_imcoords": ""},  # no box: YOLOv5 leaves it out too
]


def test_xview_by_name_asks_for_the_manual_download_in_one_line(tmp_path):
    with pytest.raises(DatasetDownloadError) as raised:
        load_data_config(repo_copy_with(tmp_path, "xView.yaml"))
    message = str(raised.value)
    assert len(message.splitlines()) == 1 and "https://challenge.xviewdataset.org" in message
    assert "put xView/xView_train.geojson into" in message and str(tmp_path / "datasets") in message


def test_xview_by_name_is_converted_in_place_as_yolov5_does(tmp_path, caplog, monkeypatch):
    root = tmp_path / "datasets" / "xView"
    xview_standin(root, XVIEW_FEATURES)
    with caplog.at_level(logging.WARNING):
        config = load_data_config(repo_copy_with(tmp_path, "xView.yaml"))
    assert config.nc == 60 and config.names[0] == "Fixed-wing Aircraft" and config.names[59] == "Tower"
    assert config.train == [str(root / "images" / "autosplit_train.txt")]
    assert (root / "images" / "autosplit_val.txt").read_text() == "./train/10.tif\n"  # YOLOv5's draw of 12
    assert sorted(p.name for p in root.iterdir()) == ["images", "labels", "xView_train.geojson"]
    assert (root / "images" / "val" / "v0.tif").is_file() and len(list((root / "images" / "train").iterdir())) == 12
    assert labels_of(root / "labels" / "train" / "00.txt") == [[0, 0.2, 0.3, 0.2, 0.4], [59, 0.95, 0.9, 0.1, 0.2]]
    assert labels_of(root / "labels" / "train" / "01.txt") == [[48, 0.25, 0.5, 0.5, 1.0]]
    assert sorted(p.name for p in (root / "labels" / "train").iterdir()) == ["00.txt", "01.txt"]
    assert "1 boxes of type ids outside xView's 60 classes left out (75: 1)" in caplog.text
    assert "1 images named in the labels are not in" in caplog.text
    monkeypatch.setattr(converters, "xview_to_yolo", lambda folder: pytest.fail("converted twice"))
    assert load_data_config(tmp_path / "repo" / "data" / "xView.yaml").train == config.train


def test_an_interrupted_xview_conversion_runs_again_from_the_moved_images(tmp_path):
    """Stopped after the images moved (no lists written): the next start reads them from images/train."""
    root = tmp_path / "datasets" / "xView"
    xview_standin(root, XVIEW_FEATURES)
    (root / "images").mkdir()
    (root / "train_images").rename(root / "images" / "train")
    load_data_config(repo_copy_with(tmp_path, "xView.yaml"))
    assert (root / "images" / "autosplit_val.txt").read_text() == "./train/10.tif\n"
    assert labels_of(root / "labels" / "train" / "01.txt") == [[48, 0.25, 0.5, 0.5, 1.0]]


@pytest.mark.parametrize("feature, message", [
    ({"image_id": "../../../escape.tif", "type_id": 11, "bounds_imcoords": "1,1,5,5"}, "not a plain file name"),
    ({"image_id": "00.tif", "type_id": 11, "bounds_imcoords": "1,1,5"}, "expected 4 integers"),
    ({"image_id": "00.tif", "type_id": "car", "bounds_imcoords": "1,1,5,5"}, "expected an integer"),
])
def test_xview_features_that_are_not_data_are_one_line_and_write_nothing(tmp_path, feature, message):
    root = tmp_path / "datasets" / "xView"
    xview_standin(root, [feature])
    with pytest.raises(AnnotationError, match=message) as raised:
        converters.xview_to_yolo(root)
    assert "xView_train.geojson: features[0]" in str(raised.value) and len(str(raised.value).splitlines()) == 1
    assert not (root / "labels").exists() and (root / "train_images").is_dir()
    assert not list(tmp_path.rglob("escape*"))


# ----------------------------------------------------------------------------- Argoverse


def argoverse_standin(root, seq_dir="train/seqA/ring_front_center", val_annotations=None):
    data = root / "Argoverse-1.1" / "tracking"
    for split in ("train", "val", "test"):
        for name in ("f0.jpg", "f1.jpg"):
            image(data / split / "seqA" / "ring_front_center" / name, 16, 10)
    annotations = root / "Argoverse-HD" / "annotations"
    annotations.mkdir(parents=True)
    images = [{"id": 0, "name": "f0.jpg", "sid": 0}, {"id": 1, "name": "f1.jpg", "sid": 0}]
    (annotations / "train.json").write_text(json.dumps({"images": images, "seq_dirs": [seq_dir], "annotations": [
        {"image_id": 0, "category_id": 2, "bbox": [960, 600, 192, 120]},
        {"image_id": 0, "category_id": 0, "bbox": [0, 0, 96, 60]},
        {"image_id": 1, "category_id": 7, "bbox": [1800, 1100, 240, 200]},  # clipped to the frame
        {"image_id": 1, "category_id": 9, "bbox": [0, 0, 10, 10]},  # no class of the 8: left out
    ]}))
    (annotations / "val.json").write_text(json.dumps(val_annotations or {
        "images": [{"id": 0, "name": "f1.jpg", "sid": 0}], "seq_dirs": ["val/seqA/ring_front_center"],
        "annotations": [{"image_id": 0, "category_id": 5, "bbox": [480, 300, 960, 600]}]}))


def test_argoverse_by_name_is_converted_in_place_as_yolov5_does(tmp_path):
    root = tmp_path / "datasets" / "Argoverse"
    with pytest.raises(DatasetDownloadError, match="downloaded by hand .*drive.google.com.*Argoverse-HD/annotations"):
        load_data_config(repo_copy_with(tmp_path / "first", "Argoverse.yaml"))
    argoverse_standin(root)
    config = load_data_config(repo_copy_with(tmp_path, "Argoverse.yaml"))
    data = root / "Argoverse-1.1"
    assert config.nc == 8 and config.val == [str(data / "images" / "val")] and not (data / "tracking").exists()
    labels = data / "labels" / "train" / "seqA" / "ring_front_center"
    assert labels_of(labels / "f0.txt") == [[0, 0.025, 0.025, 0.05, 0.05], [2, 0.55, 0.55, 0.1, 0.1]]
    assert labels_of(labels / "f1.txt") == [[7, 0.96875, pytest.approx(0.958333, abs=1e-6), 0.0625,
                                             pytest.approx(0.083333, abs=1e-6)]]  # clipped to the frame
    assert labels_of(data / "labels" / "val" / "seqA" / "ring_front_center" / "f1.txt") == [[5, 0.5, 0.5, 0.5, 0.5]]
    from utils.data.verify import img2label_paths, list_image_files

    train = list_image_files(config.train)
    assert len(train) == 2 and img2label_paths(train)[0] == str(labels / "f0.txt")  # where the loader looks


def test_argoverse_sequence_folders_cannot_leave_the_labels_folder_and_a_failed_conversion_runs_again(tmp_path):
    root = tmp_path / "datasets" / "Argoverse"
    argoverse_standin(root, seq_dir="../../../../escape")
    with pytest.raises(AnnotationError, match=r"train.json: seq_dirs\[0\]: .* not a relative folder without"):
        load_data_config(repo_copy_with(tmp_path, "Argoverse.yaml"))
    assert not list(tmp_path.rglob("escape")) and (root / "Argoverse-1.1" / "tracking").is_dir()
    (root / "Argoverse-HD" / "annotations" / "train.json").unlink()
    with pytest.raises(AnnotationError, match="train.json: missing"):
        load_data_config(tmp_path / "repo" / "data" / "Argoverse.yaml")
    train = json.loads((tmp_path / "datasets" / "Argoverse" / "Argoverse-HD" / "annotations" / "val.json").read_text())
    train["seq_dirs"] = ["train/seqA/ring_front_center"]
    (root / "Argoverse-HD" / "annotations" / "train.json").write_text(json.dumps(train))
    assert load_data_config(tmp_path / "repo" / "data" / "Argoverse.yaml").nc == 8  # converted this time
    assert (root / "Argoverse-1.1" / "images" / "train").is_dir()


# ----------------------------------------------------------------------------- Objects365


def test_objects365_yaml_lists_yolov5s_archives_with_distinct_staging():
    steps = parse_download(read_yaml(ROOT / "data" / "Objects365.yaml")["download"], "Objects365.yaml")
    archives = [step for step in steps if isinstance(step, dataset_download.Archive)]
    assert len(archives) == 2 + 51 + 44 and len({archive.url for archive in archives}) == len(archives)
    assert sum(archive.into == "Objects365/images/train" for archive in archives) == 51
    assert sum(archive.into == "Objects365/images/val" for archive in archives) == 44
    assert isinstance(steps[-1], dataset_download.Objects365Import)
    assert len(read_yaml(ROOT / "data" / "Objects365.yaml")["names"]) == 365


def test_objects365_archives_are_fetched_flattened_and_labelled(tmp_path, mirror, monkeypatch, caplog):
    """Train and val patches of one file name from different URLs both unpack (a staging folder per URL); the val
    JSON is placed as it is; images at any depth move into images/SPLIT; classes follow the JSON's category
    order; crowd boxes are left out; boxes are clipped to each image's width and height."""
    server = os.environ[downloads.MIRROR_VARIABLE]  # the loopback server, asked by URL: no mirror by file name
    monkeypatch.delenv(downloads.MIRROR_VARIABLE)
    source = tmp_path / "source"
    image(source / "train0" / "images" / "v1" / "patch0" / "t0.jpg")
    image(source / "train1" / "t1.jpg")
    image(source / "val0" / "images" / "v1" / "patch0" / "v0.jpg")
    categories = [{"id": 5, "name": "Person"}, {"id": 2, "name": "Sneakers"}]  # not in id order
    train = {"categories": categories, "images": [
        {"id": 1, "file_name": "images/v1/patch0/t0.jpg", "width": 100, "height": 50},
        {"id": 2, "file_name": "images/v1/patch1/t1.jpg", "width": 100, "height": 50},
        {"id": 3, "file_name": "images/v1/patch9/gone.jpg", "width": 100, "height": 50}], "annotations": [
        {"image_id": 1, "category_id": 2, "bbox": [10, 5, 20, 20], "iscrowd": 0},
        {"image_id": 1, "category_id": 5, "bbox": [90, 40, 30, 20], "iscrowd": 0},
        {"image_id": 1, "category_id": 5, "bbox": [0, 0, 50, 50], "iscrowd": 1},
        {"image_id": 2, "category_id": 5, "bbox": [0, 0, 100, 50], "iscrowd": 0},
        {"image_id": 3, "category_id": 5, "bbox": [0, 0, 1, 1], "iscrowd": 0}]}
    val = {"categories": categories, "images": [{"id": 7, "file_name": "images/v1/patch0/v0.jpg", "width": 100,
                                                 "height": 50}],
           "annotations": [{"image_id": 7, "category_id": 5, "bbox": [25, 12.5, 50, 25], "iscrowd": 0}]}
    (source / "annotations").mkdir()
    (source / "annotations" / "zhiyuan_objv2_train.json").write_text(json.dumps(train))
    Files.files = {"/o/train/zhiyuan_objv2_train.tar.gz": tar_folder(source / "annotations", ".")}
    Files.files["/o/train/patch0.tar.gz"] = tar_folder(source / "train0", "patch0")
    Files.files["/o/train/patch1.tar.gz"] = tar_folder(source / "train1", "patch1")
    Files.files["/o/val/zhiyuan_objv2_val.json"] = json.dumps(val).encode()
    Files.files["/o/val/images/v1/patch0.tar.gz"] = tar_folder(source / "val0", "patch0")
    base = f"{server}/o"
    download = [{"url": f"{base}/train/zhiyuan_objv2_train.tar.gz", "into": "Objects365"},
                {"url": f"{base}/train/patch0.tar.gz", "into": "Objects365/images/train"},
                {"url": f"{base}/train/patch1.tar.gz", "into": "Objects365/images/train"},
                {"url": f"{base}/val/zhiyuan_objv2_val.json", "into": "Objects365"},
                {"url": f"{base}/val/images/v1/patch0.tar.gz", "into": "Objects365/images/val"},
                {"objects365": "Objects365"}]
    root = tmp_path / "datasets" / "Objects365"
    with caplog.at_level(logging.WARNING):
        ensure_downloaded(root, download, "Objects365.yaml", ["Person", "Shoe"])
    assert sorted(p.name for p in (root / "images" / "train").iterdir()) == ["t0.jpg", "t1.jpg"]
    assert sorted(p.name for p in (root / "images" / "val").iterdir()) == ["v0.jpg"]
    assert labels_of(root / "labels" / "train" / "t0.txt") == [[0, 0.95, 0.9, 0.1, 0.2], [1, 0.2, 0.3, 0.2, 0.4]]
    assert labels_of(root / "labels" / "train" / "t1.txt") == [[0, 0.5, 0.5, 1.0, 1.0]]
    assert labels_of(root / "labels" / "val" / "v0.txt") == [[0, 0.5, 0.5, 0.5, 0.5]]
    assert not (root / "labels" / "train" / "gone.txt").exists()
    assert "1 images with annotations are not in" in caplog.text and "class 1: 'Sneakers' against 'Shoe'" in caplog.text
    assert not (tmp_path / "datasets" / ".Objects365.download").exists()


def test_objects365_with_another_number_of_categories_is_refused(tmp_path):
    root = tmp_path / "Objects365"
    image(root / "images" / "train" / "a.jpg")
    image(root / "images" / "val" / "b.jpg")
    for split in ("train", "val"):
        (root / f"zhiyuan_objv2_{split}.json").write_text(json.dumps(
            {"categories": [{"id": 1, "name": "Person"}], "images": [], "annotations": []}))
    with pytest.raises(AnnotationError, match="1 categories, but the YAML names 2 classes"):
        converters.objects365_to_yolo(root, ["Person", "Car"])


def test_the_import_tool_autosplits_and_converts(tmp_path, capsys):
    from tools import import_dataset

    for index in range(12):
        image(tmp_path / "images" / f"{index}.png", 8, 8)
    assert import_dataset.main(["autosplit", str(tmp_path / "images")]) == 0
    assert "autosplit_train.txt 11, autosplit_val.txt 1" in capsys.readouterr().out
    assert (tmp_path / "autosplit_val.txt").read_text() == "./images/8.png\n"  # the 11th in path order, as YOLOv5
    xview_standin(tmp_path / "xView", XVIEW_FEATURES[:1])
    assert import_dataset.main(["xview", str(tmp_path / "xView")]) == 0
    assert "imported xview: 60 classes, images: train 1, boxes 1" in capsys.readouterr().out
    assert import_dataset.main(["argoverse", str(tmp_path / "none")]) == 1
    assert "expected Argoverse-HD's" in capsys.readouterr().err
