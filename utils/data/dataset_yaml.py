"""Dataset YAML (YOLOv5 format) -> ``DataConfig`` with every split resolved to existing paths.

Keys: ``path`` (dataset root; relative to the YAML file's folder, default that folder), ``train``,
``val`` and optional ``test`` (each a folder, a ``.txt`` list of image paths, an image file, or a
list of those; relative to ``path``), ``names`` (a list, or a ``{id: name}`` dict with ids
0..nc-1) and optional ``nc`` (must agree with ``names``). A ``download`` key is reported as
ignored and never executed. Errors are ``DataConfigError`` naming the file, the key and the path
that was tried.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from utils.errors import UserError

LOGGER = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = ROOT / "data"
SPLITS = ("train", "val", "test")
REQUIRED_SPLITS = ("train", "val")


class DataConfigError(UserError):
    """A dataset YAML that cannot be used; the message names the file, the key and the path tried."""


@dataclass
class DataConfig:
    path: Path
    train: list[str]
    val: list[str]
    test: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    nc: int = 0
    yaml_file: Path = Path()

    def split(self, name: str) -> list[str]:
        """Sources of split ``name`` ('train', 'val' or 'test')."""
        if name not in SPLITS:
            raise DataConfigError(f"{self.yaml_file}: unknown split '{name}' (use one of {', '.join(SPLITS)})")
        return getattr(self, name)


def find_data_yaml(path: str | Path) -> Path:
    """The YAML file for ``path``: the path itself, or a bare name found in the repo's data/ folder."""
    candidate = Path(path).expanduser()
    if candidate.is_file():
        return candidate
    if candidate.parent == Path("."):  # a bare name such as "coco128" or "coco128.yaml"
        for name in (candidate.name, candidate.name + ".yaml", candidate.name + ".yml"):
            if (DATA_DIR / name).is_file():
                return DATA_DIR / name
    if candidate.exists():
        raise DataConfigError(f"{path}: not a file (expected a dataset YAML)")
    raise DataConfigError(f"{path}: dataset YAML not found (also looked in {DATA_DIR})")


def _read_yaml(file: Path, label: str) -> dict[str, Any]:
    try:
        with open(file, encoding="utf-8") as handle:
            content = yaml.safe_load(handle)
    except yaml.YAMLError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataConfigError(f"{label}: invalid YAML ({reason})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataConfigError(f"{label}: cannot read file ({e})") from None
    if not isinstance(content, dict):
        kind = type(content).__name__
        raise DataConfigError(f"{label}: expected a mapping of keys (path, train, val, names), got {kind}")
    return content


def parse_names(content: dict[str, Any], label: str) -> list[str]:
    """Class names from ``names`` (list or {id: name}) checked against the optional ``nc``."""
    names, nc = content.get("names"), content.get("nc")
    if nc is not None and (isinstance(nc, bool) or not isinstance(nc, int) or nc < 1):
        raise DataConfigError(f"{label}: nc: expected a positive integer, got {nc!r}")
    if names is None:
        if nc is None:
            raise DataConfigError(f"{label}: names: missing (give a list of class names or an {{id: name}} mapping)")
        return [str(i) for i in range(nc)]
    if isinstance(names, dict):
        ids = list(names)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise DataConfigError(f"{label}: names: ids must be integers, got {ids!r}")
        if sorted(ids) != list(range(len(ids))):
            raise DataConfigError(f"{label}: names: ids must be 0..{len(ids) - 1} without gaps, got {sorted(ids)}")
        names = [names[i] for i in range(len(ids))]
    elif not isinstance(names, list):
        raise DataConfigError(f"{label}: names: expected a list or an {{id: name}} mapping, got {type(names).__name__}")
    if not names:
        raise DataConfigError(f"{label}: names: empty (at least one class is needed)")
    if nc is not None and nc != len(names):
        raise DataConfigError(f"{label}: nc: {nc} does not agree with names ({len(names)} names)")
    return [str(name) for name in names]


def _absolute(value, base: Path) -> Path:
    """``value`` (~ expanded) as an absolute path; relative paths are taken from ``base``."""
    path = Path(value).expanduser()
    return Path(os.path.abspath(path if path.is_absolute() else base / path))


def _resolve_root(content: dict[str, Any], file: Path, label: str) -> Path:
    folder = Path(os.path.abspath(file.parent))
    value = content.get("path")
    if value in (None, ""):
        return folder
    if not isinstance(value, (str, Path)):
        raise DataConfigError(f"{label}: path: expected a folder path, got {value!r}")
    root = _absolute(value, folder)
    if not root.is_dir():
        raise DataConfigError(f"{label}: path: {root} does not exist")
    return root


def resolve_split(content: dict[str, Any], key: str, root: Path, label: str) -> list[str]:
    """Absolute sources of one split; each must exist. A missing optional split gives []."""
    value = content.get(key)
    if value in (None, "", []):
        if key in REQUIRED_SPLITS:
            raise DataConfigError(f"{label}: {key}: missing (give a folder, a .txt list of images, or a list of those)")
        return []
    entries = value if isinstance(value, list) else [value]
    sources = []
    for entry in entries:
        if not isinstance(entry, (str, Path)):
            raise DataConfigError(f"{label}: {key}: expected a path, got {entry!r}")
        source = _absolute(entry, root)
        if not source.exists():
            raise DataConfigError(f"{label}: {key}: {source} does not exist")
        sources.append(str(source))
    return sources


def load_data_config(path: str | Path) -> DataConfig:
    """Read and check a dataset YAML; see the module docstring for the format."""
    file = find_data_yaml(path)
    label = str(path) if Path(path).expanduser().is_file() else str(file)
    content = _read_yaml(file, label)
    if "download" in content:
        LOGGER.warning(f"{label}: 'download' key ignored (this trainer never downloads or runs dataset scripts)")
    names = parse_names(content, label)
    root = _resolve_root(content, file, label)
    splits = {key: resolve_split(content, key, root, label) for key in SPLITS}
    return DataConfig(path=root, names=names, nc=len(names), yaml_file=Path(os.path.abspath(file)), **splits)
