"""utils/archives.py on hostile archives built in tmp_path: every refusal is one DownloadError line naming the
archive once, leaves no temporary folder, and comes before memory or disk grow with what the archive declares."""
from __future__ import annotations

import gzip
import io
import os
import struct
import tarfile
import tracemalloc
import zipfile
from pathlib import Path

import pytest

from utils import archives
from utils.data import dataset_download
from utils.downloads import DownloadError


def make_tar(path: Path, entries, mode: str = "w", format=tarfile.GNU_FORMAT) -> Path:
    """A tar of (TarInfo, bytes or None) ``entries``."""
    with tarfile.open(path, mode, format=format) as out:
        for info, data in entries:
            if data is not None:
                info.size = len(data)
            out.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def file_entry(name: str, data: bytes = b"x", **pax) -> tuple:
    info = tarfile.TarInfo(name)
    info.pax_headers = pax
    return info, data


def make_zip(path: Path, entries, method=zipfile.ZIP_DEFLATED) -> Path:
    with zipfile.ZipFile(path, "w", method) as out:
        for name, data in entries:
            out.writestr(name, data)
    return path


def refused(extract, archive: Path, folder: Path, match: str) -> str:
    """The one-line DownloadError ``extract`` raises for ``archive``; nothing is left in ``folder``."""
    before = set(folder.iterdir())
    with pytest.raises(DownloadError, match=match) as raised:
        extract(archive, folder)
    message = str(raised.value)
    assert "\n" not in message and message.count(str(archive)) == 1, message
    assert set(folder.iterdir()) == before  # the temporary unpack folder went with what was written
    return message


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "staging"
    path.mkdir()
    return path


# ----------------------------------------------------------------------------- tar: messages and names

def test_a_tar_refusal_names_the_archive_once_not_as_could_not_be_unpacked(tmp_path, folder):
    fifo = tarfile.TarInfo("fifo")
    fifo.type = tarfile.FIFOTYPE
    archive = make_tar(tmp_path / "f.tar", [file_entry("ok.txt"), (fifo, None)])
    message = refused(archives.extract_tar, archive, folder, "is not a file or folder")
    assert message.startswith(f"{archive}: entry 'fifo' ") and "could not be unpacked" not in message


@pytest.mark.parametrize("name", ["..\\..\\escaped.txt", "ok\\..\\..\\escaped.txt", "\\abs.txt"])
def test_a_tar_member_that_climbs_with_backslashes_is_refused_as_a_zip_member_is(tmp_path, folder, name):
    """Backslashes separate folders on Windows: tar names are checked by the zip rules."""
    archive = make_tar(tmp_path / "b.tar", [file_entry(name)])
    refused(archives.extract_tar, archive, folder, "outside the dataset folder")
    zipped = make_zip(tmp_path / "b.zip", [(name, b"x")])
    refused(archives.extract_zip, zipped, folder, "outside the dataset folder")


@pytest.mark.parametrize("name", ["C:escaped.txt", "ok/C:escaped.txt", "ok\\D:\\escaped.txt"])
def test_a_drive_in_any_part_of_a_member_name_is_refused_on_windows(tmp_path, monkeypatch, name):
    """On Windows 'ok/C:x' joins to C:x (another drive): any part with a drive is refused there."""
    zipped = make_zip(tmp_path / "d.zip", [(name, b"x")])
    with pytest.raises(DownloadError, match="outside the dataset folder"):
        with monkeypatch.context() as patch:  # os.name only around the check (pathlib reads it too)
            patch.setattr(os, "name", "nt")
            archives.check_zip(zipped, tmp_path)
    with pytest.raises(DownloadError, match="outside the dataset folder"):
        with monkeypatch.context() as patch:
            patch.setattr(os, "name", "nt")
            archives._check_tar_member(tmp_path / "d.tar", tarfile.TarInfo(name), 1, 1, 1 << 20, 1 << 30, tmp_path)


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_a_member_nested_deeper_than_the_bound_is_one_line_not_a_recursion_error(tmp_path, folder, kind):
    name = "a/" * 1500 + "f.txt"  # 3,005 characters: under PATH_MAX, deeper than Python's recursion limit
    if kind == "tar":
        archive, extract = make_tar(tmp_path / "deep.tar.gz", [file_entry(name)], "w:gz"), archives.extract_tar
    else:
        archive, extract = make_zip(tmp_path / "deep.zip", [(name, b"x")]), archives.extract_zip
    refused(extract, archive, folder, r"is 1501 levels deep, more than \d+")


def test_a_member_as_deep_as_the_bound_is_unpacked(tmp_path, folder):
    name = "a/" * (archives.MAX_DEPTH - 1) + "f.txt"
    target = archives.extract_tar(make_tar(tmp_path / "ok.tar", [file_entry(name, b"fine")]), folder)
    assert target.joinpath(*name.split("/")).read_bytes() == b"fine"


# ----------------------------------------------------------------------------- tar: headers, bombs, truncation

def _pax_comment(path: Path, size: int) -> Path:
    return make_tar(path, [file_entry("a.txt", b"a", comment="x" * size)], "w:gz", tarfile.PAX_FORMAT)


def _gnu_long_name(path: Path, size: int) -> Path:
    return make_tar(path, [file_entry("n" * size)], "w:gz")


def _old_gnu_sparse(path: Path, size: int) -> Path:
    """An old GNU sparse header ('S') followed by ``size`` bytes of extension blocks, all read as its map."""
    info = tarfile.TarInfo("sparse")
    info.type = tarfile.GNUTYPE_SPARSE
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[482] = 1  # isextended: another block of 21 (offset, size) pairs follows
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    block = bytearray(512)
    for index in range(21):
        block[index * 24:index * 24 + 24] = b"%011o\0%011o\0" % (index + 1, 1)
    block[504] = 1
    path.write_bytes(gzip.compress(bytes(header) + bytes(block) * (size // 512) + bytes(1536)))
    return path


@pytest.mark.parametrize("build", [_pax_comment, _gnu_long_name, _old_gnu_sparse])
def test_a_header_larger_than_the_bound_is_refused_while_it_is_read(tmp_path, folder, build):
    """A GNU long name, PAX records or an old GNU sparse map are read into memory whole before tarfile hands over
    the member: 16 MB of them (from a few kB of gzip) are refused after MAX_HEADER_BYTES, not held."""
    archive = build(tmp_path / "header.tar.gz", 16 << 20)
    tracemalloc.start()
    try:
        refused(archives.extract_tar, archive, folder, r"header \(.*\) is larger than \d+ KiB")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * archives.MAX_HEADER_BYTES, f"{peak / 1e6:.0f} MB held for a refused header"


@pytest.mark.parametrize("build", [_pax_comment, _gnu_long_name])
def test_the_download_check_of_a_tar_reads_its_first_header_within_the_bound(tmp_path, build):
    """verify_tar (a downloaded archive's check, before it is kept) reads the first member as extract_tar does: a
    header declaring 16 MB is refused after MAX_HEADER_BYTES, not read whole; a good archive passes."""
    archive = build(tmp_path / "header.tar.gz", 16 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"header \(.*\) is larger than \d+ KiB") as raised:
            archives.verify_tar(archive)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * archives.MAX_HEADER_BYTES, f"{peak / 1e6:.0f} MB held for a refused header"
    assert str(archive) not in str(raised.value)  # the download names the file itself
    archives.verify_tar(make_tar(tmp_path / "good.tar.gz", [file_entry("set/a.txt")], "w:gz"))
    with pytest.raises(ValueError, match="not a tar archive"):
        archives.verify_tar(make_zip(tmp_path / "not.tar.gz", [("a.txt", b"x")]))


def test_the_100x_bound_counts_the_bytes_decompressed_not_the_sizes_declared(tmp_path, folder):
    """Each PAX header under MAX_HEADER_BYTES, files of one byte: 8 MB decompressed from a few kB is a bomb."""
    entries = [file_entry(f"{index}.txt", b"x", comment="c" * (512 << 10)) for index in range(16)]
    archive = make_tar(tmp_path / "pax.tar.gz", entries, "w:gz", tarfile.PAX_FORMAT)
    assert archive.stat().st_size * archives.MAX_EXPANSION < 4 << 20
    refused(archives.extract_tar, archive, folder, "more than 100x: a bomb")


@pytest.mark.parametrize("mode", ["w:gz", "w:bz2", "w:xz"])
def test_a_compressed_tar_cut_short_is_refused_wherever_it_is_cut(tmp_path, folder, mode):
    """The decompressed stream of a cut archive may end between two members: tarfile then takes it for the end
    of the archive and a dataset would silently lack files. The compression's own end marker is required."""
    entries = [file_entry(f"set/labels/{index}.txt", f"{index} 0.5 0.5 0.1 0.1\n".encode() * 3)
               for index in range(20)]
    whole = make_tar(tmp_path / "whole.tar", entries, mode).read_bytes()
    archive = tmp_path / "cut.tar"
    for cut in range(len(whole) // 4, len(whole) - 1, max(len(whole) // 24, 1)):
        archive.write_bytes(whole[:cut])
        refused(archives.extract_tar, archive, folder, "could not be unpacked")


def test_the_tar_reader_keeps_no_list_of_every_member(tmp_path, folder, monkeypatch):
    """A TarFile appends each member it reads to .members: 20 million empty entries (tens of MB of gzip) would
    hold gigabytes."""
    folder_entry = tarfile.TarInfo("d")
    folder_entry.type = tarfile.DIRTYPE
    archive = make_tar(tmp_path / "many.tar.gz", [(folder_entry, None)] * 200, "w:gz")
    opened = []
    real_open = tarfile.open

    def recording_open(*args, **kwargs):
        opened.append(real_open(*args, **kwargs))
        return opened[-1]
    monkeypatch.setattr(tarfile, "open", recording_open)
    archives.extract_tar(archive, folder)
    assert len(opened) == 1 and len(opened[0].members) <= 1


def test_a_plain_tar_and_its_compressed_forms_unpack_alike(tmp_path, folder):
    """Each known by its first bytes (a plain tar's first bytes are a name: 'BZh.txt' is no bzip2 stream)."""
    entries = [file_entry("BZh.txt", b"alpha"), file_entry("set/sub/b.txt", b"beta" * 1000)]
    for mode in ("w", "w:gz", "w:bz2", "w:xz"):
        target = archives.extract_tar(make_tar(tmp_path / f"x.{mode[2:] or 'tar'}", entries, mode), folder)
        assert (target / "BZh.txt").read_bytes() == b"alpha"
        assert (target / "set" / "sub" / "b.txt").read_bytes() == b"beta" * 1000


def test_a_plain_tar_cut_at_a_header_is_refused_and_one_lone_zero_block_ends_it(tmp_path, folder):
    """A plain tar has no checksum of its own: cut between two members it would read as an archive that ends
    there, without the zero block tar writes at its end. One zero block (which GNU tar accepts) ends it."""
    entries = [file_entry(f"set/{index}.txt", b"x" * 700) for index in range(4)]
    whole = make_tar(tmp_path / "whole.tar", entries).read_bytes()
    member = 512 + 1024  # a header and 700 bytes padded to 1024
    archive = tmp_path / "cut.tar"
    for members in (1, 3, 4):
        archive.write_bytes(whole[:members * member])
        refused(archives.extract_tar, archive, folder, f"ends without the tar end-of-archive block after "
                                                       f"{members * member} bytes")
    archive.write_bytes(whole[:4 * member] + bytes(512))
    target = archives.extract_tar(archive, folder)
    assert sorted(path.name for path in (target / "set").iterdir()) == ["0.txt", "1.txt", "2.txt", "3.txt"]


# ----------------------------------------------------------------------------- zip: what zipfile cannot read

def _patched(archive: Path, local: int, central: int, value: bytes, mask: bool = False) -> Path:
    """``archive`` with ``value`` written (or OR-ed, ``mask``) at offset ``local`` of its first local header and
    ``central`` of its first central directory entry."""
    data = bytearray(archive.read_bytes())
    for start, offset in ((data.find(b"PK\x03\x04"), local), (data.find(b"PK\x01\x02"), central)):
        at = start + offset
        data[at:at + len(value)] = bytes(a | b for a, b in zip(data[at:], value)) if mask else value
    archive.write_bytes(bytes(data))
    return archive


@pytest.mark.parametrize("damage, match", [
    (lambda path: _patched(path, 6, 8, b"\x01", mask=True), "is encrypted"),  # general purpose flag bit 0
    (lambda path: _patched(path, 8, 10, struct.pack("<H", 99)), "compression method 99"),  # AES / unknown
])
def test_a_zip_member_zipfile_cannot_read_is_refused_before_writing(tmp_path, folder, damage, match):
    archive = damage(make_zip(tmp_path / "z.zip", [("a.txt", b"hello " * 100)]))
    refused(archives.extract_zip, archive, folder, match)


def test_a_zip_member_with_corrupt_deflate_data_is_one_line(tmp_path, folder):
    archive = make_zip(tmp_path / "z.zip", [("a.txt", b"hello world " * 100)])
    data = bytearray(archive.read_bytes())
    start = data.find(b"PK\x03\x04") + 30 + len("a.txt")
    data[start + 3:start + 20] = b"\xff" * 17  # inside the deflate stream
    archive.write_bytes(bytes(data))
    refused(archives.extract_zip, archive, folder, "could not be unpacked")


# ----------------------------------------------------------------------------- cases handled before (coverage)

@pytest.mark.filterwarnings("ignore:Duplicate name")
@pytest.mark.parametrize("kind", ["tar", "zip"])
@pytest.mark.parametrize("names", [["a.txt", "a.txt"], ["a", "a/b.txt"], ["a/b.txt", "a"]])
def test_duplicate_names_and_a_file_against_a_folder_are_refused(tmp_path, folder, kind, names):
    """Never overwrite what an earlier member wrote, nor mix up a file and a folder of one name."""
    if kind == "tar":
        archive, extract = make_tar(tmp_path / "dup.tar", [file_entry(name) for name in names]), archives.extract_tar
    else:
        archive, extract = make_zip(tmp_path / "dup.zip", [(name, b"x") for name in names]), archives.extract_zip
    refused(extract, archive, folder, "could not be unpacked")


def test_a_hard_link_a_device_and_a_member_cut_short_are_refused(tmp_path, folder):
    link = tarfile.TarInfo("hard")
    link.type, link.linkname = tarfile.LNKTYPE, "ok.txt"
    device = tarfile.TarInfo("null")
    device.type = tarfile.CHRTYPE
    for odd in (link, device):
        archive = make_tar(tmp_path / "odd.tar", [file_entry("ok.txt"), (odd, None)])
        refused(archives.extract_tar, archive, folder, "is not a file or folder")
    whole = make_tar(tmp_path / "whole.tar", [file_entry("big.bin", bytes(4096))]).read_bytes()
    (tmp_path / "short.tar").write_bytes(whole[:512 + 1000])  # the header declares 4096 bytes, 1000 follow
    refused(archives.extract_tar, tmp_path / "short.tar", folder, "unexpected end of data")


def test_a_line_break_in_a_member_name_stays_on_one_line(tmp_path, folder):
    link = tarfile.TarInfo("evil\nname")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    message = refused(archives.extract_tar, make_tar(tmp_path / "nl.tar", [(link, None)]), folder, "not a file")
    assert "'evil\\nname'" in message


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_a_name_too_long_for_the_file_system_gives_a_short_message(tmp_path, folder, kind):
    name = "n" * 60_000  # one part: not a path escape, but no file system takes it (NAME_MAX is 255)
    if kind == "tar":
        archive, extract = make_tar(tmp_path / "long.tar", [file_entry(name)]), archives.extract_tar
    else:
        archive, extract = make_zip(tmp_path / "long.zip", [(name, b"x")]), archives.extract_zip
    assert len(refused(extract, archive, folder, "could not be unpacked")) < 1000


# ----------------------------------------------------------------------------- merging unpacked trees

def test_a_folder_from_a_later_archive_replaces_a_file_of_the_same_name(tmp_path):
    """Files replace files and folders; a folder replaces a file too (it was a NotADirectoryError traceback)."""
    (tmp_path / "tree" / "set").mkdir(parents=True)
    (tmp_path / "tree" / "set" / "a").write_text("a file")
    (tmp_path / "unpacked" / "set" / "a").mkdir(parents=True)
    (tmp_path / "unpacked" / "set" / "a" / "b.txt").write_text("b")
    dataset_download._merge(tmp_path / "unpacked", tmp_path / "tree")
    assert (tmp_path / "tree" / "set" / "a" / "b.txt").read_text() == "b"
