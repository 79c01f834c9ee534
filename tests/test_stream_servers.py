"""Live sources read from real servers on the loopback, through detect (utils/streams.py): an RTSP stream served by
GStreamer's RTSP server, an RTMP stream served by ffmpeg, and ``screen`` capture of an Xvfb virtual display with mss.

Each server is a Debian package (mss a PyPI one); a test skips by name when its server is not installed. The servers
make their own pictures (a solid colour at a size no default would give), so a frame of the right size and colour
was decoded from the stream. Every server process is ended by its fixture, and a watchdog ends it sooner if a
test overruns, which makes the reader see the stream close: a hung stream cannot hang the suite.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.conftest import save_random_checkpoint
from utils import streams

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's python3-gi is for Debian's Python, not the project's venv
RTSP_PACKAGES = "python3-gi gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-base gstreamer1.0-plugins-good"
WIDTH, HEIGHT = 96, 64  # the served clips' size
WATCHDOG = 60.0  # seconds a test may run before its server is ended for it

# GStreamer's RTSP server on 127.0.0.1:PORT/live, serving LAUNCH (argv); exit 3: a piece of it is not installed.
RTSP_SERVER = """
import sys
try:
    import gi
    gi.require_version("Gst", "1.0")
    gi.require_version("GstRtspServer", "1.0")
    from gi.repository import GLib, Gst, GstRtspServer
except (ImportError, ValueError) as error:
    sys.exit(print("missing:", error) or 3)
Gst.init(None)
missing = [name for name in ("videotestsrc", "jpegenc", "rtpjpegpay") if Gst.ElementFactory.find(name) is None]
if missing:
    sys.exit(print("missing:", *missing) or 3)
server = GstRtspServer.RTSPServer()
server.set_address("127.0.0.1")
server.set_service(sys.argv[1])
factory = GstRtspServer.RTSPMediaFactory()
factory.set_launch(sys.argv[2])
factory.set_shared(True)
server.get_mount_points().add_factory("/live", factory)
if server.attach(None) == 0:
    sys.exit("cannot listen on port " + sys.argv[1])
print("ready", flush=True)
GLib.MainLoop().run()
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_listening(port: int, server: Server, timeout: float = 15.0) -> None:
    """Wait for a listening socket on 127.0.0.1:port without connecting to it (``ffmpeg -listen 1`` serves the first
    connection only)."""
    wanted = f"0100007F:{port:04X}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open("/proc/net/tcp", encoding="ascii") as table:
            if any(row.split()[1] == wanted and row.split()[3] == "0A" for row in list(table)[1:]):
                return
        if server.process.poll() is not None:
            pytest.fail(f"the server ended before listening: {server.errors()}")
        time.sleep(0.05)
    pytest.fail(f"nothing listened on port {port} within {timeout:.0f} s")


def stop(process: subprocess.Popen) -> None:
    """End a process (and its process group) that a test started; wait for it."""
    try:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            os.killpg(process.pid, signal.SIGCONT)  # a test may have stopped it
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
    except ProcessLookupError:  # ended meanwhile (the watchdog and a test may both stop it)
        pass
    if process.stdout:
        process.stdout.close()


class Server:
    """A server process, stopped by the fixture that made it, or by the watchdog after WATCHDOG seconds. Its stderr
    goes to a file (a full pipe would block it), read back by ``errors()``."""

    def __init__(self, command: list[str], **options):
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log,
                                        start_new_session=True, **options)
        self.watchdog = threading.Timer(WATCHDOG, self.stop)
        self.watchdog.daemon = True
        self.watchdog.start()

    def errors(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]

    def stop(self) -> None:
        self.watchdog.cancel()
        stop(self.process)


@pytest.fixture
def servers():
    """Start servers with ``servers(command)``; each is stopped when the test ends, however it ends."""
    started = []

    def start(command: list[str], **options) -> Server:
        started.append(Server(command, **options))
        return started[-1]

    yield start
    for server in started:
        server.stop()
        server.log.close()


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("servers") / "tiny.pt", ["a", "b"], confident=True)


@pytest.fixture
def quick_reconnects(monkeypatch):
    """One reconnect after a 1 s wait (3, and up to 7 s of waiting, by default), so an ended stream ends soon."""
    monkeypatch.setattr(streams, "RECONNECTS", 1)


def detect_options(weights: Path, source: str, tmp_path: Path) -> dict:
    """A tiny model on 64-pixel inputs; thin boxes without labels (at most 3) leave the frame's colour readable."""
    return {"weights": str(weights), "source": source, "imgsz": 64, "device": "cpu", "save_txt": True, "max_det": 3,
            "line_thickness": 1, "hide_labels": True, "project": str(tmp_path / "runs")}


def read_video(path: Path) -> list[np.ndarray]:
    video = cv2.VideoCapture(str(path))
    frames = []
    while True:
        ok, image = video.read()
        if not ok:
            break
        frames.append(image)
    video.release()
    return frames


def median_colour(frames: list[np.ndarray]) -> np.ndarray:
    return np.median(np.stack(frames).reshape(-1, 3), axis=0)


@pytest.fixture
def rtsp_server(servers):
    """(server, URL): GStreamer's RTSP server with a live red picture, JPEG over RTP (TCP, as OpenCV asks first), at
    50 frames a second (FFmpeg probes a stream by frames on opening: 0.5 s at that rate)."""
    if not Path(SYSTEM_PYTHON).exists():
        pytest.skip(f"RTSP server not installed: apt-get install {RTSP_PACKAGES}")
    port = free_port()
    launch = (f"( videotestsrc is-live=true pattern=red ! video/x-raw,format=I420,width={WIDTH},height={HEIGHT},"
              "framerate=50/1 ! jpegenc ! rtpjpegpay name=pay0 pt=26 )")
    server = servers([SYSTEM_PYTHON, "-c", RTSP_SERVER, str(port), launch])
    if server.process.stdout.readline().strip() != b"ready":
        if server.process.wait(10) == 3:
            pytest.skip(f"RTSP server not installed: apt-get install {RTSP_PACKAGES}")
        pytest.fail(f"the RTSP server did not start: {server.errors()}")
    return server, f"rtsp://127.0.0.1:{port}/live"


@pytest.fixture
def rtmp_server(servers):
    """(server, URL): ffmpeg as the RTMP server, sending a blue clip (H.264 in FLV, as cameras and OBS send it) to
    the first client 8x faster than real time, so that FFmpeg's 5 s of stream probing on opening takes 0.6 s."""
    if not shutil.which("ffmpeg"):
        pytest.skip("RTMP server not installed: apt-get install ffmpeg")
    port = free_port()
    url = f"rtmp://127.0.0.1:{port}/live/camera"
    server = servers(["ffmpeg", "-nostdin", "-v", "error", "-readrate", "8", "-f", "lavfi", "-i",
                      f"color=c=blue:size={WIDTH}x{HEIGHT}:rate=10", "-t", "120", "-c:v", "libx264", "-g", "10",
                      "-pix_fmt", "yuv420p", "-f", "flv", "-listen", "1", url])
    wait_until_listening(port, server)
    return server, url


def detect_until_the_server_stops(server: Server, url: str, weights: Path, tmp_path: Path, caplog,
                                  colour: tuple[int, int, int]) -> None:
    """Detect on a live stream; after 5 frames its server stops (the camera goes away): the reader reconnects once,
    is refused, and the run ends with every frame it yielded in the stream's video and labels."""
    import detect

    caplog.set_level("INFO", logger="utils.streams")
    found = []
    with detect.run(stream=True, **detect_options(weights, url, tmp_path)) as run:
        for image in run:
            found.append(image)
            if len(found) == 5:
                server.stop()
    assert len(found) >= 5 and [image.frame for image in found] == list(range(1, len(found) + 1))
    assert all(image.path == url and image.detections for image in found)
    video = read_video(run.save_dir / "stream0.mp4")
    assert len(video) == len(found) and video[0].shape == (HEIGHT, WIDTH, 3)
    assert np.allclose(median_colour(video), colour, atol=40)
    assert sorted(path.name for path in (run.save_dir / "labels").iterdir()) == sorted(
        f"stream0_{image.frame}.txt" for image in found)
    assert "opening it again (1 of 1)" in caplog.text and f"stream ended after {len(found)} frames" in caplog.text
    assert not any(thread.name.startswith("stream ") for thread in threading.enumerate())  # the reader let go


def test_an_rtsp_stream_is_read_and_written_until_its_server_stops(rtsp_server, weights, tmp_path, quick_reconnects,
                                                                    caplog):
    detect_until_the_server_stops(*rtsp_server, weights, tmp_path, caplog, colour=(0, 0, 255))  # red, in BGR


def test_an_rtmp_stream_is_read_and_written_until_its_server_stops(rtmp_server, weights, tmp_path, quick_reconnects,
                                                                    caplog):
    detect_until_the_server_stops(*rtmp_server, weights, tmp_path, caplog, colour=(255, 0, 0))  # blue, in BGR


def test_a_stalled_stream_ends_after_its_reconnects_and_its_reader_lets_go(rtsp_server, monkeypatch):
    """A camera that hangs with its connection open (its server stopped): the read times out (READ_TIMEOUT), so does
    the open of the reconnect (the stopped server's kernel takes the connection, nothing answers: OPEN_TIMEOUT), and
    the stream ends; its reader, blocked in that read and that open until their timeouts, releases the capture
    itself. (Released from the closing thread under that read, the capture crashed the process when the read timed
    out.)"""
    from utils.sources import Sources

    server, url = rtsp_server
    for name, value in (("READ_TIMEOUT", 1.0), ("RECONNECT_WAIT", 0.2), ("RECONNECTS", 1), ("FRAME_TIMEOUT", 2.0)):
        monkeypatch.setattr(streams, name, value)
    frames, stalled = 0, None
    for item in Sources(url):
        assert item.image.shape == (HEIGHT, WIDTH, 3)
        frames += 1
        if frames == 3:  # the first open had the default time (~0.5 s idle: within 1 s only on an idle machine)
            monkeypatch.setattr(streams, "OPEN_TIMEOUT", 1.0)  # the reconnect's open, read as it starts
            os.killpg(server.process.pid, signal.SIGSTOP)
            stalled = time.monotonic()
    assert frames >= 3 and time.monotonic() - stalled < 8  # the frames already sent, then 1 + 0.2 + 1 s of nothing
    deadline = time.monotonic() + 10
    while any(thread.name == f"stream {url}" for thread in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(thread.name == f"stream {url}" for thread in threading.enumerate())


# A 16x16 X bitmap, tiled over the root window by xsetroot: in every 16 columns, 8 foreground then 8 background.
STRIPES_XBM = ("#define stripes_width 16\n#define stripes_height 16\n"
               "static unsigned char stripes_bits[] = {\n" + ", ".join(["0xff, 0x00"] * 16) + "};\n")
GREEN, BLUE = (0, 255, 0), (255, 0, 0)  # BGR
SCREEN_WIDTH, SCREEN_HEIGHT = 160, 120


@pytest.fixture
def display(servers, tmp_path, monkeypatch):
    """An Xvfb display (a free number of its own choosing) whose root window shows green and blue stripes 8 pixels
    wide, green first; DISPLAY set to it."""
    if not (shutil.which("Xvfb") and shutil.which("xsetroot")):
        pytest.skip("virtual display not installed: apt-get install xvfb x11-xserver-utils")
    pytest.importorskip("mss", reason="screen capture needs mss: pip install mss")
    read_end, write_end = os.pipe()
    # -noreset: the root window keeps its background after xsetroot disconnects (it is the last client)
    server = servers(["Xvfb", "-displayfd", str(write_end), "-screen", "0", f"{SCREEN_WIDTH}x{SCREEN_HEIGHT}x24",
                      "-nolisten", "tcp", "-noreset"], pass_fds=(write_end,))
    os.close(write_end)
    with os.fdopen(read_end, "rb") as announced:
        number = announced.readline().strip().decode()  # written once the display accepts clients
    if not number.isdigit():
        pytest.fail(f"Xvfb did not start: {server.errors()}")
    monkeypatch.setenv("DISPLAY", f":{number}")
    (tmp_path / "stripes.xbm").write_text(STRIPES_XBM, encoding="ascii")
    subprocess.run(["xsetroot", "-bitmap", str(tmp_path / "stripes.xbm"), "-fg", "#00ff00", "-bg", "#0000ff"],
                   check=True, timeout=10)
    return f":{number}"


def test_the_screen_and_a_region_of_it_are_captured_as_shown(display):
    from utils.sources import Sources

    for source, shape, left in (("screen", (SCREEN_HEIGHT, SCREEN_WIDTH, 3), 0),
                                ("screen 1", (SCREEN_HEIGHT, SCREEN_WIDTH, 3), 0),
                                ("screen 0 4 2 64 48", (48, 64, 3), 4),
                                ("screen 1 8 0 64 48", (48, 64, 3), 8)):  # left, top, width, height
        items = iter(Sources(source))
        first, second = next(items), next(items)
        items.close()
        assert (first.name, first.frame, second.frame, first.is_video) == ("screen", 1, 2, True), source
        assert first.image.shape == shape and first.image.dtype == np.uint8, source
        expected = np.array([GREEN if (left + x) % 16 < 8 else BLUE for x in range(shape[1])], np.uint8)
        assert (first.image == expected[None]).all() and (second.image == first.image).all(), source


def test_detect_on_a_screen_region_writes_its_video_and_labels(display, weights, tmp_path):
    import detect

    with detect.run(stream=True, **detect_options(weights, "screen 0 0 0 64 64", tmp_path)) as run:
        found = list(itertools.islice(run, 3))  # a screen never ends: the caller stops it
    assert [(image.path, image.frame) for image in found] == [("screen 0 0 0 64 64", n) for n in (1, 2, 3)]
    video = read_video(run.save_dir / "screen.mp4")
    assert len(video) == 3 and video[0].shape == (64, 64, 3)
    assert sorted(path.name for path in (run.save_dir / "labels").iterdir()) == [f"screen_{n}.txt" for n in (1, 2, 3)]


def test_a_screen_region_outside_the_screen_is_one_line(display):
    from utils.sources import Sources

    with pytest.raises(streams.StreamError, match=r"screen 0 100 0 64 48: the region .* is not inside screen 0 "
                                                  rf"\({SCREEN_WIDTH}x{SCREEN_HEIGHT}"):
        next(iter(Sources("screen 0 100 0 64 48")))
    with pytest.raises(streams.StreamError, match=r"screen 2: screen 2 does not exist \(1 found\)"):
        next(iter(Sources("screen 2")))


def start_as_a_terminal_would(command: list[str], **options) -> subprocess.Popen:
    """Start ``command`` with SIGINT at its default action, as a terminal's shell starts a foreground job, so that
    Python turns SIGINT into KeyboardInterrupt. A process started with SIGINT ignored keeps ignoring it (POSIX), and
    Python then installs no handler for it; a non-interactive shell ignores SIGINT in the jobs it starts in the
    background (``pytest &`` in a CI script), and every process those start inherits that. Setting a handler here for
    the moment of the start is enough: exec resets a handled signal to its default action."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(command, **options)
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


def signal_set(pid: int, field: str) -> set[int]:
    """The signals of ``field`` in /proc/PID/status: SigIgn (ignored), SigBlk (blocked: the main thread's mask, which
    a child inherits from the thread that started it)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        mask = int(next(line for line in status if line.startswith(field + ":")).split()[1], 16)
    return {number for number in range(1, 65) if mask >> (number - 1) & 1}


def test_the_command_line_captures_the_screen_until_interrupted(display, weights, tmp_path):
    """The command line ends a screen (or a stream that never ends) with Ctrl-C: exit 130, the video finished. (With
    the suite run as a background job, detect.py was started with SIGINT ignored and ran on: start_as_a_terminal_would.
    A Ctrl-C that Python dropped in a finalizer left it running too: tests/test_streams.py tests that case alone.) Should
    it not end, its Python stacks (PYTHONFAULTHANDLER, on SIGABRT) are in the failure's message."""
    command = [sys.executable, "detect.py", "--weights", str(weights), "--source", "screen", "--imgsz", "64",
               "--device", "cpu", "--save-txt", "--project", str(tmp_path / "runs")]
    log = tmp_path / "detect.log"
    with open(log, "wb") as stderr:
        process = start_as_a_terminal_would(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=stderr, start_new_session=True,
                                            env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    try:
        assert signal.SIGINT not in signal_set(process.pid, "SigIgn") | signal_set(process.pid, "SigBlk")
        labels = tmp_path / "runs" / "exp" / "labels"
        deadline = time.monotonic() + 60
        # frame 4's labels: frame 3 is in the video (each frame's labels are written before its picture)
        while not (labels / "screen_4.txt").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.poll() is None, log.read_text()[-2000:]
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(30)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack to the log
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
            pytest.fail(f"still running 30 s after SIGINT; its log, its stacks last:\n{log.read_text()[-6000:]}")
        assert code == 130, log.read_text()[-2000:]
    finally:
        stop(process)
    assert log.read_text().splitlines()[-1] == "detect.py: interrupted"
    video = read_video(tmp_path / "runs" / "exp" / "screen.mp4")
    assert len(video) >= 3 and video[0].shape == (SCREEN_HEIGHT, SCREEN_WIDTH, 3)
    assert len(list(labels.glob("screen_*.txt"))) >= 4
