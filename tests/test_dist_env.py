"""Which environments make a distributed run (utils/dist.py): a process group only when a launcher says so; the
RANK=0 WORLD_SIZE=1 that some schedulers export for every job trains as one process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, make_tiny_run
from utils import dist

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE")


@pytest.fixture
def environment(monkeypatch):
    """Set exactly the given launch variables (the others removed)."""
    def set_only(**values):
        for name in LAUNCH_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))
    return set_only


@pytest.mark.parametrize("values", [
    {},
    {"RANK": 0, "WORLD_SIZE": 1},                                       # a scheduler's bookkeeping
    {"RANK": 0, "WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1"},           # an address, but no launcher's local rank
    {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0},
])
def test_rank_variables_without_a_launcher_mean_one_process(environment, values):
    environment(**values)
    assert dist.dist_info() == dist.DistInfo(rank=-1, local_rank=-1, world_size=1, local_world_size=1)
    assert not dist.dist_info().distributed and dist.is_main_process()
    assert dist.unlaunched_world() is None
    dist.init_distributed(torch.device("cpu"))  # alone: no group
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("values, expected", [
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2,
      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1}, dist.DistInfo(1, 1, 2, 2)),             # torchrun
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0}, dist.DistInfo(0, 0, 1, 1)),
    ({"RANK": 3, "WORLD_SIZE": 4, "LOCAL_RANK": 1, "MASTER_ADDR": "10.0.0.1"}, dist.DistInfo(3, 1, 4, 4)),
])
def test_a_launcher_makes_a_distributed_run(environment, values, expected):
    environment(**values)
    assert dist.dist_info() == expected and dist.dist_info().distributed


def test_several_processes_without_a_launcher_are_one_line_error(environment):
    environment(RANK=1, WORLD_SIZE=4)
    assert dist.dist_info() == dist.DistInfo()
    with pytest.raises(dist.DistributedError, match=r"^WORLD_SIZE=4 is set but no launcher started this process .* "
                                                      r"torchrun --nproc_per_node N train.py") as raised:
        dist.init_distributed(torch.device("cpu"))
    assert "\n" not in str(raised.value) and not torch.distributed.is_initialized()


def test_a_malformed_rank_variable_is_one_line_error(environment):
    environment(TORCHELASTIC_RUN_ID="x", RANK="zero", WORLD_SIZE=1, LOCAL_RANK=0)
    with pytest.raises(dist.DistributedError, match="environment variable RANK='zero' is not an integer"):
        dist.dist_info()


def test_train_py_under_a_schedulers_rank_variables_trains_as_one_process(tmp_path):
    """End to end: ``RANK=0 WORLD_SIZE=1 python train.py ...`` (no LOCAL_RANK, no MASTER_ADDR) trains one process."""
    data, cfg = make_tiny_run(tmp_path, num_train=4, num_val=2)
    environment = {name: value for name, value in os.environ.items() if name not in LAUNCH_VARIABLES}
    done = subprocess.run([sys.executable, "train.py", "--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64",
                           "--batch-size", "4", "--epochs", "1", "--workers", "0", "--device", "cpu", "--noautoanchor",
                           "--noplots", "--no-tensorboard", "--project", str(tmp_path / "runs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**environment, "RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "DDP: host" not in output and "internal error" not in output
    assert (tmp_path / "runs" / "exp" / "weights" / "best.pt").is_file()
    assert len((tmp_path / "runs" / "exp" / "results.csv").read_text().splitlines()) == 2  # header + 1 epoch
