"""One timing of a training loader, shared by bench_loader.py and its YOLOv5 reference (standard library only,
so the reference environment can import it too).

``time_loader(loader, batches, seconds)`` drains the loader's prefetched batches first (so that the window
starts in the steady state, where every batch is one the workers made while the window ran), then counts
images over at least ``seconds`` of wall clock, with the CPU time of the main process and of every worker
read from /proc. Images per CPU-second is the per-core figure: on any machine, ``cores / that`` is how many
images a second the machine's cores can make, whatever the worker count.
"""
from __future__ import annotations

import os
import time
from pathlib import Path


def process_cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a live process (Linux /proc), zeros when unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0


def worker_pids(loader) -> list[int]:
    """The pids of a DataLoader's live workers (persistent workers: its ``_iterator``; YOLOv5's
    InfiniteDataLoader keeps its own ``iterator``)."""
    iterator = getattr(loader, "_iterator", None) or getattr(loader, "iterator", None)
    return [worker.pid for worker in getattr(iterator, "_workers", [])]


def time_loader(loader, batches, seconds: float) -> dict:
    """Time ``batches`` (an endless iterator of batch sizes made from ``loader``) over >= ``seconds``.

    Returns images, seconds, images/s, and per image the CPU milliseconds over the main process and the
    workers (all), of which system time, of which the main process; and images per CPU-second."""
    warmup = (getattr(loader, "prefetch_factor", None) or 0) * loader.num_workers + 1
    for _ in range(warmup):
        next(batches)
    pids = [os.getpid(), *worker_pids(loader)]
    begin = [process_cpu_seconds(pid) for pid in pids]
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        count += next(batches)
    elapsed = time.perf_counter() - start
    used = [tuple(b - a for a, b in zip(before, process_cpu_seconds(pid))) for pid, before in zip(pids, begin)]
    total = sum(user + system for user, system in used)
    return {"images": count, "seconds": round(elapsed, 3), "images_per_s": count / elapsed,
            "cpu_ms": total / count * 1e3, "system_ms": sum(s for _, s in used) / count * 1e3,
            "main_ms": sum(used[0]) / count * 1e3, "images_per_cpu_s": count / total if total else float("nan"),
            "processes": len(pids)}
