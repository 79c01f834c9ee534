"""Mixed precision and memory format choices for training.

- CUDA: fp16 autocast with a GradScaler by default, after a self-check on a synthetic batch that
  falls back to fp32 with a warning when fp16 outputs disagree with fp32.
- CPU: ``--amp auto`` trains with bf16 autocast where the CPU computes bf16 natively (AMX or
  AVX512-BF16) and in fp32 otherwise (utils.precision.cpu_bf16_choice); ``--amp bf16`` forces
  bf16, ``--amp off`` forces fp32. The choice and its reason are logged.
- channels_last conv weights and inputs where it is faster (CPU and CUDA alike here).
"""
from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass

import torch

from utils.precision import AMP_CHOICES, cpu_bf16_choice, cpu_has_native_bf16, warn_emulated_bf16

LOGGER = logging.getLogger(__name__)


@dataclass
class Precision:
    device_type: str
    dtype: torch.dtype | None  # None: plain fp32
    scaler: torch.amp.GradScaler

    def autocast(self, cache: bool = True):
        """The autocast context (none for fp32); ``cache=False``: without autocast's cache of cast weights (CUDA graph
        capture refuses it)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, cache_enabled=cache)

    @property
    def name(self) -> str:
        return {None: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]


def choose_precision(amp: str, device: torch.device, model: torch.nn.Module) -> Precision:
    if amp not in AMP_CHOICES:
        raise ValueError(f"--amp must be one of {', '.join(AMP_CHOICES)}, got '{amp}'")
    if device.type == "cpu":
        dtype, reason = cpu_training_dtype(amp)
    else:
        dtype, reason = accelerator_training_dtype(amp, device, model)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    precision = Precision(device.type, dtype, scaler)
    if dtype is None:
        LOGGER.info("AMP: training in fp32 on %s (%s)", device.type, reason)
    else:
        LOGGER.info("AMP: %s autocast on %s (%s); validation during training runs in %s too", precision.name,
                    device.type, reason, precision.name)
    return precision


def cpu_training_dtype(amp: str) -> tuple[torch.dtype | None, str]:
    """(autocast dtype or None for fp32, reason) on the CPU."""
    if amp == "off":
        return None, "--amp off"
    if amp == "bf16":
        if not cpu_has_native_bf16():
            warn_emulated_bf16()
        return torch.bfloat16, "--amp bf16"
    if amp == "fp16":
        LOGGER.warning("AMP: fp16 autocast needs CUDA; training in fp32 on cpu (use --amp bf16 on CPU)")
        return None, "fp16 needs CUDA"
    use_bf16, reason = cpu_bf16_choice()
    return (torch.bfloat16 if use_bf16 else None), reason


def accelerator_training_dtype(amp: str, device: torch.device, model: torch.nn.Module):
    """(autocast dtype or None for fp32, reason) on CUDA (fp16 after the self-check) and other devices."""
    if amp == "bf16":
        return torch.bfloat16, "--amp bf16"
    if amp == "off":
        return None, "--amp off"
    if device.type != "cuda":
        if amp == "fp16":
            LOGGER.warning("AMP: fp16 autocast needs CUDA; training in fp32 on %s", device.type)
        return None, f"fp16 autocast needs CUDA, not {device.type}"
    if fp16_self_check(model, device):
        return torch.float16, f"--amp {amp}, self-check passed"
    return None, "fp16 self-check failed"


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
