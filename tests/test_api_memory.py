"""The glibc heap policy (utils/memory.py) and the Python API: after train.run / val.run the caller's process hands
freed memory back to the kernel as glibc does by default; the command line keeps its policy. Each case runs in its
own process, since the policy is process-wide."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's heap policy (Linux)")

# Runs a step, then allocates 256 MB as 256 written 1 MB arrays and frees them; prints the resident memory (MB)
# before, while held and after freeing.
SCRIPT = """
import sys
from pathlib import Path
import numpy as np

def resident_mb():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2 ** 20

mode, folder = sys.argv[1], Path(sys.argv[2])
if mode in ("val", "train"):
    from tests.conftest import make_tiny_run, save_random_checkpoint
    data, cfg = make_tiny_run(folder)
if mode == "val":
    import val
    weights = save_random_checkpoint(folder / "tiny.pt", ["class0", "class1"])
    val.run(data=data, weights=weights, imgsz=64, batch_size=4, workers=0, device="cpu", amp="off",
            project=folder / "val", plots=False)
elif mode == "train":
    import train
    train.run(data=data, cfg=cfg, weights="", imgsz=64, batch_size=4, epochs=1, workers=0, device="cpu", project=folder / "train",
              noautoanchor=True, noplots=True, no_tensorboard=True)
elif mode == "call":
    from utils.memory import kept_during_call
    with kept_during_call():
        held = [np.ones(2 ** 18, np.float32) for _ in range(64)]
        del held
elif mode == "command line":
    from utils.memory import keep_freed_memory, kept_during_call
    assert keep_freed_memory()
    with kept_during_call():
        pass
before = resident_mb()
blocks = [np.ones(2 ** 18, np.float32) for _ in range(256)]
held = resident_mb()
del blocks
print(before, held, resident_mb())
"""


def resident_after(mode: str, folder: Path) -> tuple[float, float, float]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(folder)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    before, held, after = (float(value) for value in done.stdout.split()[-3:])
    assert held - before > 200  # the 256 MB were really resident
    return before, held, after


@pytest.mark.parametrize("mode", ["call", "val"])
def test_freed_memory_goes_back_to_the_kernel_after_an_api_call(mode, tmp_path):
    before, _, after = resident_after(mode, tmp_path)
    assert after - before < 32, f"{after - before:.0f} MB of 256 MB freed stayed resident"


@pytest.mark.slow
def test_freed_memory_goes_back_to_the_kernel_after_train_run(tmp_path):
    """train.run keeps freed memory while it trains (utils/memory.py), then gives the policy up and trims."""
    before, _, after = resident_after("train", tmp_path)
    assert after - before < 32, f"{after - before:.0f} MB of 256 MB freed stayed resident"


def test_a_process_that_chose_the_policy_keeps_it_after_a_training_call(tmp_path):
    """The command line (train.py) applies the policy for its whole process: a call inside it does not end it."""
    before, _, after = resident_after("command line", tmp_path)
    assert after - before > 200
