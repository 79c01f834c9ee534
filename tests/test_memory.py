"""utils.memory.keep_freed_memory: freed large blocks are reused without new page faults (glibc)."""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Allocates, writes and frees a 64 MB tensor 16 times, like a training step's activations; prints the
# page faults of the last 4 rounds (the heap needs a few rounds to hold a free block of the right size).
SCRIPT = """
import resource, sys
sys.path.insert(0, {root!r})
import torch
from utils.memory import keep_freed_memory
applied = keep_freed_memory() if {keep} else False
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for round in range(16):
    if round == 12:
        before = faults()
    block = torch.ones(16 * 1024 * 1024)  # 64 MB, written
    del block
print(applied, faults() - before)
"""


def last_rounds_faults(keep: bool) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT), keep=keep)], capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_memory_is_reused_without_page_faults():
    pages = 64 * 1024 * 1024 // 4096
    applied, kept = last_rounds_faults(keep=True)
    _, default = last_rounds_faults(keep=False)
    assert applied
    assert default > 3 * pages  # glibc's default: a fresh mmap each round, every page faulted in again
    assert kept < pages // 10  # kept: the same heap memory, already mapped
