"""utils/data/json_stream.py: the items of a JSON file's top-level arrays one at a time, equal to json.load's
whatever the chunk boundaries, in memory bounded by the largest item; malformed files are one line."""
from __future__ import annotations

import json
import tracemalloc

import pytest

from utils.data import json_stream
from utils.data.importers import AnnotationError
from utils.data.json_stream import iter_arrays

DOCUMENT = {
    "info": {"year": 2020, "nested": [[1, 2], {"a": None}], "text": "x\u00e9\u4e2d\\\"}]"},
    "images": [{"id": 1, "file_name": "a\"].jpg", "width": 1920.5, "height": 12e2},
               {"id": 123456789012, "file_name": "\u00e9\U0001f600.jpg", "flag": True, "other": False}],
    "empty": [],
    "annotations": [{"bbox": [1.25, -3, 1e-7, 4.0E+2], "crowd": None}, [], {}, 7, "s", True, None, -0.0],
    "licenses": [{"url": "http://x"}] * 3,
    "last": 1.5,
}


def items(path, keys):
    return list(iter_arrays(path, keys))


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 22])
@pytest.mark.parametrize("indent", [None, 2])
def test_items_equal_json_load_at_every_chunk_size(tmp_path, monkeypatch, chunk, indent):
    monkeypatch.setattr(json_stream, "CHUNK_CHARS", chunk)
    path = tmp_path / "a.json"
    path.write_text(json.dumps(DOCUMENT, indent=indent, ensure_ascii=chunk % 2 == 0), encoding="utf-8")
    expected = [(key, item) for key in ("images", "annotations") for item in DOCUMENT[key]]
    assert items(path, ("annotations", "images")) == expected  # in file order
    assert items(path, ("empty",)) == []


def test_a_byte_order_mark_and_white_space_are_skipped(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(b"\xef\xbb\xbf \n\t{ \"images\" : [ 1 , 2 ] } \n")
    assert items(path, ("images",)) == [("images", 1), ("images", 2)]


@pytest.mark.parametrize("text, reason", [
    ('{"images": [1, 2', "expected one of , ]"),  # cut short
    ('{"images": [1, 2]', "expected one of , }"),
    ('{"images": [1, 2]} []', "data after the top-level object"),
    ('{"images": [1, 2,]}', "Expecting value"),
    ('{"images": [{"a": 1 "b": 2}]}', "Expecting ',' delimiter"),
    ('{"images": ["unterminated]}', "Unterminated string"),
    ('{1: []}', "a key must be a string"),
    ('[{"images": []}]', "must be a JSON object"),
    ('{"images": {"a": 1}}', "'images' must be a list"),
    ('{"other": []}', "missing or non-list 'images'"),
    ('', "must be a JSON object"),
])
def test_malformed_files_are_one_line_naming_the_file(tmp_path, monkeypatch, text, reason):
    monkeypatch.setattr(json_stream, "CHUNK_CHARS", 3)
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(AnnotationError) as raised:
        items(path, ("images",))
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and reason in message and len(message.splitlines()) == 1


def test_offsets_name_where_the_error_is(tmp_path, monkeypatch):
    monkeypatch.setattr(json_stream, "CHUNK_CHARS", 5)
    path = tmp_path / "bad.json"
    path.write_text('{"images": [1, 2, 3, x]}')
    with pytest.raises(AnnotationError, match="at character 21 "):
        items(path, ("images",))


def test_not_utf8_too_deep_and_too_large_are_one_line(tmp_path, monkeypatch):
    path = tmp_path / "bad.json"
    path.write_bytes(b'{"images": ["\xff"]}')
    with pytest.raises(AnnotationError, match="not UTF-8"):
        items(path, ("images",))
    path.write_text('{"images": [' + "[" * 100_000 + "]" * 100_000 + "]}")
    with pytest.raises(AnnotationError, match="nested deeper"):
        items(path, ("images",))
    monkeypatch.setattr(json_stream, "MAX_ITEM_CHARS", 100)
    monkeypatch.setattr(json_stream, "CHUNK_CHARS", 16)
    path.write_text('{"images": [1, "' + "x" * 1000 + '"]}')
    with pytest.raises(AnnotationError, match="one value is longer than"):
        items(path, ("images",))


def test_memory_is_bounded_by_the_largest_item_not_the_file(tmp_path, monkeypatch):
    """50,000 annotations (~4 MB of JSON) read in 64 K-character chunks: json.load holds them all at once (tens of
    MB), the stream a chunk and an item."""
    monkeypatch.setattr(json_stream, "CHUNK_CHARS", 1 << 16)
    path = tmp_path / "big.json"
    with open(path, "w") as file:
        file.write('{"annotations": [')
        file.write(",".join(json.dumps({"id": i, "image_id": i // 10, "category_id": i % 365,
                                        "bbox": [i * 0.5, 2.25, 30.0, 40.0], "iscrowd": 0}) for i in range(50_000)))
        file.write('], "categories": []}')
    tracemalloc.start()
    try:
        count = sum(1 for _ in iter_arrays(path, ("annotations",)))
        streamed = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        with open(path) as file:
            whole = len(json.load(file)["annotations"])
        loaded = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == whole == 50_000
    assert streamed < 2 << 20 and streamed * 10 < loaded, (streamed, loaded)


def test_an_optional_key_may_be_missing_and_a_required_one_may_not(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('{"images": [1]}')
    assert list(iter_arrays(path, ("images", "annotations"), optional=("annotations",))) == [("images", 1)]
    with pytest.raises(AnnotationError, match="missing or non-list 'annotations'"):
        items(path, ("images", "annotations"))
