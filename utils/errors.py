"""Error types shared across the package, and the one handler every entry point runs under.

``UserError`` is the base of every error that reports a user's mistake (a bad file, flag or value).
Modules define their own subclasses (ConfigError, DataConfigError, ...) so callers can still catch
them precisely. Its message is one line naming the file or flag and the reason; values that came
from a file are passed through ``shorten`` first, so a message never grows with the input.

Entry points: ``run_main(prog, main, argv=None) -> int``
----------------------------------------------------------
Calls ``main(argv)`` (which parses its flags itself and returns an exit code or None) and turns what
escapes into an exit code and, except for bugs, one line on stderr::

    what escapes main()                               exit  stderr
    nothing                                           main's return value (None -> 0)
    UserError (bad input file or data)                1     "<prog>: error: <message>"
    ArgumentError, or a UserError whose class sets
      exit_code = 2 (bad flag value, bad --device)    2     "<prog>: error: <message>"
    KeyboardInterrupt                                 130   "<prog>: interrupted"
    OSError: disk full, quota, read-only file system,
      file too large                                  1     "<prog>: error: could not write <file>: <reason>"
    other OSError on a path given on the command line
      (or inside / on the way to one), or permission
      denied under the working folder (runs/...)      1     "<prog>: error: <file>: <reason>"
    anything else (a bug), including an OSError on a
      path the user never gave                        1     the traceback, then "<prog>: internal error
                                                            (<type>): please report it with the traceback above"

A script uses it as::

    def main(argv=None) -> int:
        return run_main("train.py", _main, argv)

    def _main(argv) -> int:
        args = parse_args(argv)      # a utils.cli.ArgumentParser: bad flags raise ArgumentError
        ...

Writers that know which file they write can wrap the write in ``with writing(path):``; an OSError
inside becomes ``WriteError`` ("could not write <path>: <reason>", exit 1) even when the OSError
itself carries no file name (as ``write()`` on a full disk does).
"""
from __future__ import annotations

import builtins
import collections
import contextlib
import errno
import gc
import itertools
import os
import reprlib
import sys
import traceback
from pathlib import Path
from typing import Callable, NoReturn, Sequence

MESSAGE_LIMIT = 2000  # characters of one error line
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}
PERMISSION_ERRNOS = {errno.EACCES, errno.EPERM}
MAX_PATH_TEXT = 4096  # characters of a path (PATH_MAX); longer file names are not compared
MAX_GIVEN = 10_000  # command-line arguments compared with a file name
REPOSITORY = Path(__file__).resolve().parents[1]


class UserError(ValueError):
    """A mistake in the user's input; the message is one line naming the file or flag and the reason."""
    exit_code = 1


class ArgumentError(UserError):
    """A command-line flag with a value that cannot be used; entry points exit with 2 (usage error)."""
    exit_code = 2


class Unavailable(UserError):
    """What this machine or this device cannot do, not a fault of the file: a missing optional package, a format
    that runs on other platforms or another device. benchmarks.py lists it and --hard-fail does not count it
    (as YOLOv5's benchmarks skip formats a platform lacks)."""


class UnavailableOption(ArgumentError, Unavailable):
    """A flag this device cannot take (--half for a CPU export that needs CUDA, a CPU-only format on a GPU)."""


class WriteError(UserError):
    """An output that could not be written (disk full, read-only, permission); names the file."""


class CheckpointError(UserError):
    """A weights file that cannot be used; the one-line message names the file and the reason."""


class AnnotationError(UserError):
    """An annotation file (or the dataset it describes) that cannot be imported; names file and reason. Here, not in
    utils/data/importers.py, because utils/data/json_stream.py raises it too and the importers read through it."""


class SourceError(UserError):
    """A --source that cannot be used (missing, empty, unsupported); one line naming it. Here, not in utils/sources.py,
    because utils/streams.py raises it too (as StreamError) and utils/sources.py imports utils/streams.py."""


class TrainingDiverged(UserError):
    """Training stopped because of the values it trained with: the loss, or the gradients, stayed NaN/inf.
    ``--evolve`` records such a generation with fitness 0 (its hyperparameters failed) and goes on."""


class _BoundedRepr(reprlib.Repr):
    """reprlib with small limits, and no path through which a value can expand before it is cut.

    Dispatch is by ``isinstance``, so subclasses (OrderedDict, Counter, torch.Size) take the bounded
    container paths instead of their own ``repr``; dicts and sets are shown in stored order, never
    sorted; strings and bytes are cut before they are converted; integers past 128 bits, tensors and
    arrays are described, not converted. At most ``1 + 6 + 36 + 216`` values are visited (three
    levels of six items), each shown in at most ``limit`` characters, whatever the value's size or
    sharing. Objects of other types use their own ``repr`` (cut afterwards): a weights_only load,
    a YAML or a JSON file never produces one.
    """

    def __init__(self, limit: int):
        super().__init__()
        self.maxlevel = 3
        self.maxitems = 6
        self.maxstring = self.maxother = limit

    def repr1(self, value, level):
        if value is None or isinstance(value, (bool, float, complex)):
            return builtins.repr(value)
        if isinstance(value, int):
            return builtins.repr(value) if value.bit_length() <= 128 else f"<{value.bit_length()}-bit integer>"
        if isinstance(value, (str, bytes, bytearray)):
            return self._cut_text(value)
        if isinstance(value, dict):
            return self._items(value, level)
        if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
            return self._sequence(value, level)
        if hasattr(type(value), "shape") and hasattr(type(value), "dtype") and getattr(value, "ndim", 0) != 0:
            # tensors and arrays are described, never printed (0-d ones and numpy scalars print as numbers)
            return f"<{type(value).__name__} shape={self._sequence(tuple(value.shape)[:8], 1)} dtype={value.dtype}>"
        return self.repr_instance(value, level)

    def _cut_text(self, value) -> str:
        head = value[: self.maxstring]
        text = builtins.repr(bytes(head) if isinstance(value, bytearray) else head)
        return text + "..." if len(value) > self.maxstring else text

    def _sequence(self, value, level) -> str:
        left, right = self._brackets(value)
        if not value:
            return left + right
        if level <= 0:
            return left + "..." + right
        parts = [self.repr1(item, level - 1) for item in itertools.islice(value, self.maxitems)]
        if len(value) > self.maxitems:
            parts.append("...")
        single = "," if isinstance(value, tuple) and len(value) == 1 else ""
        return left + ", ".join(parts) + single + right

    @staticmethod
    def _brackets(value) -> tuple[str, str]:
        if isinstance(value, list):
            return "[", "]"
        if isinstance(value, tuple):
            return "(", ")"
        return f"{type(value).__name__}({{", "})"

    def _items(self, value, level) -> str:
        if not value:
            return "{}"
        if level <= 0:
            return "{...}"
        parts = [f"{self.repr1(key, level - 1)}: {self.repr1(item, level - 1)}"
                 for key, item in itertools.islice(value.items(), self.maxitems)]
        if len(value) > self.maxitems:
            parts.append("...")
        return "{" + ", ".join(parts) + "}"


def shorten(value, limit: int = 80) -> str:
    """``repr(value)`` cut to at most ``limit`` characters, in time and memory bounded by ``limit``
    whatever the value (deeply nested, shared or recursive containers, huge strings or integers)."""
    text = _BoundedRepr(limit).repr(value)
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def one_line(message, limit: int = MESSAGE_LIMIT) -> str:
    """``message`` as a single line (line breaks become spaces), cut to ``limit`` characters.

    A string is cut before it is split; an exception is converted with ``str`` only when its arguments are
    plain scalars (otherwise they are shown through ``shorten``); any other object goes through ``shorten``.
    So the time and memory spent are bounded by ``limit`` whatever the message holds.
    """
    text = _bounded_text(message, limit)[: limit + 1]
    text = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bounded_text(message, limit: int) -> str:
    if isinstance(message, str):
        return message
    if isinstance(message, BaseException):
        args = message.args
        if len(args) <= 8 and all(_plain(arg) for arg in args):
            return str(message)
        shown = ", ".join(shorten(arg, 200) for arg in args[:4])
        return f"{type(message).__name__}: {shown}"
    return shorten(message, limit)


def _plain(value) -> bool:
    """A value whose ``str`` is no larger than the value itself (and cheap to make)."""
    if value is None or isinstance(value, (bool, float, str, bytes, os.PathLike)):
        return True
    return isinstance(value, int) and value.bit_length() <= 128


@contextlib.contextmanager
def writing(path):
    """Turn an OSError raised while writing ``path`` into a WriteError that names it."""
    try:
        yield
    except OSError as error:
        raise WriteError(f"could not write {path}: {error.strerror or error}") from error


def describe_os_error(error: OSError, given: Sequence[str] = ()) -> str | None:
    """One line for an OSError that is the user's or the environment's doing, else None (a bug: it keeps its
    traceback). ``given``: the command line's arguments. The user's or the environment's doing:

    - a full disk, a quota, a read-only file system or a file too large (``WRITE_ERRNOS``), whatever the file;
    - any error on a path given on the command line, on a file inside a folder given there, or on a folder
      on the way to one (a missing input, an output folder that cannot be made);
    - permission denied under the working folder, where outputs go by default (runs/...).

    Any other file name (a file the code looked for in the wrong place, say) is not evidence of bad input."""
    reason = error.strerror or type(error).__name__
    names = [text for text in (_path_text(error.filename), _path_text(error.filename2)) if text]
    if error.errno in WRITE_ERRNOS:
        return f"could not write {' -> '.join(names) or 'an output file'}: {reason}"
    try:
        cwd = os.getcwd()
    except OSError:  # the working folder was removed: relative names cannot be placed
        return None
    for name in names:
        target = _absolute(name, cwd)
        permission = error.errno in PERMISSION_ERRNOS and _inside(target, cwd)
        if permission or any(_concerns(target, value, cwd) for value in _given_paths(given)):
            return f"{' -> '.join(names)}: {reason}"
    return None


def _path_text(name) -> str:
    """A file name from an OSError as text ("" for none, or for a file descriptor number)."""
    if isinstance(name, (str, bytes, os.PathLike)):
        text = os.fsdecode(name)
        return text if len(text) <= MAX_PATH_TEXT else ""
    return ""


def _absolute(path: str, base: str) -> str:
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _given_paths(given: Sequence[str]) -> list[str]:
    """The values on a command line that may be paths: every argument, and the value of ``--flag=value``."""
    values = []
    for argument in list(given)[:MAX_GIVEN]:
        if not isinstance(argument, str) or not argument or len(argument) > MAX_PATH_TEXT:
            continue
        if argument.startswith("-"):
            if "=" in argument:
                values.append(argument.split("=", 1)[1])
            continue
        values.append(argument)
    return [value for value in values if value]


def _concerns(target: str, value: str, cwd: str) -> bool:
    """Whether ``target`` (absolute) is the given ``value``, inside it, or a folder on the way to it; a bare
    value also names the repository's own file of that path (the scripts look there for shipped files)."""
    given = _absolute(value, cwd)
    if _inside(target, given) or (target != os.sep and _inside(given, target)):
        return True
    return not os.path.isabs(value) and target == _absolute(value, str(REPOSITORY))


def _say(prog: str, text: str) -> None:
    print(f"{prog}: {one_line(text)}", file=sys.stderr, flush=True)


def run_main(prog: str, main: Callable, argv: list[str] | None = None) -> int:
    """Run ``main(argv)`` under the error contract in the module docstring; returns the exit code."""
    try:
        code = main(argv)
    except UserError as error:
        _say(prog, f"error: {error}")
        return error.exit_code
    except KeyboardInterrupt:
        _say(prog, "interrupted")
        return 130
    except OSError as error:
        line = describe_os_error(error, sys.argv[1:] if argv is None else argv)
        if line is None:
            return _internal_error(prog, error)
        _say(prog, f"error: {line}")
        return 1
    except Exception as error:  # noqa: BLE001 - the last resort that asks for a bug report
        return _internal_error(prog, error)
    return 0 if code is None else int(code)


def exit_process(code: int) -> NoReturn:
    """End a command-line process with ``code`` (``sys.exit``), after moving every object still alive into the
    garbage collector's permanent generation (``gc.freeze``). The interpreter's shutdown then frees them without
    walking them in its collections: detect.py's exit, from main's return to the shell's prompt, took 1.0-1.35 s
    on a 2-core Zen 3, ~0.45 s so. What the command wrote is closed by then (its files by their ``with`` blocks,
    its writers by the run); ``atexit`` functions and ``weakref.finalize`` finalizers (the shared image caches')
    run as before. Only for a script's ``__main__``: a process that goes on would never collect what is frozen."""
    gc.freeze()
    sys.exit(code)


def _internal_error(prog: str, error: BaseException) -> int:
    traceback.print_exception(error, file=sys.stderr)
    _say(prog, f"internal error ({type(error).__name__}): please report it with the traceback above")
    return 1

