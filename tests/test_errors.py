"""utils/errors.py: the entry-point handler's exit codes and lines, shorten(), one_line(), writing()."""
from __future__ import annotations

import errno
import time

import pytest

from utils.errors import ArgumentError, UserError, WriteError, one_line, run_main, shorten, writing


def raising(error):
    def main(argv):
        raise error
    return main


def stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line]


@pytest.mark.parametrize("error, code, line", [
    (UserError("data.yaml: names: missing"), 1, "tool: error: data.yaml: names: missing"),
    (ArgumentError("argument --batch-size: expected an integer in [1, 4096], got '0'"), 2,
     "tool: error: argument --batch-size: expected an integer in [1, 4096], got '0'"),
    (KeyboardInterrupt(), 130, "tool: interrupted"),
    (OSError(errno.ENOSPC, "No space left on device", "runs/exp/weights/last.pt"), 1,
     "tool: error: could not write runs/exp/weights/last.pt: No space left on device"),
    (OSError(errno.EROFS, "Read-only file system"), 1,
     "tool: error: could not write an output file: Read-only file system"),
])
def test_expected_failures_are_one_line_with_their_exit_code(capsys, error, code, line):
    assert run_main("tool", raising(error), []) == code
    assert stderr_lines(capsys) == [line]


@pytest.mark.parametrize("name, argv", [
    ("/root/x.yaml", ["--hyp", "/root/x.yaml"]),  # the path given
    ("/root/x.yaml", ["--hyp=/root/x.yaml"]),
    ("/data/set/images/a.jpg", ["--source", "/data/set/"]),  # inside a folder given
    ("/ro/runs", ["--project", "/ro/runs/train"]),  # a folder on the way to one given
    ("runs/train/exp/weights", []),  # permission denied under the working folder (default outputs)
])
def test_os_errors_on_paths_the_user_gave_are_one_line(capsys, name, argv):
    error = PermissionError(errno.EACCES, "Permission denied", name)
    assert run_main("tool", raising(error), argv) == 1
    assert stderr_lines(capsys) == [f"tool: error: {name}: Permission denied"]


def test_a_missing_file_the_user_gave_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", "data/coco.yaml")
    assert run_main("tool", raising(missing), ["--data", "./data/coco.yaml"]) == 1
    assert stderr_lines(capsys) == ["tool: error: data/coco.yaml: No such file or directory"]
    monkeypatch.setattr("sys.argv", ["tool.py", "--data", "data/coco.yaml"])  # argv=None: the command line
    assert run_main("tool", raising(missing), None) == 1
    assert stderr_lines(capsys) == ["tool: error: data/coco.yaml: No such file or directory"]


@pytest.mark.parametrize("error, argv", [
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/repo/models/missing.yaml"), ["--data", "a.yaml"]),
    (PermissionError(errno.EACCES, "Permission denied", "/etc/shadow"), ["--source", "/etc/shadows/"]),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/"), ["--project", "/tmp/x"]),
    (OSError(errno.EBADF, "Bad file descriptor", 7), []),  # a file descriptor, not a name
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), []),
])
def test_os_errors_on_paths_the_user_never_gave_are_bugs(capsys, error, argv):
    """A wrong-path bug must not look like bad input: the traceback and the request to report it."""
    assert run_main("tool", raising(error), argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1] == (
        f"tool: internal error ({type(error).__name__}): please report it with the traceback above")


def test_write_errors_name_the_output_whatever_the_command_line(capsys):
    with pytest.raises(WriteError) as error:
        with writing("runs/exp/results.csv"):
            raise PermissionError(errno.EACCES, "Permission denied")
    assert run_main("tool", raising(error.value), []) == 1
    assert stderr_lines(capsys) == ["tool: error: could not write runs/exp/results.csv: Permission denied"]


def test_class_exit_code_and_multi_line_messages():
    class FlagLike(UserError):
        exit_code = 2

    assert run_main("tool", raising(FlagLike("bad --device")), []) == 2
    assert run_main("tool", lambda argv: None, []) == 0
    assert run_main("tool", lambda argv: 3, ["x"]) == 3


def test_user_error_message_is_joined_and_cut(capsys):
    assert run_main("tool", raising(UserError("first\nsecond\n" + "x" * 10_000)), []) == 1
    (line,) = stderr_lines(capsys)
    assert line.startswith("tool: error: first second xxx") and line.endswith("...") and len(line) < 2100


def test_bug_keeps_the_traceback_and_asks_for_a_report(capsys):
    assert run_main("tool", raising(ZeroDivisionError("division by zero")), []) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: division by zero" in err
    assert err.rstrip().splitlines()[-1] == ("tool: internal error (ZeroDivisionError): please report it with the "
                                             "traceback above")
    assert run_main("tool", raising(OSError("no errno, no file")), []) == 1  # unknown cause: a bug report
    assert "internal error (OSError)" in capsys.readouterr().err


def test_system_exit_passes_through():
    with pytest.raises(SystemExit):
        run_main("tool", raising(SystemExit(0)), [])


def test_writing_names_the_file_an_os_error_does_not(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(WriteError) as error:
        with writing(target):
            raise OSError(errno.ENOSPC, "No space left on device")  # write() on a full disk: no file name
    assert str(error.value) == f"could not write {target}: No space left on device"
    assert error.value.exit_code == 1


def test_shorten_is_bounded_for_hostile_values():
    shared = ["x"] * 10
    for _ in range(9):  # 10^10 elements once expanded, 10 distinct lists
        shared = [shared] * 10
    recursive = []
    recursive.append(recursive)
    start = time.perf_counter()
    texts = [shorten(shared), shorten(10 ** 20000), shorten("y" * 10 ** 6, 30), shorten(recursive), shorten(b"\0" * 99)]
    assert time.perf_counter() - start < 1.0
    assert all(len(text) <= 80 for text in texts)
    assert texts[1] == "<66439-bit integer>" and len(texts[2]) <= 30
    assert shorten(0.5) == "0.5" and shorten("abc") == "'abc'" and shorten([1, 2]) == "[1, 2]"


def test_one_line():
    assert one_line("a\n  b\r\nc") == "a b c"
    assert one_line("z" * 50, limit=10) == "zzzzzzz..."


def test_exit_process_keeps_the_exit_code_and_runs_the_exit_finalizers(tmp_path):
    """exit_process freezes the objects still alive before the interpreter's shutdown; what a process registered to
    run at exit still runs: atexit functions and weakref.finalize finalizers, also of an object in a reference cycle
    (which the shutdown's collection would otherwise have been the one to free)."""
    from tests.conftest import fresh_python

    log = tmp_path / "exit.log"
    code = ("import atexit, weakref\n"
            "from utils.errors import exit_process\n"
            f"log = open({str(log)!r}, 'a', buffering=1)\n"
            "class Node:\n    pass\n"
            "node = Node(); node.itself = node\n"
            "weakref.finalize(node, log.write, 'finalized\\n')\n"
            "atexit.register(log.write, 'atexit\\n')\n"
            "del node\n"
            "exit_process(3)\n")
    fresh_python(code, timeout=60, exit_code=3)
    assert sorted(log.read_text().split()) == ["atexit", "finalized"]
