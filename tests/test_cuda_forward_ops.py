"""benchmarks/cuda_forward_ops.py: a CUDA training forward as the dispatcher runs it, on fake CUDA tensors (no GPU).

What it shows is torch's CUDA autocast policy on the YOLOv5 models: these tests hold it to what docs/benchmarks.md
says (2026-11-28, "Copies beside the step"), so that a torch whose policy changes fails here instead of leaving the
docs wrong."""
from __future__ import annotations

import torch
from torch import nn

from benchmarks.cuda_forward_ops import forward_operations, main
from models.common import Upsample
from tests.conftest import ROOT

YOLOV5N = str(ROOT / "models" / "yolov5n.yaml")


def activation_casts(result) -> list[tuple[str, str]]:
    return [(layer.split(":")[1], dtypes) for layer, dtypes, _, _ in result["casts"]]


def test_cuda_autocast_would_run_nearest_upsampling_in_float32_and_the_layers_after_it_would_cast_back():
    """torch's policy, which the models' Upsample steps out of (models/common.py)."""
    result = forward_operations(YOLOV5N, 8, 640, torch.float16, upsample_float32=True)
    casts = activation_casts(result)
    assert casts[0] == ("Conv", "float32->float16")  # the input, at the first convolution
    assert casts.count(("Upsample", "float16->float32")) == 2  # both of the head's upsamplings
    # the float32 concatenation after each is read by a C3's two 1x1 convolutions, each casting it back
    assert casts.count(("C3", "float32->float16")) == 4
    assert len(casts) == 7
    assert result["kinds"]["convolution"][0] == 60 and result["kinds"]["upsample_nearest2d"][0] == 2


def test_the_models_upsampling_keeps_fp16_so_only_the_input_is_cast_and_less_is_read_and_written():
    before = forward_operations(YOLOV5N, 8, 640, torch.float16, upsample_float32=True)
    after = forward_operations(YOLOV5N, 8, 640, torch.float16)
    assert activation_casts(after) == [("Conv", "float32->float16")]
    assert after["bytes"] < before["bytes"]
    assert after["kinds"]["cat"][1] < before["kinds"]["cat"][1]  # fp16 concatenations instead of float32
    assert Upsample.forward is not nn.Upsample.forward  # put back


def test_nothing_is_left_switched_on_and_the_script_prints_its_table(capsys, tmp_path):
    main(["--cfg", YOLOV5N, "--batch-size", "2", "--imgsz", "320", "--json", str(tmp_path / "ops.json")])
    assert not torch.is_autocast_enabled("cuda")
    out = capsys.readouterr().out
    assert "CUDA autocast fp16" in out and "0:Conv" in out and "float32->float16" in out
    assert (tmp_path / "ops.json").exists()
