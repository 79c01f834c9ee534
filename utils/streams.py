"""Live sources for detect.py, YOLOv5's forms: a webcam index (``0``), network streams (``rtsp://``, ``rtmp://``,
``http(s)://`` without an image or video file name), a ``.streams`` file of such URLs (one a line), and ``screen``
(``screen [N] [left top width height]``, with the optional ``mss`` package).

Opening. ``open_streams`` opens a list's streams in parallel, a thread each, and fails on the first one that cannot be
opened: one StreamError line as soon as it is known, every stream opened so far closed, and those still opening
closed as their open returns. A network open waits at most OPEN_TIMEOUT seconds (OpenCV's default is 30 s). OpenCV
runs one FFmpeg open at a time in a process, under a lock of its own (OpenCV 5.0.0 on a Zen 4 EPYC: 4 silent loopback
servers opened from 4 threads with a 2 s open timeout took 8.0 s), so the threads overlap webcams and each stream's
first frame, not the network opens: those take turns at a lock of ours first (``_OPENING``, the order OpenCV imposes
anyway), so that the opens still waiting when a list fails, or when a reader is stopped, are skipped instead of run.

Reading. Each stream is read by its own thread, which keeps only the newest frame (detection never falls behind a
live source: frames that arrive while a frame is being detected are dropped, as in YOLOv5). A read waits at most
READ_TIMEOUT seconds; a stream whose read fails or times out is opened again up to RECONNECTS times, after
RECONNECT_WAIT seconds, then twice that, and so on; after that it has ended. ``read_streams`` yields whichever stream
has a new frame, in turn among those that have one, so each stream keeps its own pace (YOLOv5's LoadStreams takes
each stream's newest frame too); it waits on one condition that every reader of the list notifies. A stream counts
as ended once its reader gave up, or after FRAME_TIMEOUT seconds in which its reader neither got a frame nor took a
step of reconnecting (a read that does not return: READ_TIMEOUT bounds the reads of network streams, not a webcam's).
FRAME_TIMEOUT is longer than any one step (a read, an open, a wait), so a stream is never given up while its reader
is still reconnecting.

Closing. The reader thread owns its capture and releases it itself: a stalled stream blocks ``read()`` inside FFmpeg
(for at most READ_TIMEOUT seconds), and releasing the capture from another thread under that read crashes the
process when the read's timeout fires. ``close()`` stops the reader (a wait between reconnects ends at once, an open
still waiting for its turn is skipped) and waits for it to release the capture: a read or an open under way ends
within its timeout. A reader still inside a read after that (a webcam's) is logged as such; it releases the capture
when that read returns.
"""
from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Callable, Iterator

import cv2
import numpy as np

from utils.downloads import is_url
from utils.errors import SourceError

LOGGER = logging.getLogger(__name__)

STREAM_SCHEMES = ("rtsp://", "rtmp://")  # and http(s):// (utils.downloads.is_url)
RECONNECTS = 3
RECONNECT_WAIT = 1.0  # seconds before the first reconnect, doubled before each further one (1, 2, 4 s)
OPEN_TIMEOUT = 10.0  # seconds a network open may take
READ_TIMEOUT = 5.0  # seconds a read may wait for a frame before the stream is opened again
FRAME_TIMEOUT = 15.0  # seconds without a frame or a reconnect step before a stream counts as ended (module doc)
CLOSE_MARGIN = 2.0  # seconds close() waits past the longest read or open for the reader to release its capture
MAX_STREAMS = 64

_OPENING = threading.Lock()  # network opens take turns (module doc)


class StreamError(SourceError):
    """A live source that cannot be opened; one line naming it."""


class SkippedOpen(StreamError):
    """An open skipped because another stream of its list failed: ``open_streams`` says that stream's error instead."""


def is_index(text: str) -> bool:
    """A webcam or screen number: ASCII digits only, '0', '12' (``str.isnumeric`` also takes '½' and '²', and
    ``str.isdigit`` '²', which ``int`` refuses)."""
    return text.isascii() and text.isdigit()


def is_stream_url(text: str) -> bool:
    """An rtsp://, rtmp:// or http(s):// URL (an http(s) one may also name a media file: see utils.sources)."""
    return text.lower().startswith(STREAM_SCHEMES) or is_url(text)


def stream_urls(text: str) -> list[str]:
    """The streams of a ``.streams`` file (one URL or webcam index a line, '#' comments), or ``[text]``."""
    path = Path(text)
    if path.suffix.lower() != ".streams":
        _refuse_web_page(text, text)
        return [text]
    if not path.is_file():
        raise StreamError(f"{text}: no such .streams file")
    urls = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.strip().startswith("#")]
    if not urls or len(urls) > MAX_STREAMS:
        raise StreamError(f"{text}: expected 1 to {MAX_STREAMS} stream URLs, one a line, found {len(urls)}")
    for url in urls:
        if not (is_index(url) or is_stream_url(url)):
            raise StreamError(f"{text}: {url[:200]!r} is not a stream URL (rtsp://, rtmp://, http(s)://) or a webcam "
                              "index")
        _refuse_web_page(url, text)
    return urls


def _refuse_web_page(url: str, given: str) -> None:
    """A YouTube address is a web page, not a stream: YOLOv5 has pafy/youtube_dl resolve it, and YouTube's players
    now need its own JavaScript run to give a video address. Nothing here runs a site's code, so it is one line
    naming what works instead, before any open (which would wait OPEN_TIMEOUT seconds to fail)."""
    host = (urllib.parse.urlsplit(url).hostname or "") if is_url(url) else ""
    if host == "youtu.be" or host == "youtube.com" or host.endswith(".youtube.com"):
        raise StreamError(f"--source {given}: {url[:200]} is a YouTube page, not a video stream; YouTube gives its "
                          "video address only to its own JavaScript, which this program never runs: download the "
                          "video (e.g. with yt-dlp) and pass the file, or pass the stream's own rtsp://, rtmp:// or "
                          "http(s):// address")


class Stream:
    """One capture and the thread that reads it (module doc). ``changed``: the condition its reader notifies (one
    for a whole list: ``read_streams`` waits on it); ``cancel``: a list's, set when one of its streams fails (this
    open's failure sets it too, before the next open's turn); once set, an open that has not begun is skipped."""

    def __init__(self, source: str, changed: threading.Condition | None = None,
                 cancel: threading.Event | None = None):
        self.source = source
        self.target = int(source) if is_index(source) else source
        what = f"webcam {source} (is a camera attached?)" if is_index(source) else f"stream {source}"
        cancel = cancel or threading.Event()
        capture = _open(self.target, cancel, failed=cancel)
        if capture is None:
            raise SkippedOpen(f"--source {source}: not opened (the list could not be opened)")
        if not capture.isOpened():
            capture.release()
            raise StreamError(f"--source {source}: cannot open {what}")
        ok, image = capture.read()
        if not ok or image is None:
            capture.release()
            raise StreamError(f"--source {source}: opened, but no frame arrived")
        self.capture = capture
        self.fps = float(capture.get(cv2.CAP_PROP_FPS) or 0.0) or 30.0
        self.frame, self.count, self.ended = image, 1, False
        self.active = time.monotonic()  # the reader's last frame or reconnect step
        self.changed = changed or threading.Condition()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._read, name=f"stream {source}", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        failures = 0
        try:
            while not self.stopping.is_set():
                ok, image = self.capture.read()
                if ok and image is not None:
                    failures = 0
                    with self.changed:
                        self.frame, self.count, self.active = image, self.count + 1, time.monotonic()
                        self.changed.notify_all()
                    continue
                failures += 1
                if failures > RECONNECTS or self.stopping.is_set() or not self._reopen(failures):
                    break
        finally:
            self.capture.release()
            with self.changed:
                self.ended = True
                self.changed.notify_all()

    def _reopen(self, failures: int) -> bool:
        """Release the capture, wait, open it again; False when stopped meanwhile."""
        LOGGER.warning("%s: no frame; opening it again (%d of %d)", self.source, failures, RECONNECTS)
        self.capture.release()
        self._step()
        if self.stopping.wait(RECONNECT_WAIT * 2 ** (failures - 1)):
            return False
        self._step()
        capture = _open(self.target, self.stopping, waiting=self._step)
        if capture is None:
            return False
        self.capture = capture
        self._step()
        return True

    def _step(self) -> None:
        self.active = time.monotonic()

    def stop(self) -> None:
        """Ask the reader to stop (``close`` also waits for it)."""
        self.stopping.set()

    def close(self) -> None:
        """Stop the reader and wait until it has released the capture (module doc); log it if it has not."""
        self.stop()
        wait = max(OPEN_TIMEOUT, READ_TIMEOUT) + CLOSE_MARGIN
        self.thread.join(timeout=wait)
        if self.thread.is_alive():
            LOGGER.warning("%s: still reading after %.0f s; its capture is released when that read returns",
                           self.source, wait)


def _open(target: int | str, cancel: threading.Event, waiting: Callable[[], None] = lambda: None,
          failed: threading.Event | None = None) -> cv2.VideoCapture | None:
    """A webcam, or a stream whose open waits at most OPEN_TIMEOUT seconds and whose reads READ_TIMEOUT seconds,
    opened at its turn (module doc); None when ``cancel`` is set before the turn comes. ``waiting`` is called
    every half second meanwhile; ``failed`` is set when a stream's open fails, before the next open's turn."""
    if isinstance(target, int):
        return cv2.VideoCapture(target)
    while not _OPENING.acquire(timeout=0.5):
        if cancel.is_set():
            return None
        waiting()
    try:
        if cancel.is_set():
            return None
        capture = cv2.VideoCapture(target, cv2.CAP_ANY, [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, int(OPEN_TIMEOUT * 1000),
                                                         cv2.CAP_PROP_READ_TIMEOUT_MSEC, int(READ_TIMEOUT * 1000)])
        if failed is not None and not capture.isOpened():
            failed.set()
        return capture
    finally:
        _OPENING.release()


def open_streams(sources: list[str]) -> list[Stream]:
    """Every source opened now, in parallel (module doc): a bad one is an error before any model work, raised as
    soon as it is known; none is left open on an error, Ctrl-C included. The error raised is the failed stream's: a
    failed open cancels the list before it releases its capture, so an open skipped meanwhile (``SkippedOpen``) can
    end first, and only stands for the failure when no other error comes."""
    changed, cancel, state = threading.Condition(), threading.Event(), threading.Condition()
    opened: dict[int, Stream] = {}
    errors: list[BaseException] = []
    skipped: list[SkippedOpen] = []
    pending = [len(sources)]

    def open_one(index: int, source: str) -> None:
        stream = error = None
        try:
            stream = Stream(source, changed, cancel)
        except BaseException as raised:  # noqa: BLE001 - handed to open_streams' caller, raised there
            error = raised
        with state:
            pending[0] -= 1
            if isinstance(error, SkippedOpen):
                skipped.append(error)
            elif error is not None:
                errors.append(error)
                cancel.set()
            elif not cancel.is_set():
                opened[index] = stream
            state.notify_all()
        if stream is not None and index not in opened:
            stream.close()  # the list failed while this one was opening

    for index, source in enumerate(sources):
        threading.Thread(target=open_one, args=(index, source), name=f"opening {source}", daemon=True).start()
    succeeded = False
    try:
        with state:
            state.wait_for(lambda: errors or not pending[0])
            succeeded = not errors and not skipped
    finally:
        if not succeeded:  # a stream failed, or Ctrl-C came while waiting
            with state:
                cancel.set()  # nothing is added to ``opened`` from here on
            close_streams(list(opened.values()))
    if errors or skipped:
        raise (errors or skipped)[0]
    return [opened[index] for index in range(len(sources))]


def close_streams(streams: list[Stream]) -> None:
    """Close every stream: all are told to stop first, so their readers wind down together."""
    for stream in streams:
        stream.stop()
    for stream in streams:
        stream.close()


def read_streams(streams: list[Stream], vid_stride: int = 1) -> Iterator[tuple[int, int, np.ndarray]]:
    """(stream index, frame number among those yielded from it, frame) as frames come (module doc): the stream with
    a new frame, at least ``vid_stride`` frames after the last one yielded from it, that comes first in turn after
    the stream last yielded; until each stream has ended. The streams must share one condition (``open_streams``
    makes them so). The streams are closed however the iteration ends."""
    try:
        changed = streams[0].changed
        if any(stream.changed is not changed for stream in streams):
            raise ValueError("read_streams: the streams must come from one open_streams call")
        last, yielded, live, turn = [0] * len(streams), [0] * len(streams), set(range(len(streams))), 0
        while live:
            with changed:
                index, ended = _wait_for_frame(streams, live, last, vid_stride, turn)
                if index is not None:
                    last[index], image = streams[index].count, streams[index].frame
            for gone in ended:
                live.discard(gone)
                streams[gone].stop()  # no reconnecting in the background
                LOGGER.info("%s: stream ended after %d frames", streams[gone].source, yielded[gone])
            if index is not None:
                turn, yielded[index] = index + 1, yielded[index] + 1
                yield index, yielded[index], image
    finally:
        close_streams(streams)


def _wait_for_frame(streams: list[Stream], live: set[int], last: list[int], vid_stride: int, turn: int
                    ) -> tuple[int | None, list[int]]:
    """(the next stream with a new frame, []) or (None, the streams that have ended); called holding their shared
    condition, on which it waits until one of the two."""
    while True:
        ready = [index for index in live if streams[index].count >= last[index] + vid_stride]
        if ready:
            return min(ready, key=lambda index: (index - turn) % len(streams)), []
        now = time.monotonic()
        ended = [index for index in live if streams[index].ended or now - streams[index].active > FRAME_TIMEOUT]
        if ended:
            return None, sorted(ended)
        streams[0].changed.wait(min(streams[index].active for index in live) + FRAME_TIMEOUT - now)


def parse_screen(text: str) -> tuple[int, dict | None]:
    """``screen [N] [left top width height]`` -> (screen number, region or None)."""
    parts = text.split()[1:]
    if not all(is_index(part) for part in parts) or len(parts) not in (0, 1, 4, 5):
        raise StreamError(f"--source {text}: expected 'screen', 'screen N' or 'screen N left top width height'")
    numbers = [int(part) for part in parts]
    screen = numbers.pop(0) if len(numbers) in (1, 5) else 0
    region = dict(zip(("left", "top", "width", "height"), numbers)) if numbers else None
    if region and (region["width"] < 1 or region["height"] < 1):
        raise StreamError(f"--source {text}: width and height must be 1 or more")
    return screen, region


def read_screen(text: str) -> Iterator[np.ndarray]:
    """Screenshots (BGR) of the screen or region ``text`` names, for as long as the caller iterates."""
    screen, region = parse_screen(text)
    try:
        import mss
    except ImportError:
        raise StreamError(f"--source {text}: screen capture needs the mss package (pip install mss)") from None
    try:
        grabber = (getattr(mss, "MSS", None) or mss.mss)()  # mss 10.2 renamed mss.mss (deprecated) to MSS
    except Exception as error:  # noqa: BLE001 - mss raises its own ScreenShotError without a display
        raise StreamError(f"--source {text}: no display to capture ({str(error).splitlines()[0][:200]})") from None
    with grabber:
        if screen >= len(grabber.monitors):
            raise StreamError(f"--source {text}: screen {screen} does not exist ({len(grabber.monitors) - 1} found)")
        monitor = grabber.monitors[screen]
        # a region past the screen's edge: X11 would answer every grab with a bare protocol error
        if region and (region["left"] + region["width"] > monitor["width"]
                       or region["top"] + region["height"] > monitor["height"]):
            raise StreamError(f"--source {text}: the region {region['width']}x{region['height']} at "
                              f"({region['left']}, {region['top']}) is not inside screen {screen} "
                              f"({monitor['width']}x{monitor['height']})")
        area = ({"left": monitor["left"] + region["left"], "top": monitor["top"] + region["top"],
                 "width": region["width"], "height": region["height"]} if region else monitor)
        while True:
            yield np.ascontiguousarray(np.asarray(grabber.grab(area))[:, :, :3])  # BGRA -> BGR
