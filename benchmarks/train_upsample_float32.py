"""train.py with nearest upsampling run in float32 under autocast, as CUDA's autocast policy runs it (and this
project did on CUDA before 79d3b69), on any device: the other side of the accuracy check of models.common.Upsample.

On a CPU with bf16 autocast, train.py runs nearest upsampling and the concatenation after it in bf16 (the CPU's
autocast does not cast it), so the gradients reaching the concatenation are added in bf16; here they are float32, the
C3 after it casting the concatenation back to bf16 for its convolutions, as CUDA's autocast did in fp16. Comparing the
two over seeds (benchmarks/accuracy_parity.py --train-script) measures what adding those gradients in the lower
precision does to accuracy, in bf16, whose rounding is coarser than fp16's.

    python benchmarks/accuracy_parity.py --seeds 0 1 2 --amp bf16 --train-script benchmarks/train_upsample_float32.py \\
        --commit <commit>-upsample-float32 --csv benchmarks/results/accuracy_upsample.csv
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def upsample_in_float32() -> None:
    """models.common.Upsample's nearest mode in float32 under any autocast (the process's models from then on)."""
    import torch
    from torch import nn

    from models.common import Upsample

    def forward(self, x):
        if self.mode == "nearest" and torch.is_autocast_enabled(x.device.type):
            return nn.Upsample.forward(self, x.float())
        return nn.Upsample.forward(self, x)

    Upsample.forward = forward


if __name__ == "__main__":
    upsample_in_float32()
    import train

    sys.exit(train.main(sys.argv[1:]))
