"""utils/files.py: the one atomic writer, the one safe read, the one lock between processes."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from utils import files
from utils.files import (AtomicFile, FileTooLarge, FolderBusy, FolderLock, NotRegularFile, append_text, atomic_write,
                         file_identity, read_regular, remove_stale_temps, replace_with_link)


def entries(folder) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


# ---------------------------------------------------------------------- writing

def test_atomic_write_replaces_a_planted_link_and_leaves_no_temp_file(outside):
    folder, target = outside
    (folder / "results.csv").symlink_to(target)
    atomic_write(folder / "results.csv", "new\n")
    assert target.read_text() == "precious\n"
    assert not (folder / "results.csv").is_symlink() and (folder / "results.csv").read_text() == "new\n"
    assert entries(folder) == ["results.csv"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE((folder / "results.csv").stat().st_mode) == 0o666 & ~umask  # as any new file


def test_a_failed_write_keeps_the_old_file_and_removes_its_temp_file(tmp_path):
    path = tmp_path / "evolve.csv"
    path.write_text("old\n")

    def half_then_fail(file):
        file.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, half_then_fail)
    assert path.read_text() == "old\n" and entries(tmp_path) == ["evolve.csv"]
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "missing-folder" / "x.txt", b"x")


def test_atomic_file_takes_the_name_only_when_the_block_succeeds(tmp_path):
    """export.py's use: the temp file (same suffix) is complete and checked inside the block."""
    path = tmp_path / "model.onnx"
    with AtomicFile(path) as out:
        out.write(b"graph")
        out.file.flush()
        assert out.temp.suffix == ".onnx" and out.temp.parent == tmp_path and out.temp.read_bytes() == b"graph"
        assert not path.exists()
    assert path.read_bytes() == b"graph" and entries(tmp_path) == ["model.onnx"]
    with pytest.raises(ValueError, match="parity"):
        with AtomicFile(path) as out:
            out.write(b"other graph")
            raise ValueError("parity check failed")
    assert path.read_bytes() == b"graph" and entries(tmp_path) == ["model.onnx"]


def test_stale_temp_files_of_a_killed_writer_are_removed(tmp_path):
    path = tmp_path / "last.pt"
    stale = files.temp_path(path)
    stale.write_bytes(b"killed mid-save")
    other = files.temp_path(tmp_path / "best.pt")
    other.write_bytes(b"another file's")
    young = files.temp_path(path)
    young.write_bytes(b"just created: its writer may not hold its lock yet")
    handle, live = files.create_temp(path)  # a live writer (its lock held by this open handle)
    for old in (stale, other, live):
        os.utime(old, (time.time() - 60, time.time() - 60))
    try:
        assert remove_stale_temps(path) == [stale]
        assert not stale.exists() and other.exists() and young.exists() and live.exists()
    finally:
        os.close(handle)
    assert remove_stale_temps(path) == [live]  # its writer is gone (the handle closed): the lock is free


def test_create_temp_gives_the_umask_mode_or_a_private_one(tmp_path):
    umask = os.umask(0o027)
    try:
        assert files.current_umask() == 0o027 and files.new_mode() == 0o640 and files.new_mode(folder=True) == 0o750
        handle, temp = files.create_temp(tmp_path / "a.pt")
        os.close(handle)
        handle, private = files.create_temp(tmp_path / "b.pt", private=True)
        os.close(handle)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(temp.stat().st_mode) == 0o640 and stat.S_IMODE(private.stat().st_mode) == 0o600
    assert temp.name.startswith(".a.pt.") and temp.name.endswith(".tmp.pt")


@pytest.mark.parametrize("links", [True, False])
def test_replace_with_link_keeps_the_bytes_when_the_source_is_replaced(tmp_path, monkeypatch, links):
    source, target = tmp_path / "last.pt", tmp_path / "best.pt"
    source.write_bytes(b"epoch 3")
    target.write_bytes(b"epoch 1")
    if not links:
        monkeypatch.setattr(files.os, "link", lambda *args: (_ for _ in ()).throw(OSError("no hard links here")))
    replace_with_link(source, target)
    assert os.path.samefile(source, target) == links
    atomic_write(source, b"epoch 4")  # the writer replaces, never writes in place
    assert target.read_bytes() == b"epoch 3" and entries(tmp_path) == ["best.pt", "last.pt"]


def test_append_text_never_writes_through_a_link(outside):
    folder, target = outside
    append_text(folder / "log.txt", "a\n")
    append_text(folder / "log.txt", "b\n")
    assert (folder / "log.txt").read_text() == "a\nb\n"
    (folder / "linked.txt").symlink_to(target)
    with pytest.raises(NotRegularFile, match="symbolic link"):
        append_text(folder / "linked.txt", "x\n")
    assert target.read_text() == "precious\n"


# ---------------------------------------------------------------------- reading

def test_read_regular_refuses_links_fifos_and_oversized_files_at_once(outside):
    folder, target = outside
    (folder / "link").symlink_to(target)
    (folder / "zero").symlink_to("/dev/zero")
    os.mkfifo(folder / "fifo")
    (folder / "big").write_bytes(b"x" * 101)
    (folder / "small").write_bytes(b"x" * 100)
    for name, reason in (("link", "symbolic link"), ("zero", "symbolic link"), ("fifo", "not a regular file")):
        with pytest.raises(NotRegularFile, match=reason):
            read_regular(folder / name, 100)  # a FIFO with no writer would block a plain open: returns at once
    with pytest.raises(FileTooLarge):
        read_regular(folder / "big", 100)
    assert read_regular(folder / "small", 100) == b"x" * 100
    with pytest.raises(FileNotFoundError):
        read_regular(folder / "missing", 100)


def test_file_identity_changes_when_a_file_is_rewritten(tmp_path):
    path = tmp_path / "last.pt"
    assert file_identity(path) is None
    atomic_write(path, b"same bytes")
    before = file_identity(path)
    assert file_identity(path) == before
    atomic_write(path, b"same bytes")
    assert file_identity(path) != before  # a new inode, even with the same content and size


# ---------------------------------------------------------------------- the lock

TRY_LOCK = ("import sys; from utils.files import FolderBusy, FolderLock\n"
            "try:\n    FolderLock(sys.argv[1], 'test.lock').acquire()\n    print('taken')\n"
            "except FolderBusy as error:\n    print('busy:', error.record)\n")


def other_process_tries(folder) -> str:
    return subprocess.run([sys.executable, "-c", TRY_LOCK, str(folder)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60).stdout.strip()


def test_the_lock_survives_other_handles_of_its_file_being_closed(tmp_path):
    """A POSIX record lock (lockf) is dropped when the process closes ANY handle of the file; the flock is not:
    reading the lock file elsewhere in the process leaves the lock held."""
    lock = FolderLock(tmp_path, "test.lock")
    assert lock.acquire(record="pid 1, holder") == ""
    try:
        with open(lock.path, "rb") as other:  # another handle of the same file, opened and closed
            assert other.read().startswith(b"pid 1, holder")
        os.close(os.open(lock.path, os.O_RDONLY))
        assert other_process_tries(tmp_path) == "busy: pid 1, holder"
    finally:
        lock.release(remove=True)
    assert not lock.path.exists() and other_process_tries(tmp_path) == "taken"


def test_two_locks_in_one_process_exclude_each_other(tmp_path):
    first, second = FolderLock(tmp_path, "test.lock"), FolderLock(tmp_path, "test.lock")
    first.acquire()
    with pytest.raises(FolderBusy, match="in use by another process"):
        second.acquire()
    first.release()
    assert second.acquire() == ""  # released without removal: the file (empty) stays
    second.release()


HOLDER_THAT_FORKS = """
import os, sys, time
from utils.files import FolderLock
FolderLock(sys.argv[1], 'test.lock').acquire(record='parent')
child = os.fork()
if child == 0:
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)  # the test reads the parent's output to its end
    os.dup2(null, 2)
    time.sleep(60)  # a loader worker that outlives its parent for a while
    os._exit(0)
print(child, flush=True)
os._exit(0)  # the parent dies without releasing
"""


def test_the_lock_ends_with_its_process_even_while_forked_children_live(tmp_path):
    result = subprocess.run([sys.executable, "-c", HOLDER_THAT_FORKS, str(tmp_path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    child = int(result.stdout.strip())
    try:
        os.kill(child, 0)  # still alive
        lock = FolderLock(tmp_path, "test.lock")
        assert lock.acquire() == "parent"  # the dead holder's record: taken over although its child lives
        lock.release()
    finally:
        os.kill(child, 9)


def test_a_waiting_lock_gets_it_when_the_holder_releases(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from utils.files import FolderLock; "
                               "lock = FolderLock(sys.argv[1], 'test.lock'); lock.acquire(); print('held', flush=True); "
                               "time.sleep(1); lock.release()", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with FolderLock(tmp_path, "test.lock") as lock:
            lock.write("7\n")
            assert time.monotonic() - start > 0.2 and lock.read() == "7\n"
    finally:
        holder.wait(timeout=60)


def test_a_planted_lock_link_is_refused_and_not_written_through(outside):
    folder, target = outside
    (folder / "test.lock").symlink_to(target)
    with pytest.raises(NotRegularFile, match="symbolic link"):
        FolderLock(folder, "test.lock").acquire(record="x")
    assert target.read_text() == "precious\n"
