"""Bounds on values read from files and flags, in one place, each with the real need it leaves room for.

A value outside its bound is refused with a one-line error that shows the range, before anything is
built, allocated or read in full. The bounds are sanity limits, far above what real YOLOv5 models,
datasets and checkpoints use (the largest, yolov5x6 / yolov5-p7, are quoted), not tuning advice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """A closed or half-open interval of finite numbers, printed as ``[0, 1)``."""
    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


# ---------------------------------------------------------------- models (YAML rows and checkpoints)
MAX_CLASSES = 100_000  # LVIS has 1,203 classes, Objects365 365, ImageNet-21k 21,841
MAX_MULTIPLE = 10.0  # depth_multiple / width_multiple: yolov5x uses 1.33 / 1.25
MAX_REPEATS = 100  # a row's `number`, before and after depth scaling: yolov5x6 reaches 12
MAX_CHANNELS = 16_384  # any layer's output channels: yolov5x6 reaches 2,560 (a Concat)
MAX_ARGUMENT = 64  # other numbers in a row's args (kernel, stride, padding, scale): SPP uses 13
MAX_LAYERS = 1_000  # backbone + head rows: yolov5-p7 has 44
MAX_INPUT_CHANNELS = 64  # `ch`: 3 for RGB, a few more for multispectral inputs
MAX_LEVELS = 8  # Detect levels: yolov5-p7 has 5
MAX_ANCHORS_PER_LEVEL = 16  # YOLOv5 uses 3
MAX_ANCHOR_PIXELS = 100_000.0  # an anchor side in input pixels (the image size limit is 16,384)
MAX_PARAMETERS = 500_000_000  # yolov5x6 has 140.8 M, yolov5-p7 144.3 M (2 GB of float32 at the limit)
MAX_MODEL_MODULES = 10_000  # modules in one model: yolov5x6 has 575 (each takes ~0.2 ms to build)

# ---------------------------------------------------------------- checkpoints (YOLOv5 pickles)
MAX_PICKLE_BYTES = 32_000_000  # data.pkl: 87 KB for yolov5n, well under 2 MB for a yolov5x6 training file
# storages read for "model" + "ema" and a resumed YOLOv5 run's optimizer: yolov5x6 in float32 needs 1.13 GB; its
# YOLOv5 last.pt (fp16 model and EMA, SGD momentum in float32) 1.13 GB, with Adam 1.69 GB
MAX_TENSOR_BYTES = 2_000_000_000
MAX_TENSORS = 100_000  # tensors in one module tree: yolov5x6 has about 1,000
MAX_MODULES = 100_000  # module records walked in one tree: yolov5x6 has about 800
MAX_TENSOR_DIMS = 8
# items of all tuples a pickle builds, nested tuples counted in full (hashing a tuple key visits them all): a
# training checkpoint's Python generator states are 1,255 per process (8.2e7 at MAX_PROCESSES), a tensor's
# rebuild arguments about 40
MAX_TUPLE_WORK = 100_000_000

# ---------------------------------------------------------------- datasets and flags
MAX_NAME_LENGTH = 256  # characters in one class name
MAX_YAML_BYTES = 16 << 20  # a model, data or hyp YAML file
MAX_YAML_NODES = 1_000_000  # YAML nodes once aliases are expanded (a COCO data YAML has about 200)
MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 32, 16_384  # --imgsz: one stride-32 cell up to a 16K image side
MAX_IMAGE_PIXELS = 178_956_970  # decoded at most: PIL's decompression-bomb limit (2x Image.MAX_IMAGE_PIXELS),
# which YOLOv5's dataset check (PIL's verify) has too; an 8 MB 16-bit PNG can declare 32K x 32K (about 70 GB decoded)
MAX_BATCH_SIZE = 4_096
MAX_WORKERS = 1_024
MAX_DETECTIONS = 100_000  # --max-det: YOLOv5 defaults to 300 (val) and 1,000 (detect)
MAX_ANNOTATION_XML_BYTES = 8 << 20  # one Pascal VOC file is a few KB
MAX_ANNOTATION_TXT_BYTES = 8 << 20  # one VisDrone annotation file: a few KB (a line an object)
MAX_OPTION_TEXT = 4_096  # characters of a path or other text option stored in a checkpoint (PATH_MAX on Linux)
MAX_OPTION_ITEMS = 1_000  # items of a list option stored in a checkpoint (--freeze takes layer indices 0..1000)

# ---------------------------------------------------------------- run state of a resumable checkpoint
MAX_PROCESSES = 65_536  # processes of one training run (world size); large clusters use a few thousand GPUs
MAX_GLOBAL_STEP = 2 ** 48  # batches trained since the start: far beyond any run, and exact in a float64
