"""Zip and tar archives from elsewhere (dataset downloads, utils/data/dataset_download.py), unpacked into a
temporary folder that the caller moves into place.

``check_zip`` reads the entry count from the archive's end record before its directory is parsed (at most
MAX_MEMBERS), refuses a path outside the folder, a drive (on Windows), a NUL, '..' or a link, and a declared total
above MAX_EXPANSION times the archive or the folder's free space. ``extract_zip`` writes each member no larger than
its declared size. Every refusal is one DownloadError line; nothing is written before the checks pass.

A tar archive (``.tar``, ``.tar.gz``/``.tgz``, ``.tar.bz2``, ``.tar.xz``) has no directory to check first: it is
read once, in order, and ``extract_tar`` checks each member before writing it by the same rules (a relative path
without '..' or a NUL; only files and folders, so no links, devices or FIFOs; at most MAX_MEMBERS; the running total
at most MAX_EXPANSION times the archive and within the free space found at the start). A refusal removes the
temporary folder with what was written to it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from utils.downloads import CHUNK, DownloadError

MAX_EXPANSION = 100  # an archive may unpack to at most this many times its own size (a zip bomb unpacks to more)
MAX_MEMBERS = 20_000_000


def check_zip(archive: Path, folder: Path) -> list:
    """The members of zip ``archive`` once each is safe to write under ``folder``: a relative path without '..',
    a drive or a NUL, no links; the declared total at most MAX_EXPANSION times the archive and within the free
    space of ``folder``'s file system. DownloadError (one line) otherwise; nothing is written."""
    import stat
    import zipfile

    count = declared_members(archive)  # before zipfile parses a directory of any length
    if count is not None and count > MAX_MEMBERS:
        raise DownloadError(f"{archive}: {count} entries, more than {MAX_MEMBERS}")
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
        drive = os.name == "nt" and ":" in parts[0]  # 'C:x' is a drive on Windows, a legal name elsewhere
        if (not name or name.startswith(("/", "\\")) or "\0" in name or ".." in parts or drive
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


@contextlib.contextmanager
def _unpack_folder(archive: Path, folder: Path, broken: tuple):
    """A new temporary folder inside ``folder`` to unpack ``archive`` into, removed with what was written when the
    unpack fails or is refused; an error of the ``broken`` kinds becomes one DownloadError line."""
    target = Path(tempfile.mkdtemp(prefix=f".{archive.name}.", suffix=".unpack", dir=folder))
    try:
        yield target
    except broken as error:
        shutil.rmtree(target, ignore_errors=True)
        raise DownloadError(f"{archive}: could not be unpacked ({error})") from None
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise


def declared_members(archive: Path) -> int | None:
    """The entry count a zip's end-of-central-directory record declares (zip64's when it has one), read from the
    archive's last 64 KiB without parsing the directory; None when no record is found (zipfile then refuses it)."""
    import struct

    with open(archive, "rb") as file:
        file.seek(0, os.SEEK_END)
        size = file.tell()
        tail_start = max(0, size - (1 << 16) - 22)
        file.seek(tail_start)
        tail = file.read()
        end = tail.rfind(b"PK\x05\x06")
        if end < 0 or len(tail) - end < 22:
            return None
        count = struct.unpack_from("<H", tail, end + 10)[0]
        locator = end - 20
        if locator >= 0 and tail[locator:locator + 4] == b"PK\x06\x07":  # zip64: its own record holds the count
            offset = struct.unpack_from("<Q", tail, locator + 8)[0]
            file.seek(offset)
            record = file.read(56)
            if len(record) == 56 and record[:4] == b"PK\x06\x06":
                count = max(count, struct.unpack_from("<Q", record, 32)[0])
    return count


def extract_zip(archive: Path, folder: Path) -> Path:
    """Unpack ``archive`` into a new temporary folder inside ``folder`` and return it (the caller moves what it
    holds into place): members checked first (``check_zip``); each file written no larger than its declared size
    (a header that lies is refused); a progress bar over the declared bytes."""
    import zipfile

    from tqdm import tqdm

    members = check_zip(archive, folder)
    with _unpack_folder(archive, folder, (zipfile.BadZipFile, OSError, EOFError)) as target, \
            zipfile.ZipFile(archive) as opened, \
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
    return target


TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")


def is_tar_name(name: str) -> bool:
    return name.lower().endswith(TAR_SUFFIXES)


def extract_tar(archive: Path, folder: Path) -> Path:
    """Unpack tar ``archive`` into a new temporary folder inside ``folder`` and return it (module doc: each member
    checked as it comes; a refusal or a broken archive removes what was written); a progress bar over the bytes."""
    import tarfile

    from tqdm import tqdm

    size = archive.stat().st_size
    budget = min(MAX_EXPANSION * max(size, 1), shutil.disk_usage(folder).free)
    with _unpack_folder(archive, folder, (tarfile.TarError, OSError, EOFError, ValueError)) as target, \
            tarfile.open(archive, mode="r|*") as opened, \
            tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc=f"Unpacking {archive.name}", disable=None,
                 leave=False) as bar:
        total = count = 0
        for member in opened:
            count += 1
            total += member.size if member.isfile() else 0
            _check_tar_member(archive, member, count, total, size, budget, folder)
            path = target.joinpath(*[part for part in member.name.split("/") if part not in ("", ".")])
            if member.isdir():
                path.mkdir(parents=True, exist_ok=True)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            source = opened.extractfile(member)
            with source, open(path, "xb") as out:
                while chunk := source.read(CHUNK):
                    out.write(chunk)
                    bar.update(len(chunk))
    return target


def _check_tar_member(archive: Path, member, count: int, total: int, size: int, budget: int, folder: Path) -> None:
    """DownloadError (one line) unless ``member``, the ``count``-th with ``total`` bytes of files so far, may be
    written (module doc)."""
    name = member.name
    parts = name.split("/")
    if count > MAX_MEMBERS:
        raise DownloadError(f"{archive}: more than {MAX_MEMBERS} entries")
    if (not name or name.startswith("/") or "\0" in name or ".." in parts or not (member.isfile() or member.isdir())
            or all(part in ("", ".") for part in parts) and member.isfile()):
        raise DownloadError(f"{archive}: entry {name[:200]!r} would be written outside the dataset folder or is "
                            "not a file or folder (a link, a device): the archive is refused")
    if total > MAX_EXPANSION * max(size, 1):
        raise DownloadError(f"{archive}: unpacks to more than {total / 1e6:.0f} MB from a {size / 1e6:.1f} MB archive "
                            f"(more than {MAX_EXPANSION}x: a bomb?): refused")
    if total > budget:
        raise DownloadError(f"{archive}: unpacks to more than {total / 1e9:.2f} GB, {folder} had "
                            f"{budget / 1e9:.2f} GB free")
