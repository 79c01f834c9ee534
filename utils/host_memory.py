"""Memory this process may still take: the kernel's estimate, within the limits of its control groups.

``/proc/meminfo``'s MemAvailable is the whole machine's. Inside a container or a job whose control group (cgroup)
has a memory limit, the limit is what counts: shared memory (``/dev/shm``, where ``--cache ram`` keeps its store)
is charged to the group that writes it, and a group over its limit is killed by the kernel, not told "no memory".
So the memory available here is the smaller of MemAvailable and, for every group from this process's up to the
root that sets a limit, that limit less the group's working set (its usage less the file pages it could drop,
``inactive_file``, as container runtimes count it).

Read from ``/proc/self/cgroup`` and the cgroup file system: version 2 (one hierarchy, ``memory.max``,
``memory.current``) and version 1 (a ``memory`` controller, ``memory.limit_in_bytes``, ``memory.usage_in_bytes``).
A group whose folder is not mounted where its path says (a container that sees only its own group at the mount's
root) is read at the mount's root. Anything missing or unreadable counts as no limit.
"""
from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED_V1 = 1 << 62  # cgroup v1 writes "no limit" as the largest page-aligned 64-bit value (9223372036854771712)


def available_memory(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup"),
                     meminfo: Path = Path("/proc/meminfo")) -> int:
    """Bytes of memory available to new allocations: MemAvailable (else sysconf), within the cgroups' limits."""
    machine = _meminfo_available(meminfo)
    group = cgroup_available(cgroup_root, proc_cgroup)
    return machine if group is None else max(0, min(machine, group))


def cgroup_available(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The smallest (limit - working set) over this process's memory cgroups that set a limit; None without one."""
    try:
        lines = proc_cgroup.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    room = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            mount, files = cgroup_root if (cgroup_root / "cgroup.controllers").exists() else cgroup_root / "unified", _V2
        elif "memory" in controllers.split(","):
            mount, files = cgroup_root / "memory", _V1
        else:
            continue
        for folder in _groups(mount, path):
            value = _group_room(folder, *files)
            if value is not None:
                room = value if room is None else min(room, value)
    return room


# (limit file, usage file, memory.stat key of the inactive file pages) per cgroup version
_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _groups(mount: Path, path: str) -> list[Path]:
    """The folders of the group at ``path`` and of its ancestors below ``mount``; the mount's root alone when the
    path is not there (the group is the container's own, mounted at the root)."""
    parts = [part for part in path.split("/") if part not in ("", ".", "..")]
    folder = mount.joinpath(*parts)
    if not folder.is_dir():
        return [mount]
    return [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _group_room(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    limit = _read_int(folder / limit_file)
    if limit is None or limit >= UNLIMITED_V1:
        return None
    usage = _read_int(folder / usage_file) or 0
    return limit - max(usage - _stat(folder / "memory.stat", inactive_key), 0)


def _read_int(path: Path) -> int | None:
    """The integer in a cgroup file; None for "max", a missing file or anything else."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except (OSError, UnicodeDecodeError):
        pass
    return 0


def _meminfo_available(meminfo: Path) -> int:
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
