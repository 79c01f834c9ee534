"""Training items as plans: every random draw and all geometry on the CPU, the pixel work left to the training device.

``--augment-device`` (docs/device-augmentation.md). A ``PlanDataset`` draws exactly what ``YoloDataset`` draws, in the
same order, from the same per-item generator (seed, epoch, index): mosaic partners and placement, the warp matrix,
mixup's second mosaic and ratio, the HSV gains, the flips. It computes the final labels exactly as ``YoloDataset`` does (the same functions of
``utils.data.transforms``), so the boxes are identical on both paths. Instead of an image it returns an
``ImagePlan``: the source pixels (decoded or cached uint8 BGR, only the part the warp reads), where each goes on the
canvas, the matrix, the HSV table and the flips. ``collate_plans`` packs a batch's plans into one ``PlanBatch`` (one
flat uint8 buffer for all pixels, small tables for the rest), and ``utils.data.device_augment.render_plans`` makes
the images on any torch device.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import cv2
import numpy as np
import torch
from torch.utils.data import get_worker_info

from utils.data.batch_slots import fresh_shared_bytes, handed_over
from utils.data.dataset import JPEG_SUFFIXES, YoloDataset, item_draw, normalised_targets, pixel_boxes
from utils.data.headers import jpeg_frame
from utils.data.images import file_orientation
from utils.data.transforms import (copy_paste_labels, flip_draws, flip_labels, hsv_gains, hsv_lut, intersect,
                                   letterbox_geometry, mixup_ratio, mosaic_labels, mosaic_placement, perspective_matrix, warp_labels,
                                   warp_needed)

@dataclass
class ImagePlan:
    """How to make one training image from uint8 BGR sources.

    The sources are ``tiles``: (pixels (h, w, 3) uint8 BGR, (x, y) of their top-left corner on the canvas of
    ``canvas_size`` (w, h)). The canvas is grey (114) wherever no tile lies. ``matrix`` (3x3, canvas -> image,
    ``projective`` or affine) warps the canvas to ``out_size`` (w, h) with bilinear sampling and a grey border, as
    cv2.warpAffine / warpPerspective; None: the canvas is the image. Then ``hsv``, a (256, 3) uint8 table on OpenCV's
    HSV (``transforms.hsv_lut``) or None, and the flips (up-down, left-right). The image comes out RGB.
    ``paste`` (copy-paste): (mask (h, w) bool, (x, y) of its top-left on the canvas): before the warp, the canvas
    pixels under the mask take the pixel of the left-right mirrored canvas. ``mixup``: (a second plan of the same
    ``out_size``, ratio): before HSV, the warped image is blended with the second one's as
    cv2.addWeighted(this, ratio, that, 1 - ratio, 0) blends them."""
    out_size: tuple[int, int]
    canvas_size: tuple[int, int]
    tiles: list
    matrix: np.ndarray | None
    projective: bool = False
    hsv: np.ndarray | None = None
    flips: tuple[bool, bool] = (False, False)
    paste: tuple | None = None
    mixup: tuple | None = None


SLOT_HEADROOM = 1.25  # a reused batch buffer grows to 1.25x the batch that outgrew it (batches of plans vary in size)
DECODE_FRAMES = (0xC0, 0xC1)  # baseline and extended sequential JPEG frames: what every nvJPEG backend decodes


@dataclass
class EncodedImage:
    """A training image left for the training device to decode (``--decode-device``): the file's JPEG bytes and its
    size (w, h), which is its training size (images that ``load_image`` resizes are decoded by the worker).
    ``index``: its dataset index, so that a batch decodes each image once."""
    index: int
    path: str
    data: np.ndarray
    size: tuple[int, int]


@dataclass
class SourceCrop:
    """A tile read from an ``EncodedImage`` once decoded: the (x, y, w, h) of its part of the image."""
    image: EncodedImage
    box: tuple[int, int, int, int]


class PlanDataset(YoloDataset):
    """``YoloDataset`` for training whose items are ``(ImagePlan, targets, path, shapes)``: the targets, path and
    shapes equal ``YoloDataset``'s for the same (seed, epoch, index), the plan renders to its image (within
    interpolation tolerance: docs/device-augmentation.md)."""

    def __init__(self, *args, decode_device: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.augment:
            raise ValueError(f"{self.prefix}plans are for training items (augment=True)")
        self.decode_device = decode_device  # mosaic tiles of uncached JPEGs as SourceCrops (``encoded``)

    def item(self, item, partners: np.ndarray | None = None):
        index, rng = item_draw(self.seed, item, self.epoch)  # the same draws, in YoloDataset.item's order
        hyp = self.hyp
        if self.mosaic and rng.random() < hyp.mosaic:
            plan, labels = self.mosaic_plan(index, rng, partners)
            shapes = None
            if hyp.mixup and rng.random() < hyp.mixup:
                other, rest = self.mixup_draw(rng, partners)
                second, second_labels = self.mosaic_plan(other, rng, rest)
                plan.mixup = (second, mixup_ratio(rng))
                labels = np.concatenate((labels, second_labels), 0)
        else:
            plan, labels, shapes = self.letterbox_plan(index, rng)
        gains = hsv_gains(hyp.hsv_h, hyp.hsv_s, hyp.hsv_v, rng)
        plan.hsv = None if gains is None else hsv_lut(gains)[:, 0]
        plan.flips = flip_draws(hyp.flipud, hyp.fliplr, rng)
        width, height = plan.out_size
        labels = flip_labels(labels, width, height, *plan.flips)
        return plan, normalised_targets(labels, width, height), self.flat.file(index), shapes

    def mosaic_plan(self, index: int, rng, partners: np.ndarray | None = None):
        """``load_mosaic`` as a plan: the tiles are the parts of the 4 images inside the window the warp reads (images
        wholly outside it are not loaded; the whole canvas with copy-paste or a projective warp), the labels and the
        copy-paste draws are ``load_mosaic``'s."""
        s = self.imgsz
        picks, centre, matrix, zoom, window = self.mosaic_draws(index, rng, partners)
        sizes = [self.resized_shape(k) for k in picks]
        window = window or (0, 0, 2 * s, 2 * s)
        tiles = []
        for position, k in enumerate(picks):
            a, b = mosaic_placement(position, centre, sizes[position], s)
            shown = intersect(a, window)
            if not shown:
                continue
            padw, padh = a[0] - b[0], a[1] - b[1]
            x1, y1, x2, y2 = shown
            encoded = self.encoded(k) if self.decode_device else None
            if encoded is not None:
                tiles.append((SourceCrop(encoded, (x1 - padw, y1 - padh, x2 - x1, y2 - y1)), (x1, y1)))
                continue
            img = self.load_image(k)[0]
            if img.shape[:2] != sizes[position]:
                raise ValueError(f"mosaic image {k} is {img.shape[1]}x{img.shape[0]}, expected "
                                 f"{sizes[position][1]}x{sizes[position][0]}")
            tiles.append((img[y1 - padh:y2 - padh, x1 - padw:x2 - padw], (x1, y1)))
        labels, segments = mosaic_labels(sizes, [self.labels[k] for k in picks], [self.segments[k] for k in picks], s,
                                         centre)
        if len(segments) != len(labels):
            segments = []
        labels, segments, pasted = copy_paste_labels(labels, segments, (2 * s, 2 * s), self.hyp.copy_paste, rng)
        projective = self.hyp.perspective > 0
        labels, _ = warp_labels(labels, segments, matrix, zoom, (s, s), projective)
        return ImagePlan((s, s), (2 * s, 2 * s), tiles, matrix, projective, paste=mask_part(pasted)), labels

    def encoded(self, k: int) -> EncodedImage | None:
        """Image k as JPEG bytes for the training device to decode, or None where this worker decodes it as today: a
        cached image, one that ``load_image`` resizes (cv2's fixed-point resize is not reproduced on the device, and an
        image at least twice the training size decodes faster here at a reduced size), a file other than a baseline
        8-bit 3-channel JPEG, one with an EXIF rotation, one whose header disagrees with the scan, or one that cannot be
        read (the worker's decode then says why)."""
        if self.store is not None or (self.decoded is not None and k in self.decoded):
            return None
        path = self.flat.file(k)
        width0, height0 = (int(v) for v in self.shapes[k])
        if not path.lower().endswith(JPEG_SUFFIXES) or self.resized_shape(k) != (height0, width0):
            return None
        try:
            data = np.fromfile(path, dtype=np.uint8)
        except OSError:
            return None
        frame = jpeg_frame(data)
        if frame is None or frame[0] not in DECODE_FRAMES or frame[1:] != (8, 3, width0, height0):
            return None
        if self.orientations[k] < 0:
            self.orientations[k] = file_orientation(path, data)
        if self.orientations[k] != 1:
            return None
        return EncodedImage(k, path, data, (width0, height0))

    def letterbox_plan(self, index: int, rng):
        """``load_letterboxed`` as a plan: the image (resized here when the letterbox resizes it, as cv2 does today)
        placed inside its grey border, then the random perspective."""
        hyp = self.hyp
        img, (h0, w0), (h, w) = self.load_image(index)
        shape = tuple(self.batch_shapes[self.batch[index]]) if self.rect else self.imgsz
        new_unpad, (ratio_w, ratio_h), pad, (top, bottom, left, right) = letterbox_geometry(
            img.shape[:2], shape, auto=False, scaleup=True)
        if img.shape[1::-1] != new_unpad:
            img = cv2.resize(img, new_unpad, interpolation=cv2.INTER_LINEAR)
        canvas_w, canvas_h = new_unpad[0] + left + right, new_unpad[1] + top + bottom
        shapes = (h0, w0), ((h * ratio_h / h0, w * ratio_w / w0), pad)
        labels = pixel_boxes(self.labels[index], ratio_w * w, ratio_h * h, pad[0], pad[1])
        out_size, projective = (canvas_w, canvas_h), hyp.perspective > 0
        matrix, zoom = perspective_matrix((canvas_h, canvas_w), out_size, hyp.degrees, hyp.translate, hyp.scale,
                                          hyp.shear, hyp.perspective, rng)
        labels, _ = warp_labels(labels, (), matrix, zoom, out_size, projective)
        warped = warp_needed((canvas_h, canvas_w), matrix, out_size)
        plan = ImagePlan(out_size, (canvas_w, canvas_h), [(img, (left, top))], matrix if warped else None, projective)
        return plan, labels, shapes


def mask_part(mask: np.ndarray | None):
    """(the part of a bool ``mask`` that holds its True values, (x, y) of that part), or None for no mask."""
    if mask is None:
        return None
    rows, columns = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    y1, y2, x1, x2 = rows[0], rows[-1] + 1, columns[0], columns[-1] + 1
    return np.ascontiguousarray(mask[y1:y2, x1:x2]), (int(x1), int(y1))


@dataclass
class PlanBatch:
    """A batch of plans in a few tensors (what loader workers send to the training process).

    Layers are what gets warped: layer i < B is image i's own plan, layers B.. are the second mosaics of the images
    with mixup. ``pixels``: every tile's bytes, one flat uint8 buffer. ``tiles`` (T, 7) int64: layer, x, y (its place
    on that layer's canvas), width, height, byte offset of its first pixel and its rows' stride in pixels, in the
    device's pixel buffer: ``pixels`` (stride = width), then the decoded ``sources`` (``--decode-device``; the stride
    is its image's width). ``sources``: the JPEG bytes of the images the device decodes, one flat uint8 buffer;
    ``source_table`` (S, 4) int64: byte offset and count in it, the image's (w, h), in the order the decoded images
    follow ``pixels``; ``source_paths``: their files. ``canvases`` (L, 2) int64: each layer's canvas (w, h).
    ``sampling`` (L, 3, 3) float64: image pixel (x, y, 1) -> canvas point (the inverse warp with the image's flips
    folded in; projective where ``projective`` (L,)). ``blends`` (M, 2) int64 (image, layer) and
    ``ratios`` (M,) float64: image = ratio x image + (1 - ratio) x layer, before HSV. ``pastes`` (P, 6) int64: layer,
    x, y, width, height, offset in ``paste_masks`` (flat bool): copy-paste's masks. ``out_sizes`` (B, 2) int64: each
    image's (w, h); the batch is (height, width) = ``size``, smaller images padded grey bottom/right as ``collate``
    pads them. ``hsv`` (B, 256, 3) uint8 and ``has_hsv`` (B,) bool: the HSV tables. ``flips`` (B, 2) bool: each
    image's (up-down, left-right) flips, which follow HSV on the OpenCV path (the rendering's HSV sees the flipped
    image, so it mirrors where OpenCV's HSV -> RGB uses its scalar code)."""
    pixels: torch.Tensor
    tiles: torch.Tensor
    canvases: torch.Tensor
    sampling: torch.Tensor
    projective: torch.Tensor
    blends: torch.Tensor
    ratios: torch.Tensor
    pastes: torch.Tensor
    paste_masks: torch.Tensor
    out_sizes: torch.Tensor
    hsv: torch.Tensor
    has_hsv: torch.Tensor
    flips: torch.Tensor
    size: tuple[int, int] = field(default=(0, 0))
    sources: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    source_table: torch.Tensor = field(default_factory=lambda: torch.empty(0, 4, dtype=torch.int64))
    source_paths: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.out_sizes)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The (B, 3, H, W) of the images it renders to."""
        return len(self), 3, *self.size

    def pin_memory(self) -> "PlanBatch":
        """The DataLoader's pin_memory (CUDA): the pixels pinned, for an asynchronous copy to the device. The JPEG bytes
        stay where they are (a worker's buffer, returned once the batch is gone): nvJPEG reads them itself, and
        pinned memory freed while a copy that torch did not make still reads it could be handed out again."""
        return dataclasses.replace(self, pixels=self.pixels.pin_memory())


def encoded_sources(crops: list, tiles: list, first_pixel: int):
    """The batch's ``EncodedImage`` sources, each once, ordered by size (the device reorders the channels of equal
    sizes together): (the sources, their table (S, 4) int64: byte offset and count in the flat bytes, w, h; the flat
    bytes' size). Each crop's tile row gets its byte offset and row stride in the device's pixel buffer, where the
    decoded images follow the worker's pixels (from ``first_pixel``), one after another in table order."""
    unique = {crop.image.index: crop.image for _, crop in crops}
    sources = sorted(unique.values(), key=lambda image: (image.size[1], image.size[0], image.index))
    place, starts, pixel, byte = {}, [], first_pixel, 0
    for source in sources:
        place[source.index] = pixel
        pixel += source.size[0] * source.size[1]
        starts.append(byte)
        byte += source.data.size
    for row, crop in crops:
        x, y, _, _ = crop.box
        width = crop.image.size[0]
        tiles[row][5] = (place[crop.image.index] + y * width + x) * 3
        tiles[row][6] = width
    table = torch.tensor([(start, source.data.size, *source.size) for start, source in zip(starts, sources)],
                         dtype=torch.int64).reshape(-1, 4)
    return sources, table, byte


def sampling_matrix(plan: ImagePlan, flips: tuple[bool, bool]) -> np.ndarray:
    """Image pixel -> canvas point for ``plan``: ``flips`` (up-down, left-right) of the image, then the inverse warp
    (cv2 inverts a singular affine matrix to zeros, which reads the canvas's (0, 0) everywhere; done alike)."""
    width, height = plan.out_size
    up_down, left_right = flips
    flipping = np.array([[-1.0 if left_right else 1.0, 0, width - 1 if left_right else 0],
                         [0, -1.0 if up_down else 1.0, height - 1 if up_down else 0],
                         [0, 0, 1]])
    inverse = np.eye(3)
    if plan.matrix is not None:
        try:
            inverse = np.linalg.inv(plan.matrix)
        except np.linalg.LinAlgError:
            inverse = np.diag([0.0, 0.0, 1.0])
    return inverse @ flipping


def collate_plans(batch, slots=None):
    """``collate`` for plans: (PlanBatch, targets (n, 6) with each row's image index, paths, shapes). Images of
    different sizes (a distributed rank's share of a --rect split) are padded bottom/right to the largest and their
    labels rescaled, as ``collate`` does. In a worker the pixels (and the JPEG bytes, ``--decode-device``) are
    written once, into one shared buffer: a reused one from ``slots`` when one is free (utils.data.batch_slots),
    else a fresh one."""
    plans, labels, paths, shapes = zip(*batch)
    height = max(plan.out_size[1] for plan in plans)
    width = max(plan.out_size[0] for plan in plans)
    for i, (plan, item_labels) in enumerate(zip(plans, labels)):
        item_labels[:, 0] = i
        w, h = plan.out_size
        if (h, w) != (height, width):
            item_labels[:, [2, 4]] *= w / width
            item_labels[:, [3, 5]] *= h / height
    layers = [(plan, plan.flips) for plan in plans]  # (what is warped, the flips of the image it belongs to)
    blends, ratios = [], []
    for i, plan in enumerate(plans):
        if plan.mixup is not None:
            second, ratio = plan.mixup
            blends.append((i, len(layers)))
            ratios.append(ratio)
            layers.append((second, plan.flips))
    tiles, chunks, crops, offset = [], [], [], 0
    for layer, (plan, _) in enumerate(layers):
        for img, (x, y) in plan.tiles:
            if isinstance(img, SourceCrop):  # its offset and stride once the sources are placed (below)
                crops.append((len(tiles), img))
                tiles.append([layer, x, y, img.box[2], img.box[3], 0, 0])
                continue
            tiles.append([layer, x, y, img.shape[1], img.shape[0], offset, img.shape[1]])
            chunks.append((offset, img))
            offset += img.shape[0] * img.shape[1] * 3
    sources, source_table, source_bytes = encoded_sources(crops, tiles, offset // 3)
    total = offset + source_bytes
    slot = slots.buffer(total, SLOT_HEADROOM) if slots is not None else None
    if slot is not None:
        data = slot
    elif get_worker_info() is not None:  # sent to the training process: built in shared memory
        data = fresh_shared_bytes(total)
    else:
        data = torch.empty(total, dtype=torch.uint8)
    flat = data.numpy()
    for start, img in chunks:
        flat[start:start + img.size].reshape(img.shape)[:] = img
    for (start, count), source in zip(source_table[:, :2].tolist(), sources):
        flat[offset + start:offset + start + count] = source.data
    pastes = [(layer, x, y, mask.shape[1], mask.shape[0]) for layer, (plan, _) in enumerate(layers)
              if plan.paste is not None for mask, (x, y) in [plan.paste]]
    masks = [plan.paste[0].reshape(-1) for plan, _ in layers if plan.paste is not None]
    starts = np.cumsum([0] + [len(mask) for mask in masks])[:-1]
    hsv = np.zeros((len(plans), 256, 3), np.uint8)
    for i, plan in enumerate(plans):
        if plan.hsv is not None:
            hsv[i] = plan.hsv
    batch = PlanBatch(pixels=data[:offset], tiles=torch.tensor(tiles, dtype=torch.int64).reshape(-1, 7),
                      canvases=torch.tensor([plan.canvas_size for plan, _ in layers], dtype=torch.int64),
                      sampling=torch.from_numpy(np.stack([sampling_matrix(plan, flips) for plan, flips in layers])),
                      projective=torch.tensor([plan.projective for plan, _ in layers]),
                      blends=torch.tensor(blends, dtype=torch.int64).reshape(-1, 2),
                      ratios=torch.tensor(ratios, dtype=torch.float64),
                      pastes=torch.tensor([(*paste, int(start)) for paste, start in zip(pastes, starts)],
                                          dtype=torch.int64).reshape(-1, 6),
                      paste_masks=torch.from_numpy(np.concatenate(masks + [np.zeros(0, bool)])),
                      out_sizes=torch.tensor([plan.out_size for plan in plans], dtype=torch.int64),
                      hsv=torch.from_numpy(hsv), has_hsv=torch.tensor([plan.hsv is not None for plan in plans]),
                      flips=torch.tensor([plan.flips for plan in plans], dtype=torch.bool).reshape(-1, 2),
                      size=(height, width), source_table=source_table, source_paths=[source.path for source in sources],
                      sources=data[offset:] if source_bytes else torch.empty(0, dtype=torch.uint8))
    collated = batch, torch.cat(labels, 0), list(paths), shapes
    return handed_over(collated, slot, slots)
