"""Memory of the image cache and of loader workers (memory figures: valid on a busy machine, unlike timings).

    # total PSS of torchrun and all its processes, --cache ram against --cache off, per worker start method
    python benchmarks/bench_memory.py pss [--data ../shared/datasets/bccd/data.yaml] [--imgsz 640] [--nproc 2]
        [--workers 2] [--methods fork spawn forkserver] [--steps 12] [--repo PATH]
    # each loader worker's private memory (USS) at the start and the end of one epoch of a generated dataset
    python benchmarks/bench_memory.py workers [--images 50000] [--root /tmp/yolo-bench-50k] [--workers 2]
        [--imgsz 128] [--method fork|spawn|forkserver] [--repo PATH]

``pss``: for each start method and each of ``--cache off`` / ``--cache ram``, ``torchrun --nproc_per_node N
train.py`` on the dataset (yolov5n from scratch, batch 8 per process, fp32 on the CPU) through a wrapper that sets
the start method of every process's multiprocessing (loader workers, the scan's pool) and keeps the loader workers
that a CPU run would drop when the RAM cache lets the main process load (``stages.compute_fills_cpus`` -> False:
the workers a GPU machine runs); with ``--all-workers``, ``--workers`` per process even where the loader would give
each process fewer (usable CPUs / processes: 1 each on a 2-core machine). The process tree is sampled twice a second until the training bar shows
``--steps`` batches (then the run is interrupted) or the run ends. Reported: the peak of the summed PSS, and the
peak of the summed PSS counting the cache files in shared memory at their allocated size instead of their mapped
PSS (a store's pages no process has touched yet are memory too: this is the honest total). The ram - off
difference is then divided by one copy of the resized images (train + val, at --imgsz, computed from the scan).

``workers``: the loader alone (no model) on a generated dataset of ``--images`` 96-px JPEGs, mosaic augmentation,
``--cache off``, ``--workers`` workers started by ``--method`` (default fork): each worker's USS (Private_Clean +
Private_Dirty) after the first ``--warmup`` batches (10; the allocator's and libraries' own start-up, the same
whatever the dataset's size) and after the last batch of the epoch.

``--repo PATH`` runs another checkout's code (e.g. ``git worktree add /tmp/before <commit>``) for a before/after
comparison on the same machine. Say the CPU beside every figure (printed in the header).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORE_MARK = "yolo-trainer-images-"
TRAIN_BAR = re.compile(r"[\d.]+G\s.*\|\s*(\d+)/(\d+) \[")  # the training bar (memory column, batches done)

WRAPPER = '''
import multiprocessing, sys
if __name__ == "__main__":
    sys.path.insert(0, {repo!r})
    multiprocessing.set_start_method({method!r}, force=True)
    import utils.data.loader as loader
    import utils.trainer.stages as stages
    stages.compute_fills_cpus = lambda *args, **kwargs: False  # keep the loader workers, as on a GPU machine
    if {all_workers!r}:  # --workers per process even where the CPUs are fewer (as on a machine with enough)
        loader.worker_count = lambda workers, batch_size, processes=1: max(0, min(workers, batch_size))
    import train
    sys.exit(train.main(sys.argv[1:]))
'''


# ---------------------------------------------------------------------------------------------- /proc readers
def cpu_name() -> str:
    """The CPU's model name, family and model numbers, and the CPU count (for the figures' header)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return (f"{fields.get('model name', 'unknown CPU')} (family {fields.get('cpu family', '?')}, model "
            f"{fields.get('model', '?')}), {os.cpu_count()} CPUs")


def rollup(pid: int) -> dict[str, int]:
    """smaps_rollup's fields in bytes ({} when the process is gone)."""
    values = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[-1] == "kB":
                values[name] = int(parts[0]) * 1024
    except (OSError, ValueError):
        return {}
    return values


def mapped_bytes(pid: int, mapping, fields: tuple[str, ...]) -> int:
    """Sum of ``fields`` (smaps lines such as "Pss:") over this process's mappings whose header line passes
    ``mapping(line)``."""
    total, inside = 0, False
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = mapping(line)
        elif inside and line.startswith(fields):
            total += int(line.split()[1]) * 1024
    return total


def store_pss(pid: int) -> int:
    """PSS of this process's mappings of image-cache store files."""
    return mapped_bytes(pid, lambda line: STORE_MARK in line, ("Pss:",))


def tree(root: int) -> list[int]:
    """``root`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += children.get(pid, [])
    return found


def store_files_bytes() -> int:
    """Allocated bytes of the image-cache store files in shared memory and the user cache's ram folder."""
    folders = [Path("/dev/shm"), Path(os.environ.get("YOLO_TRAINER_CACHE") or Path.home() / ".cache" / "yolo-trainer")
               / "ram"]
    total = 0
    for folder in folders:
        for path in folder.glob(f"{STORE_MARK}*"):
            try:
                total += path.stat().st_blocks * 512
            except OSError:
                pass
    return total


# ---------------------------------------------------------------------------------------------- pss
def one_copy_bytes(data: str, imgsz: int) -> int:
    """Bytes of the resized train + val images (what one copy of the RAM cache holds)."""
    sys.path.insert(0, str(ROOT))
    from utils.data.dataset import ram_cache_bytes
    from utils.data.dataset_yaml import load_data_config
    from utils.data.verify import scan_split

    config = load_data_config(data)
    return sum(ram_cache_bytes(scan_split(split, config.nc).shapes, imgsz) for split in (config.train, config.val))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_pss(args, method: str, cache: str, folder: Path) -> dict:
    wrapper = folder / f"wrapper_{method}.py"
    wrapper.write_text(WRAPPER.format(repo=str(Path(args.repo).resolve()), method=method,
                                      all_workers=args.all_workers))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_port",
               str(free_port()), str(wrapper), "--data", args.data, "--cfg",
               str(Path(args.repo).resolve() / "models" / "yolov5n.yaml"), "--weights", "", "--imgsz", str(args.imgsz),
               "--batch-size", str(8 * args.nproc), "--epochs", "1", "--workers", str(args.workers), "--device", "cpu",
               "--cache", cache, "--amp", "off", "--noautoanchor", "--noplots", "--no-tensorboard",
               "--project", str(folder / "runs"), "--name", f"{method}-{cache}"]
    process = subprocess.Popen(command, cwd=args.repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    steps = {"done": 0}
    reader = threading.Thread(target=follow_bar, args=(process.stdout, steps), daemon=True)
    reader.start()
    peak_pss = peak_honest = 0
    processes = 0
    while process.poll() is None:
        pids = tree(process.pid)
        pss = shared = 0
        for pid in pids:
            pss += rollup(pid).get("Pss", 0)
            shared += store_pss(pid)
        honest = pss - shared + store_files_bytes()
        if pss > peak_pss:
            peak_pss, processes = pss, len(pids)
        peak_honest = max(peak_honest, honest)
        if steps["done"] >= args.steps:
            os.killpg(process.pid, signal.SIGINT)
            break
        time.sleep(0.5)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    reader.join(timeout=5)
    return {"pss": peak_pss, "honest": peak_honest, "processes": processes, "steps": steps["done"],
            "tail": steps.get("tail", "")}


def follow_bar(stream, steps: dict) -> None:
    """Count the training bar's batches from rank 0's output; keep the output's end for error reports."""
    tail = b""
    for chunk in iter(lambda: stream.read1(4096), b""):
        tail = (tail + chunk)[-4000:]
        for line in re.split(r"[\r\n]", chunk.decode("utf-8", "replace")):
            match = TRAIN_BAR.search(line)
            if match:
                steps["done"] = max(steps["done"], int(match.group(1)))
    steps["tail"] = tail.decode("utf-8", "replace")


def pss_command(args) -> None:
    copy = one_copy_bytes(args.data, args.imgsz)
    each = args.workers if args.all_workers else f"at most {args.workers}"
    print(f"# PSS, torchrun --nproc_per_node {args.nproc}, {each} workers each, {Path(args.data)} at "
          f"{args.imgsz}, code: {Path(args.repo).resolve()}; {cpu_name()}")
    print(f"one copy of the resized images (train + val): {copy / 1e6:.0f} MB")
    print("| start method | cache | processes | peak PSS (MB) | peak PSS, cache files at full size (MB) | steps |")
    print("|---|---|---|---|---|---|")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as folder:
        for method in args.methods:
            for cache in ("off", "ram"):
                row = run_pss(args, method, cache, Path(folder))
                results[method, cache] = row
                print(f"| {method} | {cache} | {row['processes']} | {row['pss'] / 1e6:.0f} | {row['honest'] / 1e6:.0f} "
                      f"| {row['steps']} |", flush=True)
                if row["steps"] == 0:
                    print(f"  (no training step seen; output's end: {row['tail'][-600:]!r})")
    for method in args.methods:
        off, ram = results[method, "off"], results[method, "ram"]
        added = ram["honest"] - off["honest"]
        print(f"{method}: --cache ram adds {added / 1e6:.0f} MB = {added / copy:.2f} copies of the cache")


# ---------------------------------------------------------------------------------------------- workers
def uss(pid: int) -> int:
    values = rollup(pid)
    return values.get("Private_Clean", 0) + values.get("Private_Dirty", 0)


def shared_buffers_private(pid: int) -> int:
    """Private bytes of this process's shared-memory file mappings (the batch buffers workers send the main
    process: private while the main process does not hold that batch, so they swing USS by megabytes)."""
    return mapped_bytes(pid, lambda line: "/dev/shm/" in line or "torch_" in line,
                        ("Private_Clean:", "Private_Dirty:"))


def workers_command(args) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.generated_dataset import make_dataset

    data = make_dataset(Path(args.root), args.images)
    sys.path.insert(0, str(Path(args.repo).resolve()))
    from utils.config import Hyp
    from utils.data.loader import create_dataloader, set_loader_epoch

    images = str(Path(data).parent / "images" / "train")
    loader, dataset = create_dataloader(images, args.imgsz, 16, 32, hyp=Hyp(), augment=True, cache="off",
                                        workers=args.workers, shuffle=True, names=["red", "green", "blue"],
                                        multiprocessing_context=args.method)
    set_loader_epoch(loader, 0)
    print(f"# loader workers' USS over one epoch: {len(dataset)} images ({args.root}), imgsz {args.imgsz}, "
          f"{loader.num_workers} workers ({args.method}), --cache off, code: {Path(args.repo).resolve()}; {cpu_name()}")
    iterator = iter(loader)
    count = 0
    for _ in range(args.warmup):
        next(iterator)
        count += 1
    pids = [worker.pid for worker in loader._iterator._workers]  # persistent workers: the loader keeps them
    start = {pid: (uss(pid), shared_buffers_private(pid)) for pid in pids}
    for _ in iterator:
        count += 1
    end = {pid: (uss(pid), shared_buffers_private(pid)) for pid in pids}  # persistent workers: still alive
    print(f"| worker | USS after batch {args.warmup} (MB) | USS after the last batch (MB) | growth | the same "
          "without batch buffers (MB) | growth |")
    print("|---|---|---|---|---|---|")
    for number, pid in enumerate(pids):
        (first, first_buffers), (last, last_buffers) = start[pid], end[pid]
        rest_first, rest_last = first - first_buffers, last - last_buffers
        print(f"| {number} | {first / 1e6:.1f} | {last / 1e6:.1f} | {(last - first) / max(first, 1):+.1%} "
              f"| {rest_first / 1e6:.1f} -> {rest_last / 1e6:.1f} | {(rest_last - rest_first) / max(rest_first, 1):+.1%} |")
    print(f"{count} batches")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pss = commands.add_parser("pss")
    pss.add_argument("--data", default=str(ROOT.parent / "shared" / "datasets" / "bccd" / "data.yaml"))
    pss.add_argument("--imgsz", type=int, default=640)
    pss.add_argument("--nproc", type=int, default=2)
    pss.add_argument("--workers", type=int, default=2)
    pss.add_argument("--methods", nargs="+", default=["fork", "spawn", "forkserver"])
    pss.add_argument("--steps", type=int, default=12, help="training batches (rank 0) before the run is interrupted")
    pss.add_argument("--all-workers", action="store_true",
                     help="--workers per process even when the CPUs / processes are fewer (the loader's own cap)")
    pss.add_argument("--repo", default=str(ROOT))
    workers = commands.add_parser("workers")
    workers.add_argument("--images", type=int, default=50000)
    workers.add_argument("--root", default="/tmp/yolo-bench-50k")
    workers.add_argument("--workers", type=int, default=2)
    workers.add_argument("--imgsz", type=int, default=128)
    workers.add_argument("--method", default="fork", choices=["fork", "spawn", "forkserver"])
    workers.add_argument("--warmup", type=int, default=10,
                         help="batches before the first reading (the allocator's and libraries' start-up)")
    workers.add_argument("--repo", default=str(ROOT))
    args = parser.parse_args()
    pss_command(args) if args.command == "pss" else workers_command(args)


if __name__ == "__main__":
    main()
