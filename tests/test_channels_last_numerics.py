"""channels_last training keeps float32 accuracy: models.batchnorm.BatchNorm2d against torch's kernel and float64.

The whole-model bound: yolov5n, batch 4 at 256, one training step (loss = sum of squared raw outputs),
median over parameters of ||g32 - g64|| / ||g64||. Measured on a 2-core AMD EPYC (Zen 4), torch 2.14.1,
one thread: NCHW 2.0e-5, channels_last 2.2e-5 with models.batchnorm, 2.4e-2 with torch's BatchNorm2d.
channels_last may be at most 3x NCHW: the float32 convolutions round differently per layout and CPU,
which stays well inside 3x, while the imprecise statistics exceed it by two orders of magnitude.
"""
from __future__ import annotations

import copy
import statistics
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from models.batchnorm import BatchNorm2d, GroupedBatchNorm, batch_statistics, pixel_group, uses_grouped_sums
from models.yolo import DetectionModel

CHANNELS_LAST = torch.channels_last
BOUND = 3.0  # channels_last median error <= BOUND x NCHW median error


@contextmanager
def one_thread():
    """torch's channels_last kernel sums per thread, so its error depends on the thread count: pin it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def with_torch_batchnorm(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, BatchNorm2d):
            module.__class__ = nn.BatchNorm2d
    return model


def relative_error(value, reference) -> float:
    reference = reference.detach().double()
    return float((value.detach().double() - reference).norm() / reference.norm())


def gradients(model, images, dtype, channels_last: bool) -> dict:
    model = copy.deepcopy(model).to(dtype).train()
    images = images.to(dtype)
    if channels_last:
        model = model.to(memory_format=CHANNELS_LAST)
        images = images.contiguous(memory_format=CHANNELS_LAST)
    sum((out.double() ** 2).sum() for out in model(images)).backward()
    return {name: p.grad.double() for name, p in model.named_parameters()}


def median_errors(model, images) -> tuple[float, float]:
    """(NCHW, channels_last) median relative gradient error against float64."""
    reference = gradients(model, images, torch.float64, False)
    medians = []
    for channels_last in (False, True):
        grads = gradients(model, images, torch.float32, channels_last)
        medians.append(statistics.median(relative_error(grads[n], reference[n]) for n in reference))
    return medians[0], medians[1]


@pytest.fixture(scope="module")
def yolov5n_case():
    torch.manual_seed(0)
    model = DetectionModel("yolov5n.yaml", nc=80)
    images = torch.rand(4, 3, 256, 256, generator=torch.Generator().manual_seed(1))
    return model, images


def test_channels_last_model_gradients_as_accurate_as_nchw(yolov5n_case):
    model, images = yolov5n_case
    with one_thread():
        nchw, channels_last = median_errors(model, images)
    assert nchw < 1e-4, f"NCHW float32 gradients themselves are off: {nchw:.1e}"
    assert channels_last <= BOUND * nchw, f"channels_last {channels_last:.1e} vs NCHW {nchw:.1e}"


def test_torch_channels_last_batchnorm_still_loses_precision(yolov5n_case):
    """Why models.batchnorm exists; when this fails, torch's kernel is accurate and BatchNorm2d can go."""
    model, images = yolov5n_case
    with one_thread():
        nchw, channels_last = median_errors(with_torch_batchnorm(copy.deepcopy(model)), images)
    assert channels_last > 10 * BOUND * nchw, f"channels_last {channels_last:.1e} vs NCHW {nchw:.1e}"


def run_batchnorm(cls, x64, grad64, dtype, memory_format, **options):
    bn = cls(x64.shape[1], **options).to(dtype).train()
    if bn.weight is not None:
        with torch.no_grad():
            bn.weight.copy_(torch.linspace(0.5, 1.5, x64.shape[1]))
            bn.bias.copy_(torch.linspace(-1, 1, x64.shape[1]))
    x = x64.to(dtype).contiguous(memory_format=memory_format).detach().requires_grad_(True)
    y = bn(x)
    y.backward(grad64.to(dtype).contiguous(memory_format=memory_format))
    return bn, x, y


@pytest.mark.parametrize("shape, options", [
    ((4, 8, 64, 64), dict(eps=1e-3, momentum=0.03)),
    ((3, 24, 13, 13), dict()),  # 507 pixels a channel: torch's kernel, accurate at that count
    ((2, 5, 80, 48), dict(momentum=None)),
    ((2, 6, 64, 64), dict(affine=False)),
])
def test_batchnorm_channels_last_matches_float64(shape, options):
    generator = torch.Generator().manual_seed(4)
    x64 = torch.randn(shape, generator=generator, dtype=torch.float64) * 2 + 3
    grad64 = torch.randn(shape, generator=generator, dtype=torch.float64)
    ref, ref_x, ref_y = run_batchnorm(nn.BatchNorm2d, x64, grad64, torch.float64, torch.contiguous_format, **options)
    ours, x, y = run_batchnorm(BatchNorm2d, x64, grad64, torch.float32, CHANNELS_LAST, **options)
    assert y.is_contiguous(memory_format=CHANNELS_LAST) and x.grad.is_contiguous(memory_format=CHANNELS_LAST)
    assert relative_error(y, ref_y) < 3e-7 and relative_error(x.grad, ref_x.grad) < 3e-7
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.allclose(getattr(ours, name).double(), getattr(ref, name).double(), rtol=1e-6, atol=1e-7), name
    if ours.weight is not None:
        assert relative_error(ours.weight.grad, ref.weight.grad) < 3e-6
        assert relative_error(ours.bias.grad, ref.bias.grad) < 3e-6


def test_grouped_batchnorm_gradients_are_exact_in_float64():
    """The hand-written backward (batch-statistics terms included) against numerical differentiation."""
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64).contiguous(memory_format=CHANNELS_LAST).requires_grad_(True)
    weight = torch.rand(3, dtype=torch.float64, requires_grad=True)
    bias = torch.rand(3, dtype=torch.float64, requires_grad=True)

    def normalise(x, weight, bias):
        x = x.contiguous(memory_format=CHANNELS_LAST)
        group = pixel_group(x.numel() // x.shape[1], x.shape[1])
        with torch.no_grad():
            mean, var = batch_statistics(x, group)
        return GroupedBatchNorm.apply(x, weight, bias, mean, var, 1e-3, group)

    assert torch.autograd.gradcheck(normalise, (x, weight, bias))


def test_pixel_group_divides_and_respects_the_column_limit():
    from models.batchnorm import COLUMN_LIMIT, ROW_LIMIT
    for pixels, channels in ((8 * 160 * 160, 16), (800, 256), (4 * 13 * 13, 24), (7, 3), (97, 1), (1000, 20000),
                             (2 * 1031 * 1033, 8)):
        group = pixel_group(pixels, channels)
        assert pixels % group == 0 and (group * channels <= COLUMN_LIMIT or group == 1)
    assert pixel_group(8 * 160 * 160, 16) == 200  # the smallest divisor of 204800 leaving <= 1024 rows
    assert pixel_group(800, 256) == 1 and 800 <= ROW_LIMIT  # short enough already
    assert pixel_group(2 * 1031 * 1033, 8) == 1033  # no divisor leaves <= 1024 rows within 2048 columns: the largest


def test_only_cpu_float32_channels_last_training_inputs_take_the_grouped_path():
    from models.batchnorm import NATIVE_PIXELS
    x = torch.rand(2, 4, 8, NATIVE_PIXELS // 16 + 1)  # just over the pixel count torch's kernel keeps accurate
    assert uses_grouped_sums(x.contiguous(memory_format=CHANNELS_LAST))
    assert not uses_grouped_sums(x[..., :-1].contiguous(memory_format=CHANNELS_LAST))  # small map: native
    assert not uses_grouped_sums(x)  # NCHW: torch's kernel is accurate
    assert not uses_grouped_sums(x.to(torch.bfloat16).contiguous(memory_format=CHANNELS_LAST))
    assert not uses_grouped_sums(torch.rand(1, 4, 1, 1))
    x = torch.rand(2, 4, 8, 8)
    bn = BatchNorm2d(4).eval()
    with torch.no_grad():
        expected = nn.BatchNorm2d.forward(bn, x)
        assert torch.equal(bn(x.contiguous(memory_format=CHANNELS_LAST)), expected.contiguous(memory_format=CHANNELS_LAST))


def test_single_value_per_channel_still_raises_like_torch():
    bn = BatchNorm2d(4).train()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(torch.rand(1, 4, 1, 1).contiguous(memory_format=CHANNELS_LAST))


def test_state_dict_keys_match_torch_batchnorm():
    assert BatchNorm2d(8).state_dict().keys() == nn.BatchNorm2d(8).state_dict().keys()
    model = DetectionModel("yolov5n.yaml", nc=2)
    assert all(isinstance(m.bn, BatchNorm2d) for m in model.modules() if hasattr(m, "bn") and m.bn is not None)
