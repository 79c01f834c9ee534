"""Live and remote detect sources (utils/streams.py, utils/sources.py): an MJPEG stream and a .streams list served
on the loopback, read by a thread each until they end; an image URL downloaded first; a webcam and the screen where
this machine has none: one line each."""
from __future__ import annotations

import collections
import http.server
import itertools
import signal
import socket
import sys
import threading
import time
import weakref

import cv2
import numpy as np
import pytest

from tests.conftest import save_random_checkpoint
from utils import sources, streams
from utils.sources import SourceError, Sources, live_kind

FRAMES = 12
BITS = 10  # a numbered frame's number: 0 to 1023


def jpeg(index: int) -> bytes:
    image = np.full((48, 64, 3), 40, np.uint8)
    cv2.rectangle(image, (4 * index % 40, 8), (4 * index % 40 + 16, 30), (0, 200, 255), -1)
    return cv2.imencode(".jpg", image)[1].tobytes()


class Server(http.server.BaseHTTPRequestHandler):
    served: dict = {}  # path -> times served

    def do_GET(self):  # noqa: N802
        count = self.served.get(self.path, 0)
        self.served[self.path] = count + 1
        if self.path.startswith("/live") and count == 0:  # a stream that can be watched once, then is gone
            self.send_response(200)
            self.send_header("Content-Type", "multipart/x-mixed-replace; boundary=frame")
            self.end_headers()
            for index in range(FRAMES):
                body = jpeg(index)
                self.wfile.write(b"--frame\r\nContent-Type: image/jpeg\r\nContent-Length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body + b"\r\n")
            return
        if self.path == "/pictures/scene.jpg":
            body = jpeg(3)
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(streams, "RECONNECTS", 1)  # the test's streams are gone after one viewing
    Server.served = {}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def numbered(number: int) -> bytes:
    """A JPEG whose number ``frame_number`` reads back: bit i of it a white block in column i."""
    image = np.zeros((48, 64, 3), np.uint8)
    for bit in range(BITS):
        if number >> bit & 1:
            image[16:32, 2 + 6 * bit:8 + 6 * bit] = 255
    return cv2.imencode(".jpg", image)[1].tobytes()


def frame_number(image: np.ndarray) -> int:
    return sum(1 << bit for bit in range(BITS) if image[20:28, 3 + 6 * bit:7 + 6 * bit].mean() > 128)


class Camera:
    """An MJPEG camera on 127.0.0.1 whose every connection (counted in ``connections``) follows a plan: connection i
    (1-based) plans[i - 1], later ones 404. A plan is None (take the request, never answer) or (first, count, fps,
    then): frames numbered first, first + 1, ... at fps, then "close" the connection or "stall" (keep it, silent).
    With ``warmup``, each connection first sends that many frames numbered 0 at once (an open reads a few), then waits
    for ``go`` before its plan's frames."""

    def __init__(self, plans, warmup: int = 0):
        self.plans, self.warmup, self.connections = list(plans), warmup, 0
        self.go, self.release = threading.Event(), threading.Event()
        if not warmup:
            self.go.set()
        camera = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                camera.connections += 1
                if camera.connections > len(camera.plans):
                    self.send_error(404)
                    return
                plan = camera.plans[camera.connections - 1]
                if plan is None:
                    camera.release.wait()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "multipart/x-mixed-replace; boundary=frame")
                self.end_headers()
                try:
                    camera.serve(self.wfile, *plan)
                except OSError:  # the reader went away
                    return

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/live.mjpg"

    def serve(self, out, first: int, count: int, fps: float, then: str) -> None:
        for _ in range(self.warmup):
            self.send(out, 0)
        self.go.wait()
        start = time.monotonic()
        for index in range(count):
            time.sleep(max(0.0, start + index / fps - time.monotonic()))
            self.send(out, first + index)
        if then == "stall":
            self.release.wait()

    @staticmethod
    def send(out, number: int) -> None:
        body = numbered(number)
        out.write(b"--frame\r\nContent-Type: image/jpeg\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body + b"\r\n")
        out.flush()

    def stop(self) -> None:
        self.release.set()
        self.go.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def cameras():
    """``cameras(*plans, warmup=0)`` -> a Camera, stopped when the test ends."""
    made = []

    def make(*plans, warmup: int = 0) -> Camera:
        made.append(Camera(plans, warmup))
        return made[-1]

    yield make
    for camera in made:
        camera.stop()


@pytest.fixture
def quick(monkeypatch):
    """Short waits, in the proportions of the defaults: each step of a reader (a read, an open, a wait before
    reconnecting) shorter than FRAME_TIMEOUT, which the reconnects together outlast."""
    # twice what an idle machine needs (an open of the test camera takes ~0.1 s idle): a stall of a few tenths of a
    # second under a loaded CI machine's other processes must not end a step early
    for name, value in (("READ_TIMEOUT", 1.0), ("OPEN_TIMEOUT", 1.0), ("RECONNECT_WAIT", 0.6), ("FRAME_TIMEOUT", 3.0),
                        ("RECONNECTS", 2)):
        monkeypatch.setattr(streams, name, value)


def reader_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith(("stream ", "opening "))]


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("streams") / "tiny.pt", ["a", "b"], confident=True)


def test_the_kinds_of_source():
    assert [live_kind(s) for s in ("0", "rtsp://h/x", "rtmp://h/x", "http://h/live", "a.streams", "screen",
                                   "screen 0 10 10 64 64", "http://h/a.jpg", "https://h/v.mp4?x=1", "images/",
                                   "a.jpg")] == ["streams"] * 5 + ["screen"] * 2 + [None] * 4


def test_a_number_that_int_refuses_is_not_a_webcam_index(tmp_path, weights, capsys):
    """'½' and '²' are numeric to str.isnumeric (and '²' a digit to str.isdigit), but int() refuses them:
    '--source ½' was taken for a webcam and 'screen ²' for a screen number, each ended in a ValueError traceback.
    Webcam and screen numbers are ASCII digits."""
    import detect

    assert [live_kind(s) for s in ("12", "½", "²", "١", "0x1", "-1")] == ["streams"] + [None] * 5
    assert [streams.is_index(s) for s in ("0", "12", "½", "²", "١", " 1", "")] == [True, True] + [False] * 5
    with pytest.raises(SourceError, match="source not found: ½"):
        Sources("½")
    with pytest.raises(streams.StreamError, match="expected 'screen', 'screen N' or"):
        Sources("screen ²")
    assert detect.main(["--weights", str(weights), "--source", "²", "--project", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == ["detect.py: error: source not found: ²"]
    listing = tmp_path / "cams.streams"
    listing.write_text("½\n", encoding="utf-8")
    with pytest.raises(streams.StreamError, match="'½' is not a stream URL"):
        Sources(str(listing))


def test_a_stream_is_read_until_it_ends_and_written_as_a_video(server, weights, tmp_path):
    import detect

    found = detect.run(weights=str(weights), source=f"{server}/live.mjpg", imgsz=64, device="cpu",
                       project=str(tmp_path / "runs"), save_csv=True)
    frames = sorted(found.detections)
    assert 1 <= len(frames) <= FRAMES and all(key.startswith(f"{server}/live.mjpg:") for key in frames)
    rows = (found.save_dir / "predictions.csv").read_text().splitlines()
    detections = sum(len(found.detections[frame]) for frame in frames)
    # a stream's rows go under its output name, never its URL (which may hold credentials)
    assert len(rows) == 1 + detections > 1 and all(row.startswith("stream0,") for row in rows[1:])
    video = cv2.VideoCapture(str(found.save_dir / "stream0.mp4"))
    assert video.isOpened() and int(video.get(cv2.CAP_PROP_FRAME_COUNT)) == len(frames)
    video.release()
    assert Server.served["/live.mjpg"] == 2  # the stream ended, was opened again once (RECONNECTS), then given up


def test_a_streams_list_reads_each_in_its_own_thread(server, tmp_path):
    listing = tmp_path / "cams.streams"
    listing.write_text(f"# two cameras\n{server}/live1.mjpg\n{server}/live2.mjpg\n")
    sources = Sources(str(listing))
    seen = {}
    for item in sources:
        assert item.is_video and item.name in ("stream0", "stream1") and item.image.shape == (48, 64, 3)
        seen[item.name] = item.frame
    assert set(seen) == {"stream0", "stream1"} and all(1 <= count <= FRAMES for count in seen.values())
    assert not any(thread.name.startswith("stream ") for thread in threading.enumerate())  # readers stopped
    listing.write_text("not a url\n")
    with pytest.raises(streams.StreamError, match="is not a stream URL"):
        Sources(str(listing))


def test_an_image_url_is_downloaded_into_the_current_folder_then_detected(server, weights, tmp_path, monkeypatch):
    import detect

    monkeypatch.chdir(tmp_path)
    found = detect.run(weights=str(weights), source=f"{server}/pictures/scene.jpg", imgsz=64, device="cpu",
                       project=str(tmp_path / "runs"))
    assert (tmp_path / "scene.jpg").read_bytes() == jpeg(3) and list(found.detections) == ["scene.jpg"]
    with pytest.raises(SourceError.__mro__[1], match="HTTP 404"):
        Sources(f"{server}/pictures/gone.jpg")


def test_a_webcam_or_screen_this_machine_lacks_is_one_line(weights, tmp_path, capsys, monkeypatch):
    import detect

    monkeypatch.setattr(streams.cv2, "VideoCapture", lambda target: _Closed())
    assert detect.main(["--weights", str(weights), "--source", "0", "--project", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["detect.py: error: --source 0: cannot open webcam 0 (is a camera attached?)"]
    with pytest.raises(streams.StreamError, match="expected 'screen', 'screen N' or 'screen N left top width"):
        Sources("screen 0 1 2")
    assert streams.parse_screen("screen 1 10 20 300 200") == (1, {"left": 10, "top": 20, "width": 300,
                                                                   "height": 200})
    try:
        import mss  # noqa: F401
        expected = "no display to capture|does not exist"
    except ImportError:
        expected = r"screen capture needs the mss package \(pip install mss\)"
    monkeypatch.delenv("DISPLAY", raising=False)
    with pytest.raises(streams.StreamError, match=expected):
        next(iter(Sources("screen")))


def test_a_youtube_page_is_one_line_before_any_open(weights, tmp_path, capsys, monkeypatch):
    """YOLOv5's tutorial source 'https://youtu.be/...' is a web page: refused at once with what to do instead (it
    waited OPEN_TIMEOUT seconds, then said 'cannot open stream'), in a .streams list too; nothing is opened."""
    import detect

    opened = []
    monkeypatch.setattr(streams.cv2, "VideoCapture", lambda *args: opened.append(args) or _Closed())
    assert detect.main(["--weights", str(weights), "--source", "https://youtu.be/Zgi9g1ksQHc", "--project",
                        str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("detect.py: error: --source https://youtu.be/Zgi9g1ksQHc: https://"
                                               "youtu.be/Zgi9g1ksQHc is a YouTube page, not a video stream;")
    assert "download the video" in err[0]
    listing = tmp_path / "live.streams"
    listing.write_text("rtsp://127.0.0.1:9/cam\nhttps://www.youtube.com/watch?v=Zgi9g1ksQHc\n", encoding="utf-8")
    with pytest.raises(streams.StreamError, match=r"live.streams: https://www.youtube.com/watch\?v=\S+ is a YouTube "
                                                  "page"):
        Sources(str(listing))
    assert opened == [] and list(tmp_path.iterdir()) == [listing]
    assert streams.stream_urls("https://notyoutube.com/live") == ["https://notyoutube.com/live"]


class _Closed:
    def isOpened(self):  # noqa: N802 - OpenCV's name
        return False

    def release(self):
        pass


def test_a_stalled_stream_is_opened_again_and_read_on(cameras, quick, caplog):
    """A camera that stops sending with its connection open: the read times out (READ_TIMEOUT), the stream is opened
    again, the next connection is taken but never answered (the open times out), the one after serves frames again.
    The stream goes on with them: the reconnects take longer than FRAME_TIMEOUT in all, but each step less, and the
    stream is not given up meanwhile. (The read timeout was FRAME_TIMEOUT itself: the stream was given up when the
    read timed out, and never opened again.)"""
    caplog.set_level("INFO", logger="utils.streams")
    camera = cameras((1, 5, 20, "stall"), None, (6, 10, 20, "close"))
    start, seen = time.monotonic(), []
    for _, frame, image in streams.read_streams(streams.open_streams([camera.url])):
        seen.append(frame_number(image))
    assert time.monotonic() - start < 30
    assert seen == sorted(set(seen)) and seen[-1] == 15 and min(seen) <= 5 < 6 <= seen[-2]
    assert camera.connections == 5  # frames, silence, frames again, then two refusals: RECONNECTS = 2
    assert "opening it again (2 of 2)" in caplog.text and f"stream ended after {len(seen)} frames" in caplog.text
    assert wait_until(lambda: not reader_threads(), 5)


def test_each_stream_of_a_list_keeps_its_own_pace(cameras, monkeypatch):
    """A 20 fps and a 1 fps camera read together for 4 s: most frames of each are yielded, none twice. (Each
    stream was waited for in turn: the fast one ran at the slow one's rate, 12 frames each in 8 s.) The bounds
    leave room for a loaded machine: half the fast camera's 80 frames (the old code gave at most 12), the slow
    one's 4 but one."""
    monkeypatch.setattr(streams, "RECONNECTS", 0)
    seconds, rates = 4, (20, 1)
    fast, slow = (cameras((1, seconds * rate, rate, "close"), warmup=3) for rate in rates)
    opened = streams.open_streams([fast.url, slow.url])
    fast.go.set(), slow.go.set()
    seen = collections.defaultdict(list)
    for index, _, image in streams.read_streams(opened):
        seen[index].append(frame_number(image))
    for index, rate in enumerate(rates):
        numbers = [number for number in seen[index] if number]  # warm-up frames are numbered 0
        assert numbers == sorted(set(numbers)), index  # none twice, in order
        assert len(numbers) >= (seconds * rate / 2 if rate > 1 else seconds * rate - 1), (index, len(numbers))


def test_a_list_of_silent_servers_is_one_line_within_the_open_timeout(tmp_path, monkeypatch):
    """64 servers that take the connection and never answer: one StreamError line after OPEN_TIMEOUT (1 s here), not
    64 opens one after another (OpenCV's default open timeout is 30 s), and no connection left open."""
    monkeypatch.setattr(streams, "OPEN_TIMEOUT", 1.0)
    listeners = []
    try:
        for _ in range(streams.MAX_STREAMS):
            listeners.append(socket.create_server(("127.0.0.1", 0), backlog=4))
        listing = tmp_path / "silent.streams"
        listing.write_text("".join(f"http://127.0.0.1:{server.getsockname()[1]}/cam.mjpg\n" for server in listeners))
        start = time.monotonic()
        with pytest.raises(streams.StreamError) as raised:
            Sources(str(listing))
        assert time.monotonic() - start < 6
        assert len(str(raised.value).splitlines()) == 1 and "cannot open stream http://127.0.0.1:" in str(raised.value)
        assert wait_until(lambda: not reader_threads(), 3), reader_threads()
        connections = []
        for server in listeners:
            server.setblocking(False)
            while True:
                try:
                    connections.append(server.accept()[0])
                except BlockingIOError:
                    break
        assert 1 <= len(connections) <= 2  # the open that failed, and at most the one that had its turn meanwhile
        for connection in connections:
            connection.settimeout(5)
            while connection.recv(4096):  # the request, then the end: closed by the client
                pass
            connection.close()
    finally:
        for server in listeners:
            server.close()


def test_the_failed_stream_is_said_not_an_open_skipped_because_of_it(monkeypatch):
    """A failed open cancels its list before it releases its capture; an open that gets its turn meanwhile is
    skipped and ends first. The error said is still the failed stream's (the skipped one's 'the list could not be
    opened' was raised whenever its thread won that race: a CI run failed on it)."""
    opens = []

    class SlowToRelease:
        def __init__(self, target, *args):
            opens.append(target)

        def isOpened(self):
            return False

        def release(self):
            time.sleep(1.0)

    monkeypatch.setattr(streams.cv2, "VideoCapture", SlowToRelease)
    urls = ["http://127.0.0.1:9/a.mjpg", "http://127.0.0.1:9/b.mjpg"]
    with pytest.raises(streams.StreamError) as raised:
        streams.open_streams(urls)
    assert len(opens) == 1, opens  # the other open was skipped
    assert str(raised.value) == f"--source {opens[0]}: cannot open stream {opens[0]}"
    assert not isinstance(raised.value, streams.SkippedOpen)


def test_close_waits_for_a_reconnecting_reader_to_let_go(cameras, monkeypatch, caplog):
    """close() during the wait before a reconnect returns at once; during an open of a server that never answers it
    returns once the open has timed out and the capture is released; a reader still inside a read after close's
    wait is logged. (close waited 5 s, then returned while an open of up to 30 s went on, saying nothing.)"""
    monkeypatch.setattr(streams, "OPEN_TIMEOUT", 2.0)
    monkeypatch.setattr(streams, "RECONNECT_WAIT", 60.0)
    camera = cameras((1, 3, 20, "close"))
    caplog.set_level("WARNING", logger="utils.streams")
    stream, = streams.open_streams([camera.url])
    assert wait_until(lambda: "opening it again (1 of 3)" in caplog.text, 5)  # then a 60 s wait
    start = time.monotonic()
    stream.close()
    assert time.monotonic() - start < 3 and not stream.thread.is_alive()  # not the 60 s wait

    monkeypatch.setattr(streams, "RECONNECT_WAIT", 0.1)
    camera = cameras((1, 3, 20, "close"), None)
    stream, = streams.open_streams([camera.url])
    assert wait_until(lambda: camera.connections == 2, 5)  # opening the silent connection
    start = time.monotonic()
    stream.close()
    assert not stream.thread.is_alive() and time.monotonic() - start < streams.OPEN_TIMEOUT + 3

    monkeypatch.setattr(streams, "READ_TIMEOUT", 2.0)
    monkeypatch.setattr(streams, "CLOSE_MARGIN", -1.5)  # close waits 0.5 s: less than the read
    camera = cameras((1, 3, 20, "stall"))
    stream, = streams.open_streams([camera.url])
    time.sleep(0.3)  # the three frames read; the reader waits in a read
    stream.close()
    assert stream.thread.is_alive() and "still reading after" in caplog.text
    stream.thread.join(5)
    assert not stream.thread.is_alive()


class _Reply:
    """Stands for an mss screenshot's reply, which mss frees with a weakref finalizer."""


def test_a_ctrl_c_dropped_by_a_finalizer_still_ends_the_command_line(weights, tmp_path, monkeypatch, capsys):
    """Python drops a KeyboardInterrupt raised inside a finalizer ("Exception ignored in ..."), and mss frees every
    screenshot's reply in one: a Ctrl-C that landed there left ``detect.py --source screen`` capturing on (a CI run of
    test_the_command_line_captures_the_screen_until_interrupted timed out waiting for its exit). The command line notes
    the signal and ends before it detects another frame: exit 130, the frames before in the video. Here a finalizer
    run while the third frame is grabbed raises the SIGINT itself; a screen that is not stopped ends after 20 frames."""
    import detect

    grabbed = []

    def screen(text):
        for number in itertools.count(1):
            grabbed.append(number)
            if number == 3:
                weakref.finalize(_Reply(), signal.raise_signal, signal.SIGINT)  # the reply dies at once: Ctrl-C
            if number > 20:
                return
            yield np.full((48, 64, 3), 40, np.uint8)

    monkeypatch.setattr(sources, "read_screen", screen)
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(type(unraisable.exc_value)))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal starts it (pytest & ignores)
    try:
        code = detect.main(["--weights", str(weights), "--source", "screen", "--imgsz", "64", "--device", "cpu",
                            "--project", str(tmp_path / "runs")])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # detect.main put it back
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert dropped == [KeyboardInterrupt]  # Python did drop it
    assert (code, err.strip().splitlines()[-1], grabbed) == (130, "detect.py: interrupted", [1, 2, 3])
    video = cv2.VideoCapture(str(tmp_path / "runs" / "exp" / "screen.mp4"))
    assert int(video.get(cv2.CAP_PROP_FRAME_COUNT)) == 2
    video.release()
