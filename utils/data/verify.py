"""Find every image of a split, verify it and its label file once, and cache the result safely.

Images map to labels by the YOLOv5 rule: the last ``/images/`` in the path becomes ``/labels/``,
same stem, ``.txt``. Each image must decode (the shape recorded is after EXIF orientation, as
``read_image`` returns it) and be at least ``MIN_SIZE`` px; its label rows must be
``class cx cy w h`` normalised to [0, 1] (or ``class x1 y1 x2 y2 ...`` polygons, kept as segments
and boxed). Bad files are skipped with one warning naming the file and the reason; fixable rows
(duplicates, zero-size boxes, boxes past the edge) are repaired with a warning.

Results are cached by ``utils.data.label_cache`` (no pickles; beside the labels folder only for a
dataset folder that is writable, else in the user cache folder; keyed on the files' real paths and
identities, so every path to one dataset shares one cache).
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
from pathlib import Path

import cv2
import numpy as np
from tqdm import tqdm

from utils.data.flat_labels import FlatLabels, concatenate
from utils.data.headers import ImageTooLarge, image_header
from utils.data.images import IMG_EXTENSIONS, applied_orientation, is_image_file, read_image
from utils.data.label_cache import LabelCache, SplitLabels, problem_message
from utils.errors import UserError
from utils.files import read_ahead
from utils.limits import MAX_IMAGE_PIXELS

LOGGER = logging.getLogger(__name__)

MIN_SIZE = 10  # pixels, both sides
EPS = 1e-6  # tolerance on the [0, 1] range of coordinates
COUNT_KEYS = ("found", "missing", "empty", "corrupt", "duplicates", "images", "label_files")
READ_AHEAD = 32  # images whose files are announced to the kernel ahead of their checks
CHUNK = 256  # images per task of the scan's process pool (and the fewest images worth starting one for)


class DatasetError(UserError):
    """A split that cannot be used at all (no images, no labels, nothing usable); one line."""


class Problem(ValueError):
    """Why one file is unusable (or what was repaired): ``category`` groups it, ``detail`` explains."""

    def __init__(self, category: str, detail: str):
        super().__init__(detail)
        self.category, self.detail = category, detail

    def __reduce__(self):  # scan workers send it back to the main process
        return Problem, (self.category, self.detail)


# ----------------------------------------------------------------------------- file lists
def img2label_paths(im_files: list[str]) -> list[str]:
    """Label path of each image: last '/images/' -> '/labels/', same stem, '.txt'."""
    images, labels = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    result = []
    for file in im_files:
        head, sep, tail = file.rpartition(images)
        mapped = head + labels + tail if sep else file
        result.append(os.path.splitext(mapped)[0] + ".txt")
    return result


def as_list(sources) -> list[str]:
    """One source or a list of them -> list of strings."""
    return [str(sources)] if isinstance(sources, (str, Path)) else [str(s) for s in sources]


def _is_hidden(path: Path, base: Path) -> bool:
    try:
        parts = path.relative_to(base).parts
    except ValueError:
        parts = (path.name,)
    return any(part.startswith(".") for part in parts)


def _read_list_file(file: Path) -> list[Path]:
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{file}: cannot read image list ({e})") from None
    entries = [Path(line.strip()) for line in lines if line.strip()]
    return [Path(os.path.abspath(p if p.is_absolute() else file.parent / p)) for p in entries]


def _folder_images(folder: str):
    """(path, hidden) of every image file below ``folder``: one ``os.scandir`` per folder (no stat for regular
    files, a large split's listing is seconds faster than Path.rglob + is_file). Symbolic links to folders are
    followed, as YOLOv5's recursive glob follows them (a split merged from linked folders), each folder listed once
    (a link back up, or a second link to a listed folder, adds nothing); unreadable folders are skipped, links to files
    followed (as is_file); ``hidden``: a part of the path below ``folder`` starts with a dot."""
    stack, listed = [(folder, False)], set()
    while stack:
        current, hidden = stack.pop()
        try:
            info = os.stat(current)
            if (info.st_dev, info.st_ino) in listed:
                continue
            listed.add((info.st_dev, info.st_ino))
            with os.scandir(current) as listing:
                entries = list(listing)
        except OSError:
            continue
        for entry in entries:
            entry_hidden = hidden or entry.name.startswith(".")
            try:
                if entry.is_dir():
                    stack.append((entry.path, entry_hidden))
                elif os.path.splitext(entry.name)[1][1:].lower() in IMG_EXTENSIONS and entry.is_file():
                    yield entry.path, entry_hidden
            except OSError:
                continue


def collect_image_files(sources: list[str] | str) -> tuple[list[str], list[str]]:
    """(sorted image files, messages about ignored entries) for folders, .txt lists and image files."""
    files, ignored = set(), []
    for source in as_list(sources):
        source = Path(os.path.abspath(Path(source).expanduser()))
        if source.is_dir():
            found = list(_folder_images(str(source)))
        elif source.suffix.lower() == ".txt" and source.is_file():
            candidates = _read_list_file(source)
            ignored += [f"{p}: listed in {source.name} but missing" for p in candidates if not p.exists()]
            found = [(str(p), _is_hidden(p, p.parent)) for p in candidates if p.exists() and is_image_file(p)]
        elif source.is_file():
            found = [(str(source), _is_hidden(source, source.parent))] if is_image_file(source) else []
        else:
            raise DatasetError(f"{source}: does not exist")
        ignored += [f"{path}: hidden file ignored" for path, hidden in sorted(found) if hidden]
        files.update(path for path, hidden in found if not hidden)
    return sorted(files), ignored


def list_image_files(sources: list[str] | str) -> list[str]:
    """Sorted image files of ``sources``; hidden files are skipped with a warning."""
    files, ignored = collect_image_files(sources)
    for message in ignored:
        LOGGER.warning(message)
    return files


# ----------------------------------------------------------------------------- one image
def image_size(path: str) -> tuple[int, int, int]:
    """(width, height, orientation): the size after EXIF orientation and the orientation ``read_image``
    applies (1..8), recorded so that loading never parses the header again; the pixel data must decode.
    Raises Problem. The file is read once: its header and its pixel data are checked from the same bytes."""
    try:
        data = np.fromfile(path, dtype=np.uint8)
    except OSError as e:
        raise Problem("unreadable image", f"cannot read image ({e.strerror or e})") from None
    if data.size == 0:
        raise Problem("empty image file", "empty image file (0 bytes)")
    try:
        header = image_header(data)
    except ImageTooLarge as error:
        raise Problem("image too large", f"image too large ({error}; at most {MAX_IMAGE_PIXELS:,} pixels are "
                      "decoded)") from None
    if header is None:  # PIL does not know it: decode fully with the training decoder (no EXIF then)
        try:
            height, width = read_image(path, orientation=1).shape[:2]
        except ValueError:  # (too large is found above: read_image's header check reads what image_header reads)
            raise Problem("not an image", "not an image (unknown or corrupt format)") from None
        _check_size(width, height)
        return width, height, 1
    kind, width, height, orientation = header
    _check_size(width, height)
    _check_decodes(data, kind)
    orientation = applied_orientation(path, orientation)
    if orientation in (5, 6, 7, 8):
        width, height = height, width
    return width, height, orientation


def _check_size(width: int, height: int) -> None:
    if min(width, height) < MIN_SIZE:
        raise Problem("image too small", f"image too small ({width}x{height} px, minimum {MIN_SIZE})")
    if width * height > MAX_IMAGE_PIXELS:  # checked before the pixel data is decoded
        raise Problem("image too large", f"image too large ({width}x{height} px; at most {MAX_IMAGE_PIXELS:,} "
                      "pixels are decoded)")


def _check_decodes(data: np.ndarray, kind: str) -> None:
    """The pixel data decodes as read_image would; JPEGs at 1/8 scale (same entropy decode, ~6x faster)."""
    flags = cv2.IMREAD_REDUCED_GRAYSCALE_8 | cv2.IMREAD_IGNORE_ORIENTATION if kind == "JPEG" else cv2.IMREAD_UNCHANGED
    try:
        image = cv2.imdecode(data, flags)
    except cv2.error:
        image = None
    if image is None or image.size == 0:
        raise Problem("corrupt image", "cannot decode image (truncated or corrupt data)")


# ----------------------------------------------------------------------------- one label file
def _parse_rows(text: str) -> list[tuple[int, list[float]]]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        tokens = line.split()
        if not tokens:
            continue
        try:
            values = [float(token) for token in tokens]
        except ValueError:
            raise Problem("unparsable label line", f"unparsable label line {number}: '{line.strip()[:40]}'") from None
        if len(values) != 5 and (len(values) < 7 or len(values) % 2 == 0):
            raise Problem("wrong number of columns", f"wrong number of columns ({len(values)}) on line {number}: "
                          "expected 5 (class cx cy w h) or a polygon (class x1 y1 x2 y2 x3 y3 ...)")
        rows.append((number, values))
    return rows


def _check_row(number: int, values: list[float], nc: int, single_cls: bool) -> None:
    """Raise Problem for the first rule a row breaks (plain Python: rows are short, numpy is slower)."""
    if not all(math.isfinite(v) for v in values):
        raise Problem("non-finite value", f"non-finite value on line {number}")
    cls = values[0]
    if cls != int(cls):
        raise Problem("non-integer class id", f"class id {cls:g} is not an integer (line {number})")
    if cls < 0:
        raise Problem("negative class id", f"negative class id {int(cls)} (line {number})")
    if nc is not None and cls >= nc and not single_cls:
        raise Problem("class out of range", f"class {int(cls)} out of range (data has {nc} classes) on line {number}")
    coords = values[1:]
    if len(values) != 5:  # a polygon: its box's centre and size are checked, as YOLOv5 checks them, so that points
        xs, ys = coords[0::2], coords[1::2]  # a little past the edge (annotation tools overshoot) are clipped
        coords = [(min(xs) + max(xs)) / 2, (min(ys) + max(ys)) / 2, max(xs) - min(xs), max(ys) - min(ys)]
    if max(coords) > 1 + EPS:
        raise Problem("coordinates not normalised", f"coordinates not normalised (> 1, pixel values?) on line {number}")
    if min(coords) < -EPS:
        raise Problem("negative coordinates", f"negative coordinates on line {number}")


def _row_to_box(values: list[float]) -> tuple[list[float], list[float] | None]:
    """(x1, y1, x2, y2) (not clipped) and the polygon's flat coordinates clipped to the image, or None for a box row."""
    if len(values) == 5:
        _, cx, cy, w, h = values
        return [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], None
    xs, ys = values[1::2], values[2::2]
    return [min(xs), min(ys), max(xs), max(ys)], [min(max(v, 0.0), 1.0) for v in values[1:]]


def _rectangle(box: list[float]) -> np.ndarray:
    x1, y1, x2, y2 = box
    return np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]], dtype=np.float32)


def clean_boxes(text: str, nc: int, single_cls: bool) -> np.ndarray | None:
    """The (n, 5) labels of a file whose every line is a distinct box row that breaks no rule and needs no
    repair, checked for all rows at once; None otherwise (then the row-by-row parser decides, with its
    messages). Gives exactly what the row-by-row parser gives for such a file (the same float arithmetic)."""
    rows = [line.split() for line in text.splitlines()]
    rows = [tokens for tokens in rows if tokens]
    if not rows or any(len(tokens) != 5 for tokens in rows):
        return None
    try:
        values = np.array([[float(token) for token in tokens] for tokens in rows], np.float64)
    except ValueError:
        return None
    cls, coords = values[:, 0], values[:, 1:]
    if not (np.isfinite(values).all() and (cls == np.trunc(cls)).all() and (cls >= 0).all()
            and (single_cls or nc is None or (cls < nc).all()) and coords.max() <= 1 + EPS and coords.min() >= -EPS):
        return None
    if len({tuple(row) for row in values.tolist()}) != len(values):
        return None  # duplicates: the row-by-row parser removes them with a note
    half = coords[:, 2:] / 2
    box = np.concatenate([coords[:, :2] - half, coords[:, :2] + half], 1)
    inside = box.clip(0.0, 1.0)
    if (np.abs(inside - box) > EPS).any() or (inside[:, 2] - inside[:, 0] <= 0).any() or (
            inside[:, 3] - inside[:, 1] <= 0).any():
        return None  # clipped or zero-size boxes: repaired with a note there
    return _to_labels(np.zeros(len(cls)) if single_cls else cls, inside, [None] * len(inside))[0]


def parse_label_file(path: str, nc: int, single_cls: bool = False):
    """((labels (n, 5) float32, segments), notes list[Problem], duplicates removed). Raises Problem."""
    try:
        with open(path, "rb") as file:
            text = file.read().decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise Problem("unreadable label file", f"cannot read label file {path} ({e})") from None
    return parse_label_file_text(text, nc, single_cls)


def parse_label_file_text(text: str, nc: int, single_cls: bool = False):
    """``parse_label_file`` on a file's decoded text."""
    labels = clean_boxes(text, nc, single_cls)  # the common case, in a few array operations
    if labels is not None:
        return (labels, []), [], 0
    return parse_rows_one_by_one(text, nc, single_cls)


def parse_rows_one_by_one(text: str, nc: int, single_cls: bool = False):
    """``parse_label_file``'s result for any text: each row checked (Problem for the first broken rule) and
    repaired (duplicates removed, boxes clipped, zero-size boxes dropped) with notes."""
    seen, boxes, classes, polygons = set(), [], [], []
    duplicates = clipped = zero = 0
    for number, values in _parse_rows(text):
        _check_row(number, values, nc, single_cls)
        key = tuple(values)
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        box, polygon = _row_to_box(values)
        inside = [min(max(v, 0.0), 1.0) for v in box]
        clipped += int(any(abs(a - b) > EPS for a, b in zip(inside, box)))
        if inside[2] - inside[0] <= 0 or inside[3] - inside[1] <= 0:
            zero += 1
            continue
        boxes.append(inside), classes.append(0 if single_cls else int(values[0])), polygons.append(polygon)
    notes = []
    if duplicates:
        notes.append(Problem("duplicate rows removed", f"{duplicates} duplicate row{'s' * (duplicates > 1)} removed"))
    if zero:
        notes.append(Problem("zero-size box dropped", f"{zero} zero-size box{'es' * (zero > 1)} dropped"))
    if clipped:
        notes.append(Problem("box clipped to image", f"{clipped} box{'es' * (clipped > 1)} past the edge clipped"))
    return _to_labels(classes, boxes, polygons), notes, duplicates


def _to_labels(classes, boxes, polygons) -> tuple[np.ndarray, list[np.ndarray]]:
    if not len(boxes):
        return np.zeros((0, 5), np.float32), []
    xyxy = np.asarray(boxes, np.float64)
    xywh = np.concatenate([(xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]], 1)
    labels = np.concatenate([np.asarray(classes, np.float64)[:, None], xywh], 1).astype(np.float32)
    if all(p is None for p in polygons):
        return labels, []
    return labels, [np.asarray(p, np.float32).reshape(-1, 2) if p is not None else _rectangle(b)
                    for p, b in zip(polygons, boxes)]


def verify_one(item: tuple[str, str, int, bool]) -> dict:
    """Verify one (image, label file); returns a plain record (used or skipped, with reasons)."""
    im_file, label_file, nc, single_cls = item
    record = {"file": im_file, "shape": None, "orientation": 1, "labels": None, "segments": [], "notes": [],
              "problem": None, "missing": not os.path.isfile(label_file), "duplicates": 0}
    try:
        *record["shape"], record["orientation"] = image_size(im_file)
        if record["missing"]:
            record["labels"] = np.zeros((0, 5), np.float32)
            return record
        (record["labels"], record["segments"]), record["notes"], record["duplicates"] = parse_label_file(
            label_file, nc, single_cls)
    except Problem as problem:
        record["problem"] = problem
    return record


# ----------------------------------------------------------------------------- split scan
def verify_chunk(items: list) -> SplitLabels:
    """``verify_one`` over consecutive items, collected into one compact result (a scan worker's task). The
    files READ_AHEAD items ahead are announced to the kernel first, so that on a cold disk their reads run
    while earlier files are checked instead of one at a time."""
    records = []
    _read_ahead(items[:READ_AHEAD])
    for start in range(0, len(items), READ_AHEAD):
        _read_ahead(items[start + READ_AHEAD:start + 2 * READ_AHEAD])
        records += [verify_one(item) for item in items[start:start + READ_AHEAD]]
    return _collect(records)


def _read_ahead(items: list) -> None:
    read_ahead(path for item in items for path in item[:2])  # image and label file


def _ignore_interrupts() -> None:
    """Scan workers: Ctrl-C reaches the whole process group; the main process alone handles it (and ends them).
    OpenCV's thread count is left alone: cv2.setNumThreads(1) in a process forked while OpenCV's own threads
    existed waits forever (OpenCV 5.0, seen here); decoding a header does not use those threads anyway."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_checks(items: list, workers: int, description: str) -> SplitLabels:
    """Verify every item, in order, with a progress bar: in a pool of ``workers`` processes for large splits
    (reading headers and label text is Python work that threads would run one at a time), in this process
    for small ones. Each task is a chunk of CHUNK items that comes back as one compact result."""
    chunks = [items[start:start + CHUNK] for start in range(0, len(items), CHUNK)]
    parts = []
    with tqdm(total=len(items), desc=description, unit="img", disable=None, leave=False) as bar:
        if workers > 1 and len(chunks) > 1 and not multiprocessing.current_process().daemon:
            with multiprocessing.get_context().Pool(min(workers, len(chunks)), _ignore_interrupts) as pool:
                for part in pool.imap(verify_chunk, chunks):
                    parts.append(part), bar.update(part.stats["images"] + part.stats["corrupt"])
        else:
            for chunk in chunks:
                parts.append(verify_chunk(chunk)), bar.update(len(chunk))
    return _merge(parts)


def _collect(records: list[dict]) -> SplitLabels:
    stats = dict.fromkeys(COUNT_KEYS, 0)
    problems, im_files, labels, segments, shapes, orientations = [], [], [], [], [], []
    for record in records:
        stats["label_files"] += int(not record["missing"])
        problem = record["problem"]
        if problem is not None:
            stats["corrupt"] += 1
            problems.append({"file": record["file"], "category": problem.category, "detail": problem.detail,
                             "action": "skipped"})
            continue
        for note in record["notes"]:
            problems.append({"file": record["file"], "category": note.category, "detail": note.detail,
                             "action": "repaired"})
        stats["missing" if record["missing"] else "found"] += 1
        stats["empty"] += int(not record["missing"] and len(record["labels"]) == 0)
        stats["duplicates"] += record["duplicates"]
        im_files.append(record["file"]), labels.append(record["labels"])
        segments.append(record["segments"]), shapes.append(record["shape"])
        orientations.append(record["orientation"])
    stats["images"] = len(im_files)
    flat = FlatLabels.from_lists(im_files, labels, segments, np.asarray(shapes, np.int64).reshape(-1, 2),
                                 orientations)
    return SplitLabels(flat, stats, [problem_message(p) for p in problems], problems)


def _merge(parts: list[SplitLabels]) -> SplitLabels:
    """The chunks' results joined in order (counts added, problems and images one after another)."""
    stats = {key: sum(part.stats[key] for part in parts) for key in COUNT_KEYS}
    problems = [problem for part in parts for problem in part.problems]
    return SplitLabels(concatenate([part.flat for part in parts]), stats, [problem_message(p) for p in problems],
                       problems)


def _with_ignored(result: SplitLabels, ignored: list[str]) -> SplitLabels:
    """``result`` with the entries the file listing ignored (hidden files, missing list entries) first."""
    problems = []
    for message in ignored:
        file, _, detail = message.partition(": ")
        problems.append({"file": file, "category": detail, "detail": detail, "action": "ignored"})
    result.problems = problems + [p for p in result.problems if p["action"] != "ignored"]
    result.messages = [problem_message(p) for p in result.problems]
    return result


def summary_line(result: SplitLabels, prefix: str, where: str) -> str:
    stats = result.stats
    backgrounds = stats["missing"] + stats["empty"]
    parts = [f"{stats['images']} images", f"{backgrounds} background{'s' * (backgrounds != 1)}",
             f"{stats['corrupt']} corrupt"]
    if stats["duplicates"]:
        parts.append(f"{stats['duplicates']} duplicate{'s' * (stats['duplicates'] != 1)} removed")
    return f"{prefix}Scanning {where}... " + ", ".join(parts)


def display_sources(sources: list[str]) -> str:
    shown = []
    for source in sources:
        relative = os.path.relpath(source) if os.path.isabs(source) else source
        shown.append(source if relative.startswith("..") else relative)
    return ", ".join(shown)


def verify_split(sources, nc: int | None, prefix: str = "", cache_dir=None, workers: int | None = None,
                 single_cls: bool = False, use_cache: bool = True) -> SplitLabels:
    """Scan and verify a split (cached) without judging whether it is usable; logs warnings + summary. ``nc`` None
    takes any class id, as YOLOv5's dataset does, which leaves the range to its caller (utils.dataloaders)."""
    sources = as_list(sources)
    im_files, ignored = collect_image_files(sources)
    if not im_files:
        raise DatasetError(f"{prefix}no images found in {display_sources(sources)} "
                           f"(supported extensions: {', '.join(IMG_EXTENSIONS)}, any case)")
    label_files = img2label_paths(im_files)
    cache = LabelCache(im_files, label_files, nc, single_cls, cache_dir) if use_cache else None
    result = cache.load() if cache else None
    if result is None:
        items = [(im, lb, nc, single_cls) for im, lb in zip(im_files, label_files)]
        if workers is None:
            from utils.device import usable_cpus  # imports torch: only when a scan is needed

            workers = usable_cpus()
        result = _run_checks(items, max(1, workers), f"{prefix}Scanning {display_sources(sources)}")
        if cache:
            cache.save(result)
    result = _with_ignored(result, ignored)
    for message in result.messages:
        LOGGER.warning(f"{prefix}{message}")
    LOGGER.info(summary_line(result, prefix, display_sources(sources)))
    return result


def scan_split(sources, nc: int | None, prefix: str = "", cache_dir=None, workers: int | None = None,
               single_cls: bool = False, use_cache: bool = True) -> SplitLabels:
    """``verify_split`` that raises ``DatasetError`` when the split has no label files or no usable image."""
    result = verify_split(sources, nc, prefix, cache_dir, workers, single_cls, use_cache)
    if not result.im_files:
        raise DatasetError(f"{prefix}no usable images in {display_sources(as_list(sources))}: "
                           f"all {result.stats['corrupt']} are corrupt (see the warnings above)")
    if result.stats["label_files"] == 0:
        example, label = result.im_files[0], img2label_paths(result.im_files[:1])[0]
        raise DatasetError(f"{prefix}no label files found: looked in {os.path.dirname(label)} (rule: the last "
                           f"/images/ in an image path becomes /labels/, same stem, .txt: {example} -> {label})")
    return result
