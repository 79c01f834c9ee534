"""The one home of distributed state. No other module reads RANK, LOCAL_RANK or WORLD_SIZE.

``torchrun --nproc_per_node N train.py`` sets those variables; a plain ``python train.py`` has none
and runs as rank 0 of a world of 1. Writers (checkpoints, loggers, plots) ask ``is_main_process()``.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int = -1        # -1: not distributed
    local_rank: int = -1
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank in (-1, 0)


def dist_info() -> DistInfo:
    """Rank information from torchrun's environment (-1/-1/1 when launched without torchrun)."""
    return DistInfo(rank=int(os.environ.get("RANK", -1)),
                    local_rank=int(os.environ.get("LOCAL_RANK", -1)),
                    world_size=int(os.environ.get("WORLD_SIZE", 1)))


def is_main_process() -> bool:
    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_rank() == 0
    return dist_info().is_main


def get_world_size() -> int:
    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_world_size()
    return 1


def init_distributed(device: torch.device, timeout_minutes: int = 30) -> None:
    """Join the process group when launched by torchrun: NCCL on CUDA, gloo on CPU."""
    info = dist_info()
    if not info.distributed or torch_dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch_dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    LOGGER.info("DDP: rank %d/%d (local %d), backend %s", info.rank, info.world_size, info.local_rank, backend)


def cleanup() -> None:
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def barrier() -> None:
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.barrier()


@contextlib.contextmanager
def main_process_first():
    """Let rank 0 do something first (dataset scan, cache writing) while the others wait, then swap."""
    if not is_main_process():
        barrier()
    yield
    if is_main_process():
        barrier()


def all_reduce_max(values: list[int]) -> list[int]:
    """Element-wise maximum of small integer lists over all processes (identity when not distributed)."""
    if get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64)
    if torch_dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
    return tensor.cpu().tolist()


def gather_object(obj) -> list:
    """Every process's ``obj``, in rank order, on every process (``[obj]`` when not distributed)."""
    if get_world_size() == 1:
        return [obj]
    gathered = [None] * get_world_size()
    torch_dist.all_gather_object(gathered, obj)
    return gathered


@dataclass(frozen=True)
class LaunchInfo:
    """How torchrun (torch elastic) started this process: which restart of the worker group it is, and an
    id that stays the same across restarts of one launch (node, launcher process, rendezvous id)."""
    restart_count: int = 0
    launch_id: str = ""

    @property
    def restarted(self) -> bool:
        return self.restart_count > 0


def launch_info() -> LaunchInfo:
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return LaunchInfo()
    launcher = f"{socket.gethostname()}:{os.getppid()}:{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    return LaunchInfo(int(os.environ["TORCHELASTIC_RESTART_COUNT"]), launcher)


def broadcast_object(obj, src: int = 0):
    """Send a picklable Python object from ``src`` to every process (identity when not distributed)."""
    if get_world_size() == 1:
        return obj
    holder = [obj]
    torch_dist.broadcast_object_list(holder, src=src)
    return holder[0]
