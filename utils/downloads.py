"""The one place that reads from the network: YOLOv5's named files (its v7.0 release weights, dataset archives) and
URLs a user gives. Nothing fetched is ever run: a download is a file like any other, loaded by the same checked
loaders, and it is kept only once the loader that will read it has opened it.

    weights_file("yolov5s.pt")         # the file if it exists, else YOLOv5's v7.0 release asset, into ./yolov5s.pt
    weights_file("w/yolov5n6.pt")      # into w/yolov5n6.pt (the folder made), as YOLOv5 does
    weights_file("https://host/a.pt")  # a URL: into ./a.pt (the URL's last segment; kept if already there)
    weights_file("https://host/a.pt#sha256=<64 hex digits>")  # ... and its SHA-256 checked (an existing file too)

``YOLO_TRAINER_MIRROR`` names a base URL (``http://host/path``) or a local folder from which the named files are
taken by file name instead of their home (an air-gapped site's copy; the tests' loopback server); a folder may
also hold a file at its URL's path, which is taken first (``source_for``). URLs a user
gives are fetched as given, through the proxy that HTTP_PROXY / HTTPS_PROXY / NO_PROXY name.

The server never chooses a name or a folder, and a name from the network must end in a suffix its reader takes
(``url_file_name``): a model file's (.pt, .onnx, .tflite, .pte, .engine; never a module, a script or TorchScript,
which runs code), an image's or video's, an archive's. A download goes to a temporary file beside the target
(utils/files.create_temp: locked by its writer, so a later start removes what a killed one left, never a live
download of another process) and takes its name only when complete and checked: the HTTP status, an error page
(an HTML body where a file was expected), the announced length (a truncated transfer), YOLOv5's minimum size for
weights (1e5 bytes), a maximum (checked against the announced length and as bytes arrive), the SHA-256 when given,
and then the reader: a checkpoint is opened whole (the zip's central directory, every member's CRC, then the
checkpoint loader), an exported model by its backend, an image or video decoded, an archive's directory read.
Redirects are followed only to http(s), never from https down to http, and credentials in a URL
(``https://user:token@host/...``) are sent only to that host and never printed. Dataset archives resume an
interrupted transfer with an HTTP Range request (If-Range on the server's ETag or Last-Modified) where the server
allows it. Without network: one line with the URL and where to put the file.
"""
from __future__ import annotations

import base64
import hashlib
import http.client
import json
import logging
import os
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable

from utils.errors import UserError

LOGGER = logging.getLogger(__name__)

MIRROR_VARIABLE = "YOLO_TRAINER_MIRROR"
RELEASE = "https://github.com/ultralytics/yolov5/releases/download/v7.0/"
RELEASE_WEIGHT_NAMES = tuple(f"yolov5{size}{p6}.pt" for p6 in ("", "6") for size in "nsmlx")  # n..x, then P6
RELEASE_WEIGHTS = frozenset(RELEASE_WEIGHT_NAMES)
# Single-file models the loaders read (models/backends.py), by the suffix a downloaded weights file may have.
# TorchScript is left out on purpose: loading it runs the code it holds. Folders (OpenVINO, NCNN, Core ML) are
# not single downloads.
MODEL_SUFFIXES = (".pt", ".onnx", ".tflite", ".pte", ".engine")
MIN_WEIGHTS_BYTES = 100_000  # YOLOv5 counts a smaller weights file as a failed download
MAX_WEIGHTS_BYTES = 2 << 30  # yolov5x6.pt is 270 MB: a weights download past this is refused as it arrives
MAX_MEDIA_BYTES = 4 << 30  # an image or video URL for detect.py
TIMEOUT = 30  # seconds without a byte before a download is given up
CHUNK = 1 << 20
ZIP_MAGIC = b"PK\x03\x04"
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")
SHA256 = re.compile(r"(?:^|&)sha256=([0-9a-fA-F]{64})(?:&|$)")


class DownloadError(UserError):
    """A download that could not be made or was refused; one line naming the URL and what to do."""


def is_url(text) -> bool:
    """THE test for a URL this module fetches (http or https)."""
    return str(text).strip().lower().startswith(("http://", "https://"))


def public_url(url: str) -> str:
    """``url`` as it may be printed: credentials (``user:token@``) replaced by ``***@``, the fragment dropped."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def without_credentials(value):
    """``value`` with the credentials of a URL in it replaced by ``***@`` (anything else as it is): for what is
    stored or shown of an option (opt.yaml, checkpoints, trackers, logs)."""
    if isinstance(value, str) and is_url(value) and "@" in urllib.parse.urlsplit(value).netloc:
        return public_url(value)
    if isinstance(value, (list, tuple)):
        return type(value)(without_credentials(item) for item in value)
    return value


def url_file_name(url: str, suffixes=None, what: str = "file") -> str:
    """The plain file name a URL's path ends with (query and fragment ignored); DownloadError when it has none,
    one that could steer where the file goes (a separator, '..', a leading dot or dash), or, with ``suffixes``,
    one whose suffix is not among them (a name from the network never becomes a module or a script)."""
    name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
    if not SAFE_NAME.fullmatch(name) or ".." in name:  # fullmatch: '$' alone lets a final newline through
        raise DownloadError(f"{public_url(url)}: the URL does not end with a plain file name to save it as (letters, "
                            "digits, '.', '_', '+', '-'): download it yourself and pass the file's path")
    if suffixes is not None and Path(name).suffix.lower() not in suffixes:
        raise DownloadError(f"{public_url(url)}: '{name}' is not a {what} file name (one of {', '.join(suffixes)}): "
                            "only those are downloaded; download it yourself and pass the file's path")
    return name


def expected_sha256(url: str) -> str | None:
    """The SHA-256 a URL's fragment asks for (``#sha256=HEX``), lower case; None without one."""
    match = SHA256.search(urllib.parse.urlsplit(url).fragment)
    return match.group(1).lower() if match else None


def download_here(url: str, suffixes, what: str, verify: Callable[[Path], None], max_bytes: int,
                  min_bytes: int = 1) -> Path:
    """THE 'URL to a file in the working folder': ``./NAME`` (the URL's own file name, its suffix among
    ``suffixes``), reused when it exists (its SHA-256 checked when the URL gives one), else downloaded and
    checked by ``verify`` before it takes the name."""
    target = Path(url_file_name(url, suffixes, what))
    digest = expected_sha256(url)
    if target.exists():
        if digest and file_sha256(target) != digest:
            raise DownloadError(f"{target.absolute()}: exists, and its SHA-256 is not the {digest[:12]}... that "
                                f"{public_url(url)} asks for: move it away to download it again")
        LOGGER.info("%s: using the existing %s", public_url(url), target)
        return target
    return fetch(url, target, what=what, min_bytes=min_bytes, max_bytes=max_bytes, verify=verify, sha256=digest)


def weights_file(value) -> Path:
    """``--weights``/``path=`` as a file on disk: the path itself when it exists (a file or an export folder);
    a URL or a YOLOv5 release name is downloaded first (see the module doc); anything else is returned as it is,
    for the caller's own 'not found' message."""
    text = os.fspath(value)
    if is_url(text):
        suffix = Path(urllib.parse.urlsplit(text).path).suffix.lower()
        return download_here(text, MODEL_SUFFIXES, "model", verify_model_file, MAX_WEIGHTS_BYTES,
                             MIN_WEIGHTS_BYTES if suffix == ".pt" else 1)
    path = Path(text)
    if path.exists() or path.name not in RELEASE_WEIGHTS:
        return path
    return fetch(RELEASE + path.name, path, what="YOLOv5 v7.0 release weights", min_bytes=MIN_WEIGHTS_BYTES,
                 max_bytes=MAX_WEIGHTS_BYTES, verify=verify_model_file, named=True)


def source_for(url: str) -> str:
    """Where a named file is taken from: ``url`` itself, or under YOLO_TRAINER_MIRROR: a server's file of the same
    name; in a folder, the file at the URL's path (``wget -x -nH``'s layout, which keeps apart the train and val
    archives of one name that Objects365.yaml lists) where there is one, else the file of the same name."""
    mirror = os.environ.get(MIRROR_VARIABLE, "").strip()
    if not mirror:
        return url
    name = url_file_name(url)
    if is_url(mirror):
        return f"{mirror.rstrip('/')}/{name}"
    folder = Path(mirror).expanduser()
    at_path = _mirror_path(folder, url)
    return str(at_path if at_path is not None and at_path.is_file() else folder / name)


def _mirror_path(folder: Path, url: str) -> Path | None:
    """``folder`` / the URL's path (percent-decoded), or None where a segment could leave the folder."""
    segments = [urllib.parse.unquote(part) for part in urllib.parse.urlsplit(url).path.split("/") if part]
    if any(part in (".", "..") or "/" in part or "\\" in part or "\0" in part for part in segments):
        return None
    return folder.joinpath(*segments)


# ---------------------------------------------------------------------- checks of a downloaded file

def verify_model_file(path: Path, complete: bool = True) -> None:
    """Open ``path`` with the loader that will read it: a checkpoint whole (``verify_checkpoint``), an exported
    model by its backend (models/backends.py). DownloadError's reason otherwise. (A verifier's ``complete``: False
    when the server announced no length, so the transfer's end was not checked; these read the file whole.)"""
    if path.suffix.lower() == ".pt":
        verify_checkpoint(path)
        return
    from models.backends import MissingPackage, load_backend

    try:
        load_backend(path, "cpu")
    except MissingPackage as error:
        raise ValueError(f"it cannot be checked here: {error}") from None
    except UserError as error:
        raise ValueError(str(error).replace(str(path), "the file")) from None


def verify_checkpoint(path: Path) -> None:
    """A torch checkpoint read whole: the zip's central directory, every member's CRC, then the checkpoint
    loader (utils/checkpoint: the restricted unpickler, every field checked)."""
    import zipfile

    from utils.checkpoint import load_checkpoint

    try:
        with zipfile.ZipFile(path) as archive:
            broken = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise ValueError(f"not a torch checkpoint (no complete zip archive: {error})") from None
    if broken is not None:
        raise ValueError(f"a damaged torch checkpoint (bad CRC in {broken[:100]!r})")
    try:
        load_checkpoint(path)
    except UserError as error:
        raise ValueError(str(error).replace(str(path), "the file")) from None


def verify_zip(path: Path, complete: bool = True) -> None:
    """An archive whose central directory reads (a truncated zip has none); members are checked as unpacked."""
    import zipfile

    try:
        with zipfile.ZipFile(path):
            pass
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise ValueError(f"not a complete zip archive ({error})") from None


def verify_media(path: Path, complete: bool = True) -> None:
    """An image that decodes (OpenCV refuses one cut short), or a video whose first frame does (an error page
    saved as bus.jpg does not); when the server announced no length (``complete`` False), also the last frame
    its container counts: a video cut short keeps its first frames."""
    import cv2

    from utils.data.images import IMG_EXTENSIONS, ImageError, read_image

    if path.suffix[1:].lower() in IMG_EXTENSIONS:
        try:
            read_image(path)
        except ImageError:
            raise ValueError("not an image that decodes") from None
        return
    capture = cv2.VideoCapture(str(path))
    try:
        ok, frame = capture.read() if capture.isOpened() else (False, None)
        if not ok or frame is None:
            raise ValueError("not a video whose frames decode")
        count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
        if not complete and count > 1:
            capture.set(cv2.CAP_PROP_POS_FRAMES, count - 1)
            ok, frame = capture.read()
            if not ok or frame is None:
                raise ValueError(f"a video cut short: its frame {count} of {count} does not decode (the server "
                                 "announced no length)")
    finally:
        capture.release()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------- the transfer

def fetch(url: str, target: Path, what: str = "file", min_bytes: int = 1, max_bytes: int = MAX_WEIGHTS_BYTES,
          verify: Callable[[Path], None] | None = None, named: bool = False, sha256: str | None = None,
          resumable: bool = False) -> Path:
    """Download ``url`` (through the mirror when ``named``) into ``target``; the checks of the module doc.
    ``verify(path)`` raises ValueError with the reason when the file is not what its reader takes. ``resumable``:
    a broken transfer keeps what arrived (``.NAME.partial``) and the next call asks the server for the rest; only
    for a caller that holds a lock on ``target``'s folder (utils/data/dataset_download.py)."""
    from utils.files import create_temp, remove_stale_temps

    source = source_for(url) if named else url
    shown = public_url(source)
    target = Path(target)
    hint = f"put the file at {target.absolute()} yourself"
    if named:
        hint += f" (or set {MIRROR_VARIABLE} to a folder or server that has {target.name})"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(target)  # what killed downloads of this file left (never a live one: utils/files.py)
        if resumable:
            part, handle = target.with_name(f".{target.name}.partial"), None
        else:
            handle, part = create_temp(target)
    except OSError as error:
        raise DownloadError(f"{shown}: cannot write in {target.parent.absolute()} "
                            f"({error.strerror or error}); {hint}") from None
    keep_part = False  # a resumable transfer that broke off keeps what arrived
    try:
        if is_url(source):
            transfer = Transfer(source, what, target, max_bytes, hint)
            try:
                received = transfer.run(part, handle, resumable)
            finally:
                keep_part = resumable and not transfer.complete
        else:
            with os.fdopen(os.dup(handle), "wb") as out:  # the handle itself stays open: it holds the lock
                received = _folder_copy(Path(source), out, max_bytes, hint)
        complete = not is_url(source) or transfer.announced is not None
        _check(shown, part, received, min_bytes, sha256, verify, hint, complete)
        os.replace(part, target)
    finally:
        if not keep_part:
            part.unlink(missing_ok=True)
            if resumable:
                _validator_path(part).unlink(missing_ok=True)
        if handle is not None:
            os.close(handle)  # after the rename: until then the lock keeps other processes from removing it
    LOGGER.info("Downloaded %s to %s (%.1f MB)", shown, target, received / 1e6)
    return target


def _validator_path(part: Path) -> Path:
    return part.with_name(part.name + ".json")


class _Redirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, but only to http(s), never from https down to http, and credentials (an Authorization
    header) only to the host they were given for."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        old, new = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        if new.scheme.lower() not in ("http", "https"):
            raise DownloadError(f"{public_url(req.full_url)}: redirected to a {new.scheme or 'relative'}:// address; "
                                "only http(s) redirects are followed")
        if old.scheme.lower() == "https" and new.scheme.lower() == "http":
            raise DownloadError(f"{public_url(req.full_url)}: redirected from https down to http "
                                f"({public_url(newurl)}); refused")
        request = super().redirect_request(req, fp, code, msg, headers, newurl)
        if request is not None and _origin(new) != _origin(old):  # another host, port or scheme
            request.remove_header("Authorization")
        return request


def _origin(parts: urllib.parse.SplitResult) -> tuple:
    """(scheme, host, port) with the scheme's default port: where credentials were given for."""
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


def _request(url: str, headers: dict) -> urllib.request.Request:
    """A GET for ``url`` with its credentials (``user:token@``) moved into a Basic Authorization header."""
    parts = urllib.parse.urlsplit(url)
    headers = {"User-Agent": "yolo-trainer", **headers}
    if parts.username is not None:
        secret = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(secret.encode()).decode()
        netloc = parts.netloc.rsplit("@", 1)[1]
        url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
    return urllib.request.Request(url, headers=headers)


class Transfer:
    """One HTTP download into a file: the request (proxies from the environment, checked redirects), the
    response's checks, the bytes with a progress bar; for a resumable one, the Range request and its validator."""

    def __init__(self, url: str, what: str, target: Path, max_bytes: int, hint: str):
        self.url, self.shown, self.what, self.target = url, public_url(url), what, target
        self.max_bytes, self.hint = max_bytes, hint
        self.complete, self.announced = False, None

    def run(self, part: Path, handle: int | None, resumable: bool) -> int:
        """Bytes in ``part`` once the transfer ended (all of them, or DownloadError)."""
        offset, headers = 0, {}
        if resumable:
            offset, headers = self._resume_point(part)
        response = self._open(headers)
        with response:
            status = getattr(response, "status", 200)
            if offset and status != 206:
                LOGGER.info("%s: the server sent the whole file again (no resume)", self.shown)
                offset = 0
            elif status == 206 and not response.headers.get("Content-Range", "").startswith(f"bytes {offset}-"):
                _validator_path(part).unlink(missing_ok=True)  # the next try starts over
                raise DownloadError(f"{self.shown}: asked for the bytes from {offset}, the server sent "
                                    f"{response.headers.get('Content-Range', 'no Content-Range')!r}; {self.hint}")
            announced = self.announced = self._announced(response, offset if status == 206 else 0)
            if resumable:
                _validator_path(part).write_text(json.dumps({"url": self.shown, "validator": _validator(response)}))
            if handle is None:  # resumable: the partial file, kept from an earlier try or new
                from utils.files import open_regular

                writer = open_regular(part, os.O_WRONLY | os.O_CREAT)
                os.ftruncate(writer, offset)
                os.lseek(writer, offset, os.SEEK_SET)
            else:
                writer = os.dup(handle)  # the caller's handle stays open: it holds the temp file's lock
            with os.fdopen(writer, "wb") as out:
                received = self._copy(response, out, offset, announced)
        if announced is not None and received != announced:
            raise DownloadError(f"{self.shown}: truncated: {received} of {announced} bytes arrived; {self.hint}")
        self.complete = True
        return received

    def _resume_point(self, part: Path) -> tuple[int, dict]:
        try:
            size = part.stat().st_size
            saved = json.loads(_validator_path(part).read_text())
        except (OSError, ValueError):
            return 0, {}
        if not size or saved.get("url") != self.shown or not saved.get("validator"):
            return 0, {}
        LOGGER.info("%s: resuming after %.1f MB", self.shown, size / 1e6)
        return size, {"Range": f"bytes={size}-", "If-Range": saved["validator"]}

    def _open(self, headers: dict):
        opener = urllib.request.build_opener(_Redirects)  # ProxyHandler from the environment comes by default
        try:
            return opener.open(_request(self.url, headers), timeout=TIMEOUT)
        except urllib.error.HTTPError as error:
            raise DownloadError(f"{self.shown}: HTTP {error.code} {error.reason}; {self.hint}") from None
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as error:
            reason = getattr(error, "reason", error)
            raise DownloadError(f"{self.shown}: could not download ({reason}; no network?); {self.hint}") from None

    def _announced(self, response, offset: int) -> int | None:
        """The total size the server announced (the bytes already here plus Content-Length); refused when it is
        a web page or more than the maximum."""
        kind = response.headers.get("Content-Type", "")
        if kind.split(";")[0].strip().lower() in ("text/html", "application/xhtml+xml"):
            raise DownloadError(f"{self.shown}: the server sent a web page ({kind}), not the {self.what}; {self.hint}")
        length = response.headers.get("Content-Length")
        announced = offset + int(length) if length and length.isdigit() else None
        if announced is not None and announced > self.max_bytes:
            raise DownloadError(f"{self.shown}: {announced / 1e6:.0f} MB announced, more than the "
                                f"{self.max_bytes / 1e6:.0f} MB a {self.what} download may be; {self.hint}")
        return announced

    def _copy(self, response, out, received: int, announced: int | None) -> int:
        from tqdm import tqdm

        with tqdm(total=announced, initial=received, unit="B", unit_scale=True, unit_divisor=1024,
                  desc=f"Downloading {self.target.name}", disable=None, leave=False) as bar:
            try:
                while chunk := response.read(CHUNK):
                    received += len(chunk)
                    if received > self.max_bytes:
                        raise DownloadError(f"{self.shown}: more than {self.max_bytes / 1e6:.0f} MB arrived, more "
                                            f"than a {self.what} download may be; {self.hint}")
                    out.write(chunk)
                    bar.update(len(chunk))
            except (OSError, ValueError, http.client.HTTPException) as error:  # a reset, a timeout, an early end
                out.flush()
                raise DownloadError(f"{self.shown}: the transfer broke off after {received} bytes ({error}); "
                                    f"{self.hint}") from None
        return received


def _validator(response) -> str | None:
    """What If-Range may name to resume this response: a strong ETag, else Last-Modified; None without either."""
    etag = response.headers.get("ETag")
    if etag and not etag.startswith("W/"):
        return etag
    return response.headers.get("Last-Modified")


def _folder_copy(path: Path, out, max_bytes: int, hint: str) -> int:
    if not path.is_file():
        raise DownloadError(f"{path}: not in the mirror folder ${MIRROR_VARIABLE}; {hint}")
    if path.stat().st_size > max_bytes:
        raise DownloadError(f"{path}: larger than the {max_bytes / 1e6:.0f} MB a download may be; {hint}")
    with open(path, "rb") as source:
        shutil.copyfileobj(source, out, CHUNK)
    return path.stat().st_size


def _check(shown: str, part: Path, received: int, min_bytes: int, sha256: str | None, verify, hint: str,
           complete: bool = True) -> None:
    with open(part, "rb") as file:
        head = file.read(512)
    if head.lstrip().lower().startswith((b"<!doctype html", b"<html")):
        raise DownloadError(f"{shown}: the server sent a web page, not the file; {hint}")
    if received < min_bytes:
        raise DownloadError(f"{shown}: only {received} bytes arrived (a file this small is a failed download); "
                            f"{hint}")
    if sha256 is not None and file_sha256(part) != sha256:
        raise DownloadError(f"{shown}: the SHA-256 of what arrived is not the {sha256[:12]}... the URL asks for; "
                            "not kept")
    if verify is not None:
        try:
            verify(part, complete)
        except ValueError as error:
            raise DownloadError(f"{shown}: the download is not usable ({error}); not kept; {hint}") from None
