"""labels.jpg: what a split's labels look like (instances per class, box centres, box sizes, shapes); and
labels_correlogram.jpg: how the boxes' x, y, width and height are distributed, alone and in pairs (YOLOv5's).

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend change), so it
works headless and importing this module does nothing. Callers write it from the main process only.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

LOGGER = logging.getLogger(__name__)
MAX_BOXES_DRAWN = 1000
CORRELOGRAM_COLUMNS = ("x", "y", "width", "height")  # the label columns 1-4, normalised
CORRELOGRAM_BINS = 50
CORRELOGRAM_PMAX = 0.9  # a 2-D histogram's colours top out at the count holding this share of its boxes (seaborn's pmax)


def class_colours(nc: int):
    """One RGB colour (0-1 floats) per class, cycling through matplotlib's tab10."""
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % 10)[:3] for i in range(nc)]


def plot_labels(labels: np.ndarray, names, save_dir, filename: str = "labels.jpg", seed: int = 0) -> Path:
    """Write ``save_dir/labels.jpg`` from all labels of a split, (n, 5) [class, cx, cy, w, h] normalised.

    Panels: instances per class (bar chart), a sample of boxes drawn centred at the origin (their
    shapes at a glance), box centres (x, y) as a 2-D histogram, box widths vs heights likewise.
    Returns the path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = np.asarray(labels, np.float64).reshape(-1, 5)
    names = list(names) if names is not None else []
    nc = max(len(names), int(labels[:, 0].max()) + 1 if len(labels) else 1)
    names += [str(i) for i in range(len(names), nc)]
    figure = Figure(figsize=(8, 8), tight_layout=True)
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2).ravel()
    draw_instances(axes[0], labels, names)
    draw_box_shapes(axes[1], labels, class_colours(nc), np.random.default_rng(seed))
    draw_hist2d(axes[2], labels[:, 1], labels[:, 2], "x", "y")
    draw_hist2d(axes[3], labels[:, 3], labels[:, 4], "width", "height")
    path = Path(save_dir) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=200)
    LOGGER.info("labels plot saved to %s", path)
    return path


def draw_instances(ax, labels: np.ndarray, names) -> None:
    counts = np.bincount(labels[:, 0].astype(int), minlength=len(names))
    ax.bar(range(len(names)), counts, color=class_colours(len(names)))
    ax.set_ylabel("instances")
    ax.set_title(f"{len(labels)} instances, {int((counts > 0).sum())}/{len(names)} classes present", fontsize=8)
    if len(names) <= 30:
        ax.set_xticks(range(len(names)))
        from utils.fonts import names_font

        ax.set_xticklabels(names, rotation=90, fontsize=8, fontproperties=names_font(names, 8))
    else:
        ax.set_xlabel("classes")


def draw_box_shapes(ax, labels: np.ndarray, colours, rng) -> None:
    """Up to MAX_BOXES_DRAWN boxes as outlines centred at (0.5, 0.5), coloured by class."""
    from matplotlib.collections import PolyCollection

    sample = labels if len(labels) <= MAX_BOXES_DRAWN else labels[rng.choice(len(labels), MAX_BOXES_DRAWN, False)]
    half_w, half_h = sample[:, 3] / 2, sample[:, 4] / 2
    corners = np.stack([np.stack((0.5 - half_w, 0.5 - half_h), 1), np.stack((0.5 + half_w, 0.5 - half_h), 1),
                        np.stack((0.5 + half_w, 0.5 + half_h), 1), np.stack((0.5 - half_w, 0.5 + half_h), 1)], 1)
    edge = [colours[int(c)] for c in sample[:, 0]]
    ax.add_collection(PolyCollection(corners, facecolors="none", edgecolors=edge, linewidths=0.5, alpha=0.6))
    ax.set_xlim(0, 1)
    ax.set_ylim(1, 0)
    ax.set_aspect("equal")
    ax.set_title(f"box shapes ({len(sample)} drawn)", fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])


def draw_hist2d(ax, x: np.ndarray, y: np.ndarray, xlabel: str, ylabel: str) -> None:
    ax.hist2d(x, y, bins=50, range=[[0, 1], [0, 1]], cmin=1, cmap="Blues")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)


def correlogram_histograms(labels: np.ndarray) -> tuple[list[np.ndarray], dict[tuple[int, int], np.ndarray],
                                                         dict[tuple[int, int], float]]:
    """What labels_correlogram.jpg shows, from labels (n, 5) [class, cx, cy, w, h] normalised: each column's
    histogram (CORRELOGRAM_BINS bins over [0, 1]), each pair's 2-D histogram keyed (row, column) with row > column
    (x along the column's variable, counts[i, j] for its bin i and the row's bin j), and each 2-D histogram's colour
    ceiling: the smallest count whose bins, with those of fewer boxes, hold CORRELOGRAM_PMAX of the boxes."""
    boxes = np.asarray(labels, np.float64).reshape(-1, 5)[:, 1:5]
    edges = np.linspace(0.0, 1.0, CORRELOGRAM_BINS + 1)
    single = [np.histogram(boxes[:, i], bins=edges)[0] for i in range(4)]
    pairs, ceilings = {}, {}
    for row in range(4):
        for column in range(row):
            counts = np.histogram2d(boxes[:, column], boxes[:, row], bins=(edges, edges))[0]
            pairs[row, column] = counts
            ceilings[row, column] = pmax_ceiling(counts, CORRELOGRAM_PMAX)
    return single, pairs, ceilings


def pmax_ceiling(counts: np.ndarray, share: float) -> float:
    """The smallest bin count c such that the bins of at most c boxes hold ``share`` of all boxes (1 when empty)."""
    values = np.sort(counts[counts > 0].ravel())
    if not len(values):
        return 1.0
    cumulative = np.cumsum(values)
    return float(values[min(np.searchsorted(cumulative, share * cumulative[-1]), len(values) - 1)])


def plot_label_correlogram(labels: np.ndarray, save_dir, filename: str = "labels_correlogram.jpg") -> Path:
    """Write ``save_dir/labels_correlogram.jpg``: YOLOv5's corner pair plot of the boxes' x, y, width and height
    (``correlogram_histograms``: histograms on the diagonal, 2-D histograms below it). Returns the path written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    single, pairs, ceilings = correlogram_histograms(labels)
    figure = Figure(figsize=(10, 10))  # fixed margins: tight_layout's measuring pass took a third of the time
    FigureCanvasAgg(figure)
    axes = figure.subplots(4, 4, gridspec_kw={"left": 0.07, "right": 0.985, "bottom": 0.06, "top": 0.985,
                                              "wspace": 0.22, "hspace": 0.12})
    centres = (np.arange(CORRELOGRAM_BINS) + 0.5) / CORRELOGRAM_BINS
    for row in range(4):
        for column in range(4):
            ax = axes[row, column]
            if column > row:
                ax.set_visible(False)
                continue
            if column == row:
                ax.bar(centres, single[row], width=1 / CORRELOGRAM_BINS, color="#4c72b0")
            else:
                ax.imshow(np.ma.masked_equal(pairs[row, column].T, 0), origin="lower", extent=(0, 1, 0, 1),
                          aspect="auto", cmap="Blues", vmin=0, vmax=ceilings[row, column], interpolation="nearest")
            ax.set_xlim(0, 1)
            if row == 3:
                ax.set_xlabel(CORRELOGRAM_COLUMNS[column])
            if column == 0:
                ax.set_ylabel(CORRELOGRAM_COLUMNS[row])
    path = Path(save_dir) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=200)
    return path
