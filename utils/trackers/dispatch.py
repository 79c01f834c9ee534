"""``Trackers``: the one object the Recorder calls for every experiment tracker that is on.

Every call is put on the tracker's own queue and made by its own worker thread, so a slow or unreachable server never
holds up training nor the other trackers; a tracker whose call fails (server down, an exception in its package) says
so in one warning line and gets no further calls. ``close`` waits at most CLOSE_WAIT_SECONDS in all for what is
queued. Main process only (``open_trackers`` gives the other processes an empty set): the rank check lives here, not
in the training loop.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import queue
import threading
import time
from pathlib import Path

from utils import dist
from utils.errors import one_line
from utils.trackers.clearml_tracker import ClearmlTracker
from utils.trackers.comet_tracker import CometTracker
from utils.trackers.core import RunStart, Tracker, ValPredictions, redacted
from utils.trackers.mlflow_tracker import MlflowTracker
from utils.trackers.wandb_tracker import WandbTracker

LOGGER = logging.getLogger(__name__)

# each says whether it is on (Tracker.switch); the start line names them in this order
TRACKERS: tuple[type[Tracker], ...] = (MlflowTracker, WandbTracker, CometTracker, ClearmlTracker)
START_WAIT_SECONDS = 10.0   # start-up waits at most this for the trackers' runs to exist (their URLs, their ids)
CLOSE_WAIT_SECONDS = 60.0   # the end of a run waits at most this for the queued calls


_GENERATION: contextvars.ContextVar = contextvars.ContextVar("evolution_generation", default=None)


@contextlib.contextmanager
def evolution_generation(folder: Path, number: int):
    """--evolve: runs opened inside are generation ``number`` of the evolution in ``folder``: named
    ``<evolution>-gen<number>``, grouped under the evolution's name (each tracker's group, docs/trackers.md), their
    files in ``folder`` (a generation's own folder is removed when it ends)."""
    token = _GENERATION.set((Path(folder), int(number)))
    try:
        yield
    finally:
        _GENERATION.reset(token)


def open_trackers(config, hyp, save_dir: Path, resume_ids: dict | None = None,
                  classes: tuple[type[Tracker], ...] = TRACKERS) -> "Trackers":
    """The trackers that are on for this run (none with --no-trackers, and none off the main process), not started
    yet; ``resume_ids``: the run ids a resumed checkpoint stored (tracker name -> id). Inside
    ``evolution_generation`` the run is that generation's."""
    if not dist.is_main_process():
        return Trackers([])
    chosen, off = [], []
    for tracker_class in classes if config.trackers else ():
        decision = tracker_class.switch()
        if decision is None:  # not installed: nothing to say
            continue
        on, why = decision
        if on:
            chosen.append(tracker_class())
            chosen[-1].why = why
        else:
            off.append(f"{tracker_class.label} off ({why})")
    params = {**config.to_dict(), **{f"hyp/{key}": value for key, value in hyp.to_dict().items()}}
    run = RunStart(experiment=str(config.project), run_name=Path(save_dir).name, params=redacted(params),
                   save_dir=Path(save_dir))
    generation = _GENERATION.get()
    if generation is not None:
        folder, number = generation
        run.run_name, run.group, run.save_dir = f"{folder.name}-gen{number}", folder.name, folder
    return Trackers(chosen, run, off, resume_ids or {})


class Trackers:
    """The trackers of one run, each behind its own queue and worker thread (see the module docstring)."""

    def __init__(self, trackers: list[Tracker], run: RunStart | None = None, off: list[str] = (),
                 resume_ids: dict | None = None):
        self.trackers = list(trackers)
        self.run, self.off, self.resume_ids = run, list(off), dict(resume_ids or {})  # off: "<label> off (why)"
        self.failed: set[str] = set()  # names of trackers that failed (read by tests and the start line)
        self._queues: dict[str, queue.Queue] = {}
        self._threads: list[threading.Thread] = []

    def start(self, rows: list[dict]) -> None:
        """Start (or continue) every tracker's run with the epochs already finished (``rows``: a resumed run's
        results), wait at most START_WAIT_SECONDS for them, and say in one line which trackers are on and why."""
        if not self.trackers:
            if self.off:
                LOGGER.info("Trackers: %s", "; ".join(self.off))
            return
        reached = []
        for tracker in self.trackers:
            self._queues[tracker.name] = queue.Queue()
            thread = threading.Thread(target=self._work, args=(tracker, self._queues[tracker.name]),
                                      name=f"tracker-{tracker.name}", daemon=True)
            thread.start()
            self._threads.append(thread)
            run = RunStart(**{**vars(self.run), "resume_id": self.resume_ids.get(tracker.name), "rows": list(rows)})
            self._put(tracker, "start", run)
            reached.append(threading.Event())
            self._queues[tracker.name].put(reached[-1])
        deadline = time.monotonic() + START_WAIT_SECONDS
        for event in reached:
            event.wait(max(0.0, deadline - time.monotonic()))
        LOGGER.info("Trackers: %s; --no-trackers turns them off", "; ".join(self._start_words()))

    def _start_words(self) -> list[str]:
        words = []
        for tracker in self.trackers:
            if tracker.name in self.failed:
                state = "not started (the warning above says why)"
            elif tracker.run_id is None:
                state = f"no answer within {START_WAIT_SECONDS:g} s, logging in the background"
            else:
                state = f"{tracker.note}{tracker.url}"
            words.append(f"{tracker.label} on ({tracker.why}): {state}")
        return words + self.off

    def log_epoch(self, epoch: int, values: dict[str, float]) -> None:
        for tracker in self.trackers:
            self._put(tracker, "log_epoch", int(epoch), dict(values))

    def log_files(self, paths, folder: str = "") -> None:
        """Files as artifacts (their paths now: uploaded in the background, so pass files the run no longer
        rewrites: plots, best.pt at the end, epoch<N>.pt)."""
        paths = [Path(path) for path in paths]
        if paths:
            for tracker in self.trackers:
                self._put(tracker, "log_files", paths, folder)

    def log_predictions(self, predictions: ValPredictions | None) -> None:
        """--bbox_interval's val images with their predictions, right after their epoch's row (its step): each
        tracker shows them its own way, in its worker thread (drawing included)."""
        if predictions is not None:
            for tracker in self.trackers:
                self._put(tracker, "log_predictions", predictions)

    def log_validation(self, epoch: int, per_class: list[dict], confusion, names: list[str]) -> None:
        """A validation per class (utils.validation.ValResult.per_class) and its confusion matrix (None where it
        was not counted), after the row of step ``epoch`` (Tracker.log_validation)."""
        for tracker in self.trackers:
            self._put(tracker, "log_validation", int(epoch), list(per_class), confusion, list(names))

    def run_ids(self) -> dict[str, str]:
        """Tracker name -> run id, for the checkpoint (a --resume continues these runs)."""
        return {tracker.name: tracker.run_id for tracker in self.trackers  # a failed one's too: its run may go on
                if isinstance(tracker.run_id, str) and tracker.run_id}

    def close(self, finished: bool) -> None:
        """End every run (``finished``: the run ended normally; else it was stopped and a --resume may continue it)
        and wait at most CLOSE_WAIT_SECONDS in all for the queues; safe to call again."""
        if not self._threads:
            return
        for tracker in self.trackers:
            self._put(tracker, "finish", bool(finished))
            self._queues[tracker.name].put(None)
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        # a live worker's unsent calls: the one it is in and those queued behind it (the queue's end marker excluded)
        unsent = sum(self._queues[tracker.name].qsize() for tracker, thread in zip(self.trackers, self._threads)
                     if thread.is_alive())
        if unsent:
            LOGGER.warning("WARNING: Trackers: %d call(s) still unsent after %g s (a slow or unreachable server) are "
                           "given up; the run folder has everything", unsent, CLOSE_WAIT_SECONDS)
        self._threads = []

    def _put(self, tracker: Tracker, method: str, *args) -> None:
        if self._threads:
            self._queues[tracker.name].put((method, args))

    def _work(self, tracker: Tracker, calls: queue.Queue) -> None:
        """One tracker's worker: its calls in order; its first failure is one warning line and its last call."""
        while True:
            item = calls.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            method, args = item
            if tracker.name in self.failed:
                continue
            try:
                getattr(tracker, method)(*args)
            except Exception as error:  # any failure of a tracker (network, server, its package) is not training's
                self.failed.add(tracker.name)
                LOGGER.warning("WARNING: %s: %s failed, no more logging to it; training goes on (%s)", tracker.label,
                               method, one_line(f"{type(error).__name__}: {error}", 300))
