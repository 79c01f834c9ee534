"""Typed configuration: hyperparameters (flat hyp YAML) and the training run config.

``Hyp`` mirrors YOLOv5's hyp YAML keys one to one; loading rejects unknown and missing keys so a
typo never silently falls back to a default. Derived values live in small pure functions elsewhere
(``utils.trainer.optim``, ``utils.loss.loss_gains``) and never mutate a Hyp.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from utils.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
HYP_DIR = ROOT / "data" / "hyps"


class ConfigError(UserError):
    """A configuration file or value that cannot be used; the message names the file and key."""


@dataclass(frozen=True)
class Hyp:
    lr0: float = 0.01
    lrf: float = 0.01
    momentum: float = 0.937
    weight_decay: float = 0.0005
    warmup_epochs: float = 3.0
    warmup_momentum: float = 0.8
    warmup_bias_lr: float = 0.1
    box: float = 0.05
    cls: float = 0.5
    cls_pw: float = 1.0
    obj: float = 1.0
    obj_pw: float = 1.0
    iou_t: float = 0.2
    anchor_t: float = 4.0
    fl_gamma: float = 0.0
    hsv_h: float = 0.015
    hsv_s: float = 0.7
    hsv_v: float = 0.4
    degrees: float = 0.0
    translate: float = 0.1
    scale: float = 0.5
    shear: float = 0.0
    perspective: float = 0.0
    flipud: float = 0.0
    fliplr: float = 0.5
    mosaic: float = 1.0
    mixup: float = 0.0
    copy_paste: float = 0.0
    anchors: float | None = None  # optional: anchors per level (evolved when present)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "<dict>") -> "Hyp":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown hyperparameter(s) {', '.join(unknown)}")
        required = {f.name for f in fields(cls) if f.name != "anchors"}
        missing = sorted(required - set(values))
        if missing:
            raise ConfigError(f"{source}: missing hyperparameter(s) {', '.join(missing)}")
        parsed = {}
        for key, value in values.items():
            if value is None and key == "anchors":
                parsed[key] = None
                continue
            try:
                parsed[key] = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{source}: hyperparameter '{key}' must be a number, got {value!r}") from None
        return cls(**parsed)

    @classmethod
    def load(cls, path: str | Path) -> "Hyp":
        path = resolve_hyp_path(path)
        try:
            with open(path, encoding="utf-8") as f:
                values = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"{path}: cannot read hyperparameter file ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping of hyperparameters")
        return cls.from_dict(values, source=str(path))

    def to_dict(self) -> dict[str, float]:
        values = dataclasses.asdict(self)
        if values["anchors"] is None:
            del values["anchors"]
        return values

    def replace(self, **changes) -> "Hyp":
        return dataclasses.replace(self, **changes)


def resolve_hyp_path(path: str | Path) -> Path:
    """A hyp path as given, or a bare name found in data/hyps (``hyp.scratch-low.yaml``)."""
    path = Path(path)
    if path.exists():
        return path
    for candidate in (HYP_DIR / path.name, HYP_DIR / f"{path.name}.yaml"):
        if candidate.exists():
            return candidate
    raise ConfigError(f"{path}: hyperparameter file not found (also looked in {HYP_DIR})")


@dataclass
class TrainConfig:
    """Everything one training run needs; saved as opt.yaml and inside checkpoints (plain data)."""
    weights: str = ""
    cfg: str = ""
    data: str = ""
    hyp: str = "data/hyps/hyp.scratch-low.yaml"
    epochs: int = 100
    batch_size: int = 16
    imgsz: int = 640
    rect: bool = False
    resume: str | bool = False
    nosave: bool = False
    noval: bool = False
    noautoanchor: bool = False
    noplots: bool = False
    evolve: int | None = None
    cache: str | None = "auto"  # ram, disk, auto (RAM for small datasets), off / None
    image_weights: bool = False
    device: str = ""
    multi_scale: bool = False
    single_cls: bool = False
    optimizer: str = "SGD"
    sync_bn: bool = False
    workers: int = 8
    project: str = "runs/train"
    name: str = "exp"
    exist_ok: bool = False
    quad: bool = False
    cos_lr: bool = False
    label_smoothing: float = 0.0
    patience: int = 100
    freeze: list[int] = field(default_factory=lambda: [0])
    save_period: int = -1
    save_every_min: float = 10.0  # also save last.pt mid-epoch every this many minutes (0: only at epoch ends)
    seed: int = 0
    local_rank: int = -1
    deterministic: bool = False
    amp: str = "auto"  # auto (fp16 on CUDA, fp32 on CPU), bf16 (CPU or CUDA), off
    channels_last: str = "auto"
    save_dir: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})
