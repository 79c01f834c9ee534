"""C kernels built on the user's machine at first use, for what torch has no single CPU operation for.

``bn_silu_library()`` returns the compiled ``bn_silu.c`` (ctypes, argument types declared) or None. It is built
with the machine's C compiler (``$CC``, else ``cc`` or ``gcc``) into the user cache folder
(``$YOLO_TRAINER_CACHE/kernels``, by default ``~/.cache/yolo-trainer/kernels``), once per machine for each source,
compiler, instruction set and OpenMP runtime; later processes load the file.

Loading it changes nothing else in the process:
- No floating-point mode. The source is compiled with the narrow flags its loops need (no errno from libm, no
  trapping maths) and linked in a separate step without them: a library linked with ``-ffast-math`` carries gcc's
  ``crtfastmath.o``, which sets flush-to-zero for the whole process when it is loaded. Infinities and NaN pass
  through (GradScaler's skip relies on them), so never ``-ffinite-math-only``.
- No second OpenMP runtime. The kernels' OpenMP calls must reach torch's own thread pool: the library is linked
  against the exact libgomp file torch has mapped (by path), and used only where torch's runtime is GNU libgomp
  (the one in torch's package; another package's own runtime, such as ncnn's, is that package's).
- Checked before use. A freshly built library is first loaded by a child process, which must find the
  floating-point mode unchanged, one OpenMP runtime, and the statistics kernel right on 2 threads; only then is
  it renamed into place (a library loaded into this process could not be unloaded again).

Built once per machine, safely: torchrun ranks and loader workers starting together wait on one lock while the
first builds; a failed build is recorded beside the libraries (``<name>.failed``, with the compiler's message)
and not retried until that file is removed; the folders are this user's own (``utils.private_folders``), and the
library is opened without following links, checked with ``fstat`` (this user's, nobody else may write it) and
loaded through that descriptor.

None, and training computes the same with torch's operations, where any of this is missing: no compiler, not
Linux, another OpenMP runtime, a failed build or check, an unsafe folder, or ``YOLO_TRAINER_NATIVE=0``.
``YOLO_TRAINER_NATIVE_REQUIRED=1`` (CI) turns each of these but the switch into an error instead.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from utils.data.cache_folders import user_cache_folder
from utils.private_folders import private_folder

LOGGER = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bn_silu.c")
SWITCH = "YOLO_TRAINER_NATIVE"  # "0": never build or load the kernels
REQUIRED = "YOLO_TRAINER_NATIVE_REQUIRED"  # "1": kernels that cannot be had are an error (CI), not a fallback
BUILD_SECONDS = 120
CHECK_SECONDS = 120
COMPILE_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC"]
ISA_FLAGS = {  # torch's CPU capability -> the compiler's vector flags (x86-64); others: the compiler's default
    "AVX2": ["-mavx2", "-mfma"],
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mprefer-vector-width=512"],
}
OPENMP_RUNTIMES = re.compile(r"(/\S*/lib(?:gomp|iomp5|omp)[\w.-]*\.so[\w.-]*)")
FLOAT_P, DOUBLE_P = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_double)
SIGNATURES = {
    "bn_stats": (FLOAT_P, ctypes.c_int64, ctypes.c_int64, DOUBLE_P, DOUBLE_P, ctypes.c_int),
    "bn_silu_train_forward": (FLOAT_P, FLOAT_P, ctypes.c_int64, ctypes.c_int64, FLOAT_P, FLOAT_P, ctypes.c_double,
                              DOUBLE_P, DOUBLE_P, FLOAT_P, FLOAT_P, ctypes.c_int),
    "bn_silu_train_backward": (FLOAT_P, FLOAT_P, FLOAT_P, ctypes.c_int64, ctypes.c_int64, ctypes.c_double, DOUBLE_P,
                               DOUBLE_P, FLOAT_P, FLOAT_P, FLOAT_P, FLOAT_P, ctypes.c_int, ctypes.c_int),
}

# Run by a child process on a freshly built library: argv[1] the library, argv[2] the OpenMP runtime it must use.
CHECK_SCRIPT = r"""
import ctypes, json, os, re, sys
import torch
tiny = float(sys.argv[4])  # read at run time: a literal product would be folded when this script is compiled
def flushes():
    return tiny * 1.0 == 0.0 or float(torch.tensor([1e-40]).mul(1.0)) == 0.0
before = flushes()
library = ctypes.CDLL(sys.argv[1])
after = flushes()
runtimes = sorted({os.path.realpath(p) for p in re.findall(sys.argv[3], open("/proc/self/maps").read())})
rows, channels = 1000, 3
values = [float((r * 7 + c * 3) % 11) for r in range(rows) for c in range(channels)]
data = (ctypes.c_float * len(values))(*values)
mean, var = (ctypes.c_double * channels)(), (ctypes.c_double * channels)()
code = library.bn_stats(data, ctypes.c_int64(rows), ctypes.c_int64(channels), mean, var, 2)
expected = [sum(values[c::channels]) / rows for c in range(channels)]
spread = [sum((v - m) ** 2 for v in values[c::channels]) / rows for c, m in zip(range(channels), expected)]
right = code == 0 and all(abs(a - b) < 1e-6 for a, b in zip(list(mean) + list(var), expected + spread))
print("CHECK " + json.dumps({"flushes_before": before, "flushes_after": after, "runtimes": runtimes,
                             "expected_runtime": os.path.realpath(sys.argv[2]), "stats_right": right}))
"""


class NativeUnavailable(RuntimeError):
    """Raised instead of falling back when ``YOLO_TRAINER_NATIVE_REQUIRED=1``."""


def _unavailable(reason: str, level: int = logging.INFO) -> None:
    """The kernels cannot be had: log the reason (training goes on with torch's operations), or raise under CI."""
    if os.environ.get(REQUIRED) == "1":
        raise NativeUnavailable(f"native kernels required ({REQUIRED}=1) but unavailable: {reason}")
    LOGGER.log(level, "native kernels: %s; training uses torch's operations", reason)


def _compiler() -> list[str] | None:
    """The compiler's command words: ``$CC`` split as a shell would (``CC="ccache gcc"`` is a launcher and its
    compiler), its first word found on PATH; else ``cc`` or ``gcc``. None when there is none."""
    import shlex

    configured = os.environ.get("CC", "").strip()
    if configured:
        try:
            words = shlex.split(configured)
        except ValueError:
            return None
        found = shutil.which(words[0]) if words else None
        return [found, *words[1:]] if found else None
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _no_compiler() -> str:
    configured = os.environ.get("CC", "").strip()
    if configured:
        return f"$CC={configured!r}: its first word is not a program on PATH"
    return "no C compiler found ($CC, cc, gcc)"


def openmp_runtime(maps: str | None = None) -> str | None:
    """The path of the GNU libgomp torch has mapped into this process, or None (no libgomp, or an Intel or LLVM
    OpenMP runtime loaded beside it, or more than one libgomp). A runtime inside torch's package (torch/lib,
    torch.libs) is torch's own; other packages' runtimes (ncnn's wheel brings a libgomp) serve those packages and
    are not counted. Without one inside torch's package, the process must hold exactly one runtime."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    runtimes = {os.path.realpath(path) for path in OPENMP_RUNTIMES.findall(maps)}
    import torch

    package = Path(torch.__file__).resolve().parent  # a wheel's own runtime: torch/lib or torch.libs beside it
    owned = [path for path in runtimes if Path(path).is_relative_to(package)
             or Path(path).is_relative_to(package.parent / "torch.libs")]
    candidates = owned or sorted(runtimes)  # a distribution's torch links the system's libgomp
    gnu = [path for path in candidates if "libgomp" in Path(path).name]
    return gnu[0] if len(gnu) == 1 and len(candidates) == 1 else None


def _isa_flags() -> list[str]:
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    return ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])


def _version(compiler: list[str]) -> str:
    try:
        return subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(source: Path, folder: Path, openmp: str | None = None) -> Path | None:
    """The library built from ``source`` in ``folder`` (made private), built and checked now unless it is there
    already; its name is a hash of the source, the compiler, its version, the flags and the OpenMP runtime. None
    (logged) when it cannot be built, its check fails, or an earlier build on this machine failed."""
    compiler = _compiler()
    openmp = openmp or openmp_runtime()
    if compiler is None or openmp is None:
        _unavailable(_no_compiler() if compiler is None else
                     "torch's OpenMP runtime here is not GNU libgomp alone")
        return None
    flags = [*COMPILE_FLAGS, *_isa_flags()]
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(compiler).encode(), _version(compiler).encode(),
                                     " ".join(flags).encode(), openmp.encode()])).hexdigest()[:20]
    folder = private_folder(folder)
    target, failed = folder / f"{source.stem}-{key}.so", folder / f"{source.stem}-{key}.failed"
    if os.path.lexists(target):
        return target
    lock = os.open(folder / ".build.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks and workers starting together: one builds, the others wait
        if os.path.lexists(target):
            return target
        if os.path.lexists(failed):
            _unavailable(f"building {source.name} failed earlier on this machine ({_first_line(failed)}); "
                         f"remove {failed} to try again")
            return None
        reason = _build_checked(compiler, flags, source, openmp, folder, target)
        if reason is None:
            return target
        _record_failure(failed, reason)
        _unavailable(f"{reason} (recorded in {failed}: remove it to try again)")
        return None
    finally:
        os.close(lock)


def _build_checked(compiler: list[str], flags: list, source: Path, openmp: str, folder: Path, target: Path) -> str | None:
    """Compile, link against ``openmp``, check in a child process, rename into ``target``; the reason on failure."""
    with tempfile.TemporaryDirectory(prefix=".build-", dir=folder) as scratch:
        obj, library = Path(scratch) / f"{source.stem}.o", Path(scratch) / f"{source.stem}.so"
        commands = ([*compiler, *flags, "-c", "-o", str(obj), str(source)],
                    [*compiler, "-shared", "-o", str(library), str(obj), openmp,
                     f"-Wl,-rpath,{Path(openmp).parent}", "-lm"])
        for command in commands:
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_SECONDS)
            except (OSError, subprocess.SubprocessError) as error:
                return f"{' '.join(compiler)} could not build {source.name}: {error}"
            if done.returncode != 0:
                return (f"{' '.join(compiler)} could not build {source.name}: "
                        f"{(done.stderr.strip().splitlines() or ['(no message)'])[-1]}")
        problem = check_in_child(library, openmp)
        if problem:
            return f"{source.name} was built but {problem}"
        os.chmod(library, 0o755)
        os.replace(library, target)
    return None


def check_in_child(library: Path, openmp: str) -> str | None:
    """Load ``library`` in a fresh Python with torch first and return what is wrong with it, or None: the
    floating-point mode must stay as it was, the only OpenMP runtime must be ``openmp``, the statistics kernel on
    2 threads must give the exact mean and variance of a small array."""
    try:
        done = subprocess.run([sys.executable, "-c", CHECK_SCRIPT, str(library), openmp, OPENMP_RUNTIMES.pattern,
                               "1e-310"],
                              capture_output=True, text=True, timeout=CHECK_SECONDS, cwd=library.parent)
    except (OSError, subprocess.SubprocessError) as error:
        return f"its check could not run: {error}"
    line = next((text for text in done.stdout.splitlines() if text.startswith("CHECK ")), None)
    if done.returncode != 0 or line is None:
        return f"a process loading it failed: {(done.stderr.strip().splitlines() or ['(no message)'])[-1]}"
    result = json.loads(line[len("CHECK "):])
    if result["flushes_after"] and not result["flushes_before"]:
        return "loading it switched the process to flush-to-zero"
    if result["runtimes"] != [result["expected_runtime"]]:
        return f"it brought another OpenMP runtime: {', '.join(result['runtimes'])}"
    if not result["stats_right"]:
        return "its statistics kernel gave wrong values on 2 threads"
    return None


def _record_failure(path: Path, reason: str) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(reason + "\n")


def _first_line(path: Path) -> str:
    try:
        return path.read_text(errors="replace").splitlines()[0][:300]
    except (OSError, IndexError):
        return "no reason recorded"


def load_checked(path: Path):
    """The library at ``path`` through a descriptor opened without following links, once ``fstat`` shows a
    regular file of this user's that nobody else may write; None (a warning) otherwise."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        _unavailable(f"cannot open {path}: {error}", logging.WARNING)
        return None
    try:
        info = os.fstat(descriptor)
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022):
            _unavailable(f"{path} is not this user's own file or others may write it: not loaded (remove it to "
                         "rebuild it)", logging.WARNING)
            return None
        library = ctypes.CDLL(f"/proc/self/fd/{descriptor}")
    finally:
        os.close(descriptor)
    for name, arguments in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, ctypes.c_int
    return library


@functools.lru_cache(maxsize=1)
def bn_silu_library():
    """The compiled BatchNorm + SiLU kernels, or None (see the module doc). Built or loaded once per process."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    if not sys.platform.startswith("linux"):
        _unavailable("built on Linux only")
        return None
    import torch  # noqa: F401  (torch's OpenMP runtime must be loaded before the check)

    try:
        path = build(SOURCE, user_cache_folder("kernels"))
        return load_checked(path) if path is not None else None
    except (OSError, AttributeError) as error:
        _unavailable(f"cannot build or load them: {error}", logging.WARNING)
        return None
