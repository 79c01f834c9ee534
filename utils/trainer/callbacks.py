"""A small registry of training hooks. Only hooks that the trainer actually fires are listed."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

HOOKS = (
    "on_train_start",      # save_dir, model, config
    "on_fit_epoch_end",    # epoch, values (dict of results.csv columns), fitness, stats (EpochStats)
    "on_train_end",        # save_dir, best, results
)


class Callbacks:
    def __init__(self):
        self._hooks: dict[str, list[Callable]] = defaultdict(list)

    def register(self, hook: str, fn: Callable) -> None:
        if hook not in HOOKS:
            raise ValueError(f"unknown hook '{hook}' (known: {', '.join(HOOKS)})")
        self._hooks[hook].append(fn)

    def run(self, hook: str, **kwargs) -> None:
        for fn in self._hooks.get(hook, ()):
            fn(**kwargs)
