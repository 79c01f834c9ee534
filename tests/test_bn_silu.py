"""The training-mode BatchNorm + SiLU C kernels (models/bn_silu.py, models/native): values and gradients against
float64, running statistics as nn.BatchNorm2d, where Conv uses them, and how the build fails safe."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import models.native as native
from models.batchnorm import BatchNorm2d
from models.bn_silu import batch_statistics, bn_silu, usable
from models.common import Conv
from utils.trainer.sync_bn import CPUSyncBatchNorm

ROOT = Path(__file__).resolve().parents[1]
# CI sets YOLO_TRAINER_NATIVE_REQUIRED=1: the kernels must then be built, and these tests can never skip there
kernels = pytest.mark.skipif(os.environ.get(native.REQUIRED) != "1" and native.bn_silu_library() is None,
                             reason="the native kernels are not built here (no C compiler, not Linux or not libgomp)")
compiler = pytest.mark.skipif(native._compiler() is None or native.openmp_runtime() is None,
                              reason="no C compiler or no GNU libgomp here")
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

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # two threads even where torch would run one: the per-thread sums are combined
        first, second = run(), run()
        torch.set_num_threads(1)
        single = run()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
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


def test_cc_is_split_as_a_shell_would_and_a_missing_one_is_named(tmp_path, monkeypatch, caplog):
    launcher = tmp_path / "ccache"
    launcher.write_text("#!/bin/sh\nexec \"$@\"\n")
    launcher.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CC", "ccache gcc -m64")
    assert native._compiler() == [str(launcher), "gcc", "-m64"]
    monkeypatch.setenv("CC", "no-such-ccache gcc")
    monkeypatch.delenv(native.REQUIRED, raising=False)
    assert native._compiler() is None
    with caplog.at_level(logging.INFO, logger="models.native"):
        assert native.build(native.SOURCE, tmp_path / "kernels") is None
    assert "$CC='no-such-ccache gcc': its first word is not a program on PATH" in caplog.text


def test_no_compiler_means_no_kernels(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv(native.REQUIRED, raising=False)
    with caplog.at_level(logging.INFO, logger="models.native"):
        assert native.build(native.SOURCE, tmp_path) is None
    assert "no C compiler found" in caplog.text
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    monkeypatch.setenv(native.REQUIRED, "1")  # CI: a missing build is a failure, never a silent fallback
    with pytest.raises(native.NativeUnavailable, match="required .* no C compiler found"):
        native.build(native.SOURCE, tmp_path)


@compiler
def test_a_failed_build_is_recorded_and_not_retried(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv(native.REQUIRED, raising=False)
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    folder = tmp_path / "kernels"
    with caplog.at_level(logging.INFO, logger="models.native"):
        assert native.build(broken, folder) is None
    assert "could not build broken.c" in caplog.text
    (record,) = folder.glob("broken-*.failed")
    assert "could not build broken.c" in record.read_text()
    assert not list(folder.glob("*.so")) and not list(folder.glob(".build-*"))  # no library, no scratch left
    caplog.clear()

    def no_compiling(command, **kwargs):
        if "--version" in command:
            return subprocess.CompletedProcess(command, 0, native_version, "")
        raise AssertionError("compiled again")

    native_version = native._version(native._compiler())
    monkeypatch.setattr(native.subprocess, "run", no_compiling)
    with caplog.at_level(logging.INFO, logger="models.native"):
        assert native.build(broken, folder) is None  # the next start: the record, not another build
    assert "failed earlier on this machine" in caplog.text and f"remove {record} to try again" in caplog.text


@compiler
def test_built_once_then_loaded(tmp_path, monkeypatch):
    first = native.build(native.SOURCE, tmp_path)
    assert first is not None and first.is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == [".build.lock", first.name]

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


@compiler
def test_linked_against_the_libgomp_torch_has_mapped(tmp_path):
    built = native.build(native.SOURCE, tmp_path)
    listed = subprocess.run(["ldd", str(built)], capture_output=True, text=True).stdout
    line = next(text for text in listed.splitlines() if "libgomp" in text)
    assert os.path.realpath(line.split("=>")[1].split("(")[0].strip()) == native.openmp_runtime()


@compiler
def test_a_library_others_may_write_or_a_link_is_not_loaded(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv(native.REQUIRED, raising=False)
    built = native.build(native.SOURCE, tmp_path)
    assert built is not None and not built.stat().st_mode & 0o022
    assert native.load_checked(built) is not None
    link = tmp_path / "link.so"
    link.symlink_to(built)
    with caplog.at_level(logging.WARNING, logger="models.native"):
        assert native.load_checked(link) is None  # opened without following links
    assert "cannot open" in caplog.text
    built.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="models.native"):
        assert native.load_checked(built) is None
    assert "others may write it" in caplog.text


CHILD = """
import json, os, sys
sys.path.insert(0, {root!r})
import torch
from torch import nn
tiny = float(sys.argv[1])  # read at run time: a literal product would be folded when the script is compiled
before = (tiny * 1.0, float(torch.tensor([1e-40]) * 1.0))
import models.native as native
library = native.bn_silu_library()
from models.batchnorm import BatchNorm2d
from models.bn_silu import bn_silu, usable
torch.set_num_threads(2)
x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last).requires_grad_()
bn = BatchNorm2d(8)
used = usable(x, bn, nn.SiLU())
bn_silu(x, bn).sum().backward()
after = (tiny * 1.0, float(torch.tensor([1e-40]) * 1.0))
print("RESULT " + json.dumps({{"library": library is not None, "used": used, "before": before, "after": after}}))
"""


def run_child(tmp_path, cache, extra_env=None, wait=True):
    env = {**os.environ, "YOLO_TRAINER_CACHE": str(cache), **(extra_env or {})}
    env.pop(native.REQUIRED, None)
    command = [sys.executable, "-c", CHILD.format(root=str(ROOT)), "1e-310"]
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1])


@compiler
def test_a_denormal_survives_building_loading_and_a_training_step(tmp_path):
    """A library linked with -ffast-math carries crtfastmath.o, which sets flush-to-zero for the whole process on
    load: 1e-310 * 1.0 became 0.0 in Python, numpy and torch alike. Built, checked and loaded here in a fresh
    process, then used forward and backward: the process computes denormals as before."""
    for attempt in ("builds", "loads the built file"):
        result = run_child(tmp_path, tmp_path / "cache")
        assert result["library"] and result["used"], attempt
        assert result["before"] == result["after"] and result["after"][0] == 1e-310 and result["after"][1] > 0


@compiler
def test_two_processes_starting_at_once_build_once(tmp_path):
    """torchrun ranks starting together: one compiles under the lock, the other waits and loads its file. $CC is
    a launcher and the compiler, as ``CC="ccache gcc"`` is."""
    log = tmp_path / "compiles.log"
    launcher = tmp_path / "launcher"
    launcher.write_text(f"#!/bin/sh\ncase \"$*\" in *' -c '*) echo compile >> {log};; esac\nexec \"$@\"\n")
    launcher.chmod(0o755)
    cache = tmp_path / "cache"
    children = [run_child(tmp_path, cache, {"CC": f"{launcher} {native._compiler()[0]}"}, wait=False)
                for _ in range(2)]
    outputs = [child.communicate(timeout=300) for child in children]
    assert all(child.returncode == 0 for child in children), [err[-2000:] for _, err in outputs]
    results = [json.loads(out.split("RESULT ", 1)[1]) for out, _ in outputs]
    assert all(result["library"] and result["used"] for result in results)
    assert log.read_text().splitlines() == ["compile"]
    assert len(list((cache / "kernels").glob("bn_silu-*.so"))) == 1


@compiler
def test_a_library_that_would_change_the_process_is_refused_before_this_process_loads_it(tmp_path, caplog,
                                                                                           monkeypatch):
    """What -ffast-math at link time did: the child process sees flush-to-zero after loading the fresh library,
    so it never reaches this process and the failure is recorded."""
    monkeypatch.delenv(native.REQUIRED, raising=False)
    monkeypatch.setattr(native, "COMPILE_FLAGS", [*native.COMPILE_FLAGS, "-ffast-math"])
    original = native._build_checked

    def linked_fast(compiler, flags, source, openmp, folder, target):
        real_run = subprocess.run

        def run(command, **kwargs):  # the old one-step habit: fast-math flags on the link line too
            if "-shared" in command:
                command = [*command[:1], "-ffast-math", *command[1:]]
            return real_run(command, **kwargs)
        monkeypatch.setattr(native.subprocess, "run", run)
        try:
            return original(compiler, flags, source, openmp, folder, target)
        finally:
            monkeypatch.setattr(native.subprocess, "run", real_run)
    monkeypatch.setattr(native, "_build_checked", linked_fast)
    with caplog.at_level(logging.INFO, logger="models.native"):
        assert native.build(native.SOURCE, tmp_path) is None
    assert "switched the process to flush-to-zero" in caplog.text
    tiny = float("1e-310")
    assert tiny * 1.0 == tiny and not list(tmp_path.glob("*.so"))


@kernels
def test_nan_and_inf_pass_through():
    """GradScaler skips a step on inf/NaN gradients: the kernels must carry them, never assume finite maths."""
    x = channels_last(2, 8, 6, 6)
    x[0, 1, 2, 3] = float("nan")
    x[1, 2, 0, 0] = float("inf")
    out = bn_silu(x.requires_grad_(), affine_bn(8))
    assert out[:, 1].isnan().all() and not out[:, 2].isfinite().any()  # a channel's statistics take it in
    assert out[:, 0].isfinite().all()
    y = channels_last(2, 8, 6, 6).requires_grad_()
    bn = affine_bn(8)
    grad = torch.zeros(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    grad[0, 3, 1, 1] = float("inf")
    grad[1, 4, 1, 1] = float("nan")
    grad_x, grad_weight = torch.autograd.grad(bn_silu(y, bn), (y, bn.weight), grad)
    assert not grad_x[:, 3].isfinite().all() and grad_x[:, 4].isnan().any() and grad_x[:, 0].isfinite().all()
    assert not grad_weight[3].isfinite() and grad_weight[4].isnan() and grad_weight[0].isfinite()


@kernels
def test_double_backward_raises_instead_of_dropping_terms():
    x = channels_last(2, 8, 6, 6).requires_grad_()
    out = bn_silu(x, affine_bn(8))
    (grad_x,) = torch.autograd.grad(out.sum(), (x,), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|double backward|does not require grad"):
        grad_x.sum().backward()


def test_torchs_own_openmp_runtime_is_told_from_other_packages():
    """Another package's OpenMP runtime (ncnn's wheel maps its own libgomp) is not torch's: the kernels link torch's
    by path and stay usable; a second runtime inside torch's package, or two with none there, is refused."""
    import torch

    site = Path(torch.__file__).resolve().parent.parent
    torch_gomp = f"{site}/torch/lib/libgomp.so.1"
    line = "7f0000000000-7f0000001000 r-xp 00000000 00:00 0 {}\n".format
    assert native.openmp_runtime(line(torch_gomp) + line(f"{site}/ncnn.libs/libgomp-6a29c32d.so.1.0.0")) == torch_gomp
    assert native.openmp_runtime(line(torch_gomp) + line(f"{site}/torch/lib/libiomp5.so")) is None
    assert native.openmp_runtime(line("/usr/lib/x86_64-linux-gnu/libgomp.so.1")) == \
        os.path.realpath("/usr/lib/x86_64-linux-gnu/libgomp.so.1")
    assert native.openmp_runtime(line("/usr/lib/libgomp.so.1") + line("/opt/x/libomp.so")) is None
