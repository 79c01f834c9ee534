"""Precision choice: bf16 autocast on CPUs with native bf16, AMX or AVX512-BF16 (training and inference), and bf16 runs that work anywhere."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import yaml

from tests.conftest import NO_CUDA, TINY_MODEL_YAML, make_tiny_dataset
from utils import precision
from utils.precision import cpu_bf16_choice, inference_autocast, inference_dtype
from utils.trainer import amp
from utils.trainer.amp import choose_precision

CPU = torch.device("cpu")
AMX = {"avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_tile": True, "amx_bf16": True, "amx_int8": True}
AVX512_BF16 = {"avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_tile": False, "amx_bf16": False}
AVX2 = {"avx2": True, "avx512_f": False, "avx512_bf16": False, "amx_tile": False, "amx_bf16": False}


@pytest.fixture
def cpu_with(monkeypatch):
    """Make torch report the given CPU capabilities (and the OS grant AMX when ``permitted``)."""
    def install(capabilities: dict, permitted: bool = True):
        monkeypatch.setattr(precision, "cpu_capabilities", lambda: dict(capabilities))
        monkeypatch.setattr(precision, "amx_permitted", lambda: permitted)
    return install


def tiny_model():
    from models.yolo import DetectionModel
    torch.manual_seed(0)
    return DetectionModel(yaml.safe_load(TINY_MODEL_YAML))


@pytest.mark.parametrize("capabilities, permitted, expected, reason", [
    (AMX, True, True, "AMX"),
    (AMX, False, True, "AVX512-BF16; AMX present but the OS did not grant"),
    ({**AMX, "avx512_bf16": False}, False, False, "AMX present but the OS did not grant"),
    (AVX512_BF16, True, True, "AVX512-BF16"),
    (AVX2, True, False, "no native bf16 (AMX or AVX512-BF16): AVX2"),
    ({"amx_tile": True, "amx_bf16": False, "avx512_f": True}, True, False, "no native bf16 (AMX or AVX512-BF16): AVX-512"),
    ({}, True, False, "CPU capabilities unknown"),
])
def test_cpu_bf16_choice(cpu_with, capabilities, permitted, expected, reason):
    cpu_with(capabilities, permitted)
    use_bf16, why = cpu_bf16_choice()
    assert use_bf16 is expected and why.startswith(reason)


def test_cpu_bf16_choice_follows_this_cpus_capabilities():
    capabilities = dict(torch.cpu.get_capabilities())
    use_bf16, reason = cpu_bf16_choice()
    has_amx = bool(capabilities.get("amx_tile") and capabilities.get("amx_bf16"))
    native = (has_amx and precision.amx_permitted()) or bool(capabilities.get("avx512_bf16"))
    assert use_bf16 == native
    if not has_amx and not capabilities.get("avx512_bf16"):
        assert reason.startswith("no native bf16")


@pytest.mark.parametrize("capabilities, amp_flag, dtype, line", [
    (AMX, "auto", torch.bfloat16, "AMP: bf16 autocast on cpu (AMX)"),
    (AVX512_BF16, "auto", torch.bfloat16, "AMP: bf16 autocast on cpu (AVX512-BF16)"),
    (AVX2, "auto", None, "AMP: training in fp32 on cpu (no native bf16 (AMX or AVX512-BF16): AVX2)"),
    ({}, "auto", None, "AMP: training in fp32 on cpu (CPU capabilities unknown to this torch)"),
    (AMX, "off", None, "AMP: training in fp32 on cpu (--amp off)"),
    (AVX2, "bf16", torch.bfloat16, "AMP: bf16 autocast on cpu (--amp bf16)"),
])
def test_training_precision_choice_and_its_line(cpu_with, caplog, capabilities, amp_flag, dtype, line):
    cpu_with(capabilities)
    with caplog.at_level("INFO"):
        choice = choose_precision(amp_flag, CPU, torch.nn.Conv2d(3, 4, 3))
    assert choice.dtype == dtype and not choice.scaler.is_enabled()
    assert line in caplog.text


@pytest.mark.parametrize("native", [True, False])
def test_forced_bf16_warns_only_on_cpus_without_native_bf16(cpu_with, monkeypatch, caplog, native):
    cpu_with(AVX2)
    monkeypatch.setattr(amp, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    with caplog.at_level("WARNING"):
        assert choose_precision("bf16", CPU, torch.nn.Conv2d(3, 4, 3)).dtype == torch.bfloat16
        with inference_autocast(CPU, amp="bf16"):
            pass
    assert caplog.text.count("no native bf16") == (0 if native else 2)


@pytest.mark.parametrize("capabilities, device, half, amp_flag, dtype, reason", [
    (AMX, "cpu", False, "auto", torch.bfloat16, "bf16 autocast (AMX)"),
    (AVX512_BF16, "cpu", False, "auto", torch.bfloat16, "bf16 autocast (AVX512-BF16)"),
    (AVX2, "cpu", False, "auto", None, "fp32 (no native bf16 (AMX or AVX512-BF16): AVX2)"),
    (AMX, "cpu", False, "off", None, "fp32 (--amp off)"),
    (AVX2, "cpu", False, "bf16", torch.bfloat16, "bf16 autocast (--amp bf16)"),
    (AMX, "cpu", True, "fp16", None, "fp32 (fp16 needs CUDA)"),
    (AMX, "cuda", True, "auto", None, "fp16 (--half)"),
    (AMX, "cuda", False, "auto", None, "fp32"),
])
def test_inference_dtype(cpu_with, capabilities, device, half, amp_flag, dtype, reason):
    cpu_with(capabilities)
    assert inference_dtype(torch.device(device), half, amp_flag) == (dtype, reason)


def test_inference_dtype_rejects_unknown_amp():
    with pytest.raises(ValueError, match="--amp must be one of"):
        inference_dtype(CPU, amp="fast")


def test_inference_autocast_runs_convolutions_in_the_chosen_dtype(cpu_with, caplog):
    conv = torch.nn.Conv2d(3, 4, 3)
    image = torch.rand(1, 3, 8, 8)
    cpu_with(AMX)
    with caplog.at_level("INFO"), inference_autocast(CPU, half=True):
        assert conv(image).dtype == torch.bfloat16
    assert "Inference: bf16 autocast (AMX) on cpu" in caplog.text and "--half is CUDA fp16 only" in caplog.text
    cpu_with(AVX2)
    with inference_autocast("cpu"):
        assert conv(image).dtype == torch.float32


def test_bf16_training_step_gives_finite_loss(cpu_with):
    from utils.config import Hyp
    from utils.loss import DetectionLoss
    from utils.trainer.loop import TrainStep

    cpu_with(AMX)  # the auto choice on an AMX CPU; bf16 itself runs on any CPU, only slower
    model = tiny_model().train().to(memory_format=torch.channels_last)
    choice = choose_precision("auto", CPU, model)
    assert choice.dtype == torch.bfloat16
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = TrainStep(model, optimizer, DetectionLoss(model, Hyp(), imgsz=64), choice, ema=None, channels_last=True)
    before = copy.deepcopy(model.state_dict())
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[0, 0, 0.5, 0.5, 0.4, 0.3], [1, 1, 0.3, 0.6, 0.2, 0.2]])
    raw_dtypes = []
    model.model[-1].register_forward_hook(lambda module, inputs, output: raw_dtypes.append(output[0].dtype))
    items, finite = step.forward_backward(images, targets)
    assert raw_dtypes == [torch.bfloat16] and finite and torch.isfinite(items).all() and items.sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    step.optimizer_step()
    after = model.state_dict()
    assert all(torch.isfinite(value.float()).all() for value in after.values())
    assert any(not torch.equal(before[name], after[name]) for name in before)


@pytest.fixture(scope="module")
def val_loader(tmp_path_factory):
    from utils.data.dataset_yaml import load_data_config
    from utils.data.loader import create_dataloader
    config = load_data_config(make_tiny_dataset(tmp_path_factory.mktemp("amp") / "data", num_train=1, num_val=4))
    return create_dataloader(config.val, 64, 2, 32, rect=True, pad=0.5, workers=0, names=config.names)[0]


def test_bf16_validation_pass_gives_finite_metrics_close_to_fp32(cpu_with, val_loader):
    from models import for_inference
    from utils.config import Hyp
    from utils.loss import DetectionLoss
    from utils.validation import validate

    model = tiny_model()
    compute_loss = DetectionLoss(model, Hyp(), imgsz=64)
    model = for_inference(model.eval())
    raw_dtypes = []
    model.model[-1].register_forward_hook(lambda module, inputs, output: raw_dtypes.append(output[1][0].dtype))
    names = ["class0", "class1"]
    reference = validate(model, val_loader, names, CPU, compute_loss=compute_loss, plots=False)
    cpu_with(AMX)
    with inference_autocast(CPU, amp="auto"):
        result = validate(model, val_loader, names, CPU, compute_loss=compute_loss, plots=False)
    assert set(raw_dtypes[:len(val_loader)]) == {torch.float32}
    assert set(raw_dtypes[len(val_loader):]) == {torch.bfloat16}
    assert all(math.isfinite(value) for value in (result.mp, result.mr, result.map50, result.map, result.fitness))
    assert result.seen == reference.seen == 4
    losses, expected = torch.tensor(result.losses), torch.tensor(reference.losses)
    assert torch.isfinite(losses).all() and torch.allclose(losses, expected, rtol=0.05, atol=1e-3)


def test_amx_permission_request(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: True, raising=False)
    assert precision.amx_permitted()
    monkeypatch.delattr(torch.cpu, "_init_amx")
    assert precision.amx_permitted()  # this torch cannot ask: cpuinfo's answer stands

    def refuse():
        raise RuntimeError("arch_prctl failed")
    monkeypatch.setattr(torch.cpu, "_init_amx", refuse, raising=False)
    assert not precision.amx_permitted()


@pytest.mark.parametrize("amp_flag, dtype", [("bf16", torch.bfloat16), ("off", torch.float32)])
def test_validation_during_training_runs_in_the_training_precision(tmp_path, val_loader, amp_flag, dtype):
    from models import for_inference
    from utils.config import Hyp
    from utils.loss import DetectionLoss
    from utils.trainer.stages import validate_epoch

    model = tiny_model()
    compute_loss = DetectionLoss(model, Hyp(), imgsz=64)
    choice = choose_precision(amp_flag, CPU, model)
    model = for_inference(model.eval())
    raw_dtypes = []
    model.model[-1].register_forward_hook(lambda module, inputs, output: raw_dtypes.append(output[1][0].dtype))
    result = validate_epoch(model, val_loader, ["class0", "class1"], CPU, compute_loss, tmp_path, plots=False,
                            precision=choice)
    assert set(raw_dtypes) == {dtype} and len(raw_dtypes) == len(val_loader)
    assert result.seen == 4 and math.isfinite(result.fitness) and all(math.isfinite(v) for v in result.losses)
    assert not torch.is_autocast_enabled("cpu")  # the autocast ends with the validation


def test_exported_models_run_without_autocast(cpu_with, caplog):
    # a traced graph under bf16 autocast would compute (and decode boxes) in bf16: exported files keep their precision
    conv = torch.nn.Conv2d(3, 4, 3)
    cpu_with(AMX)
    with caplog.at_level("INFO"), inference_autocast("cpu", amp="bf16", exported="torchscript"):
        assert conv(torch.rand(1, 3, 8, 8)).dtype == torch.float32
    assert "Inference: torchscript runs in the precision it was exported in (no autocast) on cpu" in caplog.text
    with inference_autocast("cpu", amp="bf16"):
        assert conv(torch.rand(1, 3, 8, 8)).dtype == torch.bfloat16


def autocast_step(model, images, device_type: str, dtype):
    """A training forward under autocast and a backward of its outputs' sum: (outputs, {name: gradient})."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(device_type, dtype=dtype):
        outputs = model(images)
    sum(output.float().sum() for output in outputs).backward()
    return [o.detach() for o in outputs], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def with_torch_upsampling(model):
    """A copy of ``model`` whose upsamplings are torch's nn.Upsample (autocast's policy applies to them)."""
    from models.common import Upsample

    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, Upsample):
            module.__class__ = torch.nn.Upsample
    return twin


def yolov5n(device):
    from models.yolo import DetectionModel

    torch.manual_seed(0)
    return DetectionModel("models/yolov5n.yaml", nc=3).to(device).train()


def test_upsampling_on_the_cpu_is_torchs_to_the_bit_under_autocast():
    """models.common.Upsample steps out of CUDA's autocast in nearest mode (which would run it in float32; its CUDA
    dispatch is tests/test_cuda_forward_ops.py's). On the CPU, whose autocast runs it in the input's dtype anyway, a
    bf16 training step of yolov5n is the same to the bit as with torch's nn.Upsample; other modes are left to
    autocast."""
    from models.common import Upsample

    x = torch.randn(2, 4, 5, 6).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = Upsample(None, 2, "nearest")(x)
        bilinear = Upsample(None, 2, "bilinear")(x.float())
        expected_bilinear = torch.nn.Upsample(None, 2, "bilinear")(x.float())
    assert out.dtype == torch.bfloat16 and torch.equal(out, x.repeat_interleave(2, 2).repeat_interleave(2, 3))
    assert bilinear.dtype == expected_bilinear.dtype and torch.equal(bilinear, expected_bilinear)
    model = yolov5n(CPU)
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    outputs, grads = autocast_step(model, images, "cpu", torch.bfloat16)
    outputs_torch, grads_torch = autocast_step(with_torch_upsampling(model), images, "cpu", torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(outputs, outputs_torch))
    assert grads.keys() == grads_torch.keys() and all(torch.equal(grads[k], grads_torch[k]) for k in grads)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_on_cuda_fp16_upsampling_gives_the_same_forward_and_gradients_within_fp16s_own_error():
    """CUDA fp16: the forward with nearest upsampling in fp16 equals autocast's float32 upsampling to the bit (the
    values are copies); the gradients differ only where the two gradients of a concatenation are added in fp16, by a
    small part of what fp16 itself changes against float32 (all gradients as one vector). On the CPU in bf16 the
    same comparison gave 1.7% against bf16's own 57% (yolov5n at init, the outputs' sum as the loss: much
    cancellation), so a quarter leaves a wide margin."""
    device = torch.device("cuda", 0)
    model = yolov5n(device).to(memory_format=torch.channels_last)
    images = torch.rand(4, 3, 128, 128, device=device).contiguous(memory_format=torch.channels_last)
    outputs, grads = autocast_step(model, images, "cuda", torch.float16)
    outputs_torch, grads_torch = autocast_step(with_torch_upsampling(model), images, "cuda", torch.float16)
    model.zero_grad(set_to_none=True)
    sum(output.sum() for output in model(images)).backward()
    reference = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert all(torch.equal(a, b) for a, b in zip(outputs, outputs_torch))
    flat = [torch.cat([g[name].flatten() for name in sorted(reference)]) for g in (grads, grads_torch, reference)]
    assert (flat[0] - flat[1]).norm() <= 0.25 * (flat[1] - flat[2]).norm()
