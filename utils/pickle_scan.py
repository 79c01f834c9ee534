"""Reading a torch file's pickles without building anything: what they name and what loading them would cost.

A pickle is a program for a small stack machine; ``PickleScan`` walks its opcodes (pickletools.genops) and
keeps, for each value on the stack, only how many items it would have once expanded, so a few bytes of
shared references cannot hide work from it:

- ``globals``: the 'module.name' of every GLOBAL / STACK_GLOBAL (YOLOv5's pickled modules are recognised so);
- ``tuple_work``: the items of every tuple value pushed, counted with their nested tuples. Hashing a tuple
  (as a dict key, while unpickling) visits every nested item, and tuples of shared tuples grow as 2**depth
  in a few hundred bytes, so a load is refused when this exceeds MAX_TUPLE_WORK.

``check_legacy_pickles(path)`` applies the 32 MB pickle budget (MAX_PICKLE_BYTES) to the legacy torch
format (``_use_new_zipfile_serialization=False``: five pickles, then raw storages): the opcodes are read
through ``BoundedReader``, which never reads past the budget whatever length the file declares.
"""
from __future__ import annotations

import contextlib
import pickletools
from pathlib import Path

from utils.errors import CheckpointError
from utils.limits import MAX_PICKLE_BYTES, MAX_TUPLE_WORK

LEGACY_PICKLES = 5  # magic number, protocol version, system info, the data, the storage keys; then raw storages
TUPLE_OPCODES = {"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE"}
_MARK = None


class _Unbalanced(Exception):
    """The opcodes do not form a well-formed program (the loader reports the damage)."""


def _effects() -> dict:
    """Per opcode name: (stack items popped below a mark or None, items popped, items pushed, makes a tuple)."""
    table = {}
    for opcode in pickletools.opcodes:
        before = opcode.stack_before
        marked = pickletools.markobject in before
        count = before.index(pickletools.markobject) if marked else len(before)
        table[opcode.name] = (marked, count, len(opcode.stack_after), opcode.name in TUPLE_OPCODES)
    return table


EFFECTS = _effects()
STRING_OPCODES = {op.name for op in pickletools.opcodes if "UNICODE" in op.name or op.name.endswith("STRING")}
PUT_OPCODES = {"PUT", "BINPUT", "LONG_BINPUT"}
GET_OPCODES = {"GET", "BINGET", "LONG_BINGET"}


class PickleScan:
    """Feed ``(opcode, arg)`` pairs of one pickle after another (``next_pickle()`` between them)."""

    def __init__(self):
        self.globals: list[str] = []
        self.tuple_work = 0
        self.balanced = True
        self._strings: list[str] = []
        self._string_memo: dict = {}
        self.next_pickle()

    def next_pickle(self) -> None:
        self._stack: list = []
        self._memo: dict = {}

    def feed(self, opcode, arg) -> None:
        name = opcode.name
        if name in STRING_OPCODES:
            self._strings.append(arg)
        elif name == "GLOBAL" or name == "STACK_GLOBAL" or self._strings and (
                name in PUT_OPCODES or name in GET_OPCODES or name == "MEMOIZE"):
            self._names(name, arg)
        if self.balanced:
            try:
                self._step(name, arg)
            except _Unbalanced:
                self.balanced = False

    def _names(self, name: str, arg) -> None:
        """Strings as they are pushed or fetched from the memo, to name STACK_GLOBAL's module and name."""
        if name == "GLOBAL":
            self.globals.append(arg.replace(" ", "."))
        elif name == "STACK_GLOBAL" and len(self._strings) >= 2:
            self.globals.append(f"{self._strings[-2]}.{self._strings[-1]}")
        elif name in PUT_OPCODES:
            self._string_memo[arg] = self._strings[-1]
        elif name == "MEMOIZE":
            self._string_memo[len(self._string_memo)] = self._strings[-1]
        elif name in GET_OPCODES and arg in self._string_memo:
            self._strings.append(self._string_memo[arg])

    def _step(self, name: str, arg) -> None:
        """The opcode's stack effect on expanded sizes (pickletools' stack_before / stack_after)."""
        stack = self._stack
        if name in PUT_OPCODES or name == "MEMOIZE":
            self._memo[len(self._memo) if name == "MEMOIZE" else arg] = self._top()
            return
        if name in GET_OPCODES:
            self._push(self._memo.get(arg, 1))
            return
        if name == "MARK":
            stack.append(_MARK)
            return
        if name == "DUP":
            self._push(self._top())
            return
        marked, count, pushed, makes_tuple = EFFECTS[name]
        popped = 0
        if marked:
            while stack and stack[-1] is not _MARK:
                popped += stack.pop()
            if not stack:
                raise _Unbalanced
            stack.pop()
        for _ in range(count):
            if not stack or stack[-1] is _MARK:
                raise _Unbalanced
            popped += stack.pop()
        size = 1 + popped if makes_tuple else 1
        for _ in range(pushed):
            self._push(size)

    def _top(self) -> int:
        if not self._stack or self._stack[-1] is _MARK:
            raise _Unbalanced
        return self._stack[-1]

    def _push(self, size: int) -> None:
        self._stack.append(size)
        if size > 1:
            self.tuple_work += size


def scan_pickle(data: bytes) -> PickleScan:
    """A ``PickleScan`` of one pickle in memory (a damaged one is scanned up to the damage)."""
    scan = PickleScan()
    try:
        for opcode, arg, _ in pickletools.genops(data):
            scan.feed(opcode, arg)
            if scan.tuple_work > MAX_TUPLE_WORK:
                break
    except (ValueError, EOFError):
        pass  # a damaged pickle: the loader reports it
    return scan


def pickle_globals(data: bytes) -> list[str]:
    """'module.name' of every GLOBAL / STACK_GLOBAL in a pickle, read without unpickling."""
    return scan_pickle(data).globals


def check_tuple_work(scan: PickleScan, path) -> None:
    if scan.tuple_work > MAX_TUPLE_WORK:
        raise CheckpointError(f"{path}: refused: its tuples expand to more than {MAX_TUPLE_WORK:,} items "
                              "(shared references nested to blow up when loaded)")


def check_legacy_pickles(path: Path, file=None) -> PickleScan:
    """Walk the pickles of a legacy torch file (nothing is built, no read goes past the budget); refuse it when
    they take more than MAX_PICKLE_BYTES, the budget a zip archive's data.pkl has, or expand too far. ``file``: the
    file already open at its start (``path`` then only names it)."""
    scan = PickleScan()
    with open(path, "rb") if file is None else contextlib.nullcontext(file) as file:
        reader = BoundedReader(file, MAX_PICKLE_BYTES)
        try:
            for _ in range(LEGACY_PICKLES):
                scan.next_pickle()
                for opcode, arg, _position in pickletools.genops(reader):
                    scan.feed(opcode, arg)
                    if scan.tuple_work > MAX_TUPLE_WORK:
                        break
                if scan.tuple_work > MAX_TUPLE_WORK:
                    break
        except (ValueError, EOFError, UnicodeDecodeError, OverflowError, MemoryError):
            if reader.exhausted:
                raise CheckpointError(f"{path}: legacy torch file whose pickles take more than the "
                                      f"{MAX_PICKLE_BYTES / 1e6:.0f} MB a checkpoint's pickle may have") from None
            # ends within the budget: damaged, or a bare pickle; torch.load says which
    check_tuple_work(scan, path)
    return scan


class BoundedReader:
    """A read-only view of a file that ends ``limit`` bytes after its current position (``exhausted`` once
    a read wanted more): pickletools reads lengths from the file, so no read may trust them."""

    def __init__(self, file, limit: int):
        self.file, self.left, self.exhausted = file, limit, False

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > self.left:
            self.exhausted = True
            size = self.left
        data = self.file.read(size)
        self.left -= len(data)
        return data

    def readline(self) -> bytes:
        line = self.file.readline(self.left)
        self.left -= len(line)
        self.exhausted = self.exhausted or (self.left == 0 and not line.endswith(b"\n"))
        return line

    def tell(self) -> int:
        return self.file.tell()
