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
    other OSError naming a file (permission, missing) 1     "<prog>: error: <file>: <reason>"
    anything else (a bug)                             1     the traceback, then "<prog>: internal error
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

import contextlib
import errno
import reprlib
import sys
import traceback
from typing import Callable

MESSAGE_LIMIT = 2000  # characters of one error line
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


class UserError(ValueError):
    """A mistake in the user's input; the message is one line naming the file or flag and the reason."""
    exit_code = 1


class ArgumentError(UserError):
    """A command-line flag with a value that cannot be used; entry points exit with 2 (usage error)."""
    exit_code = 2


class WriteError(UserError):
    """An output that could not be written (disk full, read-only, permission); names the file."""


class CheckpointError(UserError):
    """A weights file that cannot be used; the one-line message names the file and the reason."""


class _BoundedRepr(reprlib.Repr):
    """reprlib with small limits everywhere, and huge integers described instead of converted."""

    def __init__(self, limit: int):
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = 6
        self.maxset = self.maxfrozenset = self.maxdeque = 6
        self.maxstring = self.maxother = limit
        self.maxlong = 40

    def repr_int(self, value, level):
        if value.bit_length() > 128:  # str() of a huge int is slow, or refused past 4300 digits
            return f"<{value.bit_length()}-bit integer>"
        return super().repr_int(value, level)


def shorten(value, limit: int = 80) -> str:
    """``repr(value)`` cut to at most ``limit`` characters, in time and memory bounded by ``limit``
    whatever the value (deeply nested, shared or recursive containers, huge strings or integers)."""
    text = _BoundedRepr(limit).repr(value)
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def one_line(message, limit: int = MESSAGE_LIMIT) -> str:
    """``message`` as a single line (line breaks become spaces), cut to ``limit`` characters."""
    text = str(message)[: limit + 1]
    text = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def writing(path):
    """Turn an OSError raised while writing ``path`` into a WriteError that names it."""
    try:
        yield
    except OSError as error:
        raise WriteError(f"could not write {path}: {error.strerror or error}") from error


def describe_os_error(error: OSError) -> str | None:
    """One line for an OSError caused by the environment (disk, permissions, missing file), else None."""
    reason = error.strerror or type(error).__name__
    name = error.filename
    if error.errno in WRITE_ERRNOS:
        return f"could not write {name if name is not None else 'an output file'}: {reason}"
    if name is not None:
        return f"{name}: {reason}"
    return None


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
        line = describe_os_error(error)
        if line is None:
            return _internal_error(prog, error)
        _say(prog, f"error: {line}")
        return 1
    except Exception as error:  # noqa: BLE001 - the last resort that asks for a bug report
        return _internal_error(prog, error)
    return 0 if code is None else int(code)


def _internal_error(prog: str, error: BaseException) -> int:
    traceback.print_exception(error, file=sys.stderr)
    _say(prog, f"internal error ({type(error).__name__}): please report it with the traceback above")
    return 1

