"""When to save inside an epoch and when to stop: SIGINT / SIGTERM and the --save-every-min clock.

A signal does not stop the run where it lands: ``SaveControl`` only notes it, and the trainer asks
``decide()`` after each optimizer step (when no gradient is pending). Then the run writes last.pt
with its position inside the epoch and stops, so ``--resume`` continues exactly. The clock works the
same way: every ``save_every_min`` minutes of training a mid-epoch last.pt is written at the next
optimizer step, so a SIGKILL or a power cut loses at most that much work (plus the epoch-end saves).

Under DDP every process asks at the same optimizer steps and the answer is agreed in one tiny
all-reduce (stop if any process was signalled; save when the main process's clock says so), so all
processes stop or save at the same step. A second Ctrl-C aborts at once without saving.

A stop can also be asked for without a signal (``stop_requested``: YOLOv5's ``callbacks.stop_training``): the same
save and stop, agreed the same way, with ``requested`` set instead of ``signal_number``.
"""
from __future__ import annotations

import logging
import signal
import threading
import time

from utils import dist

LOGGER = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + signal number, as a shell reports it


class SaveControl:
    def __init__(self, save_every_min: float = 0.0, stop_requested=None):
        self.interval = save_every_min * 60.0
        self.signal_number: int | None = None
        self.stop_requested = stop_requested  # callable() -> bool, asked at each decision; None: signals only
        self.requested = False  # the run stops because stop_requested() said so (on some process), not a signal
        self._last_save = time.monotonic()
        self._previous_handlers: dict = {}

    # ------------------------------------------------------------------ signals
    def install(self) -> "SaveControl":
        """Catch SIGINT / SIGTERM (main thread only; elsewhere signals keep their default behaviour)."""
        if threading.current_thread() is threading.main_thread():
            for number in HANDLED_SIGNALS:
                self._previous_handlers[number] = signal.signal(number, self._on_signal)
        return self

    def uninstall(self) -> None:
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        self._previous_handlers.clear()

    def _on_signal(self, number, frame) -> None:
        if self.signal_number is not None and number == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now, without saving
        self.signal_number = number
        LOGGER.warning("\n%s received: finishing the current optimizer step, then saving last.pt "
                       "(Ctrl-C again to stop without saving)", signal.Signals(number).name)

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(self.signal_number, 1)

    # ------------------------------------------------------------------ decisions
    def decide(self) -> tuple[bool, bool]:
        """At an optimizer-step boundary: (save a mid-epoch checkpoint now, stop after it)."""
        save_due = self.interval > 0 and dist.is_main_process() and time.monotonic() - self._last_save >= self.interval
        signalled = self.signal_number is not None
        requested = self.requested or (self.stop_requested is not None and bool(self.stop_requested()))
        if dist.get_world_size() > 1:
            signalled_any, requested_any, save_any = dist.all_reduce_max(
                [int(signalled), int(requested), int(save_due)], "agree whether to save or stop")
            if signalled_any and not signalled:
                self.signal_number = signal.SIGTERM  # another process was signalled: stop with it
            signalled, requested, save_due = bool(signalled_any), bool(requested_any), bool(save_any)
        self.requested = requested and not signalled
        stop = signalled or requested
        return save_due or stop, stop

    def saved(self) -> None:
        """A checkpoint was written (mid-epoch or at the end of an epoch): restart the clock."""
        self._last_save = time.monotonic()
