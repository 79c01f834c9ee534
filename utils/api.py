"""The Python API of the entry scripts: ``train.run(**kw)``, ``val.run(**kw)``, ``detect.run(**kw)``.

``keyword_argv(parser, keywords)`` turns keyword arguments named like the flags (underscores for dashes:
``batch_size=16``, ``imgsz=320``, ``exist_ok=True``; any alias such as ``img=320`` too) into the command line
they stand for, which the script then parses with its own parser: the same defaults, the same checks and the
same one-line ``ArgumentError`` for a bad value. An unknown keyword is an ArgumentError naming it. ``None``
means the flag's default. Values: a switch (``--rect``) takes True/False; a flag with an optional value
(``--resume``, ``--evolve``, ``--cache``) takes True for the flag alone, False for its default (``cache=False``:
``--cache off``) or a value; a flag with several values (``--freeze``, ``--classes``, ``--imgsz`` in detect)
takes a list or one value.

``api_call()`` wraps one call so the process is left as it was found: the root logger's handlers and level
(a console handler is added for the call when the root logger has none, as the command line has), torch's
compute threads, the global random generators, the deterministic-algorithm switches, the environment
variables training sets and matplotlib's backend (plots are drawn with Agg; a notebook keeps its own). Signal handlers are restored by the trainer itself, the process group is left by
train.py. The glibc heap policy (``utils.memory.keep_freed_memory``) is applied, as the command line does.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import gc
import logging
import os
import sys

from utils.errors import ArgumentError, shorten

TRAINING_ENVIRONMENT = ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED")  # set by --deterministic
QUIET_LOGGERS = ("matplotlib", "PIL")  # setup_logging raises their level


def keyword_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """keyword -> action, for every option string of every flag (``--img-size`` -> ``img_size``)."""
    options = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        for option in action.option_strings:
            options[option.lstrip("-").replace("-", "_")] = action
        options.setdefault(action.dest, action)
    return options


def keyword_argv(parser: argparse.ArgumentParser, keywords: dict) -> list[str]:
    """The command line that ``keywords`` stand for (see the module docstring); ArgumentError for an unknown
    keyword, two keywords for one flag, or a value of the wrong shape."""
    options = keyword_options(parser)
    argv, given = [], {}
    for key, value in keywords.items():
        action = options.get(key)
        if action is None:
            close = difflib.get_close_matches(key, list(options), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ArgumentError(f"unknown keyword argument {shorten(key, 60)}{hint} (see {parser.prog} --help)")
        if action.dest in given:
            raise ArgumentError(f"keyword arguments {given[action.dest]} and {key} set the same option "
                                f"{'/'.join(action.option_strings)}")
        given[action.dest] = key
        if value is not None:
            argv += _flag_words(action, value, key)
    return argv


def _flag_words(action: argparse.Action, value, key: str) -> list[str]:
    flag, name = action.option_strings[0], "/".join(action.option_strings)
    if action.nargs == 0:  # a switch: store_true / store_false
        if value is not True and value is not False:
            raise ArgumentError(f"argument {name}: {key} takes True or False, got {shorten(value, 40)}")
        # Named by its flag (no_tensorboard=True) the value says whether the flag is given; named by its dest
        # (tensorboard=False) the value is the option's value.
        given = value if key != action.dest else value == action.const
        return [flag] if given else []
    if action.nargs == "?":
        if value is True:
            return [flag]
        if value is False:
            return [f"{flag}=off"] if action.choices and "off" in action.choices else []
        return [f"{flag}={_text(value)}"]
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        return [flag, *(_text(v) for v in values)]
    if isinstance(value, (list, tuple, set, dict)):
        raise ArgumentError(f"argument {name}: {key} takes one value, got {shorten(value, 40)}")
    return [f"{flag}={_text(value)}"]


def _matplotlib_backend() -> tuple | None:
    """(backend as set, not resolved; backend_fallback) when matplotlib is imported, else None."""
    matplotlib = sys.modules.get("matplotlib")
    if matplotlib is None:
        return None
    return dict.__getitem__(matplotlib.rcParams, "backend"), dict.__getitem__(matplotlib.rcParams, "backend_fallback")


def _restore_matplotlib_backend(saved: tuple | None) -> None:
    """Undo a ``matplotlib.use("Agg")`` made during the call (utils/plots.py draws with Agg)."""
    matplotlib = sys.modules.get("matplotlib")
    if matplotlib is None:
        return
    if saved is None:  # imported during the call: what the import itself chose
        saved = (os.environ.get("MPLBACKEND") or dict.__getitem__(matplotlib.rcParamsOrig, "backend"),
                 dict.__getitem__(matplotlib.rcParamsOrig, "backend_fallback"))
    backend, fallback = saved
    if dict.__getitem__(matplotlib.rcParams, "backend") != backend:
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None and isinstance(backend, str):
            pyplot.switch_backend(backend)  # e.g. a notebook's inline backend
        else:
            dict.__setitem__(matplotlib.rcParams, "backend", backend)  # as set, unresolved
    dict.__setitem__(matplotlib.rcParams, "backend_fallback", fallback)


def _text(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


@contextlib.contextmanager
def api_call():
    """Run one API call with console logging when none is set up, and leave the process as it was found."""
    import torch

    from utils.loggers import setup_logging
    from utils.memory import keep_freed_memory
    from utils.rng import rng_kept

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    quiet = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    threads = torch.get_num_threads()
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.deterministic)
    environment = {name: os.environ.get(name) for name in TRAINING_ENVIRONMENT}
    backend = _matplotlib_backend()
    if not handlers:
        setup_logging()
    keep_freed_memory()  # whole-process choice: see utils/memory.py
    try:
        with rng_kept():
            yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, quiet_level in quiet.items():
            logging.getLogger(name).setLevel(quiet_level)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        torch.backends.cudnn.deterministic = deterministic[2]
        for name, text in environment.items():
            if text is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = text
        _restore_matplotlib_backend(backend)
        gc.collect()  # loader worker processes of the finished run end now, not at some later collection
