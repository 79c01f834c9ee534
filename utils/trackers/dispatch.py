"""``Trackers``: the one object the Recorder calls for every experiment tracker that is on.

Every call is put on a queue and made by one worker thread, so a slow or unreachable server never holds up training;
a tracker whose call fails (server down, an exception in its package) says so in one warning line and gets no further
calls. ``close`` waits at most CLOSE_WAIT_SECONDS for what is queued. Main process only (``open_trackers`` gives the
other processes an empty set): the rank check lives here, not in the training loop.
"""
from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path

from utils import dist
from utils.errors import one_line
from utils.trackers.clearml_tracker import ClearmlTracker
from utils.trackers.comet_tracker import CometTracker
from utils.trackers.core import RunStart, Tracker, redacted
from utils.trackers.mlflow_tracker import MlflowTracker
from utils.trackers.wandb_tracker import WandbTracker

LOGGER = logging.getLogger(__name__)

# each says whether it is on (Tracker.switch); the start line names them in this order
TRACKERS: tuple[type[Tracker], ...] = (MlflowTracker, WandbTracker, CometTracker, ClearmlTracker)
START_WAIT_SECONDS = 10.0   # start-up waits at most this for the trackers' runs to exist (their URLs, their ids)
CLOSE_WAIT_SECONDS = 60.0   # the end of a run waits at most this for the queued calls


def open_trackers(config, hyp, save_dir: Path, resume_ids: dict | None = None,
                  classes: tuple[type[Tracker], ...] = TRACKERS) -> "Trackers":
    """The trackers that are on for this run (none with --no-trackers, and none off the main process), not started
    yet; ``resume_ids``: the run ids a resumed checkpoint stored (tracker name -> id)."""
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
    return Trackers(chosen, run, off, resume_ids or {})


class Trackers:
    """The trackers of one run behind one queue (see the module docstring)."""

    def __init__(self, trackers: list[Tracker], run: RunStart | None = None, off: list[str] = (),
                 resume_ids: dict | None = None):
        self.trackers = list(trackers)
        self.run, self.off, self.resume_ids = run, list(off), dict(resume_ids or {})  # off: "<label> off (why)"
        self.failed: set[str] = set()  # names of trackers that failed (read by tests and the start line)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self, rows: list[dict]) -> None:
        """Start (or continue) every tracker's run with the epochs already finished (``rows``: a resumed run's
        results), wait at most START_WAIT_SECONDS for them, and say in one line which trackers are on and why."""
        if not self.trackers:
            if self.off:
                LOGGER.info("Trackers: %s", "; ".join(self.off))
            return
        self._thread = threading.Thread(target=self._work, name="trackers", daemon=True)
        self._thread.start()
        for tracker in self.trackers:
            run = RunStart(**{**vars(self.run), "resume_id": self.resume_ids.get(tracker.name), "rows": list(rows)})
            self._put(tracker, "start", run)
        reached = threading.Event()
        self._queue.put(reached)
        reached.wait(START_WAIT_SECONDS)
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

    def run_ids(self) -> dict[str, str]:
        """Tracker name -> run id, for the checkpoint (a --resume continues these runs)."""
        return {tracker.name: tracker.run_id for tracker in self.trackers if tracker.run_id}

    def close(self, finished: bool) -> None:
        """End every run (``finished``: the run ended normally; else it was stopped and a --resume may continue it)
        and wait at most CLOSE_WAIT_SECONDS for the queue; safe to call again."""
        if self._thread is None:
            return
        for tracker in self.trackers:
            self._put(tracker, "finish", bool(finished))
        self._queue.put(None)
        self._thread.join(CLOSE_WAIT_SECONDS)
        if self._thread.is_alive():
            LOGGER.warning("WARNING: Trackers: %d call(s) still unsent after %g s (a slow or unreachable server) are "
                           "given up; the run folder has everything", self._queue.qsize() + 1, CLOSE_WAIT_SECONDS)
        self._thread = None

    def _put(self, tracker: Tracker, method: str, *args) -> None:
        if self._thread is not None:
            self._queue.put((tracker, method, args))

    def _work(self) -> None:
        """The worker: calls in order; a tracker's first failure is one warning line and its last call."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            tracker, method, args = item
            if tracker.name in self.failed:
                continue
            try:
                getattr(tracker, method)(*args)
            except Exception as error:  # any failure of a tracker (network, server, its package) is not training's
                self.failed.add(tracker.name)
                LOGGER.warning("WARNING: %s: %s failed, no more logging to it; training goes on (%s)", tracker.label,
                               method, one_line(f"{type(error).__name__}: {error}", 300))
