"""utils/rng.py: the one capture/restore pair of the global generators, and rng_kept() around API calls."""
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from utils import rng
from utils.rng import capture_rng, restore_rng, rng_kept

ROOT = Path(__file__).resolve().parents[1]


def draws():
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_capture_is_plain_data_and_restores_every_generator(tmp_path):
    torch.save(capture_rng(), tmp_path / "rng.pt")
    expected = draws()
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draws() == expected


def test_rng_kept_undoes_seeding_and_draws():
    state = capture_rng()
    expected = draws()
    restore_rng(state)
    with rng_kept():
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
        draws()
    assert draws() == expected


def test_rng_kept_restores_on_error():
    state = capture_rng()
    expected = draws()
    restore_rng(state)
    with pytest.raises(RuntimeError), rng_kept():
        torch.manual_seed(7)
        raise RuntimeError("stop")
    assert draws() == expected


@pytest.fixture
def seed_queue(monkeypatch):
    """torch's queue of CUDA seeds, put back as it was after the test."""
    tracker = rng._seed_queue()
    if tracker is None:
        pytest.skip("this torch keeps no queue of CUDA seeds")
    for name in rng.SEED_QUEUE_FIELDS:
        value = getattr(tracker, name)
        monkeypatch.setattr(tracker, name, list(value) if isinstance(value, list) else value)
    return tracker


@pytest.mark.skipif(torch.cuda.is_initialized(), reason="needs CUDA not yet initialised in this process")
def test_rng_kept_takes_back_cuda_seeds_queued_during_the_call(seed_queue):
    torch.cuda.manual_seed_all(5)  # no CUDA yet: queued until initialisation
    before = seed_queue.manual_seed_all_cb
    with rng_kept():
        torch.manual_seed(123)  # queues 123 for CUDA as well
        assert seed_queue.manual_seed_all_cb is not before
    assert seed_queue.manual_seed_all_cb is before
    assert [entry for entry in seed_queue.call_order if entry is not None] == [before]


class FakeGenerator:
    def __init__(self):
        self.seeds = []

    def manual_seed(self, seed):
        self.seeds.append(int(seed))

    def seed(self):  # torch: a nondeterministic seed, as a new default generator gets
        self.seeds.append("fresh")


@pytest.mark.skipif(torch.cuda.is_initialized(), reason="needs CUDA not yet initialised in this process")
def test_rng_kept_reseeds_cuda_first_initialised_during_the_call(seed_queue, monkeypatch):
    """CUDA initialised inside the call (faked on the CPU): its generators get what an initialisation after the
    call would give them: a new generator's (nondeterministic) seed, then the seeds the caller had queued, in order."""
    generators = [FakeGenerator(), FakeGenerator()]
    initialised = [False]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised[0])
    monkeypatch.setattr(torch.cuda, "default_generators", generators, raising=False)
    monkeypatch.setattr(torch.cuda.random, "device_count", lambda: len(generators))
    torch.cuda.manual_seed_all(5)  # the caller's seed, waiting for CUDA
    with rng_kept():
        torch.manual_seed(123)  # the call seeds (queued: CUDA is not up yet) ...
        initialised[0] = True   # ... then brings CUDA up
    assert [g.seeds for g in generators] == [["fresh", 5], ["fresh", 5]]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_initialised_inside_the_call_draws_as_a_fresh_process():
    """On a GPU: after a call that initialised CUDA and drew from it, the caller's first CUDA draws are those of a
    process that never made the call: the caller's seed's when it had seeded; when it had not, a fresh
    nondeterministic seed (torch seeds a new default CUDA generator from the OS), never the call's stream."""
    script = """
import sys, torch
from utils.rng import rng_kept
seed = sys.argv[1]
if seed != "none":
    torch.manual_seed(int(seed))
if sys.argv[2] == "call":
    with rng_kept():
        torch.manual_seed(99)
        torch.randn(1000, device="cuda")
elif sys.argv[2] == "continued":
    torch.manual_seed(99)
    torch.randn(1000, device="cuda")
print(torch.randn(4, device="cuda").tolist())
"""

    def draw(seed, mode):
        return subprocess.run([sys.executable, "-c", script, seed, mode], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout

    assert draw("3", "call") == draw("3", "plain")
    unseeded = [draw("none", "call") for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # fresh seeds, as two fresh processes get
    assert draw("none", "continued") not in unseeded  # not the call's generator carried on
    assert draw("none", "plain") not in unseeded
