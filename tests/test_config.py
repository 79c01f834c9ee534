from pathlib import Path

import pytest

from utils.config import ConfigError, Hyp, TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["scratch-low", "scratch-med", "scratch-high", "no-augmentation"])
def test_shipped_hyps_load(name):
    hyp = Hyp.load(ROOT / f"data/hyps/hyp.{name}.yaml")
    assert hyp.lr0 == 0.01 and hyp.anchor_t == 4.0


def test_preset_values_match_yolov5():
    low, high = Hyp.load("hyp.scratch-low.yaml"), Hyp.load("hyp.scratch-high.yaml")
    assert (low.lrf, low.cls, low.obj, low.scale, low.mixup) == (0.01, 0.5, 1.0, 0.5, 0.0)
    assert (high.lrf, high.cls, high.obj, high.scale, high.mixup, high.copy_paste) == (0.1, 0.3, 0.7, 0.9, 0.1, 0.1)


def test_unknown_and_missing_keys_are_errors(tmp_path):
    values = Hyp().to_dict()
    bad = tmp_path / "typo.yaml"
    bad.write_text("\n".join(f"{k}: {v}" for k, v in values.items()) + "\nlr_0: 0.1\n")
    with pytest.raises(ConfigError, match="unknown hyperparameter.*lr_0"):
        Hyp.load(bad)
    values.pop("mosaic")
    missing = tmp_path / "missing.yaml"
    missing.write_text("\n".join(f"{k}: {v}" for k, v in values.items()))
    with pytest.raises(ConfigError, match="missing hyperparameter.*mosaic"):
        Hyp.load(missing)


def test_non_numeric_value_names_key(tmp_path):
    values = Hyp().to_dict()
    values["lr0"] = "fast"
    path = tmp_path / "h.yaml"
    path.write_text("\n".join(f"{k}: {v}" for k, v in values.items()))
    with pytest.raises(ConfigError, match="'lr0' must be a number"):
        Hyp.load(path)


def test_missing_hyp_file():
    with pytest.raises(ConfigError, match="not found"):
        Hyp.load("no/such/hyp.yaml")


def test_train_config_round_trip():
    config = TrainConfig(epochs=3, freeze=[10], data="x.yaml")
    again = TrainConfig.from_dict(config.to_dict())
    assert again == config


@pytest.mark.parametrize("argv,expected", [([], "auto"), (["--cache"], "ram"), (["--cache", "disk"], "disk"),
                                           (["--cache", "off"], "off")])
def test_train_cache_flag(argv, expected):
    """YOLOv5's --cache (alone: ram; or disk), plus our default 'auto' and an explicit 'off'."""
    import train

    assert train.config_from_args(train.parse_args(argv)).cache == expected
