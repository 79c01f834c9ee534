"""The one YAML reader for model, data and hyp files: ``yaml.safe_load`` with bounds.

``safe_load`` never builds arbitrary objects, but aliases let a few hundred bytes describe a value
whose expansion is exponential ("billion laughs"). Loaded, the value is small because aliases share
one object; any code that walks, prints or copies it element by element (``str()``, a message,
``torch.tensor``, JSON) then runs out of time or memory. So before anything is constructed, the
loader counts the nodes the document would have with every alias expanded (each distinct node is
visited once, so the count itself is linear) and refuses documents past ``MAX_YAML_NODES``, recursive
aliases, files past ``MAX_YAML_BYTES`` and nesting deeper than Python's recursion allows. Every
refusal is a ``YamlLimitError``, a ``yaml.YAMLError``, so callers report it like any invalid YAML.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from utils.limits import MAX_YAML_BYTES, MAX_YAML_NODES


class YamlLimitError(yaml.YAMLError):
    """A YAML document refused for its size or shape (not for its syntax)."""


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def expanded_size(root, limit: int = MAX_YAML_NODES) -> int:
    """Nodes under ``root`` counting each alias as a full copy; YamlLimitError past ``limit`` or on a
    recursive alias. Iterative depth-first walk with one memo entry per distinct node."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        children = _children(node)
        if finished:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[key] > limit:
                raise YamlLimitError(f"document too large once aliases are expanded (more than {limit:,} nodes)")
            continue
        if key in on_path:
            raise YamlLimitError("recursive alias (a value that contains itself)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader that checks each composed document with ``expanded_size`` before constructing it."""

    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            expanded_size(node)
        return node


def yaml_reason(error: yaml.YAMLError) -> str:
    """The first line of a YAML error, for one-line messages."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:200]


def load_yaml(source):
    """The value of a YAML document (text, bytes or a file object); raises yaml.YAMLError."""
    try:
        return yaml.load(source, Loader=BoundedLoader)  # noqa: S506 - BoundedLoader is a SafeLoader
    except RecursionError:
        raise YamlLimitError("nested too deeply") from None


def read_yaml(path):
    """``load_yaml`` of a file, refusing files larger than MAX_YAML_BYTES before reading them.

    Raises OSError when the file cannot be read and yaml.YAMLError (YamlLimitError for the bounds)."""
    with open(Path(path), "rb") as file:
        data = file.read(MAX_YAML_BYTES + 1)
    if len(data) > MAX_YAML_BYTES:
        raise YamlLimitError(f"file larger than the {MAX_YAML_BYTES >> 20} MB limit for a YAML file")
    return load_yaml(data)


def read_yaml_as(path, error: type[Exception]):
    """``read_yaml``, with a file that cannot be read or parsed raised as one-line ``error`` naming ``path``."""
    try:
        return read_yaml(path)
    except OSError as failure:
        raise error(f"{path}: cannot read ({failure.strerror or failure})") from None
    except yaml.YAMLError as failure:
        raise error(f"{path}: invalid YAML ({yaml_reason(failure)})") from None
