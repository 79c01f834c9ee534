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
compute threads, the global random generators (CUDA's too, also when the call initialised CUDA: utils/rng.py),
the deterministic-algorithm switches and the environment variables training sets. Elsewhere: plots are drawn
on their own Agg canvases, never through pyplot (a notebook's backend and open figures are untouched); signal
handlers are restored by the trainer itself; only a process group the call created is destroyed
(utils.dist.cleanup); the glibc heap policy (utils/memory.py) is kept for train.run's duration only and not
applied by val.run or detect.run.

``StreamedCall(items)`` is an API call that returns an iterator (``detect.run(stream=True)``): each step runs under
``api_call``, the caller's code between two items in the caller's own state.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import gc
import logging
import os
from typing import Iterator

from utils.errors import ArgumentError, shorten

TRAINING_ENVIRONMENT = ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED")  # set by --deterministic
QUIET_LOGGERS = ("matplotlib", "PIL")  # setup_logging raises their level


# YOLOv5 v7.0's run() parameters in their order, for scripts that pass the first ones by position
# (``val.run("data.yaml", "best.pt")``, ``detect.run("best.pt", "images/")``).
DETECT_POSITIONS = ("weights", "source", "data", "imgsz", "conf_thres", "iou_thres", "max_det", "device", "view_img",
                    "save_txt", "save_conf", "save_crop", "nosave", "classes", "agnostic_nms", "augment", "visualize",
                    "update", "project", "name", "exist_ok", "line_thickness", "hide_labels", "hide_conf", "half",
                    "dnn", "vid_stride")
VAL_POSITIONS = ("data", "weights", "batch_size", "imgsz", "conf_thres", "iou_thres", "max_det", "task", "device",
                 "workers", "single_cls", "augment", "verbose", "save_txt", "save_hybrid", "save_conf", "save_json",
                 "project", "name", "exist_ok", "half", "dnn")


def with_positions(prog: str, positions: tuple[str, ...], args: tuple, keywords: dict) -> dict:
    """``keywords`` with ``args`` named by YOLOv5's parameter order ``positions``; ArgumentError for more
    arguments than that, or one given both ways."""
    if len(args) > len(positions):
        raise ArgumentError(f"{prog} run() takes at most {len(positions)} positional arguments "
                            f"({', '.join(positions[:3])}, ...), got {len(args)}")
    named = dict(zip(positions, args))
    for key in named:
        if key in keywords:
            raise ArgumentError(f"{prog} run() got {key} both by position and as a keyword")
    return {**named, **keywords}


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


def _text(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


@contextlib.contextmanager
def api_call(trains: bool = False, step: bool = False):
    """Run one API call with console logging when none is set up, and leave the process as it was found.
    ``trains``: the call trains (train.run), so it keeps freed memory for its duration (utils/memory.py).
    ``step``: one step of a streamed call (StreamedCall), which leaves garbage collection to its last step."""
    import torch

    from utils.loggers import setup_logging
    from utils.memory import kept_during_call
    from utils.rng import rng_kept

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    quiet = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    threads = torch.get_num_threads()
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.deterministic)
    environment = {name: os.environ.get(name) for name in TRAINING_ENVIRONMENT}
    if not handlers:
        setup_logging()
    with kept_during_call() if trains else contextlib.nullcontext():
        try:
            with rng_kept():
                yield
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
            for name, quiet_level in quiet.items():
                logging.getLogger(name).setLevel(quiet_level)
            torch.set_num_threads(threads)
            if (torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled()) != deterministic[:2]:
                # only when the call changed them (--deterministic): torch's setter imports torch._inductor (~3 s
                # here, and the compiler into a process that never compiles) and sets its config as well
                torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
            torch.backends.cudnn.deterministic = deterministic[2]
            for name, text in environment.items():
                if text is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = text
            if not step:
                gc.collect()  # the run's tensors and loader workers go now (before the heap is trimmed)


class StreamedCall:
    """An API call that returns an iterator (``detect.run(stream=True)``): each ``next()`` and the closing run under
    ``api_call``, so the caller's own code between two items runs in its own process state (its logging, its random
    generators), never in the call's. ``items``: a generator that has not started. Also a context manager that
    closes it."""

    def __init__(self, items: Iterator):
        self._items = items

    def __iter__(self) -> "StreamedCall":
        return self

    def __next__(self):
        with api_call(step=True):
            item = next(self._items, _END)  # StopIteration is raised outside the guard
        if item is _END:
            raise StopIteration
        return item

    def close(self) -> None:
        """End the call early: the generator's cleanup runs (under the guard)."""
        with api_call():
            self._items.close()

    def __enter__(self) -> "StreamedCall":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


_END = object()
