"""The CUDA branches: device selection, fp16 autocast with GradScaler (a step, an inf step skipped), a process
group of one process (NCCL), SyncBatchNorm, the pinned-memory loader, --half validation against fp32, CUDA
random state across a resume, AutoBatch's real memory probe; and what benchmarks/gpu_check.py does without a GPU.

Each test takes the device as a parameter and runs the same code on both: the ``cpu`` case always runs (with
CUDA-only calls replaced by fakes where the branch needs them), the ``cuda`` case is marked ``cuda`` and skipped
without a GPU (``python -m pytest -m cuda`` runs those alone; benchmarks/gpu_check.py runs them on a GPU).
"""
from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as torch_dist
import yaml
from torch import nn

from tests.conftest import CUDA_ONLY, NO_CUDA, TINY_MODEL_YAML, make_tiny_dataset, make_tiny_run
from utils import dist

DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]
HALF_TOLERANCE = {"confidence": 2e-2, "box_px": 0.5, "map": 0.01}  # fp16 against fp32, see the half test


def tiny_model(seed: int = 0):
    from models.yolo import DetectionModel

    torch.manual_seed(seed)
    return DetectionModel(yaml.safe_load(TINY_MODEL_YAML))


def tiny_batch(device, size: int = 64, batch: int = 2):
    generator = torch.Generator().manual_seed(1)
    images = torch.rand(batch, 3, size, size, generator=generator)
    targets = torch.tensor([[0, 0, 0.5, 0.5, 0.4, 0.3], [1, 1, 0.3, 0.6, 0.2, 0.5]])  # image, class, cx, cy, w, h
    return images.to(device), targets.to(device)


def parameters(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------- device selection
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_device_selection_on_a_gpu():
    from utils.device import DeviceError, select_device

    assert select_device("0") == torch.device("cuda", 0) == select_device("") == select_device("cuda:0")
    assert select_device("0", local_rank=0) == torch.device("cuda", 0)
    assert torch.ones(1, device=select_device("0")).device.type == "cuda"
    with pytest.raises(DeviceError, match="does not exist"):
        select_device(str(torch.cuda.device_count()))


def test_device_selection_cuda_branches_with_a_fake_gpu_count(monkeypatch):
    from utils.device import DeviceError, select_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert select_device("1") == torch.device("cuda", 1) == select_device("0,1", local_rank=1)
    assert select_device("") == torch.device("cuda", 0) and select_device("", local_rank=1) == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match="GPU 2 does not exist \\(this machine has 2\\)"):
        select_device("2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="CUDA is not available \\(use --device cpu\\)"):
        select_device("0")
    assert select_device("") == torch.device("cpu")


# ---------------------------------------------------------------------- mixed precision
@pytest.mark.parametrize("device", DEVICES)
def test_scaled_step_then_an_inf_step_skipped_and_a_nan_loss_skipped(device):
    """fp16 autocast + GradScaler on CUDA (after the self-check), the same scaler logic with bf16 autocast on the
    CPU: a step changes the weights; an inf gradient (an fp16 overflow) is skipped by the scaler, which halves its
    scale, and leaves the weights untouched; a NaN loss is skipped before backward; training then goes on."""
    from utils.config import Hyp
    from utils.loss import DetectionLoss
    from utils.trainer.amp import Precision, choose_precision
    from utils.trainer.ema import ModelEMA
    from utils.trainer.loop import TrainStep
    from utils.trainer.optim import build_optimizer

    device = torch.device(device)
    model = tiny_model().to(device).train()
    if device.type == "cuda":
        precision = choose_precision("auto", device, model)
        assert precision.name == "fp16" and precision.scaler.is_enabled()
    else:
        precision = Precision("cpu", torch.bfloat16, None)
    # a small starting scale: the first steps of this test must not overflow by themselves
    precision.scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10)
    step = TrainStep(model, build_optimizer(model, lr=0.01), DetectionLoss(model, Hyp(), imgsz=64), precision,
                     ModelEMA(model))
    images, targets = tiny_batch(device)
    start = parameters(model)
    assert step.forward_backward(images, targets)[1]
    step.optimizer_step()
    after_step = parameters(model)
    assert any(not torch.equal(a, b) for a, b in zip(start, after_step))

    assert step.forward_backward(images, targets)[1]
    next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("inf"))
    scale = precision.scaler.get_scale()
    step.optimizer_step()
    assert all(torch.equal(a, b) for a, b in zip(after_step, parameters(model)))  # skipped: not corrupted
    assert precision.scaler.get_scale() == scale / 2

    finite = step.forward_backward(torch.full_like(images, float("nan")), targets)[1]
    assert not finite and step.counters.nonfinite_total == 1
    assert all(p.grad is None for p in model.parameters())
    assert step.forward_backward(images, targets)[1]
    step.optimizer_step()
    final = parameters(model)
    assert any(not torch.equal(a, b) for a, b in zip(after_step, final))
    assert all(torch.isfinite(p).all() for p in final + parameters(step.ema.ema))


@pytest.mark.parametrize("device", DEVICES)
def test_an_inf_gradient_without_a_scaler_is_skipped(device, caplog):
    """fp32 (--amp off) and bf16 train without a GradScaler: a non-finite gradient skips the optimizer step and the
    EMA update instead of clipping it into NaN weights; the next finite step trains."""
    from utils.config import Hyp
    from utils.loss import DetectionLoss
    from utils.trainer.amp import Precision
    from utils.trainer.ema import ModelEMA
    from utils.trainer.loop import TrainStep
    from utils.trainer.optim import build_optimizer

    device = torch.device(device)
    model = tiny_model().to(device).train()
    precision = Precision(device.type, None, torch.amp.GradScaler(device.type, enabled=False))
    step = TrainStep(model, build_optimizer(model, lr=0.01), DetectionLoss(model, Hyp(), imgsz=64), precision,
                     ModelEMA(model))
    images, targets = tiny_batch(device)
    start, ema_start = parameters(model), parameters(step.ema.ema)
    assert step.forward_backward(images, targets)[1]
    next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("inf"))
    step.optimizer_step()
    assert all(torch.equal(a, b) for a, b in zip(start, parameters(model)))
    assert all(torch.equal(a, b) for a, b in zip(ema_start, parameters(step.ema.ema))) and step.ema.updates == 0
    assert "Non-finite gradient at iteration 0: optimizer step skipped" in caplog.text
    assert all(p.grad is None for p in model.parameters())
    assert step.forward_backward(images, targets)[1]
    step.optimizer_step()
    assert any(not torch.equal(a, b) for a, b in zip(start, parameters(model)))
    assert all(torch.isfinite(p).all() for p in parameters(model))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaled", [False, True])
def test_steps_skipped_for_nonfinite_gradients_are_counted_and_stop_the_run(device, scaled, caplog):
    """A NaN/inf gradient skips the optimizer step (by the GradScaler under fp16, by the clip norm's check
    without one); the skips are counted, a finite step resets the count in a row, and MAX_NONFINITE_IN_ROW
    skips in a row stop the run with one line (as a loss that stays NaN does)."""
    from utils.config import Hyp
    from utils.errors import TrainingDiverged
    from utils.loss import DetectionLoss
    from utils.trainer.amp import Precision
    from utils.trainer.loop import MAX_NONFINITE_IN_ROW, NonFiniteGradientError, TrainStep
    from utils.trainer.optim import build_optimizer

    device = torch.device(device)
    model = tiny_model().to(device).train()
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10, enabled=scaled)
    precision = Precision(device.type, torch.float16 if scaled and device.type == "cuda" else None, scaler)
    step = TrainStep(model, build_optimizer(model, lr=0.01), DetectionLoss(model, Hyp(), imgsz=64), precision, None)
    images, targets = tiny_batch(device)

    def overflowing_step():
        assert step.forward_backward(images, targets)[1]
        next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("nan"))
        step.optimizer_step()
        step.counters.global_step += 1

    for _ in range(3):
        overflowing_step()
    assert (step.counters.skipped_steps_in_row, step.counters.skipped_steps_total) == (3, 3)
    assert "optimizer step skipped" in caplog.text and "(3 in a row, 3 in total)" in caplog.text
    assert step.forward_backward(images, targets)[1]
    step.optimizer_step()  # a finite step trains and resets the count in a row
    assert (step.counters.skipped_steps_in_row, step.counters.skipped_steps_total) == (0, 3)
    for _ in range(MAX_NONFINITE_IN_ROW - 1):
        overflowing_step()
    with pytest.raises(NonFiniteGradientError) as stopped:
        overflowing_step()
    assert isinstance(stopped.value, TrainingDiverged)  # --evolve records it as the hyperparameters' failure
    message = str(stopped.value)
    assert "\n" not in message and f"NaN/inf at {MAX_NONFINITE_IN_ROW} optimizer steps in a row" in message
    assert step.counters.skipped_steps_total == 3 + MAX_NONFINITE_IN_ROW


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_choice_follows_the_self_check(device, monkeypatch):
    from utils.trainer import amp

    model = tiny_model()
    if device == "cuda":
        assert amp.fp16_self_check(model, torch.device("cuda", 0)) is True
    else:  # the CUDA branch of the choice, with the self-check's answer given
        for passed, expected in ((True, torch.float16), (False, None)):
            monkeypatch.setattr(amp, "fp16_self_check", lambda *args, passed=passed: passed)
            assert amp.accelerator_training_dtype("auto", torch.device("cuda", 0), model)[0] is expected
        assert amp.accelerator_training_dtype("off", torch.device("cuda", 0), model) == (None, "--amp off")


# ---------------------------------------------------------------------- one process group
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("device", DEVICES)
def test_a_process_group_of_one_process(device, monkeypatch):
    """torchrun --nproc_per_node 1: a real process group (NCCL on a GPU, gloo on the CPU) whose broadcasts and
    reductions go through the backend, as with more processes."""
    from utils.trainer import setup_process

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    calls = []
    for name in ("all_reduce", "broadcast", "broadcast_object_list", "all_gather_object"):
        original = getattr(torch_dist, name)
        monkeypatch.setattr(torch_dist, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    threads = torch.get_num_threads()
    try:
        selected = setup_process("0" if device == "cuda" else "cpu")
        assert dist.dist_info().distributed and torch_dist.is_initialized()
        assert torch_dist.get_backend() == ("nccl" if device == "cuda" else "gloo")
        assert dist.broadcast_object({"batch": 16}) == {"batch": 16}
        assert dist.all_reduce_sum(torch.tensor([2.0, 3.0], device=selected)).tolist() == [2.0, 3.0]
        assert dist.all_reduce_max([3, 1]) == [3, 1]
        assert dist.gather_object(5) == [5]
        tensors = [torch.arange(3.0, device=selected)]
        dist.broadcast_tensors(tensors)
        assert tensors[0].tolist() == [0.0, 1.0, 2.0]
        dist.barrier("finish the test")
        assert {"all_reduce", "broadcast", "broadcast_object_list", "all_gather_object"} <= set(calls)
    finally:
        dist.cleanup()
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("device, extra", [("cpu", ()), pytest.param("cuda", (), marks=CUDA_ONLY),
                                           pytest.param("cuda", ("--augment-device", "--workers", "2"),
                                                        marks=CUDA_ONLY)])
def test_torchrun_with_one_process_trains_in_a_process_group(device, extra, tmp_path):
    """torchrun --nproc_per_node 1 train.py --sync-bn: the process group (NCCL on a GPU, gloo on the CPU), DDP and
    SyncBatchNorm are used as with more processes (YOLOv5 does the same), and the run finishes; on a GPU also with
    --augment-device, the plans from 2 workers rendered on the process's own GPU (tests/test_ddp.py runs it under
    gloo with 2 processes)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    data, cfg = make_tiny_run(tmp_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
               str(free_port()), str(ROOT / "train.py"), "--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64",
               "--batch-size", "4", "--epochs", "1", "--workers", "0", "--noautoanchor", "--noplots", "--sync-bn",
               "--device", "0" if device == "cuda" else "cpu", "--project", str(tmp_path / "runs"), *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert f"backend {'nccl' if device == 'cuda' else 'gloo'}" in output
    assert "Using SyncBatchNorm" in output and "identical on all 1 processes" in output
    opt = yaml.safe_load((tmp_path / "runs" / "exp" / "opt.yaml").read_text())
    assert opt["augment_device"] is ("--augment-device" in extra)


# ---------------------------------------------------------------------- SyncBatchNorm
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_sync_batchnorm_conversion_keeps_every_value(device, target):
    """convert_sync_batchnorm for a CUDA run (torch's SyncBatchNorm) and a CPU run (ours): every BatchNorm is
    converted, with its parameters and running statistics; in eval mode the outputs are unchanged."""
    from utils.trainer.sync_bn import CPUSyncBatchNorm, convert_sync_batchnorm

    model = tiny_model()
    batchnorms = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    converted = convert_sync_batchnorm(copy.deepcopy(model), torch.device(target))
    kind = nn.SyncBatchNorm if target == "cuda" else CPUSyncBatchNorm
    assert sum(isinstance(m, kind) for m in converted.modules()) == batchnorms > 0
    assert not any(isinstance(m, nn.BatchNorm2d) and not isinstance(m, kind) for m in converted.modules())
    reference, synced = model.state_dict(), converted.state_dict()
    assert reference.keys() == synced.keys() and all(torch.equal(reference[k], synced[k]) for k in reference)
    if target == "cuda" and device == "cpu":
        return  # torch's SyncBatchNorm computes on GPUs only
    images = tiny_batch(device)[0]
    with torch.no_grad():
        expected = model.to(device).eval()(images)[0]
        assert torch.allclose(converted.to(device).eval()(images)[0], expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------- loader
@pytest.mark.parametrize("device", DEVICES)
def test_the_loader_pins_memory_exactly_when_cuda_is_there(device, tmp_path, monkeypatch):
    from utils.data.loader import create_dataloader

    make_tiny_dataset(tmp_path, num_train=4, num_val=1)
    sources = [str(tmp_path / "images" / "train")]
    if device == "cpu":  # the CUDA decision with a fake answer; pinning itself needs a GPU, so no batch is read
        for available in (True, False):
            monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
            loader, _ = create_dataloader(sources, 64, 2, 32, workers=2, names=["class0", "class1"])
            assert loader.pin_memory is available and loader.slots is not None  # reused buffers either way
        return
    import gc

    from utils.data.loader import set_loader_epoch

    loader, _ = create_dataloader(sources, 64, 2, 32, workers=2, names=["class0", "class1"])
    reference, _ = create_dataloader(sources, 64, 2, 32, workers=0, names=["class0", "class1"])
    for epoch in range(4):  # 8 batches through 2 workers' reused slots: each comes back once its batch is pinned
        set_loader_epoch(loader, epoch)
        set_loader_epoch(reference, epoch)
        for (images, targets, _, _), (expected, expected_targets, _, _) in zip(loader, reference, strict=True):
            assert loader.pin_memory and images.is_pinned()
            on_gpu = images.to(device, non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(on_gpu.cpu(), expected) and torch.equal(targets, expected_targets)
    del images
    gc.collect()
    assert loader.slots.flags.sum() == 0  # no batch holds a slot any more


# ---------------------------------------------------------------------- --half
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from utils.checkpoint import model_state, save_checkpoint

    root = tmp_path_factory.mktemp("half")
    data = make_tiny_dataset(root, num_train=2, num_val=4)
    path = root / "tiny.pt"
    save_checkpoint({"format": "yolo-trainer/1", "model": model_state(tiny_model()), "ema": None}, path)
    return data, path


@pytest.mark.parametrize("device", DEVICES)
def test_half_validation_agrees_with_fp32(device, tiny_checkpoint):
    """val.py --half against fp32 on the same weights: confidences within 2e-2, boxes within 0.5 px (64 px inputs),
    mAP within 0.01 (HALF_TOLERANCE). On the CPU --half is dropped (fp16 is CUDA only): the same numbers."""
    import val
    from models.backends import load_backend

    from models import is_channels_last
    from utils.validation import model_dtype, model_input

    data, path = tiny_checkpoint
    images = (tiny_batch("cpu")[0] * 255).round().to(torch.uint8)  # a loader batch
    outputs = {}
    for half in (False, True):
        backend = load_backend(path, device=torch.device(device), half=half and device == "cuda")
        assert model_dtype(backend) == (torch.float16 if half and device == "cuda" else torch.float32)
        with torch.no_grad():  # fed as val.py feeds it: fp16 images to fp16 weights
            batch = model_input(images, torch.device(device), model_dtype(backend), is_channels_last(backend))
            outputs[half] = backend(batch)[0].float()
    assert outputs[True].shape == outputs[False].shape
    if device == "cpu":
        assert torch.equal(outputs[True], outputs[False])
    else:
        assert (outputs[True][..., 4:] - outputs[False][..., 4:]).abs().max() <= HALF_TOLERANCE["confidence"]
        assert (outputs[True][..., :4] - outputs[False][..., :4]).abs().max() <= HALF_TOLERANCE["box_px"]
    results = [val.run(data=str(data), weights=str(path), imgsz=64, batch_size=4, workers=0,
                       device="0" if device == "cuda" else "cpu", half=half,
                       plots=False, project=str(data.parent / "runs"), amp="off") for half in (False, True)]
    for key in ("mp", "mr", "map50", "map"):
        difference = abs(getattr(results[0], key) - getattr(results[1], key))
        assert difference == 0 if device == "cpu" else difference <= HALF_TOLERANCE["map"]


# ---------------------------------------------------------------------- random state and resume
@pytest.mark.parametrize("device", DEVICES)
def test_random_state_saved_and_restored(device, tmp_path, monkeypatch):
    """capture_rng / restore_rng through a checkpoint file (weights_only): the next draws repeat, the CUDA
    generators' included. On the CPU the CUDA calls are fakes that record what is restored."""
    from utils.rng import capture_rng, restore_rng

    restored = []
    if device == "cuda":
        torch.cuda.init()
    else:
        fake = [torch.arange(4, dtype=torch.uint8)]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: fake)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    torch.save(capture_rng(), tmp_path / "rng.pt")
    first = torch.rand(5, device=device)
    state = torch.load(tmp_path / "rng.pt", weights_only=True)
    assert "cuda" in state
    restore_rng(state)
    assert torch.equal(torch.rand(5, device=device), first)
    if device == "cpu":
        assert len(restored) == 1 and torch.equal(restored[0][0], fake[0])
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # another machine: the CUDA state is not forced
        restore_rng(state)
        assert len(restored) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_resume_on_the_gpu_is_bit_exact_with_deterministic(tmp_path, monkeypatch):
    """--device 0 --deterministic: SIGTERM inside epoch 3, then --resume, gives the uninterrupted run's weights,
    EMA, optimizer state and results.csv exactly (CUDA generators restored with the rest)."""
    import train as train_script
    from tests.test_resume import StopAfterEpoch, full_state, max_difference
    from utils.trainer import stages, trainer

    data, cfg = make_tiny_run(tmp_path, num_train=16)
    monkeypatch.setattr(stages, "strip_checkpoint", lambda path: None)

    def args(name):
        return ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size", "2", "--epochs", "4",
                "--device", "0", "--deterministic", "--workers", "0", "--project", str(tmp_path / "runs"),
                "--name", name, "--noautoanchor", "--noplots"]
    assert train_script.main(args("straight")) == 0
    monkeypatch.setattr(trainer, "Callbacks", lambda: StopAfterEpoch(1, "sigterm"))
    assert train_script.main(args("stopped")) == 143
    monkeypatch.undo()
    monkeypatch.setattr(stages, "strip_checkpoint", lambda path: None)
    last = tmp_path / "runs" / "stopped" / "weights" / "last.pt"
    assert train_script.main(["--resume", str(last)]) == 0
    straight = full_state(tmp_path / "runs" / "straight" / "weights" / "last.pt")[0]
    assert max_difference(straight, full_state(last)[0]) == 0.0
    assert ((tmp_path / "runs" / "straight" / "results.csv").read_text()
            == (tmp_path / "runs" / "stopped" / "results.csv").read_text())


# ---------------------------------------------------------------------- smaller CUDA branches
@pytest.mark.parametrize("device", DEVICES)
def test_memory_column(device, monkeypatch):
    from utils.loggers import memory_string

    if device == "cpu":  # the CUDA branch with a fake allocator figure
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 1.5e9)
    text = memory_string(torch.device("cuda", 0))
    assert text == "1.5G" if device == "cpu" else text.endswith("G")


def test_more_processes_than_gpus_is_refused(monkeypatch):
    for key, value in {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(dist.SharedError, match="2 processes on this node but 1 CUDA devices"):
        dist.check_launch(16, torch.device("cuda", 0), device_ids=1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_autobatch_measures_the_real_model_on_the_gpu():
    """The real probe: memory grows with the batch, the fit is positive, and the chosen batch is at least 1."""
    from utils.autobatch import autobatch, training_step_probe
    from utils.device import cuda_memory

    from models.yolo import DetectionModel
    from tests.conftest import ROOT

    device = torch.device("cuda", 0)  # yolov5n at 320: activations of megabytes per image, above the allocator's blocks
    probe = training_step_probe(DetectionModel(str(ROOT / "models" / "yolov5n.yaml"), nc=3), 320, device,
                                torch.float16)
    free = cuda_memory(device)[0]
    choice = autobatch(probe, free, limit=256)
    used = [choice.measured[b] for b in (1, 16)]
    assert used[1] > used[0] > 0 and choice.per_image > 0 and 1 <= choice.batch <= 256


# ---------------------------------------------------------------------- benchmarks/gpu_check.py on this machine
def test_gpu_check_stops_with_one_line_before_its_first_cuda_step(tmp_path, capsys, monkeypatch):
    """Without CUDA: the CPU steps before the gate run, then one 'no CUDA device: ...' line, exit status 3, and
    the report lists every later step as not run."""
    from benchmarks import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    data = make_tiny_dataset(tmp_path / "data")
    status = gpu_check.main(["--data", str(data), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"),
                             "--skip", "reference"])
    out = capsys.readouterr().out.splitlines()
    assert status == gpu_check.EXIT_NO_CUDA == 3
    assert out[1].startswith("environment") and " pass " in out[1] and "8 train, 4 val images" in out[1]
    assert out[2].startswith("no CUDA device: torch ") and out[2].endswith("(run this on a machine with an NVIDIA GPU)")
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| cuda | stop |" in report and "| train_n_amp | not run |" in report and "| reference |" not in report


def test_gpu_check_reads_the_training_and_validation_logs():
    """The figures come from the progress bars' own timing (epochs after the first), the Mem column, and the
    'all' row of val.py (numbers printed as %.3g, 1e-05 included)."""
    from benchmarks.gpu_check_runner import Completed, run_folder, training_figures, val_figures

    def bar(epoch, done, memory="2.5G"):
        return (("%11s" * 2 + "%11.4g" * 5) % (f"{epoch}/3", memory, 0.1, 0.05, 0.02, 40, 640)
                + f": 50%|#####     | {done}/4 [00:01<00:01,  3.00it/s]")
    fragments = [(0.5, "AMP: fp16 autocast on cuda (--amp auto, self-check passed); validation ..."),
                 (0.6, "Logging results to /runs/exp7"), (1.0, bar(1, 0)), (3.0, bar(1, 4, "3.1G")),
                 (4.0, bar(2, 0)), (5.0, bar(2, 4)), (6.0, bar(3, 0)), (7.0, bar(3, 4)),
                 (8.0, ("%22s" + "%11i" * 2 + "%11.3g" * 4) % ("all", 87, 1234, 0.512, 0.6, 0.25, 1.2e-05)),
                 (8.1, "Speed: 0.1ms pre-process, 1.5ms inference, 0.9ms NMS per image at shape (32, 3, 640, 640)")]
    completed = Completed(0, 9.0, fragments)
    figures = training_figures(completed, 64)
    assert figures == {"wall": "9.0 s", "GPU memory (reserved)": "3.10 GB", "train img/s": "64",
                       "precision": "fp16 autocast on cuda"}  # 2 epochs x 64 images in 2 s
    assert run_folder(completed).as_posix() == "/runs/exp7"
    assert val_figures(completed) == {"mAP50": 0.25, "mAP50-95": 1.2e-05,
                                      "speed": "0.1ms pre-process, 1.5ms inference, 0.9ms NMS"}



def test_gpu_check_state_and_deadline_for_short_leases(tmp_path, capsys, monkeypatch):
    """--state: a step that passed in an earlier lease is not run again (unless --only names it), each finished
    step is added as it ends; --deadline: no step starts once the time is spent; the report is on disk after every
    step, so a call cut off at its limit still brings one back."""
    import json

    from benchmarks import gpu_check

    ran = []

    def fake(name, outcome="pass"):
        def step(context):
            ran.append(name)
            assert (tmp_path / "out" / "gpu_check.md").is_file() or name == "environment"
            if outcome == "spend":
                context.deadline = 0.0  # the lease's time is up after this step
            return {"figure": name}
        return step

    steps = {"environment": fake("environment"), "cuda": None, "tests": fake("tests"), "scaler": fake("scaler"),
             "train_n_amp": fake("train_n_amp", "spend"), "half": fake("half")}
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    monkeypatch.setattr(gpu_check, "no_cuda_reason", lambda: None)
    monkeypatch.setattr(gpu_check, "cuda_device_name", lambda: "cuda:0 Fake GPU")
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"steps": {"scaler": {"status": "pass", "date": "2026-01-01", "commit": "abc"},
                                           "tests": {"status": "fail"}, "gone": {"status": "pass"}}}))
    status = gpu_check.main(["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--state", str(state),
                             "--deadline", "600"])
    assert status == 0 and ran == ["environment", "tests", "train_n_amp"]  # scaler passed earlier, half: no time
    saved = json.loads(state.read_text())["steps"]
    assert list(saved) == ["environment", "tests", "scaler", "train_n_amp"]  # in the steps' order, unknown dropped
    assert saved["tests"]["status"] == "pass" and saved["train_n_amp"]["device"] == "cuda:0 Fake GPU"
    assert saved["scaler"]["date"] == "2026-01-01"  # kept as it was
    assert json.loads((tmp_path / "out" / "gpu_check_state.json").read_text())["steps"] == saved
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| scaler | done |" in report and "passed earlier (2026-01-01, abc; --state)" in report
    assert "| half | not run |" in report and "--deadline 600 s reached" in report
    ran.clear()
    assert gpu_check.main(["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--state", str(state),
                           "--only", "scaler"]) == 0
    assert ran == ["environment", "scaler"]  # named by --only: run again
    assert (tmp_path / "out" / "gpu_check2.md").is_file()


def test_gpu_check_a_step_whose_cuda_tests_fail_fails_with_what_it_measured(tmp_path, monkeypatch):
    """graphs_step and compile_step run their cuda tests, then measure: a failed test fails the step (the state then
    runs it again in the next lease), and the report keeps both the failure and the measured figures."""
    from benchmarks import gpu_check

    def step(context):
        figures = {"cuda tests (graphs)": "1 failed, 6 passed in 5s", "cuda tests: where": "tests/test_x.py:1",
                   "yolov5s b64 held, eager": "1480 img/s"}
        return gpu_check.tests_passed(figures)

    monkeypatch.setattr(gpu_check, "STEPS", {"environment": lambda context: {}, "cuda": None, "graphs_step": step})
    monkeypatch.setattr(gpu_check, "no_cuda_reason", lambda: None)
    monkeypatch.setattr(gpu_check, "cuda_device_name", lambda: "cuda:0 Fake GPU")
    assert gpu_check.main(["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]) == gpu_check.EXIT_FAILED
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| graphs_step | fail |" in report and "yolov5s b64 held, eager: 1480 img/s" in report
    assert "## graphs_step: failed" in report and "cuda tests: 1 failed, 6 passed in 5s" in report
    assert gpu_check.tests_passed({"cuda tests (graphs)": "7 passed", "a": "b"}) == {"cuda tests (graphs)": "7 passed",
                                                                                    "a": "b"}


@pytest.mark.parametrize("device", DEVICES)
def test_a_steady_state_step_with_deferred_checks_never_waits_for_the_device(device):
    """The step CUDA trains with (deferred checks, the fixed-shape loss, fp16 + GradScaler, EMA): on CUDA five steps
    run under torch.cuda.set_sync_debug_mode("error"), where any call that waits for the device raises; on the CPU
    (fp32) the same steps read no tensor value (benchmarks/host_reads.py). The first step is left out: it makes
    the device's constants (the scaler's scale, the EMA's count, the loss's grid constants)."""
    from benchmarks.host_reads import HostReads
    from utils.config import Hyp
    from utils.loss import DetectionLoss
    from utils.trainer.amp import Precision, choose_precision
    from utils.trainer.ema import ModelEMA
    from utils.trainer.loop import TrainStep
    from utils.trainer.optim import build_optimizer
    from utils.trainer.state import RunState
    from utils.trainer.step_checks import StepChecks

    device = torch.device(device)
    model = tiny_model().to(device).train()
    if device.type == "cuda":
        precision = choose_precision("auto", device, model)
        assert precision.scaler.is_enabled()
    else:
        precision = Precision("cpu", None, torch.amp.GradScaler("cpu", enabled=False))
    step = TrainStep(model, build_optimizer(model, lr=0.01), DetectionLoss(model, Hyp(), imgsz=64, fixed_shapes=True),
                     precision, ModelEMA(model), checks=StepChecks())
    images, targets = tiny_batch(device)

    def steps(count: int) -> None:
        for _ in range(count):
            step.forward_backward(images, targets)
            step.optimizer_step()
            step.counters.global_step += 1

    steps(1)
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            steps(5)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        with HostReads() as reads:
            steps(5)
        assert reads.total() == 0, reads.by_place()
    state = RunState()
    assert step.settle(state) == 0 and state.loss_batches == 6 and step.counters.skipped_steps_total == 0
    assert step.ema.updates == 6
    assert all(torch.isfinite(p).all() for p in parameters(model) + parameters(step.ema.ema))


def test_gpu_check_throughput_steps_compare_a_baseline_tree_on_a_repeated_dataset(tmp_path, capsys):
    """The throughput steps (benchmarks/gpu_throughput.py): the train split repeated as hard links with the val split
    as it is, the time to the first progress line, a step skipped in one line without --baseline, and --only
    throughput selecting them all."""
    import os
    from pathlib import Path
    from types import SimpleNamespace

    from benchmarks import gpu_check
    from benchmarks import gpu_throughput
    from benchmarks.gpu_check_runner import Completed, Context
    from benchmarks.gpu_throughput import CASES, first_progress_seconds, repeated_dataset, step_throughput
    from utils.data.dataset_yaml import load_data_config
    from utils.data.verify import list_image_files

    data = make_tiny_dataset(tmp_path / "data", num_train=3, num_val=2)
    made, images = repeated_dataset(str(data), 4, tmp_path / "x4")
    assert images == 12 and repeated_dataset(str(data), 4, tmp_path / "x4") == (made, 12)  # found, not made again
    config = load_data_config(made)
    train = list_image_files(config.split("train"))
    assert len(train) == 12 and len(list((tmp_path / "x4" / "labels" / "train").iterdir())) == 12
    assert os.stat(train[0]).st_nlink > 1  # a hard link, not a copy
    assert [Path(p).resolve() for p in config.split("val")] == [
        Path(p).resolve() for p in load_data_config(data).split("val")]

    bar = ("%11s" * 2 + "%11.4g" * 5) % ("1/4", "2.5G", 0.1, 0.05, 0.02, 40, 640) + ": 0%| | 0/4 [00:00<?, ?it/s]"
    assert first_progress_seconds(Completed(0, 9.0, [(1.0, "Starting training"), (7.5, bar)])) == 7.5

    context = Context(SimpleNamespace(baseline="", data=str(data)), tmp_path / "work")
    with pytest.raises(gpu_throughput.StepSkipped, match="no --baseline folder"):  # gpu_check's own class
        step_throughput(context, next(iter(CASES)))
    assert set(CASES) <= set(gpu_check.selected_steps("throughput", ""))
    assert not set(CASES) & set(gpu_check.selected_steps("", "throughput"))


def test_gpu_check_compile_step_projects_each_run_to_ten_epochs(tmp_path, monkeypatch):
    """gpu_check's compile step, train.py faked: images/s over epochs 2-4 leaves the first epoch's compiling out, and
    each run's wall is projected to the 10 epochs the decision on --compile asks for (its wall, then 6 more epochs at
    its rate); the cuda_graphs step's batch-64 and batch-16 rows keep their settings apart."""
    import sys
    from types import SimpleNamespace

    from benchmarks import gpu_check  # noqa: F401  (puts benchmarks/ on sys.path, as gpu_check runs)
    from gpu_check_runner import Completed

    gpu_throughput = sys.modules["gpu_throughput"]

    def bar(epoch: int, done: int) -> str:
        return (f"        {epoch}/4      11.9G      0.125    0.02681    0.05362         34        640: "
                f"{done * 33}%|##| {done}/3 [00:01<00:00, 2.1it/s]")

    def run_command(context, name, command, limit, extra_env=None):
        compiled = "--compile" in [str(part) for part in command]
        ends = [80, 88, 96, 104] if compiled else [20, 30, 40, 50]  # the compiled run's first epoch compiles (60 s)
        fragments = [(1.0, "AMP: fp16 autocast on cuda (self-check passed)"), (10.0, bar(1, 0))]
        for epoch, end in enumerate(ends, 1):
            fragments += [(end, bar(epoch, 3))] + ([(end, bar(epoch + 1, 0))] if epoch < 4 else [])
        return Completed(0, 110.0 if compiled else 60.0, fragments)

    monkeypatch.setattr(gpu_throughput, "run_command", run_command)
    monkeypatch.setattr(gpu_throughput, "repeated_dataset", lambda data, times, root: (root / "data.yaml", 1640))
    context = SimpleNamespace(data="data.yaml", work=tmp_path, args=SimpleNamespace(limit_train=600))
    figures = gpu_throughput.step_compile(context)
    assert figures["yolov5s eager"].startswith("164 img/s, wall 60.0 s")
    assert figures["yolov5s --compile"].startswith("205 img/s, wall 110.0 s")
    assert figures["yolov5s eager: wall projected to 10 epochs"] == "120 s"  # 60 + 6 x 1640 / 164
    assert figures["yolov5s --compile: wall projected to 10 epochs"] == "158 s"  # 110 + 6 x 1640 / 205
    assert figures["yolov5s --compile / yolov5s eager (img/s)"] == "1.25"
    graphs = gpu_throughput.step_cuda_graphs(context)  # batch 64 and batch 16 rows, each setting under its own name
    assert graphs["yolov5s --cuda-graphs"].startswith("164 img/s") and graphs["yolov5s b16 --cuda-graphs"].startswith(
        "164 img/s")
    assert graphs["yolov5s setting"].startswith("batch 64 at 640") and graphs["yolov5s b16 setting"].startswith(
        "batch 16 at 640")
    assert graphs["yolov5s b16 --cuda-graphs / yolov5s b16 eager (img/s)"] == "1.00"


def test_gpu_check_times_each_validation_during_training_from_the_log():
    """gpu_check's bf16 step: seconds from the end of an epoch's training bar to the validation's 'all' row; the
    validation's own bar and an epoch cut short do not count."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gpu_check_runner import Completed, validation_seconds

    def bar(epoch: int, done: int) -> str:
        return (f"        {epoch}/3      0.65G      0.125    0.02681    0.05362         34        640: "
                f"{done * 33}%|##| {done}/3 [00:01<00:00, 2.1it/s]")

    row = "                   all         87       1138      0.512      0.498      0.501      0.301"
    fragments = [(1.0, bar(1, 1)), (2.0, bar(1, 3)), (2.4, "  Class  Images  Instances  P  R  mAP50  mAP50-95: 1/3 ["),
                 (3.5, row), (4.0, bar(2, 1)), (5.0, bar(2, 3)), (5.75, row), (6.0, bar(3, 2)), (7.0, row)]
    assert validation_seconds(Completed(0, 8.0, fragments)) == [1.5, 0.75]


def test_gpu_check_graph_memory_reports_each_case_against_eager(tmp_path, monkeypatch):
    """gpu_check's graph_memory step without a GPU, graph_memory.py's output faked: a figure per case with its peak
    against eager's, a failed case's reason as its figure, the one-pool case's gradient check; and graph_memory.py
    itself stops with one line where there is no CUDA device."""
    import json
    import subprocess
    import sys
    import types

    from benchmarks import gpu_check
    from tests.conftest import ROOT

    cases = [{"case": "eager", "peak reserved": 10.0, "before last": 10.0, "x eager": 1.0,
              "peak with validation": 10.0, "x eager with validation": 1.0},
             {"case": "graphs, last batch eager", "peak reserved": 16.2, "before last": 10.4, "x eager": 1.62,
              "peak with validation": 16.2, "x eager with validation": 1.62},
             {"case": "graphs, last batch by a second make_graphed_callables", "error": "exit status 1: OOM"},
             {"case": "one stream and pool", "peak reserved": 10.6, "before last": 10.4, "x eager": 1.06,
              "peak with validation": 13.1, "x eager with validation": 1.31,
              "last batch gradients, largest relative difference": 0.00042}]
    seen = []

    def run_command(context, name, command, limit, extra_env=None):
        seen.append([str(part) for part in command])
        return types.SimpleNamespace(returncode=0, seconds=1.0, fragments=[
            (0.1, "loading"), (0.2, json.dumps({"device": "H200", "cases": cases}))])

    monkeypatch.setattr(gpu_check, "run_command", run_command)
    figures = gpu_check.step_graph_memory(types.SimpleNamespace(work=tmp_path))
    assert seen[0][1].endswith("graph_memory.py")
    assert seen[0][2:] == ["--imgsz", "640", "--batch-size", "64", "--last", "40", "--json"]
    assert figures == {
        "memory, eager": "peak reserved 10.00 GiB (1.00x eager; 10.00 before the last batch; with a validation pass "
                         "10.00, 1.00x eager's)",
        "memory, graphs, last batch eager": "peak reserved 16.20 GiB (1.62x eager; 10.40 before the last batch; with a "
                                            "validation pass 16.20, 1.62x eager's)",
        "memory, graphs, last batch by a second make_graphed_callables": "exit status 1: OOM",
        "memory, one stream and pool": "peak reserved 10.60 GiB (1.06x eager; 10.40 before the last batch; with a "
                                       "validation pass 13.10, 1.31x eager's)",
        "memory, one stream and pool: last batch's gradients against eager": "4.2e-04 (relative, largest)"}
    if not torch.cuda.is_available():
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "graph_memory.py")], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.strip().endswith("torch.cuda.is_available() is False")


def test_gpu_check_profile_steps_run_profile_train_step_and_name_a_failing_cuda_test(tmp_path, monkeypatch):
    """gpu_check's sync_sites and graphs_step without a GPU, their commands faked: each profile case runs
    profile_train_step.py with its flags on the repeated dataset, its JSON becomes figures, and a failing cuda test is
    reported with the frames that name where it failed."""
    import json
    import types
    from pathlib import Path

    import sys

    from benchmarks import gpu_check

    gpu_throughput = sys.modules["gpu_throughput"]  # as gpu_check imports it (benchmarks/ on sys.path)
    commands = []

    def run_command(context, name, command, limit, extra_env=None):
        command = [str(part) for part in command]
        commands.append((name, command))
        if "pytest" in command:
            return types.SimpleNamespace(returncode=1, fragments=[
                (0.1, "utils/loss.py:257: in class_targets"), (0.2, "E   RuntimeError: called a synchronizing CUDA op"),
                (0.3, "1 failed, 36 deselected in 3.1s")])
        figures = {"images_per_s": 900.0, "step_ms": 71.1, "phases": {"forward": {"host_ms": 14.5, "gpu_ms": 16.0}},
                   "kernels_per_step": 1770.0,
                   "gpu_ms_per_step_by_kernel_family": {"convolution": 12.25, "BatchNorm": 6.5},
                   "gpu_ms_per_step_top_kernels": {"copies / fills": [["direct_copy_kernel_cuda", 3.0],
                                                                      ["Memset (Device)", 0.5]],
                                                   "other": [["some_kernel", 0.25]]}}
        if "--sync-debug" in command:
            figures["sync_sites_per_step"] = {"utils/loss.py:257 <- utils/loss.py:226": 3.0}
        Path(command[command.index("--json") + 1]).write_text(json.dumps(figures))
        return types.SimpleNamespace(returncode=0, fragments=[])

    monkeypatch.setattr(gpu_check, "run_command", run_command)
    monkeypatch.setattr(gpu_throughput, "repeated_dataset", lambda data, times, root: (root / "data.yaml", 1640))
    (tmp_path / "logs").mkdir()
    context = types.SimpleNamespace(data="data.yaml", work=tmp_path)
    sync = gpu_check.step_sync_sites(context)
    assert sync["cuda tests (steady_state_step)"] == "1 failed, 36 deselected in 3.1s"
    assert sync["cuda tests: where"] == ("utils/loss.py:257: in class_targets | E   RuntimeError: called a "
                                         "synchronizing CUDA op")
    assert sync["syncs per step by site"] == "3.00 utils/loss.py:257 <- utils/loss.py:226"
    with pytest.raises(gpu_check.StepFailed, match="cuda tests: 1 failed") as failed:  # measured, then failed
        gpu_check.step_graphs_step(context)
    graphs = failed.value.figures
    assert "eager: syncs per step by site" not in graphs
    assert graphs["--cuda-graphs: syncs per step by site"].startswith("3.00 ")
    assert graphs["yolov5s b64 held, --cuda-graphs"].startswith("900 img/s, 71.1 ms/step (host/GPU ms: forward 14.5/16.0)")
    assert graphs["eager: GPU ms per step by kernel family"] == "convolution 12.2; BatchNorm 6.5"
    assert graphs["eager: costliest kernels of the open families, GPU ms per step"] == (
        "copies / fills: direct_copy_kernel_cuda 3.00; Memset (Device) 0.50 | other: some_kernel 0.25")
    profiled = [command for name, command in commands if "pytest" not in command]
    assert [command[command.index("--json") + 1:] for command in profiled] == [
        [str(tmp_path / "logs" / "sync_sites.json"), "--sync-debug", "10"],
        [str(tmp_path / "logs" / "graphs_step_eager.json")],
        [str(tmp_path / "logs" / "graphs_step_graphs.json"), "--cuda-graphs", "--sync-debug", "10"],
        [str(tmp_path / "logs" / "graphs_step_model.json"), "--cuda-graphs-model"],
        [str(tmp_path / "logs" / "graphs_step_inline.json"), "--copies", "inline", "--no-profile"]]
    assert all(command[command.index("--data") + 1] == str(tmp_path / "dataset_x8" / "data.yaml") for command in profiled)
    commands.clear()
    with pytest.raises(gpu_check.StepFailed) as failed:
        gpu_check.step_compile_step(context)
    compiled = failed.value.figures
    assert compiled["cuda tests (inductor)"] == "1 failed, 36 deselected in 3.1s"
    assert compiled["yolov5s b64 held, --compile"].startswith("900 img/s, 71.1 ms/step")
    assert compiled["--compile: GPU ms per step by kernel family"] == "convolution 12.2; BatchNorm 6.5"
    assert [command[-1] for name, command in commands] == [
        "inductor", str(tmp_path / "logs" / "compile_step_eager.json"), "--compile"]
    assert "tests/test_compiled.py" in commands[0][1]
