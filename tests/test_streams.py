"""Live and remote detect sources (utils/streams.py, utils/sources.py): an MJPEG stream and a .streams list served
on the loopback, read by a thread each until they end; an image URL downloaded first; a webcam and the screen where
this machine has none: one line each."""
from __future__ import annotations

import http.server
import threading

import cv2
import numpy as np
import pytest

from tests.conftest import save_random_checkpoint
from utils import streams
from utils.sources import SourceError, Sources, live_kind

FRAMES = 12


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
                       project=str(tmp_path / "runs"))
    frames = sorted(found.detections)
    assert 1 <= len(frames) <= FRAMES and all(key.startswith(f"{server}/live.mjpg:") for key in frames)
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


class _Closed:
    def isOpened(self):  # noqa: N802 - OpenCV's name
        return False

    def release(self):
        pass
