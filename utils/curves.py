"""What the P, R and F1 curves share between their computation (utils/metrics.py) and their plots (utils/plots.py):
the box filter that picks their best confidence, and the names of their classes."""
from __future__ import annotations

import numpy as np


def smooth(values: np.ndarray, fraction: float = 0.05) -> np.ndarray:
    """Box filter over ``fraction`` of the points (edges padded with the end values)."""
    width = round(len(values) * fraction * 2) // 2 + 1
    pad = np.ones(width // 2)
    padded = np.concatenate((pad * values[0], values, pad * values[-1]))
    return np.convolve(padded, np.ones(width) / width, mode="valid")


def class_names(names, classes) -> list[str]:
    """Names of ``classes`` from a list/dict of names (class ids when missing)."""
    lookup = dict(enumerate(names)) if isinstance(names, (list, tuple)) else dict(names or {})
    return [str(lookup.get(int(c), int(c))) for c in classes]
