"""Run setup pieces: seeding, the training model (from --cfg, --weights or a resumed checkpoint), layer
freezing, image size, the dataset YAML."""
from __future__ import annotations

import logging
import math
import os
import random

import numpy as np
import torch

from utils.config import ConfigError

LOGGER = logging.getLogger(__name__)


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        os.environ["PYTHONHASHSEED"] = str(seed)


def check_img_size(imgsz: int, stride: int, floor: int = 0) -> int:
    """Round ``imgsz`` up to a multiple of the model's largest stride, with a warning when changed."""
    new_size = max(int(math.ceil(imgsz / stride) * stride), floor)
    if new_size != imgsz:
        LOGGER.warning("--imgsz %d must be a multiple of max stride %d, updating to %d", imgsz, stride, new_size)
    return new_size


TRANSFER_WARNING = 0.5  # --weights that fill less than this share of the model's tensors get a warning


def transfer_state(model: torch.nn.Module, state_dict: dict, exclude: tuple[str, ...] = ()) -> tuple[int, int]:
    """Copy entries whose names and shapes match; return (transferred, total in model). Fewer than
    TRANSFER_WARNING of the model's tensors is a warning that names what did not fit (YOLOv5 only says
    "Transferred 0/349" and trains from scratch)."""
    own = model.state_dict()
    matched = {k: v for k, v in state_dict.items()
               if k in own and v.shape == own[k].shape and not any(x in k for x in exclude)}
    model.load_state_dict({**own, **{k: v.to(own[k].dtype) for k, v in matched.items()}})
    if len(matched) < TRANSFER_WARNING * len(own):
        missing = [k for k in own if k not in state_dict][:2]
        shapes = [f"{k} {tuple(state_dict[k].shape)} vs {tuple(own[k].shape)}" for k in own
                  if k in state_dict and state_dict[k].shape != own[k].shape][:2]
        LOGGER.warning("WARNING: --weights fit only %d of the model's %d tensors (%s); most of the model starts "
                       "from scratch: are the weights for this --cfg?", len(matched), len(own),
                       "; ".join([*(f"missing {k}" for k in missing), *(f"shape {s}" for s in shapes)]) or "-")
    return len(matched), len(own)


def build_training_model(cfg: str, weights: str, nc: int, names: list[str], anchors=None):
    """Model from --cfg (optionally initialised from --weights), or from --weights' own YAML.

    Anchors from the weights are kept unless a --cfg or a hyp ``anchors`` value asks for new ones
    (then AutoAnchor computes them).
    """
    from models.yolo import DetectionModel
    from utils.checkpoint import load_checkpoint, model_entry

    if not cfg and not weights:
        raise ConfigError("give --cfg (a model YAML such as models/yolov5n.yaml) or --weights (a .pt file)")
    if weights:
        from utils import dist
        from utils.downloads import DownloadError, weights_file

        with dist.main_process_first("download the weights"):  # a URL or a YOLOv5 release name: fetched once
            try:
                weights = str(weights_file(weights))
            except DownloadError as error:
                raise DownloadError(f"{error}; or pass --weights '' to train from scratch") from None
        entry = model_entry(load_checkpoint(weights))
        model = DetectionModel(cfg or entry["yaml"], ch=3, nc=nc, anchors=anchors)
        exclude = ("anchor",) if (cfg or anchors) else ()
        done, total = transfer_state(model, {k: v.float() for k, v in entry["state_dict"].items()}, exclude)
        LOGGER.info("Transferred %d/%d items from %s", done, total, weights)
    else:
        model = DetectionModel(cfg, ch=3, nc=nc, anchors=anchors)
    model.names = list(names)
    return model


def resumed_model(entry: dict, names: list[str], source: str):
    """The model of a resumed run: its checkpoint's YAML (anchors included) and weights."""
    from models import build_model

    model = build_model(entry, source=source)
    if len(names) != model.model[-1].nc:
        raise ConfigError(f"{source}: the model has {model.model[-1].nc} classes but the dataset now has "
                          f"{len(names)}; resume with the dataset the run was started with")
    model.names = list(names)
    return model


def freeze_layers(model: torch.nn.Module, freeze: list[int]) -> list[str]:
    """--freeze 10 freezes layers 0..9 (the backbone); --freeze 0 1 2 freezes exactly those layers."""
    indices = freeze if len(freeze) > 1 else range(freeze[0] if freeze else 0)
    prefixes = tuple(f"model.{i}." for i in indices)
    frozen = []
    for name, param in model.named_parameters():
        param.requires_grad = True
        if prefixes and name.startswith(prefixes):
            param.requires_grad = False
            frozen.append(name)
    if frozen:
        LOGGER.info("Freezing %d parameter tensors in layers %s", len(frozen), list(indices))
    return frozen


def resolve_data(data: str) -> str:
    """--data as given, or the embedded default dataset (generated on first use) when empty."""
    if data:
        return data
    from utils.data.synthetic import ensure_default_dataset

    return str(ensure_default_dataset())
