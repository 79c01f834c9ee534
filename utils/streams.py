"""Live sources for detect.py, YOLOv5's forms: a webcam index (``0``), network streams (``rtsp://``, ``rtmp://``,
``http(s)://`` without an image or video file name), a ``.streams`` file of such URLs (one a line), and ``screen``
(``screen [N] [left top width height]``, with the optional ``mss`` package).

Each stream is read by its own thread, which keeps only the newest frame (detection never falls behind a live
source: frames that arrive while a frame is being detected are dropped, as in YOLOv5). A stream that stops
delivering is opened again up to ``RECONNECTS`` times; after that, or ``FRAME_TIMEOUT`` seconds without a new frame,
it counts as ended and the others go on. A source that cannot be opened at all is one SourceError line.

The reader thread owns its capture and releases it itself: a stalled stream blocks ``read()`` inside FFmpeg (for at
most ``FRAME_TIMEOUT`` seconds, set as OpenCV's read timeout), and releasing the capture from another thread under
that read crashes the process when the read's timeout fires.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Iterator

import cv2
import numpy as np

from utils.downloads import is_url
from utils.errors import SourceError

LOGGER = logging.getLogger(__name__)

STREAM_SCHEMES = ("rtsp://", "rtmp://")  # and http(s):// (utils.downloads.is_url)
RECONNECTS = 3
FRAME_TIMEOUT = 10.0  # seconds without a new frame before a stream counts as ended
MAX_STREAMS = 64


class StreamError(SourceError):
    """A live source that cannot be opened; one line naming it."""


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
    return urls


class Stream:
    """One capture and the thread that reads it (module doc)."""

    def __init__(self, source: str):
        self.source = source
        self.target = int(source) if is_index(source) else source
        self.capture = _open(self.target)
        if not self.capture.isOpened():
            self.capture.release()
            what = f"webcam {source} (is a camera attached?)" if is_index(source) else f"stream {source}"
            raise StreamError(f"--source {source}: cannot open {what}")
        ok, image = self.capture.read()
        if not ok or image is None:
            self.capture.release()
            raise StreamError(f"--source {source}: opened, but no frame arrived")
        self.fps = float(self.capture.get(cv2.CAP_PROP_FPS) or 0.0) or 30.0
        self.frame, self.count, self.ended, self.stopped = image, 1, False, False
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, name=f"stream {source}", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        failures = 0
        while not self.stopped:
            ok, image = self.capture.read()
            if ok and image is not None:
                failures = 0
                with self.changed:
                    self.frame, self.count = image, self.count + 1
                    self.changed.notify_all()
                continue
            failures += 1
            if failures > RECONNECTS or self.stopped:
                break
            LOGGER.warning("%s: no frame; opening it again (%d of %d)", self.source, failures, RECONNECTS)
            self.capture.release()
            time.sleep(min(0.5 * 2 ** failures, 4.0))
            if self.stopped:
                break
            self.capture = _open(self.target)
        self.capture.release()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def next_frame(self, after: int, timeout: float | None = None) -> tuple[int, np.ndarray] | None:
        """(number, frame) of the newest frame numbered above ``after``; None once the stream has ended or nothing
        new came for ``timeout`` seconds (FRAME_TIMEOUT)."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.count > after or self.ended,
                                         FRAME_TIMEOUT if timeout is None else timeout):
                return None  # nothing new for FRAME_TIMEOUT seconds
            if self.count > after:
                return self.count, self.frame
            return None

    def close(self) -> None:
        """Stop the reader; it releases the capture when its current read returns (module doc)."""
        self.stopped = True
        self.thread.join(timeout=5.0)


def _open(target: int | str) -> cv2.VideoCapture:
    """A webcam, or a stream whose reads wait at most FRAME_TIMEOUT seconds (OpenCV's own limit is 30 s)."""
    if isinstance(target, int):
        return cv2.VideoCapture(target)
    return cv2.VideoCapture(target, cv2.CAP_ANY, [cv2.CAP_PROP_READ_TIMEOUT_MSEC, int(FRAME_TIMEOUT * 1000)])


def open_streams(sources: list[str]) -> list[Stream]:
    """Every source opened now (a bad one is an error before any model work); none left open on an error."""
    streams = []
    try:
        for source in sources:
            streams.append(Stream(source))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


def read_streams(streams: list[Stream], vid_stride: int = 1) -> Iterator[tuple[int, int, np.ndarray]]:
    """(stream index, frame number among those yielded, frame) from every stream in turn until each has ended;
    ``vid_stride``: at least that many frames apart. The streams are closed however the iteration ends."""
    try:
        last, yielded, open_ = [0] * len(streams), [0] * len(streams), [True] * len(streams)
        while any(open_):
            for index, stream in enumerate(streams):
                if not open_[index]:
                    continue
                got = stream.next_frame(last[index] + vid_stride - 1)
                if got is None:
                    open_[index] = False
                    LOGGER.info("%s: stream ended after %d frames", stream.source, yielded[index])
                    continue
                last[index], image = got
                yielded[index] += 1
                yield index, yielded[index], image
    finally:
        for stream in streams:
            stream.close()


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
