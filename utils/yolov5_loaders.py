"""YOLOv5's training data names, ``LoadImagesAndLabels`` and ``create_dataloader``, for training scripts written
against YOLOv5 (docs/yolov5-scripts.md); ``utils.dataloaders`` and ``utils.datasets`` offer them under YOLOv5's paths.
They are this project's dataset (utils/data/dataset.py: the checked scan, the image cache, YOLOv5 v7's
augmentation) and loader (utils/data/loader.py) under YOLOv5 v7.0's parameters and return values. The project itself
trains with utils/data/.

Randomness: the project draws each item's augmentation from (seed, epoch, index). The loader that
``create_dataloader`` returns makes each iteration the next epoch (``sampler.set_epoch``, YOLOv5's call under DDP,
picks it instead), so epochs differ from each other and a run repeats exactly. ``dataset[i]`` outside that loader
draws its epoch from Python's ``random``, as YOLOv5's augmentation draws from it: every call augments anew, seeded
by ``init_seeds`` in the main process and by torch's per-worker seed in DataLoader workers.
"""
from __future__ import annotations

import dataclasses
import logging
import random

import numpy as np
import torch

from utils import dist
from utils.config import Hyp
from utils.data.dataset import YoloDataset, collate
from utils.data.loader import create_dataloader as _create_dataloader
from utils.data.loader import epoch_sampler, set_loader_epoch
from utils.data.quad import QuadBatches, quad_batch
from utils.data.verify import img2label_paths, scan_split

LOGGER = logging.getLogger("yolov5")

EPOCH_DRAWS = 2**62  # dataset[i] outside the loader: its epoch, any number below this


def hyp_of(hyp) -> Hyp | None:
    """A Hyp from YOLOv5's hyperparameter dict (the keys Hyp has; others, such as ``label_smoothing``, are the
    loss's), a Hyp as it is, None for the defaults."""
    if hyp is None or isinstance(hyp, Hyp):
        return hyp
    known = {field.name for field in dataclasses.fields(Hyp)}
    return Hyp(**{key: value for key, value in dict(hyp).items() if key in known})


def cache_mode(cache) -> str | None:
    """YOLOv5's ``cache`` / ``cache_images`` (False, True = 'ram', 'ram', 'disk', None) as the project's mode."""
    if cache in (None, False, "", "off"):
        return None
    if cache is True or cache == "ram":
        return "ram"
    if cache == "disk":
        return "disk"
    raise ValueError(f"unknown cache {cache!r} (use True or 'ram', 'disk', or False)")


class LoadImagesAndLabels(YoloDataset):
    """YOLOv5's dataset: ``dataset[i]`` is ``(image, labels_out, path, shapes)``, the image a (3, h, w) RGB uint8
    tensor, ``labels_out`` (n, 6) ``[0, class, cx, cy, w, h]`` normalised, ``shapes`` ``((h0, w0), ((h / h0, w / w0),
    pad))`` for a letterboxed image and None for a mosaic. ``labels`` (per image (n, 5) ``[class, cx, cy, w, h]``),
    ``shapes`` ((N, 2) width, height), ``im_files``, ``label_files``, ``n``, ``batch_shapes`` and ``batch`` (with
    ``rect``) as YOLOv5's. Class ids are not checked against a number of classes (YOLOv5's train.py checks them
    after); everything else about the files is, as in training (utils/data/verify.py). ``seed`` is this project's: the
    augmentation's (module docstring)."""

    def __init__(self, path, img_size=640, batch_size=16, augment=False, hyp=None, rect=False, image_weights=False,
                 cache_images=False, single_cls=False, stride=32, pad=0.0, min_items=0, prefix="", seed=0):
        split = scan_split(path, None, prefix=prefix, single_cls=single_cls)
        if min_items:
            keep = np.flatnonzero(np.diff(split.flat.box_offsets) >= min_items)
            LOGGER.info(f"{prefix}{len(split.flat) - len(keep)}/{len(split.flat)} images filtered from dataset")
            split = dataclasses.replace(split, flat=split.flat.take(keep))
        super().__init__(split, imgsz=img_size, batch_size=batch_size, augment=augment, hyp=hyp_of(hyp), rect=rect,
                         image_weights=image_weights, cache=cache_mode(cache_images), single_cls=single_cls,
                         stride=int(stride), pad=pad, prefix=prefix, seed=seed)
        self.path, self.img_size = path, img_size
        self.label_files = img2label_paths(list(self.im_files))
        self.mosaic_border = [-img_size // 2, -img_size // 2]
        self._indices = None  # set by a script (YOLOv5's --image-weights draw): each position's image
        # the partners' weights in shared memory before any worker starts, so that setting indices reaches them;
        # all zero: drawn uniformly, as without
        self.partner_cdf = torch.zeros(self.n, dtype=torch.float64).share_memory_()

    @property
    def indices(self):
        """YOLOv5's image of each position: ``range(n)``, or what a script set. Setting it (YOLOv5's train.py does,
        drawing ``random.choices(range(n), weights=image_weights, k=n)`` each epoch) makes create_dataloader's loader
        read position i as image ``indices[i]`` from its next epoch on, and draw the mosaic partners from ``indices``
        (an image as often as it appears there), as YOLOv5's dataset does."""
        return range(self.n) if self._indices is None else self._indices

    @indices.setter
    def indices(self, value) -> None:
        table = np.asarray(value)
        if table.shape != (self.n,) or not np.issubdtype(table.dtype, np.integer) or \
                (self.n and not (0 <= table.min() and table.max() < self.n)):
            raise ValueError(f"dataset.indices takes {self.n} image indices in [0, {self.n}) (YOLOv5's "
                             f"random.choices(range(n), weights=..., k=n)), got shape {table.shape} of {table.dtype}")
        self._indices = table.astype(np.int64)
        self.set_partner_weights(np.bincount(self._indices, minlength=self.n))

    def __getitem__(self, item):
        if not isinstance(item, tuple):  # not from create_dataloader's loader (whose sampler looks indices up):
            item = (self.indices[item], random.randrange(EPOCH_DRAWS))  # a new draw each call, as YOLOv5's
        return self.item(item)

    @staticmethod
    def collate_fn(batch):
        """``(images (B, 3, H, W) uint8, targets (n, 6) [image, class, cx, cy, w, h], paths, shapes)``."""
        return collate(batch)

    @staticmethod
    def collate_fn4(batch):
        """YOLOv5's ``--quad`` batch: each 4 items become one image of twice the side, the first one upscaled or
        the four tiled 2 x 2 (Python's ``random`` chooses, as YOLOv5's does); the first B // 4 paths and shapes."""
        images, targets, paths, shapes = collate(batch)
        groups = images.shape[0] // 4
        images, targets = quad_batch(images, targets, [random.random() < 0.5 for _ in range(groups)])
        return images, targets, paths[:groups], shapes[:groups]


class _EpochSetter:
    """``loader.sampler``: YOLOv5's ``train_loader.sampler.set_epoch(epoch)`` picks the loader's next epoch."""

    def __init__(self, loader: "EpochLoader"):
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        self.loader.epoch = int(epoch)


class EpochLoader:
    """What ``create_dataloader`` returns: iterating it gives one epoch of batches ``(images, targets, paths,
    shapes)``, each iteration the next epoch, the workers kept between them (YOLOv5's InfiniteDataLoader keeps its
    workers too). ``len()`` is the batches of an epoch; ``dataset``, ``batch_size``, ``num_workers`` as a
    DataLoader's; ``sampler.set_epoch(epoch)`` sets the next iteration's epoch."""

    def __init__(self, loader, quad: QuadBatches | None = None):
        self.loader, self.quad, self.epoch = loader, quad, 0
        self.dataset, self.num_workers = loader.dataset, loader.num_workers
        self.batch_size = loader.batch_sampler.batch_size
        self.sampler = _EpochSetter(self)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        epoch = self.epoch
        self.epoch += 1
        epoch_sampler(self.loader).set_table(getattr(self.dataset, "_indices", None))  # a script's dataset.indices
        set_loader_epoch(self.loader, epoch)
        for index, (images, targets, paths, shapes) in enumerate(self.loader):
            if self.quad is not None:
                images, targets, paths = self.quad(epoch, index, images, targets, paths)
                shapes = shapes[:len(paths)]
            yield images, targets, paths, shapes


def create_dataloader(path, imgsz, batch_size, stride, single_cls=False, hyp=None, augment=False, cache=False,
                      pad=0.0, rect=False, rank=-1, workers=8, image_weights=False, quad=False, prefix="",
                      shuffle=False, seed=0):
    """YOLOv5's ``(loader, dataset)``: the dataset a LoadImagesAndLabels, the loader an EpochLoader. Under torchrun
    (``rank``, YOLOv5's LOCAL_RANK, >= 0 and a process group started) each process takes its share of every epoch, as YOLOv5's
    DistributedSampler deals it; ``quad`` is YOLOv5's ``--quad`` batch (utils/data/quad.py, drawn per (seed, rank,
    epoch, batch)). ``workers`` is at most the CPUs per process and the batch size."""
    world_size = dist.get_world_size() if rank != -1 and dist.in_process_group() else 1
    rank = dist.get_rank() if world_size > 1 else -1  # the process's global rank, as DistributedSampler takes it
    with dist.main_process_first("scan the dataset"):
        dataset = LoadImagesAndLabels(path, imgsz, batch_size, augment=augment, hyp=hyp, rect=rect,
                                      image_weights=image_weights, single_cls=single_cls, stride=int(stride), pad=pad,
                                      prefix=prefix, seed=seed)
    loader, dataset = _create_dataloader(path, imgsz, batch_size, int(stride), cache=cache_mode(cache), rect=rect,
                                         workers=workers, image_weights=image_weights, pad=pad, prefix=prefix,
                                         shuffle=shuffle, seed=seed, rank=rank, world_size=world_size,
                                         dataset=dataset)
    return EpochLoader(loader, QuadBatches(seed, max(rank, 0)) if quad else None), dataset
