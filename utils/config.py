"""Typed configuration: hyperparameters (flat hyp YAML) and the training run config.

``Hyp`` mirrors YOLOv5's hyp YAML keys one to one; loading rejects unknown and missing keys so a
typo never silently falls back to a default, and values outside ``HYP_RANGES`` (NaN, a negative
learning rate, a probability above 1) so a bad file stops before training instead of training to NaN.
Derived values live in small pure functions elsewhere (``utils.trainer.optim``,
``utils.loss.loss_gains``) and never mutate a Hyp.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from utils import cli
from utils.errors import UserError, shorten
from utils.limits import MAX_OPTION_ITEMS, MAX_OPTION_TEXT, Range
from utils.safe_yaml import read_yaml, yaml_reason

ROOT = Path(__file__).resolve().parents[1]
HYP_DIR = ROOT / "data" / "hyps"


class ConfigError(UserError):
    """A configuration file or value that cannot be used; the message names the file and key."""


UNIT = Range(0, 1)
# Accepted values per hyp key: what keeps training well defined, far wider than YOLOv5's evolution
# search ranges (e.g. lr0 1e-5..0.1). Probabilities and HSV gains are fractions.
HYP_RANGES = {
    "lr0": Range(0, 10, low_open=True),  # the initial learning rate must be positive
    "lrf": UNIT,  # final learning rate as a fraction of lr0
    "momentum": Range(0, 1, high_open=True),  # SGD momentum / Adam beta1: 1 or more diverges
    "weight_decay": Range(0, 1, high_open=True),
    "warmup_epochs": Range(0, 1000),
    "warmup_momentum": Range(0, 1, high_open=True),
    "warmup_bias_lr": Range(0, 10),
    "box": Range(0, 1000), "cls": Range(0, 1000), "obj": Range(0, 1000),  # loss gains
    "cls_pw": Range(0, 1000, low_open=True), "obj_pw": Range(0, 1000, low_open=True),  # BCE positive weights
    "iou_t": UNIT,
    "anchor_t": Range(1, 100),  # target/anchor size ratio: below 1 nothing matches
    "fl_gamma": Range(0, 10),
    "hsv_h": UNIT, "hsv_s": UNIT, "hsv_v": UNIT,
    "degrees": Range(0, 180),
    "translate": UNIT,
    "scale": Range(0, 1, high_open=True),  # the scale gain is drawn from [1 - scale, 1 + scale]
    "shear": Range(0, 45),  # degrees
    "perspective": Range(0, 0.01),
    "flipud": UNIT, "fliplr": UNIT, "mosaic": UNIT, "mixup": UNIT, "copy_paste": UNIT,
    "anchors": Range(1, 16),  # anchors per output level
}


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
        unknown = [key for key in values if key not in known]
        if unknown:
            listed = ", ".join(shorten(key, 40).strip("'") for key in unknown[:10])
            raise ConfigError(f"{source}: unknown hyperparameter(s) {listed}{', ...' * (len(unknown) > 10)}")
        required = {f.name for f in fields(cls) if f.name != "anchors"}
        missing = sorted(required - set(values))
        if missing:
            raise ConfigError(f"{source}: missing hyperparameter(s) {', '.join(missing)}")
        parsed = {key: _hyp_value(key, value, source) for key, value in values.items()}
        return cls(**parsed)

    @classmethod
    def load(cls, path: str | Path) -> "Hyp":
        path = resolve_hyp_path(path)
        try:
            values = read_yaml(path)
        except OSError as e:
            raise ConfigError(f"{path}: cannot read hyperparameter file ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML ({yaml_reason(e)})") from None
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


def _hyp_value(key: str, value, source: str) -> float | None:
    """``value`` as a float within HYP_RANGES[key] (numeric strings accepted, as YAML 1.1 reads 1e-3)."""
    if value is None and key == "anchors":
        return None
    number = None
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None:
        raise ConfigError(f"{source}: hyperparameter '{key}' must be a number, got {shorten(value)}")
    allowed = HYP_RANGES[key]
    if number not in allowed:
        raise ConfigError(f"{source}: hyperparameter '{key}' must be a finite number in {allowed}, "
                          f"got {shorten(value)}")
    return number


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
    batch_size: int = 16  # -1 (AutoBatch) is replaced by the chosen batch before the run is saved
    nbs: int = 64  # nominal batch: gradients of about this many images per optimizer step (YOLOv5: always 64)
    imgsz: int = 640
    rect: bool = False
    resume: str | bool = False
    nosave: bool = False
    noval: bool = False
    noautoanchor: bool = False
    noplots: bool = False
    evolve: int | None = None
    cache: str | None = "auto"  # ram, disk, auto (RAM when memory is to spare), off / None
    image_weights: bool = False
    mosaic_partners: str = "dataset"  # dataset (YOLOv5's) or batch: where a mosaic's other images come from
    augment_device: bool = False  # --augment-device: the augmentation's pixel work on the training device
    decode_device: bool = False  # --decode-device: with --augment-device, uncached JPEGs decoded on the device too
    cuda_graphs: bool = False  # --cuda-graphs: the model's forward and backward replayed as CUDA graphs
    compile: bool = False  # --compile: the model's forward and backward compiled by torch.compile (CUDA)
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
    time: float | None = None  # --time HOURS: training time budget; sets the epoch count after the first epoch
    tensorboard: bool = True  # --no-tensorboard turns it off
    ndjson_console: bool = False  # YOLOv5's --ndjson-console: each results row as a JSON line on stdout
    ndjson_file: bool = False  # YOLOv5's --ndjson-file: the same lines in results.ndjson
    trackers: bool = True  # --no-trackers: log to no experiment tracker (utils.trackers)
    entity: str | None = None  # YOLOv5's W&B options, accepted (docs/trackers.md: what each tracker does with them)
    upload_dataset: bool | str = False
    bbox_interval: int = -1
    artifact_alias: str = "latest"
    save_dir: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The options as plain data, for opt.yaml, checkpoints and trackers: a URL's credentials
        (``https://user:token@host/...``) are left out (``***@``), as everywhere a URL is shown."""
        from utils.downloads import without_credentials

        return {key: without_credentials(value) for key, value in dataclasses.asdict(self).items()}

    @classmethod
    def from_stored(cls, values: dict[str, Any], source: str = "<dict>") -> "TrainConfig":
        """``from_dict`` for the options a run was saved with: an option added since takes the value that run had
        in effect (``STORED_DEFAULTS``), not today's default, so a resumed run goes on as it began."""
        return cls.from_dict({**STORED_DEFAULTS, **values}, source)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "<dict>") -> "TrainConfig":
        """A config from plain data (parsed flags, or the options stored in a checkpoint): every option is
        checked with the bound its flag has (``OPTION_RULES``, built from utils.cli's validators), so a file
        cannot bring a value the command line refuses. Unknown keys are ignored; a bad value is a
        ConfigError naming ``source`` and the option."""
        known = {f.name for f in fields(cls)}
        checked = {key: _option_value(key, value, source) for key, value in values.items() if key in known}
        return cls(**checked)


def _option_value(key: str, value, source: str):
    rule = OPTION_RULES.get(key, _plain_option)
    try:
        return rule(value)
    except ValueError as error:
        raise ConfigError(f"{source}: option '{key}': {error}") from None


def _text(value) -> str:
    if not isinstance(value, str) or len(value) > MAX_OPTION_TEXT:
        raise ValueError(f"expected text of at most {MAX_OPTION_TEXT} characters, got {shorten(value, 40)}")
    return value


def _flag(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {shorten(value, 40)}")
    return value


def _one_of(*choices):
    def check(value):
        if not any(value is choice or type(value) is type(choice) and value == choice for choice in choices):
            listed = ", ".join(str(choice) for choice in choices)
            raise ValueError(f"expected one of {listed}, got {shorten(value, 40)}")
        return value
    return check


def _optional(rule):
    return lambda value: None if value is None else rule(value)


def _list_of(rule):
    def check(value):
        if not isinstance(value, (list, tuple)) or len(value) > MAX_OPTION_ITEMS:
            raise ValueError(f"expected a list of at most {MAX_OPTION_ITEMS} items, got {shorten(value, 40)}")
        return [rule(item) for item in value]
    return check


def _resume_option(value):
    return value if isinstance(value, bool) else _text(value)


def _plain_option(value):
    """An option without its own rule (keep OPTION_RULES complete): a plain bounded scalar."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, int) and abs(value) <= 2 ** 63 or isinstance(value, float) and math.isfinite(value):
        return value
    raise ValueError(f"expected a number, text, true/false or null, got {shorten(value, 40)}")


TIME_HOURS = cli.float_in_range(Range(0, 10 ** 6, low_open=True))  # train.py --time (hours)

# Options added (or whose default changed) after runs were first saved: the value a stored config without them ran
# with. mosaic_partners: runs saved before the option existed drew from the whole split (whatever today's default).
STORED_DEFAULTS = {"mosaic_partners": "dataset", "augment_device": False, "decode_device": False, "cuda_graphs": False,
                   "compile": False, "ndjson_console": False, "ndjson_file": False}

# The bound of every TrainConfig field: the flag's own validator (utils.cli), applied to stored values too.
OPTION_RULES = {
    **dict.fromkeys(("weights", "cfg", "data", "hyp", "device", "project", "name", "save_dir"), _text),
    **dict.fromkeys(("rect", "nosave", "noval", "noautoanchor", "noplots", "image_weights", "multi_scale",
                     "single_cls", "sync_bn", "exist_ok", "quad", "cos_lr", "deterministic", "augment_device",
                     "decode_device", "cuda_graphs", "compile"), _flag),
    "epochs": cli.positive_int.check,
    "batch_size": cli.train_batch_size.check,
    "nbs": cli.nominal_batch.check,
    "imgsz": cli.image_size.check,
    "resume": _resume_option,
    "evolve": _optional(cli.positive_int.check),
    "cache": _one_of(*cli.CACHE_MODES, None),
    "mosaic_partners": _one_of(*cli.MOSAIC_PARTNERS),
    "optimizer": _one_of(*cli.OPTIMIZER_NAMES),
    "workers": cli.workers.check,
    "label_smoothing": cli.label_smoothing.check,
    "patience": cli.non_negative_int.check,
    "freeze": _list_of(cli.freeze_layer.check),
    "save_period": cli.save_period.check,
    "save_every_min": cli.save_every_min.check,
    "seed": cli.non_negative_int.check,
    "local_rank": cli.local_rank.check,
    "amp": _one_of(*cli.TRAIN_AMP_MODES),
    "channels_last": _one_of(*cli.CHANNELS_LAST_MODES),
    "time": _optional(TIME_HOURS.check),
    "tensorboard": _flag,
    "ndjson_console": _flag,
    "ndjson_file": _flag,
    "trackers": _flag,
    "entity": _optional(_text),
    "upload_dataset": lambda value: value if isinstance(value, bool) else _text(value),
    "bbox_interval": cli.bbox_interval.check,
    "artifact_alias": _text,
}
