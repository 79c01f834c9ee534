"""Outputs stay in their folder: a model's class names used as folder names (detect.py --save-crop), files in
run folders written without following symbolic links (results.csv, its temp file, the torchrun launch
marker, the run folder's lock), and disk-cache names that cannot collide."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import detect
from tests.conftest import TINY_MODEL_YAML
from utils.errors import WriteError
from utils.files import NotRegularFile, read_regular
from utils.loggers import RESULTS_KEYS, CSVLogger, NDJSONLogger
from utils.paths import OutsideFolderError, crop_folder, inside, safe_component, symlinks_in


def files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------- class names as folder names

def test_class_names_become_one_safe_component():
    cases = {"person": "person", "traffic light": "traffic light", "../../x": "_.._x", "/abs/x": "_abs_x",
             "..": "7", ".": "7", "": "7", "   ": "7", "a\\b": "a_b", "a\x00b": "a_b", "C:x": "C_x",
             ".hidden": "hidden", "x" * 500: "x" * 100, "line\nbreak": "line_break"}
    for name, expected in cases.items():
        assert safe_component(name, "7") == expected, name
    assert safe_component(["not", "a", "string"], "3") == "3"
    assert safe_component(None, "3") == "3"


def test_crop_folders_resolve_inside_the_run_folder(tmp_path):
    run = tmp_path / "runs" / "detect" / "exp"
    names = ["../../x", str(tmp_path / "abs"), "..", "ok"]
    folders = [crop_folder(run, names, index) for index in range(len(names))]
    assert [f.name for f in folders] == ["_.._x", safe_component(names[1], "1"), "2", "ok"]
    assert all(f.parent == run / "crops" for f in folders)
    assert crop_folder(run, names, 9).name == "9"  # an index without a name
    (run / "crops").mkdir(parents=True)
    (run / "crops" / "linked").symlink_to(tmp_path)  # e.g. planted in a reused (--exist-ok) folder
    with pytest.raises(OutsideFolderError, match="outside"):
        crop_folder(run, ["linked"], 0)
    assert inside(run, "a", "b") == run / "a" / "b"


@pytest.fixture(scope="module")
def hostile_weights(tmp_path_factory):
    """The tiny model (nc=2) whose class names are a relative path up and an absolute path; anchor 0 predicts
    class 0 and anchor 1 class 1 everywhere, so both names are used."""
    from models.yolo import DetectionModel
    from utils.checkpoint import model_state, save_checkpoint

    root = tmp_path_factory.mktemp("hostile")
    cfg = root / "tiny.yaml"
    cfg.write_text(TINY_MODEL_YAML)
    torch.manual_seed(0)
    model = DetectionModel(cfg, nc=2)
    model.names = ["../../escaped", str(root / "absolute_target")]
    detect_layer = model.model[-1]
    with torch.no_grad():
        for conv in detect_layer.m:
            bias = conv.bias.view(detect_layer.na, -1)
            bias[:, 4] += 12.0
            bias[0, 5], bias[0, 6], bias[1, 5], bias[1, 6] = 12.0, -12.0, -12.0, 12.0
    path = root / "weights" / "hostile.pt"
    save_checkpoint({"model": model_state(model), "ema": None}, path)
    return root, path


def test_save_crop_with_hostile_class_names_stays_in_the_run_folder(hostile_weights, tmp_path):
    root, weights = hostile_weights
    image = np.full((64, 80, 3), 90, np.uint8)
    cv2.rectangle(image, (10, 10), (50, 40), (0, 0, 255), -1)
    source = tmp_path / "images" / "picture.jpg"
    source.parent.mkdir()
    cv2.imwrite(str(source), image)
    project = tmp_path / "a" / "b" / "runs"
    before = files_under(tmp_path) | files_under(root)
    assert detect.main(["--weights", str(weights), "--source", str(source), "--imgsz", "64", "--device", "cpu",
                        "--save-crop", "--nosave", "--max-det", "300", "--project", str(project), "--amp", "off"]) == 0
    run = project / "exp"
    new = (files_under(tmp_path) | files_under(root)) - before
    assert new and all(p.is_relative_to(run) for p in new), sorted(map(str, new - files_under(run)))[:5]
    folders = {p.parent.name for p in new if p.suffix == ".jpg"}
    assert folders == {"_.._escaped", safe_component(str(root / "absolute_target"), "1")}
    assert not (root / "absolute_target").exists()


# ---------------------------------------------------------------------- files in run folders

@pytest.mark.parametrize("name, make_logger, lines", [
    ("results.csv", CSVLogger, 2),  # header and row
    ("results.ndjson", lambda run: NDJSONLogger(run, file=True), 1),  # --ndjson-file
])
def test_results_files_are_never_written_through_a_link(tmp_path, name, make_logger, lines):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    # links where a temp file or the file itself would be written (the old fixed temp name, and this one's)
    (run / f".{name}.tmp").symlink_to(outside)
    (run / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp").symlink_to(outside)
    (run / name).symlink_to(outside)
    row = {"epoch": 0, **{key: 0.5 for key in RESULTS_KEYS}}
    logger = make_logger(run)
    logger.rewrite([row])
    assert outside.read_text() == "precious\n"
    assert not (run / name).is_symlink() and len((run / name).read_text().splitlines()) == lines
    (run / name).unlink()
    (run / name).symlink_to(outside)
    with pytest.raises(WriteError, match="symbolic link"):
        logger.log(1, row)
    assert outside.read_text() == "precious\n"


def test_launch_marker_is_written_and_read_without_following_links(tmp_path):
    from utils.trainer.resume import LAUNCH_MARKER, mark_folder, marked_folder

    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    project = tmp_path / "runs"
    run = project / "exp"
    run.mkdir(parents=True)
    (run / LAUNCH_MARKER).symlink_to(outside)
    mark_folder(run, "launch-1")
    assert outside.read_text() == "precious\n" and not (run / LAUNCH_MARKER).is_symlink()
    assert marked_folder(project, "launch-1") == run
    # markers that are links (to a file holding the id, or to a device that never ends) or FIFOs are no markers
    linked, fifo = project / "linked", project / "fifo"
    linked.mkdir()
    fifo.mkdir()
    (tmp_path / "id.txt").write_text("launch-2\n")
    (linked / LAUNCH_MARKER).symlink_to(tmp_path / "id.txt")
    (project / "zero").mkdir()
    (project / "zero" / LAUNCH_MARKER).symlink_to("/dev/zero")
    os.mkfifo(fifo / LAUNCH_MARKER)
    assert marked_folder(project, "launch-2") is None  # returns at once: nothing followed, nothing blocks
    with pytest.raises(NotRegularFile, match="not a regular file"):
        read_regular(fifo / LAUNCH_MARKER, 512)
    assert read_regular(tmp_path / "id.txt", 512) == b"launch-2\n"


def test_lock_file_link_is_refused(tmp_path):
    from utils.trainer.resume import LOCK_NAME, lock_run_folder

    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).symlink_to(outside)
    with pytest.raises(WriteError, match=f"could not write {run / LOCK_NAME}: it is a symbolic link"):
        lock_run_folder(run)
    assert outside.read_text() == "precious\n"


def test_symlinks_in_lists_the_run_folder_and_weights_links(tmp_path):
    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    (run / "results.png").symlink_to(tmp_path)
    (run / "weights" / "best.pt").symlink_to(tmp_path / "x")
    (run / "plain.txt").write_text("x")
    assert symlinks_in(run) == ["results.png", "weights/best.pt"]
    (tmp_path / "other").mkdir()
    linked = tmp_path / "linked-run"
    linked.mkdir()
    (linked / "weights").symlink_to(tmp_path / "other")
    assert symlinks_in(linked) == ["weights"]


# ---------------------------------------------------------------------- --cache disk names

def test_disk_cache_names_do_not_collide(tmp_path, monkeypatch):
    """a.jpg and a.png of one folder each keep their own pixels in the --cache disk store (one file per split in
    the user cache folder, indexed by image: no per-image names that could collide), and nothing is written
    beside the images."""
    from utils.data.dataset import LabelSet, YoloDataset
    from utils.data.images import read_image

    monkeypatch.setenv("YOLO_TRAINER_CACHE", str(tmp_path / "cache"))
    images = tmp_path / "images"
    images.mkdir()
    red, green = np.zeros((8, 8, 3), np.uint8), np.zeros((8, 8, 3), np.uint8)
    red[..., 2], green[..., 1] = 255, 255
    cv2.imwrite(str(images / "a.jpg"), red)
    cv2.imwrite(str(images / "a.png"), green)
    files = [str(images / "a.jpg"), str(images / "a.png")]
    split = LabelSet(files, [np.zeros((0, 5), np.float32)] * 2, np.array([[8, 8], [8, 8]]))
    dataset = YoloDataset(split, imgsz=8, cache="disk")
    for i, file in enumerate(files):
        assert np.array_equal(dataset.store[i], read_image(file))
    assert sorted(p.name for p in images.iterdir()) == ["a.jpg", "a.png"]
