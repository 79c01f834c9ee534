"""AutoBatch (``train.py --batch-size -1``, as YOLOv5): the largest training batch that fits the GPU.

How the batch is chosen:
1. the memory the device has free before measuring (the driver's free memory, ``torch.cuda.mem_get_info``, so
   other processes' use counts too; YOLOv5 takes total minus this process's reserved and allocated memory);
2. the memory of one training step (forward under the run's autocast, backward) of the real model at the run's
   image size, for batches 1, 2, 4, 8 and 16 (YOLOv5's sizes), stopping at the first that runs out of memory;
3. a least-squares line through those points: memory = per_image * batch + fixed;
4. the batch whose predicted memory is ``FREE_FRACTION`` (0.8, YOLOv5's fraction) of the free memory. The rest
   is headroom for what the probe does not hold: the optimizer state and the EMA copy (each one model's
   parameters), the allocator's fragmentation over a run, and fp32 training where the fp16 self-check fails.
5. clamped to [1, limit] (the training images per process, and ``MAX_BATCH_SIZE``); a batch that ran out of
   memory while measuring caps the choice at the largest measured batch below it.

With ``--cuda-graphs`` (one process) the target is half that fraction (``GRAPHS_FRACTION``): the captured graphs
keep a memory pool of their own, holding one step's activations, beside the ordinary allocator's. An epoch's smaller
last batch is captured into the same pool, but a batch of another image size (``--multi-scale``) or with more targets
than the graphed loss was captured for runs eagerly in the ordinary allocator: up to one step's activations again.
The capture itself needs no more: torch empties the allocator's cache of the warm-up passes before it captures.

The decision is printed as one line. Under torchrun the main process measures on its own GPU and decides with
the smallest free memory of all processes; every process receives that decision (total batch = per-process
batch x processes), so the processes never disagree. On the CPU it is refused: memory is not what limits a
CPU batch. The resolved batch replaces -1 in the run's options before anything is saved, so a resumed run
continues with the batch that was chosen.

The decision functions take the memory probe as a parameter (``probe(batch) -> bytes``, raising one of
``OUT_OF_MEMORY`` when the batch does not fit) and are tested on the CPU with a fake probe.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from utils import dist
from utils.cli import AUTO_BATCH as AUTO  # --batch-size -1
from utils.limits import MAX_BATCH_SIZE

LOGGER = logging.getLogger(__name__)

FREE_FRACTION = 0.8
GRAPHS_FRACTION = FREE_FRACTION / 2  # --cuda-graphs: its pool and an eager batch each hold a step's activations
PROBE_BATCHES = (1, 2, 4, 8, 16)
OUT_OF_MEMORY = (torch.cuda.OutOfMemoryError, MemoryError)
GIB = 1 << 30


class AutoBatchError(dist.SharedError):
    """--batch-size -1 cannot be used here (the CPU, or not even a batch of 1 fits); exit 2: give --batch-size."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=2)


@dataclass(frozen=True)
class BatchChoice:
    batch: int                  # per process
    free: int                   # bytes free on the device before measuring
    fraction: float
    per_image: float            # fitted bytes per image (0 when no line could be fitted)
    fixed: float                # fitted bytes at batch 0
    measured: dict = field(default_factory=dict)  # batch -> bytes, None for out of memory
    note: str = ""              # why the batch is not the fitted one, if it is not

    @property
    def predicted(self) -> float:
        """Predicted memory of a training step at the chosen batch (bytes)."""
        if self.per_image > 0:
            return self.per_image * self.batch + self.fixed
        return float(self.measured.get(self.batch) or 0)

    def summary(self, device, imgsz: int, processes: int = 1) -> str:
        """The one line that says what was chosen and why."""
        total = f" per process, {self.batch * processes} in total" if processes > 1 else ""
        fit = (f"{self.per_image / GIB:.3g} GiB per image + {self.fixed / GIB:.3g} GiB, fitted on batches "
               f"{', '.join(str(b) for b, used in self.measured.items() if used is not None)}"
               if self.per_image > 0 else "no line could be fitted")
        note = f"; {self.note}" if self.note else ""
        share = self.predicted / self.free if self.free else 0.0
        return (f"AutoBatch: batch {self.batch}{total} for --imgsz {imgsz} on {device}: predicted "
                f"{self.predicted / GIB:.3g} GiB = {share:.0%} of {self.free / GIB:.3g} GiB free (target "
                f"{self.fraction:.0%}; {fit}{note})")


def measure(probe: Callable[[int], int], batch_sizes=PROBE_BATCHES) -> dict:
    """{batch: bytes, or None for the first batch that ran out of memory (larger ones are not tried)}."""
    measured = {}
    for batch in batch_sizes:
        try:
            measured[batch] = int(probe(batch))
        except OUT_OF_MEMORY:
            measured[batch] = None
            break
    return measured


def fit_line(measured: dict) -> tuple[float, float]:
    """(bytes per image, fixed bytes) by least squares over the batches that fitted; (0, 0) with fewer than 2."""
    points = [(batch, used) for batch, used in measured.items() if used is not None]
    if len(points) < 2:
        return 0.0, 0.0
    slope, intercept = np.polyfit([p[0] for p in points], [p[1] for p in points], 1)
    return float(slope), float(intercept)


def choose_batch(measured: dict, free: int, fraction: float = FREE_FRACTION, limit: int = MAX_BATCH_SIZE
                 ) -> BatchChoice:
    """The batch whose predicted memory is ``fraction`` of ``free`` bytes, within [1, limit], below any batch
    that ran out of memory. AutoBatchError when not even the smallest measured batch fitted."""
    fitted = [batch for batch, used in measured.items() if used is not None]
    if not fitted:
        raise AutoBatchError(f"--batch-size -1: a training step of batch {min(measured)} ran out of GPU memory "
                             f"({free / GIB:.3g} GiB free): lower --imgsz, or free the GPU")
    per_image, fixed = fit_line(measured)
    note = ""
    if per_image > 0:
        batch = math.floor((free * fraction - fixed) / per_image)
    else:
        batch = max(fitted)
        note = "memory did not grow with the batch, so the largest measured batch is used"
    failed = [b for b, used in measured.items() if used is None]
    if failed and batch >= failed[0]:
        batch = max(b for b in fitted if b < failed[0])
        note = f"batch {failed[0]} ran out of memory while measuring"
    if batch > limit:
        batch, note = limit, f"clamped to {limit}"
    if batch < 1:
        batch, note = 1, "even batch 1 is predicted above the budget: training may run out of memory"
    return BatchChoice(batch, int(free), fraction, per_image, fixed, dict(measured), note)


def autobatch(probe: Callable[[int], int], free: int, limit: int = MAX_BATCH_SIZE, fraction: float = FREE_FRACTION,
              batch_sizes=PROBE_BATCHES) -> BatchChoice:
    """Measure ``probe`` at ``batch_sizes`` and choose (see the module docstring)."""
    return choose_batch(measure(probe, batch_sizes), free, fraction, limit)


def refuse_on(device: torch.device) -> None:
    """AutoBatchError unless ``device`` is a CUDA device (the same answer on every process)."""
    if torch.device(device).type != "cuda":
        raise AutoBatchError(f"--batch-size -1 (AutoBatch) sizes the batch to fit GPU memory; on "
                             f"{torch.device(device).type} memory is not the limit: give --batch-size (e.g. 16)")


def resolve_batch_size(batch_size: int, model: torch.nn.Module, imgsz: int, device: torch.device,
                       dtype: torch.dtype | None, train_images: Callable[[], int], probe_factory=None,
                       free_memory=None, reserved: int = 0, graphs: bool = False) -> int:
    """``batch_size`` itself, or for -1 the total batch AutoBatch chooses (decided on the main process, the same
    on every process) for training steps at ``imgsz`` under ``dtype`` autocast (None: fp32). ``train_images()``
    counts the training images (called on the main process only); ``probe_factory(model, imgsz, device, dtype)``
    and ``free_memory(device)`` default to the CUDA ones; ``reserved`` bytes of the free memory are set aside
    for what the run keeps on the device besides the step (--augment-device's tables); ``graphs``: the step runs
    as CUDA graphs (--cuda-graphs on one process), so the target is ``GRAPHS_FRACTION``."""
    if batch_size != AUTO:
        return batch_size
    refuse_on(device)
    from utils.device import cuda_memory

    probe_factory = probe_factory or training_step_probe
    free_memory = free_memory or (lambda d: cuda_memory(d)[0])
    processes = dist.get_world_size()
    free = min(dist.gather_object(int(free_memory(device)), phase="report free GPU memory for AutoBatch"))
    free = max(free - int(reserved), 0)
    outcome = None
    if dist.is_main_process():
        try:
            limit = max(1, min(MAX_BATCH_SIZE, train_images() // processes))
            graphed = graphs and processes == 1  # the graphs are not used under DDP (utils/trainer/cuda_graphs.py)
            choice = autobatch(probe_factory(model, imgsz, device, dtype), free, limit,
                               GRAPHS_FRACTION if graphed else FREE_FRACTION)
            reserve = f" (after {reserved / GIB:.3g} GiB set aside for --augment-device)" if reserved else ""
            if graphed:
                reserve += " (--cuda-graphs: half the usual target, for the graphs' own memory)"
            LOGGER.info("%s%s", choice.summary(device, imgsz, processes), reserve)
            outcome = ("ok", choice.batch)
        except AutoBatchError as error:
            outcome = ("error", str(error))
    kind, value = dist.broadcast_object(outcome, phase="decide the AutoBatch batch size")
    if kind == "error":
        raise AutoBatchError(value)
    return value * processes


def training_step_probe(model: torch.nn.Module, imgsz: int, device: torch.device, dtype: torch.dtype | None
                        ) -> Callable[[int], int]:
    """probe(batch) -> peak bytes the caching allocator reserved beyond its starting point for one forward
    (under the run's autocast ``dtype``, the one its precision choice made: fp16 after the self-check, bf16, or
    None for fp32) and backward of a copy of ``model`` in channels_last, on random images of ``imgsz``."""
    probe_model = copy.deepcopy(model).to(device, memory_format=torch.channels_last).train()

    def probe(batch: int) -> int:
        torch.cuda.empty_cache()
        start = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            images = torch.rand(batch, 3, imgsz, imgsz, device=device).contiguous(memory_format=torch.channels_last)
            with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
                outputs = probe_model(images)
            sum(output.float().sum() for output in outputs).backward()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_reserved(device) - start
        finally:
            images = outputs = None
            probe_model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    return probe


def check_request(batch_size: int, device: torch.device) -> None:
    """Before anything is built: --batch-size -1 is refused off CUDA (one line, exit 2)."""
    if batch_size == AUTO:
        refuse_on(device)


def auto_batch_size(config, model: torch.nn.Module, device: torch.device, data_cfg, dtype: torch.dtype | None) -> int:
    """The run's total batch: ``config.batch_size``, or AutoBatch's choice for -1 with the run's model, its
    precision (``dtype``: the autocast the run trains under, decided before), its largest training image size
    (the image size rounded up to the model's stride; with --multi-scale the largest size it draws) and its
    training images (``data_cfg.train``)."""
    if config.batch_size != AUTO:
        return config.batch_size
    from utils.data.transforms import multi_scale_bounds
    from utils.data.verify import list_image_files

    stride = max(int(model.stride.max()), 32)
    imgsz = math.ceil(config.imgsz / stride) * stride
    if config.multi_scale:
        imgsz = multi_scale_bounds(imgsz, stride)[1]
    reserved = 0
    if getattr(config, "augment_device", False):
        from utils.data.device_augment import RESIDENT_BYTES as reserved
    return resolve_batch_size(AUTO, model, imgsz, device, dtype, lambda: len(list_image_files(data_cfg.train)),
                              reserved=reserved, graphs=getattr(config, "cuda_graphs", False))
