"""YOLOv5's remaining dataset conversions, as code that reads data: xView's GeoJSON, Argoverse-HD's JSON and
Objects365's COCO-style JSON -> YOLO labels in place, and ``autosplit`` (a folder of images -> train/val/test lists).

What YOLOv5's dataset YAMLs do in their ``download:`` scripts, done here from the same files without running any
script (data/xView.yaml, data/Argoverse.yaml, data/Objects365.yaml; utils/data/dataset_download.py runs these as
steps):

* xView (downloaded by hand: train_images/, val_images/, xView_train.geojson): each feature's
  ``bounds_imcoords`` (``x1,y1,x2,y2`` pixels) becomes a row of labels/train/ID.txt, its ``type_id`` (11-94) one of
  the 60 classes by YOLOv5's table (other ids are left out and counted); normalised by the image's header size and
  clipped. The image folders become images/train and images/val, and ``autosplit`` writes
  images/autosplit_train.txt and autosplit_val.txt (90% / 10% of the train images, YOLOv5's seeded draw, so both
  tools hold out the same images).
* Argoverse-HD (downloaded by hand: Argoverse-1.1/tracking/, Argoverse-HD/annotations/): each annotation of
  train.json and val.json (``bbox`` x, y, w, h from the top-left; ``category_id`` is the class, 0-7) becomes a row
  of Argoverse-1.1/labels/SEQ_DIR/NAME.txt, normalised by the 1920x1200 frame as YOLOv5 does (by the image entry's
  width and height when it has them) and clipped; then tracking/ becomes images/, the YAML's splits.
* Objects365 (fetched as archives): the images unpacked below images/SPLIT/ are moved into images/SPLIT/ itself,
  and zhiyuan_objv2_SPLIT.json becomes labels/SPLIT/NAME.txt: classes numbered in the JSON's category order (as
  YOLOv5's pycocotools loop), crowd annotations left out, boxes clipped to the image's width and height.

Unlike YOLOv5's scripts: a name from a file (an image id, a sequence folder) never steers a write outside the
label folder (plain names and relative folders without '..' only, else one line naming the file); a box with no
area inside its image is dropped (YOLOv5 writes it with width or height 0); each problem is one line naming the
file. The JSON files are read whole, as YOLOv5 reads them (Objects365's train JSON needs tens of GB of memory).
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
from collections import Counter, defaultdict
from pathlib import Path, PurePosixPath

from utils.data.images import IMG_EXTENSIONS
from utils.data.importers import AnnotationError, ImportSummary, image_header_size, write_labels, yolo_row
from utils.errors import shorten, writing
from utils.files import atomic_write

LOGGER = logging.getLogger(__name__)

AUTOSPLIT_FILES = ("autosplit_train.txt", "autosplit_val.txt", "autosplit_test.txt")
ARGOVERSE_SIZE = (1920, 1200)  # the ring front centre camera's frames (YOLOv5 divides by these)
ARGOVERSE_NAMES = ["person", "bicycle", "car", "motorcycle", "bus", "truck", "traffic_light", "stop_sign"]
# xView's type ids (11-94) of its 60 classes, in class order (YOLOv5's xview_class2index table, inverted)
XVIEW_TYPE_IDS = (11, 12, 13, 15, 17, 18, 19, 20, 21, 23, 24, 25, 26, 27, 28, 29, 32, 33, 34, 35, 36, 37, 38, 40, 41,
                  42, 44, 45, 47, 49, 50, 51, 52, 53, 54, 55, 56, 57, 59, 60, 61, 62, 63, 64, 65, 66, 71, 72, 73, 74,
                  76, 77, 79, 83, 84, 86, 89, 91, 93, 94)
XVIEW_CLASS_OF = {type_id: index for index, type_id in enumerate(XVIEW_TYPE_IDS)}


# ----------------------------------------------------------------------------- shared


def load_json(path: Path, what: str):
    """The parsed JSON file ``path`` (an object at the top), or AnnotationError naming it."""
    try:
        with open(path, "rb") as file:
            data = json.load(file)
    except OSError as error:
        raise AnnotationError(f"{path}: cannot read ({error.strerror or error})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AnnotationError(f"{path}: malformed JSON ({shorten(str(error), 200)})") from None
    except RecursionError:
        raise AnnotationError(f"{path}: malformed JSON (nested deeper than the parser goes)") from None
    if not isinstance(data, dict):
        raise AnnotationError(f"{path}: top level must be an object ({what})")
    return data


def _plain_name(value, path: Path, where: str) -> str:
    """``value`` as a file name that names no folder (no separator, not '.' or '..', printable), else one line."""
    if isinstance(value, str) and value and value.isprintable() and "/" not in value and "\\" not in value \
            and value not in (".", ".."):
        return value
    raise AnnotationError(f"{path}: {where}: {shorten(value)} is not a plain file name")


def _relative_folder(value, path: Path, where: str) -> PurePosixPath:
    """``value`` as a relative folder without '..' of plain names, else one line naming the file."""
    folder = PurePosixPath(value) if isinstance(value, str) and value else None
    if folder is None or folder.is_absolute() or not folder.parts \
            or not all(part not in (".", "..") and part.isprintable() and "\\" not in part for part in folder.parts):
        raise AnnotationError(f"{path}: {where}: {shorten(value)} is not a relative folder without '..'")
    return folder


def _list(data: dict, key: str, path: Path) -> list:
    value = data.get(key)
    if not isinstance(value, list):
        raise AnnotationError(f"{path}: missing or non-list {key!r}")
    return value


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _write_label_files(rows_of: dict[Path, list[tuple]], summary: ImportSummary) -> None:
    for label, rows in rows_of.items():
        with writing(label):
            write_labels(label, sorted(rows, key=lambda row: row[0]))  # class by class, as YOLOv5's files
        summary.boxes += len(rows)


def _rename(source: Path, target: Path) -> None:
    """``source`` folder renamed to ``target`` (done already when only ``target`` is there)."""
    if not source.is_dir():
        return
    if target.exists():
        raise AnnotationError(f"{source} and {target} both exist: the images are in one of them (remove the other)")
    with writing(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(source, target)


# ----------------------------------------------------------------------------- autosplit


def autosplit(path: str | os.PathLike, weights: tuple[float, float, float] = (0.9, 0.1, 0.0),
              annotated_only: bool = False) -> dict[str, int]:
    """Split the images below ``path`` into path's parent/autosplit_{train,val,test}.txt, YOLOv5's way: the files
    in path order, each drawn train/val/test by ``weights`` from Python's random seeded with 0 (the same draw, so
    the same lists as YOLOv5's autosplit), as ``./`` paths relative to the parent. ``annotated_only``: images
    without a label file are left out. Earlier lists go; a list no image was drawn for is not written; the train
    list is written before the val list, each whole. Returns the count of each list written."""
    from utils.data.verify import img2label_paths

    path = Path(path)
    if not path.is_dir():
        raise AnnotationError(f"{path}: not a folder of images")
    if len(weights) != 3 or not all(_number(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise AnnotationError(f"autosplit: weights {shorten(weights)}: expected 3 non-negative numbers, not all 0")
    files = sorted((file for file in path.rglob("*") if file.suffix[1:].lower() in IMG_EXTENSIONS and file.is_file()),
                   key=lambda file: file.parts)
    draws = random.Random(0).choices([0, 1, 2], weights=weights, k=len(files))
    lists = [[], [], []]
    for index, file in zip(draws, files):
        if not annotated_only or os.path.isfile(img2label_paths([str(file)])[0]):
            lists[index].append(f"./{file.relative_to(path.parent).as_posix()}\n")
    for name in AUTOSPLIT_FILES:
        (path.parent / name).unlink(missing_ok=True)
    for name, lines in zip(AUTOSPLIT_FILES, lists):
        if lines:
            with writing(path.parent / name):
                atomic_write(path.parent / name, "".join(lines).encode())
    counts = {name: len(lines) for name, lines in zip(AUTOSPLIT_FILES, lists) if lines}
    LOGGER.info("autosplit %s: %s", path, ", ".join(f"{name} {count}" for name, count in counts.items()))
    return counts


# ----------------------------------------------------------------------------- xView


def xview_to_yolo(folder: str | os.PathLike) -> ImportSummary:
    """xView as downloaded by hand (``folder``: train_images/, xView_train.geojson, val_images/) -> YOLOv5's layout
    in place (module doc). Run again after an interruption, it starts over from whichever folder holds the images."""
    folder = Path(folder)
    geojson = folder / "xView_train.geojson"
    images = folder / "train_images" if (folder / "train_images").is_dir() else folder / "images" / "train"
    if not geojson.is_file() or not images.is_dir():
        raise AnnotationError(f"{folder}: expected xView's xView_train.geojson and train_images/ (from "
                              "https://challenge.xviewdataset.org)")
    summary = ImportSummary(folder / "labels" / "train", [f"type {type_id}" for type_id in XVIEW_TYPE_IDS])
    features = _list(load_json(geojson, "a GeoJSON FeatureCollection"), "features", geojson)
    rows_of: dict[Path, list[tuple]] = defaultdict(list)
    sizes: dict[str, tuple[int, int] | None] = {}
    unknown = Counter()
    for index, feature in enumerate(features):
        where = f"features[{index}]"
        properties = feature.get("properties") if isinstance(feature, dict) else None
        if not isinstance(properties, dict):
            raise AnnotationError(f"{geojson}: {where} has no 'properties' object")
        if not properties.get("bounds_imcoords"):
            continue  # YOLOv5 leaves these out too
        name = _plain_name(properties.get("image_id"), geojson, f"{where}.image_id")
        corners, type_id = _xview_box(properties, geojson, where)
        if name not in sizes:  # 1395.tif is listed but not in train_images
            image = images / name
            sizes[name] = image_header_size(image) if image.is_file() else None
            summary.skipped_images += sizes[name] is None
        if sizes[name] is None:
            continue
        row = yolo_row(XVIEW_CLASS_OF[type_id], *corners, *sizes[name]) if type_id in XVIEW_CLASS_OF else None
        if type_id not in XVIEW_CLASS_OF:
            unknown[type_id] += 1
        if row is None:
            summary.skipped_boxes += 1
            continue
        rows_of[folder / "labels" / "train" / f"{Path(name).stem}.txt"].append(row)
    if unknown:
        LOGGER.warning("%s: %d boxes of type ids outside xView's 60 classes left out (%s)", geojson,
                       sum(unknown.values()), ", ".join(f"{key}: {count}" for key, count in sorted(unknown.items())))
    if summary.skipped_images:
        LOGGER.warning("%s: %d images named in the labels are not in %s, left out", geojson, summary.skipped_images,
                       images)
    _write_label_files(rows_of, summary)
    summary.images["train"] = len(rows_of)
    _rename(folder / "train_images", folder / "images" / "train")
    _rename(folder / "val_images", folder / "images" / "val")
    autosplit(folder / "images" / "train")  # the YAML's train and val lists, written last
    LOGGER.info("xView labels: %s", summary.line())
    return summary


def _xview_box(properties: dict, path: Path, where: str) -> tuple[tuple[int, ...], int]:
    """(x1, y1, x2, y2) and the type id of one feature, or AnnotationError naming it."""
    text, type_id = properties.get("bounds_imcoords"), properties.get("type_id")
    try:
        corners = tuple(int(number) for number in text.split(",")) if isinstance(text, str) and len(text) < 200 \
            else ()
    except ValueError:
        corners = ()
    if len(corners) != 4 or max(map(abs, corners)) > 1 << 31:
        raise AnnotationError(f"{path}: {where}.bounds_imcoords: {shorten(text)}: expected 4 integers x1,y1,x2,y2")
    try:
        type_id = int(type_id) if isinstance(type_id, (int, str)) and not isinstance(type_id, bool) else None
    except ValueError:
        type_id = None
    if type_id is None:
        raise AnnotationError(f"{path}: {where}.type_id: {shorten(properties.get('type_id'))}: expected an integer")
    return corners, type_id


# ----------------------------------------------------------------------------- Argoverse-HD


def argoverse_to_yolo(folder: str | os.PathLike) -> ImportSummary:
    """Argoverse-HD as downloaded by hand (``folder``: Argoverse-1.1/tracking/, Argoverse-HD/annotations/) -> YOLOv5's
    layout in place (module doc); tracking/ is renamed last, so an interrupted conversion is done again."""
    folder = Path(folder)
    annotations, data = folder / "Argoverse-HD" / "annotations", folder / "Argoverse-1.1"
    if not annotations.is_dir() or not ((data / "tracking").is_dir() or (data / "images").is_dir()):
        raise AnnotationError(f"{folder}: expected Argoverse-HD's Argoverse-1.1/tracking/ and Argoverse-HD/annotations/")
    summary = ImportSummary(data / "labels", ARGOVERSE_NAMES)
    for split in ("train", "val"):
        path = annotations / f"{split}.json"
        if not path.is_file():
            raise AnnotationError(f"{path}: missing (Argoverse-HD's annotations of the {split} split)")
        rows_of = _argoverse_rows(path, data / "labels", summary)
        _write_label_files(rows_of, summary)
        summary.images[split] = len(rows_of)
    _rename(data / "tracking", data / "images")  # the YAML's splits appear last
    LOGGER.info("Argoverse labels: %s", summary.line())
    return summary


def _argoverse_rows(path: Path, labels: Path, summary: ImportSummary) -> dict[Path, list[tuple]]:
    data = load_json(path, "Argoverse-HD annotations")
    images, folders = _list(data, "images", path), _list(data, "seq_dirs", path)
    by_id = {}
    for index, entry in enumerate(images):  # YOLOv5 takes an image_id as the entry's position: its id, where given
        if not isinstance(entry, dict):
            raise AnnotationError(f"{path}: images[{index}] is not an object")
        by_id[entry.get("id", index)] = (index, entry)
    rows_of: dict[Path, list[tuple]] = defaultdict(list)
    checked: dict[int, Path] = {}
    for index, annotation in enumerate(_list(data, "annotations", path)):
        where = f"annotations[{index}]"
        image_id = annotation.get("image_id") if isinstance(annotation, dict) else None
        if isinstance(image_id, bool) or image_id not in by_id:
            raise AnnotationError(f"{path}: {where} refers to unknown image_id {shorten(image_id)}")
        if image_id not in checked:
            checked[image_id] = _argoverse_label(*by_id[image_id], folders, labels, path)
        bbox, category = annotation.get("bbox"), annotation.get("category_id")
        if not (isinstance(bbox, list) and len(bbox) == 4 and all(map(_number, bbox))):
            raise AnnotationError(f"{path}: {where}.bbox must be 4 finite numbers, got {shorten(bbox)}")
        width, height = _argoverse_size(by_id[image_id][1])
        x, y, w, h = bbox
        row = yolo_row(category, x, y, x + w, y + h, width, height) \
            if isinstance(category, int) and not isinstance(category, bool) \
            and 0 <= category < len(ARGOVERSE_NAMES) else None
        if row is None:
            summary.skipped_boxes += 1
            continue
        rows_of[checked[image_id]].append(row)
    return rows_of


def _argoverse_label(index: int, entry: dict, folders: list, labels: Path, path: Path) -> Path:
    """The label file of images[index]: labels/SEQ_DIR/NAME.txt, names checked (module doc)."""
    name = _plain_name(entry.get("name"), path, f"images[{index}].name")
    sequence = entry.get("sid")
    if isinstance(sequence, bool) or not isinstance(sequence, int) or not 0 <= sequence < len(folders):
        raise AnnotationError(f"{path}: images[{index}].sid: {shorten(sequence)} is not an index of seq_dirs")
    folder = _relative_folder(folders[sequence], path, f"seq_dirs[{sequence}]")
    return labels.joinpath(*folder.parts) / f"{Path(name).stem}.txt"


def _argoverse_size(entry: dict) -> tuple[float, float]:
    width, height = entry.get("width"), entry.get("height")
    if _number(width) and _number(height) and width > 0 and height > 0:
        return width, height
    return ARGOVERSE_SIZE


# ----------------------------------------------------------------------------- Objects365


def objects365_to_yolo(folder: str | os.PathLike, names: list[str] | None = None) -> ImportSummary:
    """Objects365 as its archives unpack (``folder``: zhiyuan_objv2_{train,val}.json, images/{train,val}/ holding
    the patches' images at any depth) -> YOLOv5's layout in place (module doc). ``names``: the YAML's class names;
    a JSON with another number of categories is refused (its labels would not fit), other names are a warning."""
    folder = Path(folder)
    summary = ImportSummary(folder / "labels", list(names or []))
    for split in ("train", "val"):
        path, images = folder / f"zhiyuan_objv2_{split}.json", folder / "images" / split
        if not path.is_file() or not images.is_dir():
            raise AnnotationError(f"{folder}: expected Objects365's zhiyuan_objv2_{split}.json and images/{split}/")
        present = _flatten_images(images)
        rows_of = _objects365_rows(path, images, present, folder / "labels" / split, names, summary)
        _write_label_files(rows_of, summary)
        summary.images[split] = len(rows_of)
    LOGGER.info("Objects365 labels: %s", summary.line())
    return summary


def _flatten_images(images: Path) -> set[str]:
    """Move every image below ``images`` into ``images`` itself (YOLOv5's move; the emptied folders go) and return
    the names there; two different images of one name are refused."""
    for file in sorted(images.rglob("*")):
        if file.parent == images or file.suffix[1:].lower() not in IMG_EXTENSIONS or not file.is_file():
            continue
        target = images / file.name
        if target.exists() and not os.path.samefile(file, target):
            raise AnnotationError(f"{file}: another image of the name {file.name} is already in {images}")
        with writing(target):
            os.replace(file, target)
    for folder in sorted((path for path in images.rglob("*") if path.is_dir()), key=lambda p: -len(p.parts)):
        try:
            folder.rmdir()
        except OSError:
            pass  # not empty (other files than images): left as it is
    return {entry.name for entry in os.scandir(images) if entry.is_file()}


def _objects365_rows(path: Path, folder: Path, present: set[str], labels: Path, names: list[str] | None,
                     summary: ImportSummary) -> dict[Path, list[tuple]]:
    data = load_json(path, "COCO-style annotations")
    class_of, found = {}, []
    for index, entry in enumerate(_list(data, "categories", path)):
        category_id = entry.get("id") if isinstance(entry, dict) else None
        if isinstance(category_id, bool) or not isinstance(category_id, int) or category_id in class_of:
            raise AnnotationError(f"{path}: categories[{index}] has no valid or a repeated 'id'")
        class_of[category_id] = len(class_of)
        found.append(str(entry.get("name")))
    if names and len(found) != len(names):
        raise AnnotationError(f"{path}: {len(found)} categories, but the YAML names {len(names)} classes")
    if names and found != list(names):
        first = next(index for index, (a, b) in enumerate(zip(found, names)) if a != b)
        LOGGER.warning("%s: category names differ from the YAML's (class %d: %s against %s); numbered in the JSON's "
                       "order", path, first, shorten(found[first]), shorten(names[first]))
    images = {}
    for index, entry in enumerate(_list(data, "images", path)):
        image_id = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(image_id, (int, str)) or isinstance(image_id, bool):
            raise AnnotationError(f"{path}: images[{index}] has no valid 'id'")
        name = _plain_name(PurePosixPath(str(entry.get("file_name", ""))).name or None, path,
                           f"images[{index}].file_name")
        width, height = entry.get("width"), entry.get("height")
        if not (_number(width) and _number(height) and width > 0 and height > 0):
            raise AnnotationError(f"{path}: images[{index}] has no valid width and height")
        images[image_id] = (name, width, height)
    rows_of: dict[Path, list[tuple]] = defaultdict(list)
    missing = set()
    for index, annotation in enumerate(_list(data, "annotations", path)):
        where = f"annotations[{index}]"
        if not isinstance(annotation, dict) or annotation.get("image_id") not in images \
                or annotation.get("category_id") not in class_of:
            raise AnnotationError(f"{path}: {where} refers to no listed image and category")
        bbox = annotation.get("bbox")
        if not (isinstance(bbox, list) and len(bbox) == 4 and all(map(_number, bbox))):
            raise AnnotationError(f"{path}: {where}.bbox must be 4 finite numbers, got {shorten(bbox)}")
        name, width, height = images[annotation["image_id"]]
        if name not in present:
            missing.add(name)
            continue
        x, y, w, h = bbox
        row = None if annotation.get("iscrowd") else \
            yolo_row(class_of[annotation["category_id"]], x, y, x + w, y + h, width, height)
        if row is None:
            summary.skipped_boxes += 1
            continue
        rows_of[labels / f"{Path(name).stem}.txt"].append(row)
    summary.skipped_images += len(missing)
    if missing:
        LOGGER.warning("%s: %d images with annotations are not in %s, left out", path, len(missing), folder)
    return rows_of
