"""Mixed precision and memory format choices for training.

- CUDA: fp16 autocast with a GradScaler by default, after a self-check on a synthetic batch that
  falls back to fp32 with a warning when fp16 outputs disagree with fp32.
- CPU: fp32 by default; ``--amp bf16`` uses bf16 autocast (fast on CPUs with AMX/AVX512-BF16 units).
- channels_last conv weights and inputs where it is faster (CPU and CUDA alike here).
"""
from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass

import torch

LOGGER = logging.getLogger(__name__)

AMP_CHOICES = ("auto", "fp16", "bf16", "off")


@dataclass
class Precision:
    device_type: str
    dtype: torch.dtype | None  # None: plain fp32
    scaler: torch.amp.GradScaler

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    @property
    def name(self) -> str:
        return {None: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]


def choose_precision(amp: str, device: torch.device, model: torch.nn.Module) -> Precision:
    if amp not in AMP_CHOICES:
        raise ValueError(f"--amp must be one of {', '.join(AMP_CHOICES)}, got '{amp}'")
    dtype = None
    if amp == "bf16":
        dtype = torch.bfloat16
        if device.type == "cpu" and not cpu_has_native_bf16():
            LOGGER.warning("AMP: this CPU has no native bf16 units (no AVX512-BF16/AMX); bf16 autocast is emulated "
                           "and much slower than fp32 here (8x for yolov5n measured on an AVX2 CPU): consider --amp off")
    elif amp in ("auto", "fp16") and device.type == "cuda":
        dtype = torch.float16 if fp16_self_check(model, device) else None
    elif amp == "fp16":
        LOGGER.warning("AMP: fp16 autocast needs CUDA; training in fp32 on %s (use --amp bf16 on CPU)", device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    precision = Precision(device.type, dtype, scaler)
    LOGGER.info("AMP: training in %s on %s", precision.name, device.type)
    return precision


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN reports bf16 support on this CPU (AVX512-BF16 or AMX); True when it cannot tell."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def fp16_self_check(model: torch.nn.Module, device: torch.device, imgsz: int = 256) -> bool:
    """Compare fp32 and fp16-autocast eval outputs on a fixed synthetic batch; False means 'do not use AMP'."""
    probe = copy.deepcopy(model).to(device).eval()
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(2, 3, imgsz, imgsz, generator=generator).to(device)
    try:
        with torch.no_grad():
            reference = probe(images)[0].float()
            with torch.autocast(device_type=device.type, dtype=torch.float16):
                half = probe(images)[0].float()
    except Exception as e:  # a broken fp16 kernel is a reason to fall back, not to crash
        LOGGER.warning("AMP: fp16 self-check failed (%s); training in fp32", e)
        return False
    ok = bool(torch.isfinite(half).all()) and torch.allclose(half[..., :4], reference[..., :4], rtol=0.05, atol=2.0)
    if not ok:
        LOGGER.warning("AMP: fp16 outputs disagree with fp32 on this device; training in fp32")
    return ok


def use_channels_last(option: str, device: torch.device) -> bool:
    """'auto' picks channels_last on CPU (measured faster for these convs) and CUDA; 'on'/'off' force it."""
    if option not in ("auto", "on", "off"):
        raise ValueError(f"--channels-last must be auto, on or off, got '{option}'")
    return option != "off"
