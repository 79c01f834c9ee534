"""detect.py --visualize: each layer's output for an image, as YOLOv5 saves it.

For every layer of the model but the Detect head whose output is a map (height and width above 1), the first
``MAX_CHANNELS`` channels are drawn side by side, 8 a row (viridis, each channel scaled to its own range, as
YOLOv5's matplotlib figure shows them), as ``stage{i}_{Type}_features.png`` (``i`` the layer's
index in the model YAML, ``Type`` its class, e.g. ``stage2_C3_features.png``), and the whole map (channels, height,
width; float32) is saved beside it as the ``.npy`` file of the same name. detect.py gives each image (each video
frame) its own folder in the run folder, named after it. Only a checkpoint's own model has layers to hook: exported
files, ensembles and ``--augment`` are not visualized (detect.py says so once).

The grid is drawn with OpenCV: matplotlib's figures took ~0.2 s a layer, ~5 s an image for yolov5s.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

LOGGER = logging.getLogger("detect")
MAX_CHANNELS = 32  # channels drawn per layer (YOLOv5's n=32)
PER_ROW = 8  # channels a row, as YOLOv5's figure
TILE_PIXELS = 64  # a smaller map is enlarged to at least this on its long side
GAP = 2  # white pixels between channels


class LayerOutputs:
    """``with LayerOutputs(model) as outputs: model(images)`` -> ``outputs.maps``: (layer index, class name, the first
    image's output) for each layer of ``model.model`` but the last (the Detect head), in order."""

    def __init__(self, model: nn.Module):
        self.layers = list(model.model)[:-1]
        self.maps: list[tuple[int, str, torch.Tensor]] = []
        self._hooks = []

    def __enter__(self) -> "LayerOutputs":
        for index, layer in enumerate(self.layers):
            self._hooks.append(layer.register_forward_hook(self._hook(index, type(layer).__name__)))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _hook(self, index: int, name: str):
        def keep(module, inputs, output):
            if isinstance(output, torch.Tensor) and output.dim() == 4:
                self.maps.append((index, name, output[0].detach().float().cpu()))
        return keep


def channel_grid(feature: torch.Tensor, shown: int) -> np.ndarray:
    """The first ``shown`` channels of ``feature`` (channels, height, width) as one BGR image: each channel scaled to
    its own range (as matplotlib's imshow scales an image) and coloured with viridis, small maps enlarged (nearest)
    to at least TILE_PIXELS on their long side, PER_ROW a row on white with GAP pixels between them."""
    import cv2

    tiles = feature[:shown].numpy().astype(np.float64)
    low, high = tiles.min(axis=(1, 2), keepdims=True), tiles.max(axis=(1, 2), keepdims=True)
    grey = np.round((tiles - low) / np.where(high > low, high - low, 1.0) * 255).astype(np.uint8)
    height, width = grey.shape[1:]
    scale = max(1, math.ceil(TILE_PIXELS / max(height, width)))
    height, width = height * scale, width * scale
    rows, columns = math.ceil(shown / PER_ROW), min(shown, PER_ROW)
    grid = np.full((rows * (height + GAP) - GAP, columns * (width + GAP) - GAP, 3), 255, np.uint8)
    for index, channel in enumerate(grey):
        tile = cv2.applyColorMap(np.kron(channel, np.ones((scale, scale), np.uint8)), cv2.COLORMAP_VIRIDIS)
        top, left = (index // PER_ROW) * (height + GAP), (index % PER_ROW) * (width + GAP)
        grid[top:top + height, left:left + width] = tile
    return grid


def save_feature_maps(maps, folder: Path) -> list[Path]:
    """Write each map of ``maps`` (LayerOutputs.maps) whose height and width exceed 1 into ``folder``: the PNG of its
    first channels (``channel_grid``) and the .npy of all of them. Returns the PNG paths."""
    import cv2

    written = []
    for index, name, feature in maps:
        channels, height, width = feature.shape
        if height <= 1 or width <= 1:
            continue
        path = Path(folder) / f"stage{index}_{name}_features.png"
        shown = min(MAX_CHANNELS, channels)
        if not cv2.imwrite(str(path), channel_grid(feature, shown)):
            LOGGER.warning("WARNING: could not write %s", path)
            continue
        np.save(path.with_suffix(".npy"), feature.numpy())
        LOGGER.info("Saving %s... (%d/%d)", path, shown, channels)
        written.append(path)
    return written
