"""YOLOv5's ``model(images, augment=..., profile=..., visualize=...)`` options of DetectionModel.forward, for scripts
written against YOLOv5 (docs/yolov5-scripts.md); the plain ``model(images)`` never comes here.

- ``augment``: test-time augmentation (models/composite.py, as detect.py --augment): ``(pred, None)``;
- ``profile``: each layer's forward time, parameters and type logged (python models/yolo.py --line-profile's table);
- ``visualize``: a folder, which receives each layer's feature maps (utils/feature_maps.py, as detect.py
  --visualize).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

LOGGER = logging.getLogger(__name__)


def forward_with(model, images: torch.Tensor, augment: bool, profile: bool, visualize):
    from models.composite import augmented_forward

    if profile:
        from models.model_cli import line_profile

        training = model.training
        try:
            for line in line_profile(model, images):
                LOGGER.info(line)
        finally:
            model.train(training)
    if visualize:
        from utils.feature_maps import LayerOutputs, save_feature_maps

        with LayerOutputs(model) as outputs:
            result = _run(model, images, augment, augmented_forward)
        folder = Path(visualize)
        folder.mkdir(parents=True, exist_ok=True)
        save_feature_maps(outputs.maps, folder)
        return result
    return _run(model, images, augment, augmented_forward)


def _run(model, images, augment: bool, augmented_forward):
    if not augment:
        return model(images)
    if model.training:
        raise ValueError("augment=True (test-time augmentation) is for inference: call model.eval() first")
    detect = model.model[-1]
    return augmented_forward(lambda batch: model(batch)[0], images, int(model.stride.max()), detect.nl), None
