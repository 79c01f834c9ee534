"""Bounds on the values of a model YAML (limits in ``utils.limits``), checked before anything is built.

Each check raises ValueError with a one-line message that names the value and its range;
``models.yolo`` adds the file, layer and row. Values from the file are cut with ``shorten``.
"""
from __future__ import annotations

from utils.errors import shorten
from utils.limits import (MAX_ANCHOR_PIXELS, MAX_ANCHORS_PER_LEVEL, MAX_ARGUMENT, MAX_CHANNELS, MAX_CLASSES,
                          MAX_INPUT_CHANNELS, MAX_LAYERS, MAX_LEVELS, MAX_MULTIPLE, MAX_REPEATS, Range)

REQUIRED_KEYS = ("nc", "depth_multiple", "width_multiple", "anchors", "backbone", "head")
MAX_ARGUMENT_ITEMS = 256  # numbers, strings and lists in one row's args, nested lists included
MULTIPLES = Range(0, MAX_MULTIPLE, low_open=True)
ANCHOR_PIXELS = Range(0, MAX_ANCHOR_PIXELS, low_open=True)


def is_count(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def check_nc(nc) -> None:
    if not is_count(nc, 1, MAX_CLASSES):
        raise ValueError(f"nc must be an integer in [1, {MAX_CLASSES}], got {shorten(nc)}")


def check_anchors(anchors) -> None:
    """An anchor count per level, or 1..MAX_LEVELS equal-length lists of positive finite pixel (w, h) pairs."""
    if is_count(anchors, 1, MAX_ANCHORS_PER_LEVEL):
        return
    levels_ok = isinstance(anchors, list) and 0 < len(anchors) <= MAX_LEVELS and all(
        isinstance(level, list) and 0 < len(level) <= 2 * MAX_ANCHORS_PER_LEVEL and len(level) % 2 == 0
        and len(level) == len(anchors[0]) for level in anchors)
    if not levels_ok:
        raise ValueError(f"anchors must be an integer in [1, {MAX_ANCHORS_PER_LEVEL}] (anchors per level) or 1 to "
                         f"{MAX_LEVELS} equal-length lists of up to {MAX_ANCHORS_PER_LEVEL} (w, h) pixel pairs, "
                         f"got {shorten(anchors)}")
    for value in (value for level in anchors for value in level):
        if value not in ANCHOR_PIXELS:
            raise ValueError(f"anchor sizes must be finite numbers in {ANCHOR_PIXELS} pixels, got {shorten(value)}")


def check_config(d: dict) -> None:
    """The top-level keys: present, and within their bounds."""
    missing = [key for key in REQUIRED_KEYS if key not in d]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    check_nc(d["nc"])
    check_anchors(d["anchors"])
    for key in ("depth_multiple", "width_multiple"):
        if d[key] not in MULTIPLES:
            raise ValueError(f"{key} must be a number in {MULTIPLES}, got {shorten(d[key])}")
    if not is_count(d.get("ch", 3), 1, MAX_INPUT_CHANNELS):
        raise ValueError(f"ch must be an integer in [1, {MAX_INPUT_CHANNELS}], got {shorten(d.get('ch'))}")
    for key in ("backbone", "head"):
        if not isinstance(d[key], list):
            raise ValueError(f"'{key}' must be a list of [from, number, module, args] rows")
    if len(d["backbone"]) + len(d["head"]) > MAX_LAYERS:
        raise ValueError(f"{len(d['backbone']) + len(d['head'])} rows, more than {MAX_LAYERS}")


def check_arguments(name: str, args: list) -> None:
    """Numbers in a row's args: the first (output channels for most blocks) at most MAX_CHANNELS, any
    other at most MAX_ARGUMENT in size (kernel, stride, padding, scale); nesting and count bounded."""
    pending, seen = [(value, 0, position == 0) for position, value in enumerate(args)], 0
    while pending:
        value, depth, first = pending.pop()
        seen += 1
        if seen > MAX_ARGUMENT_ITEMS or depth > 3:
            raise ValueError(f"args too long or too deeply nested: {shorten(args)}")
        if isinstance(value, list):
            pending.extend((item, depth + 1, False) for item in value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            limit = MAX_CHANNELS if first else MAX_ARGUMENT
            if value not in Range(-limit, limit):
                raise ValueError(f"{name} argument {shorten(value)} is outside [-{limit}, {limit}]")


def scaled_repeats(number: int, depth: float) -> int:
    """A row's repeats after depth scaling (YOLOv5's rule), at most MAX_REPEATS."""
    repeats = max(round(number * depth), 1) if number > 1 else number
    if repeats > MAX_REPEATS:
        raise ValueError(f"'number' {number} x depth_multiple {depth:g} = {repeats} repeats, more than {MAX_REPEATS}")
    return repeats
