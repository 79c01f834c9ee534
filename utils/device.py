"""Device selection from a ``--device`` string: '', 'cpu', '0', '0,1', 'cuda:1', 'mps'."""
from __future__ import annotations

import logging
import os

import torch

from utils.errors import UserError

LOGGER = logging.getLogger(__name__)


class DeviceError(UserError):
    """A --device value that this machine cannot satisfy."""
    exit_code = 2  # a bad flag value


def select_device(device: str = "", local_rank: int = -1) -> torch.device:
    """Return the torch.device for ``device``; with ``local_rank >= 0`` (DDP) it picks cuda:local_rank.

    '' means the first GPU when one is available, else the CPU. A GPU request on a machine without
    CUDA is a one-line ``DeviceError`` rather than a silent fallback.
    """
    spec = str(device).strip().lower().replace("cuda:", "").replace("none", "")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise DeviceError("--device mps requested but MPS is not available")
        return torch.device("mps")
    if spec:
        ids = [s for s in spec.split(",") if s != ""]
        if not all(s.isdigit() for s in ids):
            raise DeviceError(f"invalid --device '{device}': use 'cpu', a GPU index such as 0, or a list such as 0,1")
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {device} requested but CUDA is not available (use --device cpu)")
        count = torch.cuda.device_count()
        bad = [i for i in ids if int(i) >= count]
        if bad:
            raise DeviceError(f"--device {device}: GPU {bad[0]} does not exist (this machine has {count})")
        if local_rank >= 0:
            return torch.device("cuda", int(ids[local_rank % len(ids)]))
        return torch.device("cuda", int(ids[0]))
    if torch.cuda.is_available():
        return torch.device("cuda", max(local_rank, 0))
    return torch.device("cpu")


def usable_cpus() -> int:
    """CPUs this process may run on (process affinity), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def compute_fills_cpus(device, processes: int = 1) -> bool:
    """The compute of ``processes`` processes on this node keeps every usable CPU busy: a CPU device whose
    intra-op threads (per process) cover the CPUs. Then other CPU work (loader workers) competes with it."""
    return torch.device(device).type == "cpu" and torch.get_num_threads() * max(processes, 1) >= usable_cpus()


def cuda_memory(device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device as the driver reports them (other processes' use included), after
    handing this process's cached but unused blocks back."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)
