"""Image + label transforms. Each works on (image, labels) or on the image alone; order is set by the dataset."""
from __future__ import annotations

import math

import cv2
import numpy as np

from utils.boxes import xywhn2xyxy


def letterbox(img: np.ndarray, new_shape=640, color=(114, 114, 114), auto: bool = True,
              scale_fill: bool = False, scaleup: bool = True, stride: int = 32):
    """Resize keeping aspect ratio and pad to ``new_shape`` (int or (h, w)).

    ``auto`` pads only to the next multiple of ``stride`` (minimum rectangle, used by detect);
    ``scaleup=False`` never enlarges (used by validation). Returns ``(image, (ratio_w, ratio_h), (pad_w, pad_h))``
    where pads are per side (half the total), as needed by ``utils.boxes.scale_boxes``.
    """
    shape = img.shape[:2]
    new_unpad, ratios, (dw, dh), (top, bottom, left, right) = letterbox_geometry(shape, new_shape, auto, scale_fill,
                                                                                scaleup, stride)
    if shape[::-1] != new_unpad:
        img = cv2.resize(img, new_unpad, interpolation=cv2.INTER_LINEAR)
    if top or bottom or left or right:
        img = cv2.copyMakeBorder(img, top, bottom, left, right, cv2.BORDER_CONSTANT, value=color)
    return img, ratios, (dw, dh)


def letterbox_geometry(shape, new_shape=640, auto: bool = True, scale_fill: bool = False, scaleup: bool = True,
                       stride: int = 32):
    """``letterbox``'s arithmetic for an image of ``shape`` (h, w), without its pixels: ``(new_unpad (w, h) of the
    resize, (ratio_w, ratio_h), (pad_w, pad_h) per side, (top, bottom, left, right) border in pixels)``."""
    if isinstance(new_shape, int):
        new_shape = (new_shape, new_shape)
    ratio = min(new_shape[0] / shape[0], new_shape[1] / shape[1])
    if not scaleup:
        ratio = min(ratio, 1.0)
    ratios = (ratio, ratio)
    new_unpad = (int(round(shape[1] * ratio)), int(round(shape[0] * ratio)))  # (w, h)
    dw, dh = new_shape[1] - new_unpad[0], new_shape[0] - new_unpad[1]
    if auto:
        dw, dh = np.mod(dw, stride), np.mod(dh, stride)
    elif scale_fill:
        dw, dh = 0.0, 0.0
        new_unpad = (new_shape[1], new_shape[0])
        ratios = (new_shape[1] / shape[1], new_shape[0] / shape[0])
    dw, dh = dw / 2, dh / 2
    border = int(round(dh - 0.1)), int(round(dh + 0.1)), int(round(dw - 0.1)), int(round(dw + 0.1))
    return new_unpad, ratios, (dw, dh), border


# ---------------------------------------------------------------------------------------------
# Training augmentations. Boxes inside the pipeline are (n, 5) float arrays [class, x1, y1, x2, y2]
# in pixels of the current image; segments are lists of (k, 2) pixel arrays. Every random draw
# comes from the ``rng`` (numpy Generator) passed in, so results follow from the caller's seed.
# ---------------------------------------------------------------------------------------------

FILL = 114  # grey used for padding and borders, as YOLOv5


def box_candidates(before: np.ndarray, after: np.ndarray, wh_thr: float = 2.0, ar_thr: float = 100.0,
                   area_thr: float = 0.1, eps: float = 1e-16) -> np.ndarray:
    """Boolean mask of boxes worth keeping after a warp; both arrays are (n, 4) xyxy pixels.

    ``before`` is the box before the warp scaled by the warp's zoom, ``after`` the warped and clipped
    box. A box is kept when it is more than ``wh_thr`` px wide and high, keeps more than ``area_thr`` of
    its area and its aspect ratio (long / short side) is below ``ar_thr`` (YOLOv5 v7's rule).
    """
    w1, h1 = before[:, 2] - before[:, 0], before[:, 3] - before[:, 1]
    w2, h2 = after[:, 2] - after[:, 0], after[:, 3] - after[:, 1]
    aspect = np.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + eps) > area_thr) & (aspect < ar_thr)


def perspective_matrix(shape, out_size, degrees=0.0, translate=0.0, scale=0.0, shear=0.0, perspective=0.0,
                       rng=None):
    """Random 3x3 matrix (centre -> perspective -> rotate/scale -> shear -> translate) and its zoom.

    ``shape`` is the input (h, w), ``out_size`` the output (w, h). Returns ``(M, zoom)``.
    """
    rng = rng if rng is not None else np.random.default_rng()
    height, width = shape[:2]
    centre = np.eye(3)
    centre[0, 2], centre[1, 2] = -width / 2, -height / 2
    persp = np.eye(3)
    persp[2, 0], persp[2, 1] = rng.uniform(-perspective, perspective, 2)
    rotate = np.eye(3)
    angle = rng.uniform(-degrees, degrees)
    zoom = rng.uniform(1 - scale, 1 + scale)
    rotate[:2] = cv2.getRotationMatrix2D(angle=angle, center=(0, 0), scale=zoom)
    shear_m = np.eye(3)
    shear_m[0, 1], shear_m[1, 0] = np.tan(rng.uniform(-shear, shear, 2) * math.pi / 180)
    move = np.eye(3)
    move[0, 2] = rng.uniform(0.5 - translate, 0.5 + translate) * out_size[0]
    move[1, 2] = rng.uniform(0.5 - translate, 0.5 + translate) * out_size[1]
    return move @ shear_m @ rotate @ persp @ centre, zoom


def warp_image(img: np.ndarray, matrix: np.ndarray, out_size, projective: bool) -> np.ndarray:
    """One cv2 warp of ``img`` by ``matrix`` to ``out_size`` (w, h), grey border, same channel count.

    OpenCV's bilinear warp is ~3x faster on 4-channel images than on 3-channel ones, so a 3-channel
    input is widened to BGRA for the warp and narrowed afterwards (both conversions are cheap).
    """
    channels = img.shape[2] if img.ndim == 3 else 1
    src = cv2.cvtColor(img, cv2.COLOR_BGR2BGRA) if channels == 3 else img
    border = (FILL,) * 4
    if projective:
        out = cv2.warpPerspective(src, matrix, dsize=out_size, borderValue=border)
    else:
        out = cv2.warpAffine(src, matrix[:2], dsize=out_size, borderValue=border)
    return cv2.cvtColor(out, cv2.COLOR_BGRA2BGR) if channels == 3 else out


def transform_boxes(boxes: np.ndarray, matrix: np.ndarray, projective: bool) -> np.ndarray:
    """Warp (n, 4) xyxy boxes by their 4 corners; returns the enclosing xyxy boxes."""
    n = len(boxes)
    corners = np.ones((n * 4, 3))
    corners[:, :2] = boxes[:, [0, 1, 2, 3, 0, 3, 2, 1]].reshape(n * 4, 2)
    corners = corners @ matrix.T
    corners = corners[:, :2] / corners[:, 2:3] if projective else corners[:, :2]
    xs, ys = corners[:, 0].reshape(n, 4), corners[:, 1].reshape(n, 4)
    return np.stack((xs.min(1), ys.min(1), xs.max(1), ys.max(1)), 1)


def resample_segment(segment: np.ndarray, num: int = 1000) -> np.ndarray:
    """Closed polygon (k, 2) -> ``num`` points evenly spaced along its outline."""
    closed = np.concatenate((segment, segment[:1]), 0)
    steps = np.linspace(0, len(closed) - 1, num)
    positions = np.arange(len(closed))
    return np.stack([np.interp(steps, positions, closed[:, j]) for j in range(2)], 1)


def segments_to_boxes(segments, matrix: np.ndarray, projective: bool, width: int, height: int):
    """Warp segments; box = extent of the warped outline points that fall inside the image."""
    boxes, warped = np.zeros((len(segments), 4)), []
    for j, segment in enumerate(segments):
        points = np.ones((1000, 3))
        points[:, :2] = resample_segment(segment)
        points = points @ matrix.T
        points = points[:, :2] / points[:, 2:3] if projective else points[:, :2]
        warped.append(points)
        inside = (points[:, 0] >= 0) & (points[:, 1] >= 0) & (points[:, 0] <= width) & (points[:, 1] <= height)
        if inside.any():
            x, y = points[inside, 0], points[inside, 1]
            boxes[j] = x.min(), y.min(), x.max(), y.max()
    return boxes, warped


def random_perspective(img: np.ndarray, labels: np.ndarray, segments=(), degrees=10.0, translate=0.1, scale=0.1,
                       shear=10.0, perspective=0.0, border=(0, 0), rng=None):
    """Random rotation/scale/shear/translation/perspective as one matrix and one cv2 warp.

    ``labels`` (n, 5) [class, x1, y1, x2, y2] pixels; ``border`` (rows, cols) grows (+) or shrinks (-)
    the output on each side (mosaic uses -imgsz/2 to come back from the 2x canvas). Returns
    (img, labels, segments) as ``apply_warp``.
    """
    out_size = (img.shape[1] + border[1] * 2, img.shape[0] + border[0] * 2)  # (w, h)
    matrix, zoom = perspective_matrix(img.shape, out_size, degrees, translate, scale, shear, perspective, rng)
    return apply_warp(img, labels, segments, matrix, zoom, out_size, perspective > 0)


def apply_warp(img: np.ndarray, labels: np.ndarray, segments, matrix: np.ndarray, zoom: float, out_size,
               projective: bool):
    """Warp ``img`` and its labels by ``matrix`` (from ``perspective_matrix``) to ``out_size`` (w, h).

    Warped boxes are clipped to the image, then those failing ``box_candidates`` are dropped (with
    segments, the 10% area rule becomes 1% since the tight outline box is more reliable).
    """
    if warp_needed(img.shape, matrix, out_size):
        img = warp_image(img, matrix, out_size, projective)
    labels, segments = warp_labels(labels, segments, matrix, zoom, out_size, projective)
    return img, labels, segments


def warp_needed(shape, matrix: np.ndarray, out_size) -> bool:
    """Whether ``apply_warp`` warps an image of ``shape`` (h, w, ...): not for the identity to the same size."""
    return tuple(out_size) != (shape[1], shape[0]) or not np.allclose(matrix, np.eye(3))


def warp_labels(labels: np.ndarray, segments, matrix: np.ndarray, zoom: float, out_size, projective: bool):
    """``apply_warp``'s labels and segments, without the image: (labels, segments)."""
    if not len(labels):
        return labels, []
    if len(segments):
        boxes, segments = segments_to_boxes(segments, matrix, projective, *out_size)
    else:
        boxes = transform_boxes(labels[:, 1:5], matrix, projective)
    boxes[:, [0, 2]] = boxes[:, [0, 2]].clip(0, out_size[0])
    boxes[:, [1, 3]] = boxes[:, [1, 3]].clip(0, out_size[1])
    keep = box_candidates(labels[:, 1:5] * zoom, boxes, area_thr=0.01 if len(segments) else 0.10)
    labels = labels[keep].copy()
    labels[:, 1:5] = boxes[keep]
    segments = [s for s, k in zip(segments, keep) if k]
    return labels, segments


def source_window(matrix: np.ndarray, out_size, shape, margin: int = 2):
    """The rectangle (x1, y1, x2, y2) of an image of ``shape`` (h, w) that an affine warp to ``out_size``
    (w, h) reads: the output rectangle mapped back, widened by ``margin`` px for bilinear neighbours,
    clipped to the image. Pixels outside it never reach the output.
    """
    w, h = out_size
    corners = np.array([[0, 0, 1], [w, 0, 1], [0, h, 1], [w, h, 1]], np.float64)
    try:
        back = corners @ np.linalg.inv(matrix).T
    except np.linalg.LinAlgError:  # a zero zoom (hyp scale 1.0 can draw it): the warp reads one point
        return 0, 0, shape[1], shape[0]
    xs, ys = back[:, 0] / back[:, 2], back[:, 1] / back[:, 2]
    x1, y1 = max(math.floor(xs.min()) - margin, 0), max(math.floor(ys.min()) - margin, 0)
    x2, y2 = min(math.ceil(xs.max()) + margin, shape[1]), min(math.ceil(ys.max()) + margin, shape[0])
    return x1, y1, max(x2, x1), max(y2, y1)


def augment_hsv(img: np.ndarray, hgain: float = 0.5, sgain: float = 0.5, vgain: float = 0.5, rng=None,
                rgb: bool = False) -> np.ndarray:
    """Random hue/saturation/value gains on a uint8 BGR (or BGRA) image via one 3-channel LUT on its HSV form.

    Hue is multiplied (mod 180, OpenCV's hue range), saturation and value multiplied and clipped.
    The result is BGR, or RGB with ``rgb`` (the conversion back from HSV writes either order at the
    same cost, which saves the loader a separate BGR -> RGB pass). A 3-channel input is overwritten
    and returned; a 4-channel BGRA one (mosaic canvas) gives a new 3-channel image.
    """
    back = cv2.COLOR_HSV2RGB if rgb else cv2.COLOR_HSV2BGR
    gains = hsv_gains(hgain, sgain, vgain, rng)
    if gains is None:
        if rgb:
            return cv2.cvtColor(img, cv2.COLOR_BGRA2RGB if img.shape[2] == 4 else cv2.COLOR_BGR2RGB)
        return img if img.shape[2] == 3 else cv2.cvtColor(img, cv2.COLOR_BGRA2BGR)
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)  # takes BGRA too (alpha ignored)
    cv2.LUT(hsv, hsv_lut(gains), dst=hsv)  # one 3-channel table: hue, saturation, value
    if img.shape[2] == 3:
        cv2.cvtColor(hsv, back, dst=img)
        return img
    return cv2.cvtColor(hsv, back)


def hsv_gains(hgain: float, sgain: float, vgain: float, rng=None):
    """``augment_hsv``'s random (hue, saturation, value) gains, or None (and no draw) when every gain is 0."""
    if not (hgain or sgain or vgain):
        return None
    rng = rng if rng is not None else np.random.default_rng()
    return rng.uniform(-1, 1, 3) * (hgain, sgain, vgain) + 1


def hsv_lut(gains) -> np.ndarray:
    """(256, 1, 3) uint8 table of ``gains`` on OpenCV's uint8 HSV: hue times gain mod 180, the others clipped."""
    x = np.arange(256, dtype=np.float64)
    lut = np.empty((256, 1, 3), np.uint8)
    lut[:, 0, 0] = ((x * gains[0]) % 180).astype(np.uint8)
    lut[:, 0, 1] = np.clip(x * gains[1], 0, 255).astype(np.uint8)
    lut[:, 0, 2] = np.clip(x * gains[2], 0, 255).astype(np.uint8)
    return lut


def flip_lr(img: np.ndarray, labels: np.ndarray):
    """Left-right flip of the image and its [class, x1, y1, x2, y2] pixel labels."""
    width = img.shape[1]
    labels = labels.copy()
    labels[:, [1, 3]] = width - labels[:, [3, 1]]
    return cv2.flip(img, 1), labels


def flip_ud(img: np.ndarray, labels: np.ndarray):
    """Up-down flip of the image and its [class, x1, y1, x2, y2] pixel labels."""
    height = img.shape[0]
    labels = labels.copy()
    labels[:, [2, 4]] = height - labels[:, [4, 2]]
    return cv2.flip(img, 0), labels


def random_flips(img: np.ndarray, labels: np.ndarray, flipud: float, fliplr: float, rng):
    """Flip up-down with probability ``flipud`` then left-right with probability ``fliplr``."""
    up_down, left_right = flip_draws(flipud, fliplr, rng)
    if up_down:
        img, labels = flip_ud(img, labels)
    if left_right:
        img, labels = flip_lr(img, labels)
    return img, labels


def flip_draws(flipud: float, fliplr: float, rng) -> tuple[bool, bool]:
    """``random_flips``'s draws: (flip up-down, flip left-right); a probability of 0 draws nothing."""
    up_down = bool(flipud and rng.random() < flipud)
    left_right = bool(fliplr and rng.random() < fliplr)
    return up_down, left_right


def flip_labels(labels: np.ndarray, width: int, height: int, up_down: bool, left_right: bool) -> np.ndarray:
    """``random_flips``'s labels for flips of an image of ``width`` x ``height`` already drawn."""
    if up_down:
        labels = labels.copy()
        labels[:, [2, 4]] = height - labels[:, [4, 2]]
    if left_right:
        labels = labels.copy()
        labels[:, [1, 3]] = width - labels[:, [3, 1]]
    return labels


def mixup(img: np.ndarray, labels: np.ndarray, img2: np.ndarray, labels2: np.ndarray, rng):
    """Blend two same-size images with a Beta(32, 32) ratio and keep both label sets."""
    ratio = mixup_ratio(rng)
    blended = cv2.addWeighted(img, ratio, img2, 1.0 - ratio, 0.0)
    return blended, np.concatenate((labels, labels2), 0)


def mixup_ratio(rng) -> float:
    """``mixup``'s draw: the first image's weight (the second's is 1 - it)."""
    return rng.beta(32.0, 32.0)


def box_ioa(box: np.ndarray, boxes: np.ndarray, eps: float = 1e-7) -> np.ndarray:
    """Intersection of ``box`` (4,) with each of ``boxes`` (n, 4) over the area of each of ``boxes``."""
    inter_w = (np.minimum(box[2], boxes[:, 2]) - np.maximum(box[0], boxes[:, 0])).clip(0)
    inter_h = (np.minimum(box[3], boxes[:, 3]) - np.maximum(box[1], boxes[:, 1])).clip(0)
    return inter_w * inter_h / ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) + eps)


def copy_paste(img: np.ndarray, labels: np.ndarray, segments, probability: float = 0.5, rng=None):
    """Paste left-right mirrored copies of a random ``probability`` share of the segmented objects.

    A copy is pasted only where it overlaps existing boxes by less than 30% (intersection over their
    area). Needs one pixel-space segment per label. Returns (img, labels, segments).
    """
    if not (probability and len(segments)):
        return img, labels, segments
    labels, segments, mirrored_mask = copy_paste_labels(labels, segments, img.shape[:2], probability, rng)
    if mirrored_mask is not None:
        img = img.copy()
        img[mirrored_mask] = cv2.flip(img, 1)[mirrored_mask]
    return img, labels, segments


def copy_paste_labels(labels: np.ndarray, segments, shape, probability: float, rng=None):
    """``copy_paste``'s draws, labels and segments for an image of ``shape`` (h, w), without the image: (labels,
    segments, where the mirrored copies go: an (h, w) bool mask, or None when nothing is pasted)."""
    count = len(segments)
    if not (probability and count):
        return labels, segments, None
    rng = rng if rng is not None else np.random.default_rng()
    width = shape[1]
    mask = np.zeros(shape[:2], np.uint8)
    labels, segments = labels.copy(), list(segments)
    for j in rng.permutation(count)[: round(probability * count)]:
        cls, x1, y1, x2, y2 = labels[j]
        mirrored = np.array([cls, width - x2, y1, width - x1, y2])
        if (box_ioa(mirrored[1:5], labels[:, 1:5]) < 0.30).all():
            labels = np.concatenate((labels, mirrored[None]), 0)
            segments.append(np.stack((width - segments[j][:, 0], segments[j][:, 1]), 1))
            cv2.drawContours(mask, [segments[j].astype(np.int32)], -1, 255, cv2.FILLED)
    return labels, segments, (cv2.flip(mask, 1).astype(bool) if mask.any() else None)


def multi_scale_size(imgsz: int, stride: int, rng) -> int:
    """Random training size in [0.5, 1.5] x imgsz, a multiple of ``stride`` (at least one stride)."""
    low, high = int(imgsz * 0.5), int(imgsz * 1.5) + stride
    return max(int(rng.integers(low, high)) // stride * stride, stride)


def multi_scale_bounds(imgsz: int, stride: int) -> tuple[int, int]:
    """(smallest, largest) size ``multi_scale_size`` can draw."""
    low, high = int(imgsz * 0.5), int(imgsz * 1.5) + stride
    return max(low // stride * stride, stride), max((high - 1) // stride * stride, stride)


def mosaic_placement(position: int, centre, size, s: int):
    """Where an image of ``size`` (h, w) goes on a 2s x 2s canvas around ``centre`` (xc, yc).

    ``position`` 0..3 = top-left, top-right, bottom-left, bottom-right of the centre, as YOLOv5's
    mosaic. Returns ((x1a, y1a, x2a, y2a) canvas rectangle, (x1b, y1b, x2b, y2b) image rectangle).
    """
    (xc, yc), (h, w) = centre, size
    if position == 0:
        a = (max(xc - w, 0), max(yc - h, 0), xc, yc)
        b = (w - (a[2] - a[0]), h - (a[3] - a[1]), w, h)
    elif position == 1:
        a = (xc, max(yc - h, 0), min(xc + w, s * 2), yc)
        b = (0, h - (a[3] - a[1]), min(w, a[2] - a[0]), h)
    elif position == 2:
        a = (max(xc - w, 0), yc, xc, min(s * 2, yc + h))
        b = (w - (a[2] - a[0]), 0, w, min(a[3] - a[1], h))
    else:
        a = (xc, yc, min(xc + w, s * 2), min(s * 2, yc + h))
        b = (0, 0, min(w, a[2] - a[0]), min(a[3] - a[1], h))
    return a, b


def mosaic_placements(centre, sizes, s: int):
    """``mosaic_placement`` for 4 image sizes in order."""
    return [mosaic_placement(i, centre, size, s) for i, size in enumerate(sizes)]


def intersect(r, q):
    """Intersection of two (x1, y1, x2, y2) rectangles, or None when empty."""
    x1, y1, x2, y2 = max(r[0], q[0]), max(r[1], q[1]), min(r[2], q[2]), min(r[3], q[3])
    return (x1, y1, x2, y2) if x2 > x1 and y2 > y1 else None


def fill_around(canvas: np.ndarray, outer, inner) -> None:
    """Fill the part of rectangle ``outer`` not covered by ``inner`` (x1, y1, x2, y2) with grey."""
    ox1, oy1, ox2, oy2 = outer
    x1, y1, x2, y2 = inner
    canvas[oy1:y1, ox1:ox2] = FILL
    canvas[y2:oy2, ox1:ox2] = FILL
    canvas[y1:y2, ox1:x1] = FILL
    canvas[y1:y2, x2:ox2] = FILL


def mosaic4(load, sizes, labels_list, segments_list, s: int, centre, out: np.ndarray | None = None, window=None):
    """Tile 4 BGR images on a 2s x 2s grey BGRA canvas (4 channels: faster warp afterwards).

    ``load(position)`` returns image ``position`` (0..3) of ``sizes[position]`` (h, w); it is called
    just before the image is placed (decoding one at a time keeps memory hot). With ``window``
    (x1, y1, x2, y2), only that part of the canvas is built, as ``source_window`` gives it for the warp
    that follows: images that fall wholly outside it are never loaded and the rest of the canvas is
    left unwritten (the warp never reads it).

    ``labels_list`` items are (n, 5) [class, cx, cy, w, h] normalised to their image and
    ``segments_list`` items lists of normalised (k, 2) polygons. Returns (canvas, labels (m, 5)
    [class, x1, y1, x2, y2] canvas pixels clipped to the canvas, segments in canvas pixels); labels
    of unloaded images are included (the warp drops them, being outside its output).
    ``out``: a (2s, 2s, 4) uint8 buffer to reuse (saves page faults on a fresh 2s x 2s allocation).
    """
    shape = (s * 2, s * 2, 4)
    canvas = out if out is not None and out.shape == shape and out.dtype == np.uint8 else np.empty(shape, np.uint8)
    window = window or (0, 0, 2 * s, 2 * s)
    xc, yc = centre
    quadrants = [(0, 0, xc, yc), (xc, 0, 2 * s, yc), (0, yc, xc, 2 * s), (xc, yc, 2 * s, 2 * s)]
    for position in range(len(labels_list)):
        h, w = sizes[position]
        a, b = mosaic_placement(position, centre, (h, w), s)
        padw, padh = a[0] - b[0], a[1] - b[1]  # image pixel (x, y) lands at (x + padw, y + padh)
        part, shown = intersect(quadrants[position], window), intersect(a, window)
        if shown:
            img = load(position)
            if img.shape[:2] != (h, w):
                raise ValueError(f"mosaic image {position} is {img.shape[1]}x{img.shape[0]}, expected {w}x{h}")
            fill_around(canvas, part, shown)
            x1, y1, x2, y2 = shown
            cv2.cvtColor(img[y1 - padh:y2 - padh, x1 - padw:x2 - padw], cv2.COLOR_BGR2BGRA, dst=canvas[y1:y2, x1:x2])
        elif part:
            canvas[part[1]:part[3], part[0]:part[2]] = FILL
    labels, segments = mosaic_labels(sizes, labels_list, segments_list, s, centre)
    return canvas, labels, segments


def mosaic_labels(sizes, labels_list, segments_list, s: int, centre):
    """``mosaic4``'s labels and segments, without the images: ((m, 5) [class, x1, y1, x2, y2] canvas pixels
    clipped to the canvas, segments in canvas pixels)."""
    all_labels, all_segments = [], []
    for position, (labels, segments) in enumerate(zip(labels_list, segments_list)):
        h, w = sizes[position]
        a, b = mosaic_placement(position, centre, (h, w), s)
        padw, padh = a[0] - b[0], a[1] - b[1]
        rows = np.asarray(labels, np.float64).reshape(-1, 5)
        all_labels.append(np.concatenate([rows[:, :1], xywhn2xyxy(rows[:, 1:5], w, h, padw, padh)], 1))
        all_segments += [seg * (w, h) + (padw, padh) for seg in segments]
    labels = np.concatenate(all_labels, 0)
    np.clip(labels[:, 1:], 0, 2 * s, out=labels[:, 1:])
    return labels, [np.clip(seg, 0, 2 * s) for seg in all_segments]
