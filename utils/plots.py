"""Metric plots: PR / F1 / P / R curves, the confusion matrix and results.png from results.csv; the names of
the plot files a run shows in TensorBoard.

Each plot is a ``matplotlib.figure.Figure`` on its own Agg canvas, never pyplot: no global backend is
switched and no figure joins pyplot's list, so a caller's backend (a notebook's) and open figures stay as
they were, and plotting in a headless process or a worker thread never touches a display. Matplotlib is
imported inside the functions, so importing this module does not import it.

For scripts written against YOLOv5 (docs/yolov5-scripts.md), YOLOv5's ``Annotator``, ``colors``,
``save_one_box``, v5's ``plot_one_box``, and ``plot_images``, ``output_to_target`` and ``plot_labels`` are here too,
with YOLOv5's signatures (utils/drawing.py and utils/data/plots.py draw them).
"""
from __future__ import annotations

import csv
import logging
from pathlib import Path

import numpy as np

from utils.data.plots import plot_labels  # noqa: F401  (YOLOv5's names, for scripts written against it)
from utils.drawing import Annotator, colors, output_to_target, plot_images  # noqa: F401
from utils.drawing import draw_box_label
from utils.drawing import save_one_box as _save_one_box
from utils.fonts import names_font
from utils.curves import class_names, smooth

LOGGER = logging.getLogger(__name__)

# results.csv columns drawn in results.png (YOLOv5's order): train losses, P, R, val losses, mAPs
RESULTS_COLUMNS = ("train/box_loss", "train/obj_loss", "train/cls_loss", "metrics/precision", "metrics/recall",
                   "val/box_loss", "val/obj_loss", "val/cls_loss", "metrics/mAP_0.5", "metrics/mAP_0.5:0.95")

# Plot files a run writes that TensorBoard shows as images (tags: the names without suffix)
TRAIN_BATCH_PLOTS = ("train_batch0.jpg", "train_batch1.jpg", "train_batch2.jpg")  # the first epoch's mosaics
FINAL_PLOTS = ("results.png", "confusion_matrix.png", "PR_curve.png", "F1_curve.png", "P_curve.png", "R_curve.png",
               *(f"val_batch{i}_{kind}.jpg" for i in range(3) for kind in ("labels", "pred")))  # at the end


def existing_plots(save_dir, names) -> list[Path]:
    """The files among ``names`` that exist in ``save_dir`` (a small dataset plots fewer batches), in order."""
    return [Path(save_dir) / name for name in names if (Path(save_dir) / name).is_file()]


def new_figure(rows: int, columns: int, figsize: tuple[float, float]):
    """(figure, axes) on a private Agg canvas: ``axes`` one Axes for 1 x 1, else an array of them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, tight_layout=True)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, columns)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=200)
    return path


def plot_pr_curve(px, py, ap, save_path, names=()) -> Path:
    """Precision-recall curve per class (legend with AP@0.5 when < 21 classes) and their mean."""
    fig, ax = new_figure(1, 1, figsize=(9, 6))
    py, ap = np.asarray(py), np.asarray(ap)
    if 0 < len(names) < 21:
        for i, curve in enumerate(py):
            ax.plot(px, curve, linewidth=1, label=f"{names[i]} {ap[i, 0]:.3f}")
    else:
        ax.plot(px, py.T, linewidth=1, color="grey")
    if len(py):
        ax.plot(px, py.mean(0), linewidth=3, color="blue", label=f"all classes {ap[:, 0].mean():.3f} mAP@0.5")
    ax.set_xlabel("Recall")
    ax.set_ylabel("Precision")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(bbox_to_anchor=(1.04, 1), loc="upper left", prop=names_font(names))
    ax.set_title("Precision-Recall Curve")
    return _save(fig, save_path)


def plot_mc_curve(px, py, save_path, names=(), xlabel: str = "Confidence", ylabel: str = "Metric") -> Path:
    """A metric against confidence per class, plus the smoothed class mean with its best point."""
    fig, ax = new_figure(1, 1, figsize=(9, 6))
    py = np.asarray(py)
    if 0 < len(names) < 21:
        for i, curve in enumerate(py):
            ax.plot(px, curve, linewidth=1, label=f"{names[i]}")
    else:
        ax.plot(px, py.T, linewidth=1, color="grey")
    if len(py):
        mean = smooth(py.mean(0), 0.05)
        best = int(mean.argmax())
        ax.plot(px, mean, linewidth=3, color="blue", label=f"all classes {mean[best]:.2f} at {px[best]:.3f}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(bbox_to_anchor=(1.04, 1), loc="upper left", prop=names_font(names))
    ax.set_title(f"{ylabel}-{xlabel} Curve")
    return _save(fig, save_path)


def plot_confusion_matrix(matrix, save_path, names=(), normalize: bool = True) -> Path:
    """Heatmap of a [predicted, true] count matrix with a trailing background row/column.

    Columns are normalised to sum to 1 (fractions of each true class); cells below 0.005 are left blank.
    Class names label the axes below 99 classes (smaller from 50 on) and the cells hold their values below 30
    classes, as YOLOv5's plot.
    """
    matrix = np.asarray(matrix, dtype=float)
    size = matrix.shape[0]
    values = matrix / (matrix.sum(0, keepdims=True) + 1e-9) if normalize else matrix.copy()
    values[values < 0.005] = np.nan
    labelled = 0 < len(names) == size - 1 and len(names) < 99
    ticks = list(names) + ["background"] if labelled else None
    fig, ax = new_figure(1, 1, figsize=(12, 9))
    image = ax.imshow(values, cmap="Blues", vmin=0.0, vmax=1.0 if normalize else None)
    fig.colorbar(image, ax=ax)
    if size < 31:
        for (row, col), value in np.ndenumerate(values):
            if not np.isnan(value):
                text = f"{value:.2f}" if normalize else f"{int(value)}"
                ax.text(col, row, text, ha="center", va="center", fontsize=8,
                        color="white" if normalize and value > 0.5 else "black")
    if ticks:
        fontsize = 10 if size <= 50 else 6  # COCO's 80 names stay apart at 6 points on 9 inches
        font = names_font(ticks, fontsize)
        ax.set_xticks(range(size), ticks, rotation=90, fontsize=fontsize, fontproperties=font)
        ax.set_yticks(range(size), ticks, fontsize=fontsize, fontproperties=font)
    ax.set_xlabel("True")
    ax.set_ylabel("Predicted")
    ax.set_title("Confusion Matrix")
    return _save(fig, save_path)


def gaussian_smooth(values: np.ndarray, sigma: float = 3.0) -> np.ndarray:
    """1-D Gaussian filter with reflected edges (like scipy's gaussian_filter1d, without scipy)."""
    values = np.asarray(values, dtype=float)
    radius = int(4 * sigma + 0.5)
    if len(values) < 2 or radius == 0:
        return values
    kernel = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    kernel /= kernel.sum()
    padded = np.pad(values, radius, mode="symmetric" if len(values) > radius else "edge")
    return np.convolve(padded, kernel, mode="valid")


def read_results_csv(path) -> dict[str, np.ndarray]:
    """results.csv -> {column name (stripped): float array}; non-numbers become NaN."""
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    if not rows:
        return {}
    header = [name.strip() for name in rows[0]]
    columns = {name: [] for name in header}
    for row in rows[1:]:
        for name, cell in zip(header, row):
            try:
                columns[name].append(float(cell))
            except ValueError:
                columns[name].append(np.nan)
    return {name: np.asarray(values) for name, values in columns.items()}


def plot_results(file="results.csv", save_path=None) -> Path:
    """results.png beside ``file``: 2 x 5 panels (train losses, P, R, val losses, mAPs), points + smoothed line."""
    file = Path(file)
    data = read_results_csv(file)
    epochs = data.get("epoch")
    fig, axes = new_figure(2, 5, figsize=(12, 6))
    for ax, column in zip(axes.ravel(), RESULTS_COLUMNS):
        values = data.get(column)
        if values is not None and len(values):
            x = epochs if epochs is not None else np.arange(len(values))
            ax.plot(x, values, marker=".", label=file.parent.name, linewidth=2, markersize=8)
            finite = np.isfinite(values)
            if finite.sum() > 1:
                ax.plot(x[finite], gaussian_smooth(values[finite]), ":", label="smooth", linewidth=2)
        ax.set_title(column, fontsize=12)
    axes.ravel()[1].legend()
    return _save(fig, save_path or file.with_name("results.png"))


STUDY_COLUMNS = ("P", "R", "mAP50", "mAP50-95", "", "", "", "pre-process ms", "inference ms", "NMS ms")  # study_*.txt


def plot_val_study(save_dir, sizes) -> Path:
    """study.png (val.py --task study): mAP50-95 against inference time per image, one curve per study_*.txt in
    ``save_dir`` (its rows: one per image size of ``sizes``, STUDY_COLUMNS), each point labelled with its size."""
    fig, ax = new_figure(1, 1, figsize=(8, 4))
    inference, map50_95 = STUDY_COLUMNS.index("inference ms"), STUDY_COLUMNS.index("mAP50-95")
    for file in sorted(Path(save_dir).glob("study_*.txt")):
        rows = np.loadtxt(file, dtype=np.float64, ndmin=2)
        x, y = rows[:, inference], rows[:, map50_95] * 100
        ax.plot(x, y, ".-", linewidth=2, markersize=8, label=file.stem.removeprefix("study_"))
        for size, px, py in zip(sizes, x, y):
            ax.annotate(str(size), (px, py), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.grid(alpha=0.2)
    ax.set_xlabel("Inference (ms/img)")
    ax.set_ylabel("mAP50-95 (%)")
    ax.legend(loc="best")
    return _save(fig, Path(save_dir) / "study.png")


def plot_ap_curves(result, save_dir: Path, names=None, prefix: str = "") -> None:
    """PR_curve.png, F1_curve.png, P_curve.png, R_curve.png for an ``ap_per_class`` result (utils.metrics.APResult)."""
    if not len(result.classes):
        return
    save_dir = Path(save_dir)
    names = class_names(names, result.classes)
    plot_pr_curve(result.px, result.pr_curve, result.ap, save_dir / f"{prefix}PR_curve.png", names)
    plot_mc_curve(result.px, result.f1_curve, save_dir / f"{prefix}F1_curve.png", names, ylabel="F1")
    plot_mc_curve(result.px, result.p_curve, save_dir / f"{prefix}P_curve.png", names, ylabel="Precision")
    plot_mc_curve(result.px, result.r_curve, save_dir / f"{prefix}R_curve.png", names, ylabel="Recall")


def save_one_box(xyxy, im: np.ndarray, file=Path("im.jpg"), gain: float = 1.02, pad: int = 10, square: bool = False,
                 BGR: bool = False, save: bool = True) -> np.ndarray:
    """YOLOv5's crop of a box from BGR ``im``, grown by ``gain`` and ``pad`` px (optionally squared), saved under a
    new name when ``save`` (``crop.jpg``, ``crop2.jpg``, ...); returns the crop, in BGR with ``BGR=True``, else RGB."""
    crop = _save_one_box(xyxy, im, file, gain, pad, square, save)
    return crop if BGR else crop[..., ::-1]


def plot_one_box(x, im: np.ndarray, color=None, label=None, line_thickness: int = 3) -> None:
    """YOLOv5 v5's drawing of one box ``x`` (x1, y1, x2, y2) with an optional label on BGR ``im``, in place;
    ``color`` defaults to grey (YOLOv5 drew a random colour from Python's global generator, which this leaves as it
    is)."""
    draw_box_label(im, x, label, color if color is not None else (128, 128, 128), line_thickness, (225, 255, 255))
