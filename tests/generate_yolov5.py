"""YOLOv5-v7-format checkpoints for the tests, written without YOLOv5's code.

``tests/yolov5_lookalike/write_checkpoint.py`` runs in a subprocess where a look-alike ``models``
package (YOLOv5's module, class and attribute names) shadows ours, so ``torch.save`` pickles the tree
as YOLOv5 does. What it writes is listed in that script's docstring.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "yolov5_lookalike" / "write_checkpoint.py"


@dataclass(frozen=True)
class Yolov5Files:
    checkpoint: Path  # final (best.pt-like): fp16 model, no EMA
    training_checkpoint: Path  # last.pt-like: model, EMA, optimizer
    io: Path  # input, eval output and state_dict (plain tensors)
    shapes: Path  # JSON: state-dict shapes, strides, parameter counts of yolov5n / yolov5s


def _write(folder: Path, *extra: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # nothing may put the project's models package ahead of the look-alike
    done = subprocess.run([sys.executable, str(SCRIPT), str(ROOT / "models"), str(folder), *extra], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def write_yolov5_run(folder: Path, cfg: Path, data: Path, epochs: int, epoch: int, layout: str = "v7") -> Path:
    """A YOLOv5 run folder (``folder/exp``) interrupted after ``epoch`` of ``epochs``, the model ``cfg`` with
    ``data``'s classes; ``folder/momentum.pt`` holds its momentum buffers by parameter name (write_checkpoint.py)."""
    _write(folder, "run", str(cfg), str(data), str(epochs), str(epoch), layout)
    return folder / "exp"


def write_yolov5_lookalike(folder: Path) -> Yolov5Files:
    _write(folder)
    return Yolov5Files(folder / "yolov5n_lookalike.pt", folder / "yolov5n_lookalike_last.pt",
                       folder / "yolov5n_lookalike_io.pt", folder / "state_dict_shapes.json")
