"""Torch operations counted as they pass through the dispatcher (benchmarks/render_ops.py, benchmarks/loss_ops.py):
on CUDA each one costs host time, and most launch a kernel, so their number is what a host-bound step pays for.
Also the bytes each kind of operation reads and writes (its tensor inputs and outputs, views excluded): what a
device-bound step pays for, since such operations (copies, indexing, elementwise work) are bound by memory."""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _tensors(values) -> list:
    found = []
    for value in values if isinstance(values, (list, tuple)) else (values,):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


class OperationCount(TorchDispatchMode):
    """``with OperationCount() as count: ...`` then ``count.operations``: every operation run inside, views included;
    ``count.bytes_by_kind``: {operation name: [operations, bytes read and written]} of the operations that are not
    views (a gather counts the elements it reads once, whatever the memory it touches)."""

    def __init__(self):
        super().__init__()
        self.operations = 0
        self.bytes_by_kind = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operations += 1
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            moved = sum(t.numel() * t.element_size() for t in _tensors(args) + _tensors(out))
            entry = self.bytes_by_kind[func.overloadpacket.__name__]
            entry[0] += 1
            entry[1] += moved
        return out

    def total_bytes(self) -> int:
        return sum(moved for _, moved in self.bytes_by_kind.values())
