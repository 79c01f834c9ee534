"""The items of a JSON file's top-level arrays, one at a time: memory bounded by the largest item, not the file.

Annotation files from elsewhere can be far larger than memory once parsed whole (Objects365's train JSON holds
25 million boxes: tens of GB as Python objects). ``iter_arrays(path, keys)`` reads the top-level object in chunks
and yields ``(key, item)`` for each item of the arrays named in ``keys``, in file order; the other values are
parsed and dropped (arrays an item at a time). Every item is parsed by the standard library's decoder
(``json.JSONDecoder.raw_decode``), so what it accepts is what ``json.load`` accepts.

Refused in one line naming the file (``AnnotationError``, utils/errors.py): text that is not UTF-8, malformed or truncated JSON (the
character offset given), a top level that is not an object, a key of ``keys`` whose value is not an array or that
is missing, one item larger than ``MAX_ITEM_CHARS``, nesting deeper than the decoder goes.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from utils.errors import AnnotationError, shorten

CHUNK_CHARS = 1 << 22  # read 4 M characters at a time
MAX_ITEM_CHARS = 64 << 20  # one annotation, image or feature is well under 1 KB; GeoJSON polygons a few KB
_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class _Reader:
    """A window onto a text file: ``buffer[pos:]`` is what is not parsed yet, ``consumed`` what went before."""

    def __init__(self, file, path: Path):
        self.file, self.path = file, path
        self.buffer, self.pos, self.consumed, self.eof = "", 0, 0, False

    def fill(self) -> bool:
        """Drop what is parsed and read the next chunk; False at the end of the file."""
        if self.eof:
            return False
        try:
            chunk = self.file.read(CHUNK_CHARS)
        except UnicodeDecodeError as error:
            raise AnnotationError(f"{self.path}: not UTF-8 text ({error.reason})") from None
        except OSError as error:
            raise AnnotationError(f"{self.path}: cannot read ({error.strerror or error})") from None
        if not chunk:
            self.eof = True  # the window stays where it is
            return False
        self.consumed += self.pos
        self.buffer, self.pos = self.buffer[self.pos:] + chunk, 0
        return True

    def peek(self) -> str:
        """The next character after white space ("" at the end of the file)."""
        while True:
            self.pos = _SPACE.match(self.buffer, self.pos).end()
            if self.pos < len(self.buffer) or not self.fill():
                return self.buffer[self.pos:self.pos + 1]

    def expect(self, allowed: str) -> str:
        char = self.peek()
        if not char or char not in allowed:
            found = f"{char!r}" if char else "the end of the file"
            raise self.error(f"expected one of {' '.join(allowed)}, found {found}")
        self.pos += 1
        return char

    def value(self):
        """The next JSON value, read whole (at most MAX_ITEM_CHARS)."""
        self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buffer, self.pos)
            except json.JSONDecodeError as error:
                at = self.consumed + error.pos  # before more() moves the window
                cut = error.pos >= len(self.buffer) - 16 or error.msg.startswith("Unterminated string")
                if not cut or not self.more():  # a value cut by the chunk's end is parsed again with what follows
                    raise self.error(error.msg, at) from None
                continue
            except RecursionError:
                raise self.error("nested deeper than the parser goes") from None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and end > len(self.buffer) - 32 \
                    and self.more():
                continue  # a number the chunk's end may cut ("12" of "12.5e3"): parsed again with what follows
            self.pos = end
            return value

    def more(self) -> bool:
        """Read on for the value at ``pos``; False at the end of the file. One value is at most MAX_ITEM_CHARS."""
        if len(self.buffer) - self.pos > MAX_ITEM_CHARS:
            raise self.error(f"one value is longer than {MAX_ITEM_CHARS >> 20} M characters")
        return self.fill()

    def error(self, reason: str, offset: int | None = None) -> AnnotationError:
        at = self.consumed + self.pos if offset is None else offset
        return AnnotationError(f"{self.path}: malformed JSON at character {at} ({reason})")


def iter_arrays(path: str | Path, keys: tuple[str, ...] | set[str], optional: tuple[str, ...] = ()):
    """``(key, item)`` for each item of the top-level arrays named in ``keys``, in file order (module doc); a key of
    ``optional`` may be missing."""
    path = Path(path)
    try:
        file = open(path, encoding="utf-8-sig")  # a byte order mark is skipped, as Python's text readers do
    except OSError as error:
        raise AnnotationError(f"{path}: cannot read ({error.strerror or error})") from None
    with file:
        reader = _Reader(file, path)
        if reader.peek() != "{":
            raise AnnotationError(f"{path}: the top level must be a JSON object (with {', '.join(sorted(keys))})")
        reader.pos += 1
        seen = set()
        if reader.peek() == "}":
            reader.pos += 1
        else:
            while True:
                key = reader.value()
                if not isinstance(key, str):
                    raise reader.error(f"a key must be a string, found {shorten(key)}")
                reader.expect(":")
                if reader.peek() == "[":
                    reader.pos += 1
                    if reader.peek() == "]":
                        reader.pos += 1
                    else:
                        while True:
                            item = reader.value()
                            if key in keys:
                                yield key, item
                            if reader.expect(",]") == "]":
                                break
                elif key in keys:
                    raise AnnotationError(f"{path}: {key!r} must be a list")
                else:
                    reader.value()  # another key's value: dropped
                seen.add(key)
                if reader.expect(",}") == "}":
                    break
        if reader.peek():
            raise reader.error("data after the top-level object")
    missing = sorted(set(keys) - seen - set(optional))
    if missing:
        raise AnnotationError(f"{path}: missing or non-list {missing[0]!r}")
