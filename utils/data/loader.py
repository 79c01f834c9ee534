"""The one dataloader builder: dataset + epoch-aware sampler + seeded, persistent workers.

Reproducibility: augmentation depends only on ``(seed, epoch, index)`` (see ``utils.data.dataset``)
and the sampler's order only on ``(seed, epoch)``; the sampler yields ``(index, epoch)`` so
persistent workers see the current epoch without being restarted. Call
``set_loader_epoch(loader, epoch)`` at the start of every epoch.
"""
from __future__ import annotations

import functools
import gc
import itertools
import logging
import math
import multiprocessing
import random

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from utils import dist
from utils.data.batch_slots import TRAILER, BatchSlots, unwrapped
from utils.data.dataset import YoloDataset, auto_cache_refusal, collate
from utils.data.plans import PlanDataset, collate_plans
from utils.device import usable_cpus
from utils.memory import keep_freed_memory

LOGGER = logging.getLogger(__name__)

PREFETCH = 4  # batches each worker prepares ahead (DataLoader's prefetch_factor)
SPARE_SLOTS = 2  # reusable batch buffers per worker beyond those (utils.data.batch_slots)


class EpochSampler(Sampler):
    """Indices for one rank, as ``(index, epoch)`` pairs (``(index, epoch, repeat)`` for an image that comes again in
    the epoch: ``items``); order fixed by ``(seed, epoch)``.

    Like ``DistributedSampler``: with ``world_size > 1`` the (optionally shuffled) list is padded to
    a multiple of world_size and rank r takes every world_size-th entry from r; without shuffle
    (rect batches) each rank takes a contiguous block so batches keep one shape.
    With image weights set, indices are drawn with replacement by weight instead (same on all ranks).
    An iteration runs from the current epoch's ``start`` through epoch ``through`` (``set_epoch``), each epoch's
    order as that epoch alone would give it: one iterator of the loader then serves several epochs (``EpochStream``).
    """

    def __init__(self, size: int, shuffle: bool = False, seed: int = 0, rank: int = 0, world_size: int = 1):
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world_size = max(rank, 0), max(world_size, 1)
        self.epoch, self.start, self.through = 0, 0, 0
        self.weights = None
        self.table = None  # position -> image (YOLOv5's dataset.indices, set_table); None: the identity
        self.per_rank = math.ceil(size / self.world_size)

    def set_epoch(self, epoch: int, start: int = 0, through: int | None = None) -> None:
        """Epoch ``epoch``'s order, from its ``start``-th index on (a resumed epoch skips what was done); an iteration
        goes on into the epochs after it up to ``through`` (None: this epoch only)."""
        self.epoch, self.start = int(epoch), int(start)
        self.through = self.epoch if through is None else max(int(through), self.epoch)

    def set_weights(self, weights) -> None:
        """Per-image sampling weights (None switches back to plain sampling). An iteration reads them as it reaches
        each epoch: with weights that change between epochs, iterate one epoch at a time."""
        self.weights = None if weights is None else np.asarray(weights, np.float64)

    def set_table(self, table) -> None:
        """Each position's image (``size`` indices), or None: the order's positions are then looked up in it, as
        YOLOv5's dataset looks its ``indices`` up (utils/yolov5_loaders.py). The table is read as each epoch starts."""
        self.table = None if table is None else np.asarray(table, np.int64)

    def order(self, epoch: int | None = None) -> np.ndarray:
        rng = np.random.default_rng((self.seed, self.epoch if epoch is None else int(epoch), 7))
        if self.weights is not None and self.weights.sum() > 0:
            return rng.choice(self.size, self.size, replace=True, p=self.weights / self.weights.sum())
        positions = rng.permutation(self.size) if self.shuffle else np.arange(self.size)
        return positions if self.table is None else self.table[positions]

    def indices(self, epoch: int | None = None) -> np.ndarray:
        return self._share(self.order(epoch))

    def items(self, epoch: int | None = None) -> list[tuple]:
        """This rank's items of the epoch: ``(index, epoch)``, or ``(index, epoch, repeat)`` for the repeat-th
        (1, 2, ...) time an image comes again in the epoch's order (drawn by weight, or a table): each repeat is
        augmented anew, as YOLOv5's dataset augments each time it is asked (its draw: utils.data.dataset.item_draw)."""
        epoch = self.epoch if epoch is None else int(epoch)
        order = self.order(epoch)
        repeats = self._share(repeat_counts(order))
        return [(int(i), epoch, int(r)) if r else (int(i), epoch) for i, r in zip(self._share(order), repeats)]

    def _share(self, order: np.ndarray) -> np.ndarray:
        """This rank's part of an epoch's ``order`` (or of an array aligned with it), padded as DistributedSampler."""
        total = self.per_rank * self.world_size
        if total > len(order):
            order = np.concatenate((order, order[: total - len(order)]))
        if self.world_size == 1:
            return order
        if self.shuffle or self.weights is not None:
            return order[self.rank:total:self.world_size]
        return order[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]

    def epochs(self):
        """``(epoch, items)`` from the current epoch (from ``start``) through ``through``, as set when called."""
        first, start, through = self.epoch, self.start, self.through
        for epoch in range(first, through + 1):
            yield epoch, self.items(epoch)[start if epoch == first else 0:]

    def __iter__(self):
        return (item for _, items in self.epochs() for item in items)

    def __len__(self) -> int:
        """The current epoch's indices from ``start``."""
        return max(self.per_rank - self.start, 0)


def repeat_counts(order: np.ndarray) -> np.ndarray:
    """For each entry of ``order``, how many times its value came before it (0 for a first time)."""
    order = np.asarray(order)
    sorter = np.argsort(order, kind="stable")
    values = order[sorter]
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]]) if len(values) else np.zeros(0, np.int64)
    runs = np.diff(np.r_[starts, len(values)])
    counts = np.empty(len(order), np.int64)
    counts[sorter] = np.arange(len(values)) - np.repeat(starts, runs)
    return counts


class EpochBatchSampler(Sampler):
    """Batches of ``batch_size`` items (``(index, epoch)`` pairs) from an EpochSampler, epoch by epoch: an epoch's last batch
    may be smaller, and no batch mixes two epochs. Its length is the current epoch's batches."""

    def __init__(self, sampler: EpochSampler, batch_size: int):
        self.sampler, self.batch_size = sampler, batch_size

    def __iter__(self):
        for _, items in self.sampler.epochs():
            for first in range(0, len(items), self.batch_size):
                yield items[first:first + self.batch_size]

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)


class BatchShardSampler(Sampler):
    """Whole batches of an unshuffled split for one rank: batch k (indices k*batch_size ...) goes to rank
    k % world_size. Distributed validation: every image once, in the same batches (so the same rect
    shapes and padding) as a single process, and no padding duplicates."""

    def __init__(self, size: int, batch_size: int, rank: int = 0, world_size: int = 1):
        self.size, self.batch_size = size, batch_size
        self.rank, self.world_size = max(rank, 0), max(world_size, 1)

    def __iter__(self):
        for start in range(self.rank * self.batch_size, self.size, self.world_size * self.batch_size):
            yield list(range(start, min(start + self.batch_size, self.size)))

    def __len__(self) -> int:
        batches = math.ceil(self.size / self.batch_size)
        return len(range(self.rank, batches, self.world_size))


class SlotDataLoader(DataLoader):
    """A DataLoader whose workers reuse shared-memory batch buffers (``utils.data.batch_slots``): each
    batch it yields hands its buffer back to the workers once the batch's images (or plans) are garbage-collected;
    pinned, once they are copied to pinned memory (``SlotBatch``)."""

    def __init__(self, *args, slots: BatchSlots | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.slots = slots

    def __iter__(self):
        iterator = super().__iter__()
        if self.slots is None:
            return iterator
        return self._tracked(iterator)

    def _tracked(self, iterator):
        for batch in iterator:  # a SlotBatch unless the pin thread took it (or the batch came in a fresh buffer)
            yield unwrapped(batch)


def seed_worker(worker_id: int) -> None:
    """Worker start-up: OpenCV single-threaded, freed memory kept (``utils.memory``), the objects it
    inherited left out of garbage collection, and the libraries a worker might use seeded from torch's
    per-worker seed (itself from the loader's generator, seeded by (seed, rank)). Augmentation itself is
    seeded per item, not from here.

    ``gc.freeze()``: a collection walks every container object it tracks and writes its header, so in a
    forked worker it would copy every page holding the parent's objects; frozen, they are never walked (the
    dataset's own data are flat arrays, which reading does not copy either: utils.data.flat_labels)."""
    gc.freeze()
    cv2.setNumThreads(0)
    keep_freed_memory()
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def worker_count(workers: int, batch_size: int, processes: int = 1) -> int:
    """min(requested, usable CPUs / processes on this node, batch size): all processes' workers together do
    not outnumber the CPUs. 0 means load in the main process."""
    return max(0, min(workers, usable_cpus() // max(processes, 1), batch_size))


def loader_shared_bytes(num_workers: int, batch_size: int, imgsz: int, stride: int, pad: float = 0.0,
                        processes: int = 1) -> int:
    """Shared memory that a split's loaders hold on a machine at most: ``processes`` loaders of ``num_workers``
    workers, each worker PREFETCH + SPARE_SLOTS batch buffers (``utils.data.batch_slots``, made as they are needed),
    each a collated uint8 batch of ``batch_size`` images 3 x side x side: side ``imgsz`` (a mosaic), or a rect batch's
    longest, padded side. (A batch of plans, ``--augment-device``, holds about as many bytes on average: the parts
    of its sources that its images read; a reused buffer grows to 1.25x a batch that outgrew it.)"""
    side = math.ceil(imgsz / stride + pad) * stride
    return processes * num_workers * (PREFETCH + SPARE_SLOTS) * (batch_size * 3 * side * side + TRAILER)


def create_dataloader(sources, imgsz, batch_size, stride, hyp=None, augment=False, cache=None, rect=False, workers=8,
                      image_weights=False, pad=0.0, prefix="", shuffle=False, seed=0, rank=-1, world_size=1,
                      single_cls=False, names=None, labels=None, processes_per_node=None, shard="samples",
                      cpus_busy=False, multiprocessing_context=None, mosaic_partners="dataset", augment_device=False,
                      decode_device=False, dataset=None):
    """Build ``(loader, dataset)``. ``labels``: an already scanned SplitLabels (skips the scan); ``dataset``: an
    already built YoloDataset (then ``sources``, ``labels`` and the dataset's own arguments are not read).
    ``processes_per_node``: training processes sharing this node's CPUs and memory (default world_size).
    ``shard``: how ``world_size`` ranks split the data: "samples" (training: the (seed, epoch) order dealt
    out like DistributedSampler) or "batches" (validation: whole unshuffled batches, see BatchShardSampler).
    ``cache``: None/"off", "ram", "disk", or "auto" (RAM for small datasets, see ``auto_cache``); a cache is one
    store per machine (``utils.data.image_cache``): under a process group every process calls this together. A RAM
    store leaves room in ``/dev/shm`` for the loaders' own batches (``loader_shared_bytes``).
    ``cpus_busy``: the caller's compute keeps every CPU busy (CPU training, see ``utils.device.compute_fills_cpus``);
    then images cached in RAM load in the main process (see ``inline_loading``).
    ``multiprocessing_context``: the workers' start method ("fork", "spawn", "forkserver"; None: Python's default).
    ``mosaic_partners``: "dataset" (YOLOv5's draw) or "batch" (this rank's batch), see ``YoloDataset.__getitems__``.
    ``augment_device`` (training only): batches hold a ``PlanBatch`` (``utils.data.plans``) instead of images, which
    ``utils.data.device_augment.render_plans`` turns into the images on the training device; with ``decode_device``
    the uncached JPEGs of its mosaics travel as their bytes, decoded there too (``PlanDataset.encoded``).

    Batches are ``(images uint8 (B,3,H,W) RGB, targets (n,6), paths, shapes)`` (see ``collate``).
    """
    if rect and shuffle:
        LOGGER.warning("%s--rect is incompatible with shuffle, setting shuffle=False", prefix)
        shuffle = False
    if rect and image_weights:  # as YOLOv5: images drawn by weight make batches of any shapes, so mosaics instead
        LOGGER.info("%s--rect is not used with --image-weights (weighted draws mix the images' shapes)", prefix)
        rect = False
    if cache not in (None, "off", "ram", "disk", "auto"):
        raise ValueError(f"{prefix}unknown cache mode {cache!r} (use ram, disk, auto or off)")
    nc = len(names) if names is not None else None
    plans = augment_device and augment
    dataset_class, extra = (PlanDataset, {"decode_device": decode_device}) if plans else (YoloDataset, {})
    if dataset is None:
        dataset = dataset_class(labels if labels is not None else sources, imgsz=imgsz, batch_size=batch_size,
                                augment=augment, hyp=hyp, rect=rect, image_weights=image_weights,
                                single_cls=single_cls, stride=stride, pad=pad, prefix=prefix, seed=seed, nc=nc,
                                mosaic_partners=mosaic_partners, **extra)
    batch_size = min(batch_size, len(dataset))
    processes_per_node = processes_per_node or world_size
    num_workers = worker_count(workers, batch_size, processes_per_node)
    if cache in ("ram", "disk", "auto"):
        inline = cpus_busy and cache != "disk"  # images cached in RAM then load in the main process (inline_loading)
        room = loader_shared_bytes(0 if inline else num_workers, batch_size, imgsz, stride, pad, processes_per_node)
        if cache == "auto":
            auto_cache(dataset, prefix, room)
        else:
            dataset.cache_images(cache, loader_bytes=room)
    if plans and decode_device and dataset.store is not None:
        LOGGER.warning("%sWARNING: --decode-device has nothing to decode: the images are cached decoded (--cache %s); "
                       "it decodes uncached JPEGs (--cache off)", prefix, cache)
    if num_workers and cpus_busy and dataset.in_ram:
        num_workers = inline_loading(num_workers, prefix)
    if num_workers and start_method(multiprocessing_context) != "fork":
        dataset.share_labels()  # spawned workers map the labels instead of unpickling a copy each
    if shard == "batches":
        sampling = {"batch_sampler": BatchShardSampler(len(dataset), batch_size, rank, world_size)}
    else:
        sampling = {"batch_sampler": EpochBatchSampler(
            EpochSampler(len(dataset), shuffle=shuffle, seed=seed, rank=rank, world_size=world_size), batch_size)}
    generator = torch.Generator()
    generator.manual_seed(seed * 1000 + max(rank, 0))
    prefetch = PREFETCH if num_workers > 0 else None
    pin_memory = torch.cuda.is_available()
    slots = BatchSlots(num_workers, PREFETCH + SPARE_SLOTS) if num_workers > 0 else None
    collate_fn = functools.partial(collate_plans if plans else collate, slots=slots)
    loader = SlotDataLoader(dataset, **sampling, num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin_memory,
                            persistent_workers=num_workers > 0, worker_init_fn=seed_worker,
                            generator=generator, prefetch_factor=prefetch, slots=slots,
                            multiprocessing_context=multiprocessing_context if num_workers > 0 else None)
    return loader, dataset


def start_method(context) -> str:
    """How loader workers start: ``context`` (a method name, a multiprocessing context or None for Python's
    default; read without fixing the default, as DataLoader will when it starts them)."""
    if context is None:
        return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    return context if isinstance(context, str) else context.get_start_method()


def inline_loading(num_workers: int, prefix: str = "") -> int:
    """0 workers, said once: with the images in RAM a worker has nothing to read or decode, only augment,
    and when the compute (CPU training) already keeps every CPU busy, worker processes only preempt its
    threads. BCCD, yolov5n, 320, 2-core Xeon (bench_train.py, 2 alternating pairs): the first epoch took
    4.3-4.4 s instead of 6.9-7.1 (bf16) and 7.1 instead of 11.3-11.5 (fp32), no worker start-up competing
    with it; steady epochs were even (training steps 1.09-1.10x their in-memory floor either way). With
    --cache off (JPEG decoding) workers overlap real work, so they stay."""
    LOGGER.info("%simages cached in RAM and the training computes on every CPU: loading in the main process "
                "instead of %d worker processes that would compete with it", prefix, num_workers)
    return 0


def auto_cache(dataset: YoloDataset, prefix: str = "", loader_bytes: int = 0) -> None:
    """--cache auto (train.py's default): cache the resized images in RAM when the machine has memory to spare, one
    copy per machine shared by every process and loader worker (``auto_cache_refusal``). The main process decides
    for all: every process must take the same path through the cache's collective steps. ``loader_bytes``: see
    ``YoloDataset.cache_images``."""
    refusal, need = auto_cache_refusal(dataset.shapes, dataset.imgsz, loader_bytes)
    refusal = dist.broadcast_object(refusal, phase="decide whether --cache auto caches the images")
    if refusal is None:
        LOGGER.info("%s--cache auto: caching the images in RAM (%.2f GB, one copy per machine; --cache off to skip)",
                    prefix, need / 1e9)
        dataset.cache_images("ram", loader_bytes=loader_bytes)
    else:
        LOGGER.info("%s--cache auto: not caching, %.2f GB is %s (--cache ram or disk to cache anyway)", prefix,
                    need / 1e9, refusal)


def epoch_sampler(loader):
    """The loader's EpochSampler (training loaders), else its sampler."""
    batches = getattr(loader, "batch_sampler", None)
    return batches.sampler if isinstance(batches, EpochBatchSampler) else loader.sampler


def set_loader_epoch(loader, epoch: int, start_batch: int = 0, through: int | None = None) -> None:
    """Start of an epoch: reseeds the sampler order and the augmentation of every item. A resumed epoch
    starts at batch ``start_batch`` (the same batches as an uninterrupted epoch from there on). A new iterator of
    the loader goes on through epoch ``through`` (None: this epoch only; see ``EpochStream``)."""
    sampler = epoch_sampler(loader)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch, start_batch * loader.batch_sampler.batch_size, through)
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)


def set_loader_image_weights(loader, weights_per_class) -> None:
    """--image-weights: sample images, and draw their mosaics' other images, by the sum of their labels' class
    weights from now on."""
    weights = loader.dataset.image_weights_for(weights_per_class)
    epoch_sampler(loader).set_weights(weights)
    loader.dataset.set_partner_weights(weights)


class EpochStream:
    """The training loader's batches, epoch after epoch, from one iterator where it can: the workers then build the
    next epoch's first batches while this epoch's last steps run and while it is validated, instead of starting
    when the next epoch asks (YOLOv5's InfiniteDataLoader does the same). Why: each epoch's first step waited for a
    worker to build a whole batch from nothing. On an H200 (2026-11-28, yolov5s at batch 64 and 640, 8 workers, BCCD
    x8: 26 steps an epoch of ~1.3 s) training ran at 1,082-1,384 images/s where the step alone, on batches held on
    the GPU, ran at 1,424; one worker builds 64 mosaics in ~0.4 s there (8 made ~1,380 images/s), so that wait
    can be a quarter of such an epoch (an estimate: not yet measured on a GPU).

    Nothing the run computes changes: each epoch's order and every item's augmentation are functions of (seed,
    epoch, index), whichever iterator asks for them. ``epoch(epoch, start_batch, through)`` gives one epoch's batches
    (a ``len``-able iterable); iterating it continues the iterator where the last epoch ended exactly at this one's
    first batch, and otherwise (the first epoch, a resumed one, after an epoch that stopped early, or past the
    ``through`` of the iterator) starts a new one that runs through epoch ``through``. With image weights, which
    change after each epoch's validation, the caller passes ``through=epoch``: one iterator per epoch, as before.

    The trainer goes on across epochs on CUDA only. On the CPU the compute uses every core, and the workers building
    the next epoch's batches then compete with the validation between epochs: the 10-epoch BCCD command with
    ``--cache off`` (2 workers) took 1.055x the wall time with the stream (3 alternating pairs, 1.029-1.071, the same
    results.csv in all runs; 2-core AMD EPYC Zen 4, 2026-11-28)."""

    def __init__(self, loader):
        self.loader = loader
        self.iterator, self.through = None, -1
        self.next_at = None  # (epoch, batch) that the iterator yields next

    def epoch(self, epoch: int, start_batch: int = 0, through: int | None = None) -> "EpochBatches":
        set_loader_epoch(self.loader, epoch, start_batch, through)  # the loader's length, and a new iterator's start
        return EpochBatches(self, epoch, start_batch, len(self.loader))

    def restart(self) -> None:
        """A new iterator from the epoch and batch set last (``set_loader_epoch``)."""
        self.iterator = iter(self.loader)
        self.through = epoch_sampler(self.loader).through


class EpochBatches:
    """One epoch's batches from an EpochStream (see there)."""

    def __init__(self, stream: EpochStream, epoch: int, start_batch: int, length: int):
        self.stream, self.epoch, self.start_batch, self.length = stream, epoch, start_batch, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        stream = self.stream
        if stream.iterator is None or stream.next_at != (self.epoch, self.start_batch) or self.epoch > stream.through:
            stream.restart()
        stream.next_at = None  # until this epoch's batches are all taken
        for taken, batch in enumerate(itertools.islice(stream.iterator, self.length), start=1):
            stream.next_at = (self.epoch, self.start_batch + taken) if taken < self.length else (self.epoch + 1, 0)
            yield batch
