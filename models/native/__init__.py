"""C kernels built on the user's machine at first use, for what torch has no single CPU operation for.

``bn_silu_library()`` returns the compiled ``bn_silu.c`` (ctypes, argument types declared) or None. It is built
with the machine's C compiler (``$CC``, else ``cc`` or ``gcc``) into the user cache folder
(``$YOLO_TRAINER_CACHE/kernels``, by default ``~/.cache/yolo-trainer/kernels``), once per source, compiler and
instruction set; later processes load the file. The instruction set follows torch's own CPU dispatch
(``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` can lower), so the kernels never
use wider vectors than torch's. The library's OpenMP calls must reach torch's own OpenMP runtime (the same
thread pool, no second set of spinning threads): it is used only where this process already has GNU libgomp
loaded (torch's Linux wheels) and none of Intel's.

None, and training computes the same with torch's operations, where any of this is missing: no compiler, not
Linux, another OpenMP runtime, a failed build (logged once), or ``YOLO_TRAINER_NATIVE=0`` in the environment.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from utils.data.cache_folders import user_cache_folder

LOGGER = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bn_silu.c")
SWITCH = "YOLO_TRAINER_NATIVE"  # "0": never build or load the kernels
BUILD_SECONDS = 120
ISA_FLAGS = {  # torch's CPU capability -> the compiler's vector flags (x86-64); others: the compiler's default
    "AVX2": ["-mavx2", "-mfma"],
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mprefer-vector-width=512"],
}
FLOAT_P, DOUBLE_P = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_double)
SIGNATURES = {
    "bn_stats": (FLOAT_P, ctypes.c_int64, ctypes.c_int64, DOUBLE_P, DOUBLE_P, ctypes.c_int),
    "bn_silu_train_forward": (FLOAT_P, FLOAT_P, ctypes.c_int64, ctypes.c_int64, FLOAT_P, FLOAT_P, ctypes.c_double,
                              DOUBLE_P, DOUBLE_P, FLOAT_P, FLOAT_P, ctypes.c_int),
    "bn_silu_train_backward": (FLOAT_P, FLOAT_P, FLOAT_P, ctypes.c_int64, ctypes.c_int64, ctypes.c_double, DOUBLE_P,
                               DOUBLE_P, FLOAT_P, FLOAT_P, FLOAT_P, FLOAT_P, ctypes.c_int, ctypes.c_int),
}


def _compiler() -> str | None:
    configured = os.environ.get("CC")
    if configured:
        return shutil.which(configured)
    return shutil.which("cc") or shutil.which("gcc")


def _openmp_is_gnu() -> bool:
    """torch's OpenMP runtime in this process is GNU libgomp (and no Intel runtime is loaded beside it)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return "libgomp" in maps and "libiomp" not in maps


def _isa_flags() -> list[str]:
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    return ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])


def _version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(source: Path, folder: Path) -> Path | None:
    """Compile ``source`` into ``folder`` (atomically: a temporary file renamed) unless it is there already;
    the file's name is a hash of the source, compiler, its version and the flags. None when it cannot be built,
    or when the file there is not this user's own or others may write it."""
    compiler = _compiler()
    if compiler is None:
        return None
    flags = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-shared", *_isa_flags()]
    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, compiler.encode(), _version(compiler).encode(),
                                     " ".join(flags).encode()])).hexdigest()[:20]
    target = folder / f"{source.stem}-{key}.so"
    if target.is_file():
        return target if _trusted(target) else None
    folder.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    os.close(handle)
    try:
        done = subprocess.run([compiler, *flags, "-o", temporary, str(source), "-lm"], capture_output=True, text=True,
                              timeout=BUILD_SECONDS)
        if done.returncode != 0:
            LOGGER.info("native kernels: %s could not build %s, training uses torch's operations: %s", compiler,
                        source.name, (done.stderr.strip().splitlines() or ["(no message)"])[-1])
            return None
        os.chmod(temporary, 0o755)
        os.replace(temporary, target)
        return target
    except (OSError, subprocess.SubprocessError) as error:
        LOGGER.info("native kernels: building %s failed, training uses torch's operations: %s", source.name, error)
        return None
    finally:
        Path(temporary).unlink(missing_ok=True)


def _trusted(path: Path) -> bool:
    """A library found in the cache is loaded only when this user owns it and nobody else may change it (a file
    that others could have replaced would run their code in this process); otherwise torch's operations."""
    info = path.stat()
    if (hasattr(os, "getuid") and info.st_uid != os.getuid()) or info.st_mode & 0o022:
        LOGGER.warning("native kernels: %s is not this user's own or others may write it: not loaded, training uses "
                       "torch's operations (remove the file to rebuild it)", path)
        return False
    return True


def _load(path: Path):
    library = ctypes.CDLL(str(path))
    for name, arguments in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, ctypes.c_int
    return library


@functools.lru_cache(maxsize=1)
def bn_silu_library():
    """The compiled BatchNorm + SiLU kernels, or None (see the module doc). Built or loaded once per process."""
    if os.environ.get(SWITCH, "1") == "0" or not sys.platform.startswith("linux"):
        return None
    import torch  # noqa: F401  (torch's OpenMP runtime must be loaded before the check)

    if not _openmp_is_gnu():
        return None
    try:
        path = build(SOURCE, user_cache_folder("kernels"))
        return _load(path) if path is not None else None
    except (OSError, AttributeError) as error:
        LOGGER.info("native kernels: cannot load them, training uses torch's operations: %s", error)
        return None
