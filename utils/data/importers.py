"""Pascal VOC XML and COCO JSON annotations -> YOLO layout: images/<split>, labels/<split>, data.yaml; VisDrone's
text annotations -> YOLO labels in place (labels/ beside images/, as YOLOv5's VisDrone.yaml lays them out).

Label rows are ``class cx cy w h``, normalised to the image size and clipped to [0, 1]; boxes with no
area left after clipping are dropped with a warning. Images are hard-linked into place (copied when the
output is on another file system), or symlinked / copied on request. Every problem with an input file
raises ``AnnotationError`` (a UserError) whose one-line message names the file and the reason.

Nothing outside the images folder is ever read or linked: an image is looked up by its real path
(symlinks resolved), and an entry whose file lies outside the folder (``../``, an absolute path, a
symlink pointing out) is skipped with a warning naming the entry. A VOC XML file with a DOCTYPE or
ENTITY declaration (entity expansion attacks) or larger than 8 MB is skipped with a warning and the
import goes on with the other files.

Conventions (as YOLOv5's own converters):
* VOC: ``xmin ymin xmax ymax`` are 1-based pixels, so both corners move by -1; ``difficult`` objects
  are kept; the size comes from ``<size>`` or, when absent, the image header. Class names are given
  or discovered (sorted); objects of classes outside given names are skipped with a warning.
* COCO: ``bbox`` is ``x, y, w, h`` from the top-left, in pixels; category ids map to 0..nc-1 in
  sorted id order; ``iscrowd`` annotations are skipped; images without annotations get an empty
  label file (background).
* VisDrone (DET): a line an object, ``left,top,width,height,score,category,truncation,occlusion`` in pixels;
  lines of score 0 (ignored regions) are left out and categories 1-10 become classes 0-9, as YOLOv5's converter
  does; category 0 (ignored regions) and 11 (others), which name no class of its 10, are left out and counted
  (YOLOv5 would write class 10 for 'others' and then refuse it as beyond nc). The size is the image header's.
* SKU-110K: annotations/annotations_{train,val,test}.csv, a row a box without a header,
  ``image_name,x1,y1,x2,y2,class,image_width,image_height`` in pixels; one class (0: object), normalised to the
  row's image size, as YOLOv5's converter does; each split's images listed in SPLIT.txt as ``./images/NAME``.
"""
from __future__ import annotations

import csv
import logging
import math
import os
import re
import shutil
import xml.etree.ElementTree as ElementTree
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from utils.data.images import IMG_EXTENSIONS
from utils.data.json_stream import iter_arrays
from utils.errors import AnnotationError, shorten, writing
from utils.limits import MAX_ANNOTATION_TXT_BYTES, MAX_ANNOTATION_XML_BYTES, MAX_CLASSES, MAX_NAME_LENGTH
from utils.safe_yaml import read_yaml, yaml_reason

LOGGER = logging.getLogger(__name__)

LINK_MODES = ("hardlink", "symlink", "copy")
SPLITS = ("train", "val", "test")
MAX_CSV_LINE_BYTES = 4096  # one SKU-110K row: about 50 ('train_0.jpg,208,537,422,814,object,3024,3024')
MAX_VISDRONE_INTEGER = 1 << 31  # a VisDrone field: pixels, a score, a category (beyond a float: OverflowError)
_UNSAFE_XML = re.compile(rb"<!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)


class SkippedAnnotation(AnnotationError):
    """An annotation file refused on sight (DOCTYPE/ENTITY, oversized): skipped with a warning."""


@dataclass
class ImportSummary:
    yaml_path: Path
    names: list[str]
    images: Counter = field(default_factory=Counter)  # split -> images written
    boxes: int = 0
    skipped_images: int = 0  # annotation without a readable image file
    skipped_boxes: int = 0  # crowd, unknown class, or no area inside the image
    skipped_files: int = 0  # annotation files refused on sight (DOCTYPE/ENTITY, oversized)

    def line(self) -> str:
        splits = ", ".join(f"{split} {count}" for split, count in sorted(self.images.items()))
        files = f", skipped annotation files {self.skipped_files}" if self.skipped_files else ""
        return (f"{len(self.names)} classes, images: {splits or 'none'}, boxes {self.boxes}, "
                f"skipped images {self.skipped_images}, skipped boxes {self.skipped_boxes}{files} -> {self.yaml_path}")


# ----------------------------------------------------------------------------- shared writers


def plain_file_name(name) -> bool:
    """A file name from an annotation that names no folder: a non-empty printable string (no NUL, line break or
    control character: it may be a line of a list) without a path separator, not '.' or '..'."""
    return isinstance(name, str) and bool(name) and name.isprintable() and "/" not in name and "\\" not in name \
        and name not in (".", "..")


def yolo_row(cls: int, x0: float, y0: float, x1: float, y1: float, width: float, height: float):
    """Pixel corners -> (cls, cx, cy, w, h) normalised and clipped, or None when no area is left."""
    x0, x1 = np.clip([x0 / width, x1 / width], 0.0, 1.0)
    y0, y1 = np.clip([y0 / height, y1 / height], 0.0, 1.0)
    if x1 - x0 <= 0 or y1 - y0 <= 0:
        return None
    return cls, (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0


def write_labels(path: Path, rows: list[tuple]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{c} {x:.6f} {y:.6f} {w:.6f} {h:.6f}\n" for c, x, y, w, h in rows))


def place_image(source: Path, target: Path, mode: str = "hardlink") -> None:
    """Put ``source`` at ``target``: hard link (copy across file systems), symlink or copy."""
    if mode not in LINK_MODES:
        raise ValueError(f"unknown image mode {mode!r}, expected one of {', '.join(LINK_MODES)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        if target.exists() and os.path.samefile(source, target):
            return
        target.unlink()
    if mode == "symlink":
        target.symlink_to(source.resolve())
        return
    if mode == "hardlink":
        try:
            os.link(source, target)
            return
        except OSError:
            pass  # other file system or no link support: copy
    shutil.copy2(source, target)


def check_existing_names(out_dir: Path, names: list[str]) -> None:
    """Refuse to import into a folder whose data.yaml has other class names (labels would disagree)."""
    yaml_path = out_dir / "data.yaml"
    if yaml_path.is_file():
        try:
            old = read_yaml(yaml_path) or {}
        except yaml.YAMLError as error:
            raise AnnotationError(f"{yaml_path}: existing data.yaml is not valid YAML ({yaml_reason(error)})") from None
        except OSError as error:
            raise AnnotationError(f"{yaml_path}: cannot read ({error.strerror or error})") from None
        old_names = old.get("names") if isinstance(old, dict) else None
        if isinstance(old_names, dict):
            integer_ids = all(isinstance(key, int) and not isinstance(key, bool) for key in old_names)
            old_names = [old_names[key] for key in sorted(old_names)] if integer_ids else old_names
        if old_names is not None and (not isinstance(old_names, list) or old_names != list(names)):
            raise AnnotationError(f"{yaml_path}: existing class names {shorten(old_names)} differ from "
                                  f"{shorten(names)}; import into another folder or pass the same names")


def check_names(names: list[str], source) -> None:
    """Class names a data.yaml can hold: at most MAX_CLASSES, each 1..MAX_NAME_LENGTH characters."""
    if len(names) > MAX_CLASSES:
        raise AnnotationError(f"{source}: {len(names)} classes, more than the {MAX_CLASSES} supported")
    for name in names:
        if not 0 < len(name) <= MAX_NAME_LENGTH:
            raise AnnotationError(f"{source}: class name {shorten(name)} must have 1 to {MAX_NAME_LENGTH} characters")


def write_data_yaml(out_dir: Path, names: list[str]) -> Path:
    """data.yaml naming every split folder present in ``out_dir``; refuses to change existing names."""
    check_existing_names(out_dir, names)
    config = {"path": str(out_dir.resolve())}
    for split in SPLITS:
        if (out_dir / "images" / split).is_dir():
            config[split] = f"images/{split}"
    config["nc"] = len(names)
    config["names"] = {index: name for index, name in enumerate(names)}
    yaml_path = out_dir / "data.yaml"
    with writing(yaml_path):
        yaml_path.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    return yaml_path


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.is_file() and path.resolve().is_relative_to(root)
    except (OSError, ValueError, RuntimeError):  # too long, NUL byte, symlink loop
        return False


def _candidates(folder: Path, name: str | None, stem: str) -> list[Path]:
    found = [folder / name, folder / Path(name).name] if name else []
    return found + [folder / f"{stem}.{suffix}" for extension in IMG_EXTENSIONS
                    for suffix in (extension, extension.upper())]


def find_image(folder: Path, name: str | None, stem: str) -> tuple[Path | None, str]:
    """(image, "") for the file called ``name`` in ``folder`` (or just its base name), else ``stem`` + any
    image extension; only files whose real path (symlinks resolved) is inside ``folder`` count.
    (None, reason) when there is none; the reason says whether a candidate lay outside the folder."""
    root = folder.resolve()
    outside = None
    for candidate in _candidates(folder, name, stem):
        if _inside(candidate, root):
            return candidate, ""
        try:
            outside = outside or (candidate.resolve() if candidate.is_file() else None)
        except (OSError, ValueError, RuntimeError):
            continue
    if outside is not None:
        return None, f"is outside the images folder {root} (resolves to {shorten(str(outside), 200)})"
    return None, f"not found in {folder}"


def image_header_size(path: Path) -> tuple[int, int]:
    """(width, height) as stored in the file header (no EXIF rotation), or AnnotationError."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.size
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as error:  # the last: > 2x MAX_IMAGE_PIXELS
        raise AnnotationError(f"{path}: cannot read the image size ({error})") from None


# ----------------------------------------------------------------------------- Pascal VOC


@dataclass
class VocRecord:
    xml_path: Path
    filename: str | None
    width: float
    height: float
    objects: list[tuple[str, float, float, float, float, bool]]  # name, xmin, ymin, xmax, ymax, difficult


def _read_at_most(path: Path, limit: int) -> bytes | None:
    """The bytes of an annotation file, None when it holds more than ``limit``; AnnotationError when unreadable."""
    try:
        with open(path, "rb") as file:
            data = file.read(limit + 1)
    except OSError as error:
        raise AnnotationError(f"{path}: cannot read ({error.strerror or error})") from None
    return None if len(data) > limit else data


def read_xml(path: Path) -> ElementTree.Element:
    """Parse an XML file; SkippedAnnotation for DOCTYPE/ENTITY declarations (entity expansion attacks)
    and files past MAX_ANNOTATION_XML_BYTES, AnnotationError for unreadable or malformed ones."""
    data = _read_at_most(path, MAX_ANNOTATION_XML_BYTES)
    if data is None:
        raise SkippedAnnotation(f"{path}: larger than {MAX_ANNOTATION_XML_BYTES >> 20} MB, not an annotation file")
    if _UNSAFE_XML.search(data) or _declares(data):
        raise SkippedAnnotation(f"{path}: DOCTYPE/ENTITY declarations are not allowed in annotation XML")
    try:
        return ElementTree.fromstring(data)
    except ElementTree.ParseError as error:
        raise AnnotationError(f"{path}: malformed XML ({shorten(str(error), 200)})") from None


class _Declared(Exception):
    pass


def _declares(data: bytes) -> bool:
    """Whether the XML declares a DOCTYPE or an entity, as expat reads it in its own encoding (the byte pattern
    misses UTF-16 text); malformed XML counts as not declaring (ElementTree then says what is wrong)."""
    from xml.parsers import expat

    def refuse(*args):
        raise _Declared

    parser = expat.ParserCreate()
    parser.StartDoctypeDeclHandler = parser.EntityDeclHandler = refuse
    try:
        parser.Parse(data, True)
    except _Declared:
        return True
    except expat.ExpatError:
        return False
    return False


def _number(element: ElementTree.Element, tag: str, path: Path, required: bool = True) -> float | None:
    text = element.findtext(tag)
    if text is None or not text.strip():
        if required:
            raise AnnotationError(f"{path}: missing <{tag}>")
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise AnnotationError(f"{path}: <{tag}> is not a finite number: {shorten(text.strip())}")
    return value


def parse_voc_xml(path: Path) -> VocRecord:
    root = read_xml(path)
    if root.tag != "annotation":
        raise AnnotationError(f"{path}: root element is <{shorten(root.tag, 40)}>, expected <annotation>")
    size = root.find("size")
    width = _number(size, "width", path, required=False) if size is not None else None
    height = _number(size, "height", path, required=False) if size is not None else None
    objects = []
    for element in root.iter("object"):
        name = (element.findtext("name") or "").strip()
        box = element.find("bndbox")
        if not name or box is None:
            raise AnnotationError(f"{path}: an <object> lacks <name> or <bndbox>")
        corners = [_number(box, tag, path) for tag in ("xmin", "ymin", "xmax", "ymax")]
        difficult = (element.findtext("difficult") or "0").strip() in ("1", "true")
        objects.append((name, *corners, difficult))
    filename = (root.findtext("filename") or "").strip() or None
    return VocRecord(path, filename, width or 0.0, height or 0.0, objects)


def _voc_folders(source: Path, images_dir: Path | None) -> tuple[Path, Path, Path | None]:
    """(annotations folder, images folder, ImageSets/Main folder or None) for a VOC root or XML folder."""
    if not source.is_dir():
        raise AnnotationError(f"{source}: not a folder (expected a VOC root or a folder of XML files)")
    if (source / "Annotations").is_dir():
        lists = source / "ImageSets" / "Main"
        images = images_dir or (source / "JPEGImages")
        return source / "Annotations", images, lists if lists.is_dir() else None
    return source, images_dir or source, None


def _voc_split_of(stems: list[str], lists: Path | None, split: str | None,
                  val_fraction: float) -> dict[str, str]:
    """stem -> split: the given split; else VOC's ImageSets lists; else train with a stable val share."""
    if split is not None:
        return {stem: split for stem in stems}
    if lists is not None and any((lists / f"{name}.txt").is_file() for name in SPLITS):
        assigned = {}
        for name in SPLITS:
            list_file = lists / f"{name}.txt"
            if list_file.is_file():
                for line in _read_list(list_file):
                    if line.split():
                        assigned.setdefault(line.split()[0], name)
        return {stem: assigned[stem] for stem in stems if stem in assigned}
    threshold = int(val_fraction * 10000)
    return {stem: "val" if zlib.crc32(stem.encode()) % 10000 < threshold else "train" for stem in stems}


def _read_list(path: Path) -> list[str]:
    """The lines of a VOC ImageSets list (UTF-8, at most MAX_ANNOTATION_TXT_BYTES), or AnnotationError."""
    data = _read_at_most(path, MAX_ANNOTATION_TXT_BYTES)
    if data is None:
        raise AnnotationError(f"{path}: larger than {MAX_ANNOTATION_TXT_BYTES >> 20} MB, not an image set list")
    try:
        return data.decode("utf-8").split("\n")
    except UnicodeDecodeError as error:
        raise AnnotationError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None


def voc_to_yolo(source: str | os.PathLike, out_dir: str | os.PathLike, images_dir: str | os.PathLike | None = None,
                names: list[str] | None = None, split: str | None = None, val_fraction: float = 0.0,
                keep_difficult: bool = True, mode: str = "hardlink") -> ImportSummary:
    """Import Pascal VOC: ``source`` is a VOC root (Annotations/, JPEGImages/, ImageSets/Main/) or a
    folder of XML files (images beside them unless ``images_dir``).

    Splits: ``split`` puts everything in one split; otherwise ImageSets/Main/{train,val,test}.txt when
    present (images in no list are left out), else train with ``val_fraction`` of the images (chosen
    by a stable hash of the name) in val. ``names`` fixes the class order; by default the sorted set
    of names found.
    """
    annotations, images_folder, lists = _voc_folders(Path(source), Path(images_dir) if images_dir else None)
    _check_split(split)
    records, skipped_files = _read_voc_records(annotations)
    splits = _voc_split_of([record.xml_path.stem for record in records], lists, split, val_fraction)
    records = [record for record in records if record.xml_path.stem in splits]
    names = list(names) if names else sorted({obj[0] for record in records for obj in record.objects})
    out_dir = Path(out_dir)
    check_names(names, annotations)
    check_existing_names(out_dir, names)
    summary = ImportSummary(out_dir / "data.yaml", names, skipped_files=skipped_files)
    class_index = {name: index for index, name in enumerate(names)}
    unknown = Counter()
    for record in records:
        image_path, reason = find_image(images_folder, record.filename, record.xml_path.stem)
        if image_path is None:
            LOGGER.warning("%s: image %s %s, skipped", record.xml_path,
                           shorten(record.filename or record.xml_path.stem, 200), reason)
            summary.skipped_images += 1
            continue
        rows = _voc_rows(record, image_path, class_index, keep_difficult, unknown)
        summary.skipped_boxes += len(record.objects) - len(rows)
        _write_sample(out_dir, splits[record.xml_path.stem], image_path, rows, mode, summary)
    for name, count in unknown.items():
        if count:
            LOGGER.warning("%s: %d objects of class %s (not in the given names) skipped", annotations, count,
                           shorten(name))
    summary.yaml_path = write_data_yaml(out_dir, names)
    LOGGER.info("VOC import: %s", summary.line())
    return summary


def _read_voc_records(annotations: Path) -> tuple[list[VocRecord], int]:
    """Parsed XML files of ``annotations`` (sorted) and how many were skipped on sight, with a warning."""
    records, skipped = [], 0
    for path in sorted(annotations.glob("*.xml")):
        try:
            records.append(parse_voc_xml(path))
        except SkippedAnnotation as error:
            LOGGER.warning("%s, skipped", error)
            skipped += 1
    if not records:
        raise AnnotationError(f"{annotations}: no usable .xml annotation files found"
                              + (f" ({skipped} skipped, see the warnings)" if skipped else ""))
    return records, skipped


def _voc_rows(record: VocRecord, image_path: Path, class_index: dict, keep_difficult: bool,
              unknown: Counter) -> list[tuple]:
    """YOLO rows of one VOC record; objects of unknown classes are counted in ``unknown``."""
    width, height = record.width, record.height
    if width <= 0 or height <= 0:
        width, height = image_header_size(image_path)
    rows = []
    for name, xmin, ymin, xmax, ymax, difficult in record.objects:
        unknown[name] += name not in class_index
        if name not in class_index or not (keep_difficult or not difficult):
            continue
        row = yolo_row(class_index[name], xmin - 1, ymin - 1, xmax - 1, ymax - 1, width, height)
        if row is None:
            LOGGER.warning("%s: %s box has no area inside the %gx%g image, dropped",
                           record.xml_path, shorten(name), width, height)
        rows.extend([row] if row else [])
    return rows


def _check_split(split: str | None) -> None:
    if split is not None and split not in SPLITS:
        raise AnnotationError(f"split {shorten(split)}: expected one of {', '.join(SPLITS)}")


def _write_sample(out_dir: Path, split: str, image_path: Path, rows: list[tuple], mode: str,
                  summary: ImportSummary) -> None:
    target = out_dir / "images" / split / image_path.name
    with writing(target):
        place_image(image_path, target, mode)
    label = out_dir / "labels" / split / f"{image_path.stem}.txt"
    with writing(label):
        write_labels(label, rows)
    summary.images[split] += 1
    summary.boxes += len(rows)


# ----------------------------------------------------------------------------- COCO


def _load_coco(path: Path) -> dict:
    """The images, annotations (optional: a test split's file has none) and categories of a COCO JSON file, read an
    item at a time (utils/data/json_stream.py: the file's text is never held whole); AnnotationError naming it."""
    data = {"images": [], "annotations": [], "categories": []}
    for key, item in iter_arrays(path, ("images", "annotations", "categories"), optional=("annotations",)):
        data[key].append(item)
    return data


def _field(entry, key: str, kind, path: Path, where: str):
    """entry[key] checked against ``kind`` (a type or tuple), else an AnnotationError naming the entry."""
    value = entry.get(key) if isinstance(entry, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise AnnotationError(f"{path}: {where} has no valid {key!r} (got {shorten(value)})")
    return value


def _coco_categories(data: dict, path: Path) -> tuple[dict[int, int], list[str]]:
    """category id -> 0..nc-1 in sorted id order, and the names in that order."""
    categories = {}
    for index, entry in enumerate(data["categories"]):
        category_id = _field(entry, "id", int, path, f"categories[{index}]")
        categories[category_id] = str(_field(entry, "name", (str, int), path, f"categories[{index}]"))
    if not categories:
        raise AnnotationError(f"{path}: no categories")
    ordered = sorted(categories)
    return {category_id: index for index, category_id in enumerate(ordered)}, [categories[i] for i in ordered]


def _coco_boxes(data: dict, path: Path, class_of: dict[int, int], image_ids: set,
                summary: ImportSummary) -> dict[int, list[tuple[int, float, float, float, float]]]:
    """image id -> [(class, x0, y0, x1, y1) pixels], crowd annotations skipped."""
    boxes: dict[int, list] = {}
    for index, entry in enumerate(data.get("annotations", [])):
        where = f"annotations[{index}]"
        image_id = _field(entry, "image_id", (int, str), path, where)
        category_id = _field(entry, "category_id", int, path, where)
        bbox = check_bbox(_field(entry, "bbox", list, path, where), path, where)
        if image_id not in image_ids or category_id not in class_of:
            raise AnnotationError(f"{path}: {where} refers to unknown image_id {shorten(image_id)} "
                                  f"or category_id {shorten(category_id)}")
        if entry.get("iscrowd"):
            summary.skipped_boxes += 1
            continue
        x, y, w, h = (float(v) for v in bbox)
        boxes.setdefault(image_id, []).append((class_of[category_id], x, y, x + w, y + h))
    return boxes


def coco_to_yolo(coco_json: str | os.PathLike, images_dir: str | os.PathLike, out_dir: str | os.PathLike,
                 split: str = "train", mode: str = "hardlink") -> ImportSummary:
    """Import one COCO JSON file (one split) whose ``file_name``s are relative to ``images_dir``.

    Run once per split into the same ``out_dir``; data.yaml lists every split present and refuses a
    second import whose categories differ.
    """
    path, images_dir, out_dir = Path(coco_json), Path(images_dir), Path(out_dir)
    _check_split(split)
    data = _load_coco(path)
    class_of, names = _coco_categories(data, path)
    check_names(names, path)
    check_existing_names(out_dir, names)
    images = {}
    for index, entry in enumerate(data["images"]):
        image_id = _field(entry, "id", (int, str), path, f"images[{index}]")
        images[image_id] = (_field(entry, "file_name", str, path, f"images[{index}]"), entry)
    summary = ImportSummary(out_dir / "data.yaml", names)
    boxes = _coco_boxes(data, path, class_of, set(images), summary)
    written: dict[str, object] = {}
    for image_id, (file_name, entry) in images.items():
        image_path, reason = find_image(images_dir, file_name, Path(file_name).stem)
        if image_path is None:
            LOGGER.warning("%s: image %s %s, skipped", path, shorten(file_name, 200), reason)
            summary.skipped_images += 1
            continue
        if written.setdefault(image_path.name, image_id) != image_id:
            raise AnnotationError(f"{path}: two images share the file name {shorten(image_path.name)}")
        rows = _coco_rows(boxes.get(image_id, []), entry, image_path, f"{path}: image {shorten(file_name, 200)}")
        summary.skipped_boxes += len(boxes.get(image_id, [])) - len(rows)
        _write_sample(out_dir, split, image_path, rows, mode, summary)
    summary.yaml_path = write_data_yaml(out_dir, names)
    LOGGER.info("COCO import: %s", summary.line())
    return summary


def check_bbox(value, path: Path, where: str) -> list:
    """A COCO-style ``bbox`` (x, y, w, h: 4 finite numbers) of the entry ``where``, or AnnotationError naming it."""
    if not (isinstance(value, list) and len(value) == 4 and all(map(finite_number, value))):
        raise AnnotationError(f"{path}: {where} bbox must be 4 finite numbers, got {shorten(value)}")
    return value


def finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _coco_rows(boxes: list[tuple], entry: dict, image_path: Path, where: str) -> list[tuple]:
    """YOLO rows of one COCO image; the size comes from the entry, else from the image header."""
    width, height = entry.get("width"), entry.get("height")
    if not (finite_number(width) and finite_number(height) and width > 0 and height > 0):
        width, height = image_header_size(image_path)
    rows = []
    for cls, x0, y0, x1, y1 in boxes:
        row = yolo_row(cls, x0, y0, x1, y1, width, height)
        if row is None:
            LOGGER.warning("%s has a box with no area inside the image, dropped", where)
        rows.extend([row] if row else [])
    return rows


# ----------------------------------------------------------------------------- VisDrone

VISDRONE_NAMES = ["pedestrian", "people", "bicycle", "car", "van", "truck", "tricycle", "awning-tricycle", "bus",
                  "motor"]


def visdrone_to_yolo(folder: str | os.PathLike) -> ImportSummary:
    """VisDrone DET annotations -> YOLO labels in place: ``folder``/annotations/NAME.txt with its image
    ``folder``/images/NAME.jpg give ``folder``/labels/NAME.txt (module doc); an annotation without its image is
    skipped with a warning; a line that is not 6 or more integers is an AnnotationError naming file and line."""
    folder = Path(folder)
    annotations, images = folder / "annotations", folder / "images"
    if not annotations.is_dir() or not images.is_dir():
        raise AnnotationError(f"{folder}: expected the VisDrone folders annotations/ and images/")
    summary = ImportSummary(folder / "labels", VISDRONE_NAMES)
    files = sorted(annotations.glob("*.txt"))
    if not files:
        raise AnnotationError(f"{annotations}: no .txt annotation files found")
    for path in files:
        image_path, reason = find_image(images, f"{path.stem}.jpg", path.stem)
        if image_path is None:
            LOGGER.warning("%s: image %s %s, skipped", path, shorten(f"{path.stem}.jpg", 200), reason)
            summary.skipped_images += 1
            continue
        objects = _visdrone_objects(path)
        width, height = image_header_size(image_path)
        rows = []
        for left, top, box_width, box_height, category in objects:
            row = yolo_row(category - 1, left, top, left + box_width, top + box_height, width, height) \
                if 1 <= category <= len(VISDRONE_NAMES) else None
            rows.extend([row] if row else [])
        summary.skipped_boxes += len(objects) - len(rows)
        label = folder / "labels" / f"{path.stem}.txt"
        with writing(label):
            write_labels(label, rows)
        summary.images[folder.name] += 1
        summary.boxes += len(rows)
    LOGGER.info("VisDrone labels: %s", summary.line())
    return summary


def _visdrone_objects(path: Path) -> list[tuple[int, int, int, int, int]]:
    """(left, top, width, height, category) of each line of score 1 (score 0: an ignored region)."""
    data = _read_at_most(path, MAX_ANNOTATION_TXT_BYTES)
    if data is None:
        raise AnnotationError(f"{path}: larger than {MAX_ANNOTATION_TXT_BYTES >> 20} MB, not a VisDrone annotation")
    objects = []
    for number, line in enumerate(data.decode("ascii", errors="replace").splitlines(), 1):
        fields = [field.strip() for field in line.strip().rstrip(",").split(",")]
        if fields == [""]:
            continue
        try:
            values = [int(field) for field in fields[:6]] if len(fields) >= 6 else None
        except ValueError:
            values = None
        if values is None or max(map(abs, values)) > MAX_VISDRONE_INTEGER:
            raise AnnotationError(f"{path}: line {number}: {shorten(line.strip(), 80)}: expected "
                                  "left,top,width,height,score,category,... as integers (up to 2^31)")
        if values[4] != 0:
            objects.append((values[0], values[1], values[2], values[3], values[5]))
    return objects


# ----------------------------------------------------------------------------- SKU-110K


def sku110k_to_yolo(folder: str | os.PathLike) -> ImportSummary:
    """SKU-110K's CSV annotations -> YOLO labels in place (module doc): ``folder``/labels/NAME.txt for each image
    ``folder``/images/NAME, and ``folder``/{train,val,test}.txt listing each split's images (sorted, those whose
    file is there; the others are counted and warned about). A row that is not 8 fields of a plain file name and
    numbers is an AnnotationError naming the file and line."""
    folder = Path(folder)
    annotations, images = folder / "annotations", folder / "images"
    if not annotations.is_dir() or not images.is_dir():
        raise AnnotationError(f"{folder}: expected the SKU-110K folders annotations/ and images/")
    summary = ImportSummary(folder / "labels", ["object"])
    started: set[str] = set()  # label files written in this import (a later row of the same image appends)
    for split in SPLITS:
        path = annotations / f"annotations_{split}.csv"
        if not path.is_file():
            raise AnnotationError(f"{path}: missing (SKU-110K lists each split in annotations/annotations_SPLIT.csv)")
        listed = []
        for name, rows, skipped in _sku110k_images(path):
            summary.skipped_boxes += skipped
            image = images / name
            if not _inside(image, images.resolve()):
                summary.skipped_images += 1
                continue
            label = folder / "labels" / f"{Path(name).stem}.txt"
            with writing(label):
                label.parent.mkdir(parents=True, exist_ok=True)
                with open(label, "a" if name in started else "w") as out:
                    out.writelines(f"{c} {x:.6f} {y:.6f} {w:.6f} {h:.6f}\n" for c, x, y, w, h in rows)
            started.add(name)
            listed.append(name)
            summary.boxes += len(rows)
        listing = folder / f"{split}.txt"
        with writing(listing):
            listing.write_text("".join(f"./images/{name}\n" for name in sorted(set(listed))))
        summary.images[split] += len(set(listed))
    if summary.skipped_images:
        LOGGER.warning("%s: %d images named in the annotations are not in %s, left out", annotations,
                       summary.skipped_images, images)
    LOGGER.info("SKU-110K labels: %s", summary.line())
    return summary


def _sku110k_images(path: Path):
    """(image name, YOLO rows, boxes dropped for no area) for each run of rows of one image in the CSV ``path``."""
    name, rows, skipped = None, [], 0
    for number, record in _csv_records(path):
        if not record or number == 1 and record[0].strip() == "image_name":  # a header line, if any
            continue
        box = _sku110k_row(record, path, number)
        if box[0] != name:
            if name is not None:
                yield name, rows, skipped
            name, rows, skipped = box[0], [], 0
        row = yolo_row(0, *box[1:])
        rows.extend([row] if row else [])
        skipped += row is None
    if name is not None:
        yield name, rows, skipped


def _csv_records(path: Path):
    """(line number, fields) of each line of the CSV ``path``, read a line at a time: a line is one record (a
    quoted field never spans lines) of at most MAX_CSV_LINE_BYTES of UTF-8; AnnotationError naming file and line."""
    try:
        with open(path, "rb") as file:
            for number, line in enumerate(iter(lambda: file.readline(MAX_CSV_LINE_BYTES + 1), b""), 1):
                if len(line) > MAX_CSV_LINE_BYTES:
                    raise AnnotationError(f"{path}: line {number}: longer than {MAX_CSV_LINE_BYTES} bytes, not a "
                                          "SKU-110K row")
                yield number, _csv_record(line, path, number)
    except OSError as error:
        raise AnnotationError(f"{path}: cannot read ({error.strerror or error})") from None


def _csv_record(line: bytes, path: Path, number: int) -> list[str]:
    try:
        return next(csv.reader([line.decode("utf-8")]), [])
    except UnicodeDecodeError as error:
        raise AnnotationError(f"{path}: line {number}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except csv.Error as error:
        raise AnnotationError(f"{path}: line {number}: {shorten(str(error), 120)}") from None


def _sku110k_row(record: list[str], path: Path, number: int) -> tuple:
    """(name, x1, y1, x2, y2, width, height) of one CSV row, or AnnotationError."""
    name = record[0].strip() if record else ""
    try:
        values = [float(record[index]) for index in (1, 2, 3, 4, 6, 7)] if len(record) == 8 else None
    except ValueError:
        values = None
    if values is None or not plain_file_name(name) or not all(math.isfinite(v) for v in values) or min(values[4:]) <= 0:
        raise AnnotationError(f"{path}: line {number}: {shorten(','.join(record), 120)}: expected "
                              "image_name,x1,y1,x2,y2,class,image_width,image_height (a file name and pixels)")
    return (name, *values)
