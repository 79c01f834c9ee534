"""Torch operations counted as they pass through the dispatcher (benchmarks/render_ops.py, benchmarks/loss_ops.py):
on CUDA each one costs host time, and most launch a kernel, so their number is what a host-bound step pays for."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OperationCount(TorchDispatchMode):
    """``with OperationCount() as count: ...`` then ``count.operations``: every operation run inside, views included."""

    def __init__(self):
        super().__init__()
        self.operations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operations += 1
        return func(*args, **(kwargs or {}))
