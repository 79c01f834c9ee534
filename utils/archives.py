"""Zip and tar archives from elsewhere (dataset downloads, utils/data/dataset_download.py), unpacked into a
temporary folder that the caller moves into place.

``check_zip`` reads the entry count from the archive's end record before its directory is parsed (at most
MAX_MEMBERS), refuses a path outside the folder ('..' or a leading separator, '/' and '\\' alike; a drive in any
part, on Windows; a NUL), more than MAX_DEPTH levels deep, a link, an encrypted member or one compressed in a way
zipfile does not read, and a declared total above MAX_EXPANSION times the archive or the folder's free space.
``extract_zip`` writes each member no larger than its declared size. Every refusal is one DownloadError line naming
the archive; nothing is written before the checks pass.

A tar archive (``.tar``, ``.tar.gz``/``.tgz``, ``.tar.bz2``, ``.tar.xz``) has no directory to check first: it is
read once, in order, and ``extract_tar`` checks each member before writing it by the same rules (the same names;
only files and folders, so no links, devices or FIFOs; at most MAX_MEMBERS; the running total at most MAX_EXPANSION
times the archive and within the free space found at the start). The bytes decompressed are counted too (headers
included: at most MAX_EXPANSION times the archive in all, MAX_HEADER_BYTES for one member's headers, which tarfile
reads whole into memory), the compression's own end and checksum are read (a stream cut short would otherwise look
like an archive that ends early), and members are not kept once written. A refusal removes the temporary folder
with what was written to it.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from pathlib import Path

from utils.downloads import CHUNK, DownloadError
from utils.errors import one_line
from utils.paths import TAR_SUFFIXES

MAX_EXPANSION = 100  # an archive may unpack to at most this many times its own size (a zip bomb unpacks to more)
MAX_MEMBERS = 2_000_000  # COCO's train2017.zip has 118,287 entries; each costs zipfile ~0.5 KB of memory
ENTRY_BYTES = 4096  # the disk a file or folder takes however small (a block, an inode): counted against free space
MAX_DEPTH = 100  # parts of a member's path: datasets nest a few; pathlib's mkdir and shutil's rmtree recurse per part
MAX_HEADER_BYTES = 1 << 20  # one tar member's headers (GNU long names, PAX records, sparse maps); a path: 4 KiB
ZIP_METHODS = (0, 8, 12, 14)  # stored, deflated, bzip2, lzma: what zipfile decompresses
ZIP_ENCRYPTED = 0x01 | 0x40  # general purpose flags: encrypted, strongly encrypted (zipfile reads neither)


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
        if _outside(name) or stat.S_ISLNK(member.external_attr >> 16):
            raise DownloadError(f"{archive}: entry {name[:200]!r} would be written outside the dataset folder or is "
                                "a link: the archive is refused")
        _check_depth(archive, name)
        if member.flag_bits & ZIP_ENCRYPTED:
            raise DownloadError(f"{archive}: entry {name[:200]!r} is encrypted: the archive is refused")
        if member.compress_type not in ZIP_METHODS:
            raise DownloadError(f"{archive}: entry {name[:200]!r} uses compression method {member.compress_type}, "
                                "which is not unpacked here: the archive is refused")
    declared = sum(member.file_size for member in members)
    size = archive.stat().st_size
    if declared > MAX_EXPANSION * max(size, 1):
        raise DownloadError(f"{archive}: declares {declared / 1e6:.0f} MB from a {size / 1e6:.1f} MB archive "
                            f"(more than {MAX_EXPANSION}x: a zip bomb?): refused")
    free = shutil.disk_usage(folder).free
    if declared + ENTRY_BYTES * len(members) > free:  # a million empty entries still take a million blocks
        raise DownloadError(f"{archive}: unpacks to {(declared + ENTRY_BYTES * len(members)) / 1e9:.2f} GB "
                            f"({len(members)} entries), {folder} has {free / 1e9:.2f} GB free")
    return members


def _outside(name: str) -> bool:
    """Whether member ``name`` could be written outside the unpack folder, here or on Windows: empty, a leading
    separator, '..' between separators ('/' or '\\'), a NUL, or on Windows a drive in any part ('a/C:x' joins to
    'C:x' there; elsewhere 'C:x' is a legal name)."""
    parts = name.replace("\\", "/").split("/")
    drive = os.name == "nt" and any(":" in part for part in parts)
    return not name or name.startswith(("/", "\\")) or "\0" in name or ".." in parts or drive


def _check_depth(archive: Path, name: str) -> None:
    depth = sum(part not in ("", ".") for part in name.replace("\\", "/").split("/"))
    if depth > MAX_DEPTH:
        raise DownloadError(f"{archive}: entry {name[:200]!r} is {depth} levels deep, more than {MAX_DEPTH}: the "
                            "archive is refused")


@contextlib.contextmanager
def _unpack_folder(archive: Path, folder: Path, broken: tuple):
    """A new temporary folder inside ``folder`` to unpack ``archive`` into, removed with what was written when the
    unpack fails or is refused; an error of the ``broken`` kinds becomes one DownloadError line (cut short: an
    OSError's message holds the member's path, as long as the archive makes it)."""
    target = Path(tempfile.mkdtemp(prefix=f".{archive.name}.", suffix=".unpack", dir=folder))
    try:
        yield target
    except BaseException as error:
        shutil.rmtree(target, ignore_errors=True)
        if isinstance(error, broken) and not isinstance(error, DownloadError):  # a refusal is a ValueError too
            raise DownloadError(f"{archive}: could not be unpacked ({one_line(error, 300)})") from None
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
    import lzma
    import zipfile
    import zlib

    from tqdm import tqdm

    members = check_zip(archive, folder)
    broken = (zipfile.BadZipFile, OSError, EOFError, zlib.error, lzma.LZMAError)  # the last two: damaged data
    with _unpack_folder(archive, folder, broken) as target, \
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




def is_tar_name(name: str) -> bool:
    return name.lower().endswith(TAR_SUFFIXES)


def extract_tar(archive: Path, folder: Path) -> Path:
    """Unpack tar ``archive`` into a new temporary folder inside ``folder`` and return it (module doc: each member
    checked as it comes; a refusal or a broken archive removes what was written); a progress bar over the bytes."""
    from tqdm import tqdm

    size = archive.stat().st_size
    budget = shutil.disk_usage(folder).free  # the bytes and the entries' blocks; MAX_EXPANSION bounds the bytes
    with _unpack_folder(archive, folder, _tar_errors()) as target, _open_tar(archive) as (opened, stream), \
            tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc=f"Unpacking {archive.name}", disable=None,
                 leave=False) as bar:
        total = count = 0
        for member in _tar_members(opened, stream):
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
        while stream.read(CHUNK):  # to the compression's end and checksum: a stream cut short is refused
            pass
    return target


def verify_tar(path: Path, complete: bool = True) -> None:
    """A downloaded tar archive (compressed or not) whose first member's headers read, within the bound that
    ``extract_tar`` keeps (a header declaring megabytes is refused before it is read whole); ValueError (the
    download's check: it names the file itself) otherwise. Members are checked as they are unpacked, and a
    compressed stream cut short is found there (a gzip stream has no directory to read first)."""
    try:
        with _open_tar(path) as (opened, stream):
            next(_tar_members(opened, stream), None)
    except DownloadError as error:
        raise ValueError(str(error).removeprefix(f"{path}: ")) from None
    except _tar_errors() as error:
        raise ValueError(f"not a tar archive ({error})") from None


def _tar_errors() -> tuple:
    """What reading a broken tar archive raises: tarfile's errors, I/O, a stream cut short, damaged compressed data."""
    import lzma
    import tarfile
    import zlib

    return tarfile.TarError, OSError, EOFError, ValueError, zlib.error, lzma.LZMAError


@contextlib.contextmanager
def _open_tar(archive: Path):
    """(TarFile in stream mode, the ``_CountedStream`` it reads) of tar ``archive``, decompressed by ``_decompressed``."""
    import tarfile

    with open(archive, "rb") as file, _decompressed(file) as plain:
        stream = _CountedStream(plain, archive, archive.stat().st_size)
        with tarfile.open(fileobj=stream, mode="r|") as opened:
            yield opened, stream


def _decompressed(file):
    """The tar bytes of the open archive ``file``: a gzip, bzip2 or xz stream (known by its first bytes, as
    tarfile's 'r|*' knows them) through its module, which checks the stream's end and checksum; else ``file``."""
    import bz2
    import gzip
    import lzma

    head = file.read(10)
    file.seek(0)
    if head.startswith(b"\x1f\x8b\x08"):
        return gzip.GzipFile(fileobj=file, mode="rb")
    if head.startswith(b"BZh") and head[4:10] == b"1AY&SY":  # not a plain tar whose first file is BZh...
        return bz2.BZ2File(file)
    if head.startswith((b"\xfd7zXZ\x00", b"\x5d\x00\x00\x80")):  # xz, or lzma's older format
        return lzma.LZMAFile(file)
    return file


class _CountedStream:
    """The tar bytes of ``archive`` (``source``) as tarfile reads them, counted: DownloadError (one line) past
    MAX_EXPANSION times the archive's ``size`` (and MAX_HEADER_BYTES more: a tiny archive's headers and padding to
    10 KiB compress further) in all, or past ``header_end`` while a member's headers are read."""

    def __init__(self, source, archive: Path, size: int):
        self.source, self.archive, self.size = source, archive, size
        self.count = 0
        self.limit = MAX_EXPANSION * size + MAX_HEADER_BYTES
        self.header_end = MAX_HEADER_BYTES  # tarfile.open reads the first member's headers

    def read(self, size: int) -> bytes:
        data = self.source.read(size)
        self.count += len(data)
        if self.count > self.limit:
            raise _bomb(self.archive, self.count, self.size)
        if self.count > self.header_end:
            raise DownloadError(f"{self.archive}: an entry's header (a long name, PAX records, a sparse map) is "
                                f"larger than {MAX_HEADER_BYTES >> 10} KiB: the archive is refused")
        return data


def _tar_members(opened, stream: _CountedStream):
    """The members of tar ``opened`` in order, each one's headers read from at most MAX_HEADER_BYTES of ``stream``
    (a file's data is read before the next member), none kept: a TarFile lists each member it reads, and millions of
    empty entries (tens of MB of gzip) would hold gigabytes."""
    while True:
        stream.header_end = stream.count + MAX_HEADER_BYTES
        member = opened.next()
        stream.header_end = math.inf
        opened.members.clear()
        if member is None:
            if stream.count < opened.offset + 512:  # tar's end is a zero block; a file cut at a header has none
                raise DownloadError(f"{stream.archive}: ends without the tar end-of-archive block after "
                                    f"{opened.offset} bytes (cut short?): the archive is refused")
            return
        yield member


def _bomb(archive: Path, total: int, size: int) -> DownloadError:
    return DownloadError(f"{archive}: unpacks to more than {total / 1e6:.0f} MB from a {size / 1e6:.1f} MB archive "
                         f"(more than {MAX_EXPANSION}x: a bomb?): refused")


def _check_tar_member(archive: Path, member, count: int, total: int, size: int, budget: int, folder: Path) -> None:
    """DownloadError (one line) unless ``member``, the ``count``-th with ``total`` bytes of files so far, may be
    written (module doc)."""
    name = member.name
    parts = name.split("/")
    if count > MAX_MEMBERS:
        raise DownloadError(f"{archive}: more than {MAX_MEMBERS} entries")
    if (_outside(name) or not (member.isfile() or member.isdir())
            or all(part in ("", ".") for part in parts) and member.isfile()):
        raise DownloadError(f"{archive}: entry {name[:200]!r} would be written outside the dataset folder or is "
                            "not a file or folder (a link, a device): the archive is refused")
    _check_depth(archive, name)
    if total > MAX_EXPANSION * max(size, 1):
        raise _bomb(archive, total, size)
    if total + ENTRY_BYTES * count > budget:
        raise DownloadError(f"{archive}: unpacks to more than {(total + ENTRY_BYTES * count) / 1e9:.2f} GB "
                            f"({count} entries), {folder} had {budget / 1e9:.2f} GB free")
