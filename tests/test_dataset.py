"""YoloDataset / create_dataloader: glued boxes through the full pipeline, rect shapes, collate,
reproducible seeding with 0 and 2 workers, caches, single-class, image weights, reduced decode."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from utils.boxes import scale_boxes, xywh2xyxy
from utils.config import Hyp
from utils.data import dataset as dataset_module
from utils.data.dataset import (CacheError, LabelSet, YoloDataset, collate, read_jpeg, reduce_factor,
                                rect_batch_shapes)
from utils.data.images import read_image
from utils.data.loader import EpochSampler, create_dataloader, epoch_sampler, set_loader_epoch, set_loader_image_weights

COLOURS_RGB = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0]], np.uint8)
SIZES = [(160, 120), (120, 160), (200, 100), (128, 128), (100, 180), (150, 90)]  # (w, h)


def make_split(folder, sizes=SIZES, suffix=".png"):
    """Images with one filled rectangle per class at known places; labels normalised."""
    files, labels = [], []
    for i, (w, h) in enumerate(sizes):
        img = np.full((h, w, 3), 60, np.uint8)
        rows = []
        for cls, (fx, fy) in enumerate([(0.1, 0.1), (0.55, 0.1), (0.1, 0.55), (0.55, 0.55)][: 2 + i % 3]):
            x1, y1, x2, y2 = int(fx * w), int(fy * h), int((fx + 0.35) * w), int((fy + 0.35) * h)
            img[y1:y2, x1:x2] = COLOURS_RGB[cls][::-1]
            rows.append([cls, (x1 + x2) / 2 / w, (y1 + y2) / 2 / h, (x2 - x1) / w, (y2 - y1) / h])
        path = folder / f"im{i}{suffix}"
        cv2.imwrite(str(path), img)
        files.append(str(path))
        labels.append(np.array(rows, np.float32))
    return LabelSet(files, labels, np.array(sizes))


@pytest.fixture
def split(tmp_path):
    return make_split(tmp_path)


def no_colour_hyp(**changes):
    return Hyp(hsv_h=0, hsv_s=0, hsv_v=0, degrees=5, shear=2, translate=0.1, scale=0.5, flipud=0.5,
               fliplr=0.5).replace(**changes)


def check_glued(image, targets, min_px=6):
    """Every box (big enough) has its class colour at its centre; returns the number checked."""
    _, height, width = image.shape
    checked = 0
    for _, cls, cx, cy, w, h in targets.tolist():
        if w * width < min_px or h * height < min_px:
            continue
        x, y = int(cx * width), int(cy * height)
        colour = image[:, max(y - 1, 0):y + 2, max(x - 1, 0):x + 2].reshape(3, -1).float().median(1).values
        distances = (torch.from_numpy(COLOURS_RGB).float() - colour).abs().sum(1)
        assert int(distances.argmin()) == int(cls) and distances.min() < 60, (cls, cx, cy, colour)
        checked += 1
    return checked


@pytest.mark.parametrize("rect", [False, True])  # mosaic + perspective, or letterbox + perspective
def test_training_items_keep_boxes_glued(split, rect):
    data = YoloDataset(split, imgsz=96, batch_size=2, augment=True, rect=rect, hyp=no_colour_hyp())
    checked = 0
    for epoch in range(3):
        for i in range(len(data)):
            image, targets, path, shapes = data[(i, epoch)]
            expected = tuple(data.batch_shapes[data.batch[i]]) if rect else (96, 96)
            assert image.dtype == torch.uint8 and tuple(image.shape) == (3, *expected)
            assert image.permute(1, 2, 0).is_contiguous()  # stored channels-last
            assert (shapes is None) != rect and targets.shape[1] == 6 and (targets[:, 2:] <= 1).all()
            checked += check_glued(image, targets)
    assert checked > 30


def test_letterbox_and_rect_items_glued_and_map_back(split):
    for rect in (False, True):
        data = YoloDataset(split, imgsz=96, batch_size=2, augment=False, rect=rect, pad=0.5)
        for i in range(len(data)):
            image, targets, path, ((h0, w0), ratio_pad) = data[i]
            assert check_glued(image, targets) == len(targets)
            assert (w0, h0) == tuple(data.shapes[i])
            boxes = xywh2xyxy(targets[:, 2:] * torch.tensor([image.shape[2], image.shape[1]] * 2))
            original = scale_boxes(image.shape[1:], boxes, (h0, w0), ratio_pad)
            expected = xywh2xyxy(torch.from_numpy(data.labels[i][:, 1:]) * torch.tensor([w0, h0] * 2))
            assert torch.allclose(original, expected.float(), atol=1.5)


def test_rect_batch_shapes():
    shapes = np.array([[128, 64], [128, 96], [96, 128], [64, 128], [128, 128]])  # (w, h), sorted by h/w
    batch_shapes, batch = rect_batch_shapes(shapes, 2, 128, 32)
    assert batch.tolist() == [0, 0, 1, 1, 2]
    assert batch_shapes.tolist() == [[96, 128], [128, 96], [128, 128]]  # (h, w) per batch
    padded, _ = rect_batch_shapes(shapes, 2, 128, 32, pad=0.5)
    assert padded.tolist() == [[128, 160], [160, 128], [160, 160]]


def test_rect_dataset_sorts_and_batches_share_a_shape(split):
    loader, data = create_dataloader(None, 96, 2, 32, rect=True, workers=0, labels=split)
    aspects = data.shapes[:, 1] / data.shapes[:, 0]
    assert (np.diff(aspects) >= 0).all()
    for (images, _, _, _), shape in zip(loader, data.batch_shapes):
        assert tuple(images.shape[2:]) == tuple(shape)


def test_image_weights_turn_rect_off_and_the_mosaic_on(split):
    """As YOLOv5: batches drawn by image weight mix shapes, so --rect --image-weights trains mosaics."""
    _, data = create_dataloader(None, 96, 2, 32, hyp=Hyp(), augment=True, rect=True, image_weights=True, workers=0,
                                labels=split)
    assert not data.rect and data.mosaic and data.batch_shapes is None


def test_collate_format(split):
    data = YoloDataset(split, imgsz=64)
    images, targets, paths, shapes = collate([data[0], data[1], data[2]])
    assert images.shape == (3, 3, 64, 64) and images.dtype == torch.uint8
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(images[1], data[1][0])
    counts = [len(data.labels[i]) for i in range(3)]
    assert targets.shape == (sum(counts), 6)
    assert targets[:, 0].tolist() == [float(i) for i, c in enumerate(counts) for _ in range(c)]
    assert paths == data.im_files[:3] and len(shapes) == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_seeding_is_reproducible(split, workers):
    def first_batches(epoch):
        loader, _ = create_dataloader(None, 64, 4, 32, hyp=Hyp(), augment=True, workers=workers, shuffle=True,
                                      seed=3, labels=split)
        set_loader_epoch(loader, epoch)
        return [batch for batch, _ in zip(loader, range(2))]

    a, b = first_batches(1), first_batches(1)
    assert a[0][0].is_contiguous(memory_format=torch.channels_last)  # also when stacked inside workers
    for x, y in zip(a, b):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2]
    other = first_batches(2)
    assert not torch.equal(a[0][0], other[0][0])


# mosaic partners from the split, from the batch, and from the split again (a batch of 3 has too few images)
@pytest.mark.parametrize("partners, batch_size", [("dataset", 4), ("batch", 4), ("batch", 3)])
def test_worker_count_does_not_change_batches(split, partners, batch_size):
    batches = []
    for workers in (0, 2):
        loader, _ = create_dataloader(None, 64, batch_size, 32, hyp=Hyp(), augment=True, workers=workers,
                                      shuffle=True, seed=1, labels=split, mosaic_partners=partners)
        set_loader_epoch(loader, 4)
        batches.append(next(iter(loader)))
    assert torch.equal(batches[0][0], batches[1][0]) and torch.equal(batches[0][1], batches[1][1])


def test_ram_cache_refused_when_memory_is_short(split, monkeypatch):
    monkeypatch.setattr(dataset_module, "available_memory", lambda: 1000)
    with pytest.raises(CacheError, match=r"need .* GB.*available 0\.0 GB"):
        YoloDataset(split, imgsz=64, cache="ram")


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    """The user cache folder (--cache disk stores, label caches of read-only datasets) under tmp_path."""
    monkeypatch.setenv("YOLO_TRAINER_CACHE", str(tmp_path / "user-cache"))
    return tmp_path / "user-cache"


def test_ram_and_disk_caches_give_the_same_items(split, tmp_path, user_cache):
    dataset_files = sorted(tmp_path.iterdir())
    plain = YoloDataset(split, imgsz=64)
    ram = YoloDataset(split, imgsz=64, cache="ram")
    assert ram.in_ram and all(max(ram.store[i].shape[:2]) == 64 for i in range(len(ram)))
    disk = YoloDataset(split, imgsz=64, cache="disk")
    assert not disk.in_ram and [p.name for p in (user_cache / "images").iterdir()] == [Path(disk.store.path).name]
    for i in range(len(plain)):
        assert torch.equal(plain[i][0], ram[i][0]) and torch.equal(plain[i][0], disk[i][0])
    assert sorted(tmp_path.iterdir()) == dataset_files + [user_cache]  # nothing written beside the images
    again = YoloDataset(split, imgsz=64, cache="disk")  # a restart reads the store: no image decoded
    assert again.store.path == disk.store.path and torch.equal(again[2][0], plain[2][0])


def test_auto_cache_caches_small_datasets_only(split, monkeypatch):
    """--cache auto (train.py's default) caches in RAM when every copy fits the automatic budget, and the
    batches are the ones an uncached loader gives; over the budget nothing is cached."""
    from utils.data import loader as loader_module

    hyp = Hyp()
    need = dataset_module.ram_cache_bytes(split.shapes, 64)
    monkeypatch.setattr(dataset_module, "available_memory", lambda: 10 * need)  # share 0.1 -> budget = need
    auto, auto_data = create_dataloader(None, 64, 3, 32, hyp=hyp, augment=True, shuffle=True, cache="auto",
                                        workers=0, labels=split)
    off, off_data = create_dataloader(None, 64, 3, 32, hyp=hyp, augment=True, shuffle=True, cache="off",
                                      workers=0, labels=split)
    assert auto_data.in_ram and off_data.store is None
    for (a, ta, _, _), (b, tb, _, _) in zip(auto, off):
        assert torch.equal(a, b) and torch.equal(ta, tb)
    # one copy per machine, whatever the processes and the workers' start method
    two_ranks, _ = create_dataloader(None, 64, 3, 32, hyp=hyp, cache="auto", workers=0, world_size=2,
                                     processes_per_node=2, labels=split)
    assert two_ranks.dataset.in_ram
    monkeypatch.setattr(loader_module, "worker_count", lambda *args: 2)
    spawned, _ = create_dataloader(None, 64, 3, 32, hyp=hyp, cache="auto", workers=2, labels=split,
                                   multiprocessing_context="spawn")
    assert spawned.dataset.in_ram
    monkeypatch.setattr(dataset_module, "available_memory", lambda: 10 * need - 10)  # budget just short
    over, _ = create_dataloader(None, 64, 3, 32, hyp=hyp, cache="auto", workers=0, labels=split)
    assert over.dataset.store is None
    with pytest.raises(ValueError, match="unknown cache mode 'ssd'"):
        create_dataloader(None, 64, 3, 32, hyp=hyp, cache="ssd", workers=0, labels=split)


@pytest.mark.parametrize("cache,cpus_busy,workers", [("ram", True, 0), ("ram", False, 2), (None, True, 2),
                                                     ("disk", True, 2)])
def test_images_in_ram_load_in_line_when_the_compute_fills_the_cpus(split, monkeypatch, user_cache, cache, cpus_busy,
                                                                    workers):
    """Worker processes only when they have files to read: with every image in RAM and the CPUs busy with
    the training's compute, the main process loads (the disk cache still reads its file)."""
    from utils.data import loader as loader_module

    monkeypatch.setattr(loader_module, "worker_count", lambda *args: 2)
    loader, _ = create_dataloader(None, 64, 3, 32, hyp=Hyp(), augment=True, cache=cache, workers=2, labels=split,
                                  cpus_busy=cpus_busy)
    assert loader.num_workers == workers


def test_compute_fills_cpus(monkeypatch):
    from utils import device as device_module

    monkeypatch.setattr(device_module, "usable_cpus", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert device_module.compute_fills_cpus("cpu", processes=2)
    assert not device_module.compute_fills_cpus("cpu", processes=1)  # two CPUs left for loader workers
    assert not device_module.compute_fills_cpus("cuda:0", processes=2)  # the GPU computes


@pytest.mark.parametrize("cache", [None, "ram"])
def test_mosaic_items_equal_a_whole_canvas_build(split, monkeypatch, cache):
    """The dataset's windowed mosaic (only the part the warp reads, hidden images not loaded) gives the
    same items as building the whole canvas; sizes come from the scan (or the RAM cache) before loading."""
    hyp = Hyp(mixup=0.5)  # hyp.scratch-low's augmentation, plus mixup (two mosaics per item)
    windowed = YoloDataset(split, imgsz=96, augment=True, hyp=hyp, cache=cache)
    items = [windowed[(i, epoch)] for epoch in range(3) for i in range(len(windowed))]
    monkeypatch.setattr(dataset_module, "source_window", lambda matrix, out_size, shape: None)
    whole = YoloDataset(split, imgsz=96, augment=True, hyp=hyp, cache=cache)
    for k, (image, targets, _, _) in enumerate(items):
        other = whole[(k % len(whole), k // len(whole))]
        assert torch.equal(image, other[0]) and torch.equal(targets, other[1])


def test_single_cls(split):
    data = YoloDataset(split, imgsz=64, single_cls=True)
    assert all((lb[:, 0] == 0).all() for lb in data.labels)
    assert (data[2][1][:, 1] == 0).all()


def test_image_weights_sampling(split):
    loader, data = create_dataloader(None, 64, 2, 32, workers=0, shuffle=True, labels=split)
    weights = np.array([0.0, 0.0, 0.0, 1.0])  # only class 3 counts: images 1 and 4 have it (2 + i % 3 == 4)
    set_loader_image_weights(loader, weights)
    drawn = set(epoch_sampler(loader).indices().tolist())
    assert drawn == {i for i, lb in enumerate(data.labels) if (lb[:, 0] == 3).any()}


def test_image_weights_draw_the_mosaics_other_images_too(split):
    """As YOLOv5 (partners from its weighted indices): with only class 3 weighted, every mosaic's other three images
    hold class 3; with the weights taken away, partners are drawn from the whole split again."""
    _, data = create_dataloader(None, 64, 2, 32, hyp=Hyp(), augment=True, workers=0, shuffle=True, labels=split)
    weighted = {i for i, lb in enumerate(data.labels) if (lb[:, 0] == 3).any()}
    data.set_partner_weights([1.0 if i in weighted else 0.0 for i in range(data.n)])
    for index in range(data.n):
        for seed in range(5):
            partners = list(data.mosaic_draws(index, np.random.default_rng((seed, index)))[0])
            partners.remove(index)
            assert set(partners) <= weighted, (index, partners)
    data.set_partner_weights(None)
    uniform = {k for i in range(data.n) for k in data.mosaic_draws(i, np.random.default_rng((1, i)))[0]}
    assert uniform - weighted


def test_image_weights_reach_the_persistent_workers_each_epoch(split):
    """The partner weights live in shared memory: loader workers started in epoch 0 draw epoch 1's mosaics by the
    weights set after epoch 0, as the main process does (batches equal to a loader without workers)."""
    def two_epochs(workers):
        loader, data = create_dataloader(None, 64, 3, 32, hyp=Hyp(), augment=True, workers=workers, shuffle=True,
                                         seed=5, labels=split)
        batches = []
        for epoch, weights in enumerate(([1.0, 1, 1, 1], [0.0, 0, 0, 1])):
            set_loader_image_weights(loader, np.array(weights))
            set_loader_epoch(loader, epoch)
            batches += [(images, targets) for images, targets, _, _ in loader]
        return batches

    inline, workers = two_epochs(0), two_epochs(2)
    assert len(inline) == len(workers) == 4
    for (a, x), (b, y) in zip(inline, workers):
        assert torch.equal(a, b) and torch.equal(x, y)


def test_distributed_sampler_splits_evenly():
    parts = [EpochSampler(10, shuffle=True, seed=0, rank=r, world_size=3).indices() for r in range(3)]
    assert [len(p) for p in parts] == [4, 4, 4]
    assert set(np.concatenate(parts).tolist()) == set(range(10))


def test_reduced_jpeg_decode_matches_full_decode(tmp_path):
    split = make_split(tmp_path, sizes=[(400, 300)], suffix=".jpg")
    assert reduce_factor(400, 300, 96, split.im_files[0]) == 4
    assert reduce_factor(400, 300, 320, split.im_files[0]) == 1
    assert reduce_factor(400, 300, 200, split.im_files[0]) == 2 and reduce_factor(400, 300, 201, "a.JPG") == 1
    assert reduce_factor(400, 300, 96, "x.png") == 1
    reduced = read_jpeg(split.im_files[0], 4)
    assert reduced.shape == (75, 100, 3)
    full = cv2.resize(read_image(split.im_files[0]), (100, 75), interpolation=cv2.INTER_AREA)
    assert np.abs(reduced.astype(int) - full).mean() < 6
    image, targets, _, _ = YoloDataset(split, imgsz=96)[0]
    assert image.shape == (3, 96, 96) and check_glued(image, targets) == len(targets)


@pytest.mark.parametrize("orientation", [1, 6, 3])
def test_fast_jpeg_decode_equals_read_image_with_exif(tmp_path, orientation):
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = np.kron(rng.integers(0, 255, (6, 8, 3)), np.ones((16, 16, 1))).astype(np.uint8)  # 96x128 blocks
    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = orientation
    path = tmp_path / f"exif{orientation}.jpg"
    image.save(path, exif=exif, quality=95)
    expected = read_image(path)
    assert np.array_equal(read_jpeg(str(path)), expected)
    assert np.array_equal(read_jpeg(str(path), 1, orientation), expected)
    assert read_jpeg(str(path), 2).shape[:2] == (expected.shape[0] // 2, expected.shape[1] // 2)
    height, width = expected.shape[:2]
    data = YoloDataset(LabelSet([str(path)], [np.zeros((0, 5), np.float32)], np.array([[width, height]])), imgsz=128)
    assert np.array_equal(data.decode(0), expected) and data.orientations.tolist() == [orientation]


def test_an_mpo_photo_is_an_image_read_as_its_first_picture_upright(tmp_path):
    """A camera's MPO file (YOLOv5 lists .mpo): scanned as an image, decoded as its first JPEG picture, its EXIF
    orientation applied as for a JPEG."""
    from PIL import Image

    from utils.data.verify import scan_split

    (tmp_path / "images").mkdir(), (tmp_path / "labels").mkdir()
    first = np.kron(np.arange(48, dtype=np.uint8).reshape(6, 8, 1) * 5, np.ones((16, 16, 3), np.uint8))  # 96x128
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(first).save(tmp_path / "images" / "stereo.mpo", format="MPO", save_all=True, quality=95,
                                append_images=[Image.fromarray(np.zeros_like(first))], exif=exif)
    (tmp_path / "labels" / "stereo.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    split = scan_split([str(tmp_path / "images")], 1, cache_dir=tmp_path / "cache")
    assert [Path(f).name for f in split.im_files] == ["stereo.mpo"]
    assert split.flat.orientations.tolist() == [6] and split.shapes.tolist() == [[96, 128]]  # (width, height) upright
    image = read_image(split.im_files[0])
    expected = np.rot90(first, -1)  # orientation 6: turned 90 degrees clockwise
    assert image.shape == expected.shape and np.abs(image.astype(int) - expected).max() <= 8  # JPEG at quality 95


def test_the_scan_records_orientations_and_loading_reads_no_header(tmp_path, monkeypatch):
    """EXIF-rotated JPEG and PNG, and a BMP (never rotated): the scan records what read_image applies, and the
    dataset loads the same pixels without parsing a header again (a PNG's EXIF costs PIL a whole decode)."""
    from PIL import Image

    from utils.data import images as images_module
    from utils.data.verify import scan_split

    rng = np.random.default_rng(1)
    pixels = np.kron(rng.integers(0, 255, (6, 8, 3)), np.ones((16, 16, 1))).astype(np.uint8)  # 96x128 blocks
    (tmp_path / "images").mkdir(), (tmp_path / "labels").mkdir()
    for name, orientation in (("a.jpg", 6), ("b.png", 8), ("c.png", 1), ("d.bmp", 1)):
        image = Image.fromarray(pixels)
        exif = image.getexif()
        exif[0x0112] = 6 if name.endswith(".bmp") else orientation
        image.save(tmp_path / "images" / name, exif=exif, **({"quality": 95} if name.endswith(".jpg") else {}))
        (tmp_path / "labels" / f"{Path(name).stem}.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    split = scan_split([str(tmp_path / "images")], 1, cache_dir=tmp_path / "cache")
    assert [Path(f).name for f in split.im_files] == ["a.jpg", "b.png", "c.png", "d.bmp"]
    assert split.flat.orientations.tolist() == [6, 8, 1, 1]
    assert split.shapes.tolist() == [[96, 128], [96, 128], [128, 96], [128, 96]]  # (width, height) upright
    expected = [read_image(f) for f in split.im_files]
    assert expected[0].shape == (128, 96, 3) and expected[3].shape == (96, 128, 3)
    again = scan_split([str(tmp_path / "images")], 1, cache_dir=tmp_path / "cache")  # read back from the cache
    assert again.flat.orientations.tolist() == [6, 8, 1, 1]

    def no_header(path):
        raise AssertionError(f"header parsed again: {path}")

    monkeypatch.setattr(images_module, "exif_orientation", no_header)
    data = YoloDataset(again, imgsz=128)
    for i, pixels_expected in enumerate(expected):
        assert np.array_equal(data.decode(i), pixels_expected)
    image, targets, _, _ = data[0]
    assert image.shape == (3, 128, 128) and len(targets) == 1


def test_augmenting_never_changes_the_ram_cache(split):
    hyp = Hyp(mosaic=0, degrees=0, translate=0, scale=0, shear=0, fliplr=0)  # HSV only
    data = YoloDataset(split, imgsz=128, augment=True, hyp=hyp, cache="ram")
    cached = data.store[3].copy()  # 128 x 128: letterbox returns the cached array itself
    assert not data.store[3].flags.writeable  # an in-place change of the cache fails instead of changing it
    first, second = data[(3, 0)][0], data[(3, 1)][0]
    assert np.array_equal(data.store[3], cached) and not torch.equal(first, second)


def test_collate_pads_mixed_sizes_and_keeps_boxes_glued(split):
    data = YoloDataset(split, imgsz=96, batch_size=2, rect=True)
    items = [data[0], data[len(data) - 1]]  # first and last rect batches differ in shape
    assert items[0][0].shape != items[1][0].shape
    images, targets, _, _ = collate(items)
    for i in range(2):
        assert check_glued(images[i], targets[targets[:, 0] == i]) == (targets[:, 0] == i).sum()
