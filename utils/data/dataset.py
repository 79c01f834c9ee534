"""YoloDataset: one image and its labels per item, with YOLOv5 v7's training augmentations.

Item format (``dataset[i]``): ``(image, labels, path, shapes)`` where image is a uint8 tensor
(3, H, W) RGB stored channels-last (``to_rgb_tensor``), labels a float32 tensor (n, 6) ``[0, class, cx, cy, w, h]`` normalised to the
returned image (column 0 is filled with the image's index in the batch by ``collate``), and shapes
``((h0, w0), ((ratio_h, ratio_w), (pad_w, pad_h)))`` mapping boxes back to the original image, or
None for a mosaic.

Augmentation is a pure function of ``(seed, epoch, index)``: each item draws from its own numpy
Generator, so results do not depend on worker count or order. The epoch reaches worker processes
with the index itself (the loader's sampler yields ``(index, epoch)``), so persistent workers never
need their copy of the dataset updated; ``set_epoch`` covers direct use and ``workers=0``.

Memory: file names, labels, segments and sizes are flat arrays (``utils.data.flat_labels``), and cached
images are one shared store per machine (``utils.data.image_cache``): a loader worker reads both without
copying their pages, whatever the split's size and whatever the workers' start method.

Image weights (``--image-weights``): the trainer computes per-class weights each epoch (e.g.
``class_weights(labels, nc)`` times ``(1 - maps) ** 2``) and calls
``utils.data.loader.set_loader_image_weights(loader, class_weights)``, which stores
``dataset.image_weights(class_weights)`` in the sampler, which then draws indices with those weights, and in the
dataset (``set_partner_weights``), whose mosaics then draw their other three images by the same weights, as
YOLOv5's draw from its weighted indices (with ``mosaic_partners="batch"``: the batch's distinct other images,
which those weights drew). The weights reach persistent workers through one shared-memory array, written between
epochs (an --image-weights run starts each epoch's iterator after setting them), so an item stays a function of
(seed, epoch, index) and the epoch's weights, which come from the run state.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from utils.boxes import xywhn2xyxy
from utils.cli import MOSAIC_PARTNERS
from utils.config import Hyp
from utils.data import old_caches
from utils.data.batch_slots import handed_over
from utils.data.flat_labels import FlatLabels
from utils.data.image_cache import StoreRequest, fits_shared_memory, shared_image_store
from utils.data.image_store import CacheError, layout
from utils.data.images import apply_orientation, file_orientation, read_image
from utils.data.transforms import (FILL, apply_warp, augment_hsv, copy_paste, letterbox, mixup, mosaic4,
                                   perspective_matrix, random_flips, random_perspective, source_window)
from utils.dist import is_main_process
from utils.host_memory import available_memory

LOGGER = logging.getLogger(__name__)

_REDUCED_FLAGS = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}
RAM_SAFETY = 1.1  # need this many times the estimate to cache in RAM
AUTO_CACHE_SHARE = 0.1  # --cache auto: cache in RAM when the machine's one copy needs at most this share of the
AUTO_CACHE_LIMIT = 1 << 30  # available memory, and at most this many bytes unless /dev/shm holds it
CACHE_MODES = ("ram", "disk")


@dataclass
class LabelSet:
    """Per-image lists for in-memory datasets (``SplitLabels`` holds the same as flat arrays)."""
    im_files: list
    labels: list
    shapes: np.ndarray
    segments: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Decoding and caching
# ---------------------------------------------------------------------------------------------

JPEG_SUFFIXES = (".jpg", ".jpeg")


def reduce_factor(width: int, height: int, target_long: int, path: str) -> int:
    """Largest JPEG DCT reduction (1, 2, 4, 8) that still decodes at least the size we resize to."""
    if not str(path).lower().endswith(JPEG_SUFFIXES):
        return 1
    ratio = target_long / max(width, height)
    if ratio > 0.5:
        return 1
    need_w, need_h = math.ceil(width * ratio), math.ceil(height * ratio)
    long0, short0 = max(width, height), min(width, height)
    long1, short1 = max(need_w, need_h), min(need_w, need_h)
    for factor in (8, 4, 2):
        if factor * long1 <= long0 and factor * short1 <= short0:
            return factor
    return 1


def read_jpeg(path: str, factor: int = 1, orientation: int | None = None) -> np.ndarray:
    """Fast JPEG decode with the same result as ``read_image`` (at 1/``factor`` size when > 1).

    Decodes 8-bit BGR ignoring EXIF, then applies ``orientation`` with the images module's own
    helper (read from the header when not given; the scan records it, since parsing the header with
    PIL costs about as much as half a decode). DCT-scaled decoding (factor 2/4/8) is several times
    faster than decode + resize. Non-JPEG files and any failure go through ``read_image``.
    """
    if not str(path).lower().endswith(JPEG_SUFFIXES):
        return read_image(path, orientation)
    flags = (_REDUCED_FLAGS[factor] if factor > 1 else cv2.IMREAD_COLOR) | cv2.IMREAD_IGNORE_ORIENTATION
    try:
        img = cv2.imdecode(np.fromfile(path, dtype=np.uint8), flags)
    except (OSError, cv2.error):
        img = None
    if img is None or img.size == 0:
        return read_image(path, orientation)
    orientation = file_orientation(path) if orientation is None else orientation
    return np.ascontiguousarray(apply_orientation(img, orientation))


def resized_sizes(shapes: np.ndarray, imgsz: int) -> np.ndarray:
    """(N, 2) int64 (w, h) of (N, 2) (w, h) images after resizing each long side to ``imgsz`` (ceil, as YOLOv5)."""
    shapes = np.asarray(shapes, np.float64).reshape(-1, 2)
    ratio = imgsz / shapes.max(1)
    return np.ceil(shapes * ratio[:, None]).astype(np.int64)


def ram_cache_bytes(shapes: np.ndarray, imgsz: int) -> int:
    """Exact bytes of the cache's store: all resized uint8 BGR images (sizes are known from the label scan), its
    header and index."""
    return layout(resized_sizes(shapes, imgsz))[2]


def check_ram_cache(shapes: np.ndarray, imgsz: int, prefix: str = "") -> None:
    """Raise CacheError (one line, both numbers) when the RAM cache would not fit with a margin."""
    need, free = ram_cache_bytes(shapes, imgsz), available_memory()
    if need * RAM_SAFETY > free:
        raise CacheError(f"{prefix}--cache ram: need {need / 1e9:.1f} GB (+{RAM_SAFETY - 1:.0%} margin), "
                         f"available {free / 1e9:.1f} GB; use --cache disk or no cache")


def auto_cache_refusal(shapes: np.ndarray, imgsz: int, loader_bytes: int = 0) -> tuple[str | None, int]:
    """--cache auto: (why not to cache in RAM, None to cache; bytes of the cache). The resized images must take at
    most AUTO_CACHE_SHARE of the available memory (utils.host_memory: a container's limit counts), counted once:
    the RAM cache is one store per machine, shared by every training process and loader worker
    (utils.data.image_cache). Past AUTO_CACHE_LIMIT, only where ``/dev/shm`` holds it beside the loaders' batches
    (``loader_bytes``): a larger store is never made the mapped file in the user's cache folder that a small
    ``/dev/shm`` falls back to. Decoding is most of a loader's work (about one decode per item with mosaic
    partners from the batch, ~3.6 from the dataset), so a cache saves that work every epoch for memory that the
    machine has to spare."""
    need = ram_cache_bytes(shapes, imgsz)
    share = AUTO_CACHE_SHARE * available_memory()
    if need > share:
        return f"over {AUTO_CACHE_SHARE:.0%} of the available memory ({share / 1e9:.2f} GB)", need
    if need > AUTO_CACHE_LIMIT and not fits_shared_memory(need, loader_bytes):
        return f"over {AUTO_CACHE_LIMIT / 2 ** 30:.0f} GiB and more than /dev/shm has free", need
    return None, need


# ---------------------------------------------------------------------------------------------
# Rectangular batches, weights, collate, tensor conversion
# ---------------------------------------------------------------------------------------------

def rect_batch_shapes(shapes: np.ndarray, batch_size: int, imgsz: int, stride: int, pad: float = 0.0):
    """For images already sorted by aspect (h/w): per-batch (h, w) canvas, stride multiples (YOLOv5)."""
    aspect = shapes[:, 1] / shapes[:, 0]
    batch = np.floor(np.arange(len(shapes)) / batch_size).astype(int)
    ratios = np.ones((batch[-1] + 1, 2))
    for i in range(len(ratios)):
        group = aspect[batch == i]
        low, high = group.min(), group.max()
        if high < 1:
            ratios[i] = high, 1
        elif low > 1:
            ratios[i] = 1, 1 / low
    return np.ceil(ratios * imgsz / stride + pad).astype(int) * stride, batch


def class_weights(labels, nc: int) -> np.ndarray:
    """Class weights = 1 / instance frequency (absent classes count once), normalised to sum 1. ``labels``:
    per image (n, 5) arrays (a flat ``labels`` view is read as its one array)."""
    if hasattr(labels, "flat"):
        classes = labels.flat.boxes[:, 0].astype(int)
    else:
        classes = np.concatenate([lb[:, 0] for lb in labels], 0).astype(int) if len(labels) else np.zeros(0, int)
    counts = np.bincount(classes, minlength=nc).astype(np.float64)
    counts[counts == 0] = 1
    weights = 1 / counts
    return weights / weights.sum()


def to_rgb_tensor(img: np.ndarray, is_rgb: bool = False) -> torch.Tensor:
    """HxWx3 BGR (or HxWx4 BGRA, or RGB when ``is_rgb``) uint8 -> (3, H, W) RGB uint8 tensor.

    The tensor is a channel-first view of an HxWx3 array, i.e. stored channels-last: ``collate``
    stacks such items with plain copies into a channels_last batch, which the channels_last model
    takes as it is (no per-item transpose, no per-batch layout conversion in the training process).
    """
    if not is_rgb:
        img = cv2.cvtColor(img, cv2.COLOR_BGRA2RGB if img.shape[2] == 4 else cv2.COLOR_BGR2RGB)
    return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)


def collate(batch, slots=None):
    """Stack images into a (B, 3, H, W) channels_last uint8 batch and write each label row's image index.

    Inside workers the stacked storage is shared memory, so the batch reaches the training process
    without another copy: a reused buffer from ``slots`` (``utils.data.batch_slots``) when one is free,
    else a fresh one (``default_collate``); a batch in a slot is handed over as a ``SlotBatch``. Images of different
    sizes (only possible when a distributed rank's share of a --rect split
    straddles two rect batches) are padded bottom/right to the largest, labels rescaled to match.
    """
    images, labels, paths, shapes = zip(*batch)
    hwc = [im.permute(1, 2, 0) for im in images]  # items are channels-last views: these are plain arrays
    height, width = max(im.shape[0] for im in hwc), max(im.shape[1] for im in hwc)
    for i, item_labels in enumerate(labels):
        item_labels[:, 0] = i
        h, w = hwc[i].shape[:2]
        if (h, w) != (height, width):
            hwc[i] = torch.nn.functional.pad(hwc[i], (0, 0, 0, width - w, 0, height - h), value=FILL)
            item_labels[:, [2, 4]] *= w / width
            item_labels[:, [3, 5]] *= h / height
    buffer = slots.images_buffer((len(hwc), height, width, 3)) if slots is not None else None
    stacked = torch.stack(hwc, out=buffer) if buffer is not None else default_collate(hwc)
    batch = stacked.permute(0, 3, 1, 2), torch.cat(labels, 0), list(paths), shapes
    return handed_over(batch, buffer, slots)


def pixel_boxes(labels: np.ndarray, width: float, height: float, padw: float = 0.0, padh: float = 0.0):
    """(n, 5) [class, cx, cy, w, h] normalised -> [class, x1, y1, x2, y2] pixels (+ padding)."""
    labels = np.asarray(labels, np.float64).reshape(-1, 5)
    return np.concatenate([labels[:, :1], xywhn2xyxy(labels[:, 1:5], width, height, padw, padh)], 1)


def normalised_targets(labels: np.ndarray, width: int, height: int, eps: float = 1e-3) -> torch.Tensor:
    """[class, x1, y1, x2, y2] pixels -> (n, 6) tensor [0, class, cx, cy, w, h] normalised, clipped."""
    out = np.zeros((len(labels), 6), np.float32)
    if len(labels):
        x1, x2 = labels[:, 1].clip(0, width - eps), labels[:, 3].clip(0, width - eps)
        y1, y2 = labels[:, 2].clip(0, height - eps), labels[:, 4].clip(0, height - eps)
        out[:, 1] = labels[:, 0]
        out[:, 2], out[:, 3] = (x1 + x2) / 2 / width, (y1 + y2) / 2 / height
        out[:, 4], out[:, 5] = (x2 - x1) / width, (y2 - y1) / height
    return torch.from_numpy(out)


# ---------------------------------------------------------------------------------------------
# The dataset
# ---------------------------------------------------------------------------------------------


def item_draw(seed: int, item, epoch: int) -> tuple[int, np.random.Generator]:
    """(image index, the generator of its augmentation) for a loader item: ``index`` (of ``epoch``), ``(index,
    epoch)``, or ``(index, epoch, repeat)`` for an image's repeat-th time in an epoch (utils.data.loader.EpochSampler):
    every draw a function of (seed, epoch, index[, repeat])."""
    index, epoch, *repeat = item if isinstance(item, tuple) else (item, epoch)
    key = (seed, int(epoch), int(index), *(int(r) for r in repeat if r))
    return int(index), np.random.default_rng(key)


class YoloDataset(Dataset):
    """Images + YOLO labels of one split, resized (long side = imgsz) and augmented like YOLOv5 v7.

    ``source`` is a ``SplitLabels`` from ``utils.data.verify.scan_split`` (its ``flat`` is used as it is), a
    ``LabelSet`` (or anything with ``im_files, labels, segments, shapes`` lists), or the split's sources (folders /
    .txt lists), which are then scanned with ``nc`` classes. ``cache`` is None, "ram" or "disk" (see
    ``cache_images``). ``im_files``, ``labels`` and ``segments`` are list-like views of flat arrays
    (``utils.data.flat_labels``), ``shapes`` an (N, 2) array of (width, height).
    """

    def __init__(self, source, imgsz=640, batch_size=16, augment=False, hyp=None, rect=False, image_weights=False,
                 cache=None, single_cls=False, stride=32, pad=0.0, prefix="", seed=0, nc=None,
                 mosaic_partners="dataset"):
        split = source if hasattr(source, "im_files") else self._scan(source, nc, prefix, single_cls)
        self.imgsz, self.augment, self.rect, self.stride = imgsz, augment, rect, stride
        self.hyp = hyp if hyp is not None else Hyp()
        self.mosaic = augment and not rect
        if mosaic_partners not in MOSAIC_PARTNERS:
            raise ValueError(f"{prefix}mosaic_partners must be one of {MOSAIC_PARTNERS}, got {mosaic_partners!r}")
        self.mosaic_partners = mosaic_partners
        self.decoded = None  # while a batch is built: its decoded images by index (see __getitems__)
        self.image_weights, self.seed, self.epoch, self.prefix = image_weights, seed, 0, prefix
        self.partner_cdf = None  # --image-weights: the mosaic partners' cumulative weights (set_partner_weights)
        flat = split.flat if hasattr(split, "flat") else FlatLabels.from_lists(split.im_files, split.labels,
                                                                              split.segments, split.shapes)
        if not len(flat):
            raise ValueError(f"{prefix}no images in {source if not hasattr(source, 'im_files') else 'split'}")
        if single_cls:
            flat = flat.with_one_class()
        self.n = len(flat)
        self.batch_shapes, self.batch = None, None  # rect: each image's batch and the batches' shapes
        if rect:
            order = (flat.shapes[:, 1] / flat.shapes[:, 0]).argsort(kind="stable")
            flat = flat.take(order)
        self.flat = flat
        self.im_files, self.labels, self.segments, self.shapes = flat.im_files, flat.labels, flat.segments, flat.shapes
        if rect:
            self.batch_shapes, self.batch = rect_batch_shapes(self.shapes, batch_size, self.imgsz, self.stride, pad)
        self.store = None  # the image cache (utils.data.image_store.ImageStore): resized BGR images
        # EXIF orientations from the scan (read-only, shared); a split given as lists has none: read lazily then
        self.orientations = flat.orientations if (flat.orientations >= 0).all() else flat.orientations.copy()
        self.canvas = None  # mosaic buffer, one per process
        if cache:
            self.cache_images(cache)
        if is_main_process():
            old_caches.report(self.im_files, prefix=prefix)

    @staticmethod
    def _scan(sources, nc, prefix, single_cls):
        from utils.data.verify import scan_split

        if nc is None:
            raise ValueError(f"{prefix}YoloDataset needs nc (the number of classes) to scan {sources}")
        return scan_split(sources, nc, prefix=prefix, single_cls=single_cls)

    def __len__(self) -> int:
        return self.n

    def __getstate__(self) -> dict:
        """What a spawned loader worker receives: no mosaic buffer (each process makes its own) and the image
        cache as its file's name (``ImageStore`` pickles as one): never a copy of the pixels."""
        state = dict(self.__dict__)
        state["canvas"], state["decoded"] = None, None
        for name in ("shapes", "orientations"):  # views of flat's arrays: rebuilt from it, not pickled twice
            if state[name] is getattr(self.flat, name):
                state[name] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for name in ("shapes", "orientations"):
            if state[name] is None:
                setattr(self, name, getattr(self.flat, name))

    def share_labels(self) -> None:
        """Labels, file names and shapes into shared memory, for loader workers started by spawn or forkserver:
        they receive this dataset pickled, and then map one copy instead of each unpickling its own
        (``FlatLabels.share_memory``)."""
        own_orientations = self.orientations is self.flat.orientations
        self.flat.share_memory()
        self.shapes = self.flat.shapes
        if own_orientations:
            self.orientations = self.flat.orientations

    def set_epoch(self, epoch: int) -> None:
        """Epoch used when items are requested by a bare index (workers get it with the index)."""
        self.epoch = int(epoch)

    def set_partner_weights(self, weights) -> None:
        """Draw mosaic partners by these per-image ``weights`` from now on (None or all zero: uniformly again). Kept in
        shared memory made at the first call (before the loader's workers start), rewritten in place later."""
        weights = None if weights is None else np.asarray(weights, np.float64)
        if weights is None or not weights.sum() > 0:
            if self.partner_cdf is not None:
                self.partner_cdf.zero_()
            return
        if self.partner_cdf is None:
            self.partner_cdf = torch.zeros(self.n, dtype=torch.float64).share_memory_()
        cdf = np.cumsum(weights)
        self.partner_cdf.copy_(torch.from_numpy(cdf / cdf[-1]))

    def _weighted_partners(self, rng, count: int):
        """``count`` images drawn by the partner weights (with replacement, as YOLOv5's random.choices), or None."""
        if self.partner_cdf is None or not self.partner_cdf[-1] > 0:
            return None
        return np.searchsorted(self.partner_cdf.numpy(), rng.random(count), side="right")  # cdf ends at 1.0 exactly

    def image_weights_for(self, weights_per_class: np.ndarray) -> np.ndarray:
        """Per-image sampling weight = sum of its labels' class weights (images without labels: 0)."""
        weights = np.asarray(weights_per_class, np.float64)
        flat = self.flat
        image_of_box = np.repeat(np.arange(self.n), np.diff(flat.box_offsets))
        return np.bincount(image_of_box, weights=weights[flat.boxes[:, 0].astype(int)], minlength=self.n)

    def cache_images(self, cache: str, loader_bytes: int = 0) -> None:
        """Resize every image once into the split's image store (``utils.data.image_cache``): 'ram', one store in
        shared memory per machine for this run (after a memory check); 'disk', a store kept in the user cache
        folder for later runs. ``loader_bytes``: the shared memory this split's loaders hold on the machine, kept
        free beside a RAM store (``utils.data.loader.loader_shared_bytes``). Every process of a distributed run
        calls this together."""
        if cache not in CACHE_MODES:
            raise CacheError(f"{self.prefix}unknown cache mode {cache!r} (use ram or disk)")
        request = StoreRequest(self.im_files, self._resized_shapes(), lambda i: self._load_resized(i)[0],
                               variant=f"{self.imgsz}-{'linear' if self.augment else 'area'}", prefix=self.prefix,
                               loader_bytes=loader_bytes)
        check = (lambda: check_ram_cache(self.shapes, self.imgsz, self.prefix)) if cache == "ram" else None
        self.store = shared_image_store(request, cache, check_memory=check)
        LOGGER.info("%s%d images cached (%s, %.2f GB): %s", self.prefix, self.n, cache, request.nbytes / 1e9,
                    self.store.path)

    def _resized_shapes(self) -> np.ndarray:
        """(N, 2) (h, w) of every image as ``load_image`` returns it."""
        return resized_sizes(self.shapes, self.imgsz)[:, ::-1]

    @property
    def in_ram(self) -> bool:
        """Every image is cached in RAM (resized): loading one reads no file and decodes nothing."""
        return self.store is not None and self.store.in_memory

    def load_image(self, i: int):
        """Image i resized so its long side is imgsz: (img BGR, (h0, w0) original, (h, w) resized). A cached
        image is a read-only view of the cache."""
        width0, height0 = (int(v) for v in self.shapes[i])
        if self.store is not None:
            img = self.store[i]
            return img, (height0, width0), img.shape[:2]
        if self.decoded is not None and i in self.decoded:
            img = self.decoded[i]
            return img, (height0, width0), img.shape[:2]
        img, _, size = self._load_resized(i)
        if self.decoded is not None:  # kept for the batch's other mosaics: read-only, as a cached image
            img.flags.writeable = False
            self.decoded[i] = img
        return img, (height0, width0), size

    def resized_shape(self, i: int) -> tuple[int, int]:
        """(h, w) of image i as ``load_image`` returns it, without loading it."""
        width, height = (int(v) for v in resized_sizes(self.shapes[i], self.imgsz)[0])
        return height, width

    def decode(self, i: int, factor: int = 1) -> np.ndarray:
        """Decode image i with its EXIF orientation from the scan (read from the header once per process when
        the split came without one)."""
        path = self.flat.file(i)
        if self.orientations[i] < 0:
            self.orientations[i] = file_orientation(path)
        return read_jpeg(path, factor, int(self.orientations[i]))

    def _load_resized(self, i: int):
        width0, height0 = (int(v) for v in self.shapes[i])
        height, width = self.resized_shape(i)
        img = self.decode(i, reduce_factor(width0, height0, self.imgsz, self.flat.file(i)))
        if img.shape[:2] != (height, width):
            upscale = width > img.shape[1]
            interpolation = cv2.INTER_LINEAR if (self.augment or upscale) else cv2.INTER_AREA
            img = cv2.resize(img, (width, height), interpolation=interpolation)
        return img, (height0, width0), (height, width)

    def __getitems__(self, items: list) -> list:
        """One batch's items (the DataLoader asks for a batch at once, in its worker or in the main process).

        With ``mosaic_partners="dataset"`` (the default, YOLOv5's draw) each item is built as ``dataset[item]``: a
        mosaic's three other images are any three of the split. ``"batch"`` (opt-in, for uncached data where
        decoding is most of what the loader does: docs/benchmarks.md, "The training loader at scale") draws them
        from the batch's distinct images (by index) other than the item's own (three distinct ones, uniformly),
        and keeps each image decoded for the batch until the batch is built: about one decode per item instead
        of ~3.6. A batch with fewer than four distinct images (batch sizes 1-3, or image weights drawing the
        same images) cannot give every item three distinct others: all its items draw from the split then. What
        ``"batch"`` changes: a mosaic only mixes images that share its batch, so small batches reuse the same few
        images in every mosaic, and under torchrun the batch is each rank's share (16 processes of batch 4 do not
        augment like one process of batch 64). With a RAM or disk cache it saves no decode. The batch's order
        depends only on (seed, epoch), so items stay independent of worker count and order either way.
        """
        indices = np.array([int(item[0]) if isinstance(item, tuple) else int(item) for item in items], np.int64)
        distinct = np.unique(indices)  # sorted: the same partners whatever the items' order
        if not (self.mosaic and self.mosaic_partners == "batch" and len(distinct) >= 4):
            return [self[item] for item in items]
        self.decoded = {} if self.store is None else None  # a cache already holds every image decoded
        try:
            return [self.item(item, distinct[distinct != index]) for index, item in zip(indices, items)]
        finally:
            self.decoded = None

    def __getitem__(self, item):
        return self.item(item)

    def item(self, item, partners: np.ndarray | None = None):
        """Item ``item`` (an index, or ``(index, epoch)``); a mosaic's other images are drawn from ``partners``
        (distinct indices, not the item's own, at least three) when given, else from the whole split. Mixup's
        second mosaic is one of ``partners``, with the rest as its partners when three remain."""
        index, rng = item_draw(self.seed, item, self.epoch)
        hyp = self.hyp
        if self.mosaic and rng.random() < hyp.mosaic:
            img, labels = self.load_mosaic(index, rng, partners)
            shapes = None
            if hyp.mixup and rng.random() < hyp.mixup:
                other, rest = self.mixup_draw(rng, partners)
                img, labels = mixup(img, labels, *self.load_mosaic(other, rng, rest), rng)
        else:
            img, labels, shapes = self.load_letterboxed(index, rng)
        if self.augment:  # a mosaic is BGRA (faster warp) until here; HSV and to_rgb_tensor take both
            if not img.flags.writeable:
                img = img.copy()  # HSV works in place: never on the image cache (a read-only view)
            img = augment_hsv(img, hyp.hsv_h, hyp.hsv_s, hyp.hsv_v, rng, rgb=True)  # HSV -> RGB in one pass
            img, labels = random_flips(img, labels, hyp.flipud, hyp.fliplr, rng)
            image = to_rgb_tensor(img, is_rgb=True)
        else:
            image = to_rgb_tensor(img)
        targets = normalised_targets(labels, img.shape[1], img.shape[0])
        return image, targets, self.flat.file(index), shapes

    def mixup_draw(self, rng, partners: np.ndarray | None = None):
        """Mixup's second mosaic: (its image index, its own partners or None), drawn as ``item`` documents."""
        if partners is None:
            return int(rng.integers(self.n)), None
        other = int(rng.choice(partners))
        rest = partners[partners != other]  # the second mosaic's own partners
        return other, (rest if len(rest) >= 3 else None)

    def load_letterboxed(self, index: int, rng):
        """Non-mosaic path: letterbox to the rect batch shape or imgsz (+ random perspective if training)."""
        img, (h0, w0), (h, w) = self.load_image(index)
        shape = tuple(self.batch_shapes[self.batch[index]]) if self.rect else self.imgsz
        img, (ratio_w, ratio_h), pad = letterbox(img, shape, color=(FILL,) * 3, auto=False, scaleup=self.augment)
        shapes = (h0, w0), ((h * ratio_h / h0, w * ratio_w / w0), pad)
        labels = pixel_boxes(self.labels[index], ratio_w * w, ratio_h * h, pad[0], pad[1])
        if self.augment:
            hyp = self.hyp
            img, labels, _ = random_perspective(img, labels, (), hyp.degrees, hyp.translate, hyp.scale, hyp.shear,
                                                hyp.perspective, rng=rng)
        return img, labels, shapes

    def load_mosaic(self, index: int, rng, partners: np.ndarray | None = None):
        """4-image mosaic on a 2*imgsz BGRA canvas, random centre, then random perspective back to imgsz. The
        other three images: three distinct ones of ``partners`` (indices) when given, else any three of the split.

        The warp is drawn first, so that only the part of the canvas it reads is built and images
        wholly outside that part are not decoded (a third of the canvas on average with
        hyp.scratch-low's scale 0.5). Not with a projective warp or copy-paste (which reads the
        mirrored canvas): then the whole canvas is built.
        """
        s, hyp = self.imgsz, self.hyp
        picks, centre, matrix, zoom, window = self.mosaic_draws(index, rng, partners)
        out_size, projective = (s, s), hyp.perspective > 0
        if self.canvas is None:
            self.canvas = np.empty((2 * s, 2 * s, 4), np.uint8)  # reused: warped into a new array below
        canvas, labels, segments = mosaic4(lambda position: self.load_image(picks[position])[0],
                                           [self.resized_shape(k) for k in picks], [self.labels[k] for k in picks],
                                           [self.segments[k] for k in picks], s, centre, out=self.canvas, window=window)
        if len(segments) != len(labels):
            segments = []
        canvas, labels, segments = copy_paste(canvas, labels, segments, hyp.copy_paste, rng)
        canvas, labels, _ = apply_warp(canvas, labels, segments, matrix, zoom, out_size, projective)
        return canvas, labels

    def mosaic_draws(self, index: int, rng, partners: np.ndarray | None = None):
        """A mosaic's random draws, in order: (the 4 image indices as placed, the canvas centre (xc, yc), the 3x3
        warp to imgsz and its zoom, the canvas window that warp reads (None: the whole canvas is needed))."""
        s, hyp = self.imgsz, self.hyp
        if partners is not None:
            others = rng.choice(partners, 3, replace=False)
        else:
            weighted = self._weighted_partners(rng, 3)
            others = weighted if weighted is not None else rng.integers(0, self.n, 3)
        picks = [index, *(int(k) for k in others)]
        rng.shuffle(picks)
        centre = tuple(int(v) for v in rng.uniform(0.5 * s, 1.5 * s, 2))
        out_size, projective = (s, s), hyp.perspective > 0
        matrix, zoom = perspective_matrix((2 * s, 2 * s), out_size, hyp.degrees, hyp.translate, hyp.scale, hyp.shear,
                                          hyp.perspective, rng)
        pasting = hyp.copy_paste > 0 and any(self.flat.has_segments(k) for k in picks)
        window = None if projective or pasting else source_window(matrix, out_size, (2 * s, 2 * s))
        return picks, centre, matrix, zoom, window
