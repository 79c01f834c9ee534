"""Count the reads of tensor values by the host: on a GPU each one waits for every kernel queued before it.

    with HostReads() as reads:
        ...                                  # training steps
    reads.by_place()                         # {"utils/trainer/loop.py:optimizer_step": 12, ...}

Counted: ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()`` and a tensor's truth value, ``float()`` and ``int()``
(Python's ``bool(t)``, ``if t:``, ``float(t)``), each under the project file and function that asked for it (the
nearest frame in the repository outside this module). Works on the CPU, where such reads cost nothing, so the
training step's reads can be tested without a GPU. Not counted: the waits PyTorch makes by itself (indexing with a
boolean mask, ``torch.unique``, ``nonzero``: output sizes the host must know); on CUDA,
``torch.cuda.set_sync_debug_mode("error")`` finds those.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


class HostReads:
    def __init__(self):
        self.places: Counter = Counter()
        self._saved: dict = {}

    def __enter__(self) -> "HostReads":
        for name in METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._counting(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def _counting(self, name: str, original):
        places, here = self.places, Path(__file__).resolve()

        def counted(tensor, *args, **kwargs):
            if tensor.device.type != "meta":
                places[_caller(here)] += 1
            return original(tensor, *args, **kwargs)
        counted.__name__ = name
        return counted

    def by_place(self) -> dict:
        return dict(self.places)

    def total(self) -> int:
        return sum(self.places.values())


def _caller(here: Path) -> str:
    """``relative/file.py:function`` of the nearest frame in the repository (not this module, not torch)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path != here and path.is_relative_to(ROOT) and "site-packages" not in path.parts:
            return f"{path.relative_to(ROOT)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "elsewhere"
