"""The global random generators (Python, numpy, torch CPU and CUDA): one capture/restore pair.

``capture_rng()`` returns plain data (lists, ints, floats, tensors) so a checkpoint holding it loads with
``torch.load(weights_only=True)``; ``restore_rng(state)`` sets the generators back to it. The trainer saves
one state per process in its checkpoints; the Python API wraps each call in ``rng_kept()`` so the caller's
generators are as it left them.

CUDA's generators exist only once CUDA is initialised; before that torch queues seeds
(``torch.cuda.manual_seed_all``, also called by ``torch.manual_seed``) and applies them at initialisation.
``rng_kept()`` covers both sides: seeds the call queued are taken back, and generators the call brought
into being are put where a fresh initialisation after the call would have put them: a nondeterministic seed
(torch seeds each default CUDA generator from the OS when it creates it; seen on an H200 with torch 2.11), then
the seeds the caller had queued.
"""
from __future__ import annotations

import contextlib
import logging
import random

import numpy as np
import torch

LOGGER = logging.getLogger(__name__)

SEED_QUEUE_FIELDS = ("manual_seed_all_cb", "manual_seed_cb", "call_order")  # torch.cuda._LazySeedTracker


def capture_rng() -> dict:
    """Python, numpy, torch (and CUDA when initialised) global generator states, as plain data."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {"bit_generator": numpy_state["bit_generator"], "key": numpy_state["state"]["key"].tolist(),
                  "pos": int(numpy_state["state"]["pos"]), "has_gauss": int(numpy_state["has_gauss"]),
                  "gauss": float(numpy_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Set the global generators to a ``capture_rng`` result (CUDA only when both sides have it)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state({"bit_generator": numpy_state["bit_generator"],
                         "state": {"key": np.asarray(numpy_state["key"], dtype=np.uint32), "pos": numpy_state["pos"]},
                         "has_gauss": numpy_state["has_gauss"], "gauss": numpy_state["gauss"]})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def rng_kept():
    """Leave every global generator as it was found, CUDA's included when the body initialised CUDA."""
    state = capture_rng()
    queued = None if "cuda" in state else _queued_cuda_seeds()
    try:
        yield
    finally:
        restore_rng(state)
        if "cuda" not in state:
            _restore_uninitialised_cuda(queued)


def _seed_queue():
    """torch's record of CUDA seeds waiting for initialisation (a private object: None where it is gone)."""
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    if tracker is None or not all(hasattr(tracker, name) for name in SEED_QUEUE_FIELDS):
        return None
    return tracker


def _queued_cuda_seeds() -> dict | None:
    tracker = _seed_queue()
    if tracker is None:
        return None
    return {name: list(value) if isinstance(value, list) else value
            for name, value in ((name, getattr(tracker, name)) for name in SEED_QUEUE_FIELDS)}


def _restore_uninitialised_cuda(queued: dict | None) -> None:
    """CUDA was not initialised when the call began: put back the seeds that were waiting, or, when the call
    initialised CUDA, give each device's generator the state that initialisation with those seeds gives."""
    if torch.cuda.is_initialized():
        for generator in torch.cuda.default_generators:
            generator.seed()  # what creating it does: a nondeterministic seed, offset 0
        for entry in (queued or {}).get("call_order", []):
            if entry is not None:
                entry[0]()  # (seeding function, traceback) as torch queued it; applies now CUDA is up
        return
    tracker = _seed_queue()
    if tracker is None or queued is None:
        LOGGER.debug("torch keeps no queue of CUDA seeds here: nothing to put back")
        return
    for name, value in queued.items():
        setattr(tracker, name, value)
