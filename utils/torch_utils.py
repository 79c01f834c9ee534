"""YOLOv5's ``utils.torch_utils`` names for scripts written against YOLOv5 (docs/yolov5-scripts.md):
``select_device``, ``smart_inference_mode``, ``time_sync`` (v5: ``time_synchronized``), ``model_info``, ``prune`` /
``sparsity`` from YOLOv5's pruning tutorial, and for training loops ``ModelEMA`` (the trainer's own,
utils/trainer/ema.py), ``smart_optimizer``, ``de_parallel``, ``is_parallel``, ``copy_attr``, ``EarlyStopping`` and
``torch_distributed_zero_first``. The project itself uses utils/device.py and utils/trainer/."""
from __future__ import annotations

import contextlib
import logging
import platform
import time

import torch
from torch import nn

from utils import dist
from utils.device import DeviceError
from utils.device import select_device as _select_device
from utils.trainer.ema import ModelEMA, copy_attr  # noqa: F401  (YOLOv5's names; ModelEMA(decay, tau, updates))
from utils.trainer.ema import unwrap_model as de_parallel  # noqa: F401  (YOLOv5: the model inside DDP)
from utils.trainer.optim import parameter_groups

LOGGER = logging.getLogger("yolov5")


def select_device(device="", batch_size: int = 0, newline: bool = True) -> torch.device:
    """The torch.device for a ``--device`` string ('' = the first GPU if any, 'cpu', '0', '0,1', 'mps'), logged as
    YOLOv5 logs it; a batch size that several GPUs cannot share evenly is refused."""
    selected = _select_device(str(device))
    text = f"Python-{platform.python_version()} torch-{torch.__version__} "
    if selected.type == "cuda":
        ids = [part for part in str(device).replace("cuda:", "").split(",") if part.strip()] or ["0"]
        if len(ids) > 1 and batch_size > 0 and batch_size % len(ids):
            raise DeviceError(f"batch-size {batch_size} not multiple of GPU count {len(ids)}")
        for index in ids:
            properties = torch.cuda.get_device_properties(int(index))
            text += f"CUDA:{index} ({properties.name}, {properties.total_memory / (1 << 20):.0f}MiB)\n"
    else:
        text += "MPS\n" if selected.type == "mps" else "CPU\n"
    LOGGER.info(text if newline else text.rstrip())
    return selected


def smart_inference_mode(torch_1_9: bool = True):
    """A decorator: the function runs under torch.inference_mode (torch.no_grad with ``torch_1_9=False``)."""
    def decorate(function):
        return (torch.inference_mode if torch_1_9 else torch.no_grad)()(function)
    return decorate


def time_sync() -> float:
    """time.time() after the GPU's queued work has finished (when there is a GPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.time()


time_synchronized = time_sync  # YOLOv5 v5's name


def model_info(model, verbose: bool = False, imgsz=640) -> None:
    """YOLOv5's model summary line (and with ``verbose`` each parameter's row first) in the log."""
    model.info(verbose=verbose, img_size=imgsz)


def sparsity(model) -> float:
    """The fraction of the model's parameter values that are zero."""
    total = zeros = 0
    for parameter in model.parameters():
        total += parameter.numel()
        zeros += int((parameter == 0).sum())
    return zeros / max(total, 1)


def prune(model, amount: float = 0.3) -> None:
    """Zero the ``amount`` fraction of smallest-magnitude weights of every Conv2d (torch.nn.utils.prune's L1
    unstructured pruning, made permanent), as YOLOv5's pruning tutorial does; logs the global sparsity after."""
    from torch.nn.utils import prune as torch_prune

    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d):
            torch_prune.l1_unstructured(module, name="weight", amount=amount)
            torch_prune.remove(module, "weight")
    LOGGER.info(f"Model pruned to {sparsity(model):.3g} global sparsity")


def is_parallel(model) -> bool:
    """Whether ``model`` is wrapped in DataParallel or DistributedDataParallel."""
    return isinstance(model, (nn.parallel.DataParallel, nn.parallel.DistributedDataParallel))


def smart_optimizer(model, name: str = "Adam", lr: float = 0.001, momentum: float = 0.9, decay: float = 1e-5):
    """YOLOv5's torch.optim optimizer over three parameter groups (utils.trainer.optim.parameter_groups): biases,
    weights (with weight decay ``decay``), normalisation weights. ``name``: SGD (Nesterov), Adam, AdamW (betas =
    (momentum, 0.999)) or RMSProp. (train.py's SGD is utils/trainer/sgd.py's, the same update.)"""
    biases, weights, norm_weights = parameter_groups(model)
    if name == "SGD":
        optimizer = torch.optim.SGD(biases, lr=lr, momentum=momentum, nesterov=True)
    elif name in ("Adam", "AdamW"):
        optimizer = getattr(torch.optim, name)(biases, lr=lr, betas=(momentum, 0.999), weight_decay=0.0)
    elif name == "RMSProp":
        optimizer = torch.optim.RMSprop(biases, lr=lr, momentum=momentum)
    else:
        raise NotImplementedError(f"Optimizer {name} not implemented (SGD, Adam, AdamW or RMSProp)")
    optimizer.add_param_group({"params": weights, "weight_decay": decay})
    optimizer.add_param_group({"params": norm_weights, "weight_decay": 0.0})
    LOGGER.info(f"optimizer: {type(optimizer).__name__}(lr={lr}) with parameter groups {len(norm_weights)} "
                f"weight(decay=0.0), {len(weights)} weight(decay={decay}), {len(biases)} bias")
    return optimizer


class EarlyStopping:
    """``stop = stopper(epoch, fitness)`` after each epoch: true once ``patience`` epochs have passed since the best
    fitness (the latest of equal ones); ``possible_stop``: the next epoch ends the run unless it improves. A
    ``patience`` of 0 never stops."""

    def __init__(self, patience: int = 30):
        self.best_fitness, self.best_epoch = 0.0, 0
        self.patience = patience or float("inf")
        self.possible_stop = False

    def __call__(self, epoch: int, fitness: float) -> bool:
        if fitness >= self.best_fitness:
            self.best_epoch, self.best_fitness = epoch, fitness
        waited = epoch - self.best_epoch
        self.possible_stop = waited >= self.patience - 1
        stop = waited >= self.patience
        if stop:
            LOGGER.info(f"Stopping training early as no improvement observed in last {self.patience} epochs. "
                        f"Best results observed at epoch {self.best_epoch}, best model saved as best.pt.")
        return stop


@contextlib.contextmanager
def torch_distributed_zero_first(local_rank: int):
    """Under torchrun, the other processes wait while local rank 0 runs the block (a dataset's first scan), then
    run it themselves; a single process (rank -1) just runs it."""
    if local_rank not in (-1, 0):
        dist.barrier("run the block under torch_distributed_zero_first")
    yield
    if local_rank == 0:
        dist.barrier("run the block under torch_distributed_zero_first")
