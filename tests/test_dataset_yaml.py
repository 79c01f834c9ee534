"""Dataset YAML loading: resolution of path and splits, names/nc, download key, error messages."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from utils.data import dataset_yaml
from utils.data.dataset_yaml import DataConfigError, load_data_config


def make_dataset(root: Path, splits=("train", "val")) -> None:
    for split in splits:
        (root / "images" / split).mkdir(parents=True)


def write_yaml(folder: Path, text: str, name: str = "data.yaml") -> Path:
    file = folder / name
    file.write_text(text)
    return file


def test_relative_path_resolves_against_yaml_folder(tmp_path, monkeypatch):
    make_dataset(tmp_path / "ds")
    file = write_yaml(tmp_path, "path: ds\ntrain: images/train\nval: [images/val]\nnames: [a, b]\n")
    monkeypatch.chdir("/")  # the YAML's folder counts, not the working directory
    config = load_data_config(file)
    assert config.path == tmp_path / "ds"
    assert config.train == [str(tmp_path / "ds" / "images" / "train")]
    assert config.val == [str(tmp_path / "ds" / "images" / "val")]
    assert config.test == []
    assert config.names == ["a", "b"] and config.nc == 2
    assert config.yaml_file == file


def test_a_roboflow_export_finds_its_dot_dot_splits_beside_its_yaml(tmp_path, caplog):
    """Roboflow's YOLOv5 export: data.yaml beside train/, valid/, test/, naming ../train/images. A '../' path that
    is not there is looked for without it, as YOLOv5 does; one that is there is used as written."""
    export = tmp_path / "export"
    for split in ("train", "valid", "test"):
        (export / split / "images").mkdir(parents=True)
    (tmp_path / "test" / "images").mkdir(parents=True)  # a real ../test/images: taken as written
    file = write_yaml(export, "train: ../train/images\nval: ../valid/images\ntest: ../test/images\nnc: 1\n"
                              "names: ['cell']\n")
    with caplog.at_level(logging.INFO):
        config = load_data_config(file)
    assert config.train == [str(export / "train" / "images")] and config.val == [str(export / "valid" / "images")]
    assert config.test == [str(tmp_path / "test" / "images")]
    assert "a '../' path taken from the dataset folder, as YOLOv5 does" in caplog.text
    with pytest.raises(DataConfigError, match=r"val: .*/valid/images does not exist"):
        load_data_config(write_yaml(export, "train: ../train/images\nval: ../../valid/images\nnames: [a]\n", "b.yaml"))


def test_path_defaults_to_yaml_folder_and_accepts_lists_and_txt(tmp_path):
    make_dataset(tmp_path, ("train", "extra", "val"))
    (tmp_path / "test.txt").write_text("images/val/a.jpg\n")
    file = write_yaml(tmp_path, "train: [images/train, images/extra]\nval: images/val\ntest: test.txt\n"
                                "names: {0: cat, 1: dog, 2: bird}\nnc: 3\n")
    config = load_data_config(file)
    assert config.path == tmp_path
    assert config.train == [str(tmp_path / "images" / "train"), str(tmp_path / "images" / "extra")]
    assert config.test == [str(tmp_path / "test.txt")]
    assert config.names == ["cat", "dog", "bird"] and config.nc == 3
    assert config.split("test") == config.test


def test_absolute_split_path(tmp_path):
    make_dataset(tmp_path / "elsewhere")
    file = write_yaml(tmp_path, f"path: {tmp_path / 'elsewhere'}\ntrain: {tmp_path / 'elsewhere/images/train'}\n"
                                "val: images/val\nnames: [x]\n")
    config = load_data_config(file)
    assert config.train == [str(tmp_path / "elsewhere" / "images" / "train")]


def test_missing_split_folder_names_file_key_and_path(tmp_path):
    make_dataset(tmp_path, ("train",))
    file = write_yaml(tmp_path, "path: .\ntrain: images/train\nval: images/val\nnames: [a]\n")
    with pytest.raises(DataConfigError) as error:
        load_data_config(file)
    message = str(error.value)
    assert message == f"{file}: val: {tmp_path / 'images' / 'val'} does not exist"
    assert "\n" not in message


@pytest.mark.parametrize("text, expected", [
    ("train: images/train\nnames: [a]\n", "val: missing"),
    ("train: images/train\nval: images/val\n", "names: missing"),
    ("train: images/train\nval: images/val\nnames: [a, b]\nnc: 3\n", "nc: 3 does not agree with names (2 names)"),
    ("train: images/train\nval: images/val\nnames: {0: a, 2: b}\n", "names: ids must be 0..1"),
    ("train: images/train\nval: images/val\nnames: []\n", "names: empty"),
    ("train: images/train\nval: images/val\nnames: [a]\nnc: two\n", "nc: expected a positive integer"),
    ("path: nowhere\ntrain: images/train\nval: images/val\nnames: [a]\n", "path: "),
    ("- just\n- a list\n", "expected a mapping"),
    ("train: [unclosed\n", "invalid YAML"),
])
def test_config_errors(tmp_path, text, expected):
    make_dataset(tmp_path)
    file = write_yaml(tmp_path, text)
    with pytest.raises(DataConfigError, match=None) as error:
        load_data_config(file)
    assert expected in str(error.value)
    assert str(error.value).startswith(str(file))


def test_nc_without_names_gives_numbered_names(tmp_path):
    make_dataset(tmp_path)
    config = load_data_config(write_yaml(tmp_path, "train: images/train\nval: images/val\nnc: 2\n"))
    assert config.names == ["0", "1"] and config.nc == 2


def test_download_code_is_never_run(tmp_path):
    """A dataset that is there: its download: is not needed. One that is missing: a script is refused in one
    line (only archives listed as data are fetched: tests/test_dataset_download.py); nothing is run either way."""
    from utils.data.dataset_download import DatasetDownloadError

    make_dataset(tmp_path)
    marker = tmp_path / "executed"
    code = f"download: |\n  import pathlib; pathlib.Path('{marker}').touch()\n"
    assert load_data_config(write_yaml(tmp_path, "train: images/train\nval: images/val\nnames: [a]\n" + code))
    missing = write_yaml(tmp_path, "path: ../gone\ntrain: images/train\nval: images/val\nnames: [a]\n" + code)
    with pytest.raises(DatasetDownloadError, match="scripts in a dataset YAML are never run") as error:
        load_data_config(missing)
    assert "\n" not in str(error.value) and not marker.exists() and not (tmp_path.parent / "gone").exists()
    from utils.data.dataset_download import parse_download

    with pytest.raises(DatasetDownloadError, match="only .zip and tar archives"):  # the name kept is evil.py
        parse_download("https://example.org/evil.py#.zip", "x.yaml")
    with pytest.raises(DatasetDownloadError, match="only .zip and tar archives"):
        parse_download("https://example.org/evil.py?x=.zip", "x.yaml")
    assert len(parse_download("https://example.org/set.zip?token=1#part", "x.yaml")) == 1


def test_yaml_tags_are_not_constructed(tmp_path):
    make_dataset(tmp_path)
    file = write_yaml(tmp_path, "train: !!python/object/apply:os.system ['true']\nval: images/val\nnames: [a]\n")
    with pytest.raises(DataConfigError, match="invalid YAML"):
        load_data_config(file)


def test_bare_name_found_in_repo_data_folder(tmp_path, monkeypatch):
    make_dataset(tmp_path / "ds")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_yaml(data_dir, f"path: {tmp_path / 'ds'}\ntrain: images/train\nval: images/val\nnames: [a]\n", "mine.yaml")
    monkeypatch.setattr(dataset_yaml, "DATA_DIR", data_dir)
    monkeypatch.chdir(tmp_path)
    assert load_data_config("mine").yaml_file == data_dir / "mine.yaml"
    assert load_data_config("mine.yaml").nc == 1
    with pytest.raises(DataConfigError, match="not found"):
        load_data_config("absent.yaml")


def test_badinputs_yaml(badinputs):
    file = badinputs / "data.yaml"  # "path: ." is the YAML's own folder
    config = load_data_config(file)
    assert config.names == ["RBC", "WBC", "Platelets"] and config.nc == 3
    assert config.train == [str(file.parent / "images" / "train")]
    assert config.test == []


LAUGHS = "[&a0 [x, x, x, x, x, x, x, x, x, x]" + "".join(
    f", &a{k} [" + ", ".join([f"*a{k - 1}"] * 10) + "]" for k in range(1, 9)) + "]"  # 10^9 strings expanded


@pytest.mark.parametrize("text, expected", [
    (f"names: {LAUGHS}\n", "invalid YAML (document too large once aliases are expanded (more than 1,000,000 nodes))"),
    (f"names: [a]\nnc: {LAUGHS}\n", "invalid YAML (document too large once aliases are expanded"),
    ("nc: 100000000\n", "nc: expected a positive integer (at most 100000), got 100000000"),
    ("names: [[1, 2], {a: b}, null]\n", "names: class 0 must be a string, got [1, 2]"),
    ("names: [a, null]\n", "names: class 1 must be a string, got None"),
    ("names: [a, true]\n", "names: class 1 must be a string, got True"),
    ("names: [a, '']\n", "names: class 1 must have 1 to 256 characters, got ''"),
    (f"names: [a, {'b' * 300}]\n", "names: class 1 must have 1 to 256 characters, got 'bbbb"),
    ("names: [a]\ntest: \"images\\0/x\"\n", "test: not a usable path (control characters, or longer than 4096 "
                                             "characters): 'images\\x00/x'"),
    ("names: [a]\ntest: [[images/val]]\n", "test: expected a path, got ['images/val']"),
])
def test_hostile_values_are_refused_with_short_messages(tmp_path, text, expected):
    make_dataset(tmp_path)
    file = write_yaml(tmp_path, "train: images/train\nval: images/val\n" + text)
    with pytest.raises(DataConfigError) as error:
        load_data_config(file)
    message = str(error.value)
    assert message.startswith(f"{file}: ") and expected in message and len(message) < 300 + len(str(file))


def test_numeric_class_names_are_used_as_text_with_a_warning(tmp_path, caplog):
    make_dataset(tmp_path)
    file = write_yaml(tmp_path, "train: images/train\nval: images/val\nnames: [0, 1, two, 3.5]\n")
    with caplog.at_level(logging.WARNING):
        config = load_data_config(file)
    assert config.names == ["0", "1", "two", "3.5"]
    assert "3 class name(s) given as numbers, used as text (e.g. class 0: '0')" in caplog.text


def roboflow_export(folder: Path) -> Path:
    """Roboflow's YOLOv5 export layout: data.yaml naming ../train/images beside train/, valid/ (one image each)."""
    import cv2
    import numpy as np

    for split in ("train", "valid"):
        (folder / split / "images").mkdir(parents=True)
        (folder / split / "labels").mkdir(parents=True)
        cv2.imwrite(str(folder / split / "images" / "a.jpg"), np.full((32, 48, 3), 90, np.uint8))
        (folder / split / "labels" / "a.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    (folder / "data.yaml").write_text("train: ../train/images\nval: ../valid/images\nnc: 1\nnames: ['cell']\n")
    (folder / "__MACOSX").mkdir()
    (folder / "__MACOSX" / "._data.yaml").write_bytes(b"\0\5\26\7")  # a macOS zip's resource fork: never the YAML
    return folder


@pytest.mark.parametrize("kind", ["zip", "gztar"])
def test_a_dataset_archive_is_unpacked_once_beside_the_repository_as_yolov5_takes_it(tmp_path, monkeypatch, kind,
                                                                                      caplog):
    """--data export.zip (or .tar.gz): unpacked into DATASETS_DIR/export, checked as any archive, and the YAML inside
    read from its own folder; the second use takes the folder as it is."""
    import shutil

    from utils.data import dataset_download

    monkeypatch.setattr(dataset_yaml, "DATASETS_DIR", tmp_path / "datasets")
    archive = Path(shutil.make_archive(str(tmp_path / "export"), kind, roboflow_export(tmp_path / "made")))
    config = load_data_config(archive)
    root = tmp_path / "datasets" / "export"
    assert config.path == root and config.yaml_file == root / "data.yaml" and config.names == ["cell"]
    assert config.train == [str(root / "train" / "images")] and config.val == [str(root / "valid" / "images")]
    for unpack in ("extract_zip", "extract_tar"):
        monkeypatch.setattr(dataset_download, unpack, lambda *args: pytest.fail("unpacked twice"))
    assert load_data_config(archive).train == config.train
    assert sorted(p.name for p in (tmp_path / "datasets").iterdir()) == [".export.download.lock",
                                                                         ".export.unpacked-from", "export"]
    os.utime(archive, ns=(0, 0))  # the archive changed (a new export): said, and the folder left as it is
    with caplog.at_level(logging.WARNING):
        assert load_data_config(archive).train == config.train
    assert f"{archive} changed since it was unpacked into {root}" in caplog.text


def test_a_dataset_archive_without_a_yaml_or_with_an_escaping_member_is_one_line(tmp_path, monkeypatch):
    import zipfile

    from utils.data.dataset_download import DatasetDownloadError

    monkeypatch.setattr(dataset_yaml, "DATASETS_DIR", tmp_path / "datasets")
    with zipfile.ZipFile(tmp_path / "empty.zip", "w") as out:
        out.writestr("images/a.txt", "x")
    with pytest.raises(DatasetDownloadError, match=r"empty.zip: holds no dataset YAML \(unpacked into .*empty\)"):
        load_data_config(tmp_path / "empty.zip")
    with zipfile.ZipFile(tmp_path / "bad.zip", "w") as out:
        out.writestr("data.yaml", "train: .\nval: .\nnames: [a]\n")
        out.writestr("../../escape.txt", "x")
    with pytest.raises(DatasetDownloadError, match="bad.zip.*outside"):
        load_data_config(tmp_path / "bad.zip")
    assert not (tmp_path / "datasets" / "bad").exists() and not list(tmp_path.rglob("escape.txt"))
    assert not list((tmp_path / "datasets").glob(".*.download"))
