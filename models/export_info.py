"""What an exported model says about itself (``ExportInfo``), and the checks on it when it is read back.

An exported file's metadata was written by whoever made the file, so every field is checked before
anything uses it: its type, its range (the command line's bounds, from utils/limits.py) and, for text,
its size before it is parsed or put into a message. ``info_from_metadata`` raises ``MetadataError``
(a ValueError) naming the field; the backends (models/backends.py) add the file's name.

Fields (``METADATA_KEYS``; YOLOv5's exports carry only ``stride`` and ``names``, plus ``shape`` in
TorchScript, and the rest comes from the graph's input shape):

    format         "yolo-trainer-export/1", or absent (YOLOv5)
    names          1 to MAX_CLASSES names of at most MAX_NAME_LENGTH characters: a list, an
                   {index: name} dict with indices 0..n-1, or such a dict as a Python literal (YOLOv5)
    nc             len(names), when present
    stride         an integer in [1, MAX_STRIDE]
    imgsz          [height, width]: multiples of the stride up to MAX_IMAGE_SIZE (free for --dynamic)
    batch          an integer in [1, MAX_BATCH_SIZE]
    dynamic, half, int8, channels_last   true or false (int8: weights and activations quantised; absent: false)
    device         "cpu", "cuda", "mps" or absent
"""
from __future__ import annotations

import ast
from dataclasses import asdict, dataclass

from utils.errors import shorten
from utils.limits import MAX_BATCH_SIZE, MAX_CLASSES, MAX_IMAGE_SIZE, MAX_NAME_LENGTH, MAX_PICKLE_BYTES

EXPORT_FORMAT = "yolo-trainer-export/1"
METADATA_KEYS = ("format", "names", "nc", "stride", "imgsz", "batch", "dynamic", "half", "int8", "channels_last",
                 "device")
DEVICE_TYPES = ("cpu", "cuda", "mps")
MAX_STRIDE = 1_024  # a model's largest stride: P5 models use 32, P6 64, P7 128
# Characters of one file's metadata text, checked before it is parsed: the budget of a checkpoint's
# pickle (utils/limits.py), room for MAX_CLASSES names of MAX_NAME_LENGTH characters.
MAX_METADATA_CHARS = MAX_PICKLE_BYTES
# YOLOv5's names as a Python dict literal, parsed with ast.literal_eval: its syntax tree takes many times
# the text's size in memory, so this bound is tighter (still 20 characters per name at MAX_CLASSES).
MAX_LITERAL_CHARS = 2_000_000


class MetadataError(ValueError):
    """A metadata field that is missing or out of bounds; the message names the field."""


@dataclass(frozen=True)
class ExportInfo:
    """What an exported file says about itself (``METADATA_KEYS``)."""
    names: tuple
    stride: int
    imgsz: tuple  # (height, width) the file was exported for
    batch: int
    dynamic: bool = False
    half: bool = False
    int8: bool = False  # export.py --int8: int8 weights and activations (LiteRT, ExecuTorch)
    channels_last: bool = False
    device: str | None = None  # device type traced on ("cpu", "cuda"); None when the file does not say
    format: str = EXPORT_FORMAT

    @property
    def nc(self) -> int:
        return len(self.names)

    def to_dict(self) -> dict:
        values = asdict(self)
        values.update(names=list(self.names), imgsz=list(self.imgsz), nc=self.nc)
        return {key: values[key] for key in METADATA_KEYS}


def info_from_metadata(values, input_shape=None) -> ExportInfo:
    """ExportInfo from a file's metadata mapping (our keys, or YOLOv5's ``stride``/``names``/``shape``).

    ``input_shape`` (B, C, H, W) of the graph, None for a free axis, fills in what YOLOv5 files lack and
    must agree with the metadata. Raises MetadataError naming the field.
    """
    if not isinstance(values, dict):
        raise MetadataError(f"not a mapping of fields ({type(values).__name__})")
    fmt = values.get("format")
    if fmt is not None and fmt != EXPORT_FORMAT:
        raise MetadataError(f"'format' {shorten(fmt)} is not {EXPORT_FORMAT!r} (written by another version?)")
    names = check_names(required(values, "names"))
    if "nc" in values and not (is_integer(values["nc"]) and values["nc"] == len(names)):
        raise MetadataError(f"'nc' {shorten(values['nc'])} but {len(names)} names")
    stride = check_count(required(values, "stride"), "stride", 1, MAX_STRIDE)
    graph_shape = check_shape(input_shape, "the model's input shape")
    shape = check_shape(values.get("shape"), "shape") or graph_shape  # YOLOv5 TorchScript: "shape"
    dynamic = check_flag(values, "dynamic", not is_static(shape))
    imgsz = values.get("imgsz")
    imgsz = check_imgsz(imgsz if imgsz is not None else (shape[2:4] if shape else None), stride, dynamic)
    batch = values.get("batch")
    batch = batch if batch is not None else (shape[0] if shape else None)
    batch = 1 if batch is None else check_count(batch, "batch", 1, MAX_BATCH_SIZE)
    device = values.get("device")
    if device is not None and device not in DEVICE_TYPES:
        raise MetadataError(f"'device' must be one of {', '.join(DEVICE_TYPES)}, got {shorten(device)}")
    info = ExportInfo(names=names, stride=stride, imgsz=imgsz, batch=batch, dynamic=dynamic,
                      half=check_flag(values, "half", False), int8=check_flag(values, "int8", False),
                      channels_last=check_flag(values, "channels_last", False),
                      device=device)
    check_graph_agrees(info, graph_shape)
    return info


def required(values: dict, key: str):
    if key not in values:
        raise MetadataError(f"missing '{key}'")
    return values[key]


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_count(value, field: str, low: int, high: int) -> int:
    if not (is_integer(value) and low <= value <= high):
        raise MetadataError(f"'{field}' must be an integer in [{low}, {high}], got {shorten(value)}")
    return value


def check_flag(values: dict, field: str, default: bool) -> bool:
    value = values.get(field, default)
    if not isinstance(value, bool):
        raise MetadataError(f"'{field}' must be true or false, got {shorten(value)}")
    return value


def is_static(shape) -> bool:
    return bool(shape) and all(is_integer(dim) and dim > 0 for dim in shape)


def check_shape(shape, field: str):
    """A (B, C, H, W) shape: four integers or None (a free axis); None when there is none."""
    if shape is None:
        return None
    if not (isinstance(shape, (list, tuple)) and len(shape) == 4
            and all(dim is None or (is_integer(dim) and 0 < dim <= MAX_IMAGE_SIZE) for dim in shape)):
        raise MetadataError(f"'{field}' must be 4 sizes in [1, {MAX_IMAGE_SIZE}] (batch, channels, height, width), "
                            f"got {shorten(shape)}")
    return tuple(shape)


def check_imgsz(imgsz, stride: int, dynamic: bool):
    """(height, width), multiples of ``stride`` within the --imgsz bound; None for a --dynamic file without one."""
    if imgsz is None or (isinstance(imgsz, (list, tuple)) and len(imgsz) == 2 and None in imgsz):
        if dynamic:
            return None
        raise MetadataError("missing 'imgsz' (and the model's input has no fixed size)")
    valid = isinstance(imgsz, (list, tuple)) and len(imgsz) == 2 and all(
        is_integer(side) and 0 < side <= MAX_IMAGE_SIZE and side % stride == 0 for side in imgsz)
    if not valid:
        raise MetadataError(f"'imgsz' must be [height, width], multiples of the stride {stride} up to "
                            f"{MAX_IMAGE_SIZE}, got {shorten(imgsz)}")
    return tuple(imgsz)


def check_names(value) -> tuple:
    """The class names as a tuple of short strings (integers are taken as their digits)."""
    if isinstance(value, str):
        value = parse_literal(value)
    if isinstance(value, dict):
        value = names_from_dict(value)
    if not (isinstance(value, (list, tuple)) and 1 <= len(value) <= MAX_CLASSES):
        raise MetadataError(f"'names' must be a list or {{index: name}} dict of 1 to {MAX_CLASSES} names, "
                            f"got {shorten(value)}")
    names = []
    for index, name in enumerate(value):
        if is_integer(name) and abs(name) < 10 ** 18:
            name = str(name)
        if not isinstance(name, str) or len(name) > MAX_NAME_LENGTH:
            raise MetadataError(f"'names' entry {index} must be a text of at most {MAX_NAME_LENGTH} characters, "
                                f"got {shorten(name)}")
        names.append(name)
    return tuple(names)


def parse_literal(text: str):
    """YOLOv5's names as text (a Python dict literal), read without eval and within MAX_LITERAL_CHARS."""
    if len(text) > MAX_LITERAL_CHARS:
        raise MetadataError(f"'names' is a text of {len(text):,} characters, more than {MAX_LITERAL_CHARS:,}")
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise MetadataError(f"'names' must be a list or dict literal, got {shorten(text)}") from None


def names_from_dict(value: dict) -> list:
    """{0: 'a', 1: 'b'} (keys as integers or digit strings, JSON's) in index order; keys must be 0..n-1."""
    if not 1 <= len(value) <= MAX_CLASSES:
        raise MetadataError(f"'names' must hold 1 to {MAX_CLASSES} names, got {len(value):,}")
    indices = {}
    for key in value:
        index = key if is_integer(key) else (int(key) if isinstance(key, str) and len(key) <= 6 and key.isdecimal()
                                             else None)
        if index is None or not 0 <= index < len(value) or index in indices:
            raise MetadataError(f"'names' keys must be the indices 0 to {len(value) - 1}, got {shorten(key)}")
        indices[index] = key
    return [value[indices[index]] for index in range(len(value))]


def check_graph_agrees(info: ExportInfo, graph_shape) -> None:
    """A graph with a fixed input shape must be the size and batch the metadata says (and not --dynamic)."""
    if not is_static(graph_shape):
        return
    if info.dynamic:
        raise MetadataError(f"'dynamic' is true but the model's input has the fixed shape {list(graph_shape)}")
    if (info.batch, *info.imgsz) != (graph_shape[0], *graph_shape[2:]):
        raise MetadataError(f"'imgsz' {list(info.imgsz)} and 'batch' {info.batch} do not match the model's input "
                            f"shape {list(graph_shape)}")
