"""AutoAnchor: measure how well a model's anchors fit the training boxes, and fit new ones when they do not.

YOLOv5 behaviour, step by step:

- Box sizes (``label_wh``): each image is scaled so its long side is ``imgsz``, times a random 0.9-1.1
  factor per image (a numpy Generator here, so a run is reproducible); a box is its normalised (w, h)
  times that image size, in pixels.
- Fit of a box to an anchor: ``r = min(w / aw, aw / w, h / ah, ah / h)``, the worse dimension's ratio.
  An anchor can learn a box when ``r > 1 / anchor_t`` (hyp.anchor_t, 4 by default), the rule the loss
  uses. Best possible recall (BPR) = share of boxes with at least one such anchor; anchors/target =
  mean number of such anchors per box.
- When BPR is not above 0.98, or the model YAML gave an anchor count instead of anchors, k-means on the
  whitened (w, h) of the boxes with a side of at least 2 px (their exact sizes, without the jitter) gives a
  start, refined by a genetic hill climb (multiplicative mutations) on fitness = mean over boxes of their
  best ``r``, 0 where it is too small.
- New anchors replace the current ones only when their BPR (on the jittered sizes) is higher. They are
  rounded to 0.1 px, sorted by area and assigned to levels in pixels (smallest areas to the smallest
  stride), then divided by each level's stride into the Detect buffer (grid units); ``model.yaml``
  gets the same pixel values, so a checkpoint's stored YAML rebuilds identical anchors.

The search is seeded but stops at a time limit, so under DDP run it on one process and broadcast the
model's buffers (as DDP does at construction) rather than on every rank.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm import tqdm

from utils.dist import is_main_process
from utils.errors import UserError

LOGGER = logging.getLogger(__name__)
PREFIX = "AutoAnchor: "

BPR_TARGET = 0.98  # below this best possible recall, new anchors are searched for
MIN_SIDE = 2.0  # pixels: boxes with both sides below are left out of k-means; anchors never go below
SMALL_SIDE = 3.0  # pixels: boxes with a side below are reported
SCALE_JITTER = (0.9, 1.1)  # random per-image scale applied to the box sizes
KMEANS_ITERATIONS = 30
MUTATION_PROBABILITY = 0.9
MUTATION_SIGMA = 0.1
FACTOR_RANGE = (0.3, 3.0)  # clip of one generation's multiplicative mutation
FILL_SIGMA = 0.1  # spread of the copies that fill in centroids k-means could not produce
DEFAULT_TIME_LIMIT = 60.0  # seconds for the genetic refinement
DECIMALS = 1  # pixel anchors are rounded to 0.1 px (stored in model.yaml)


class AnchorError(UserError):
    """Anchors cannot be computed for this model and dataset; the message says why."""


@dataclass
class AnchorReport:
    """What ``adapt_anchors`` found and did. ``*_before`` are None when the YAML gave only a count."""
    boxes: int
    bpr_before: float | None
    bpr_after: float | None
    anchors_per_target_before: float | None
    anchors_per_target_after: float | None
    anchors: list = field(default_factory=list)  # per level: [[w, h], ...] in pixels, after the check
    strides: list = field(default_factory=list)
    adopted: bool = False
    seconds: float = 0.0
    message: str = ""


# ----------------------------------------------------------------------------- box sizes and metrics
def label_wh(labels, shapes, imgsz: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """(n, 2) float64 box widths and heights in pixels at ``imgsz`` (long side), all images' boxes.

    ``labels``: per image (k, 5) ``[class, cx, cy, w, h]`` normalised; ``shapes``: (N, 2) (width, height).
    With ``rng``, each image's size is multiplied by a U(0.9, 1.1) draw (YOLOv5's jitter); without, exact.
    """
    shapes = np.asarray(shapes, dtype=np.float64).reshape(-1, 2)
    if len(labels) != len(shapes):
        raise ValueError(f"{len(labels)} label arrays but {len(shapes)} image shapes")
    sizes = imgsz * shapes / shapes.max(1, keepdims=True)
    if rng is not None:
        sizes = sizes * rng.uniform(*SCALE_JITTER, size=(len(shapes), 1))
    parts = [np.asarray(boxes, dtype=np.float64).reshape(-1, 5)[:, 3:5] * size for boxes, size in zip(labels, sizes)]
    return np.concatenate(parts) if parts else np.zeros((0, 2))


def anchor_ratios(wh, anchors) -> np.ndarray:
    """(n, k) fit of each box to each anchor: min over w and h of min(box / anchor, anchor / box)."""
    wh = np.asarray(wh, dtype=np.float64).reshape(-1, 1, 2)
    anchors = np.asarray(anchors, dtype=np.float64).reshape(1, -1, 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = wh / anchors
        fit = np.minimum(ratio, 1 / ratio).min(2)
    return np.nan_to_num(fit, nan=0.0)


def anchor_fit(anchors_px, wh, thr: float) -> tuple[float, float]:
    """(best possible recall, anchors per target) of pixel anchors for pixel boxes; (0, 0) without boxes."""
    if not len(wh):
        return 0.0, 0.0
    matched = anchor_ratios(wh, anchors_px) > 1 / thr
    return float(matched.any(1).mean()), float(matched.sum(1).mean())


def anchor_fitness(anchors_px, wh, thr: float) -> float:
    """Mean over boxes of the best anchor's fit, counting 0 where it is not above 1 / thr."""
    if not len(wh):
        return 0.0
    best = anchor_ratios(wh, anchors_px).max(1)
    return float((best * (best > 1 / thr)).mean())


def _log_fitness(log_wh: np.ndarray, log_anchors: np.ndarray, log_thr: float) -> float:
    """``anchor_fitness`` in log space (fit = exp(-max |log box - log anchor|)), one anchor at a time:
    O(n) memory and one exp per box, for the thousand evaluations of the genetic search."""
    distance = np.full(len(log_wh), np.inf)
    for log_w, log_h in log_anchors:
        np.minimum(distance, np.maximum(np.abs(log_wh[:, 0] - log_w), np.abs(log_wh[:, 1] - log_h)), out=distance)
    return float(np.where(distance < log_thr, np.exp(-distance), 0.0).mean())


def sort_by_area(anchors) -> np.ndarray:
    anchors = np.asarray(anchors, dtype=np.float64).reshape(-1, 2)
    return anchors[np.argsort(anchors.prod(1), kind="stable")]


# ----------------------------------------------------------------------------- k-means + genetic search
def evolve_anchors(wh, n: int = 9, imgsz: int = 640, thr: float = 4.0, generations: int = 1000, seed: int = 0,
                  time_limit: float = DEFAULT_TIME_LIMIT, progress: bool = True) -> np.ndarray:
    """(n, 2) pixel anchors for pixel boxes ``wh``, sorted by area: k-means, then a genetic hill climb.

    Boxes with both sides under 2 px are left out. When k-means yields fewer than ``n`` centroids (fewer
    distinct boxes than anchors, or empty clusters), the missing ones are jittered copies of those it
    found, or YOLOv5's random start when there are none. The climb only accepts better anchors, so the
    result is never less fit than the start; it stops after ``generations`` or ``time_limit`` seconds.
    """
    wh = np.asarray(wh, dtype=np.float64).reshape(-1, 2)
    small = int((wh < SMALL_SIDE).any(1).sum())
    if small:
        LOGGER.warning(f"{PREFIX}{small} of {len(wh)} boxes are smaller than {SMALL_SIDE:g} pixels at "
                       f"imgsz {imgsz}; such tiny objects are hard to learn")
    usable = wh[(wh >= MIN_SIDE).any(1)]
    if not len(usable):
        usable = wh[(wh > 0).all(1)]
    if not len(usable):
        raise ValueError("no box with a positive size to fit anchors to")
    rng = np.random.default_rng(_entropy(seed))
    anchors = _initial_anchors(usable, n, imgsz, rng)
    anchors = _refine(anchors, usable, thr, generations, rng, time_limit, progress)
    return sort_by_area(anchors)


def _entropy(seed: int) -> int:
    return int(seed) % (1 << 64)  # numpy seeds must be non-negative


def _initial_anchors(wh: np.ndarray, n: int, imgsz: int, rng: np.random.Generator) -> np.ndarray:
    from scipy.cluster.vq import kmeans

    scale = wh.std(0)
    scale[~(scale > 0)] = 1.0  # all boxes alike in one dimension: nothing to whiten
    centroids = np.zeros((0, 2))
    if len(np.unique(wh, axis=0)) >= n:
        try:
            centroids = kmeans(wh / scale, n, iter=KMEANS_ITERATIONS, rng=rng)[0] * scale
        except (ValueError, np.linalg.LinAlgError) as error:
            LOGGER.warning(f"{PREFIX}k-means failed ({str(error)[:80]}); starting from other points")
    else:
        centroids = np.unique(wh, axis=0)
    if len(centroids) < n:
        LOGGER.info(f"{PREFIX}k-means gave {len(centroids)} of {n} anchors; the rest start as jittered copies")
        centroids = _fill(centroids, n, imgsz, rng)
    return np.clip(centroids, MIN_SIDE, None)


def _fill(centroids: np.ndarray, n: int, imgsz: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` starting anchors from fewer centroids: cycle through them with a small multiplicative jitter
    (log-normal, sigma 0.1), or YOLOv5's random start (sorted uniform sizes up to imgsz) when there are none."""
    if not len(centroids):
        return np.sort(rng.random(n * 2)).reshape(n, 2) * imgsz
    copies = centroids[np.arange(n - len(centroids)) % len(centroids)]
    copies = copies * np.exp(rng.normal(0.0, FILL_SIGMA, copies.shape))
    return np.concatenate([centroids, copies])


def _mutation_factors(shape, rng: np.random.Generator) -> np.ndarray:
    """YOLOv5's mutation: each value with probability 0.9 gets 1 + u * N(0, 1) * 0.1 (one u ~ U(0, 1) per
    draw), clipped to [0.3, 3]; drawn again until something changes."""
    factors = np.ones(shape)
    while (factors == 1).all():
        mask = rng.random(shape) < MUTATION_PROBABILITY
        factors = (mask * rng.random() * rng.standard_normal(shape) * MUTATION_SIGMA + 1).clip(*FACTOR_RANGE)
    return factors


def _refine(anchors: np.ndarray, wh: np.ndarray, thr: float, generations: int, rng: np.random.Generator,
            time_limit: float, progress: bool) -> np.ndarray:
    """Genetic hill climb: mutate the best anchors, keep the mutant when its fitness is higher."""
    log_wh, log_thr = np.log(wh), math.log(thr)
    best = _log_fitness(log_wh, np.log(anchors), log_thr)
    start = time.monotonic()
    bar = tqdm(range(generations), desc=f"{PREFIX}evolving anchors", leave=False, disable=not progress)
    for generation in bar:
        candidate = np.clip(anchors * _mutation_factors(anchors.shape, rng), MIN_SIDE, None)
        fitness = _log_fitness(log_wh, np.log(candidate), log_thr)
        if fitness > best:
            best, anchors = fitness, candidate
            bar.set_description(f"{PREFIX}evolving anchors, fitness {best:.4f}")
        if time.monotonic() - start > time_limit and generation + 1 < generations:
            LOGGER.warning(f"{PREFIX}anchor search stopped after {generation + 1} of {generations} "
                           f"generations (time limit {time_limit:g} s)")
            break
    bar.close()
    return anchors


# ----------------------------------------------------------------------------- the model's anchors
def _detect(model):
    model = getattr(model, "module", model)  # DDP / DataParallel wrapper
    return model, model.model[-1]


def anchor_pixels(model) -> np.ndarray:
    """(nl, na, 2) float64 anchors in pixels, in the Detect head's level order."""
    _, detect = _detect(model)
    pixels = detect.anchors.detach().cpu().double() * detect.stride.detach().cpu().double().view(-1, 1, 1)
    return pixels.numpy()


def _plain(value: float) -> int | float:
    """A pixel value for YAML and printing: rounded to 0.1 px, an int when whole."""
    value = round(float(value), DECIMALS)
    return int(value) if value.is_integer() else value


def set_anchors(model, anchors_px) -> None:
    """Put (nl * na, 2) pixel anchors into the model: sorted by area, the smallest ``na`` to the level with
    the smallest stride and so on (in pixels), then divided by each level's stride into the Detect buffer;
    ``model.yaml["anchors"]`` gets the per-level pixel lists and the placeholder flag is cleared."""
    model, detect = _detect(model)
    anchors_px = np.round(sort_by_area(anchors_px), DECIMALS)
    if anchors_px.shape != (detect.nl * detect.na, 2):
        raise ValueError(f"{len(anchors_px)} anchors given, the model has {detect.nl} levels x {detect.na}")
    levels = np.argsort(detect.stride.cpu().numpy(), kind="stable")  # level indices, smallest stride first
    per_level = np.empty((detect.nl, detect.na, 2))
    per_level[levels] = anchors_px.reshape(detect.nl, detect.na, 2)
    with torch.no_grad():  # the same float32 arithmetic as building the model from the YAML below
        grid = torch.tensor(per_level, dtype=torch.float32) / detect.stride.cpu().float().view(-1, 1, 1)
        detect.anchors.copy_(grid.to(detect.anchors))
    model.yaml["anchors"] = [[_plain(value) for value in level.reshape(-1)] for level in per_level]
    model.anchors_placeholder = False


def adapt_anchors(model, labels, shapes, imgsz: int, thr: float = 4.0, seed: int = 0, generations: int = 1000,
                  time_limit: float = DEFAULT_TIME_LIMIT, progress: bool = True) -> AnchorReport:
    """Check the model's anchors against the training boxes at ``imgsz``; fit and adopt new ones when the
    best possible recall is not above 0.98 or the YAML gave a count, and theirs is higher. Updates the model in
    place when adopting. No boxes: nothing changes (AnchorError if the model has no real anchors)."""
    start = time.monotonic()
    model, detect = _detect(model)
    placeholder = bool(getattr(model, "anchors_placeholder", False))
    wh = label_wh(labels, shapes, imgsz, np.random.default_rng([_entropy(seed), 1]))
    if not len(wh):
        if placeholder:
            raise AnchorError(f"{model.yaml.get('yaml_file') or 'model YAML'}: 'anchors' is a count, and the "
                              "training labels have no boxes to compute anchors from; give pixel anchors")
        return _report(model, wh, None, None, False, start, "no boxes in the training labels; keeping the "
                       "model's anchors")
    current = anchor_pixels(model).reshape(-1, 2)
    before = None if placeholder else anchor_fit(current, wh, thr)
    if before is not None and before[0] > BPR_TARGET:
        return _report(model, wh, before, before, False, start,
                       f"{_fit_text(before)}: current anchors are a good fit to the dataset")
    LOGGER.info(f"{PREFIX}{'the model YAML gives an anchor count' if before is None else _fit_text(before)}; "
                f"fitting {len(current)} anchors to {len(wh)} boxes (k-means + {generations} generations)")
    exact = label_wh(labels, shapes, imgsz)  # k-means and the climb fit the exact sizes; BPR judges on the jittered
    found = np.round(evolve_anchors(exact, len(current), imgsz, thr, generations, seed, time_limit, progress),
                     DECIMALS)
    found = np.clip(found, MIN_SIDE, None)
    after = anchor_fit(found, wh, thr)
    if before is not None and after[0] <= before[0]:
        return _report(model, wh, before, before, False, start,
                       f"new anchors ({_fit_text(after)}) are not better; keeping the current ones")
    set_anchors(model, found)
    return _report(model, wh, before, after, True, start,
                   f"new anchors adopted ({_fit_text(after)}); they are saved with the model")


def _fit_text(fit: tuple[float, float]) -> str:
    return f"{fit[1]:.2f} anchors/target, {fit[0]:.3f} best possible recall (BPR)"


def _report(model, wh, before, after, adopted: bool, start: float, message: str) -> AnchorReport:
    _, detect = _detect(model)
    anchors = [[[_plain(w), _plain(h)] for w, h in level] for level in anchor_pixels(model)]
    before, after = before or (None, None), after or (None, None)
    report = AnchorReport(boxes=len(wh), bpr_before=before[0], bpr_after=after[0],
                          anchors_per_target_before=before[1], anchors_per_target_after=after[1],
                          anchors=anchors, strides=[_plain(s) for s in detect.stride.tolist()], adopted=adopted,
                          seconds=time.monotonic() - start, message=f"{PREFIX}{message}")
    LOGGER.info(report.message)
    return report


def format_anchors(model) -> str:
    """The anchors in pixels per level, one line per level, for printing at the start of a run."""
    _, detect = _detect(model)
    lines = ["Anchors (pixels, width x height) per level:"]
    for stride, level in zip(detect.stride.tolist(), anchor_pixels(model)):
        level_number = math.log2(stride) if stride > 0 else 0.5
        name = f"P{int(level_number)}/{_plain(stride)}" if level_number.is_integer() else f"stride {_plain(stride)}"
        lines.append(f"  {name:>7}: " + ", ".join(f"{_plain(w)}x{_plain(h)}" for w, h in level))
    return "\n".join(lines)


def write_anchors_yaml(model, path) -> Path | None:
    """anchors.yaml: the strides and per-level pixel anchors ``[w1, h1, w2, h2, ...]`` in the model YAML's
    layout (paste-able into one). Main process only; returns the path written, else None."""
    if not is_main_process():
        return None
    _, detect = _detect(model)
    content = {"strides": [_plain(s) for s in detect.stride.tolist()],
               "anchors": [[_plain(v) for v in level.reshape(-1)] for level in anchor_pixels(model)]}
    header = ("# Anchors in pixels per detection level, as this run uses them: [w1, h1, w2, h2, ...]\n"
              "# (same layout as a model YAML's 'anchors'; strides list each level's stride)\n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(content, default_flow_style=None, sort_keys=False), encoding="utf-8")
    return path


# YOLOv5's names, for training scripts written against it (docs/yolov5-scripts.md); the trainer calls adapt_anchors.

def check_anchors(dataset, model, thr: float = 4.0, imgsz: int = 640) -> AnchorReport:
    """YOLOv5's ``check_anchors(dataset, model, thr, imgsz)``: ``adapt_anchors`` on the boxes of ``dataset`` (its
    ``labels`` and ``shapes``: utils.dataloaders.LoadImagesAndLabels, or the project's dataset)."""
    return adapt_anchors(model, dataset.labels, dataset.shapes, imgsz, thr=thr)


def kmean_anchors(dataset="./data/coco128.yaml", n: int = 9, img_size: int = 640, thr: float = 4.0, gen: int = 1000,
                  verbose: bool = True) -> np.ndarray:
    """YOLOv5's ``kmean_anchors``: ``n`` anchors in pixels, sorted by area, for the boxes of ``dataset`` at
    ``img_size`` (a dataset YAML, whose train split is scanned and checked as train.py checks it, or a dataset with
    ``labels`` and ``shapes``): ``evolve_anchors`` over ``gen`` generations; ``verbose`` shows its progress bar."""
    if isinstance(dataset, (str, Path)):
        from utils.data.dataset_yaml import load_data_config
        from utils.data.verify import scan_split

        config = load_data_config(dataset)
        dataset = scan_split(config.split("train"), config.nc, prefix="train: ")
    wh = label_wh(dataset.labels, dataset.shapes, img_size)
    anchors = evolve_anchors(wh, n, img_size, thr, generations=gen, progress=verbose)
    bpr, per_target = anchor_fit(anchors, wh, thr)
    LOGGER.info(f"{PREFIX}thr={thr:.2f}: {bpr:.4f} best possible recall, {per_target:.2f} anchors past thr; "
                f"n={n}, img_size={img_size}: {', '.join(f'{w:.0f},{h:.0f}' for w, h in anchors)}")
    return anchors
