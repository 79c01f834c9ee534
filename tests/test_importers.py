"""VOC XML / COCO JSON importers: round trips from a YOLO dataset, class mapping, bad input messages."""
from __future__ import annotations

import json
import os
import struct
import tracemalloc
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from tools import import_dataset
from utils.data.importers import AnnotationError, coco_to_yolo, sku110k_to_yolo, visdrone_to_yolo, voc_to_yolo

NAMES = ["zebra", "cat", "moth"]  # index order differs from sorted order on purpose
SIZES = {"a": (40, 30), "b": (64, 50), "c": (33, 47), "d": (50, 50)}  # stem -> (width, height)


@pytest.fixture
def yolo_source(tmp_path):
    """A tiny YOLO dataset in memory and on disk: stem -> (image path, labels (n, 5))."""
    rng = np.random.default_rng(0)
    samples = {}
    for stem, (width, height) in SIZES.items():
        image_path = tmp_path / "src" / f"{stem}.png"
        image_path.parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(image_path), rng.integers(0, 255, (height, width, 3), dtype=np.uint8))
        count = 0 if stem == "d" else 3
        centres = rng.uniform(0.3, 0.7, (count, 2))
        sizes = rng.uniform(0.05, 0.5, (count, 2))
        classes = rng.integers(0, len(NAMES), (count, 1))
        samples[stem] = (image_path, np.concatenate([classes, centres, sizes], 1))
    return samples


def _corners(row, width, height):
    _, cx, cy, w, h = row
    return (cx - w / 2) * width, (cy - h / 2) * height, (cx + w / 2) * width, (cy + h / 2) * height


def _voc_xml(filename, width, height, labels, names, difficult=(), with_size=True):
    objects = []
    for index, row in enumerate(labels):
        x0, y0, x1, y1 = _corners(row, width, height)
        objects.append(f"<object><name>{names[int(row[0])]}</name><difficult>{int(index in difficult)}</difficult>"
                       f"<bndbox><xmin>{x0 + 1:.6f}</xmin><ymin>{y0 + 1:.6f}</ymin>"
                       f"<xmax>{x1 + 1:.6f}</xmax><ymax>{y1 + 1:.6f}</ymax></bndbox></object>")
    size = f"<size><width>{width}</width><height>{height}</height><depth>3</depth></size>" if with_size else ""
    return f"<annotation><filename>{filename}</filename>{size}{''.join(objects)}</annotation>"


def _write_voc_root(root: Path, samples, splits):
    (root / "Annotations").mkdir(parents=True)
    (root / "JPEGImages").mkdir()
    (root / "ImageSets" / "Main").mkdir(parents=True)
    for stem, (image_path, labels) in samples.items():
        width, height = SIZES[stem]
        os.link(image_path, root / "JPEGImages" / image_path.name)
        (root / "Annotations" / f"{stem}.xml").write_text(_voc_xml(image_path.name, width, height, labels, NAMES))
    for split, stems in splits.items():
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(f"{s}\n" for s in stems))


def _read_labels(path: Path) -> np.ndarray:
    return np.array([line.split() for line in path.read_text().splitlines()], np.float64).reshape(-1, 5)


def test_voc_round_trip_with_image_sets(tmp_path, yolo_source):
    _write_voc_root(tmp_path / "VOC", yolo_source, {"train": ["a", "b", "d"], "val": ["c"]})
    summary = voc_to_yolo(tmp_path / "VOC", tmp_path / "out", names=NAMES)
    assert summary.images == {"train": 3, "val": 1} and summary.boxes == 9
    for stem, (image_path, labels) in yolo_source.items():
        split = "val" if stem == "c" else "train"
        np.testing.assert_allclose(_read_labels(tmp_path / "out" / "labels" / split / f"{stem}.txt"), labels, atol=1e-4)
        assert os.path.samefile(tmp_path / "out" / "images" / split / image_path.name, image_path)  # hard link
    config = yaml.safe_load((tmp_path / "out" / "data.yaml").read_text())
    assert config["names"] == dict(enumerate(NAMES)) and config["nc"] == 3
    assert (config["train"], config["val"], "test" in config) == ("images/train", "images/val", False)
    assert Path(config["path"]) == (tmp_path / "out").resolve()


def test_voc_discovered_names_are_sorted_and_size_read_from_image(tmp_path, yolo_source):
    folder = tmp_path / "xmls"
    folder.mkdir()
    for stem, (image_path, labels) in yolo_source.items():
        width, height = SIZES[stem]
        (folder / f"{stem}.xml").write_text(_voc_xml(image_path.name, width, height, labels, NAMES,
                                                     difficult={0}, with_size=False))
    summary = voc_to_yolo(folder, tmp_path / "out", images_dir=tmp_path / "src", mode="copy")
    assert summary.names == sorted(NAMES)
    remap = np.array([sorted(NAMES).index(name) for name in NAMES])
    for stem, (image_path, labels) in yolo_source.items():
        expected = labels.copy()
        expected[:, 0] = remap[labels[:, 0].astype(int)]
        np.testing.assert_allclose(_read_labels(tmp_path / "out" / "labels" / "train" / f"{stem}.txt"),
                                   expected, atol=1e-4)
        assert not os.path.samefile(tmp_path / "out" / "images" / "train" / image_path.name, image_path)
    skipped = voc_to_yolo(folder, tmp_path / "out2", images_dir=tmp_path / "src", keep_difficult=False)
    assert skipped.boxes == 9 - 3 and skipped.skipped_boxes == 3


def test_voc_val_fraction_unknown_class_and_clipping(tmp_path, yolo_source):
    folder = tmp_path / "xmls"
    folder.mkdir()
    for index in range(40):
        xml = ("<annotation><size><width>100</width><height>50</height></size>"
               "<object><name>cat</name><bndbox><xmin>-9</xmin><ymin>11</ymin><xmax>51</xmax><ymax>80</ymax></bndbox>"
               "</object><object><name>dog</name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>5</xmax><ymax>5</ymax>"
               "</bndbox></object></annotation>")
        (folder / f"im{index}.xml").write_text(xml)
        os.link(yolo_source["a"][0], folder / f"im{index}.png")
    summary = voc_to_yolo(folder, tmp_path / "out", names=["cat"], val_fraction=0.25, mode="symlink")
    assert summary.images["train"] + summary.images["val"] == 40 and 3 <= summary.images["val"] <= 18
    assert summary.skipped_boxes == 40  # every "dog" skipped
    row = _read_labels(next((tmp_path / "out" / "labels" / "train").glob("*.txt")))
    np.testing.assert_allclose(row, [[0, 0.25, 0.6, 0.5, 0.8]], atol=1e-6)  # clipped to x 0..50, y 10..50
    assert next((tmp_path / "out" / "images" / "train").glob("*.png")).is_symlink()


def test_coco_round_trip_and_category_mapping(tmp_path, yolo_source):
    ids = {"cat": 3, "moth": 12, "zebra": 7}  # sorted ids -> cat 0, zebra 1, moth 2
    (tmp_path / "src" / "sub").mkdir()
    images, annotations = [], []
    for image_id, (stem, (image_path, labels)) in enumerate(yolo_source.items(), start=1):
        os.replace(image_path, tmp_path / "src" / "sub" / image_path.name)
        width, height = SIZES[stem]
        images.append({"id": image_id, "file_name": f"sub/{image_path.name}", "width": width, "height": height})
        for row in labels:
            x0, y0, x1, y1 = _corners(row, width, height)
            annotations.append({"id": len(annotations), "image_id": image_id, "iscrowd": 0,
                                "category_id": ids[NAMES[int(row[0])]], "bbox": [x0, y0, x1 - x0, y1 - y0]})
    annotations.append({"id": 99, "image_id": 1, "category_id": 3, "iscrowd": 1, "bbox": [0, 0, 10, 10]})
    categories = [{"id": i, "name": n} for n, i in ids.items()]
    (tmp_path / "coco.json").write_text(json.dumps({"images": images, "annotations": annotations,
                                                    "categories": categories}))
    summary = coco_to_yolo(tmp_path / "coco.json", tmp_path / "src", tmp_path / "out", split="val")
    assert summary.names == ["cat", "zebra", "moth"] and summary.skipped_boxes == 1
    remap = np.array([summary.names.index(name) for name in NAMES])
    for stem, (_, labels) in yolo_source.items():
        expected = labels.copy()
        expected[:, 0] = remap[labels[:, 0].astype(int)]
        np.testing.assert_allclose(_read_labels(tmp_path / "out" / "labels" / "val" / f"{stem}.txt"),
                                   expected, atol=1e-4)
    assert (tmp_path / "out" / "labels" / "val" / "d.txt").read_text() == ""  # background image
    config = yaml.safe_load((tmp_path / "out" / "data.yaml").read_text())
    assert config["val"] == "images/val" and "train" not in config
    with pytest.raises(AnnotationError, match="class names"):  # other categories into the same folder
        _import_other_categories(tmp_path)
    assert not (tmp_path / "out" / "images" / "train").exists()  # refused before writing anything


def _import_other_categories(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"images": [], "categories": [{"id": 1, "name": "x"}]}))
    coco_to_yolo(tmp_path / "other.json", tmp_path / "src", tmp_path / "out", split="train")


@pytest.mark.parametrize("text, reason", [
    ("<annotation><object><name>cat</name>", "malformed XML"),
    ("<annotation><object><name>cat</name><bndbox><xmin>a</xmin></bndbox></object></annotation>",
     "<xmin> is not a finite number: 'a'"),
    ("<annotation><object><name>cat</name><bndbox><xmin>nan</xmin></bndbox></object></annotation>",
     "<xmin> is not a finite number: 'nan'"),
    ("<folder>x</folder>", "expected <annotation>"),
])
def test_malformed_voc_names_the_file(tmp_path, text, reason):
    (tmp_path / "bad.xml").write_text(text)
    with pytest.raises(AnnotationError, match=reason) as caught:
        voc_to_yolo(tmp_path, tmp_path / "out")
    assert str(tmp_path / "bad.xml") in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("content, reason", [
    ("{not json", "malformed JSON"),
    ('{"images": ' + "[" * 100_000, "malformed JSON"),  # nested deeper than the parser recurses
    (json.dumps([1, 2]), "top level"),
    (json.dumps({"images": [], "annotations": []}), "'categories'"),
    (json.dumps({"images": [{"id": 1, "file_name": "a.png"}], "categories": [{"id": 1, "name": "c"}],
                 "annotations": [{"image_id": 1, "category_id": 1, "bbox": [1, 2, 3]}]}), r"annotations\[0\] bbox"),
    (json.dumps({"images": [{"id": 1, "file_name": "a.png"}], "categories": [{"id": 1, "name": "c"}],
                 "annotations": [{"image_id": 5, "category_id": 1, "bbox": [1, 2, 3, 4]}]}), "unknown image_id"),
])
def test_malformed_coco_names_the_file(tmp_path, content, reason):
    (tmp_path / "bad.json").write_text(content)
    with pytest.raises(AnnotationError, match=reason) as caught:
        coco_to_yolo(tmp_path / "bad.json", tmp_path, tmp_path / "out")
    assert str(tmp_path / "bad.json") in str(caught.value)


@pytest.mark.parametrize("content, reason", [(b"a\n\xff\xfe\n", "not UTF-8 text"),
                                             (b"a\n" * (5 << 20), "larger than 8 MB")])
def test_a_voc_image_set_list_that_is_not_text_or_too_large_is_one_line(tmp_path, yolo_source, content, reason):
    _write_voc_root(tmp_path / "VOC", yolo_source, {"train": ["a"]})
    listing = tmp_path / "VOC" / "ImageSets" / "Main" / "train.txt"
    listing.write_bytes(content)
    with pytest.raises(AnnotationError, match=reason) as caught:
        voc_to_yolo(tmp_path / "VOC", tmp_path / "out")
    assert str(caught.value).startswith(f"{listing}: ") and "\n" not in str(caught.value)


def test_command_line(tmp_path, yolo_source, capsys):
    _write_voc_root(tmp_path / "VOC", yolo_source, {"train": ["a", "b"], "val": ["c", "d"]})
    assert import_dataset.main(["voc", str(tmp_path / "VOC"), str(tmp_path / "out"), "--names", *NAMES]) == 0
    assert "train 2, val 2" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{")
    assert import_dataset.main(["coco", str(tmp_path / "bad.json"), str(tmp_path), str(tmp_path / "o2")]) == 1
    error = capsys.readouterr().err
    assert error.startswith("tools.import_dataset: error: ") and "bad.json" in error and error.count("\n") == 1
    for flags in (["--split", "../../escaped"], ["--val-fraction", "nan"], ["--val-fraction", "1"]):
        assert import_dataset.main(["voc", str(tmp_path / "VOC"), str(tmp_path / "o3"), *flags]) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"tools.import_dataset: error: argument {flags[0]}: ") and error.count("\n") == 1
    assert not (tmp_path / "o3").exists() and not (tmp_path / "escaped").exists()


# ----------------------------------------------------------------------------- hostile annotation files


def _outside_layout(tmp_path):
    """images/ok.jpg inside the image root; outside/secret.jpg next to it; images/linked.jpg -> the secret."""
    images, outside = tmp_path / "images", tmp_path / "outside"
    images.mkdir()
    outside.mkdir()
    cv2.imwrite(str(images / "ok.jpg"), np.full((20, 30, 3), 90, np.uint8))
    cv2.imwrite(str(outside / "secret.jpg"), np.full((24, 24, 3), 200, np.uint8))
    (images / "linked.jpg").symlink_to(outside / "secret.jpg")
    return images, outside / "secret.jpg"


def _assert_contained(out: Path, secret: Path, imported: set):
    placed = {p.name for p in (out / "images").rglob("*") if p.is_file()}
    assert placed == imported
    assert not any(os.path.samefile(p, secret) for p in out.rglob("*") if p.is_file())


def test_coco_file_names_outside_the_image_folder_are_skipped(tmp_path, caplog):
    images, secret = _outside_layout(tmp_path)
    entries = ["ok.jpg", "../outside/secret.jpg", str(secret), "linked.jpg", "a\0b.jpg", "x" * 5000 + ".jpg"]
    data = {"images": [{"id": i, "file_name": name} for i, name in enumerate(entries)],
            "categories": [{"id": 1, "name": "thing"}], "annotations": []}
    (tmp_path / "ann.json").write_text(json.dumps(data))
    with caplog.at_level("WARNING"):
        summary = coco_to_yolo(tmp_path / "ann.json", images, tmp_path / "out")
    assert summary.images["train"] == 1 and summary.skipped_images == 5
    _assert_contained(tmp_path / "out", secret, {"ok.jpg"})
    outside = [r.getMessage() for r in caplog.records if "is outside the images folder" in r.getMessage()]
    assert len(outside) == 3 and all(str(images.resolve()) in m and m.endswith(", skipped") for m in outside)
    assert any("'../outside/secret.jpg'" in m for m in outside) and any("'linked.jpg'" in m for m in outside)
    assert all(len(r.getMessage()) < 1000 for r in caplog.records)


def test_voc_filenames_outside_the_image_folder_are_skipped(tmp_path, caplog):
    images, secret = _outside_layout(tmp_path)
    box = "<object><name>a</name><bndbox><xmin>2</xmin><ymin>2</ymin><xmax>9</xmax><ymax>9</ymax></bndbox></object>"
    for stem, name in (("ok", "ok.jpg"), ("up", "../outside/secret.jpg"), ("absolute", str(secret)),
                       ("link", "linked.jpg")):
        (images / f"{stem}.xml").write_text(f"<annotation><filename>{name}</filename>{box}</annotation>")
    with caplog.at_level("WARNING"):
        summary = voc_to_yolo(images, tmp_path / "out", split="train")
    assert summary.images["train"] == 1 and summary.skipped_images == 3
    _assert_contained(tmp_path / "out", secret, {"ok.jpg"})
    assert sum("is outside the images folder" in r.getMessage() for r in caplog.records) == 3


def test_voc_xml_with_doctype_is_skipped_and_the_import_goes_on(tmp_path, yolo_source, caplog):
    _write_voc_root(tmp_path / "VOC", yolo_source, {"train": ["a", "b"], "val": ["c", "d"]})
    bomb = ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;">]>'
            "<annotation><filename>&lol2;</filename></annotation>")
    (tmp_path / "VOC" / "Annotations" / "b.xml").write_text(bomb)
    # in UTF-16 (which expat reads from its byte order mark) the bytes '<!ENTITY' never occur
    (tmp_path / "VOC" / "Annotations" / "d.xml").write_bytes(bomb.replace('"1.0"?>', '"1.0" encoding="UTF-16"?>')
                                                             .encode("utf-16"))
    with caplog.at_level("WARNING"):
        summary = voc_to_yolo(tmp_path / "VOC", tmp_path / "out", names=NAMES)
    assert summary.images == {"train": 1, "val": 1} and summary.skipped_files == 2
    assert "skipped annotation files 2" in summary.line()
    warning = [r.getMessage() for r in caplog.records if "b.xml" in r.getMessage()]
    assert warning == [f"{tmp_path / 'VOC' / 'Annotations' / 'b.xml'}: DOCTYPE/ENTITY declarations are not allowed "
                       "in annotation XML, skipped"]
    assert any("d.xml: DOCTYPE/ENTITY declarations are not allowed" in r.getMessage() for r in caplog.records)
    for stem in ("a", "c"):
        assert (tmp_path / "out" / "labels" / ("train" if stem == "a" else "val") / f"{stem}.txt").is_file()


def test_coco_non_finite_boxes_and_sizes(tmp_path):
    images, _ = _outside_layout(tmp_path)
    text = json.dumps({"images": [{"id": 1, "file_name": "ok.jpg", "width": float("inf"), "height": 20}],
                       "categories": [{"id": 1, "name": "c"}],
                       "annotations": [{"image_id": 1, "category_id": 1, "bbox": [1, 2, 3, 4]}]})
    (tmp_path / "inf.json").write_text(text)
    coco_to_yolo(tmp_path / "inf.json", images, tmp_path / "out")  # the size comes from the image header
    assert _read_labels(tmp_path / "out" / "labels" / "train" / "ok.txt")[0, 1] == pytest.approx(2.5 / 30, abs=1e-6)
    (tmp_path / "nan.json").write_text(text.replace("[1, 2, 3, 4]", "[1, NaN, 3, 4]"))
    with pytest.raises(AnnotationError, match=r"annotations\[0\] bbox must be 4 finite numbers, got \[1, nan, 3, 4\]"):
        coco_to_yolo(tmp_path / "nan.json", images, tmp_path / "out2")


def test_full_disk_is_one_line_naming_the_file(tmp_path, yolo_source, capsys, monkeypatch):
    import errno

    import utils.data.importers as importers

    _write_voc_root(tmp_path / "VOC", yolo_source, {"train": ["a", "b"], "val": ["c", "d"]})

    def full_disk(path, rows):
        raise OSError(errno.ENOSPC, "No space left on device")  # as write() reports it: no file name

    monkeypatch.setattr(importers, "write_labels", full_disk)
    assert import_dataset.main(["voc", str(tmp_path / "VOC"), str(tmp_path / "out"), "--names", *NAMES]) == 1
    assert capsys.readouterr().err == (f"tools.import_dataset: error: could not write "
                                       f"{tmp_path / 'out' / 'labels' / 'train' / 'a.txt'}: No space left on device\n")



# ----------------------------------------------------------------------------- VisDrone

def _visdrone_folder(root: Path, annotations: dict[str, str], size=(100, 50)) -> Path:
    """A VisDrone DET folder: images/NAME.jpg (``size`` = width, height) and annotations/NAME.txt as given."""
    (root / "images").mkdir(parents=True)
    (root / "annotations").mkdir()
    for stem, text in annotations.items():
        cv2.imwrite(str(root / "images" / f"{stem}.jpg"), np.full((size[1], size[0], 3), 90, np.uint8))
        (root / "annotations" / f"{stem}.txt").write_text(text)
    return root


def test_visdrone_labels_as_yolov5_converts_them(tmp_path, caplog):
    """Categories 1-10 -> classes 0-9 normalised to the image size; score 0 (ignored regions), category 0 and
    11 ('others', beyond YOLOv5's 10 names) left out; boxes clipped to the image, no-area ones dropped; a trailing
    comma (VisDrone's files have some) read; an annotation without its image skipped with a warning."""
    folder = _visdrone_folder(tmp_path / "VisDrone2019-DET-val", {
        "a": "10,5,20,10,1,4,0,0\n90,40,20,20,1,1,0,1,\n0,0,5,5,0,0,0,0\n1,1,5,5,1,11,0,0\n3,3,0,7,1,2,0,0\n",
        "b": "",
    })
    (folder / "annotations" / "lost.txt").write_text("1,1,5,5,1,1,0,0\n")
    summary = visdrone_to_yolo(folder)
    rows = [line.split() for line in (folder / "labels" / "a.txt").read_text().splitlines()]
    assert rows == [["3", "0.200000", "0.200000", "0.200000", "0.200000"],  # car: 10..30 of 100, 5..15 of 50
                    ["0", "0.950000", "0.900000", "0.100000", "0.200000"]]  # pedestrian, clipped at 100 x 50
    assert (folder / "labels" / "b.txt").read_text() == ""
    assert summary.boxes == 2 and summary.skipped_boxes == 2 and summary.skipped_images == 1
    assert summary.images == {"VisDrone2019-DET-val": 2} and summary.names[9] == "motor"
    assert "lost.txt: image 'lost.jpg' not found" in caplog.text
    assert sorted(p.name for p in folder.iterdir()) == ["annotations", "images", "labels"]


@pytest.mark.parametrize("line, reason", [("1,2,3,4,1", "line 2: '1,2,3,4,1': expected"),
                                          ("1,2,x,4,1,1,0,0", "line 2: '1,2,x,4,1,1,0,0': expected")])
def test_a_malformed_visdrone_line_names_the_file_and_line(tmp_path, line, reason):
    folder = _visdrone_folder(tmp_path / "v", {"a": f"1,1,5,5,1,1,0,0\n{line}\n"})
    with pytest.raises(AnnotationError, match=reason) as raised:
        visdrone_to_yolo(folder)
    assert str(folder / "annotations" / "a.txt") in str(raised.value)
    assert not (folder / "labels").exists()


def test_a_visdrone_number_too_large_for_a_float_names_the_file_and_line(tmp_path):
    folder = _visdrone_folder(tmp_path / "v", {"a": "1,1,5,5,1,1,0,0\n1" + "0" * 400 + ",1,5,5,1,1,0,0\n"})
    with pytest.raises(AnnotationError, match="line 2: .*expected") as raised:
        visdrone_to_yolo(folder)
    assert str(folder / "annotations" / "a.txt") in str(raised.value)


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` and holds no pixels: all an image header reader sees."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) \
        + chunk(b"IEND", b"")


def test_an_image_header_declaring_a_decompression_bomb_is_one_line(tmp_path):
    """Pillow refuses to open an image of more than 2 x MAX_IMAGE_PIXELS (a DecompressionBombError, not an
    OSError): the importer says which image, in one line."""
    folder = _visdrone_folder(tmp_path / "v", {"a": "1,1,5,5,1,1,0,0\n"})
    (folder / "images" / "a.jpg").write_bytes(_png_header(30_000, 30_000))
    with pytest.raises(AnnotationError, match="cannot read the image size") as raised:
        visdrone_to_yolo(folder)
    assert str(raised.value).startswith(f"{folder / 'images' / 'a.jpg'}: ") and "\n" not in str(raised.value)


def test_visdrone_on_the_command_line(tmp_path, capsys):
    folder = _visdrone_folder(tmp_path / "v", {"a": "10,5,20,10,1,4,0,0\n"})
    assert import_dataset.main(["visdrone", str(folder)]) == 0
    assert "imported visdrone:" in capsys.readouterr().out and (folder / "labels" / "a.txt").is_file()
    assert import_dataset.main(["visdrone", str(tmp_path / "missing")]) == 1
    error = capsys.readouterr().err
    assert "expected the VisDrone folders annotations/ and images/" in error and error.count("\n") == 1



# ----------------------------------------------------------------------------- SKU-110K

def _sku_folder(root: Path, rows: dict[str, str]) -> Path:
    (root / "images").mkdir(parents=True)
    (root / "annotations").mkdir()
    cv2.imwrite(str(root / "images" / "a.jpg"), np.full((20, 40, 3), 90, np.uint8))
    for split in ("train", "val", "test"):
        (root / "annotations" / f"annotations_{split}.csv").write_text(rows.get(split, ""))
    return root


@pytest.mark.parametrize("row, reason", [("a.jpg,1,2,3,object,40,20", "line 2: "),
                                         ("a.jpg,1,2,x,4,object,40,20", "line 2: "),
                                         ("a.jpg,1,2,3,4,object,0,20", "line 2: "),
                                         ("../a.jpg,1,2,3,4,object,40,20", "line 2: "),
                                         ("sub/a.jpg,1,2,3,4,object,40,20", "line 2: "),
                                         ("a.jpg,nan,2,3,4,object,40,20", "line 2: "),
                                         ("a.jpg,1,2,3,4,object,inf,20", "line 2: "),
                                         ('"a.jpg\nb.jpg",1,2,3,4,object,40,20', "line 2: "),
                                         ("a.jpg\u2028b.jpg,1,2,3,4,object,40,20", "line 2: "),
                                         ("a\x1b[2Jb.jpg,1,2,3,4,object,40,20", "line 2: ")])
def test_a_malformed_sku110k_row_names_the_file_and_line_and_steers_no_write(tmp_path, row, reason):
    """A row that is not a plain file name and 7 numbers (a size of 0 too) is one error naming the CSV and the
    line; a name with a folder in it never chooses where a label is written."""
    folder = _sku_folder(tmp_path / "sku", {"val": f"a.jpg,1,1,5,5,object,40,20\n{row}\n"})
    with pytest.raises(AnnotationError, match=reason) as raised:
        sku110k_to_yolo(folder)
    assert str(folder / "annotations" / "annotations_val.csv") in str(raised.value)
    assert "expected image_name,x1,y1,x2,y2,class,image_width,image_height" in str(raised.value)
    assert not (tmp_path / "a.txt").exists() and not (folder / "labels" / "sub").exists()


def test_a_sku110k_name_with_a_line_break_never_adds_a_line_to_a_split_list(tmp_path):
    """The split lists hold a line an image: a name that breaks a line (there is such an image file) is refused."""
    folder = _sku_folder(tmp_path / "sku", {"train": '"a.jpg\nb.jpg",1,1,5,5,object,40,20\n'})
    (folder / "images" / "a.jpg\nb.jpg").write_bytes((folder / "images" / "a.jpg").read_bytes())
    with pytest.raises(AnnotationError, match="line 1: "):
        sku110k_to_yolo(folder)
    assert not (folder / "train.txt").exists()


def test_a_sku110k_line_longer_than_a_row_is_refused_without_being_read_whole(tmp_path):
    folder = _sku_folder(tmp_path / "sku", {})
    (folder / "annotations" / "annotations_train.csv").write_bytes(b"a.jpg,1,1,5,5,object,40,20\n" + b"x" * (8 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(AnnotationError, match="line 2: longer than"):
            sku110k_to_yolo(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, f"{peak / 1e6:.0f} MB held for one line"


def test_a_sku110k_line_that_is_not_utf8_names_the_file_and_line(tmp_path):
    folder = _sku_folder(tmp_path / "sku", {})
    path = folder / "annotations" / "annotations_val.csv"
    path.write_bytes(b"a.jpg,1,1,5,5,object,40,20\n\xffa.jpg,1,1,5,5,object,40,20\n")
    with pytest.raises(AnnotationError, match="line 2: not UTF-8") as raised:
        sku110k_to_yolo(folder)
    assert str(raised.value).startswith(f"{path}: ")


def test_sku110k_on_the_command_line(tmp_path, capsys):
    folder = _sku_folder(tmp_path / "sku", {"train": "image_name,x1,y1,x2,y2,class,image_width,image_height\n"
                                                      "a.jpg,0,0,20,10,object,40,20\na.jpg,20,10,40,20,object,40,20\n"})
    assert import_dataset.main(["sku110k", str(folder)]) == 0
    assert "imported sku110k: 1 classes, images: test 0, train 1, val 0, boxes 2" in capsys.readouterr().out
    assert (folder / "labels" / "a.txt").read_text().splitlines() == ["0 0.250000 0.250000 0.500000 0.500000",
                                                                      "0 0.750000 0.750000 0.500000 0.500000"]
    assert (folder / "train.txt").read_text() == "./images/a.jpg\n" and (folder / "val.txt").read_text() == ""
