"""utils/data/flat_labels.py and the scan that fills it: a split's names, labels, segments and sizes as a few flat
arrays (reordered, joined, pickled, read through list-like views), a dataset whose Python objects do not grow
with its images, and the scan's process pool giving what one process gives."""
from __future__ import annotations

import gc
import pickle

import cv2
import numpy as np
import pytest

from utils.data import verify
from utils.data.dataset import LabelSet, YoloDataset
from utils.data.flat_labels import FlatLabels, concatenate
from utils.data.label_cache import SplitLabels


def lists(count: int, seed: int = 0):
    """(files, labels, segments, shapes) with empty images, images without polygons and images with several."""
    rng = np.random.default_rng(seed)
    files = [f"/data/images/im{i}é.jpg" for i in range(count)]
    labels = [rng.random((i % 4, 5)).astype(np.float32) for i in range(count)]
    segments = [[rng.random((3 + k, 2)).astype(np.float32) for k in range(len(lb))] if i % 3 == 0 else []
                for i, lb in enumerate(labels)]
    shapes = rng.integers(10, 500, (count, 2))
    return files, labels, segments, shapes


def assert_holds(flat: FlatLabels, files, labels, segments, shapes) -> None:
    assert len(flat) == len(files) and list(flat.im_files) == files and flat.im_files == files
    assert [flat.im_files[i] for i in range(len(files))] == files  # item by item as iterated at once
    assert all(np.array_equal(a, b) for a, b in zip(flat.labels, labels, strict=True))
    for ours, theirs in zip(flat.segments, segments, strict=True):
        assert len(ours) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    assert np.array_equal(flat.shapes, shapes)


def test_lists_round_trip_and_reorder():
    files, labels, segments, shapes = lists(10)
    flat = FlatLabels.from_lists(files, labels, segments, shapes)
    assert_holds(flat, files, labels, segments, shapes)
    assert flat.segments[1] == [] and flat.labels[-1].shape == (1, 5) and flat.im_files[2:4] == files[2:4]
    order = [7, 0, 3, 3, 9]
    assert_holds(flat.take(order), [files[i] for i in order], [labels[i] for i in order],
                 [segments[i] for i in order], shapes[order])
    again = pickle.loads(pickle.dumps(flat))
    assert_holds(again, files, labels, segments, shapes)
    assert not again.names.flags.writeable and not again.shapes.flags.writeable
    joined = concatenate([flat.take([0, 1, 2]), flat.take([3]), flat.take(range(4, 10))])
    assert_holds(joined, files, labels, segments, shapes)
    with pytest.raises(IndexError):
        flat.labels[10]


def test_orientations_follow_their_images():
    files, labels, segments, shapes = lists(6)
    orientations = [1, 6, 3, 8, 1, 5]
    flat = FlatLabels.from_lists(files, labels, segments, shapes, orientations)
    assert flat.orientations.tolist() == orientations and not flat.orientations.flags.writeable
    assert flat.take([5, 1, 1]).orientations.tolist() == [5, 6, 6]
    assert concatenate([flat.take([3, 4]), flat.take([0])]).orientations.tolist() == [8, 1, 1]
    assert flat.with_one_class().orientations.tolist() == orientations
    assert flat.with_files([f"/b/{i}.jpg" for i in range(6)]).orientations.tolist() == orientations
    assert pickle.loads(pickle.dumps(flat)).orientations.tolist() == orientations
    assert FlatLabels.from_lists(files, labels, segments, shapes).orientations.tolist() == [-1] * 6  # not known
    arrays = flat.arrays()
    arrays["orientations"] = np.array([1, 2, 3, 4, 5, 9], np.int8)
    with pytest.raises(ValueError, match="orientations"):
        FlatLabels.from_arrays(arrays)
    arrays["orientations"] = arrays["orientations"][:5]
    with pytest.raises(ValueError, match="orientations"):
        FlatLabels.from_arrays(arrays)


def test_inconsistent_arrays_are_refused():
    flat = FlatLabels.from_lists(*lists(4))
    arrays = flat.arrays()
    arrays["box_offsets"] = arrays["box_offsets"][:-1]
    with pytest.raises(ValueError, match="boxes: offsets do not match"):
        FlatLabels.from_arrays(arrays)


def reachable_objects(root) -> int:
    """How many distinct Python objects ``root`` reaches (what a forked worker would touch reading them)."""
    seen, stack = set(), [root]
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, type):
            continue
        seen.add(id(item))
        stack.extend(gc.get_referents(item))
    return len(seen)


def test_a_dataset_holds_no_python_object_per_image(tmp_path):
    """Labels, segments, sizes and names live in flat arrays: ten times the images, the same objects."""
    def dataset(count):
        files, labels, segments, shapes = lists(count)
        return YoloDataset(LabelSet(files, labels, shapes, segments), imgsz=64, rect=True, batch_size=4)

    small, large = dataset(30), dataset(300)
    held = [reachable_objects(data.__dict__) for data in (small, large)]
    assert held[0] == held[1], held
    files, labels, segments, shapes = lists(300)
    order = (shapes[:, 1] / shapes[:, 0]).argsort(kind="stable")  # --rect sorts by aspect
    assert_holds(large.flat, [files[i] for i in order], [labels[i] for i in order], [segments[i] for i in order],
                 shapes[order])


def write_split(root, count: int):
    images, labels = root / "images" / "train", root / "labels" / "train"
    images.mkdir(parents=True), labels.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for i in range(count):
        cv2.imwrite(str(images / f"{i:04d}.png"), rng.integers(0, 255, (12 + i % 5, 16, 3), dtype=np.uint8))
        if i % 7:
            rows = "\n".join(f"{i % 3} 0.5 0.5 0.2 0.{1 + k}" for k in range(i % 3))
            if i % 11 == 0:
                rows += "\n0 0.1 0.1 0.3 0.1 0.3 0.4"  # a polygon
            if i % 13 == 0:
                rows = "9 0.5 0.5 0.2 0.2"  # class out of range: skipped
            (labels / f"{i:04d}.txt").write_text(rows + "\n")
    return images


def test_the_scans_process_pool_gives_what_one_process_gives(tmp_path):
    images = write_split(tmp_path, verify.CHUNK + 40)  # two chunks: the pool runs
    alone = verify.scan_split(str(images), nc=3, workers=1, use_cache=False)
    pooled = verify.scan_split(str(images), nc=3, workers=2, use_cache=False)
    assert pooled.stats == alone.stats and pooled.problems == alone.problems and alone.stats["corrupt"] > 0
    assert_holds(pooled.flat, list(alone.im_files), list(alone.labels), list(alone.segments), alone.shapes)
    cached = verify.scan_split(str(images), nc=3, workers=2)
    again = verify.scan_split(str(images), nc=3, workers=2)  # read back from the label cache
    assert again.stats == cached.stats and again.messages == cached.messages
    assert_holds(again.flat, list(alone.im_files), list(alone.labels), list(alone.segments), alone.shapes)


def test_folder_listing_follows_links_and_skips_hidden_names(tmp_path):
    """The scan's folder listing (one scandir per folder): links to files and to folders followed (as YOLOv5's
    recursive glob), hidden names (a dot anywhere below the source) ignored with a message, other files and broken
    links skipped."""
    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True)
    (images / ".cache" / "deep").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for path in (images / "a.jpg", images / "sub" / "B.PNG", images / ".cache" / "deep" / "c.jpg",
                 images / "sub" / ".d.jpg", elsewhere / "e.jpg", elsewhere / "f.jpg"):
        cv2.imwrite(str(path), np.zeros((12, 12, 3), np.uint8))
    (images / "notes.txt").write_text("x")
    (images / "linked.jpg").symlink_to(elsewhere / "e.jpg")
    (images / "linked-folder").symlink_to(elsewhere)
    (images / "broken.jpg").symlink_to(tmp_path / "missing.jpg")
    files, ignored = verify.collect_image_files(str(images))
    linked = ("linked-folder/e.jpg", "linked-folder/f.jpg")
    assert files == sorted(str(images / name) for name in ("a.jpg", "sub/B.PNG", "linked.jpg", *linked))
    assert ignored == [f"{images / name}: hidden file ignored" for name in (".cache/deep/c.jpg", "sub/.d.jpg")]


def test_shared_labels_travel_as_handles_to_spawned_workers():
    """After share_memory() the pickler of spawned loader workers (torch.multiprocessing's) sends handles to one
    copy: its message does not grow with the images, whereas plain pickling still carries every value."""
    from multiprocessing.reduction import ForkingPickler

    def sent(count):
        flat = FlatLabels.from_lists(*lists(count))
        plain = pickle.dumps(flat)
        assert not flat.is_shared and flat.share_memory() is flat and flat.is_shared
        assert_holds(flat, *lists(count))
        return flat, plain, bytes(ForkingPickler.dumps(flat))

    (small, small_plain, small_sent), (large, large_plain, large_sent) = sent(50), sent(5000)
    assert len(large_plain) > 50 * len(small_plain) / 2 and abs(len(large_sent) - len(small_sent)) < 100
    assert len(large_sent) < 4000
    mapped, copied = pickle.loads(large_sent), pickle.loads(pickle.dumps(large))  # a handle is taken once
    for received in (mapped, copied):
        assert_holds(received, *lists(5000))
        assert not received.names.flags.writeable and not received.shapes.flags.writeable
    assert mapped.is_shared and not copied.is_shared and large.share_memory().names is large.names  # moved once


def test_a_dataset_for_spawned_workers_sends_its_labels_once_and_shared(tmp_path):
    """The dataset a spawned worker receives: shapes and orientations come from its labels (not pickled twice),
    and with shared labels the message is the same size for ten times the images."""
    from multiprocessing.reduction import ForkingPickler

    def dataset(count):
        flat = FlatLabels.from_lists(*lists(count), orientations=np.ones(count))  # as the scan gives them
        data = YoloDataset(SplitLabels(flat), imgsz=64, batch_size=4)
        plain = pickle.dumps(data)
        data.share_labels()
        return data, plain, bytes(ForkingPickler.dumps(data))

    (small, _, small_sent), (large, large_plain, large_sent) = dataset(30), dataset(3000)
    assert large.flat.shapes.nbytes + large.flat.names.nbytes < len(large_plain) < 2 * large.flat.nbytes
    assert abs(len(large_sent) - len(small_sent)) < 100
    received = pickle.loads(large_sent)
    assert received.shapes is received.flat.shapes and received.orientations is received.flat.orientations
    assert_holds(received.flat, *lists(3000))
    assert np.array_equal(received.shapes, lists(3000)[3])
