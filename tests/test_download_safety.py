"""What a server can make a download do, on loopback servers: the names it may write (never a module), the files
it may leave (never a truncated or undecodable one), where it may redirect (only http(s), never https -> http),
the credentials and proxies a URL travels with, the leftovers of killed downloads, and the one-line errors."""
from __future__ import annotations

import base64
import fcntl
import logging
import hashlib
import http.server
import io
import os
import socket
import stat
import threading
import time
import urllib.request
import zipfile

import cv2
import numpy as np
import pytest

from utils import downloads, files
from utils.downloads import DownloadError, weights_file


class Handler(http.server.BaseHTTPRequestHandler):
    """Routes: path -> function(handler) that answers; every request's path and headers are kept."""
    routes: dict = {}
    seen: list = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.seen.append((self.command, self.path, dict(self.headers)))
        route = self.routes.get(self.path)
        if route is None:
            self.send_error(404)
            return
        route(self)

    do_CONNECT = do_GET  # a proxy's tunnel request

    def log_message(self, *args):
        pass


def serve(body: bytes, length: bool = True, kind: str = "application/octet-stream", status: int = 200,
          headers: dict | None = None):
    def answer(handler):
        handler.send_response(status)
        handler.send_header("Content-Type", kind)
        for key, value in (headers or {}).items():
            handler.send_header(key, value)
        if length:
            handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return answer


class Server:
    def __init__(self):
        handler = type("Routes", (Handler,), {"routes": {}, "seen": []})
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.routes, self.seen = handler.routes, handler.seen
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    made = Server()
    yield made
    made.close()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(downloads.MIRROR_VARIABLE, raising=False)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "ALL_PROXY",
                 "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.fixture(scope="session")
def checkpoint(yolov5_lookalike) -> bytes:
    return yolov5_lookalike.checkpoint.read_bytes()


def entries(folder):
    return sorted(path.name for path in folder.iterdir())


# ---------------------------------------------------------------------- names (finding 1)

@pytest.mark.parametrize("name", ["torch.py", "sitecustomize.pth", "run.sh", "model.torchscript", "weights",
                                  "numpy.so"])
def test_a_weights_url_never_writes_a_module_or_a_script(server, workdir, name):
    server.routes[f"/{name}"] = serve(b"import os\n" * 20_000)
    with pytest.raises(DownloadError, match=rf"'{name}' is not a model file name \(one of \.pt, \.onnx") as error:
        weights_file(f"{server.base}/{name}")
    assert "\n" not in str(error.value)
    assert entries(workdir) == [] and server.seen == []  # refused before any request


def test_a_source_url_and_a_hub_path_take_only_their_own_suffixes(server, workdir):
    import hubconf
    from utils.errors import UserError
    from utils.sources import resolve_source

    with pytest.raises(DownloadError, match="'evil.py' is not a image or video file name"):
        resolve_source(f"{server.base}/x/evil.py")
    with pytest.raises(UserError, match=r"'model' is not a model file name") as error:
        hubconf.custom(path=f"{server.base}/models/model")  # no suffix: was mangled into 'http:/127...model.pt'
    assert str(error.value).startswith(f"{server.base}/models/model:")
    assert entries(workdir) == [] and server.seen == []


# ---------------------------------------------------------------------- complete and usable (findings 2, 4)

def test_a_checkpoint_cut_short_without_a_length_is_not_kept_and_is_fetched_again(server, workdir, checkpoint):
    server.routes["/yolov5s.pt"] = serve(checkpoint[:200_000], length=False)
    with pytest.raises(DownloadError, match="not a torch checkpoint .*not kept"):
        weights_file(f"{server.base}/yolov5s.pt")
    assert entries(workdir) == []
    server.routes["/yolov5s.pt"] = serve(checkpoint, length=False)  # the next run fetches it again, whole
    assert weights_file(f"{server.base}/yolov5s.pt").read_bytes() == checkpoint
    assert len(server.seen) == 2


def test_a_checkpoint_with_a_damaged_member_is_not_kept(server, workdir, checkpoint):
    with zipfile.ZipFile(io.BytesIO(checkpoint)) as archive:
        largest = max(archive.infolist(), key=lambda member: member.file_size)
        header = checkpoint[largest.header_offset:largest.header_offset + 30]
        start = largest.header_offset + 30 + int.from_bytes(header[26:28], "little") + \
            int.from_bytes(header[28:30], "little")
    damaged = bytearray(checkpoint)
    damaged[start + largest.compress_size // 2] ^= 0xFF  # torch stores members uncompressed: only the CRC tells
    server.routes["/damaged.pt"] = serve(bytes(damaged))
    with pytest.raises(DownloadError, match="bad CRC|corrupt|not kept"):
        weights_file(f"{server.base}/damaged.pt")
    assert entries(workdir) == []


def test_a_checkpoint_that_is_a_zip_but_not_a_checkpoint_is_not_kept(server, workdir, tmp_path_factory):
    other = tmp_path_factory.mktemp("zip") / "a.zip"
    with zipfile.ZipFile(other, "w") as archive:
        archive.writestr("readme.txt", os.urandom(150_000))
    server.routes["/a.pt"] = serve(other.read_bytes())
    with pytest.raises(DownloadError, match="not usable"):
        weights_file(f"{server.base}/a.pt")
    assert entries(workdir) == []


@pytest.mark.parametrize("name", ["model.onnx", "model.tflite", "model.pte"])
def test_an_exported_model_cut_short_is_not_kept(server, workdir, name):
    server.routes[f"/{name}"] = serve(b"\x08\x07\x12\x0cpytorch" + os.urandom(5000), length=False)
    with pytest.raises(DownloadError, match="not usable .*not kept"):
        weights_file(f"{server.base}/{name}")
    assert entries(workdir) == []


def test_an_error_page_served_as_an_image_is_not_kept(server, workdir):
    from utils.sources import resolve_source

    server.routes["/x/bus.jpg"] = serve(b"Not Found", kind="text/plain")
    with pytest.raises(DownloadError, match="not an image that decodes"):
        resolve_source(f"{server.base}/x/bus.jpg")
    assert entries(workdir) == []
    ok, jpeg = cv2.imencode(".jpg", np.full((32, 48, 3), 127, np.uint8))
    server.routes["/x/bus.jpg"] = serve(jpeg.tobytes(), kind="image/jpeg")
    assert resolve_source(f"{server.base}/x/bus.jpg")[0].read_bytes() == jpeg.tobytes()
    server.routes["/x/clip.mp4"] = serve(b"\x00\x00\x00\x18ftypmp42" + bytes(3000))
    with pytest.raises(DownloadError, match="not a video whose frames decode"):
        resolve_source(f"{server.base}/x/clip.mp4")
    assert entries(workdir) == ["bus.jpg"]


def test_a_video_cut_short_without_a_length_is_not_kept(server, workdir, tmp_path_factory):
    """A server that announces no length and closes early leaves a video whose first frames decode: its last
    frame (by the container's count) is read too, and the file is not kept; whole, it is kept."""
    from utils.sources import resolve_source

    made = tmp_path_factory.mktemp("source") / "made.avi"
    writer = cv2.VideoWriter(str(made), cv2.VideoWriter_fourcc(*"MJPG"), 30, (64, 48))
    for i in range(30):
        writer.write(np.random.default_rng(i).integers(0, 255, (48, 64, 3), dtype=np.uint8))
    writer.release()
    whole = made.read_bytes()
    server.routes["/v/clip.avi"] = serve(whole[: len(whole) * 9 // 10], length=False)
    with pytest.raises(DownloadError, match="a video cut short: its frame 30 of 30 does not decode"):
        resolve_source(f"{server.base}/v/clip.avi")
    assert entries(workdir) == []
    server.routes["/v/clip.avi"] = serve(whole, length=False)
    assert resolve_source(f"{server.base}/v/clip.avi")[0].read_bytes() == whole


def test_a_sha256_in_the_url_is_checked_on_download_and_on_reuse(server, workdir, checkpoint):
    server.routes["/w.pt"] = serve(checkpoint)
    right, wrong = hashlib.sha256(checkpoint).hexdigest(), "0" * 64
    with pytest.raises(DownloadError, match="SHA-256 of what arrived is not the 000000000000"):
        weights_file(f"{server.base}/w.pt#sha256={wrong}")
    assert entries(workdir) == []
    assert weights_file(f"{server.base}/w.pt#sha256={right.upper()}").read_bytes() == checkpoint
    assert weights_file(f"{server.base}/w.pt#sha256={right}").read_bytes() == checkpoint  # reused, checked
    with pytest.raises(DownloadError, match="exists, and its SHA-256 is not"):
        weights_file(f"{server.base}/w.pt#sha256={wrong}")
    assert len(server.seen) == 2


# ---------------------------------------------------------------------- redirects, credentials, proxies (2, 3)

def test_a_redirect_to_ftp_is_refused_without_connecting(server, workdir):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    server.routes["/w.pt"] = serve(b"", status=302, headers={"Location": f"ftp://127.0.0.1:{port}/w.pt"})
    try:
        with pytest.raises(DownloadError, match="redirected to a ftp:// address; only http\\(s\\) redirects"):
            weights_file(f"{server.base}/w.pt")
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing connected to the FTP port
    finally:
        listener.close()
    assert entries(workdir) == []


def test_redirects_never_go_from_https_down_to_http():
    handler = downloads._Redirects()
    request = urllib.request.Request("https://weights.example/w.pt")
    with pytest.raises(DownloadError, match="redirected from https down to http"):
        handler.redirect_request(request, None, 302, "Found", {}, "http://weights.example/w.pt")
    upgraded = handler.redirect_request(urllib.request.Request("http://a.example/w.pt"), None, 302, "Found", {},
                                        "https://b.example/w.pt")
    assert upgraded.full_url == "https://b.example/w.pt"


def test_credentials_go_to_their_host_only_and_are_never_printed(server, workdir, checkpoint):
    other = Server()
    try:
        port = other.httpd.server_address[1]
        other.routes["/w.pt"] = serve(checkpoint)
        server.routes["/w.pt"] = serve(b"", status=302, headers={"Location": f"http://localhost:{port}/w.pt"})
        url = f"http://alice:s3cr%40t@{server.base.removeprefix('http://')}"
        assert weights_file(f"{url}/w.pt").read_bytes() == checkpoint
        sent = server.seen[0][2].get("Authorization")
        assert sent == "Basic " + base64.b64encode(b"alice:s3cr@t").decode()
        assert "Authorization" not in other.seen[0][2]  # another host: the credentials stay behind
        with pytest.raises(DownloadError) as error:
            weights_file(f"{url}/missing.pt")
        assert "s3cr" not in str(error.value) and "alice" not in str(error.value)
        assert str(error.value).startswith(f"http://***@{server.base.removeprefix('http://')}/missing.pt: HTTP 404")
    finally:
        other.close()


def test_credentials_stay_with_their_port_and_out_of_opt_yaml_and_logs(caplog):
    """A redirect to another port of the same host (another server) drops the Authorization header; a --weights
    URL with credentials is stored (opt.yaml, checkpoints, trackers) and logged without them."""
    from utils.config import TrainConfig
    from utils.trainer.resume import with_absolute_paths

    handler = downloads._Redirects()
    for target, kept in (("http://h.example:8081/w.pt", False), ("http://h.example:8080/x.pt", True),
                         ("https://h.example:8080/w.pt", False)):
        request = urllib.request.Request("http://h.example:8080/w.pt", headers={"Authorization": "Basic YTpi"})
        redirected = handler.redirect_request(request, None, 302, "Found", {}, target)
        assert redirected.has_header("Authorization") == kept, target
    default = urllib.request.Request("https://h.example/w.pt", headers={"Authorization": "Basic YTpi"})
    assert handler.redirect_request(default, None, 302, "Found", {}, "https://h.example:443/v.pt").has_header(
        "Authorization")
    secret = "https://alice:s3cr3t-token@models.example.com/a.pt"
    config = TrainConfig(weights=secret)
    assert config.weights == secret  # the run itself downloads with them
    stored = config.to_dict()
    assert stored["weights"] == "https://***@models.example.com/a.pt" and "s3cr3t" not in str(stored)
    with caplog.at_level(logging.INFO):
        with_absolute_paths(config)
    assert "--weights https://***@models.example.com/a.pt" in caplog.text and "s3cr3t" not in caplog.text


def test_the_proxy_variables_are_honoured(server, workdir, monkeypatch, checkpoint):
    server.routes["http://weights.invalid/w.pt"] = serve(checkpoint)  # a proxy is asked for the absolute URL
    monkeypatch.setenv("HTTP_PROXY", server.base)
    assert weights_file("http://weights.invalid/w.pt").read_bytes() == checkpoint
    monkeypatch.setenv("HTTPS_PROXY", server.base)
    with pytest.raises(DownloadError, match="could not download"):
        weights_file("https://weights.invalid/x.pt")  # the tunnel is refused (404): but it was asked for
    assert [(method, path) for method, path, _ in server.seen] == [("GET", "http://weights.invalid/w.pt"),
                                                                   ("CONNECT", "weights.invalid:443")]


# ---------------------------------------------------------------------- leftovers and modes (5, 6)

def test_a_killed_downloads_temp_file_is_removed_and_a_live_one_kept(server, workdir, checkpoint):
    stale = files.temp_path(workdir / "w.pt")
    stale.write_bytes(b"killed at 40%")
    handle, live = files.create_temp(workdir / "w.pt")  # another download of the same file, still running
    for path in (stale, live):
        os.utime(path, (time.time() - 120, time.time() - 120))
    try:
        server.routes["/w.pt"] = serve(checkpoint)
        weights_file(f"{server.base}/w.pt")
        assert not stale.exists() and live.exists()
    finally:
        os.close(handle)
    assert entries(workdir) == sorted(["w.pt", live.name])


def test_a_download_gets_the_mode_of_a_new_file(server, workdir, checkpoint):
    server.routes["/w.pt"] = serve(checkpoint)
    umask = os.umask(0o002)
    try:
        path = weights_file(f"{server.base}/w.pt")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o664  # a shared project folder: the group may read it


def test_no_process_wide_umask_change_is_left_in_the_code():
    """No call sets the umask to 0 (the window in which another thread's new file got mode 0666)."""
    import ast

    from tests.conftest import ROOT

    offenders = []
    for path in ROOT.rglob("*.py"):
        if "tests" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "umask"
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == 0):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


# ---------------------------------------------------------------------- one-line errors (11)

def test_a_target_that_cannot_be_written_is_one_line(server, workdir, monkeypatch, checkpoint):
    server.routes["/yolov5s.pt"] = serve(checkpoint)
    monkeypatch.setenv(downloads.MIRROR_VARIABLE, server.base)
    with pytest.raises(DownloadError, match=r"^http://.*/yolov5s.pt: cannot write in /proc \(") as error:
        weights_file("/proc/yolov5s.pt")
    assert "\n" not in str(error.value)
