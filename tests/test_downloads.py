"""utils/downloads.py against a server on the loopback: YOLOv5's release weights by name (through the mirror
variable), URLs as given, and every way a download can go wrong (an error page, a truncated transfer, a file too
small or not a checkpoint, no network): one line, nothing left behind, nothing loaded."""
from __future__ import annotations

import http.server
import threading

import pytest

from utils import downloads
from utils.downloads import DownloadError, weights_file



@pytest.fixture(scope="session")
def checkpoint_bytes(yolov5_lookalike) -> bytes:
    """A real checkpoint (YOLOv5's format, written by look-alike classes): a download is kept only once the
    checkpoint loader has read it."""
    return yolov5_lookalike.checkpoint.read_bytes()


class Routes(http.server.BaseHTTPRequestHandler):
    routes: dict = {}  # path -> (status, content type, body, announced length or None)

    def do_GET(self):  # noqa: N802 - http.server's name
        status, kind, body, announced = self.routes.get(self.path, (404, "text/html", b"<html>no</html>", None))
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body) if announced is None else announced))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Routes.routes = {}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Routes)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", Routes.routes
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(downloads.MIRROR_VARIABLE, raising=False)
    return tmp_path


def leftovers(folder):
    return sorted(p.name for p in folder.rglob("*") if ".tmp" in p.name or p.name.endswith(".part"))


def test_a_release_name_comes_from_the_mirror_into_the_path_given(checkpoint_bytes, server, workdir, monkeypatch):
    base, routes = server
    routes["/assets/yolov5n6.pt"] = (200, "application/octet-stream", checkpoint_bytes, None)
    monkeypatch.setenv(downloads.MIRROR_VARIABLE, base + "/assets/")
    assert weights_file("yolov5n6.pt") == workdir.joinpath("yolov5n6.pt").relative_to(workdir)
    assert (workdir / "yolov5n6.pt").read_bytes() == checkpoint_bytes
    assert weights_file("weights/yolov5n6.pt").read_bytes() == checkpoint_bytes  # the folder is made
    routes.clear()  # an existing file is never fetched again
    assert weights_file("yolov5n6.pt").read_bytes() == checkpoint_bytes
    assert weights_file("mine.pt").name == "mine.pt" and not (workdir / "mine.pt").exists()  # not a release name


def test_a_mirror_folder_and_the_release_address(checkpoint_bytes, workdir, monkeypatch, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mirror")
    (folder / "yolov5x.pt").write_bytes(checkpoint_bytes)
    monkeypatch.setenv(downloads.MIRROR_VARIABLE, str(folder))
    assert weights_file("yolov5x.pt").read_bytes() == checkpoint_bytes
    with pytest.raises(DownloadError, match="yolov5s.pt: not in the mirror folder"):
        weights_file("yolov5s.pt")
    monkeypatch.delenv(downloads.MIRROR_VARIABLE)
    assert downloads.source_for(downloads.RELEASE + "yolov5s.pt") == \
        "https://github.com/ultralytics/yolov5/releases/download/v7.0/yolov5s.pt"
    assert downloads.RELEASE_WEIGHTS == {f"yolov5{s}{p}.pt" for s in "nsmlx" for p in ("", "6")}


def test_a_mirror_folder_takes_a_file_at_its_urls_path_first(workdir, monkeypatch, tmp_path_factory):
    """Objects365.yaml's train and val patches share file names: a folder laid out as the URLs' paths (wget -x -nH)
    keeps them apart, a flat folder still serves by name, and a path that would leave the folder is not followed."""
    folder = tmp_path_factory.mktemp("mirror")
    base = "https://host.example/data-set/2020Objects365%E6%95%B0%E6%8D%AE%E9%9B%86/"
    train, val = base + "train/patch0.tar.gz", base + "val/images/v1/patch0.tar.gz"
    for url, body in ((train, b"train"), (val, b"val")):
        at = folder / "data-set" / "2020Objects365数据集" / url[len(base):]
        at.parent.mkdir(parents=True, exist_ok=True)
        at.write_bytes(body)
    (folder / "patch0.tar.gz").write_bytes(b"flat")
    (folder / "secret.pt").write_bytes(b"outside the URL's path")
    monkeypatch.setenv(downloads.MIRROR_VARIABLE, str(folder))
    for url, body in ((train, b"train"), (val, b"val"), (base + "test/patch0.tar.gz", b"flat")):
        target = workdir / "got" / url.replace("/", "_")
        assert downloads.fetch(url, target, named=True).read_bytes() == body
    assert downloads.source_for("https://h/a/%2E%2E/%2E%2E/secret.pt") == str(folder / "secret.pt")  # by name
    assert downloads.source_for("https://h/a%2F..%2F..%2Fx/secret.pt") == str(folder / "secret.pt")
    (folder / "a").mkdir()
    (folder / "a" / "yolov5s.pt").mkdir()  # a folder at the path is not a file: the name is taken
    assert downloads.source_for("https://h/a/yolov5s.pt") == str(folder / "yolov5s.pt")


def test_a_url_is_fetched_as_given_under_its_own_file_name(checkpoint_bytes, server, workdir):
    base, routes = server
    routes["/files/custom.pt?token=1"] = (200, "application/octet-stream", checkpoint_bytes, None)
    assert weights_file(base + "/files/custom.pt?token=1") == workdir.joinpath("custom.pt").relative_to(workdir)
    assert (workdir / "custom.pt").read_bytes() == checkpoint_bytes
    for bad in ("/files/", "/files/..%2F..%2Fevil.pt", "/files/.hidden.pt", "/files/a%2Fb.pt", "/files/a.pt%0A"):
        with pytest.raises(DownloadError, match="does not end with a plain file name"):
            weights_file(base + bad)
    assert sorted(p.name for p in workdir.iterdir()) == ["custom.pt"]


@pytest.mark.parametrize("route, message", [
    ((200, "text/html; charset=utf-8", b"<html>Sign in</html>" + bytes(200_000), None), "sent a web page"),
    ((200, "application/octet-stream", b"<!DOCTYPE html><html>" + bytes(200_000), None), "sent a web page"),
    ((404, "text/plain", b"Not Found", None), "HTTP 404"),
    ((200, "application/octet-stream", b"PK\x03\x04" + bytes(150_000), 5_000_000), "truncated|broke off"),
    ((200, "application/octet-stream", b"PK\x03\x04" + bytes(96), None), "only 100 bytes arrived"),
    ((200, "application/octet-stream", b"\x80\x02" + bytes(200_000), None), "not a torch checkpoint"),
    ((200, "application/octet-stream", b"PK", 3 << 30), "3221 MB announced, more than the 2147 MB"),
])
def test_a_bad_download_is_one_line_and_leaves_nothing(server, workdir, monkeypatch, route, message):
    base, routes = server
    routes["/yolov5s.pt"] = route
    monkeypatch.setenv(downloads.MIRROR_VARIABLE, base)
    with pytest.raises(DownloadError, match=message) as error:
        weights_file("yolov5s.pt")
    assert "\n" not in str(error.value)
    assert f"put the file at {workdir / 'yolov5s.pt'} yourself" in str(error.value)
    assert not (workdir / "yolov5s.pt").exists() and leftovers(workdir) == []


def test_no_network_says_where_to_put_the_file(workdir, monkeypatch):
    monkeypatch.setenv(downloads.MIRROR_VARIABLE, "http://127.0.0.1:9/")  # the discard port: nothing listens
    with pytest.raises(DownloadError, match=r"^http://127.0.0.1:9/yolov5m.pt: could not download \(.*no network\?\); "
                                            r"put the file at .*/yolov5m.pt yourself \(or set YOLO_TRAINER_MIRROR"):
        weights_file("yolov5m.pt")
    assert list(workdir.iterdir()) == []


def test_the_scripts_and_the_hub_fetch_release_weights_and_load_them_checked(server, workdir, monkeypatch,
                                                                            yolov5_lookalike, capsys):
    """YOLOv5's own commands with the file absent: detect.py and val.py --weights yolov5n.pt, the hub's
    custom(path='yolov5n') and yolov5n(); the file is the project's YOLOv5-format look-alike, served as the
    release asset, then loaded through the restricted unpickler like any file from elsewhere."""
    import detect
    import hubconf

    base, routes = server
    routes["/yolov5n.pt"] = (200, "application/octet-stream", yolov5_lookalike.checkpoint.read_bytes(), None)
    monkeypatch.setenv(downloads.MIRROR_VARIABLE, base)
    assert detect.main(["--weights", "yolov5n.pt", "--imgsz", "160", "--project", str(workdir / "runs")]) == 0
    assert (workdir / "yolov5n.pt").read_bytes() == yolov5_lookalike.checkpoint.read_bytes()
    assert len(list((workdir / "runs" / "exp").glob("shapes*.jpg"))) == 2  # the sample images in data/images
    (workdir / "yolov5n.pt").unlink()
    model = hubconf.custom(path="yolov5n")
    assert len(model.names) == 80 and (workdir / "yolov5n.pt").is_file()
    (workdir / "yolov5n.pt").unlink()
    assert len(hubconf.yolov5n().names) == 80
    routes.clear()
    (workdir / "yolov5n.pt").unlink()
    capsys.readouterr()
    assert detect.main(["--weights", "yolov5n.pt", "--project", str(workdir / "runs")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("detect.py: error: ") and "HTTP 404" in err[0]
