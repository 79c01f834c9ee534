"""Label discovery, verification of every bad input (generated; ../shared's CASES.md too when present), the non-pickle
cache, the check tool."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.conftest import shared_path
from tools import check_dataset
from utils.data import verify
from utils.data.images import read_image
from utils.data.verify import DatasetError, img2label_paths, list_image_files, scan_split
from utils.files import read_ahead

# CASES.md file -> (outcome, boxes kept or reason fragment); "used" with None = as many boxes as label rows
TRAIN_CASES = {
    "zero_bytes.jpg": ("skipped", "empty image file"),
    "truncated.jpg": ("skipped", "cannot decode"),
    "not_an_image.jpg": ("skipped", "not an image"),
    "html_named_png.png": ("skipped", "not an image"),
    "class_out_of_range.jpg": ("skipped", "class 7 out of range (data has 3 classes)"),
    "negative_class.jpg": ("skipped", "negative class id"),
    "pixel_coords.jpg": ("skipped", "not normalised (> 1"),
    "negative_coords.jpg": ("skipped", "negative coordinates"),
    "nan_coords.jpg": ("skipped", "non-finite value"),
    "text_in_label.jpg": ("skipped", "unparsable label line"),
    "four_columns.jpg": ("skipped", "wrong number of columns"),
    "tiny_1x1.png": ("skipped", "image too small"),
    "duplicate_rows.jpg": ("used", 2),
    "empty_label.jpg": ("background", 0),
    "whitespace_label.jpg": ("background", 0),
    "no_label_file.jpg": ("background", 0),
    "crlf_trailing_spaces.jpg": ("used", 2),
    "zero_size_box.jpg": ("used", 1),
    "polygon_segment.jpg": ("used", 1),
    "box_past_edge.jpg": ("used", 1),
    "very_wide.jpg": ("used", 1),
    "notes.txt": ("ignored", None),
    ".hidden.jpg": ("ignored", None),
    **{name: ("used", None) for name in ("gray.png", "rgba.png", "sixteen_bit.png", "UPPER_CASE.JPG", "bitmap.bmp",
                                         "webp_image.webp", "tiff_image.tif", "name with spaces é.jpg",
                                         "exif_rotated.jpg")},
    **{f"good_{i:02d}.jpg": ("used", None) for i in range(12)},
}
VAL_CASES = {f"good_{i:02d}.jpg": ("used", None) for i in range(6)}


def scan_bad_train(root: Path, cache_dir: Path):
    return scan_split([str(root / "images" / "train")], nc=3, prefix="train: ", cache_dir=cache_dir)


@pytest.fixture(scope="module")
def bad_train(badinputs, tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("label-cache")
    return badinputs, scan_bad_train(badinputs, cache_dir), cache_dir


def label_rows(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def by_name(result) -> dict[str, int]:
    return {Path(f).name: i for i, f in enumerate(result.im_files)}


def check_case(root: Path, result, name: str) -> None:
    """``name`` of images/train had the outcome TRAIN_CASES gives it."""
    outcome, expected = TRAIN_CASES[name]
    index = by_name(result).get(name)
    problems = [p for p in result.problems if Path(p["file"]).name == name]
    if outcome == "skipped":
        assert index is None, f"{name} should be skipped"
        assert len(problems) == 1 and problems[0]["action"] == "skipped", (name, problems)
        assert expected in problems[0]["detail"], (name, problems[0]["detail"])
    elif outcome == "ignored":
        assert index is None, f"{name} should be ignored"
    else:
        assert index is not None, f"{name} should be used"
        labels = result.labels[index]
        assert labels.dtype == np.float32 and labels.shape[1] == 5
        rows = label_rows(root / "labels" / "train" / (Path(name).stem + ".txt")) if expected is None else expected
        assert len(labels) == rows, name
        assert ((labels[:, 1:] >= 0) & (labels[:, 1:] <= 1)).all(), name
        height, width = read_image(result.im_files[index]).shape[:2]
        assert tuple(result.shapes[index]) == (width, height), name


def check_stats_and_warnings(root: Path, result, cache_dir: Path, caplog) -> None:
    assert result.stats["corrupt"] == 12 and result.stats["duplicates"] == 1
    assert result.stats["missing"] == 1 and result.stats["empty"] == 2
    assert result.stats["images"] == len(result.im_files) == 30
    assert result.shapes.dtype == np.int64 and result.shapes.shape == (30, 2)
    caplog.clear()
    with caplog.at_level(logging.INFO):  # a second scan: cache hit, same warnings and summary
        again = scan_bad_train(root, cache_dir)
    assert again.im_files == result.im_files
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("class_out_of_range.jpg" in w and "class 7 out of range (data has 3 classes)" in w for w in warnings)
    assert sum("zero_bytes.jpg" in w for w in warnings) == 1
    assert any(w.endswith("... 30 images, 3 backgrounds, 12 corrupt, 1 duplicate removed") for w in caplog.messages)


def check_geometry(result) -> None:
    """The polygon is boxed, the box past the edge clipped, the EXIF-rotated JPEG upright like its source."""
    from PIL import Image

    names = by_name(result)
    polygon = names["polygon_segment.jpg"]
    np.testing.assert_allclose(result.labels[polygon], [[2, 0.21, 0.25, 0.22, 0.30]], atol=1e-6)
    assert len(result.segments[polygon]) == 1 and result.segments[polygon][0].shape == (4, 2)
    assert result.segments[names["good_00.jpg"]] == []
    np.testing.assert_allclose(result.labels[names["box_past_edge.jpg"]], [[0, 0.925, 0.5, 0.15, 0.2]], atol=1e-6)
    rotated, source = names["exif_rotated.jpg"], names["bitmap.bmp"]
    with Image.open(result.im_files[rotated]) as stored:
        assert stored.getexif().get(0x0112) == 6 and stored.size[::-1] == tuple(result.shapes[source])
    assert tuple(result.shapes[rotated]) == tuple(result.shapes[source])
    assert result.shapes[source][0] != result.shapes[source][1]  # a quarter turn shows in the shape
    np.testing.assert_array_equal(result.labels[rotated], result.labels[source])
    pixels = read_image(result.im_files[rotated]).astype(np.float32)
    assert np.abs(pixels - read_image(result.im_files[source])).mean() < 3


def test_generated_badinputs_hold_every_case(badinputs):
    train = {p.name for p in (badinputs / "images" / "train").iterdir()}
    assert train == set(TRAIN_CASES)
    assert {p.name for p in (badinputs / "images" / "val").iterdir()} == set(VAL_CASES)
    total = sum(p.stat().st_size for p in badinputs.rglob("*") if p.is_file())
    assert total < 1_000_000, total  # small: made in a blink, at every run


@pytest.mark.parametrize("name", sorted(TRAIN_CASES))
def test_train_case(bad_train, name):
    root, result, _ = bad_train
    check_case(root, result, name)


def test_val_split_all_used(badinputs):
    result = scan_split(str(badinputs / "images" / "val"), nc=3, use_cache=False)
    assert sorted(Path(f).name for f in result.im_files) == sorted(VAL_CASES)
    assert result.stats["corrupt"] == 0 and not result.problems


def test_badinputs_stats_and_warnings(bad_train, caplog):
    check_stats_and_warnings(*bad_train, caplog)


def test_read_only_dataset_uses_fallback_cache(bad_train):
    root, _, cache_dir = bad_train
    assert not (root / "labels" / "train.cache.npz").exists()
    assert len(list(Path(cache_dir).glob("*.npz"))) == 1


def test_polygon_box_past_edge_and_exif_rotation(bad_train):
    check_geometry(bad_train[1])


def test_shared_badinputs_behave_as_cases_md_says(tmp_path, caplog):
    """The same expectations on ../shared's bad-input files (made by other tools), when present."""
    root = shared_path("datasets", "badinputs", why="the same checks on files made by other tools; the generated "
                       "dataset above covers every case")
    rows = re.findall(r"^\| (train|val) \| `([^`]+)` \|", (root / "CASES.md").read_text(), flags=re.M)
    assert len(rows) >= 40
    for split, name in rows:
        assert name in (TRAIN_CASES if split == "train" else VAL_CASES), f"{split}/{name} has no expectation"
    result = scan_bad_train(root, tmp_path)
    for name in TRAIN_CASES:
        check_case(root, result, name)
    check_stats_and_warnings(root, result, tmp_path, caplog)
    check_geometry(result)
    assert not (root / "labels" / "train.cache.npz").exists()
    assert check_dataset.main(["--data", str(root / "data.yaml"), "--cache-dir", str(tmp_path / "tool")]) == 1


# ----------------------------------------------------------------------------- synthetic datasets
def make_split(root: Path, rows: dict[str, str], size=(40, 32)) -> Path:
    """images/train/<name>.jpg + labels/train/<name>.txt (None -> no label file)."""
    images, labels = root / "images" / "train", root / "labels" / "train"
    images.mkdir(parents=True, exist_ok=True)
    labels.mkdir(parents=True, exist_ok=True)
    for index, (name, text) in enumerate(rows.items()):
        image = np.full((size[1], size[0], 3), 40 * index % 255, np.uint8)
        cv2.imwrite(str(images / f"{name}.jpg"), image)
        if text is not None:
            (labels / f"{name}.txt").write_text(text)
    return images


def test_img2label_paths_uses_last_images_folder():
    assert img2label_paths(["/d/images/x/images/a.b.jpg"]) == ["/d/images/x/labels/a.b.txt"]
    assert img2label_paths(["/d/pictures/a.PNG"]) == ["/d/pictures/a.txt"]


def test_list_image_files(tmp_path, caplog):
    images = make_split(tmp_path, {"a": "", "b": ""})
    (images / "sub").mkdir()
    cv2.imwrite(str(images / "sub" / "C.PNG"), np.zeros((12, 12, 3), np.uint8))
    (images / ".hidden.jpg").write_bytes(b"")
    (images / "readme.md").write_text("x")
    listing = tmp_path / "list.txt"
    listing.write_text("images/train/a.jpg\n\n./images/train/sub/C.PNG\n")
    with caplog.at_level(logging.WARNING):
        files = list_image_files([str(images)])
    assert [Path(f).name for f in files] == ["a.jpg", "b.jpg", "C.PNG"]  # sorted by full path
    assert ".hidden.jpg" in caplog.text
    assert list_image_files(str(listing)) == sorted([str(images / "a.jpg"), str(images / "sub" / "C.PNG")])


def test_linked_folders_are_listed_once_each_as_yolov5s_glob_follows_them(tmp_path):
    """A split merged from linked folders (images/train/part -> elsewhere) trains on all of them; a link back up
    and a second link to the same folder add nothing (no loop, no image twice)."""
    images = make_split(tmp_path, {"a": ""})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cv2.imwrite(str(elsewhere / "b.jpg"), np.zeros((12, 12, 3), np.uint8))
    (images / "part").symlink_to(elsewhere, target_is_directory=True)
    (images / "part-again").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / "loop").symlink_to(images, target_is_directory=True)
    files = list_image_files([str(images)])
    assert [Path(f).name for f in files] == ["a.jpg", "b.jpg"] and Path(files[1]).parent.name.startswith("part")


def test_cache_hit_does_no_decoding(tmp_path, monkeypatch):
    images = make_split(tmp_path, {"a": "0 0.5 0.5 0.2 0.2\n", "b": "1 0.5 0.5 0.4 0.4\n1 0.2 0.2 0.1 0.1\n"})
    first = scan_split(str(images), nc=2, cache_dir=tmp_path / "fallback")
    assert (tmp_path / "labels" / "train.cache.npz").is_file()

    def no_decoding(*args):
        raise AssertionError("decoded on a cache hit")

    monkeypatch.setattr(verify, "verify_one", no_decoding)
    monkeypatch.setattr(cv2, "imdecode", no_decoding)
    second = scan_split(str(images), nc=2, cache_dir=tmp_path / "fallback")
    assert second.im_files == first.im_files and second.stats == first.stats
    for a, b in zip(first.labels, second.labels):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(first.shapes, second.shapes)


def test_cache_file_has_no_objects(tmp_path):
    images = make_split(tmp_path, {"a": "0 0.1 0.1 0.3 0.1 0.2 0.3\n", "b": None})
    scan_split(str(images), nc=1)
    with np.load(tmp_path / "labels" / "train.cache.npz", allow_pickle=False) as arrays:
        assert all(arrays[key].dtype != object for key in arrays.files)
        assert arrays["labels"].dtype == np.float32 and arrays["points"].shape == (3, 2)


def test_cache_invalidated_when_one_label_changes(tmp_path):
    images = make_split(tmp_path, {"a": "0 0.5 0.5 0.2 0.2\n", "b": "0 0.5 0.5 0.4 0.4\n"})
    assert len(scan_split(str(images), nc=2).labels[1]) == 1
    label = tmp_path / "labels" / "train" / "b.txt"
    label.write_text("1 0.5 0.5 0.4 0.4\n1 0.1 0.1 0.1 0.1\n")
    os.utime(label, ns=(1, 1))  # size and mtime both differ from the cached ones
    result = scan_split(str(images), nc=2)
    np.testing.assert_allclose(result.labels[1][:, 0], [1, 1])


@pytest.mark.parametrize("damage", ["garbage", "truncated", "compressed"])
def test_corrupt_cache_is_rebuilt(tmp_path, caplog, damage):
    """A cache np.savez did not write is rebuilt; a compressed one (a planted 1 MB file declaring gigabytes of
    meta) before any member is read."""
    images = make_split(tmp_path, {"a": "0 0.5 0.5 0.2 0.2\n"})
    scan_split(str(images), nc=1)
    cache = tmp_path / "labels" / "train.cache.npz"
    content = cache.read_bytes()
    if damage == "compressed":
        with np.load(cache, allow_pickle=False) as arrays:
            saved = {name: arrays[name] for name in arrays.files}
        np.savez_compressed(cache, **saved)
        with np.load(cache, allow_pickle=False) as arrays:
            assert np.array_equal(arrays["meta"], saved["meta"])  # np.load itself would read it
    else:
        cache.write_bytes(b"not a zip at all" if damage == "garbage" else content[: len(content) // 2])
    with caplog.at_level(logging.WARNING):
        result = scan_split(str(images), nc=1)
    assert "label cache unreadable" in caplog.text and len(result.labels[0]) == 1
    assert damage != "compressed" or "is compressed, as np.savez never writes it" in caplog.text
    with np.load(cache, allow_pickle=False) as arrays:
        assert len(arrays["labels"]) == 1


def test_unwritable_labels_folder_falls_back(tmp_path, monkeypatch):
    images = make_split(tmp_path / "ds", {"a": "0 0.5 0.5 0.2 0.2\n"})
    labels_parent = tmp_path / "ds" / "labels"
    labels_parent.chmod(0o555)  # read-only (checked by mode bits too, so it holds for root)
    try:
        scan_split(str(images), nc=1, cache_dir=tmp_path / "fallback")
        assert not (labels_parent / "train.cache.npz").exists()
        assert len(list((tmp_path / "fallback").glob("*.npz"))) == 1
        monkeypatch.setattr(verify, "verify_one", lambda item: pytest.fail("not cached"))
        assert len(scan_split(str(images), nc=1, cache_dir=tmp_path / "fallback").labels) == 1
    finally:
        labels_parent.chmod(0o755)


def test_nothing_usable_is_one_line_error(tmp_path):
    images = make_split(tmp_path, {"a": "5 0.5 0.5 0.2 0.2\n"})
    with pytest.raises(DatasetError, match="no usable images") as error:
        scan_split(str(images), nc=2, use_cache=False)
    assert "\n" not in str(error.value)


def test_no_label_files_says_where_it_looked(tmp_path):
    images = make_split(tmp_path, {"a": None, "b": None})
    with pytest.raises(DatasetError) as error:
        scan_split(str(images), nc=2, use_cache=False)
    message = str(error.value)
    assert "no label files found" in message and str(tmp_path / "labels" / "train") in message
    assert "/images/" in message and "/labels/" in message


def test_single_cls_and_mixed_polygons(tmp_path):
    images = make_split(tmp_path, {"a": "4 0.5 0.5 0.2 0.2\n2 0.1 0.1 0.3 0.1 0.3 0.4\n"})
    result = scan_split(str(images), nc=1, single_cls=True, use_cache=False)
    np.testing.assert_array_equal(result.labels[0][:, 0], [0, 0])
    segments = result.segments[0]
    assert len(segments) == 2 and segments[0].shape == (4, 2) and segments[1].shape == (3, 2)
    np.testing.assert_allclose(result.labels[0][1, 1:], [0.2, 0.25, 0.2, 0.3], atol=1e-6)


def test_a_polygon_a_little_past_the_edge_is_clipped_and_a_pixel_polygon_refused():
    """As YOLOv5, a polygon's box (centre and size) must be normalised, not each point: points that overshoot the
    edge (annotation tools do) are clipped with a note instead of the image being skipped."""
    text = "0 0.9 0.5 1.02 0.5 1.0 0.6\n1 -0.001 0.2 0.3 0.2 0.3 0.4\n"
    (labels, segments), notes, _ = verify.parse_rows_one_by_one(text, 2)
    np.testing.assert_allclose(labels, [[0, 0.95, 0.55, 0.1, 0.1], [1, 0.15, 0.3, 0.3, 0.2]], atol=1e-6)
    assert segments[0].max() == 1.0 and segments[1].min() == 0.0
    assert [note.category for note in notes] == ["box clipped to image"] and "2 boxes" in notes[0].detail
    for pixels in ("0 10 20 30 20 30 40", "0 0.5 0.5 2.5 0.5 2.5 0.6", "0 -0.6 0.5 0.2 0.5 0.2 0.6"):
        with pytest.raises(verify.Problem):
            verify.parse_rows_one_by_one(pixels + "\n", 2)


# ----------------------------------------------------------------------------- check tool
def write_data_yaml(root: Path) -> Path:
    (root / "images" / "val").mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(root / "images" / "val" / "v.jpg"), np.zeros((20, 20, 3), np.uint8))
    (root / "labels" / "val").mkdir(parents=True, exist_ok=True)
    (root / "labels" / "val" / "v.txt").write_text("1 0.5 0.5 0.5 0.5\n")
    file = root / "data.yaml"
    file.write_text("path: .\ntrain: images/train\nval: images/val\nnames: [a, b]\n")
    return file


def test_check_tool_exit_codes(tmp_path, capsys):
    make_split(tmp_path, {"a": "0 0.5 0.5 0.2 0.2\n"})
    data = write_data_yaml(tmp_path)
    assert check_dataset.main(["--data", str(data), "--no-cache"]) == 0
    assert "all images usable" in capsys.readouterr().out
    (tmp_path / "images" / "train" / "broken.jpg").write_bytes(b"\xff\xd8\xff garbage")
    assert check_dataset.main(["--data", str(data), "--splits", "train", "--no-cache"]) == 1
    out = capsys.readouterr().out
    assert "images/train/broken.jpg: not an image" in out and "1 corrupt" in out
    assert check_dataset.main(["--data", str(tmp_path / "absent.yaml")]) == 1  # a bad input file
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "absent.yaml" in error and "Traceback" not in error
    assert check_dataset.main(["--splits", "train"]) == 2  # a usage error, one line
    assert capsys.readouterr().err == ("tools.check_dataset: error: the following arguments are required: --data "
                                       "(see python -m tools.check_dataset --help)\n")
    assert check_dataset.main(["--data", str(data), "--workers", "0"]) == 2


def test_check_tool_on_badinputs(badinputs, capsys, tmp_path):
    data = badinputs / "data.yaml"
    assert check_dataset.main(["--data", str(data), "--cache-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "train: Scanning" in out and "12 corrupt" in out
    assert "class 7 out of range (data has 3 classes)" in out


# ----------------------------------------------------------------------------- cache place and key
def no_scan(monkeypatch):
    monkeypatch.setattr(verify, "verify_one", lambda item: pytest.fail(f"scanned {item[0]} again"))


def test_folder_that_is_not_a_dataset_is_never_written_into(tmp_path, monkeypatch):
    system = tmp_path / "share" / "pixmaps"  # images, no label files anywhere: e.g. a system folder
    system.mkdir(parents=True)
    for name in ("icon", "logo"):
        cv2.imwrite(str(system / f"{name}.png"), np.zeros((16, 16, 3), np.uint8))
    first = verify.verify_split([str(system)], nc=1, cache_dir=tmp_path / "user")
    assert sorted(p.name for p in (tmp_path / "share").iterdir()) == ["pixmaps"]
    assert sorted(p.name for p in system.iterdir()) == ["icon.png", "logo.png"]
    assert len(list((tmp_path / "user").glob("*.npz"))) == 1
    no_scan(monkeypatch)
    assert verify.verify_split([str(system)], nc=1, cache_dir=tmp_path / "user").im_files == first.im_files


def test_two_paths_to_one_dataset_share_one_cache(tmp_path, monkeypatch):
    images = make_split(tmp_path / "real", {"a": "0 0.5 0.5 0.2 0.2\n", "b": "9 0.5 0.5 0.2 0.2\n", "c": None})
    (tmp_path / "alias").symlink_to(tmp_path / "real")  # e.g. a second checkout's data/ link
    via_alias = tmp_path / "alias" / "images" / "train"
    first = verify.verify_split(str(images), nc=2, cache_dir=tmp_path / "user")
    cache = tmp_path / "real" / "labels" / "train.cache.npz"
    written = cache.stat().st_mtime_ns
    no_scan(monkeypatch)
    for _ in range(2):
        again = verify.verify_split(str(via_alias), nc=2, cache_dir=tmp_path / "user")
        assert again.im_files == [str(via_alias / "a.jpg"), str(via_alias / "c.jpg")]  # the reader's own paths
        assert again.messages == [f"{via_alias / 'b.jpg'}: class 9 out of range (data has 2 classes) on line 1 "
                                  "(image skipped)"]
        assert again.stats == first.stats
        for ours, theirs in zip(again.labels, first.labels):
            np.testing.assert_array_equal(ours, theirs)
        assert verify.verify_split(str(images), nc=2, cache_dir=tmp_path / "user").im_files == first.im_files
    assert cache.stat().st_mtime_ns == written  # never rewritten
    assert not (tmp_path / "user").exists()


def test_read_only_dataset_reached_two_ways_shares_the_user_cache(tmp_path, monkeypatch):
    images = make_split(tmp_path / "real", {"a": "0 0.5 0.5 0.2 0.2\n"})
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    labels_parent = tmp_path / "real" / "labels"
    labels_parent.chmod(0o555)
    try:
        verify.verify_split(str(images), nc=1, cache_dir=tmp_path / "user")
        no_scan(monkeypatch)
        verify.verify_split(str(tmp_path / "alias" / "images" / "train"), nc=1, cache_dir=tmp_path / "user")
    finally:
        labels_parent.chmod(0o755)
    assert len(list((tmp_path / "user").glob("*.npz"))) == 1
    assert not (labels_parent / "train.cache.npz").exists()


# ----------------------------------------------------------------------------- the clean-file fast path
def random_label_text(rng: np.random.Generator) -> str:
    """A label file that is clean or breaks one rule: duplicates, clipping, zero size, bad class, polygons..."""
    rows = []
    for _ in range(int(rng.integers(0, 8))):
        cls = int(rng.integers(0, 4))
        cx, cy = rng.uniform(0.05, 0.95, 2)
        w, h = rng.uniform(0.0, 0.2, 2)
        rows.append(f"{cls} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}")
    fault = int(rng.integers(0, 10))
    if fault == 1 and rows:
        rows.append(rows[0])  # duplicate
    elif fault == 2:
        rows.append("1 0.99 0.5 0.2 0.2")  # past the edge: clipped
    elif fault == 3:
        rows.append("2 0.5 0.5 0 0.1")  # zero size
    elif fault == 4:
        rows.append(f"{rng.choice(['7', '1.5', '-1', 'nan'])} 0.5 0.5 0.1 0.1")  # bad class / value
    elif fault == 5:
        rows.append("0 0.1 0.1 0.4 0.1 0.3 0.5")  # a polygon
    elif fault == 6:
        rows.append("0 0.5 0.5 0.1")  # wrong number of columns
    elif fault == 7:
        rows.insert(0, "")  # blank line
    elif fault == 8:
        rows.append("0 0.5 0.5 1.2 0.1")  # not normalised
    return "\n".join(rows) + ("\n" if fault != 9 else "")


def parsed(parse, text: str, nc: int, single_cls: bool):
    try:
        (labels, segments), notes, duplicates = parse(text, nc, single_cls)
    except verify.Problem as problem:
        return "problem", problem.category, problem.detail
    return labels.tolist(), [s.tolist() for s in segments], [(n.category, n.detail) for n in notes], duplicates


@pytest.mark.parametrize("single_cls", [False, True])
def test_clean_files_parse_in_one_pass_to_the_same_labels(single_cls):
    """The vectorised path takes only files needing no repair, and gives bit for bit what the row-by-row
    parser gives; every other file (faults, notes, problems) goes to the row-by-row parser."""
    rng = np.random.default_rng(3)
    taken = 0
    for _ in range(600):
        text = random_label_text(rng)
        fast = verify.clean_boxes(text, 4, single_cls)
        slow = parsed(verify.parse_rows_one_by_one, text, 4, single_cls)
        if fast is not None:
            taken += 1
            assert slow[2:] == ([], 0) and slow[1] == [], text
            assert fast.dtype == np.float32 and fast.tolist() == slow[0], text
        with_fast = parsed(lambda t, n, s: verify.parse_label_file_text(t, n, s), text, 4, single_cls)
        assert with_fast == slow, text
    assert 100 < taken < 500  # both paths exercised


def test_read_ahead_changes_nothing_but_timing(badinputs, monkeypatch, tmp_path):
    """verify_chunk announces files to the kernel ahead of their checks: the records are the same without it, and
    missing or unreadable paths (the bad inputs have both, and a FIFO here) are left for verify_one to report."""
    images = list_image_files([str(badinputs / "images" / "train")])
    items = [(image, label, 3, False) for image, label in zip(images, img2label_paths(images))]
    items.append((str(badinputs / "no_such_image.jpg"), str(badinputs / "no_such_label.txt"), 3, False))
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "pipe.jpg"
        os.mkfifo(fifo)  # opening it to read would block: read_ahead must not
        read_ahead([str(fifo)])
    monkeypatch.setattr(verify, "READ_AHEAD", 4)  # several windows over the ~30 files
    announced = []
    real_read_ahead = verify._read_ahead
    monkeypatch.setattr(verify, "_read_ahead", lambda chunk: (announced.extend(chunk), real_read_ahead(chunk)))
    with_hints = verify.verify_chunk(items)
    assert announced == items  # every item announced once, in order, before its check
    monkeypatch.setattr(verify, "_read_ahead", lambda chunk: None)
    without = verify.verify_chunk(items)
    assert with_hints.stats == without.stats and with_hints.problems == without.problems
    assert with_hints.messages == without.messages and len(with_hints.messages) > 5
    assert list(with_hints.im_files) == list(without.im_files)
    assert np.array_equal(with_hints.shapes, without.shapes)
    assert all(np.array_equal(a, b) for a, b in zip(with_hints.labels, without.labels))


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height 8-bit gray pixels, with a few bytes of pixel data: what a
    decompression bomb looks like before it is decoded."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(width + 1)))
            + chunk(b"IEND", b""))


def test_an_image_declaring_more_pixels_than_are_decoded_is_refused_before_decoding(tmp_path, monkeypatch):
    """A few MB of PNG can declare 32K x 32K (about 70 GB once decoded as 16-bit RGBA): above PIL's bomb limit
    (YOLOv5's dataset check refuses those too) the scan and read_image refuse the header, never decoding."""
    from PIL import Image

    from utils.data.images import ImageError
    from utils.limits import MAX_IMAGE_PIXELS

    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_declaring(20_000, 10_000))
    decoded = []
    monkeypatch.setattr(verify.cv2, "imdecode", lambda *args: decoded.append(args) or None)
    with pytest.raises(verify.Problem, match=r"image too large \(20000x10000 px; at most 178,956,970 pixels"):
        verify.image_size(str(bomb))
    with pytest.raises(ImageError, match=r"bomb.png: image too large \(200,000,000 pixels; at most 178,956,970"):
        read_image(bomb)
    assert decoded == [] and 20_000 * 10_000 > MAX_IMAGE_PIXELS
    monkeypatch.undo()
    bmp = tmp_path / "small.bmp"
    cv2.imwrite(str(bmp), np.zeros((64, 64, 3), np.uint8))  # PIL reads its header (no fast reader for BMP)
    assert read_image(bmp).shape == (64, 64, 3)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # PIL's own refusal, twice its limit, is ours too
    with pytest.raises(ImageError, match=r"small.bmp: image too large \(Image size \(4096 pixels\) exceeds limit"):
        read_image(bmp)
    with pytest.raises(verify.Problem, match="image too large"):
        verify.image_size(str(bmp))


def test_sixteen_bit_images_become_eight_bit_as_before_without_float_copies():
    from utils.data.images import to_bgr8

    values = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    assert np.array_equal(to_bgr8(values)[:, :, 0], (values / 257.0).round().astype(np.uint8))
    rgba = np.random.default_rng(0).integers(0, 65536, (32, 48, 4), dtype=np.uint16)
    expected = cv2.cvtColor((rgba / 257.0).round().astype(np.uint8), cv2.COLOR_BGRA2BGR)
    assert np.array_equal(to_bgr8(rgba), expected)
