"""``--compile``: the model's training forward and backward compiled by ``torch.compile`` (off by default; CUDA).

Why: on a GPU, a BatchNorm and the SiLU after it each read and write every activation on their own (in the forward
and again in the backward), and each is a kernel the host must launch. Inductor (torch.compile's compiler) fuses
such element-wise work into the kernels around it (the convolutions stay cuDNN's), so fewer passes over memory and
fewer launches. Whether that pays for its compile time (a minute or more at the first step, every run) is measured
by ``benchmarks/gpu_check.py --only compile_step,compile``; until a GPU has shown it, the flag stays opt-in.

How: ``torch.compile(model, dynamic=False)`` for batches of the first full batch's shape, memory layout and dtype
(the first step compiles: the progress bar's first line waits for it); any other shape (a smaller last batch,
``--multi-scale``, ``--rect``) runs the model itself, so a run compiles once and never recompiles. Autocast is
applied around the call, as for the model. The compiled module shares the model's parameters and buffers, so
checkpoints, the EMA, validation and resume see the model as without the flag (nothing compiled is saved).
Compiled numerics differ from eager ones in rounding only (fused arithmetic); a resumed run compiles the same
kernels again.

Where the compiled kernels live: inductor keeps the code it generates and then loads (Python modules, shared
libraries, Triton kernels) in ``$TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_<user>``, which it creates
if missing and uses whoever made it: in a folder every user can write, another user could make it first and put code
there. Unless the user set ``TORCHINDUCTOR_CACHE_DIR`` to another folder, the cache is this user's private
``~/.cache/yolo-trainer/compile`` (``$YOLO_TRAINER_CACHE/compile``; utils.private_folders' checks), set in the
environment before the first compile. Importing ``torch._dynamo`` already writes the default into the environment
(inductor records its choice there), so the default's value counts as unset.

Under DDP the DistributedDataParallel wrapper is what is compiled (TorchDynamo's DDPOptimizer then splits the graph
at DDP's gradient buckets, so the all-reduces still overlap the backward): compiling the module inside it would skip
DDP's forward and with it the gradients' all-reduce. Micro-steps without a sync (``no_sync``) work as eagerly; tested
with 2 gloo processes on the CPU (``aot_eager``), to the bit as eager DDP.

Not used (with a warning): on the CPU (benchmarks/bench_compile_cpu.py on a 2-core Zen 4, yolov5n at 320, batch 8,
3 runs: 0.29-0.42 s a step compiled against 0.27-0.30 s eager with this project's own BatchNorm + SiLU kernels, after
a first step of 42 s, 13-21 s with inductor's cache from an earlier run; and ``torch._dynamo`` stays out of the CPU
path's start-up) and with ``--sync-bn`` (its all-reduce inside each BatchNorm: the CPU's version fails to compile,
CUDA's is not tested); with ``--cuda-graphs`` train.py refuses it (the two are not combined).
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

from utils.data.cache_folders import private_cache_folder

LOGGER = logging.getLogger(__name__)
CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"  # inductor's cache of the code it generates and loads


class CompiledModel:
    """``model``'s training forward for TrainStep: compiled for batches of one shape, the model itself for the others
    (see the module docstring). ``model``: what training calls (the DDP wrapper under DDP); ``batch_size``: the
    per-process batch whose shape is compiled; ``backend``:
    torch.compile's (the tests use ``aot_eager`` on the CPU: the same tracing and autograd, no code generation)."""

    def __init__(self, model: nn.Module, precision, batch_size: int, backend: str = "inductor"):
        self.model, self.precision, self.batch_size, self.backend = model, precision, batch_size, backend
        self.compiled = None
        self.key = None  # (shape, strides, dtype) of the compiled input
        self.compiled_calls = self.eager = 0

    def __call__(self, images: torch.Tensor):
        key = (tuple(images.shape), images.stride(), images.dtype)
        if self.compiled is None and images.shape[0] == self.batch_size and self.model.training:
            private_compiler_cache()
            self.compiled, self.key = torch.compile(self.model, backend=self.backend, dynamic=False), key
            LOGGER.info("--compile: compiling the forward and backward for batches of %s at this first step (a "
                        "minute or more); other shapes run eagerly", "x".join(map(str, key[0])))
        with self.precision.autocast():
            if key == self.key and self.model.training:
                self.compiled_calls += 1
                return self.compiled(images)
            self.eager += 1
            return self.model(images)

    def loss_of(self, images: torch.Tensor, targets: torch.Tensor):
        """None: the loss runs eagerly after the compiled model (TrainStep asks every runner)."""
        return None

    def own_gradients(self) -> None:
        """Nothing to do: the compiled backward returns new gradient tensors at every call (no buffers it reuses, as
        CUDA graphs do), so accumulation adds to them as autograd always does."""


def private_compiler_cache() -> str:
    """inductor's cache folder: the user's ``TORCHINDUCTOR_CACHE_DIR``, else this user's private one (module
    docstring), put in the environment where inductor reads it."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(CACHE_VARIABLE)
    if not chosen or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ[CACHE_VARIABLE] = str(private_cache_folder("compile"))
    return os.environ[CACHE_VARIABLE]


def compiled_model(enabled: bool, model: nn.Module, precision, batch_size: int, device: torch.device,
                   sync_bn: bool = False, multi_scale: bool = False) -> CompiledModel | None:
    """A CompiledModel of ``model`` (what training calls: under DDP, the DDP wrapper) when ``--compile`` asks for one
    and the run can use it; None (with a warning saying why) otherwise."""
    if not enabled:
        return None
    if device.type != "cuda":
        LOGGER.warning("WARNING: --compile is for CUDA devices (on %s it measured slower, after up to a minute of "
                       "compiling); training without", device.type)
        return None
    if sync_bn:
        LOGGER.warning("WARNING: --compile is not used with --sync-bn (its all-reduce inside each BatchNorm is not "
                       "compiled here); training without")
        return None
    if multi_scale:
        LOGGER.warning("WARNING: --compile with --multi-scale: only batches of the first full batch's size run "
                       "compiled, the others eagerly")
    return CompiledModel(model, precision, batch_size)
