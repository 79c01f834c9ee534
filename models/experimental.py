"""YOLOv5's ``models.experimental.attempt_load`` and ``Ensemble``, for scripts written against YOLOv5
(docs/yolov5-scripts.md). Checkpoints load through models.load_model (every file checked before it is read; a YOLOv5
release name or a URL is downloaded first)."""
from __future__ import annotations

import torch
from torch import nn


class Ensemble(nn.ModuleList):
    """Several models whose predictions are concatenated before one NMS: ``(pred, None)``."""

    def forward(self, x, augment: bool = False, profile: bool = False, visualize=False):
        return torch.cat([module(x, augment, profile, visualize)[0] for module in self], 1), None


def attempt_load(weights, device=None, inplace: bool = True, fuse: bool = True):
    """A checkpoint (its EMA weights when present) as an eval-mode float32 DetectionModel on ``device``, BatchNorm
    fused when ``fuse``, ``names`` as {index: name} (YOLOv5 v7); a list of several: an ``Ensemble`` with the first's
    names, nc and yaml, and the largest stride. ``inplace`` is accepted (the heads here never write in place)."""
    from models import load_model
    from models.backends import BackendError
    from models.multibackend import as_device, weights_path

    models = Ensemble()
    for given in (weights if isinstance(weights, (list, tuple)) else [weights]):
        model = load_model(weights_path(given), as_device("cpu" if device is None else device))
        model.names = dict(enumerate(model.names))
        models.append(model.fuse().eval() if fuse else model.eval())
    if len(models) == 1:
        return models[-1]
    first = models[0]
    different = next((model for model in models if model.model[-1].nc != first.model[-1].nc), None)
    if different is not None:
        raise BackendError(f"ensemble: the models must detect the same classes ({first.model[-1].nc} and "
                           f"{different.model[-1].nc})")
    models.names, models.nc, models.yaml = first.names, first.model[-1].nc, first.yaml
    models.stride = max((model.stride for model in models), key=lambda stride: float(stride.max()))
    return models
