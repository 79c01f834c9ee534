"""The one lock between a CUDA graph's capture and the thread that pins the training loader's batches.

Why: ``--cuda-graphs`` captures (utils/trainer/graph_capture.py, ``torch.cuda.graph``) in CUDA's global mode, torch's
default, as ``torch.cuda.make_graphed_callables`` does. While a capture is under way in that mode, a CUDA call that
may synchronise, made by *any* thread of the process, fails and invalidates the capture. Pinning a batch is such a
call: it allocates pinned host memory and queries the events of earlier copies. The capture then fails, and the error
raised in the DataLoader's pin-memory thread ends the run at its next batch. ``--cuda-graphs`` captures at the first
full batch (and at an epoch's smaller last batch), while that thread pins the batches behind it. (The lock works in
any capture mode.)

How: the pin-memory thread pins every batch of the training loader's workers through ``SlotBatch.pin_memory``
(utils/data/batch_slots.py), which holds this lock; the capture (utils/trainer/cuda_graphs.py) holds it too. The
thread then waits, making no CUDA call, for the capture's few seconds, and the capture waits for at most one batch's
pinning. No other thread of a training process calls CUDA.
"""
from __future__ import annotations

import threading

CUDA_CAPTURE_LOCK = threading.Lock()
