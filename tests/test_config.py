from pathlib import Path

import pytest

from utils.config import ConfigError, Hyp, TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["scratch-low", "scratch-med", "scratch-high", "no-augmentation", "quickstart"])
def test_shipped_hyps_load(name):
    hyp = Hyp.load(ROOT / f"data/hyps/hyp.{name}.yaml")
    assert hyp.lr0 == (0.02 if name == "quickstart" else 0.01) and hyp.anchor_t == 4.0


def test_quickstart_hyp_is_yolov5s_no_augmentation_but_lr0_and_cls():
    quick, plain = Hyp.load("hyp.quickstart.yaml").to_dict(), Hyp.load("hyp.no-augmentation.yaml").to_dict()
    assert {key for key in plain if quick[key] != plain[key]} == {"lr0", "cls"}
    assert (quick["lr0"], quick["cls"]) == (0.02, 2.0)


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
    config = TrainConfig(epochs=3, freeze=[10], data="x.yaml", nbs=16)
    again = TrainConfig.from_dict(config.to_dict())
    assert again == config


def test_stored_options_without_nbs_get_yolov5s_64_and_a_bad_one_is_refused():
    stored = TrainConfig().to_dict()
    del stored["nbs"]  # options saved before --nbs existed, or by YOLOv5
    assert TrainConfig.from_dict(stored).nbs == 64
    with pytest.raises(ConfigError, match="option 'nbs'"):
        TrainConfig.from_dict({**stored, "nbs": 0}, "last.pt")


@pytest.mark.parametrize("argv,expected", [([], "auto"), (["--cache"], "ram"), (["--cache", "disk"], "disk"),
                                           (["--cache", "off"], "off")])
def test_train_cache_flag(argv, expected):
    """YOLOv5's --cache (alone: ram; or disk), plus our default 'auto' and an explicit 'off'."""
    import train

    assert train.config_from_args(train.parse_args(argv)).cache == expected


def write_hyp(folder: Path, key: str, value: str) -> Path:
    lines = [f"{k}: {value if k == key else v}" for k, v in Hyp().to_dict().items()]
    path = folder / f"hyp-{key}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("key, value, expected", [
    ("lr0", ".nan", "'lr0' must be a finite number in (0, 10], got nan"),
    ("lr0", ".inf", "'lr0' must be a finite number in (0, 10], got inf"),
    ("lr0", "-5", "'lr0' must be a finite number in (0, 10], got -5"),
    ("lr0", "0", "'lr0' must be a finite number in (0, 10], got 0"),
    ("momentum", "1.0", "'momentum' must be a finite number in [0, 1), got 1.0"),
    ("fliplr", "2", "'fliplr' must be a finite number in [0, 1], got 2"),
    ("scale", "1.5", "'scale' must be a finite number in [0, 1), got 1.5"),
    ("anchor_t", "0.5", "'anchor_t' must be a finite number in [1, 100], got 0.5"),
    ("lr0", "true", "'lr0' must be a number, got True"),
    ("lr0", "[0.1, 0.2]", "'lr0' must be a number, got [0.1, 0.2]"),
])
def test_hyp_values_outside_their_range_name_key_and_range(tmp_path, key, value, expected):
    path = write_hyp(tmp_path, key, value)
    with pytest.raises(ConfigError) as error:
        Hyp.load(path)
    assert str(error.value) == f"{path}: hyperparameter {expected}"


def test_hyp_numeric_strings_and_range_edges_are_accepted(tmp_path):
    assert Hyp.load(write_hyp(tmp_path, "lr0", "1e-3")).lr0 == 0.001  # YAML 1.1 reads 1e-3 as a string
    assert Hyp.load(write_hyp(tmp_path, "fliplr", "1")).fliplr == 1.0
    assert Hyp.load(write_hyp(tmp_path, "momentum", "0")).momentum == 0.0


def test_hyp_alias_bomb_and_odd_keys_give_short_messages(tmp_path):
    bomb = "[&a0 [x, x, x, x, x, x, x, x, x, x]" + "".join(
        f", &a{k} [" + ", ".join([f"*a{k - 1}"] * 10) + "]" for k in range(1, 9)) + "]"
    path = write_hyp(tmp_path, "lr0", bomb)  # 10^9 strings once expanded
    with pytest.raises(ConfigError, match="invalid YAML .*more than 1,000,000 nodes"):
        Hyp.load(path)
    odd = tmp_path / "odd.yaml"
    odd.write_text(path.read_text().replace(f"lr0: {bomb}", "lr0: 0.01") + "1: 2\n? " + "x" * 5000 + "\n: 1\n")
    with pytest.raises(ConfigError) as error:
        Hyp.load(odd)
    message = str(error.value)
    assert "unknown hyperparameter(s) 1, xxx" in message and len(message) < 200 + len(str(odd))


def test_yolov5s_dataset_hyps_load_and_their_evolved_anchor_count_builds_three_anchors():
    """hyp.VOC.yaml and hyp.Objects365.yaml: YOLOv5 v7's values, with the evolved ``anchors`` (3.412, 3.2)
    rounded to 3 anchors per level when the model is built, as YOLOv5 does."""
    from models.yolo import DetectionModel

    voc, objects365 = Hyp.load("hyp.VOC.yaml"), Hyp.load("hyp.Objects365.yaml")
    assert (voc.lr0, voc.mosaic, voc.mixup, voc.anchors) == (0.00334, 0.85834, 0.04266, 3.412)
    assert (objects365.lr0, objects365.scale, objects365.anchors) == (0.00258, 0.491, 3.2)
    model = DetectionModel("yolov5n.yaml", ch=3, nc=20, anchors=voc.anchors)
    assert model.model[-1].na == 3 and model.model[-1].anchors.shape == (3, 3, 2)
