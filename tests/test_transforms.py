"""Augmentations keep boxes glued to pixels; box filter rules; HSV, mixup, copy-paste, multi-scale."""
from __future__ import annotations

import cv2
import numpy as np
import pytest

from utils.data.transforms import (apply_warp, augment_hsv, box_candidates, copy_paste, flip_lr, flip_ud, mixup,
                                   mosaic4, mosaic_placements, multi_scale_size, perspective_matrix,
                                   random_perspective, source_window, warp_image)

COLOURS = np.array([[0, 0, 255], [0, 255, 0], [255, 0, 0], [0, 255, 255]], np.uint8)  # BGR per class
BACKGROUND = 60


def painted(height, width, boxes):
    """Grey image with filled rectangles; boxes (n, 5) [class, x1, y1, x2, y2] pixels."""
    img = np.full((height, width, 3), BACKGROUND, np.uint8)
    for cls, x1, y1, x2, y2 in boxes.astype(int):
        img[y1:y2, x1:x2] = COLOURS[cls]
    return img


def centre_class(img, box):
    """Class whose colour is nearest to the median colour of the 3x3 patch at the box centre."""
    cx, cy = int((box[0] + box[2]) / 2), int((box[1] + box[3]) / 2)
    patch = img[max(cy - 1, 0):cy + 2, max(cx - 1, 0):cx + 2, :3].reshape(-1, 3)
    colour = np.median(patch, 0)
    distances = np.abs(COLOURS.astype(float) - colour).sum(1)
    return int(distances.argmin()), distances.min()


def assert_glued(img, labels, min_size=8):
    checked = 0
    for cls, *box in labels:
        if box[2] - box[0] < min_size or box[3] - box[1] < min_size:
            continue
        found, distance = centre_class(img, box)
        assert found == int(cls) and distance < 60, (cls, box, found, distance)
        checked += 1
    return checked


BOXES = np.array([[0, 20, 30, 70, 90], [1, 100, 20, 180, 60], [2, 40, 120, 90, 190], [3, 130, 110, 190, 180]], float)


def test_box_candidates_rules():
    before = np.array([[0, 0, 10, 10]] * 5, float)
    after = np.array([[0, 0, 10, 10],      # unchanged: kept
                      [0, 0, 1.5, 10],     # narrower than 2 px: dropped
                      [0, 0, 3, 3],        # 9% of the area left: dropped
                      [0, 0, 2, 2],        # exactly 2 px and 4% of the area: dropped by area
                      [0, 0, 4, 4]], float)  # 16% of the area: kept
    assert box_candidates(before, after).tolist() == [True, False, False, False, True]
    long_before = np.array([[0, 0, 1000, 10]], float)
    thin = np.array([[0, 0, 500, 4.9]], float)  # aspect > 100
    assert not box_candidates(long_before, thin)[0]
    assert box_candidates(long_before, np.array([[0, 0, 500, 5.1]]))[0]
    square = np.array([[0, 0, 10, 10.0]])  # as YOLOv5 v7: more than 2 px and more than the area share, not equal
    after = np.array([[0, 0, 2.01, 6], [0, 0, 2, 6], [0, 0, 4, 2.6], [0, 0, 4, 2.5]])
    kept = box_candidates(np.repeat(square, 4, 0), after)
    assert kept.tolist() == [True, False, True, False]  # 2 px wide; 10% of the area


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("perspective", [0.0, 0.0005])
def test_random_perspective_keeps_boxes_glued(seed, perspective):
    img = painted(200, 200, BOXES)
    out, labels, _ = random_perspective(img, BOXES, (), degrees=10, translate=0.1, scale=0.4, shear=3,
                                        perspective=perspective, rng=np.random.default_rng(seed))
    assert out.shape == img.shape and out.dtype == np.uint8
    assert (labels[:, 1:] >= 0).all() and (labels[:, [1, 3]] <= 200).all() and (labels[:, [2, 4]] <= 200).all()
    assert assert_glued(out, labels) >= 2


def test_random_perspective_identity_is_a_no_op():
    img = painted(64, 96, BOXES[:1] / 3)
    out, labels, _ = random_perspective(img, BOXES[:1] / 3, (), 0, 0, 0, 0, 0, rng=np.random.default_rng(0))
    assert out is img and np.allclose(labels, BOXES[:1] / 3)


def test_warp_three_and_four_channels_agree():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (50, 70, 3), dtype=np.uint8)
    matrix = np.array([[0.9, 0.1, 3.0], [-0.1, 1.1, -2.0], [0, 0, 1]])
    three = warp_image(img, matrix, (60, 40), False)
    four = warp_image(np.dstack((img, img[:, :, :1])), matrix, (60, 40), False)
    assert three.shape == (40, 60, 3) and np.array_equal(three, four[:, :, :3])


def test_flips_keep_boxes_glued():
    img = painted(200, 200, BOXES)
    for flip in (flip_lr, flip_ud):
        out, labels = flip(img, BOXES)
        assert assert_glued(out, labels) == len(BOXES)
    assert np.allclose(flip_lr(img, BOXES)[1][0], [0, 130, 30, 180, 90])


@pytest.mark.parametrize("seed", range(3))
def test_mosaic_then_perspective_keeps_boxes_glued(seed):
    rng = np.random.default_rng(seed)
    s = 128
    sizes = [(128, 96), (100, 128), (128, 128), (64, 128)]
    images, labels = [], []
    for h, w in sizes:
        boxes = BOXES.copy()
        boxes[:, [1, 3]] *= w / 200
        boxes[:, [2, 4]] *= h / 200
        images.append(painted(h, w, boxes))
        normalised = np.stack((boxes[:, 0], (boxes[:, 1] + boxes[:, 3]) / 2 / w, (boxes[:, 2] + boxes[:, 4]) / 2 / h,
                               (boxes[:, 3] - boxes[:, 1]) / w, (boxes[:, 4] - boxes[:, 2]) / h), 1)
        labels.append(normalised.astype(np.float32))
    centre = tuple(int(v) for v in rng.uniform(0.5 * s, 1.5 * s, 2))
    canvas, boxes, _ = mosaic4(images.__getitem__, sizes, labels, [[]] * 4, s, centre)
    assert canvas.shape == (2 * s, 2 * s, 4)
    covered = np.zeros(canvas.shape[:2], bool)
    for a, _ in mosaic_placements(centre, [im.shape[:2] for im in images], s):
        covered[a[1]:a[3], a[0]:a[2]] = True
    assert (canvas[~covered] == 114).all() and (canvas[covered][:, :3] != 114).all()
    assert assert_glued(canvas, boxes, min_size=4) >= 4
    out, boxes, _ = random_perspective(canvas, boxes, (), degrees=5, translate=0.1, scale=0.5, shear=2,
                                       border=(-s // 2, -s // 2), rng=rng)
    assert out.shape == (s, s, 4)
    assert assert_glued(out, boxes) >= 1


@pytest.mark.parametrize("degrees, shear", [(0.0, 0.0), (10.0, 5.0)])
def test_windowed_mosaic_warps_to_the_same_pixels_and_labels_without_loading_hidden_images(degrees, shear):
    """Building only the canvas part the warp reads (and skipping images outside it) changes nothing."""
    s, skipped = 96, 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        sizes = [(int(rng.integers(40, s + 1)), s) if k % 2 else (s, int(rng.integers(40, s + 1))) for k in range(4)]
        images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
        labels = [np.array([[k, 0.5, 0.5, 0.4, 0.3], [k, 0.2, 0.3, 0.2, 0.2]], np.float32) for k in range(4)]
        centre = tuple(int(v) for v in rng.uniform(0.5 * s, 1.5 * s, 2))
        matrix, zoom = perspective_matrix((2 * s, 2 * s), (s, s), degrees, 0.1, 0.5, shear, 0.0, rng)
        window = source_window(matrix, (s, s), (2 * s, 2 * s))
        loaded = []

        def load(position):
            loaded.append(position)
            return images[position]

        stale = np.full((2 * s, 2 * s, 4), 7, np.uint8)  # a reused buffer holding an older mosaic
        full, full_labels, _ = mosaic4(images.__getitem__, sizes, labels, [[]] * 4, s, centre)
        part, part_labels, _ = mosaic4(load, sizes, labels, [[]] * 4, s, centre, out=stale, window=window)
        np.testing.assert_array_equal(part_labels, full_labels)
        x1, y1, x2, y2 = window
        np.testing.assert_array_equal(part[y1:y2, x1:x2], full[y1:y2, x1:x2])
        out_full, kept_full, _ = apply_warp(full, full_labels, [], matrix, zoom, (s, s), False)
        out_part, kept_part, _ = apply_warp(part, part_labels, [], matrix, zoom, (s, s), False)
        np.testing.assert_array_equal(out_part, out_full)
        np.testing.assert_array_equal(kept_part, kept_full)
        for position in set(range(4)) - set(loaded):  # never loaded: none of its labels survive the warp
            skipped += 1
            assert position not in kept_full[:, 0]
    assert skipped > 0


def test_source_window_of_a_singular_warp_is_the_whole_image():
    singular = np.diag([0.0, 0.0, 1.0])  # zero zoom
    assert source_window(singular, (64, 64), (128, 96)) == (0, 0, 96, 128)
    zoom_in = np.array([[2.0, 0, -64], [0, 2.0, -64], [0, 0, 1]])  # output 64x64 reads canvas [32, 64) + margin
    assert source_window(zoom_in, (64, 64), (128, 128)) == (30, 30, 66, 66)


def test_mosaic_placements_cover_the_centre():
    places = mosaic_placements((100, 80), [(50, 60)] * 4, 64)
    assert [a for a, _ in places] == [(40, 30, 100, 80), (100, 30, 128, 80), (40, 80, 100, 128), (100, 80, 128, 128)]
    for a, b in places:  # canvas and image rectangles have the same size
        assert (a[2] - a[0], a[3] - a[1]) == (b[2] - b[0], b[3] - b[1])


def test_augment_hsv_in_place_and_reproducible():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
    first, second = img.copy(), img.copy()
    augment_hsv(first, 0.015, 0.7, 0.4, np.random.default_rng(5))
    augment_hsv(second, 0.015, 0.7, 0.4, np.random.default_rng(5))
    assert np.array_equal(first, second) and not np.array_equal(first, img)
    untouched = img.copy()
    augment_hsv(untouched, 0, 0, 0, np.random.default_rng(5))
    assert np.array_equal(untouched, img)


def test_augment_hsv_applies_the_drawn_gains_per_hsv_plane():
    img = np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    gains = np.random.default_rng(7).uniform(-1, 1, 3) * (0.1, 0.7, 0.4) + 1  # what augment_hsv draws
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV).astype(np.float64)
    hsv[..., 0] = (hsv[..., 0] * gains[0]) % 180
    hsv[..., 1:] = np.clip(hsv[..., 1:] * gains[1:], 0, 255)
    expected = cv2.cvtColor(hsv.astype(np.uint8), cv2.COLOR_HSV2BGR)
    assert np.array_equal(augment_hsv(img.copy(), 0.1, 0.7, 0.4, np.random.default_rng(7)), expected)


def test_mixup_blends_and_keeps_both_label_sets():
    a, b = np.full((8, 8, 3), 200, np.uint8), np.full((8, 8, 3), 100, np.uint8)
    out, labels = mixup(a, BOXES[:1], b, BOXES[1:], np.random.default_rng(0))
    assert len(labels) == len(BOXES)
    assert 120 < out.mean() < 180  # Beta(32, 32) ratio stays near 0.5


def test_copy_paste_adds_mirrored_object():
    boxes = np.array([[2, 10, 10, 40, 40]], float)
    img = painted(64, 128, boxes)
    segment = np.array([[10, 10], [40, 10], [40, 40], [10, 40]], float)
    out, labels, segments = copy_paste(img, boxes, [segment], probability=1.0, rng=np.random.default_rng(0))
    assert len(labels) == 2 and len(segments) == 2
    assert np.allclose(labels[1], [2, 88, 10, 118, 40])
    assert assert_glued(out, labels) == 2


def test_multi_scale_size_range_and_stride():
    rng = np.random.default_rng(0)
    sizes = [multi_scale_size(640, 32, rng) for _ in range(200)]
    assert all(s % 32 == 0 and 320 <= s <= 960 for s in sizes)
    assert len(set(sizes)) > 10


def test_augment_hsv_bgra_matches_bgr():
    from utils.data.dataset import to_rgb_tensor

    rng = np.random.default_rng(1)
    img = rng.integers(0, 255, (16, 24, 3), dtype=np.uint8)
    four = np.dstack((img, np.zeros((16, 24, 1), np.uint8)))
    three = img.copy()
    assert augment_hsv(three, 0.1, 0.7, 0.4, np.random.default_rng(2)) is three
    result = augment_hsv(four, 0.1, 0.7, 0.4, np.random.default_rng(2))
    assert result.shape == img.shape and np.array_equal(result, three)
    rgb = to_rgb_tensor(four)
    assert rgb.shape == (3, 16, 24) and rgb.permute(1, 2, 0).is_contiguous()  # channels-last storage
    assert np.array_equal(rgb.numpy(), img.transpose(2, 0, 1)[::-1])
    as_rgb = augment_hsv(four, 0.1, 0.7, 0.4, np.random.default_rng(2), rgb=True)
    assert np.array_equal(as_rgb, three[:, :, ::-1])
    assert np.array_equal(augment_hsv(img.copy(), 0, 0, 0, rgb=True), img[:, :, ::-1])


def test_plot_labels_writes_jpeg(tmp_path):
    from PIL import Image

    from utils.data.plots import plot_labels

    rng = np.random.default_rng(0)
    labels = np.column_stack((rng.integers(0, 3, 50), rng.uniform(0.1, 0.9, (50, 2)), rng.uniform(0.01, 0.3, (50, 2))))
    path = plot_labels(labels, ["a", "b", "c"], tmp_path)
    assert path == tmp_path / "labels.jpg"
    with Image.open(path) as im:
        assert im.format == "JPEG" and min(im.size) > 500
    assert plot_labels(np.zeros((0, 5)), ["a"], tmp_path / "empty").exists()


def test_label_correlogram_counts_each_column_and_pair(tmp_path):
    """labels_correlogram.jpg (YOLOv5's corner pair plot of x, y, width, height): the histograms it draws count every
    box in its bin, a 2-D histogram's colours top out where the bins of fewer boxes hold 90% of them, and the picture
    is a 2000-pixel JPEG, also for a split without boxes."""
    from PIL import Image

    from utils.data.plots import CORRELOGRAM_BINS, correlogram_histograms, plot_label_correlogram, pmax_ceiling

    labels = np.array([[0, 0.11, 0.51, 0.2, 0.3], [1, 0.11, 0.95, 0.2, 0.05], [2, 0.99, 0.51, 0.6, 0.3]])
    single, pairs, ceilings = correlogram_histograms(labels)
    assert [int(h.sum()) for h in single] == [3, 3, 3, 3] and len(single[0]) == CORRELOGRAM_BINS
    assert single[0][5] == 2 and single[0][49] == 1  # x: 0.11 twice (bin 5), 0.99 once (bin 49)
    assert sorted(pairs) == [(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]
    assert pairs[1, 0][5, 25] == 1 and pairs[1, 0][5, 47] == 1 and pairs[1, 0][49, 25] == 1  # (x bin, y bin)
    assert pairs[3, 2][10, 15] == pairs[3, 2][10, 2] == pairs[3, 2][30, 15] == 1 and pairs[3, 2].sum() == 3  # (w, h)
    assert pairs[2, 0][5, 10] == 2 and pairs[2, 0][49, 30] == 1  # (x, width): two boxes in one bin
    assert ceilings[2, 0] == 2 and ceilings[3, 2] == 1  # 90% of 3 boxes: the 2-box bin; all bins alike: 1
    assert pmax_ceiling(np.array([[1, 1], [8, 0]]), 0.9) == 8 and pmax_ceiling(np.array([[1, 1], [8, 0]]), 0.2) == 1
    assert pmax_ceiling(np.zeros((2, 2)), 0.9) == 1.0
    for given, folder in ((labels, tmp_path), (np.zeros((0, 5)), tmp_path / "empty")):
        path = plot_label_correlogram(given, folder)
        assert path == folder / "labels_correlogram.jpg"
        with Image.open(path) as im:
            assert im.format == "JPEG" and im.size == (2000, 2000)
