"""A split's file names, labels, segments and image sizes in a few flat numpy arrays (``FlatLabels``).

Why: loader workers read these for every item. Held as Python lists of arrays and strings, every read
writes the reference count of the object it touches, so a forked worker's copy-on-write pages fill up
with private copies through an epoch (about 0.8 KB per image per worker: 800 MB per worker at a million
images), and the garbage collector walks every list again in every process. Flat arrays hold the same
data in a handful of objects: reading an item slices them (a new small view, the big buffers are only
read), so a worker's memory stays flat whatever the split's size.

Layout (N images, M boxes, S polygons, P points), every ragged part as values + int64 offsets:

- ``names`` uint8 (file names encoded with ``os.fsencode``), ``name_offsets`` (N + 1,)
- ``boxes`` float32 (M, 5) ``[class, cx, cy, w, h]`` normalised, ``box_offsets`` (N + 1,)
- ``points`` float32 (P, 2) normalised, ``point_offsets`` (S + 1,): polygon k is points[po[k]:po[k + 1]]
- ``segment_offsets`` (N + 1,): image i's polygons are k in segment_offsets[i]:segment_offsets[i + 1]
- ``shapes`` int64 (N, 2) ``(width, height)`` after EXIF orientation
- ``orientations`` int8 (N,): the EXIF orientation the image is read with (1..8, from the scan, so loading
  never parses a header again; -1: not known, read when the image is first loaded)

The names, offsets and shapes are read-only; ``im_files``, ``labels`` and ``segments`` are sequence views
(``im_files[i]`` a str, ``labels[i]`` an (n, 5) array, ``segments[i]`` a list of (k, 2) arrays, [] for none), so
code written for lists reads them unchanged.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

ARRAY_NAMES = ("names", "name_offsets", "boxes", "box_offsets", "points", "point_offsets", "segment_offsets",
               "shapes", "orientations")


def offsets_of(lengths) -> np.ndarray:
    """(n + 1,) int64 start offsets of consecutive runs of ``lengths``."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(np.asarray(lengths, np.int64), out=offsets[1:])
    return offsets


def gather_runs(offsets: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(element indices, new offsets) that put the runs ``order`` of a ragged array one after another."""
    order = np.asarray(order, np.int64)
    lengths = (offsets[1:] - offsets[:-1])[order]
    new_offsets = offsets_of(lengths)
    steps = np.repeat(offsets[:-1][order] - new_offsets[:-1], lengths)
    return steps + np.arange(int(new_offsets[-1]), dtype=np.int64), new_offsets


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


class FlatLabels:
    """Everything the dataset needs to know about a split's images, except the pixels (see the module docstring)."""

    def __init__(self, names, name_offsets, boxes, box_offsets, points, point_offsets, segment_offsets, shapes,
                 orientations=None):
        self.names = _read_only(np.ascontiguousarray(names, np.uint8).reshape(-1))
        self.name_offsets = _read_only(np.ascontiguousarray(name_offsets, np.int64).reshape(-1))
        self.boxes = np.ascontiguousarray(boxes, np.float32).reshape(-1, 5)  # writable: torch.from_numpy warns else
        self.box_offsets = _read_only(np.ascontiguousarray(box_offsets, np.int64).reshape(-1))
        self.points = np.ascontiguousarray(points, np.float32).reshape(-1, 2)
        self.point_offsets = _read_only(np.ascontiguousarray(point_offsets, np.int64).reshape(-1))
        self.segment_offsets = _read_only(np.ascontiguousarray(segment_offsets, np.int64).reshape(-1))
        self.shapes = _read_only(np.ascontiguousarray(shapes, np.int64).reshape(-1, 2))
        if orientations is None:
            orientations = np.full(len(self.shapes), -1, np.int8)
        self.orientations = _read_only(np.ascontiguousarray(orientations, np.int8).reshape(-1))
        self._check()
        self._shared = None  # {name: tensor} once share_memory() moved the arrays into shared memory

    def _check(self) -> None:
        """The offsets describe the arrays: ValueError otherwise (a cache file read back goes through here)."""
        count = len(self.shapes)
        if len(self.orientations) != count or (self.orientations > 8).any() or (self.orientations < -1).any():
            raise ValueError(f"orientations: {len(self.orientations)} values in -1..8 expected for {count} images")
        for offsets, values, what in ((self.name_offsets, self.names, "names"), (self.box_offsets, self.boxes, "boxes"),
                                      (self.point_offsets, self.points, "points"),
                                      (self.segment_offsets, self.point_offsets[1:], "segments")):
            expected = len(self.point_offsets) - 1 if what == "points" else count
            if len(offsets) != expected + 1 or offsets[0] != 0 or offsets[-1] != len(values) or (
                    np.diff(offsets) < 0).any():
                raise ValueError(f"{what}: offsets do not match {len(values)} values for {expected} entries")

    # ------------------------------------------------------------------ building
    @classmethod
    def from_lists(cls, im_files, labels, segments, shapes, orientations=None) -> "FlatLabels":
        """From per-image lists: file names, (n, 5) label arrays, lists of (k, 2) polygons ([] or empty for none),
        (width, height) and EXIF orientations (None: not known)."""
        count = len(im_files)
        encoded = [os.fsencode(str(file)) for file in im_files]
        label_arrays = [np.asarray(lb, np.float32).reshape(-1, 5) for lb in labels]
        segments = list(segments) if segments is not None and len(segments) else [[] for _ in range(count)]
        polygons = [np.asarray(polygon, np.float32).reshape(-1, 2) for image in segments for polygon in image]
        if len(label_arrays) != count or len(segments) != count or len(shapes) != count:
            raise ValueError(f"{count} files but {len(label_arrays)} label arrays, {len(segments)} segment lists "
                             f"and {len(shapes)} shapes")
        return cls(np.frombuffer(b"".join(encoded), np.uint8), offsets_of([len(e) for e in encoded]),
                   np.concatenate(label_arrays + [np.zeros((0, 5), np.float32)]),
                   offsets_of([len(lb) for lb in label_arrays]),
                   np.concatenate(polygons + [np.zeros((0, 2), np.float32)]), offsets_of([len(p) for p in polygons]),
                   offsets_of([len(image) for image in segments]), np.asarray(shapes, np.int64).reshape(-1, 2),
                   orientations)

    @classmethod
    def from_arrays(cls, arrays) -> "FlatLabels":
        """From ``arrays()`` (e.g. read back from an .npz file); ValueError when they do not fit together."""
        return cls(*(arrays[name] for name in ARRAY_NAMES))

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in ARRAY_NAMES}

    def __reduce__(self):  # rebuilt through __init__: read-only and checked again in the receiving process
        if self._shared is not None:
            return FlatLabels._from_tensors, (self._shared,)
        return FlatLabels.from_arrays, (self.arrays(),)

    def share_memory(self) -> "FlatLabels":
        """Move the arrays into shared memory (torch's, as for tensors sent to loader workers), in place.

        Why: a loader worker started by spawn or forkserver (Python 3.14's default on Linux) receives the
        dataset pickled. Plain arrays travel as their bytes, a private copy per worker (~230 bytes per COCO
        image: 230 MB per worker at a million images, times workers, times ranks); shared ones travel as
        handles through torch.multiprocessing's pickler and every worker maps the one copy. Plain pickling (a
        file, ``copy.deepcopy``) still carries the values. Forked workers share the arrays without this."""
        if self._shared is None:
            import torch

            tensors = {name: torch.from_numpy(np.array(getattr(self, name))).share_memory_() for name in ARRAY_NAMES}
            shared = FlatLabels.from_arrays({name: tensor.numpy() for name, tensor in tensors.items()})
            for name in ARRAY_NAMES:
                setattr(self, name, getattr(shared, name))
            self._shared = tensors
        return self

    @property
    def is_shared(self) -> bool:
        return self._shared is not None

    @classmethod
    def _from_tensors(cls, tensors: dict) -> "FlatLabels":
        flat = cls.from_arrays({name: tensor.numpy() for name, tensor in tensors.items()})
        if all(tensor.is_shared() for tensor in tensors.values()):  # mapped, not unpickled by value
            flat._shared = tensors
        return flat

    def take(self, order) -> "FlatLabels":
        """The images ``order`` (indices), in that order."""
        order = np.asarray(order, np.int64).reshape(-1)
        name_index, name_offsets = gather_runs(self.name_offsets, order)
        box_index, box_offsets = gather_runs(self.box_offsets, order)
        polygon_index, segment_offsets = gather_runs(self.segment_offsets, order)
        point_index, point_offsets = gather_runs(self.point_offsets, polygon_index)
        return FlatLabels(self.names[name_index], name_offsets, self.boxes[box_index], box_offsets,
                          self.points[point_index], point_offsets, segment_offsets, self.shapes[order],
                          self.orientations[order])

    def with_files(self, im_files) -> "FlatLabels":
        """The same images under other names (``im_files``, one per image)."""
        encoded = [os.fsencode(str(file)) for file in im_files]
        if len(encoded) != len(self):
            raise ValueError(f"{len(encoded)} names for {len(self)} images")
        return FlatLabels(np.frombuffer(b"".join(encoded), np.uint8), offsets_of([len(e) for e in encoded]),
                          self.boxes, self.box_offsets, self.points, self.point_offsets, self.segment_offsets,
                          self.shapes, self.orientations)

    def with_one_class(self) -> "FlatLabels":
        """A copy whose every box has class 0 (--single-cls)."""
        boxes = self.boxes.copy()
        boxes[:, 0] = 0
        return FlatLabels(self.names, self.name_offsets, boxes, self.box_offsets, self.points, self.point_offsets,
                          self.segment_offsets, self.shapes, self.orientations)

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self.shapes)

    def file(self, i: int) -> str:
        return os.fsdecode(self.names[self.name_offsets[i]:self.name_offsets[i + 1]].tobytes())

    def labels_of(self, i: int) -> np.ndarray:
        return self.boxes[self.box_offsets[i]:self.box_offsets[i + 1]]

    def segments_of(self, i: int) -> list[np.ndarray]:
        first, last = self.segment_offsets[i], self.segment_offsets[i + 1]
        offsets = self.point_offsets
        return [self.points[offsets[k]:offsets[k + 1]] for k in range(first, last)]

    def has_segments(self, i: int) -> bool:
        return bool(self.segment_offsets[i + 1] > self.segment_offsets[i])

    @property
    def im_files(self) -> "FileNames":
        return FileNames(self)

    @property
    def labels(self) -> "Labels":
        return Labels(self)

    @property
    def segments(self) -> "Segments":
        return Segments(self)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in ARRAY_NAMES)


def concatenate(parts: list[FlatLabels]) -> FlatLabels:
    """The images of ``parts`` one after another (the scan's chunks joined)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return FlatLabels.from_lists([], [], [], np.zeros((0, 2), np.int64))

    def joined_offsets(name: str, counts: list[int]) -> np.ndarray:
        bases = np.cumsum([0] + counts[:-1])
        return np.concatenate([[0]] + [getattr(part, name)[1:] + base for part, base in zip(parts, bases)])

    return FlatLabels(np.concatenate([part.names for part in parts]),
                      joined_offsets("name_offsets", [len(part.names) for part in parts]),
                      np.concatenate([part.boxes for part in parts]),
                      joined_offsets("box_offsets", [len(part.boxes) for part in parts]),
                      np.concatenate([part.points for part in parts]),
                      joined_offsets("point_offsets", [len(part.points) for part in parts]),
                      joined_offsets("segment_offsets", [len(part.point_offsets) - 1 for part in parts]),
                      np.concatenate([part.shapes for part in parts]),
                      np.concatenate([part.orientations for part in parts]))


class _View(Sequence):
    """A read-only list-like view of one field of a FlatLabels (an int gives one item, a slice a list)."""

    def __init__(self, flat: FlatLabels):
        self.flat = flat

    def __len__(self) -> int:
        return len(self.flat)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(len(self)))]
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} images")
        return self._item(index)

    def __eq__(self, other) -> bool:
        if isinstance(other, (str, bytes)) or not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(_equal(a, b) for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} images)"

    def _item(self, i: int):
        raise NotImplementedError


def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


class FileNames(_View):
    """``im_files``: image i's path as a str."""

    def _item(self, i: int) -> str:
        return self.flat.file(i)

    def __iter__(self):
        """Every path, decoded in one pass over the names (a whole split's in ~0.05 s per 100k images, against
        ~0.4 s item by item)."""
        data, offsets = self.flat.names.tobytes(), self.flat.name_offsets.tolist()
        return iter([os.fsdecode(data[start:end]) for start, end in zip(offsets[:-1], offsets[1:])])


class Labels(_View):
    """``labels``: image i's (n, 5) float32 ``[class, cx, cy, w, h]`` (a read-only view)."""

    def _item(self, i: int) -> np.ndarray:
        return self.flat.labels_of(i)


class Segments(_View):
    """``segments``: image i's polygons, a list of (k, 2) float32 arrays ([] when it has none)."""

    def _item(self, i: int) -> list[np.ndarray]:
        return self.flat.segments_of(i)
