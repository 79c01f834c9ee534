"""The training-mode BatchNorm + SiLU C kernels (models/bn_silu.py, models/native): values and gradients against
float64, running statistics as nn.BatchNorm2d, where Conv uses them, and how the build fails safe."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import models.native as native
from models.batchnorm import BatchNorm2d
from models.bn_silu import batch_statistics, bn_silu, usable
from models.common import Conv
from utils.trainer.sync_bn import CPUSyncBatchNorm

kernels = pytest.mark.skipif(native.bn_silu_library() is None,
                             reason="the native kernels are not built here (no C compiler, not Linux or not libgomp)")
SHAPES = [(4, 16, 40, 40), (3, 24, 7, 9), (2, 37, 5, 3), (1, 8, 2, 3), (2, 256, 5, 5)]


def channels_last(*shape, scale=3.0, offset=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale + offset).contiguous(memory_format=torch.channels_last)


def affine_bn(channels: int, seed: int = 1, momentum=0.1) -> BatchNorm2d:
    generator = torch.Generator().manual_seed(seed)
    bn = BatchNorm2d(channels, momentum=momentum)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(channels, generator=generator) + 0.5)
        bn.bias.copy_(torch.randn(channels, generator=generator))
        bn.running_mean.copy_(torch.randn(channels, generator=generator))
        bn.running_var.copy_(torch.rand(channels, generator=generator) + 0.5)
    return bn


def reference(x, bn, grad):
    """silu(batch_norm(x)) and its gradients in float64 with torch's own BatchNorm, and its running statistics."""
    twin = nn.BatchNorm2d(bn.num_features, momentum=bn.momentum).double()
    twin.load_state_dict(bn.state_dict())
    x64 = x.detach().double().requires_grad_()
    out = nn.functional.silu(twin(x64))
    grads = torch.autograd.grad(out, (x64, twin.weight, twin.bias), grad.double())
    return out, grads, twin


def relative(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@kernels
@pytest.mark.parametrize("shape", SHAPES)
def test_values_and_gradients_match_float64(shape):
    x = channels_last(*shape).requires_grad_()
    bn = affine_bn(shape[1])
    before = {key: value.clone() for key, value in bn.state_dict().items()}
    assert usable(x, bn, nn.SiLU())
    out = bn_silu(x, bn)
    grad = channels_last(*shape, scale=1.0, offset=0.0, seed=2)
    grads = torch.autograd.grad(out, (x, bn.weight, bn.bias), grad)
    bn.load_state_dict(before)  # the reference updates the same starting statistics
    expected, expected_grads, twin = reference(x, bn, grad)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert relative(out, expected) < 2e-6
    for got, want in zip(grads, expected_grads):
        assert relative(got, want) < 5e-6
    bn_after = affine_bn(shape[1])
    bn_silu(x.detach(), bn_after)
    for name in ("running_mean", "running_var"):
        assert relative(getattr(bn_after, name), getattr(twin, name)) < 1e-6
    assert int(bn_after.num_batches_tracked) == 1


@kernels
def test_cumulative_running_average_with_momentum_none():
    x = channels_last(2, 8, 6, 6)
    bn, twin = affine_bn(8, momentum=None), nn.BatchNorm2d(8, momentum=None).double()
    twin.load_state_dict(bn.state_dict())
    for seed in range(3):
        x = channels_last(2, 8, 6, 6, seed=seed)
        bn_silu(x, bn)
        twin(x.double())
    assert int(bn.num_batches_tracked) == 3
    assert relative(bn.running_mean, twin.running_mean) < 1e-6
    assert relative(bn.running_var, twin.running_var) < 1e-6


@kernels
def test_statistics_stay_accurate_far_from_zero_and_over_many_pixels():
    """Shifted sums (the first pixel as pivot) in float over 256-pixel blocks, double across blocks: a map whose
    mean is 1000x its spread, over 16 x 160 x 160 pixels, keeps the variance to float precision."""
    x = channels_last(16, 4, 160, 160, scale=1.0, offset=1000.0)
    mean, var = batch_statistics(x)
    x64 = x.double()
    assert relative(mean, x64.mean((0, 2, 3))) < 1e-9
    assert relative(var, x64.var((0, 2, 3), unbiased=False)) < 1e-5


@kernels
def test_deterministic_and_close_across_thread_counts():
    x = channels_last(4, 16, 33, 31).requires_grad_()
    grad = channels_last(4, 16, 33, 31, scale=1.0, offset=0.0, seed=3)

    def run():
        bn = affine_bn(16)
        out = bn_silu(x, bn)
        return (out, *torch.autograd.grad(out, (x, bn.weight, bn.bias), grad))

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = run()
    finally:
        torch.set_num_threads(threads)
    assert all(relative(a, b) < 1e-5 for a, b in zip(first, single))


@kernels
def test_frozen_parameters_and_an_input_without_gradient():
    x = channels_last(2, 8, 10, 10).requires_grad_()
    bn = affine_bn(8)
    bn.weight.requires_grad_(False)
    out = bn_silu(x, bn)
    grad_x, grad_bias = torch.autograd.grad(out, (x, bn.bias), torch.ones_like(out))
    expected, (want_x, _, want_bias), _ = reference(x, affine_bn(8), torch.ones_like(out))
    assert relative(grad_x, want_x) < 5e-6 and relative(grad_bias, want_bias) < 5e-6
    weight_only = affine_bn(8)
    out = bn_silu(x.detach(), weight_only)  # the first layer: only the BatchNorm's parameters need gradients
    (grad_weight,) = torch.autograd.grad(out.sum(), (weight_only.weight,))
    assert torch.isfinite(grad_weight).all()


@kernels
def test_conv_uses_the_kernels_in_training_and_agrees_with_torch(monkeypatch):
    torch.manual_seed(0)
    conv = Conv(8, 16, 3, 1).to(memory_format=torch.channels_last).train()
    twin = Conv(8, 16, 3, 1).to(memory_format=torch.channels_last).train()
    twin.load_state_dict(conv.state_dict())
    x = channels_last(4, 8, 12, 12).requires_grad_()
    calls = []
    original = bn_silu

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr("models.common.bn_silu", counted)
    out = conv(x)
    assert calls == [1]
    monkeypatch.setattr("models.common.bn_silu_usable", lambda *args: False)
    expected = twin(x)
    assert relative(out, expected) < 2e-6
    grads = torch.autograd.grad(out.sum(), (x, conv.conv.weight, conv.bn.weight))
    expected_grads = torch.autograd.grad(expected.sum(), (x, twin.conv.weight, twin.bn.weight))
    assert all(relative(a, b) < 5e-5 for a, b in zip(grads, expected_grads))
    assert relative(conv.bn.running_var, twin.bn.running_var) < 1e-6
    conv.eval()
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr("models.common.bn_silu", counted)
    with torch.no_grad():
        conv(x)
    assert calls == []  # eval mode: torch's BatchNorm with the running statistics


@kernels
def test_not_used_outside_cpu_float32_channels_last_training():
    bn, x = affine_bn(8), channels_last(2, 8, 6, 6)
    assert usable(x, bn, nn.SiLU())
    assert not usable(x.contiguous(), bn, nn.SiLU())  # NCHW
    assert not usable(channels_last(1, 8, 1, 1), bn, nn.SiLU())  # one pixel: torch raises its own error
    assert not usable(x.double(), bn, nn.SiLU())
    assert not usable(x, bn, nn.ReLU())
    assert not usable(x, bn.eval(), nn.SiLU())
    bn.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not usable(x, bn, nn.SiLU())
    assert not usable(x, CPUSyncBatchNorm(8), nn.SiLU())
    assert not usable(x, nn.BatchNorm2d(8), nn.SiLU())  # torch's own class keeps torch's kernels
    assert not usable(x, BatchNorm2d(8, affine=False), nn.SiLU())
    assert not usable(x, BatchNorm2d(8, track_running_stats=False), nn.SiLU())


def test_switched_off_by_the_environment(monkeypatch):
    native.bn_silu_library.cache_clear()
    monkeypatch.setenv(native.SWITCH, "0")
    try:
        assert native.bn_silu_library() is None
        assert not usable(channels_last(2, 8, 6, 6), affine_bn(8), nn.SiLU())
    finally:
        monkeypatch.delenv(native.SWITCH)
        native.bn_silu_library.cache_clear()


def test_no_compiler_means_no_kernels(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_compiler", lambda: None)
    assert native.build(native.SOURCE, tmp_path) is None
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.skipif(native._compiler() is None, reason="no C compiler here")
def test_a_failed_build_is_logged_and_leaves_no_file(tmp_path, caplog):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    with caplog.at_level(logging.INFO, logger="models.native"):
        assert native.build(broken, tmp_path / "kernels") is None
    assert "could not build broken.c" in caplog.text
    assert list((tmp_path / "kernels").iterdir()) == []


@pytest.mark.skipif(native._compiler() is None, reason="no C compiler here")
def test_built_once_then_loaded(tmp_path, monkeypatch):
    first = native.build(native.SOURCE, tmp_path)
    assert first is not None and first.is_file()
    assert [path.name for path in tmp_path.iterdir()] == [first.name]

    def no_compiling(command, **kwargs):
        raise AssertionError("compiled again")

    version = native._version(native._compiler())
    monkeypatch.setattr(native, "_version", lambda compiler: version)
    monkeypatch.setattr(native.subprocess, "run", no_compiling)
    assert native.build(native.SOURCE, tmp_path) == first
    changed = tmp_path / "changed.c"
    changed.write_text(native.SOURCE.read_text() + "\n/* another source, another file */\n")
    with pytest.raises(AssertionError, match="compiled again"):
        native.build(changed, tmp_path)


@pytest.mark.skipif(native._compiler() is None, reason="no C compiler here")
def test_a_library_others_may_write_is_not_loaded(tmp_path, caplog):
    built = native.build(native.SOURCE, tmp_path)
    assert built is not None and not built.stat().st_mode & 0o022
    built.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="models.native"):
        assert native.build(native.SOURCE, tmp_path) is None
    assert "others may write it" in caplog.text
