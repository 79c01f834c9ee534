"""utils/host_memory.py: the memory available here, within the limits of this process's control groups."""
from __future__ import annotations

from pathlib import Path

import pytest

from utils.host_memory import UNLIMITED_V1, available_memory, cgroup_available

GB = 1 << 30


def write(folder: Path, **files) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)
    return folder


@pytest.fixture
def meminfo(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {64 * GB // 1024} kB\nMemAvailable:   {40 * GB // 1024} kB\n")
    return path


def test_cgroup_v2_limit_less_working_set_over_the_groups_ancestors(tmp_path, meminfo):
    root = write(tmp_path / "cg", **{"cgroup.controllers": "cpu memory"})
    write(root / "job", memory_max=str(16 * GB), memory_current=str(6 * GB),
          memory_stat=f"anon {4 * GB}\ninactive_file {2 * GB}\nactive_file 0\n")
    write(root / "job" / "step", memory_max="max", memory_current=str(3 * GB), memory_stat="inactive_file 0\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n")
    # the job's 16 GB less its 4 GB working set (6 GB used, 2 GB of it file pages it can drop); the step sets none
    assert cgroup_available(root, proc) == 12 * GB
    assert available_memory(root, proc, meminfo) == 12 * GB
    write(root / "job", memory_max=str(64 * GB))  # a limit above the machine's: MemAvailable bounds
    assert available_memory(root, proc, meminfo) == 40 * GB
    write(root / "job" / "step", memory_max=str(5 * GB))  # the tighter of two limits
    assert cgroup_available(root, proc) == 2 * GB


def test_cgroup_v1_memory_controller_and_a_container_mounted_at_the_root(tmp_path, meminfo):
    root = tmp_path / "cg"
    write(root / "memory", memory_limit_in_bytes=str(8 * GB), memory_usage_in_bytes=str(5 * GB),
          memory_stat=f"cache {2 * GB}\ntotal_inactive_file {1 * GB}\n")
    proc = tmp_path / "cgroup"
    # the host's path of a container's group that is mounted at the root inside it: read at the root
    proc.write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_available(root, proc) == 4 * GB
    assert available_memory(root, proc, meminfo) == 4 * GB


def test_no_limit_anywhere_is_memavailable(tmp_path, meminfo):
    root = tmp_path / "cg"
    write(root / "memory" / "user", memory_limit_in_bytes=str(UNLIMITED_V1 + 4096), memory_usage_in_bytes="100")
    write(root / "unified")  # a hybrid machine: version 2's hierarchy without the memory controller
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/user\n0::/user\n")
    assert cgroup_available(root, proc) is None
    assert available_memory(root, proc, meminfo) == 40 * GB
    assert available_memory(root, tmp_path / "missing", meminfo) == 40 * GB  # no /proc/self/cgroup
    (root / "memory" / "user" / "memory.limit_in_bytes").write_text("garbage")
    assert cgroup_available(root, proc) is None


def test_a_group_over_its_limit_has_nothing_available(tmp_path, meminfo):
    root = write(tmp_path / "cg", **{"cgroup.controllers": "memory"})
    write(root / "g", memory_max=str(GB), memory_current=str(2 * GB), memory_stat="inactive_file 0\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/g\n")
    assert cgroup_available(root, proc) == -GB
    assert available_memory(root, proc, meminfo) == 0


def test_this_machine_reads_without_error():
    """The real files: a positive number, never above MemAvailable."""
    with open("/proc/meminfo", encoding="ascii") as f:
        machine = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    if machine is None:
        pytest.skip("no MemAvailable in /proc/meminfo")
    assert 0 < available_memory() <= machine * 1.05  # memory moves between the two reads
