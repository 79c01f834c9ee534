"""The one place that reads from the network: YOLOv5's named files (its v7.0 release weights) and URLs a user
gives. Nothing fetched is ever run: a download is a file like any other, loaded by the same checked loaders.

    weights_file("yolov5s.pt")         # the file if it exists, else YOLOv5's v7.0 release asset, into ./yolov5s.pt
    weights_file("w/yolov5n6.pt")      # into w/yolov5n6.pt (the folder made), as YOLOv5 does
    weights_file("https://host/a.pt")  # a URL: into ./a.pt (the URL's last segment; kept if already there)

``YOLO_TRAINER_MIRROR`` names a base URL (``http://host/path``) or a local folder from which the named files are
taken by file name instead of their home (an air-gapped site's copy; the tests' loopback server). URLs a user
gives are fetched as given.

A download goes to a temporary file beside the target (``.NAME.part``) and is renamed when complete and checked:
the HTTP status, an error page (an HTML body where a file was expected), the length the server announced (a
truncated transfer), YOLOv5's minimum size for weights (1e5 bytes), a maximum (2 GiB for weights, checked against
the announced length and as bytes arrive) and, for ``.pt``, the zip archive torch writes.
The server never chooses a name or a folder. Without network: one line with the URL and where to put the file.
"""
from __future__ import annotations

import http.client
import logging
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from utils.errors import UserError

LOGGER = logging.getLogger(__name__)

MIRROR_VARIABLE = "YOLO_TRAINER_MIRROR"
RELEASE = "https://github.com/ultralytics/yolov5/releases/download/v7.0/"
RELEASE_WEIGHTS = frozenset(f"yolov5{size}{p6}.pt" for size in "nsmlx" for p6 in ("", "6"))
MIN_WEIGHTS_BYTES = 100_000  # YOLOv5 counts a smaller weights file as a failed download
MAX_WEIGHTS_BYTES = 2 << 30  # yolov5x6.pt is 270 MB: a weights download past this is refused as it arrives
TIMEOUT = 30  # seconds without a byte before a download is given up
CHUNK = 1 << 20
ZIP_MAGIC = b"PK\x03\x04"
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")


class DownloadError(UserError):
    """A download that could not be made or was refused; one line naming the URL and what to do."""


def is_url(text: str) -> bool:
    return str(text).lower().startswith(("http://", "https://"))


def url_file_name(url: str) -> str:
    """The plain file name a URL's path ends with (query and fragment ignored); DownloadError when it has none
    or one that could steer where the file goes (a separator, '..', a leading dot or dash)."""
    name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
    if not SAFE_NAME.match(name) or ".." in name:
        raise DownloadError(f"{url}: the URL does not end with a plain file name to save it as (letters, digits, "
                            "'.', '_', '+', '-'): download it yourself and pass the file's path")
    return name


def weights_file(value) -> Path:
    """``--weights``/``path=`` as a file on disk: the path itself when it exists (a file or an export folder);
    a URL or a YOLOv5 release name is downloaded first (see the module doc); anything else is returned as it is,
    for the caller's own 'not found' message."""
    text = os.fspath(value)
    if is_url(text):
        target = Path(url_file_name(text))
        if target.exists():
            LOGGER.info("%s: using the existing %s", text, target)
            return target
        return fetch(text, target, what="weights", min_bytes=MIN_WEIGHTS_BYTES if target.suffix == ".pt" else 1,
                     max_bytes=MAX_WEIGHTS_BYTES, zip_archive=target.suffix == ".pt")
    path = Path(text)
    if path.exists() or path.name not in RELEASE_WEIGHTS:
        return path
    return fetch(RELEASE + path.name, path, what="YOLOv5 v7.0 release weights", min_bytes=MIN_WEIGHTS_BYTES,
                 max_bytes=MAX_WEIGHTS_BYTES, zip_archive=True, named=True)


def source_for(url: str) -> str:
    """Where a named file is taken from: ``url`` itself, or the same file name under YOLO_TRAINER_MIRROR."""
    mirror = os.environ.get(MIRROR_VARIABLE, "").strip()
    if not mirror:
        return url
    name = url_file_name(url)
    return f"{mirror.rstrip('/')}/{name}" if is_url(mirror) else str(Path(mirror).expanduser() / name)


def fetch(url: str, target: Path, what: str = "file", min_bytes: int = 1, max_bytes: int = MAX_WEIGHTS_BYTES,
          zip_archive: bool = False, named: bool = False) -> Path:
    """Download ``url`` (through the mirror when ``named``) into ``target``; the checks of the module doc."""
    source = source_for(url) if named else url
    target = Path(target)
    hint = f"put the file at {target.absolute()} yourself"
    if named:
        hint += f" (or set {MIRROR_VARIABLE} to a folder or server that has {target.name})"
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, part = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            if is_url(source):
                received = _http_copy(source, out, what, target, max_bytes, hint)
            else:
                received = _folder_copy(Path(source), out, max_bytes, hint)
        _check(source, Path(part), received, min_bytes, zip_archive, hint)
        os.replace(part, target)
    finally:
        Path(part).unlink(missing_ok=True)
    LOGGER.info("Downloaded %s to %s (%.1f MB)", source, target, received / 1e6)
    return target


def _http_copy(url: str, out, what: str, target: Path, max_bytes: int, hint: str) -> int:
    from tqdm import tqdm

    request = urllib.request.Request(url, headers={"User-Agent": "yolo-trainer"})
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT)  # redirects followed; the name stays ours
    except urllib.error.HTTPError as error:
        raise DownloadError(f"{url}: HTTP {error.code} {error.reason}; {hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise DownloadError(f"{url}: could not download ({reason}; no network?); {hint}") from None
    with response:
        kind = response.headers.get("Content-Type", "")
        if kind.split(";")[0].strip().lower() in ("text/html", "application/xhtml+xml"):
            raise DownloadError(f"{url}: the server sent a web page ({kind}), not the {what}; {hint}")
        announced = response.headers.get("Content-Length")
        announced = int(announced) if announced and announced.isdigit() else None
        if announced is not None and announced > max_bytes:
            raise DownloadError(f"{url}: {announced / 1e6:.0f} MB announced, more than the {max_bytes / 1e6:.0f} MB "
                                f"a {what} download may be; {hint}")
        received = 0
        with tqdm(total=announced, unit="B", unit_scale=True, unit_divisor=1024, desc=f"Downloading {target.name}",
                  disable=None, leave=False) as bar:
            try:
                while chunk := response.read(CHUNK):
                    received += len(chunk)
                    if received > max_bytes:
                        raise DownloadError(f"{url}: more than {max_bytes / 1e6:.0f} MB arrived, more than a {what} "
                                            f"download may be; {hint}")
                    out.write(chunk)
                    bar.update(len(chunk))
            except (OSError, ValueError, http.client.HTTPException) as error:  # a reset, a timeout, an early end
                raise DownloadError(f"{url}: the transfer broke off after {received} bytes ({error}); {hint}") \
                    from None
    if announced is not None and received != announced:
        raise DownloadError(f"{url}: truncated: {received} of {announced} bytes arrived; {hint}")
    return received


def _folder_copy(path: Path, out, max_bytes: int, hint: str) -> int:
    if not path.is_file():
        raise DownloadError(f"{path}: not in the mirror folder ${MIRROR_VARIABLE}; {hint}")
    if path.stat().st_size > max_bytes:
        raise DownloadError(f"{path}: larger than the {max_bytes / 1e6:.0f} MB a download may be; {hint}")
    with open(path, "rb") as source:
        shutil.copyfileobj(source, out, CHUNK)
    return path.stat().st_size


def _check(source: str, part: Path, received: int, min_bytes: int, zip_archive: bool, hint: str) -> None:
    with open(part, "rb") as file:
        head = file.read(512)
    if head.lstrip().lower().startswith((b"<!doctype html", b"<html")):
        raise DownloadError(f"{source}: the server sent a web page, not the file; {hint}")
    if received < min_bytes:
        raise DownloadError(f"{source}: only {received} bytes arrived (a file this small is a failed download); "
                            f"{hint}")
    if zip_archive and not head.startswith(ZIP_MAGIC):
        raise DownloadError(f"{source}: not a torch checkpoint (no zip archive); {hint}")


# ---------------------------------------------------------------------- archives
MAX_EXPANSION = 100  # an archive may unpack to at most this many times its own size (a zip bomb unpacks to more)
MAX_MEMBERS = 20_000_000


def check_zip(archive: Path, folder: Path) -> list:
    """The members of zip ``archive`` once each is safe to write under ``folder``: a relative path without '..',
    a drive or a NUL, no links; the declared total at most MAX_EXPANSION times the archive and within the free
    space of ``folder``'s file system. DownloadError (one line) otherwise; nothing is written."""
    import stat
    import zipfile

    try:
        with zipfile.ZipFile(archive) as opened:
            members = opened.infolist()
    except (zipfile.BadZipFile, OSError) as error:
        raise DownloadError(f"{archive}: not a readable zip archive ({error})") from None
    if len(members) > MAX_MEMBERS:
        raise DownloadError(f"{archive}: {len(members)} entries, more than {MAX_MEMBERS}")
    for member in members:
        name = member.filename
        parts = name.replace("\\", "/").split("/")
        if (not name or name.startswith(("/", "\\")) or "\0" in name or ".." in parts or ":" in parts[0]
                or stat.S_ISLNK(member.external_attr >> 16)):
            raise DownloadError(f"{archive}: entry {name[:200]!r} would be written outside the dataset folder or is "
                                "a link: the archive is refused")
    declared = sum(member.file_size for member in members)
    size = archive.stat().st_size
    if declared > MAX_EXPANSION * max(size, 1):
        raise DownloadError(f"{archive}: declares {declared / 1e6:.0f} MB from a {size / 1e6:.1f} MB archive "
                            f"(more than {MAX_EXPANSION}x: a zip bomb?): refused")
    free = shutil.disk_usage(folder).free
    if declared > free:
        raise DownloadError(f"{archive}: unpacks to {declared / 1e9:.2f} GB, {folder} has {free / 1e9:.2f} GB free")
    return members


def extract_zip(archive: Path, folder: Path) -> Path:
    """Unpack ``archive`` into a new temporary folder inside ``folder`` and return it (the caller moves what it
    holds into place): members checked first (``check_zip``); each file written no larger than its declared size
    (a header that lies is refused); a progress bar over the declared bytes."""
    import zipfile

    from tqdm import tqdm

    members = check_zip(archive, folder)
    target = Path(tempfile.mkdtemp(prefix=f".{archive.name}.", suffix=".unpack", dir=folder))
    try:
        with zipfile.ZipFile(archive) as opened, \
                tqdm(total=sum(m.file_size for m in members), unit="B", unit_scale=True, unit_divisor=1024,
                     desc=f"Unzipping {archive.name}", disable=None, leave=False) as bar:
            for member in members:
                path = target.joinpath(*member.filename.replace("\\", "/").split("/"))
                if member.is_dir():
                    path.mkdir(parents=True, exist_ok=True)
                    continue
                path.parent.mkdir(parents=True, exist_ok=True)
                written = 0
                with opened.open(member) as source, open(path, "xb") as out:
                    while chunk := source.read(CHUNK):
                        written += len(chunk)
                        if written > member.file_size:
                            raise DownloadError(f"{archive}: {member.filename[:200]!r} unpacks to more than its "
                                                "declared size: the archive is refused")
                        out.write(chunk)
                        bar.update(len(chunk))
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        shutil.rmtree(target, ignore_errors=True)
        raise DownloadError(f"{archive}: could not be unpacked ({error})") from None
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return target
