"""The host's reads of tensor values in steady-state training steps (on a GPU each read waits for the device):
counted on the CPU with benchmarks/host_reads.py, place by place. A new read in the step fails here; the ones
left are the decisions a step still takes at once (a finite loss, finite gradients) and the progress bar's reads
every REPORT_EVERY batches."""
from __future__ import annotations

import math

import pytest
import torch
import yaml

from benchmarks.host_reads import HostReads
from tests.conftest import TINY_MODEL_YAML
from utils.config import Hyp
from utils.loss import DetectionLoss
from utils.trainer.amp import choose_precision
from utils.trainer.ema import ModelEMA
from utils.trainer.loop import REPORT_EVERY, TrainStep, train_one_epoch
from utils.trainer.optim import build_optimizer
from utils.trainer.state import RunState


def tiny_step():
    from models.yolo import DetectionModel

    torch.manual_seed(0)
    model = DetectionModel(yaml.safe_load(TINY_MODEL_YAML)).train()
    return TrainStep(model, build_optimizer(model, lr=0.01), DetectionLoss(model, Hyp(), imgsz=64),
                     choose_precision("off", torch.device("cpu"), model), ModelEMA(model))


def batches(count: int):
    generator = torch.Generator().manual_seed(1)
    targets = torch.tensor([[0, 0, 0.5, 0.5, 0.4, 0.3], [1, 1, 0.3, 0.6, 0.2, 0.5]])
    return [((torch.rand(2, 3, 64, 64, generator=generator) * 255).to(torch.uint8), targets, ["a", "b"], None)
            for _ in range(count)]


def step_hooks():
    """YOLOv5's callbacks with an action on each per-step hook that hands the loop no tensor to read."""
    from utils.callbacks import Callbacks

    callbacks, calls = Callbacks(), []
    for hook in ("on_train_batch_start", "optimizer_step", "on_before_zero_grad"):
        callbacks.register_action(hook, callback=lambda _hook=hook: calls.append(_hook))
    return callbacks, calls


@pytest.mark.parametrize("hooked", [False, True], ids=["no-callbacks", "step-callbacks"])
def test_a_steady_state_step_reads_only_its_two_decisions_and_the_bar_reads_every_n_batches(hooked):
    step, state, count = tiny_step(), RunState(), 2 * REPORT_EVERY + 3
    loader = batches(count)
    callbacks, calls = step_hooks() if hooked else (None, [])
    train_one_epoch(step, loader[:2], state, 1, torch.device("cpu"), lambda *args: 1)  # warm-up, not counted
    state = RunState()
    with HostReads() as reads:
        stats = train_one_epoch(step, loader, state, 1, torch.device("cpu"), lambda *args: 1, callbacks=callbacks)
    assert stats.iterations == count and state.loss_batches == count
    assert len(calls) == (3 * count if hooked else 0)  # the hooks ran at every step, and added no read
    places = reads.by_place()
    assert places.pop("utils/trainer/loop.py:_forward_backward") == count  # is the loss finite? (skip the step)
    assert places.pop("utils/trainer/loop.py:optimizer_step") == count  # are the gradients finite?
    bar = places.pop("utils/trainer/loop.py:train_one_epoch")
    assert bar <= math.ceil(count / REPORT_EVERY) + 3  # first batch, every N, the last, the epoch's sums
    assert places == {}  # nothing else reads: the loss, EMA and optimizer stay on the device


def test_the_sums_a_checkpoint_records_mid_epoch_are_the_batches_trained_so_far():
    step, state = tiny_step(), RunState()
    seen = []

    def at_step_boundary():  # what a mid-epoch checkpoint writes (RunState.to_dict), after each optimizer step
        seen.append((state.to_dict()["loss_batches"], state.to_dict()["loss_sums"]))
        return False

    stats = train_one_epoch(step, batches(5), state, 1, torch.device("cpu"), lambda *args: 1, at_step_boundary)
    assert [batches_done for batches_done, _ in seen] == [1, 2, 3, 4]  # not after the last: the epoch ends there
    assert all(isinstance(value, float) for _, sums in seen for value in sums)
    assert all(later[1][0] > earlier[1][0] for earlier, later in zip(seen, seen[1:]))  # box loss sums grow
    assert torch.equal(torch.tensor(state.loss_sums) / 5, stats.mean_losses)
    assert isinstance(state.loss_sums, list)  # plain data again once the epoch ends


def test_the_profile_script_times_each_phase_of_the_real_loop(tmp_path):
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, make_tiny_dataset

    data = make_tiny_dataset(tmp_path / "data")
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_MODEL_YAML)
    output = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "benchmarks/profile_train_step.py", "--data", str(data), "--cfg", str(cfg),
                           "--imgsz", "64", "--batch-size", "2", "--steps", "4", "--top", "3", "--hold", "2",
                           "--json", str(output)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(output.read_text())
    assert result["batch"] == 2 and result["steps"] == 4 and result["images_per_s"] > 0
    # in the loop's order; no optimizer step in these 4 (accumulate: 64 / 2 = 32 batches a step)
    assert list(result["phases"]) == ["data", "copy", "forward", "loss", "backward", "logging"]
    assert all(times["host_ms"] >= 0 and times["gpu_ms"] is None for times in result["phases"].values())
    assert result["host_reads_per_step"]["utils/trainer/loop.py:_forward_backward"] == 1.0
    assert "phase        host ms" in done.stdout


def test_cuda_kernels_are_told_apart_by_family():
    """profile_train_step's GPU time by kernel family, on kernel names as cuDNN 9 and torch's CUDA kernels carry them."""
    from benchmarks.profile_train_step import kernel_family

    named = {
        "sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x64": "convolution",
        "sm90_xmma_dgrad_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc": "convolution, input gradient",
        "sm80_xmma_wgrad_implicit_gemm_indexed_f16f16_f16f32_f32_nhwckrsc_nhwc": "convolution, weight gradient",
        "void cudnn::bn_fw_tr_1C11_kernel_NCHW<__half, float, 512, true, 1>(cudnnTensorStruct)": "BatchNorm",
        "void cudnn::bn_bw_1C11_singleread<__half, 512, true, 1, 2, 0>(float, float)": "BatchNorm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel(at::"
        "TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda(c10::Half)#1}>": "SiLU",
        "void cudnn::ops::nchwToNhwcKernel<__half, __half, float, false, true>(cudnn::ops::nchw2nhwc_params_t<float>)":
            "layout conversions",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig<c10::Half, unsigned int, 4, 64, 64>":
            "upsample / concat / pooling",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<3>>": "foreach (optimizer, EMA, clipping)",
        "Memcpy HtoD (Pinned -> Device)": "copies / fills",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float>>>":
            "reductions",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "other elementwise",
        "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64": "GEMM",
        "some_kernel_nobody_named": "other",
    }
    assert {name: kernel_family(name) for name in named} == named


def test_kernel_time_is_summed_per_family_from_device_events_only():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.profile_train_step import kernel_time_by_family

    events = [SimpleNamespace(device_type=DeviceType.CUDA, key="sm90_xmma_fprop_a", self_device_time_total=3000.0),
              SimpleNamespace(device_type=DeviceType.CPU, key="aten::cudnn_convolution", self_device_time_total=9e9),
              SimpleNamespace(device_type=DeviceType.CUDA, key="cudnn::bn_fw_tr", self_device_time_total=1000.0),
              SimpleNamespace(device_type=DeviceType.CUDA, key="sm90_xmma_fprop_b", self_device_time_total=1000.0)]
    figures = kernel_time_by_family(events, steps=2)  # the operators' CUDA time would count the kernels twice
    assert figures == {"convolution": 2.0, "BatchNorm": 0.5} and list(figures) == ["convolution", "BatchNorm"]


def test_the_costliest_kernels_of_the_open_families_are_named():
    """profile_train_step lists the costliest kernels of the families a name leaves open (copies and fills, other
    elementwise, other), each summed over its events, ms per step, largest first."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.profile_train_step import top_kernels

    def event(key, micros):
        return SimpleNamespace(device_type=DeviceType.CUDA, key=key, self_device_time_total=micros)

    events = [event("void at::native::direct_copy_kernel_cuda", 4000.0), event("Memset (Device)", 1000.0),
              event("void at::native::direct_copy_kernel_cuda", 2000.0), event("sm90_xmma_fprop_a", 9000.0),
              event("some_kernel_nobody_named", 500.0), event("Memcpy HtoD (Pinned -> Device)", 200.0),
              SimpleNamespace(device_type=DeviceType.CPU, key="aten::copy_", self_device_time_total=9e9)]
    found = top_kernels(events, steps=2, count=2, width=30)
    assert found == {"copies / fills": [("void at::native::direct_copy_k", 3.0), ("Memset (Device)", 0.5)],
                     "other": [("some_kernel_nobody_named", 0.25)]}
