"""Two-process DDP on CPU (gloo) through torchrun: one run folder, outputs written once, by rank 0."""
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY_MODEL_YAML, make_tiny_dataset


@pytest.mark.slow
def test_torchrun_two_processes_write_one_run(tmp_path):
    data = make_tiny_dataset(tmp_path / "data", num_train=16, num_val=4)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_MODEL_YAML)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29561",
               str(ROOT / "train.py"), "--data", str(data), "--cfg", str(cfg), "--imgsz", "64", "--batch-size", "8",
               "--epochs", "2", "--workers", "0", "--device", "cpu", "--noautoanchor", "--noplots",
               "--project", str(tmp_path / "runs")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["exp"]
    lines = (tmp_path / "runs" / "exp" / "results.csv").read_text().splitlines()
    assert len(lines) == 3  # header + one row per epoch, written once
    assert (tmp_path / "runs" / "exp" / "weights" / "best.pt").exists()
    assert done.stdout.count("Starting training for 2 epochs") == 1  # only rank 0 logs
