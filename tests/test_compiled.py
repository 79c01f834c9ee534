"""--compile (utils/trainer/compiled.py): which runs use it, and that the compiled forward trains the run it would
have trained eagerly. On the CPU the compiler is torch.compile with the ``aot_eager`` backend: the same tracing
(TorchDynamo), functionalised BatchNorm statistics and compiled autograd graph as on a GPU, without generating
kernels; inductor itself (``cuda`` case) runs on a GPU, from benchmarks/gpu_check.py."""
from __future__ import annotations

import logging
import os
import stat

import pytest
import torch

from tests.conftest import NO_CUDA, ROOT, fresh_python
from tests.test_host_reads import batches, tiny_step
from utils.data.cache_folders import CacheFolderError
from utils.trainer.compiled import CACHE_VARIABLE, CompiledModel, compiled_model, private_compiler_cache
from utils.trainer.loop import train_one_epoch
from utils.trainer.state import RunState

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    """The user cache folder under tmp_path, and inductor's cache variable as the user left it: unset (restored after
    the test, whatever the code set)."""
    monkeypatch.setenv("YOLO_TRAINER_CACHE", str(tmp_path / "user-cache"))
    monkeypatch.delenv(CACHE_VARIABLE, raising=False)
    return tmp_path / "user-cache"


def test_the_compiled_code_is_kept_in_a_private_folder_unless_the_user_chose_one(user_cache, tmp_path, monkeypatch):
    """inductor's default cache, /tmp/torchinductor_<user>, is used by whoever created it (another user could, and put
    code there): the first compile points it at this user's 0700 folder; a folder others can write is refused in one
    line; a TORCHINDUCTOR_CACHE_DIR the user set stays theirs."""
    folder = user_cache / "compile"
    assert private_compiler_cache() == str(folder) == os.environ[CACHE_VARIABLE]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    monkeypatch.delenv(CACHE_VARIABLE)
    folder.chmod(0o777)
    with pytest.raises(CacheFolderError, match="YOLO_TRAINER_CACHE"):
        private_compiler_cache()
    folder.chmod(0o700)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv(CACHE_VARIABLE, default_cache_dir())  # what importing torch._dynamo writes there
    assert private_compiler_cache() == str(folder)
    chosen = str(tmp_path / "mine")
    monkeypatch.setenv(CACHE_VARIABLE, chosen)
    assert private_compiler_cache() == chosen and not (tmp_path / "mine").exists()


def test_the_flag_is_used_on_one_cuda_process_only(caplog):
    step = tiny_step()

    def warnings() -> list[str]:
        return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert compiled_model(False, step.model, step.precision, 2, torch.device("cuda", 0), False) is None
        assert not warnings()
        assert compiled_model(True, step.model, step.precision, 2, CPU, False) is None
        assert compiled_model(True, step.model, step.precision, 2, torch.device("cuda", 0), True) is None
    said = warnings()
    assert len(said) == 2 and "--compile is for CUDA devices (on cpu" in said[0] and "not used with --sync-bn" in said[1]
    runner = compiled_model(True, step.model, step.precision, 2, torch.device("cuda", 0), False)
    assert isinstance(runner, CompiledModel) and runner.batch_size == 2 and runner.compiled is None
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert compiled_model(True, step.model, step.precision, 2, torch.device("cuda", 0), False, multi_scale=True)
    assert len(warnings()) == 1 and "--multi-scale" in warnings()[0]


def test_the_cpu_path_never_imports_the_compiler():
    """train.py --compile on the CPU warns and trains eagerly; torch._dynamo (over a second of start-up) is never
    imported for it (build_step, then the runner the step gets)."""
    code = ("import sys, torch\n"
            "from tests.test_host_reads import tiny_step\n"
            "from utils.trainer.compiled import compiled_model\n"
            "step = tiny_step()\n"
            "runner = compiled_model(True, step.model, step.precision, 2, torch.device('cpu'), False)\n"
            "print(runner is None, 'torch._dynamo' in sys.modules)\n")
    assert fresh_python(code) == ["True False"]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_compiled_forward_trains_the_eager_run_and_other_shapes_run_eagerly(accumulate):
    """A run whose forward goes through CompiledModel ends with the weights, BatchNorm statistics and EMA of the same
    run without it (``aot_eager`` runs the same operators: to the bit), with optimizer steps of 1 and 2 micro-steps;
    full batches run compiled, a smaller one and eval mode eagerly, and the one shape compiles once."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps them: another test's recompiles would count here
    plain, compiled = tiny_step(), tiny_step()
    compiled.runner = CompiledModel(compiled.model, compiled.precision, batch_size=2, backend="aot_eager")
    loader = batches(5)
    smaller = [(images[:1], targets[targets[:, 0] == 0], paths[:1], shapes) for images, targets, paths, shapes
               in batches(1)]
    for step in (plain, compiled):
        train_one_epoch(step, loader + smaller + loader[:2], RunState(), 1, CPU, lambda *args: accumulate)
    assert (compiled.runner.compiled_calls, compiled.runner.eager) == (7, 1)
    assert os.environ[CACHE_VARIABLE].endswith(os.path.join("user-cache", "compile"))  # set before compiling
    for name, module in (("model", lambda s: s.model), ("EMA", lambda s: s.ema.ema)):
        for (key, a), (_, b) in zip(module(plain).state_dict().items(), module(compiled).state_dict().items()):
            assert torch.equal(a, b), (name, key)
    compiled.model.eval()
    with torch.no_grad():
        compiled.runner(loader[0][0].float() / 255)
    assert compiled.runner.eager == 2
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] >= 1 and torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert not torch._dynamo.utils.counters["recompiles"]  # one shape, one compilation


DDP_SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
import torch, torch.distributed as tdist
from tests.test_host_reads import batches, tiny_step
from utils.trainer.compiled import CompiledModel

tdist.init_process_group("gloo")
rank = tdist.get_rank()
finals, calls = [], 0
for compiled in (False, True):
    step = tiny_step()
    model = step.model
    step.model = torch.nn.parallel.DistributedDataParallel(model)
    if compiled:
        step.runner = CompiledModel(step.model, step.precision, batch_size=1, backend="aot_eager")
    for number, (images, targets, _, _) in enumerate(batches(6)):  # each rank its image of each batch
        mine = targets[targets[:, 0] == rank].clone()
        mine[:, 0] = 0
        stepping = number % 2 == 1  # 2 micro-steps a step: the first keeps its gradients local (no_sync)
        step.forward_backward(images[rank:rank + 1].float() / 255, mine, sync=stepping)
        if stepping:
            step.optimizer_step()
        step.counters.global_step += 1
    finals.append({{key: value.clone() for key, value in model.state_dict().items()}})
    calls = step.runner.compiled_calls if compiled else calls
torch.save({{"calls": calls, "differ": [k for k in finals[0] if not torch.equal(finals[0][k], finals[1][k])],
            "weights": {{name: p.detach().clone() for name, p in model.named_parameters()}}}},
           os.path.join({out!r}, f"rank{{rank}}.pt"))
"""


@pytest.mark.slow
def test_under_ddp_the_wrapper_is_compiled_and_trains_as_eager_ddp(tmp_path):
    """2 gloo processes, each its own image of every batch, 2 micro-steps a step (the first under no_sync): the
    compiled DistributedDataParallel wrapper ends to the bit as eager DDP on both ranks (its gradients are
    all-reduced: compiling the module inside would skip that and the ranks would part), and the ranks' weights agree
    (BatchNorm's running statistics are each rank's own between DDP's broadcasts, as eagerly)."""
    from tests.test_ddp import free_port, run, torchrun

    script = tmp_path / "ddp_compile.py"
    script.write_text(DDP_SCRIPT.format(root=str(ROOT), out=str(tmp_path)))
    done = run(torchrun(str(script), extra=["--master_port", str(free_port())]),
               env={"YOLO_TRAINER_CACHE": str(tmp_path / "user-cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert [r["calls"] for r in ranks] == [6, 6] and [r["differ"] for r in ranks] == [[], []]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["weights"].values(), ranks[1]["weights"].values()))


def test_the_checkpoint_holds_the_model_not_the_compiled_module(tmp_path):
    """The compiled module shares the model's tensors: the model (what checkpoints save) trains, and its state_dict
    keys are the model's own (no '_orig_mod.' prefix a saved compiled module would add)."""
    torch._dynamo.reset()
    step = tiny_step()
    keys = list(step.model.state_dict())
    before = {k: v.clone() for k, v in step.model.state_dict().items()}
    step.runner = CompiledModel(step.model, step.precision, batch_size=2, backend="aot_eager")
    train_one_epoch(step, batches(2), RunState(), 1, CPU, lambda *args: 1)
    after = step.model.state_dict()
    assert list(after) == keys
    assert not torch.equal(before["model.0.conv.weight"], after["model.0.conv.weight"])  # the shared weights moved
    assert not torch.equal(before["model.0.bn.running_mean"], after["model.0.bn.running_mean"])  # and BatchNorm's


def test_a_gpus_forward_is_one_graph_without_breaks():
    """On a GPU the whole training forward is one compiled graph: no graph break (each would return to Python between
    two compiled pieces and split the fusion). Traced on the meta device, which takes the model's non-CPU path (the
    CPU's own BatchNorm + SiLU kernels and grouped sums are never reached there), channels_last, under CUDA's
    autocast."""
    from models.yolo import Model

    torch._dynamo.reset()
    model = Model(str(ROOT / "models" / "yolov5n.yaml"), ch=3, nc=4).train().to("meta")
    model = model.to(memory_format=torch.channels_last)
    images = torch.empty(2, 3, 128, 128, device="meta").contiguous(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.float16):
        explained = torch._dynamo.explain(model)(images)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_inductor_on_cuda_trains_as_eager_within_rounding():
    """Inductor's fused kernels on a GPU: 6 steps of a tiny model under autocast end within rounding of the eager run
    (weights and BatchNorm statistics), without a synchronisation inside a step."""
    from models.yolo import DetectionModel
    from tests.test_host_reads import TINY_MODEL_YAML
    import yaml
    from utils.config import Hyp
    from utils.loss import DetectionLoss
    from utils.trainer.amp import choose_precision
    from utils.trainer.ema import ModelEMA
    from utils.trainer.loop import TrainStep
    from utils.trainer.optim import build_optimizer
    from utils.trainer.step_checks import StepChecks

    device = torch.device("cuda", 0)
    torch._dynamo.reset()
    steps = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = DetectionModel(yaml.safe_load(TINY_MODEL_YAML)).to(device).train()
        model = model.to(memory_format=torch.channels_last)
        precision = choose_precision("auto", device, model)
        step = TrainStep(model, build_optimizer(model, lr=0.01), DetectionLoss(model, Hyp(), imgsz=64, fixed_shapes=True),
                         precision, ModelEMA(model), channels_last=True, checks=StepChecks())
        step.runner = CompiledModel(model, precision, batch_size=2) if compiled else None
        generator = torch.Generator().manual_seed(1)
        images = torch.rand(2, 3, 64, 64, generator=generator).to(device)
        targets = torch.tensor([[0, 0, 0.5, 0.5, 0.4, 0.3], [1, 1, 0.3, 0.6, 0.2, 0.5]], device=device)
        step.forward_backward(images, targets)  # the compilation and cuDNN's first calls, outside the checked steps
        step.optimizer_step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                step.forward_backward(images, targets)
                step.optimizer_step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        steps.append(step)
    assert steps[1].runner.compiled_calls == 6
    for (key, a), (_, b) in zip(steps[0].model.state_dict().items(), steps[1].model.state_dict().items()):
        if a.dtype.is_floating_point:
            assert torch.allclose(a, b, rtol=2e-2, atol=2e-3), key


def test_compile_with_cuda_graphs_is_one_line_error(tmp_path, capsys):
    import train

    assert train.main(["--data", str(tmp_path / "data.yaml"), "--compile", "--cuda-graphs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["train.py: error: --compile and --cuda-graphs are not combined (each runs the model's forward its "
                   "own way): choose one"]
    assert not (tmp_path / "runs").exists()
