"""Which precision to compute in on the CPU, for training and inference alike.

bf16 autocast pays off on a CPU where the hardware computes bf16 products natively: Intel AMX (tile
registers with the AMX-BF16 instructions) or AVX512-BF16 (``vdpbf16ps``: AMD Zen 4 and later, Intel
Cooper Lake and later). Measured on a 2-core AMD EPYC Zen 4 (AVX512-BF16, no AMX), yolov5n at 320,
batch 16: one training step 589-598 ms in fp32, 309-329 ms under bf16 autocast; the 10-epoch BCCD
command 93-94 s against 69 s with the same mAP (README, docs/benchmarks.md). On the AMX Xeon bf16
trains in 0.61x the fp32 wall time. Without either unit bf16 is emulated and several times slower
(8x measured on AVX2), so ``--amp auto`` keeps fp32 there; ``--amp bf16`` still forces bf16 anywhere.
The capability comes from ``torch.cpu.get_capabilities()`` (cpuinfo's ``amx_tile``/``amx_bf16``,
``avx512_bf16``); on Linux a process using AMX must also be granted the tile state
(``torch.cpu._init_amx()`` asks for it), and where it is refused AVX512-BF16 still serves.

``inference_autocast(device, half, amp)`` is the inference side (val.py, detect.py): bf16 autocast on
the same CPUs, fp32 otherwise; ``--half`` remains CUDA fp16 and is applied by the caller, as before.
"""
from __future__ import annotations

import contextlib
import logging

import torch

LOGGER = logging.getLogger(__name__)

AMP_CHOICES = ("auto", "fp16", "bf16", "off")
VECTOR_UNITS = (("avx512_f", "AVX-512"), ("avx2", "AVX2"), ("neon", "NEON"))  # widest first, for the reason


def cpu_capabilities() -> dict:
    """torch's view of the CPU's instruction sets ({} when this torch cannot tell)."""
    try:
        return dict(torch.cpu.get_capabilities())
    except (AttributeError, RuntimeError):
        return {}


def amx_permitted() -> bool:
    """Whether the OS lets this process use the AMX tile state (Linux asks for it per process).

    A torch without ``torch.cpu._init_amx`` cannot ask; oneDNN then asks itself, so cpuinfo is trusted."""
    request = getattr(torch.cpu, "_init_amx", None)
    if request is None:
        return True
    try:
        return bool(request())
    except RuntimeError:
        return False


def cpu_bf16_choice(capabilities: dict | None = None) -> tuple[bool, str]:
    """(use bf16 autocast, reason): True where the CPU computes bf16 natively (AMX usable by this process,
    or AVX512-BF16), False where bf16 would be emulated."""
    capabilities = cpu_capabilities() if capabilities is None else capabilities
    if not capabilities:
        return False, "CPU capabilities unknown to this torch"
    has_amx = bool(capabilities.get("amx_tile") and capabilities.get("amx_bf16"))
    if has_amx and amx_permitted():
        return True, "AMX"
    if capabilities.get("avx512_bf16"):
        return True, ("AVX512-BF16; AMX present but the OS did not grant its tile state to this process"
                      if has_amx else "AVX512-BF16")
    if has_amx:
        return False, "AMX present but the OS did not grant its tile state to this process"
    widest = next((label for name, label in VECTOR_UNITS if capabilities.get(name)), None)
    return False, f"no native bf16 (AMX or AVX512-BF16): {widest}" if widest else "no native bf16 (AMX or AVX512-BF16)"


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN reports bf16 support on this CPU (AVX512-BF16 or AMX); True when it cannot tell."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def warn_emulated_bf16() -> None:
    LOGGER.warning("AMP: this CPU has no native bf16 units (no AVX512-BF16/AMX); bf16 autocast is emulated "
                   "and much slower than fp32 here (8x for yolov5n measured on an AVX2 CPU): consider --amp off")


def inference_dtype(device: torch.device, half: bool = False, amp: str = "auto") -> tuple[torch.dtype | None, str]:
    """(autocast dtype or None for none, reason) for running a model on ``device``.

    CUDA: None (``--half`` converts the model to fp16 in the caller, as before). CPU: bf16 with AMX under
    ``amp='auto'``, always under ``amp='bf16'``, never under ``amp='off'``; fp16 is CUDA-only.
    """
    if amp not in AMP_CHOICES:
        raise ValueError(f"--amp must be one of {', '.join(AMP_CHOICES)}, got '{amp}'")
    device = torch.device(device)
    if device.type != "cpu":
        return None, "fp16 (--half)" if half else "fp32"
    if amp == "off":
        return None, "fp32 (--amp off)"
    if amp == "bf16":
        return torch.bfloat16, "bf16 autocast (--amp bf16)"
    if amp == "fp16":
        return None, "fp32 (fp16 needs CUDA)"
    use_bf16, reason = cpu_bf16_choice()
    return (torch.bfloat16, f"bf16 autocast ({reason})") if use_bf16 else (None, f"fp32 ({reason})")


def inference_autocast(device, half: bool = False, amp: str = "auto", exported: str = ""):
    """Context manager to run a model's forward passes in; logs which precision and why. ``exported``: the
    format of an exported model (torchscript, onnx, openvino), which runs in the precision it was exported in
    (autocast would change a traced graph's arithmetic, e.g. decode boxes in bf16), so no autocast."""
    device = torch.device(device)
    if exported:
        LOGGER.info("Inference: %s runs in the precision it was exported in (no autocast) on %s", exported,
                    device.type)
        return contextlib.nullcontext()
    dtype, reason = inference_dtype(device, half, amp)
    if half and device.type == "cpu":
        LOGGER.warning("--half is CUDA fp16 only; ignored on cpu")
    if dtype == torch.bfloat16 and amp == "bf16" and not cpu_has_native_bf16():
        warn_emulated_bf16()
    LOGGER.info("Inference: %s on %s", reason, device.type)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
