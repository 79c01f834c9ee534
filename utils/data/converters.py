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
file. The JSON files are read an item at a time (utils/data/json_stream.py) where YOLOv5 parses them whole: the
memory a conversion needs is that of its compact results (32 bytes a box: an Objects365 stand-in of 10 million boxes
converted in 965 MB, where json.load alone took 7.3 GB; benchmarks/bench_convert.py).
"""
from __future__ import annotations

import logging
import math
import os
import random
from array import array
from collections import Counter, defaultdict
from pathlib import Path, PurePosixPath

import numpy as np

from utils.data.images import IMG_EXTENSIONS
from utils.data.importers import (AnnotationError, ImportSummary, check_bbox, finite_number, image_header_size,
                                  plain_file_name, write_labels, yolo_row)
from utils.data.json_stream import iter_arrays
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


def _plain_name(value, path: Path, where: str) -> str:
    """``value`` as a file name that names no folder (no separator, not '.' or '..', printable), else one line."""
    if plain_file_name(value):
        return value
    raise AnnotationError(f"{path}: {where}: {shorten(value)} is not a plain file name")


def _relative_folder(value, path: Path, where: str) -> PurePosixPath:
    """``value`` as a relative folder without '..' of plain names, else one line naming the file."""
    folder = PurePosixPath(value) if isinstance(value, str) and value else None
    if folder is None or folder.is_absolute() or not folder.parts or not all(map(plain_file_name, folder.parts)):
        raise AnnotationError(f"{path}: {where}: {shorten(value)} is not a relative folder without '..'")
    return folder


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
    if len(weights) != 3 or not all(finite_number(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise AnnotationError(f"autosplit: weights {shorten(weights)}: expected 3 non-negative numbers, not all 0")
    files = sorted((file for file in path.rglob("*") if file.suffix[1:].lower() in IMG_EXTENSIONS and file.is_file()),
                   key=lambda file: file.parts)
    draws = random.Random(0).choices([0, 1, 2], weights=weights, k=len(files))
    labels = img2label_paths([str(file) for file in files]) if annotated_only else [None] * len(files)
    lists = [[], [], []]
    for index, file, label in zip(draws, files, labels):
        if label is None or os.path.isfile(label):
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
    rows_of: dict[Path, list[tuple]] = defaultdict(list)
    sizes: dict[str, tuple[int, int] | None] = {}
    unknown = Counter()
    for index, (_, feature) in enumerate(iter_arrays(geojson, ("features",))):
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
        if row is None:  # no class of the 60 (counted by type id), or no area inside the image
            if type_id not in XVIEW_CLASS_OF:
                unknown[type_id] += 1
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
    images, folders, boxes = [], [], []
    for key, item in iter_arrays(path, ("images", "seq_dirs", "annotations")):
        if key == "annotations":
            boxes.append(_argoverse_box(item, path, len(boxes)))
        else:
            (images if key == "images" else folders).append(item)
    by_id = {}
    for index, entry in enumerate(images):  # YOLOv5 takes an image_id as the entry's position: its id, where given
        if not isinstance(entry, dict):
            raise AnnotationError(f"{path}: images[{index}] is not an object")
        by_id[entry.get("id", index)] = (index, entry)
    rows_of: dict[Path, list[tuple]] = defaultdict(list)
    checked: dict[int, Path] = {}
    for index, (image_id, category, x, y, w, h) in enumerate(boxes):
        if isinstance(image_id, bool) or image_id not in by_id:
            raise AnnotationError(f"{path}: annotations[{index}] refers to unknown image_id {shorten(image_id)}")
        if image_id not in checked:
            checked[image_id] = _argoverse_label(*by_id[image_id], folders, labels, path)
        row = yolo_row(category, x, y, x + w, y + h, *_argoverse_size(by_id[image_id][1])) \
            if 0 <= category < len(ARGOVERSE_NAMES) else None
        if row is None:
            summary.skipped_boxes += 1
            continue
        rows_of[checked[image_id]].append(row)
    return rows_of


def _argoverse_box(annotation, path: Path, index: int) -> tuple:
    """(image_id, category, x, y, w, h) of one annotation, or AnnotationError naming it."""
    where = f"annotations[{index}]"
    if not isinstance(annotation, dict):
        raise AnnotationError(f"{path}: {where} is not an object")
    bbox, category = check_bbox(annotation.get("bbox"), path, where), annotation.get("category_id")
    if isinstance(category, bool) or not isinstance(category, int):
        raise AnnotationError(f"{path}: {where}.category_id must be an integer, got {shorten(category)}")
    image_id = annotation.get("image_id")
    if isinstance(image_id, bool) or not isinstance(image_id, (int, str)):
        raise AnnotationError(f"{path}: {where}.image_id must be an integer or a string, got {shorten(image_id)}")
    return (image_id, category, *bbox)


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
    if finite_number(width) and finite_number(height) and width > 0 and height > 0:
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
        summary.images[split] = _objects365_labels(path, images, present, folder / "labels" / split, names, summary)
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


MAX_ID = 1 << 62  # an image or category id (stored in 64-bit arrays)
LABELS_AT_ONCE = 10_000  # label files whose rows are made Python numbers together (Objects365: ~15 boxes a file)


def _objects365_labels(path: Path, folder: Path, present: set[str], labels: Path, names: list[str] | None,
                       summary: ImportSummary) -> int:
    """labels/SPLIT/NAME.txt for each image of ``present`` with boxes in the JSON ``path`` (module doc); the boxes are
    kept in compact arrays (32 bytes each) while the file streams by. Returns the label files written."""
    categories, images = [], {}
    image_ids, category_ids, boxes = array("q"), array("q"), array("d")
    index = -1
    for key, item in iter_arrays(path, ("categories", "images", "annotations")):
        if key == "annotations":
            index += 1
            image_id, category_id, bbox = _objects365_box(item, path, index)
            if item.get("iscrowd"):
                summary.skipped_boxes += 1
                continue
            image_ids.append(image_id)
            category_ids.append(category_id)
            boxes.extend(bbox)
        elif key == "images":
            image_id, entry = _objects365_image(item, path, len(images))
            if image_id in images:
                raise AnnotationError(f"{path}: images[{len(images)}]: the id {image_id} is listed twice")
            images[image_id] = entry
        else:
            categories.append(item)
    class_of = _objects365_classes(categories, path, names)
    summary.names = summary.names or [str(entry.get("name")) for entry in categories]
    if not image_ids:
        return 0
    known = np.array(sorted(images), np.int64)
    position = _positions(known, np.frombuffer(image_ids, np.int64), path, "image").astype(np.int32)
    category_known = np.array(sorted(class_of), np.int64)
    classes = np.array([class_of[c] for c in category_known.tolist()], np.int32)[
        _positions(category_known, np.frombuffer(category_ids, np.int64), path, "category")]
    del image_ids, category_ids  # the compact arrays are all that is kept from here on
    entries = [images[image_id] for image_id in known.tolist()]
    here = np.array([entry[0] in present for entry in entries])
    missing = int(np.unique(position[~here[position]]).size)
    summary.skipped_images += missing
    if missing:
        LOGGER.warning("%s: %d images with annotations are not in %s, left out", path, missing, folder)
    corners = _normalised_corners(np.frombuffer(boxes, np.float64).reshape(-1, 4), position, entries)
    keep = here[position] & (corners[:, 2] > corners[:, 0]) & (corners[:, 3] > corners[:, 1])  # as yolo_row
    summary.skipped_boxes += int((here[position] & ~keep).sum())
    kept = np.flatnonzero(keep)
    del keep
    order = kept[np.lexsort((classes[kept], position[kept]))]  # by image, then class (YOLOv5's); stable: file order
    del kept
    starts = np.flatnonzero(np.diff(position[order], prepend=-1)).tolist()
    ends = [*starts[1:], len(order)]
    for first in range(0, len(starts), LABELS_AT_ONCE):  # rows as Python numbers for some files at a time
        low, high = starts[first], ends[min(first + LABELS_AT_ONCE, len(starts)) - 1]
        box = corners[order[low:high]]
        columns = classes[order[low:high]], (box[:, 0] + box[:, 2]) / 2, (box[:, 1] + box[:, 3]) / 2, \
            box[:, 2] - box[:, 0], box[:, 3] - box[:, 1]
        rows = list(zip(*(column.tolist() for column in columns)))
        for start, end in zip(starts[first:first + LABELS_AT_ONCE], ends[first:first + LABELS_AT_ONCE]):
            label = labels / f"{Path(entries[position[order[start]]][0]).stem}.txt"
            with writing(label):
                write_labels(label, rows[start - low:end - low])
    summary.boxes += len(order)
    return len(starts)


def _normalised_corners(boxes: np.ndarray, position: np.ndarray, entries: list) -> np.ndarray:
    """``boxes`` (x, y, w, h pixels from the top-left) made (x0, y0, x1, y1) normalised to each box's image and
    clipped to [0, 1], in place and a part at a time (no array of the boxes' size is added); the same arithmetic as
    yolo_row."""
    width = np.array([entry[1] for entry in entries], np.float64)
    height = np.array([entry[2] for entry in entries], np.float64)
    for low in range(0, len(boxes), 1 << 20):
        part, where = boxes[low:low + (1 << 20)], position[low:low + (1 << 20)]
        part[:, 2:] += part[:, :2]
        part[:, 0::2] /= width[where][:, None]
        part[:, 1::2] /= height[where][:, None]
        np.clip(part, 0.0, 1.0, out=part)
    return boxes


def _positions(known: np.ndarray, ids: np.ndarray, path: Path, what: str) -> np.ndarray:
    """Where each of ``ids`` is in the sorted ``known``; AnnotationError naming the first annotation that refers to
    an id not there."""
    position = np.minimum(np.searchsorted(known, ids), len(known) - 1) if len(known) else np.zeros_like(ids)
    wrong = np.flatnonzero(known[position] != ids) if len(known) else np.arange(len(ids))
    if len(wrong):
        raise AnnotationError(f"{path}: an annotation refers to {what} id {int(ids[wrong[0]])}, which is not listed")
    return position


def _int_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -MAX_ID <= value < MAX_ID


def _objects365_box(annotation, path: Path, index: int) -> tuple:
    where = f"annotations[{index}]"
    if not isinstance(annotation, dict) or not _int_id(annotation.get("image_id")) \
            or not _int_id(annotation.get("category_id")):
        raise AnnotationError(f"{path}: {where} has no integer image_id and category_id")
    return annotation["image_id"], annotation["category_id"], check_bbox(annotation.get("bbox"), path, where)


def _objects365_image(entry, path: Path, index: int) -> tuple:
    """(id, (file name, width, height)) of one image entry; the file name is its last part (images are flat)."""
    if not isinstance(entry, dict) or not _int_id(entry.get("id")):
        raise AnnotationError(f"{path}: images[{index}] has no integer 'id'")
    file_name = entry.get("file_name")
    name = _plain_name(PurePosixPath(file_name).name if isinstance(file_name, str) else file_name, path,
                       f"images[{index}].file_name")
    width, height = entry.get("width"), entry.get("height")
    if not (finite_number(width) and finite_number(height) and width > 0 and height > 0):
        raise AnnotationError(f"{path}: images[{index}] has no valid width and height")
    return entry["id"], (name, width, height)


def _objects365_classes(categories: list, path: Path, names: list[str] | None) -> dict[int, int]:
    """category id -> class, in the JSON's category order (YOLOv5's loop over pycocotools' getCatIds)."""
    class_of, found = {}, []
    for index, entry in enumerate(categories):
        category_id = entry.get("id") if isinstance(entry, dict) else None
        if not _int_id(category_id) or category_id in class_of:
            raise AnnotationError(f"{path}: categories[{index}] has no valid or a repeated 'id'")
        class_of[category_id] = len(class_of)
        found.append(str(entry.get("name")))
    if names and len(found) != len(names):
        raise AnnotationError(f"{path}: {len(found)} categories, but the YAML names {len(names)} classes")
    if names and found != list(names):
        first = next(index for index, (a, b) in enumerate(zip(found, names)) if a != b)
        LOGGER.warning("%s: category names differ from the YAML's (class %d: %s against %s); numbered in the JSON's "
                       "order", path, first, shorten(found[first]), shorten(names[first]))
    return class_of
