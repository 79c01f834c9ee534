"""Rendering a batch of plans (``utils.data.plans``) into training images with torch ops, on any device.

What the CPU path does with OpenCV per image, done here for a whole batch (docs/device-augmentation.md):

- canvas: grey (114) with each plan's tiles pasted where the plan puts them;
- warp: bilinear sampling of the canvas at the inverse warp of every image pixel (``grid_sample``), grey outside the
  canvas, as cv2.warpAffine / warpPerspective with ``borderValue=114``. OpenCV 5's uint8 bilinear warp computes in
  floating point and rounds to nearest, as this does: the two differ by 1 on a few pixels in 100,000 (rounding of
  values within float error of .5);
- HSV: OpenCV's own uint8 BGR -> HSV and HSV -> RGB conversions as two tables, made once per device by cv2 on
  every possible input (64 MiB + 45 MiB as int32), with the plan's table in between: exact. OpenCV's HSV -> RGB
  converts the last pixels of a row past its blocks of vector code (32 pixels with OpenCV 5.0, 64 with 5.1) with
  its scalar code, which rounds most inputs differently (by 1): where an image's shape has such pixels (asked of
  cv2 once per shape, ``scalar_positions``), they take a third table, the scalar code's (45 MiB, made on first
  need);
- copy-paste: the canvas pixels under the plan's mask take the mirrored canvas's (exact);
- mixup: the second mosaic warped the same way, blended in float32 and rounded as cv2.addWeighted (exact);
- flips: folded into the sampling (exact);
- letterbox: a plan's tile inside its grey canvas (a resize, when the letterbox needs one, is done by cv2 in the
  worker, so that it is exact);
- ``--decode-device``: the JPEG sources a batch carries (``PlanBatch.sources``, images at their training size)
  decoded here first, in one batched call (torchvision's ``decode_jpeg``: nvJPEG on CUDA; libjpeg-turbo on the CPU,
  which decodes as OpenCV does, to the bit), then read by the tiles in place.

The result is ``collate``'s layout: (B, 3, H, W) uint8 RGB, channels_last.
"""
from __future__ import annotations

import functools
import threading

import cv2
import numpy as np
import torch
import torch.nn.functional as F

from utils.data.images import ImageError
from utils.data.transforms import FILL

CANVAS_BYTES = 256 << 20  # float32 canvas memory one rendering step uses at most (more images: several steps)
# what the rendering keeps on the device between batches, at most: the two HSV tables as int32 and, once an image's
# shape has pixels that OpenCV's HSV -> RGB converts with its scalar code, that code's table (AutoBatch sets it all
# aside; the rendering's other buffers are freed before the forward pass, whose peak is larger, and reused by it)
RESIDENT_BYTES = (256 ** 3 + 2 * 180 * 256 ** 2) * 4
COLOUR_STEP = 16  # images per HSV step (its index tensors: 12 bytes per pixel)
_TABLES: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
_SCALAR_TABLES: dict[str, torch.Tensor] = {}
_TABLES_LOCK = threading.Lock()
_POSITIONS: dict[tuple[int, int], np.ndarray] = {}
_POSITIONS_LOCK = threading.Lock()


def every_colour(first: int = 256) -> np.ndarray:
    """Every uint8 triple whose first byte is below ``first``, in packed-index order: (first, 256, 256, 3)."""
    values = np.arange(256, dtype=np.uint8)
    colours = np.empty((first, 256, 256, 3), np.uint8)
    colours[..., 0] = values[:first, None, None]
    colours[..., 1] = values[None, :, None]
    colours[..., 2] = values[None, None, :]
    return colours


def packed_conversion(colours: np.ndarray, row: int, code: int) -> np.ndarray:
    """cv2.cvtColor(code) of every colour, converted as rows of ``row`` pixels, as int32 of packed bytes."""
    packed = np.zeros((colours.size // 3, 4), np.uint8)
    packed[:, :3] = cv2.cvtColor(colours.reshape(-1, row, 3), code).reshape(-1, 3)
    return packed.view("<i4")[:, 0].copy()


def hsv_tables_cpu() -> tuple[np.ndarray, np.ndarray]:
    """OpenCV's uint8 conversions on every input, as int32 tables of packed bytes: BGR -> HSV indexed by
    b << 16 | g << 8 | r, holding h | s << 8 | v << 16; HSV -> RGB indexed by h << 16 | s << 8 | v (hue is below
    180), holding r | g << 8 | b << 16. Rows of 256 pixels, so that OpenCV converts every pixel with its vector code."""
    colours = every_colour()
    return (packed_conversion(colours, 256, cv2.COLOR_BGR2HSV),
            packed_conversion(colours[:180], 256, cv2.COLOR_HSV2RGB))


def hsv_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``hsv_tables_cpu`` on ``device``, made once per device (64 MiB + 45 MiB as int32)."""
    key = str(device)
    with _TABLES_LOCK:
        if key not in _TABLES:
            to_hsv, to_rgb = hsv_tables_cpu()
            _TABLES[key] = to_device(torch.from_numpy(to_hsv), device), to_device(torch.from_numpy(to_rgb), device)
        return _TABLES[key]


def hsv_inputs(index: np.ndarray) -> np.ndarray:
    """The uint8 HSV inputs at ``index`` of the HSV -> RGB table (h << 16 | s << 8 | v, hue below 180): (N, 3)."""
    index = np.asarray(index)
    return np.stack([index >> 16, (index >> 8) & 255, index & 255], axis=1).astype(np.uint8)


def scalar_rgb_table_cpu() -> np.ndarray:
    """``hsv_tables_cpu``'s HSV -> RGB table as OpenCV's scalar code computes it: rows of one pixel, which have no
    block of vector code."""
    return packed_conversion(every_colour(180), 1, cv2.COLOR_HSV2RGB)


def scalar_rgb_table(device: torch.device) -> torch.Tensor:
    """``scalar_rgb_table_cpu`` on ``device``, made once per device on first need (45 MiB as int32)."""
    key = str(device)
    with _TABLES_LOCK:
        if key not in _SCALAR_TABLES:
            _SCALAR_TABLES[key] = to_device(torch.from_numpy(scalar_rgb_table_cpu()), device)
        return _SCALAR_TABLES[key]


@functools.lru_cache(maxsize=None)
def probe_inputs(count: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` HSV inputs that OpenCV's two HSV -> RGB codes convert differently, with the vector code's and the
    scalar code's results: (count, 3) each."""
    inputs = hsv_inputs(np.arange(2048) * 4099)  # spread over the table; most inputs differ between the codes
    vector = cv2.cvtColor(inputs.reshape(1, -1, 3), cv2.COLOR_HSV2RGB).reshape(-1, 3)  # one long row: its blocks
    scalar = cv2.cvtColor(inputs.reshape(-1, 1, 3), cv2.COLOR_HSV2RGB).reshape(-1, 3)
    differ = np.flatnonzero((vector != scalar).any(axis=1))[:count]
    return inputs[differ], vector[differ], scalar[differ]


def scalar_positions(height: int, width: int) -> np.ndarray:
    """The pixels of a contiguous (height, width) image that OpenCV's HSV -> RGB converts with its scalar code, as
    flat indices (empty where it has none: every width OpenCV's blocks divide). Found by converting images of that
    shape filled with inputs that the two codes convert differently: the installed cv2 is asked, no block size is
    assumed; cached per shape (a few cv2 calls)."""
    key = (int(height), int(width))
    with _POSITIONS_LOCK:
        if key not in _POSITIONS:
            inputs, _, scalar = probe_inputs()
            found = np.ones(key, bool)
            for value, result in zip(inputs, scalar):
                out = cv2.cvtColor(np.broadcast_to(value, (*key, 3)).copy(), cv2.COLOR_HSV2RGB)
                found &= (out == result).all(axis=-1)
            _POSITIONS[key] = np.flatnonzero(found)
        return _POSITIONS[key]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on ``device`` that does not wait for the device (a copy from pageable memory is staged
    before the call returns, so the host tensor may go at once)."""
    return tensor.to(device, non_blocking=True)


def render_plans(batch, device: torch.device | str = "cpu") -> torch.Tensor:
    """The images of a ``PlanBatch`` on ``device``: (B, 3, H, W) uint8 RGB, channels_last."""
    device = torch.device(device)
    count, (height, width) = len(batch), batch.size
    pixels = device_pixels(batch, device)
    bgr = torch.empty((len(batch.canvases), height, width, 3), dtype=torch.uint8, device=device)  # every layer
    for members in canvas_steps(batch.canvases, CANVAS_BYTES):
        bgr[to_device(members, device)] = warp_step(batch, pixels, members, device)
    blend_step(bgr, batch.blends, batch.ratios, device)
    out = torch.empty((count, height, width, 3), dtype=torch.uint8, device=device)
    for first in range(0, count, COLOUR_STEP):
        last = min(first + COLOUR_STEP, count)
        out[first:last] = colour_step(bgr[first:last], batch.hsv[first:last], batch.has_hsv[first:last], device,
                                      batch.out_sizes[first:last], batch.flips[first:last])
    for image, (w, h) in enumerate(batch.out_sizes.tolist()):  # smaller than the batch: grey beyond, as collate pads
        if (h, w) != (height, width):
            out[image, h:] = FILL
            out[image, :, w:] = FILL
    return out.permute(0, 3, 1, 2)


def device_pixels(batch, device: torch.device) -> torch.Tensor:
    """The pixel buffer the tiles read on ``device``: the worker's pixels, then the batch's decoded sources."""
    pixels = to_device(batch.pixels, device)
    if not len(batch.source_table):
        return pixels
    return torch.cat((pixels, decoded_sources(batch, device)))


def decoded_sources(batch, device: torch.device) -> torch.Tensor:
    """The batch's JPEG sources decoded on ``device`` in one call, one after another as uint8 BGR rows (the worker's
    layout) in table order. A file that does not decode, or decodes to another size than its scan read, raises
    ImageError naming it."""
    table = batch.source_table.tolist()
    images = decode_on(device, [batch.sources[start:start + count] for start, count, *_ in table], batch.source_paths)
    flat, run = [], []  # runs of equal sizes (consecutive in the table), each turned into rows in one copy
    for image, (*_, w, h), path in zip(images, table, batch.source_paths):
        if tuple(image.shape) != (3, h, w):
            raise ImageError(f"{path}: decodes to {image.shape[2]}x{image.shape[1]} on {device}, not the {w}x{h} "
                             "its scan read (was it replaced during training?)")
        if run and run[-1].shape != image.shape:
            flat.append(_bgr_rows(run))
            run = []
        run.append(image)
    if run:
        flat.append(_bgr_rows(run))
    return torch.cat(flat)


_DECODE_STREAMS: dict = {}  # CUDA device index -> the side stream that decode_jpeg runs from


def decode_on(device: torch.device, data: list, paths: list) -> list:
    """The JPEG bytes ``data`` decoded on ``device`` in one call, (3, h, w) RGB each; a file that does not decode
    raises ImageError naming it (``paths``).

    On CUDA the call runs with a side stream of its own current, so that its outputs come from that stream's memory,
    never from blocks freed on the training stream that kernels queued there still read. torchvision's CUDA decoder
    (0.29) decodes on a private stream that it never orders after the caller's, and the caching allocator hands the
    caller's stream a freed block at once: with kernels in flight (the previous step), the decode overwrote memory
    they had yet to read (pytorch/vision#9606: 199 of 200 iterations corrupted on an H100; none with the decode
    called from another stream, as here). The training stream then waits for the decode, and the images' blocks are
    not reused until its kernels that read them have run."""
    if device.type != "cuda":
        return _decode_all(device, data, paths)
    index = device.index if device.index is not None else torch.cuda.current_device()
    training = torch.cuda.current_stream(index)
    side = _DECODE_STREAMS.get(index)
    if side is None:
        side = _DECODE_STREAMS[index] = torch.cuda.Stream(index)
    with torch.cuda.stream(side):
        images = _decode_all(device, data, paths)
    training.wait_stream(side)  # torchvision orders its outputs on the stream that was current (``side``)
    for image in images:
        image.record_stream(training)
    return images


def _decode_all(device: torch.device, data: list, paths: list) -> list:
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:  # one at a time, to name the file
        return [_decode_one(one, path, device) for one, path in zip(data, paths)]


def _decode_one(data: torch.Tensor, path: str, device: torch.device) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError as error:
        raise ImageError(f"{path}: cannot be decoded on {device} ({str(error).splitlines()[0][:200]})") from None


def _bgr_rows(images: list[torch.Tensor]) -> torch.Tensor:
    """Decoded (3, h, w) RGB images of one size -> their pixels as uint8 BGR rows, one image after another, flat."""
    return torch.stack([image.permute(1, 2, 0) for image in images]).flip(-1).reshape(-1)


def canvas_steps(canvases: torch.Tensor, budget: int):
    """Groups of images (index tensors) with canvases of one size, whose float32 canvases fit ``budget`` bytes together
    (at least one image per group). Each image is sampled from a canvas of its own size, so that its pixels do not
    depend on the others in its group (``grid_sample``'s coordinates are relative to the canvas's size)."""
    sizes = canvases.tolist()
    for size in sorted(set(map(tuple, sizes))):
        members = [i for i, s in enumerate(sizes) if tuple(s) == size]
        per_step = max(budget // (3 * size[0] * size[1] * 4), 1)
        for start in range(0, len(members), per_step):
            yield torch.tensor(members[start:start + per_step], dtype=torch.int64)


def build_canvases(batch, pixels: torch.Tensor, members: torch.Tensor, device) -> torch.Tensor:
    """(n, 3, H, W) float32 canvases (of one size) of images ``members`` minus the grey (114): 0 wherever no tile
    lies, so that ``grid_sample``'s zero padding is the grey border."""
    width, height = (max(int(v), 2) for v in batch.canvases[members[0]])
    canvas = torch.zeros((len(members), height, width, 3), dtype=torch.float32, device=device)
    paste_tiles(canvas, batch.tiles, pixels, members)
    place = {int(image): k for k, image in enumerate(members.tolist())} if len(batch.pastes) else {}
    for image, x, y, w, h, offset in batch.pastes.tolist():  # copy-paste: mirrored pixels under the mask
        if image in place:
            mask = to_device(batch.paste_masks[offset:offset + w * h].view(h, w, 1), device)
            region = canvas[place[image], y:y + h, x:x + w]
            mirrored = canvas[place[image], y:y + h, width - x - w:width - x].flip(1)
            region.copy_(torch.where(mask, mirrored, region))
    return canvas.permute(0, 3, 1, 2)


def paste_tiles(canvas: torch.Tensor, tiles: torch.Tensor, pixels: torch.Tensor, members: torch.Tensor) -> None:
    """Every tile of images ``members`` (rows of ``tiles``: image, x, y, w, h, byte offset in ``pixels``, row stride
    in pixels) minus the grey into its place on ``canvas`` (n, H, W, 3) float32, in two calls: a view of each tile's
    rows in ``pixels`` copied onto a view of its place (``torch._foreach_copy_``), then the grey taken from those
    places (``torch._foreach_sub_``); nothing computed per pixel but the values. The form that wrote all tiles through
    per-pixel indices (CUDA's until 2026-11-28) read and wrote 28.1 GB for a batch of 64 BCCD mosaics at 640, and one
    copy and one subtraction per tile (the CPU's) 14.0 GB in ~7 operations a tile; this way 13.4 GB in 2 operations a
    tile, both views (benchmarks/render_ops.py)."""
    place = {image: k for k, image in enumerate(members.tolist())}
    _, height, width, _ = canvas.shape
    destinations, sources = [], []
    for image, x, y, w, h, offset, stride in tiles.tolist():
        if image in place:  # one view each (as_strided), where indexing the canvas would take three operations
            sources.append(pixels.as_strided((h, w, 3), (stride * 3, 3, 1), pixels.storage_offset() + offset))
            first = canvas.storage_offset() + ((place[image] * height + y) * width + x) * 3
            destinations.append(canvas.as_strided((h, w, 3), (width * 3, 3, 1), first))
    if destinations:
        torch._foreach_copy_(destinations, sources)
        torch._foreach_sub_(destinations, FILL)


def sampling_grid(batch, members: torch.Tensor, height: int, width: int, canvas_h: int, canvas_w: int,
                  device) -> torch.Tensor:
    """(n, height, width, 2) ``grid_sample`` coordinates (align_corners=True) of every image pixel."""
    scale = np.array([[2.0 / (canvas_w - 1), 0, -1], [0, 2.0 / (canvas_h - 1), -1], [0, 0, 1]])
    matrices = to_device(torch.from_numpy(scale @ batch.sampling[members].numpy()).to(torch.float32), device)
    ys = torch.arange(height, dtype=torch.float32, device=device).view(1, height, 1)
    xs = torch.arange(width, dtype=torch.float32, device=device).view(1, 1, width)
    m = matrices.view(-1, 9, 1, 1)
    gx = m[:, 0] * xs + m[:, 1] * ys + m[:, 2]
    gy = m[:, 3] * xs + m[:, 4] * ys + m[:, 5]
    projective = batch.projective[members]
    if bool(projective.any()):
        denominator = m[:, 6] * xs + m[:, 7] * ys + m[:, 8]
        keep = to_device(~projective, device).view(-1, 1, 1)
        denominator = torch.where(keep, torch.ones_like(denominator), denominator)
        gx, gy = gx / denominator, gy / denominator
    return torch.stack((gx, gy), -1)


def warp_step(batch, pixels: torch.Tensor, members: torch.Tensor, device) -> torch.Tensor:
    """(n, H, W, 3) uint8 BGR of images ``members``: canvases, warp, rounding."""
    height, width = batch.size
    canvas = build_canvases(batch, pixels, members, device)
    grid = sampling_grid(batch, members, height, width, canvas.shape[2], canvas.shape[3], device)
    warped = F.grid_sample(canvas, grid, mode="bilinear", padding_mode="zeros", align_corners=True)
    return warped.add_(FILL).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)


def blend_step(bgr: torch.Tensor, blends: torch.Tensor, ratios: torch.Tensor, device) -> None:
    """Mixup, in place: image = ratio x image + (1 - ratio) x its second layer, in float32 and rounded to nearest, as
    cv2.addWeighted blends uint8 images (equal to it on every value tested)."""
    if not len(blends):
        return
    images, layers = to_device(blends[:, 0], device), to_device(blends[:, 1], device)
    alpha = to_device(ratios.to(torch.float32), device).view(-1, 1, 1, 1)
    beta = to_device((1.0 - ratios).to(torch.float32), device).view(-1, 1, 1, 1)  # 1 - ratio in float64, as cv2
    mixed = bgr[images].to(torch.float32) * alpha + bgr[layers].to(torch.float32) * beta
    bgr[images] = mixed.round_().clamp_(0, 255).to(torch.uint8)


def colour_step(bgr: torch.Tensor, hsv: torch.Tensor, has_hsv: torch.Tensor, device,
                out_sizes: torch.Tensor | None = None, flips: torch.Tensor | None = None) -> torch.Tensor:
    """(n, H, W, 3) uint8 BGR -> RGB, through each image's HSV table where it has one (OpenCV's conversions, each
    image as OpenCV converts an image of its own size, before its flips: ``out_sizes`` (n, 2) (w, h), else the
    frame's; ``flips`` (n, 2) (up-down, left-right), else none; both on the host)."""
    if not bool(has_hsv.any()):
        return bgr.flip(-1)
    to_hsv, to_rgb = hsv_tables(device)
    count = len(bgr)
    channels = bgr.to(torch.int32)
    index = (channels[..., 0] << 16) | (channels[..., 1] << 8) | channels[..., 2]
    packed = to_hsv.index_select(0, index.reshape(-1)).view(count, -1)  # h | s << 8 | v << 16
    # each image's table as three int32 tables already shifted to their place in the HSV -> RGB index
    tables = hsv.to(torch.int32) << torch.tensor([16, 8, 0], dtype=torch.int32)  # tiny: shifted on the host
    tables = to_device(tables.transpose(1, 2).reshape(-1), device)  # image i: hue at 768 i, saturation, value
    base = (torch.arange(count, dtype=torch.int32, device=device) * 768).view(-1, 1)
    index = tables.index_select(0, ((packed & 255) + base).view(-1))
    index += tables.index_select(0, (((packed >> 8) & 255) + (base + 256)).view(-1))
    index += tables.index_select(0, ((packed >> 16) + (base + 512)).view(-1))
    rgb = to_rgb.index_select(0, index)
    positions = scalar_step_positions(bgr.shape[:3], has_hsv, out_sizes, flips)
    if positions is not None:
        positions = to_device(positions, device)
        rgb.index_copy_(0, positions, scalar_rgb_table(device).index_select(0, index.index_select(0, positions)))
    coloured = rgb.view(torch.uint8).view(*bgr.shape[:3], 4)[..., :3]
    if bool(has_hsv.all()):
        return coloured
    return torch.where(to_device(has_hsv, device).view(-1, 1, 1, 1), coloured, bgr.flip(-1))


def scalar_step_positions(shape, has_hsv: torch.Tensor, out_sizes: torch.Tensor | None = None,
                          flips: torch.Tensor | None = None) -> torch.Tensor | None:
    """The flat indices into an (n, H, W) colour step of the pixels OpenCV converts with its scalar HSV -> RGB
    code: ``scalar_positions`` of each coloured image's own size, mirrored by its flips (OpenCV flips after HSV),
    placed in the frame; None where there are none. Known on the host from the shapes alone: the device never waits
    for them."""
    count, height, width = shape
    sizes = [(width, height)] * count if out_sizes is None else out_sizes.tolist()
    flipped = [(False, False)] * count if flips is None else flips.tolist()
    found = []
    for image, ((w, h), (up_down, left_right), coloured) in enumerate(zip(sizes, flipped, has_hsv.tolist())):
        flat = scalar_positions(h, w) if coloured else ()
        if len(flat):
            rows, cols = np.divmod(flat, w)
            rows = h - 1 - rows if up_down else rows
            cols = w - 1 - cols if left_right else cols
            found.append(np.sort(image * height * width + rows * width + cols))
    return torch.from_numpy(np.concatenate(found)) if found else None


class DeviceAugment:
    """train_one_epoch's ``batch_transform`` for --augment-device: a ``PlanBatch`` from the loader -> its images on
    the training device (the targets and paths as they come)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def __call__(self, epoch: int, batch_index: int, images, targets, paths):
        return render_plans(images, self.device), targets, paths
