"""Backends made of checkpoints: test-time augmentation (``--augment``) and ensembles (``--weights a.pt b.pt``), as
YOLOv5 v7 defines them. Both return what a backend returns (``(pred, [])``, pred ``(bs, N, 5 + nc)`` in the input's
pixels) with more rows, and one NMS follows as usual. Checkpoints only: an exported file runs one fixed graph.

TTA: the batch at scales 1, 0.83 and 0.67 (the second also flipped left-right), each scaled bilinearly and padded
to a multiple of the largest stride with grey 0.447; each pass's boxes divided by its scale and the flip undone;
the full-scale pass keeps all but its largest-stride level's rows and the smallest pass all but its smallest-
stride level's rows (large objects are found at small scale and small ones at full scale); the rows concatenated.

Ensemble: every model on the same input, the rows concatenated; the models must agree on the class count (the
names are the first model's), the stride is the largest.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models.backends import Backend, BackendError, PyTorchBackend
from models.export_info import ExportInfo

SCALES = (1.0, 0.83, 0.67)
FLIPS = (None, "lr", None)
PAD_VALUE = 0.447  # YOLOv5's grey for the padded border of a scaled image


def scale_images(images: torch.Tensor, ratio: float, stride: int) -> torch.Tensor:
    """``images`` resized by ``ratio`` (bilinear) and padded right and bottom to a multiple of ``stride``."""
    if ratio == 1.0:
        return images
    height, width = images.shape[2:]
    size = (int(height * ratio), int(width * ratio))
    scaled = F.interpolate(images, size=size, mode="bilinear", align_corners=False)
    padded_h, padded_w = (math.ceil(side * ratio / stride) * stride for side in (height, width))
    return F.pad(scaled, [0, padded_w - size[1], 0, padded_h - size[0]], value=PAD_VALUE)


def level_rows(total: int, levels: int) -> list[int]:
    """Rows of each detection level (smallest stride first) in a concatenated output of ``total`` rows, each
    level having 4x the grid points of the next, as YOLOv5's P3-P5 (and P3-P6) heads have."""
    unit = total // sum(4 ** level for level in range(levels))
    return [unit * 4 ** (levels - 1 - level) for level in range(levels)]


def augmented_forward(run, images: torch.Tensor, stride: int, levels: int) -> torch.Tensor:
    """TTA (module doc) around ``run(images) -> pred``; returns the concatenated rows."""
    height, width = images.shape[2:]
    outputs = []
    for ratio, flip in zip(SCALES, FLIPS):
        batch = scale_images(images.flip(3) if flip == "lr" else images, ratio, stride)
        pred = run(batch).clone()
        pred[..., :4] /= ratio
        if flip == "lr":
            pred[..., 0] = width - pred[..., 0]
        outputs.append(pred)
    outputs[0] = outputs[0][:, :-level_rows(outputs[0].shape[1], levels)[-1]]  # full scale: no largest-stride rows
    outputs[-1] = outputs[-1][:, level_rows(outputs[-1].shape[1], levels)[0]:]  # smallest: no smallest-stride rows
    return torch.cat(outputs, 1)


def _checkpoint(backend: Backend, what: str) -> Backend:
    if not isinstance(backend, (PyTorchBackend, AugmentedBackend)):
        raise BackendError(f"{backend.path.name}: {what} works with .pt checkpoints only (an exported file runs one "
                           "fixed graph): pass the .pt")
    return backend


class AugmentedBackend(Backend):
    """``--augment``: a checkpoint's backend run with test-time augmentation."""

    kind = "pytorch"

    def __init__(self, backend: Backend):
        _checkpoint(backend, "--augment (test-time augmentation)")
        super().__init__(backend.path, backend.info, backend.device)
        self.inner = backend
        self.model = backend.model

    def forward(self, images: torch.Tensor):
        detect = self.model.model[-1]
        return augmented_forward(lambda batch: self.model(batch)[0], images, self.stride, detect.nl), []

    def anchors_text(self) -> str | None:
        return self.inner.anchors_text()


class EnsembleBackend(Backend):
    """``--weights a.pt b.pt ...``: the models' rows concatenated before one NMS."""

    kind = "pytorch"

    def __init__(self, backends: list[Backend]):
        members = [_checkpoint(backend, "an ensemble (several --weights)") for backend in backends]  # TTA: each
        first = members[0]
        for other in members[1:]:
            if other.nc != first.nc:
                raise BackendError(f"ensemble: {first.path.name} has {first.nc} classes, {other.path.name} "
                                   f"{other.nc}: the models must detect the same classes")
        info = ExportInfo(names=first.info.names, stride=max(m.stride for m in members), imgsz=None, batch=1,
                          dynamic=True, half=first.info.half, channels_last=True)
        super().__init__(first.path, info, first.device)
        self.members = torch.nn.ModuleList(members)
        self.model = first.model  # what callers read the anchors and the head from

    def forward(self, images: torch.Tensor):
        return torch.cat([member(images)[0] for member in self.members], 1), []

    def anchors_text(self) -> str | None:
        return "\n".join(filter(None, (f"{m.path.name}: {m.anchors_text()}" for m in self.members))) or None


def load_models(weights, device="cpu", half: bool = False, augment: bool = False, dnn: bool = False) -> Backend:
    """The backend for one path or several (an ensemble), each with TTA when ``augment``; ``dnn``: .onnx files on
    OpenCV's DNN module."""
    from models.backends import load_backend

    paths = [weights] if isinstance(weights, (str, bytes)) or not hasattr(weights, "__iter__") else list(weights)
    backends = [load_backend(path, device, half=half, dnn=dnn) for path in paths]
    if augment:
        backends = [AugmentedBackend(backend) for backend in backends]
    return backends[0] if len(backends) == 1 else EnsembleBackend(backends)
