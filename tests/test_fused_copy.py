"""models.fused.FusedCopy: the trainer's validation model computes what the (EMA) source computes now."""
from __future__ import annotations

import pytest
import torch

from models.fused import FusedCopy
from models.yolo import DetectionModel

TINY = {"nc": 3, "depth_multiple": 0.33, "width_multiple": 0.125,
        "anchors": [[10, 13, 16, 30, 33, 23], [30, 61, 62, 45, 59, 119], [116, 90, 156, 198, 373, 326]],
        "backbone": [[-1, 1, "Conv", [64, 6, 2, 2]], [-1, 1, "Conv", [128, 3, 2]], [-1, 1, "C3", [128]],
                     [-1, 1, "Conv", [256, 3, 2]], [-1, 1, "C3", [256]], [-1, 1, "Conv", [512, 3, 2]],
                     [-1, 1, "SPPF", [512, 5]]],
        "head": [[[2, 4, 6], 1, "Detect", ["nc", "anchors"]]]}


def perturb(model, generator):
    """Stand in for a training step + EMA update: new weights and BatchNorm statistics."""
    with torch.no_grad():
        for value in model.state_dict().values():
            if value.dtype.is_floating_point:
                value.add_(torch.randn(value.shape, generator=generator) * 0.05)
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_var.abs_().add_(0.1)


@pytest.mark.parametrize("channels_last", [False, True])
def test_refreshed_copy_follows_the_source(channels_last):
    generator = torch.Generator().manual_seed(0)
    source = DetectionModel(TINY)
    if channels_last:
        source = source.to(memory_format=torch.channels_last)
    fused = FusedCopy(source)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in fused.model.modules())
    weight = next(p for p in fused.model.parameters() if p.dim() == 4)
    assert weight.is_contiguous(memory_format=torch.channels_last) == channels_last
    images = torch.rand(2, 3, 64, 96, generator=generator)
    for _ in range(2):
        perturb(source, generator)
        source.eval()
        with torch.inference_mode():
            expected = source(images)[0]
            stale = fused.model(images)[0]
            actual = fused.refresh()(images)[0]
        assert not torch.allclose(stale, expected, atol=1e-3)  # without refresh it would be out of date
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-3)


@pytest.fixture
def fused_calls(monkeypatch):
    """A list that grows by one per conv_silu call made by a Conv's forward."""
    import models.common as common

    calls = []
    original = common.conv_silu
    monkeypatch.setattr(common, "conv_silu", lambda conv, x: calls.append(1) or original(conv, x))
    return calls


def test_fused_silu_matches_the_two_op_path_and_export_keeps_plain_ops(monkeypatch, fused_calls):
    """fuse_silu: the folded Convs with SiLU compute conv + SiLU in one oneDNN call on the CPU, equal to
    the two-op path up to float rounding, in the input's memory format; a model never given it (export)
    runs no fused call, and where the op disagrees or is missing nothing is switched on."""
    import models.common as common
    import models.fused as fused_module
    from models import for_inference

    generator = torch.Generator().manual_seed(0)
    model = for_inference(DetectionModel(TINY).eval())
    images = torch.rand(2, 3, 64, 96, generator=generator).contiguous(memory_format=torch.channels_last)
    calls = fused_calls
    with torch.inference_mode():
        expected = model(images)[0]
        assert not calls  # not switched on: the plain path (what export traces)
        silu_convs = sum(isinstance(m, common.Conv) and type(m.act) is torch.nn.SiLU for m in model.modules())
        assert fused_module.fuse_silu(model) == silu_convs > 0
        actual = model(images)[0]
    assert len(calls) == silu_convs
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)

    fused_module._conv_silu_agrees.cache_clear()
    monkeypatch.setattr(fused_module, "conv_silu", lambda conv, x: torch.nn.functional.silu(conv(x)) + 1e-3)
    try:
        assert fused_module.fuse_silu(for_inference(DetectionModel(TINY).eval())) == 0  # the probe disagrees
    finally:
        fused_module._conv_silu_agrees.cache_clear()


def test_fused_silu_is_fp32_only(fused_calls):
    """Under bf16 autocast the fused Convs take the two-op path (the rounding exported models share)."""
    from models import for_inference
    from models.fused import fuse_silu

    model = for_inference(DetectionModel(TINY).eval())
    assert fuse_silu(model) > 0
    calls = fused_calls
    images = torch.rand(1, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(images)
    assert not calls
    with torch.inference_mode():
        model(images)
    assert calls
