"""The one lock between a CUDA graph's capture and the thread that pins the training loader's batches.

Why: ``torch.cuda.make_graphed_callables`` captures in CUDA's global mode (a choice of mode came with
pytorch/pytorch#188832, merged 2026-07: torch 2.14 has it, earlier releases such as the lease's 2.11 may not, so the
project keeps the default and guards the other thread instead, which works on every release). While a capture is under
way in that mode, a CUDA call that may synchronise, made by *any* thread of the process, fails and invalidates the capture.
Pinning a batch is such a call: it allocates pinned host memory and queries the events of earlier copies. The capture
then fails, and the error raised in the DataLoader's pin-memory thread ends the run at its next batch.
``--cuda-graphs`` captures at the first full batch, while that thread pins the batches behind it.

How: the pin-memory thread pins every batch of the training loader's workers through ``SlotBatch.pin_memory``
(utils/data/batch_slots.py), which holds this lock; the capture (utils/trainer/cuda_graphs.py) holds it too. The
thread then waits, making no CUDA call, for the capture's few seconds, and the capture waits for at most one batch's
pinning. No other thread of a training process calls CUDA.
"""
from __future__ import annotations

import threading

CUDA_CAPTURE_LOCK = threading.Lock()
