"""YOLOv5's ``utils.torch_utils`` names for scripts written against YOLOv5 (docs/yolov5-scripts.md):
``select_device``, ``smart_inference_mode``, ``time_sync`` (v5: ``time_synchronized``), ``model_info``, and
``prune`` / ``sparsity`` from YOLOv5's pruning tutorial. The project itself uses utils/device.py."""
from __future__ import annotations

import logging
import platform
import time

import torch

from utils.device import DeviceError
from utils.device import select_device as _select_device

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
