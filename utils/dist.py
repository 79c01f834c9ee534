"""The one home of distributed state. No other module reads RANK, LOCAL_RANK, WORLD_SIZE or torchrun's
other variables.

``torchrun --nproc_per_node N train.py`` (or ``python -m torch.distributed.run``, one or many nodes) sets
those variables; a plain ``python train.py`` has none and runs as rank 0 of a world of 1. RANK and
WORLD_SIZE count only when a launcher that sets up a process group says so (torchrun's
TORCHELASTIC_RUN_ID, or LOCAL_RANK with MASTER_ADDR): some schedulers export ``RANK=0 WORLD_SIZE=1`` for
every job, and such a job trains as one process. Writers
(checkpoints, loggers, plots) ask ``is_main_process()``. The process group uses NCCL when every process
has its own CUDA device and gloo otherwise; every wait that can be long is named (``barrier(phase)``), so
a timeout says what the processes were waiting for.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as torch_dist

from utils.errors import UserError

LOGGER = logging.getLogger(__name__)
TIMEOUT_MINUTES = 30
_OWN_GROUP = {"group": None}  # the default process group init_distributed created (None: none, or the caller's)


class DistributedError(UserError):
    """A launch that cannot work (batch not divisible, more processes than devices, ...), or a wait that
    timed out; the message names the phase."""


class SharedError(UserError):
    """An error every process raises alike (decided on the main process and shared, or a check that gives
    the same answer everywhere): only the main process prints it. ``exit_code`` 2 for a bad flag."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class DistInfo:
    rank: int = -1        # -1: not distributed
    local_rank: int = -1
    world_size: int = 1
    local_world_size: int = 1  # processes on this node

    @property
    def distributed(self) -> bool:
        """Launched by torchrun, one process included (as YOLOv5: a process group, DDP and --sync-bn)."""
        return self.world_size > 1 or self.rank >= 0

    @property
    def is_main(self) -> bool:
        return self.rank in (-1, 0)


def launched() -> bool:
    """A launcher that sets up a process group started this process: torchrun (TORCHELASTIC_RUN_ID), or the
    rendezvous address and local rank that torch.distributed.launch and hand-written multi-node scripts give."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) or ("LOCAL_RANK" in os.environ and "MASTER_ADDR" in os.environ)


def dist_info() -> DistInfo:
    """Rank information from the launcher's environment (-1/-1/1 when no launcher started this process)."""
    if not launched():
        return DistInfo()
    world_size = _environment_int("WORLD_SIZE", 1)
    return DistInfo(rank=_environment_int("RANK", -1),
                    local_rank=_environment_int("LOCAL_RANK", -1),
                    world_size=world_size,
                    local_world_size=_environment_int("LOCAL_WORLD_SIZE", world_size))


def _environment_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise DistributedError(f"environment variable {name}={text[:40]!r} is not an integer") from None


def unlaunched_world() -> str | None:
    """The one-line reason when the environment asks for several processes but no launcher joined them (WORLD_SIZE
    above 1 without a rendezvous): each would train alone. None otherwise."""
    if launched() or "WORLD_SIZE" not in os.environ:
        return None
    world_size = _environment_int("WORLD_SIZE", 1)
    if world_size <= 1:
        return None
    return (f"WORLD_SIZE={world_size} is set but no launcher started this process (no TORCHELASTIC_RUN_ID, nor "
            "LOCAL_RANK with MASTER_ADDR): start the processes with torchrun --nproc_per_node N train.py ..., or "
            "unset WORLD_SIZE to train as one process")


def is_main_process() -> bool:
    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_rank() == 0
    return dist_info().is_main


def in_process_group() -> bool:
    """This process has joined a process group (under torchrun): collectives go through its backend, even
    with one process; outside one they return their input."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def get_world_size() -> int:
    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_world_size()
    return 1


def get_rank() -> int:
    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_rank()
    return 0


def check_launch(batch_size: int, device: torch.device, device_ids: int | None = None) -> None:
    """One-line errors, before anything is built, for launches that cannot work."""
    info = dist_info()
    if not info.distributed:
        return
    if batch_size > 0 and batch_size % info.world_size:  # AutoBatch (-1) chooses a multiple later
        lower = batch_size - batch_size % info.world_size
        choices = [b for b in (lower, lower + info.world_size) if b > 0]
        raise SharedError(f"--batch-size {batch_size} is not divisible by the {info.world_size} processes "
                          f"(the total batch is split evenly); use {' or '.join(map(str, choices))}", exit_code=2)
    if device.type == "cuda":
        available = device_ids if device_ids is not None else torch.cuda.device_count()
        if info.local_world_size > available:
            raise SharedError(f"{info.local_world_size} processes on this node but {available} CUDA devices: "
                              "use --nproc_per_node <= the number of GPUs (one process per GPU)", exit_code=2)


def init_distributed(device: torch.device) -> None:
    """Join the process group when launched by torchrun: NCCL on CUDA (this process's own device), gloo
    otherwise. Sets this process's compute threads to its share of the node's CPUs, and logs one start
    line on every rank (host, rank, local rank, world size, device, backend)."""
    problem = unlaunched_world()
    if problem:
        raise DistributedError(problem)
    info = dist_info()
    if not info.distributed or torch_dist.is_initialized():
        return  # alone, or in a group its caller made (which stays the caller's: see cleanup)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    share_cpu_threads(info)
    timeout = datetime.timedelta(minutes=TIMEOUT_MINUTES)
    torch_dist.init_process_group(backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None,
                                  **_restart_store(info, timeout))
    _OWN_GROUP["group"] = torch_dist.group.WORLD
    LOGGER.info("DDP: host %s, rank %d/%d, local rank %d, device %s, backend %s, %d compute threads",
                socket.gethostname(), info.rank, info.world_size, info.local_rank, device, backend,
                torch.get_num_threads(), extra={"all_ranks": True})


def _restart_store(info: DistInfo, timeout: datetime.timedelta) -> dict:
    """torchrun's static rendezvous (--master_port) keeps one key-value store for all restarts of a launch, so
    a restarted group would read the dead group's addresses and fail to connect. Each restart gets its own
    key prefix in that store. Nothing changes for a first start or the c10d rendezvous (--standalone,
    --rdzv-backend c10d), which give every round a fresh store."""
    restarts = restart_count()
    if not restarts or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    client = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
                                 is_master=False, timeout=timeout)
    store = torch_dist.PrefixStore(f"/yolo-trainer/restart_{restarts}/", client)
    return {"store": store, "rank": info.rank, "world_size": info.world_size}


def share_cpu_threads(info: DistInfo) -> None:
    """Compute threads per process = usable CPUs / processes on this node (at least 1): N processes each
    spinning all cores' OpenMP threads slow CPU training 10x or more."""
    from utils.device import usable_cpus

    cpus = usable_cpus()
    torch.set_num_threads(max(1, cpus // max(info.local_world_size, 1)))
    if info.local_world_size > cpus and info.local_rank == 0:
        LOGGER.warning("WARNING: %d processes on this node share %d CPUs: each gets 1 compute thread and they take "
                       "turns; training will be slower than with %d processes", info.local_world_size, cpus, cpus)


def cleanup() -> None:
    """Leave the process group that ``init_distributed`` created; a group the caller made before (a script that
    calls train.run under its own launcher) stays as it is."""
    own, _OWN_GROUP["group"] = _OWN_GROUP["group"], None
    if own is not None and in_process_group() and torch_dist.group.WORLD is own:
        torch_dist.destroy_process_group()


def barrier(phase: str = "") -> None:
    """Wait for every process; a timeout (TIMEOUT_MINUTES) or a dead peer raises naming ``phase``."""
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return
    with named_wait(phase or "meet at a barrier"):
        torch_dist.barrier()


@contextlib.contextmanager
def named_wait(phase: str):
    """A collective operation that can wait for other processes: its failure (a timeout after TIMEOUT_MINUTES, or
    a peer that died) becomes a one-line DistributedError saying what this process was waiting for."""
    try:
        yield
    except (RuntimeError, torch_dist.DistBackendError) as error:
        detail = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        if "timed out" in detail.lower() or "timeout" in detail.lower():
            reason = f"timed out after {TIMEOUT_MINUTES} min waiting for the other processes to {phase}"
        else:
            reason = f"another process ended while this one waited for it to {phase} (see its error)"
        raise DistributedError(f"rank {get_rank()}: {reason} [{detail}]") from None


@contextlib.contextmanager
def main_process_first(phase: str):
    """Let the main process do something first (a dataset scan, a cache) while the others wait, then the
    first process of every other node (which finds the main process's files on a shared filesystem, or
    writes its node's own), then the rest: no two processes ever write the same file."""
    info = dist_info()
    if not (info.distributed and torch_dist.is_initialized()):
        yield
        return
    stage = 0 if info.rank == 0 else 1 if info.local_rank == 0 else 2
    if stage:
        others = " and each node's first process" if stage == 2 and info.world_size > info.local_world_size else ""
        LOGGER.info("waiting for rank 0%s to %s", others, phase, extra={"all_ranks": True})
    for turn in range(3):
        if turn == stage:
            yield
        barrier(phase)


def all_reduce_max(values: list[int], phase: str = "agree on a decision") -> list[int]:
    """Element-wise maximum of small integer lists over all processes (identity when not distributed)."""
    return _all_reduce(torch.tensor(values, dtype=torch.int64), torch_dist.ReduceOp.MAX, phase).tolist()


def all_reduce_sum(tensor: torch.Tensor, phase: str = "sum a statistic") -> torch.Tensor:
    """Sum of ``tensor`` over all processes, as a new tensor on ``tensor``'s device (identity when alone)."""
    return _all_reduce(tensor.detach().clone(), torch_dist.ReduceOp.SUM, phase).to(tensor.device)


def all_reduce_in_place(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Element-wise ``op`` ("sum" or "max") over all processes, in place on ``tensor``'s device and never read by
    the host (NCCL queues it behind the step's kernels: a training step's deferred decisions and loss counts).
    Identity when alone."""
    if in_process_group():
        torch_dist.all_reduce(tensor, op={"sum": torch_dist.ReduceOp.SUM, "max": torch_dist.ReduceOp.MAX}[op])
    return tensor


def _all_reduce(tensor: torch.Tensor, op, phase: str) -> torch.Tensor:
    if not in_process_group():
        return tensor
    if torch_dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    with named_wait(phase):
        torch_dist.all_reduce(tensor, op=op)
    return tensor.cpu()


def gather_object(obj, phase: str = "share their results") -> list:
    """Every process's ``obj``, in rank order, on every process (``[obj]`` when not distributed)."""
    if not in_process_group():
        return [obj]
    gathered = [None] * get_world_size()
    with named_wait(phase):
        torch_dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj, src: int = 0, phase: str = "share the main process's decision"):
    """Send a picklable Python object from ``src`` to every process (identity when not distributed)."""
    if not in_process_group():
        return obj
    holder = [obj]
    with named_wait(phase):
        torch_dist.broadcast_object_list(holder, src=src)
    return holder[0]


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0, phase: str = "receive the main process's tensors"
                      ) -> None:
    """Overwrite ``tensors`` in place with ``src``'s values on every process (one flat transfer)."""
    if not in_process_group() or not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    if torch_dist.get_backend() == "nccl":
        flat = flat.cuda()
    with named_wait(phase):
        torch_dist.broadcast(flat, src=src)
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            count = tensor.numel()
            tensor.copy_(flat[offset:offset + count].view_as(tensor).to(tensor.dtype))
            offset += count


@dataclass(frozen=True)
class LaunchInfo:
    """How torchrun (torch elastic) started this process: which restart of the worker group it is, and an
    id that stays the same across the restarts of one launch and is never shared by two launches ("" when
    not under torchrun, or when the launch cannot be identified: its restarts then start a new run)."""
    restart_count: int = 0
    launch_id: str = ""

    @property
    def restarted(self) -> bool:
        return self.restart_count > 0


LAUNCH_TOKEN_KEY = "/yolo-trainer/launch-token"
STORE_TIMEOUT_SECONDS = 60  # to reach torchrun's agent store
PROC_ROOT = Path("/proc")
_LAUNCH_IDS: dict[int, str] = {}  # process id -> this process's launch id, asked for once


def restart_count() -> int:
    """Which restart of its worker group torchrun started this process as (0: the first start, or no torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def launch_info() -> LaunchInfo:
    """This process's launch (see LaunchInfo); a plain ``python train.py`` has no launch id."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return LaunchInfo()
    if os.getpid() not in _LAUNCH_IDS:
        _LAUNCH_IDS[os.getpid()] = _identify_launch()
    return LaunchInfo(restart_count(), _LAUNCH_IDS[os.getpid()])


def _identify_launch() -> str:
    """What survives a torchrun restart is the agent process (the workers' parent) and, by default, its
    key-value store at MASTER_ADDR:MASTER_PORT (the static --master_port store and the c10d one alike); a
    fresh launch has a fresh agent and a fresh store. So the first process to ask puts a random token in
    that store and every later process of the launch, restarts included, reads the same one. Without an
    agent store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) the agent process itself identifies the launch:
    the machine's boot id, its process id and its start time, which no other process on any machine
    shares (host names, process ids and run ids alone repeat in containers)."""
    token = _agent_store_token()
    if token:
        return f"token:{token}"
    agent = _process_identity(os.getppid())
    if agent:
        return f"process:{agent}"
    LOGGER.warning("WARNING: cannot identify this torchrun launch (no agent store, no %s): a torchrun restart "
                   "will start a new run folder instead of resuming this one", PROC_ROOT)
    return ""


def _agent_store_token() -> str:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return ""
    try:
        store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=datetime.timedelta(seconds=STORE_TIMEOUT_SECONDS))
        token = store.compare_set(LAUNCH_TOKEN_KEY, "", secrets.token_hex(16))  # the first process's wins
    except (KeyError, ValueError, RuntimeError) as error:
        LOGGER.warning("WARNING: torchrun's agent store is unreachable (%s)", str(error).splitlines()[0][:160]
                       if str(error) else type(error).__name__)
        return ""
    return token.decode("ascii", errors="replace") if isinstance(token, bytes) else str(token)


def _process_identity(pid: int) -> str:
    """``boot id:pid:start time`` of a process (Linux /proc), "" when unavailable."""
    try:
        boot = (PROC_ROOT / "sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
        stat = (PROC_ROOT / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
        start = stat[stat.rindex(")") + 1:].split()[19]  # field 22 (starttime); the name in (...) may hold spaces
    except (OSError, ValueError, IndexError):
        return ""
    if not boot or not start.isdigit():
        return ""
    return f"{boot}:{pid}:{start}"
