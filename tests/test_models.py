"""models/: YAML parsing, YOLOv5 parameter / state-dict parity, Detect decoding, fuse, info."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from models.common import Conv
from models.yolo import Detect, DetectionModel, ModelConfigError, count_parameters, resolve_symbol
from tests.conftest import shared_path

MODELS = Path(__file__).resolve().parents[1] / "models"
YOLOV5_PARAMS = {"n": 1872157, "s": 7235389, "m": 21190557, "l": 46563709, "x": 86749405, "n6": 3246940,
                 "s6": 12626620, "m6": 35731932, "l6": 76770172, "x6": 140794780}


def tiny_config(name="yolov5n.yaml", **overrides) -> dict:
    config = yaml.safe_load((MODELS / name).read_text())
    config.update({"depth_multiple": 0.33, "width_multiple": 0.125, **overrides})
    return config


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return DetectionModel(tiny_config(nc=3))


@pytest.mark.parametrize("size", list(YOLOV5_PARAMS))
def test_parameter_counts_match_yolov5(size):
    with torch.device("meta"):  # shapes only: cheap even for yolov5x6
        model = DetectionModel(MODELS / f"yolov5{size}.yaml")
    assert count_parameters(model) == YOLOV5_PARAMS[size]
    assert len(model.model[-1].m) == (4 if size.endswith("6") else 3)


def check_state_dict(size: str, expected: dict) -> None:
    model = DetectionModel(MODELS / f"yolov5{size}.yaml")
    ours = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    assert list(ours) == list(expected["state_dict"])
    assert ours == expected["state_dict"]
    assert model.stride.tolist() == expected["stride"]


@pytest.mark.parametrize("size", ["n", "s"])
def test_state_dict_keys_and_shapes_match_yolov5(size, yolov5_lookalike):
    """Against YOLOv5's module tree as tests/yolov5_lookalike builds it (its parameter count is YOLOv5's)."""
    expected = json.loads(yolov5_lookalike.shapes.read_text())[f"models/yolov5{size}.yaml"]
    assert expected["parameters"] == YOLOV5_PARAMS[size]
    assert len(expected["state_dict"]) == 349  # 57 Conv+BatchNorm blocks x 6, Detect: 3 x 2 + anchors
    check_state_dict(size, expected)


def test_state_dict_keys_and_shapes_match_yolov5_recorded():
    """Against the keys and shapes recorded from YOLOv5 itself (../shared), when present."""
    why = "compares with the shapes recorded from YOLOv5 itself; the generated check above always runs"
    reference = json.loads(shared_path("fixtures", "yolov5", "state_dict_shapes_nc80.json", why=why).read_text())
    for size in ("n", "s"):
        check_state_dict(size, reference[f"models/yolov5{size}.yaml"])


@pytest.mark.parametrize("path", sorted((MODELS / "hub").glob("yolo*.yaml")), ids=lambda p: p.name)
def test_hub_yamls_build_and_run(path):
    config = yaml.safe_load(path.read_text())
    levels = config["head"][-1][0]
    config.update(width_multiple=0.0625, depth_multiple=0.33)  # same topology, tiny channels
    model = DetectionModel(config).eval()
    strides = model.stride.tolist()
    assert strides == sorted(strides) and len(strides) == len(levels)
    size = int(max(strides)) * 2
    with torch.no_grad():
        pred, raw = model(torch.rand(1, 3, size, size))
    expected_rows = sum(model.model[-1].na * (size // s) ** 2 for s in strides)
    assert pred.shape == (1, expected_rows, 85)
    assert model.anchors_placeholder == isinstance(config["anchors"], int)


def test_anchor_presets_fit_their_heads():
    """models/hub/anchors.yaml (YOLOv5's COCO presets): 3, 4 or 5 levels of 3 anchors by head, growing with the
    stride; the P5 and P6-1280 ones are yolov5s.yaml's and yolov5s6.yaml's; one pasted into a P7 YAML builds."""
    from utils.autoanchor import anchor_pixels

    presets = yaml.safe_load((MODELS / "hub" / "anchors.yaml").read_text())
    assert set(presets) == {"anchors_p5_640", *(f"anchors_p{p}_{size}" for p in (6, 7) for size in (640, 1280, 1920))}
    for name, rows in presets.items():
        assert len(rows) == {"5": 3, "6": 4, "7": 5}[name.split("_")[1][1]], name
        areas = [np.prod(np.reshape(row, (3, 2)), 1).mean() for row in rows]
        assert all(len(row) == 6 and min(row) > 0 for row in rows) and areas == sorted(areas), name
    assert presets["anchors_p5_640"] == yaml.safe_load((MODELS / "yolov5s.yaml").read_text())["anchors"]
    assert presets["anchors_p6_1280"] == yaml.safe_load((MODELS / "yolov5s6.yaml").read_text())["anchors"]
    config = yaml.safe_load((MODELS / "hub" / "yolov5-p7.yaml").read_text())
    config.update(width_multiple=0.0625, depth_multiple=0.33, anchors=presets["anchors_p7_640"])
    model = DetectionModel(config)
    np.testing.assert_allclose(anchor_pixels(model).reshape(5, 6), presets["anchors_p7_640"])


def test_hub_variants_have_their_features():
    with torch.device("meta"):
        panet = DetectionModel(MODELS / "hub" / "yolov5-panet.yaml")
        p6 = DetectionModel(MODELS / "hub" / "yolov5-p6.yaml")
    assert count_parameters(panet) == YOLOV5_PARAMS["l"]
    assert count_parameters(p6) == YOLOV5_PARAMS["l6"] and p6.anchors_placeholder
    leaky = DetectionModel(tiny_config("hub/yolov5s-LeakyReLU.yaml"))
    activations = {type(m.act) for m in leaky.modules() if isinstance(m, Conv)}
    assert activations == {nn.LeakyReLU} and leaky.model[0].act.negative_slope == 0.1


def test_every_block_builds_from_yaml_rows():
    config = {"nc": 2, "depth_multiple": 1.0, "width_multiple": 0.25, "anchors": [[10, 13, 16, 30], [30, 61, 62, 45]],
              "backbone": [[-1, 1, "Focus", [64, 3]],                      # 0 /2
                           [-1, 1, "Conv", [128, 3, 2]],                   # 1 /4
                           [-1, 2, "BottleneckCSP", [128]],                # 2
                           [-1, 1, "DWConv", [128, 3, 1]],                 # 3
                           [-1, 1, "GhostBottleneck", [256, 3, 2]],        # 4 /8
                           [-1, 2, "C3x", [256]],                          # 5
                           [-1, 1, "CrossConv", [256, 3, 1]],              # 6
                           [-1, 1, "Contract", [2]],                       # 7 /16
                           [-1, 1, "Expand", [2]],                         # 8 /8
                           [-1, 1, "nn.ZeroPad2d", [[0, 1, 0, 1]]],        # 9
                           [-1, 1, "nn.MaxPool2d", [2, 1, 0]],             # 10
                           [-1, 1, "SPP", [256, [5, 9, 13]]],              # 11
                           [-1, 1, "C3SPP", [256, [3, 5]]],                # 12
                           [-1, 2, "C3Ghost", [256]],                      # 13
                           [-1, 1, "Conv", [256, 3, 2, None, 1, 1, "nn.ReLU()"]]],  # 14 /16
              "head": [[-1, 1, "C3TR", [256]],                             # 15
                       [-1, 1, "nn.BatchNorm2d", []],                      # 16
                       [[13, 16], 1, "Detect", ["nc", "anchors"]]]}
    model = DetectionModel(config).eval()
    assert model.stride.tolist() == [8.0, 16.0]
    assert isinstance(model.model[14].act, nn.ReLU)
    assert model.model[7].type == "Contract" and model.model[2].m[1].cv1.conv.in_channels == 16
    with torch.no_grad():
        pred, raw = model(torch.rand(2, 3, 64, 64))
    assert pred.shape == (2, 2 * (8 * 8 + 4 * 4), 7)
    assert [r.shape for r in raw] == [(2, 2, 8, 8, 7), (2, 2, 4, 4, 7)]


def test_yolov3_and_p34_hub_yamls_match_yolov5s_summaries():
    """YOLOv5's summaries: yolov3 61,949,149 parameters, yolov3-tiny 8,852,366; yolov3-spp adds SPP's second 1x1
    conv (2048 -> 512 with its BatchNorm) where yolov3 has a 1024 -> 512 one; yolov5-p34 is yolov5s without P5."""
    with torch.device("meta"):
        v3, spp, tiny, p34, v5s = (DetectionModel(MODELS / name) for name in (
            "hub/yolov3.yaml", "hub/yolov3-spp.yaml", "hub/yolov3-tiny.yaml", "hub/yolov5-p34.yaml", "yolov5s.yaml"))
    assert count_parameters(v3) == 61_949_149 and count_parameters(tiny) == 8_852_366
    assert count_parameters(spp) - count_parameters(v3) == 2048 * 512 + 2 * 512
    assert len(p34.model[-1].m) == 2  # Detect(P3, P4); the strides are checked by test_hub_yamls_build_and_run
    backbone = [sum(p.numel() for p in layer.parameters()) for layer in v5s.model[:14]]
    assert [sum(p.numel() for p in layer.parameters()) for layer in p34.model[:14]] == backbone


def test_mixconv2d_and_dwconvtranspose2d_rows_build_with_yolov5_names():
    from models.common import MixConv2d

    # YOLOv5's equal split: channel i of c2 goes to kernel floor(i * (n - 1e-6) / (c2 - 1))
    assert MixConv2d.channel_split(32, [1, 3, 5]) == [11, 10, 11]
    # equal weights: c_g * k_g^2 alike, summing to c2 (64 / (1 + 1/9) = 57.6 -> 58, 6.4 -> 6)
    assert MixConv2d.channel_split(64, [1, 3], equal_ch=False) == [58, 6]
    assert MixConv2d.channel_split(64, [3, 5, 7], equal_ch=False) == [41, 15, 8]
    config = {"nc": 2, "depth_multiple": 1.0, "width_multiple": 0.5, "anchors": [[10, 13, 16, 30]],
              "backbone": [[-1, 1, "Conv", [32, 3, 2]],                        # 0 /2
                           [-1, 1, "MixConv2d", [64, [1, 3, 5], 2]],           # 1 /4
                           [-1, 1, "MixConv2d", [64, [1, 3], 2, False]],       # 2 /8
                           [-1, 1, "DWConvTranspose2d", [64, 2, 2]],           # 3 /4
                           [-1, 1, "Conv", [64, 3, 2]]],                       # 4 /8
              "head": [[[4], 1, "Detect", ["nc", "anchors"]]]}
    model = DetectionModel(config).eval()
    assert model.stride.tolist() == [8.0]
    mix, unequal, transposed = model.model[1], model.model[2], model.model[3]
    assert [conv.out_channels for conv in mix.m] == [11, 10, 11] and [conv.groups for conv in mix.m] == [1, 2, 1]
    assert [conv.out_channels for conv in unequal.m] == [29, 3] and type(mix.act) is nn.SiLU
    assert sorted(mix.state_dict()) == ["bn.bias", "bn.num_batches_tracked", "bn.running_mean", "bn.running_var",
                                        "bn.weight", "m.0.weight", "m.1.weight", "m.2.weight"]
    assert transposed.groups == 32 and sorted(transposed.state_dict()) == ["bias", "weight"]
    with torch.no_grad():
        pred, raw = model(torch.rand(1, 3, 64, 64))
    assert model.model[1](torch.rand(1, 16, 8, 8)).shape == (1, 32, 4, 4)
    assert pred.shape == (1, 2 * 8 * 8, 7)
    with pytest.raises(ValueError, match="MixConv2d cannot split 15 channels"):  # 13.5 and 1.5 round to 14 + 2
        MixConv2d(16, 15, [1, 3], equal_ch=False)
    config["backbone"][2] = [-1, 1, "MixConv2d", [64, [1, 4], 2]]
    with pytest.raises(ModelConfigError, match=r"layer 2 \(backbone row 2\): .*kernel sizes must be odd"):
        DetectionModel(config)


def test_train_mode_returns_raw_maps(tiny_model):
    tiny_model.train()
    raw = tiny_model(torch.rand(2, 3, 64, 96))
    assert [tuple(r.shape) for r in raw] == [(2, 3, 8, 12, 8), (2, 3, 4, 6, 8), (2, 3, 2, 3, 8)]


def test_eval_decoding_follows_yolov5_formulas(tiny_model):
    tiny_model.eval()
    with torch.no_grad():
        pred, raw = tiny_model(torch.rand(1, 3, 64, 64))
    detect = tiny_model.model[-1]
    level, anchor, gy, gx = 1, 2, 3, 1
    logits = raw[level][0, anchor, gy, gx]
    s = detect.stride[level]
    anchor_pixels = detect.anchors[level, anchor] * s
    expected_xy = (logits[:2].sigmoid() * 2 - 0.5 + torch.tensor([gx, gy])) * s
    expected_wh = (logits[2:4].sigmoid() * 2) ** 2 * anchor_pixels
    row = 3 * 8 * 8 + anchor * 4 * 4 + gy * 4 + gx
    assert torch.allclose(pred[0, row, :2], expected_xy, atol=1e-5)
    assert torch.allclose(pred[0, row, 2:4], expected_wh, atol=1e-5)
    assert torch.allclose(pred[0, row, 4:], logits[4:].sigmoid(), atol=1e-6)


def test_bf16_logits_decode_in_float32(tiny_model):
    """Under bf16 autocast the heads' logits are bf16, but boxes are decoded in float32: bf16 steps by 2 px
    between 256 and 512, too coarse for mAP at IoU 0.95."""
    tiny_model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        pred, raw = tiny_model(torch.rand(1, 3, 512, 512))
    detect = tiny_model.model[-1]
    assert raw[0].dtype == torch.bfloat16 and pred.dtype == torch.float32
    with torch.no_grad():
        expected = torch.cat([detect._decode(r.float(), i).view(1, -1, detect.no) for i, r in enumerate(raw)], 1)
    assert torch.equal(pred, expected)
    assert (pred[0, :, 0] % 2 != 0).any()  # off bf16's 2 px grid


def test_grids_are_cached_per_shape(tiny_model):
    tiny_model.eval()
    detect = tiny_model.model[-1]
    with torch.no_grad():
        tiny_model(torch.rand(1, 3, 64, 64))
        first = detect._grids[0]
        tiny_model(torch.rand(1, 3, 64, 64))
        assert detect._grids[0] is first
        tiny_model(torch.rand(1, 3, 32, 64))
        assert detect._grids[0].shape[2:4] == (4, 8)


def test_anchors_in_grid_units_biases_and_batchnorm(tiny_model):
    detect = tiny_model.model[-1]
    pixels = (detect.anchors * detect.stride.view(-1, 1, 1)).view(3, -1).tolist()
    assert pixels == [[10, 13, 16, 30, 33, 23], [30, 61, 62, 45, 59, 119], [116, 90, 156, 198, 373, 326]]
    for conv, stride in zip(detect.m, detect.stride.tolist()):
        bias = conv.bias.view(detect.na, -1)
        bound = 1 / math.sqrt(conv.in_channels)  # default Conv2d bias init range
        assert (bias[:, 4] - math.log(8 / (640 / stride) ** 2)).abs().max() <= bound
        assert (bias[:, 5:] - math.log(0.6 / (3 - 0.99999))).abs().max() <= bound
    norms = [m for m in tiny_model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(m.eps == 1e-3 and m.momentum == 0.03 for m in norms)


def test_reversed_anchors_are_flipped_to_match_strides():
    config = tiny_config(anchors=[[116, 90, 156, 198, 373, 326], [30, 61, 62, 45, 59, 119], [10, 13, 16, 30, 33, 23]])
    detect = DetectionModel(config).model[-1]
    assert (detect.anchors[0] * 8).view(-1).tolist() == [10, 13, 16, 30, 33, 23]


def test_overrides_names_and_placeholder_anchors(caplog):
    with caplog.at_level("INFO"):
        model = DetectionModel(tiny_config(), nc=5, anchors=2)
    assert model.yaml["nc"] == 5 and model.names == ["0", "1", "2", "3", "4"]
    assert model.model[-1].na == 2 and model.anchors_placeholder
    assert "Overriding model.yaml nc=80 with nc=5" in caplog.text


def test_fuse_keeps_outputs(tiny_model):
    tiny_model.eval()
    image = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        before = tiny_model(image)[0]
        fused = DetectionModel(tiny_config(nc=3))
        fused.load_state_dict(tiny_model.state_dict())
        fused.fuse().eval()
        after = fused(image)[0]
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fused.modules())
    assert torch.allclose(before, after, rtol=1e-4, atol=1e-4)


def test_info_summary_line():
    model = DetectionModel(MODELS / "yolov5n.yaml")
    summary = model.info()
    assert re.fullmatch(r"YOLOv5n summary: 214 layers, 1872157 parameters, 1872157 gradients, \d+\.\d GFLOPs",
                        summary)
    gflops = float(summary.split(", ")[-1].split()[0])
    assert 4.0 <= gflops <= 4.6  # YOLOv5 reports 4.1-4.5 for yolov5n at 640


@pytest.mark.parametrize("row, problem", [
    ([-1, 1, "Nope", [64]], "unknown module 'Nope'"),
    ([-1, 1, "Conv"], "expected [from, number, module, args]"),
    ([7, 1, "Conv", [64]], "'from' 7 does not name an earlier layer"),
    ([-1, 0, "Conv", [64]], "'number' must be a positive integer"),
    ([-1, 1, "Conv", ["nn.Evil(1)"]], "'nn.Evil' is not an allowed constructor"),
    ([-1, 1, "Conv", [64, "x", 2]], "Conv"),  # constructor rejects the argument
])
def test_bad_rows_give_one_line_errors(row, problem):
    config = tiny_config()
    config["backbone"][2] = row
    with pytest.raises(ModelConfigError) as error:
        DetectionModel(config)
    message = str(error.value)
    assert "\n" not in message and "layer 2 (backbone row 2)" in message and problem in message


def test_bad_files_and_keys(tmp_path):
    with pytest.raises(ModelConfigError, match="model YAML not found"):
        DetectionModel(tmp_path / "missing.yaml")
    config = tiny_config()
    del config["head"]
    with pytest.raises(ModelConfigError, match="missing key"):
        DetectionModel(config)
    with pytest.raises(ModelConfigError, match="not an allowed constructor"):
        DetectionModel(tiny_config(activation="os.system('true')"))


def test_symbols_are_parsed_without_eval(tmp_path):
    marker = tmp_path / "ran"
    assert resolve_symbol("nc", {"nc": 7}) == 7
    assert resolve_symbol("None", {}) is None and resolve_symbol("nearest", {}) == "nearest"
    assert resolve_symbol("-0.5", {}) == -0.5
    act = resolve_symbol("nn.LeakyReLU(0.1, inplace=True)", {})
    assert isinstance(act, nn.LeakyReLU) and act.negative_slope == 0.1
    payload = f"__import__('os').system('touch {marker}')"
    assert resolve_symbol(payload, {}) == payload  # left as an inert string
    with pytest.raises(ValueError):
        resolve_symbol(f"exec('open(\"{marker}\", \"w\")')", {})
    assert not marker.exists()


def test_detect_is_last_layer_with_contract_attributes(tiny_model):
    detect = tiny_model.model[-1]
    assert isinstance(detect, Detect) and (detect.nc, detect.no, detect.nl, detect.na) == (3, 8, 3, 3)
    assert tiny_model.save == [4, 6, 10, 14, 17, 20, 23]
    assert all(hasattr(layer, attr) for layer in tiny_model.model for attr in ("i", "f", "type", "np"))


# ----------------------------------------------------------------------------- bounds on hostile YAMLs
ALL_YAMLS = sorted(MODELS.glob("*.yaml")) + sorted((MODELS / "hub").glob("yolo*.yaml"))  # not anchors.yaml


@pytest.mark.parametrize("path", ALL_YAMLS, ids=lambda p: p.name)
def test_every_shipped_yaml_is_within_the_bounds(path):
    from models.yolo import check_model_size, load_model_config

    config, _ = load_model_config(path)
    check_model_size(config, 3, path.name)  # full width and depth, counted on the meta device


def test_largest_probe_fits_the_activation_budget():
    with torch.device("meta"):  # yolov5-p7 probes at 256 px: the largest pass of any shipped YAML
        model = DetectionModel(MODELS / "hub" / "yolov5-p7.yaml")
    assert model._probe_strides(3, torch.device("meta")) == [8.0, 16.0, 32.0, 64.0, 128.0]


def hostile(path_or_change, value=None) -> dict:
    config = tiny_config()
    if callable(path_or_change):
        path_or_change(config)
    else:
        config[path_or_change] = value
    return config


def set_row(section, index, row):
    return lambda config: config[section].__setitem__(index, row)


@pytest.mark.parametrize("config, expected", [
    (hostile("depth_multiple", 1e6), "depth_multiple must be a number in (0, 10], got 1000000.0"),
    (hostile("width_multiple", 1e4), "width_multiple must be a number in (0, 10], got 10000.0"),
    (hostile("width_multiple", float("nan")), "width_multiple must be a number in (0, 10], got nan"),
    (hostile("nc", 100_000_000), "nc must be an integer in [1, 100000], got 100000000"),
    (hostile("nc", 2.5), "nc must be an integer in [1, 100000], got 2.5"),
    (hostile("ch", 10_000), "ch must be an integer in [1, 64], got 10000"),
    (hostile("anchors", [[-10, 13, 16, 30, 33, 23]] * 3),
     "anchor sizes must be finite numbers in (0, 100000] pixels, got -10"),
    (hostile("anchors", [[float("nan"), 13]] * 3),
     "anchor sizes must be finite numbers in (0, 100000] pixels, got nan"),
    (hostile("anchors", 1_000_000), "anchors must be an integer in [1, 16] (anchors per level)"),
    (hostile("anchors", [[10, 13, 16]] * 3), "anchors must be an integer in [1, 16]"),
    (hostile(set_row("backbone", 2, [-1, 1_000_000_000, "C3", [128]])),
     "layer 2 (backbone row 2): 'number' must be a positive integer (at most 100), got 1000000000"),
    (hostile(lambda c: c.update(depth_multiple=10.0, backbone=c["backbone"][:2] + [[-1, 20, "C3", [128]]]
                                + c["backbone"][3:])),
     "layer 2 (backbone row 2): 'number' 20 x depth_multiple 10 = 200 repeats, more than 100"),
    (hostile(set_row("backbone", 1, [-1, 1, "Conv", [10_000_000, 3, 2]])),
     "layer 1 (backbone row 1): Conv argument 10000000 is outside [-16384, 16384]"),
    (hostile(set_row("backbone", 1, [-1, 1, "Conv", [128, 4096, 2]])),
     "layer 1 (backbone row 1): Conv argument 4096 is outside [-64, 64]"),
    (hostile(set_row("head", 1, [-1, 1, "nn.Upsample", [None, 4096, "nearest"]])),
     "layer 11 (head row 1): nn.Upsample argument 4096 is outside [-64, 64]"),
    (hostile(set_row("head", 14, [[17, 20, 23], 1, "Detect", [0, "anchors"]])),
     "layer 24 (head row 14): nc must be an integer in [1, 100000], got 0"),
    (hostile(lambda c: c.update(width_multiple=10.0, backbone=[[-1, 1, "Conv", [2048, 1, 1]]] + c["backbone"][1:])),
     "layer 0 (backbone row 0): Conv would output 20480 channels, outside [1, 16384]"),
])
def test_hostile_values_are_one_line_errors_with_the_range(config, expected):
    with pytest.raises(ModelConfigError) as error:
        DetectionModel(config)
    assert "\n" not in str(error.value) and expected in str(error.value), str(error.value)


def test_size_limits_are_checked_before_memory_is_used():
    base = {"nc": 1, "depth_multiple": 1.0, "width_multiple": 1.0, "anchors": [[10, 13]],
            "head": [[-1, 1, "Detect", ["nc", "anchors"]]]}
    wide = {**base, "backbone": [[-1, 1, "Conv", [16384, 3, 2]]] * 3}  # 2.4 G parameters
    many = {**base, "width_multiple": 0.01, "backbone": [[-1, 100, "C3", [8]]] * 999}
    upsample = [-1, 1, "nn.Upsample", [None, 64, "nearest"]]
    upsampled = {**base, "backbone": [[-1, 1, "Conv", [16384, 1, 1]], upsample, upsample]}  # 1.1 TB at 64 px
    for config, expected in ((wide, "more than 500 M parameters by layer 1"),
                             (many, "more than 10000 modules by layer"),
                             (upsampled, "the probe forward pass would produce more than 275079 M values by layer 1")):
        with pytest.raises(ModelConfigError, match=re.escape(expected)):
            DetectionModel(config)


def test_alias_bomb_model_yaml_is_refused(tmp_path):
    bomb = "[&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]" + "".join(
        f", &a{k} [" + ", ".join([f"*a{k - 1}"] * 10) + "]" for k in range(1, 9)) + "]"
    path = tmp_path / "bomb.yaml"
    path.write_text((MODELS / "yolov5n.yaml").read_text().replace("nc: 80", f"nc: {bomb}"))
    with pytest.raises(ModelConfigError, match="invalid YAML .*more than 1,000,000 nodes"):
        DetectionModel(path)


def test_detect_from_a_single_layer():
    config = {"nc": 2, "depth_multiple": 1.0, "width_multiple": 0.25, "anchors": [[10, 13, 16, 30]],
              "backbone": [[-1, 1, "Conv", [32, 3, 2]], [-1, 1, "Conv", [64, 3, 2]]],
              "head": [[-1, 1, "Detect", ["nc", "anchors"]]]}  # 'from' an int, not a list
    model = DetectionModel(config).eval()
    assert model.stride.tolist() == [4.0]
    with torch.no_grad():
        assert model(torch.rand(1, 3, 32, 32))[0].shape == (1, 2 * 8 * 8, 7)


def test_out_of_place_activations_give_the_same_values_and_gradients(tmp_path):
    """activations_out_of_place changes how the training step runs, not what it computes: bit for bit."""
    import copy

    from models.yolo import activations_out_of_place

    torch.manual_seed(0)
    in_place = DetectionModel(tiny_config(nc=3)).train()
    out_of_place = activations_out_of_place(copy.deepcopy(in_place))
    assert all(m.inplace for m in in_place.modules() if isinstance(m, torch.nn.SiLU))
    images = torch.rand(2, 3, 64, 64)
    results = []
    for model in (in_place, out_of_place):
        outputs = model(images)
        sum(output.square().sum() for output in outputs).backward()
        results.append(([o.detach() for o in outputs], [p.grad.clone() for p in model.parameters()]))
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
