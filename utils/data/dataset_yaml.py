"""Dataset YAML (YOLOv5 format) -> ``DataConfig`` with every split resolved to existing paths.

Keys: ``path`` (dataset root; relative to the YAML file's folder, default that folder), ``train``,
``val`` and optional ``test`` (each a folder, a ``.txt`` list of image paths, an image file, or a
list of those; relative to ``path``; one starting with '../' that is not there is also looked for without that
'../', as YOLOv5 does for Roboflow's exports), ``names`` (a list, or a ``{id: name}`` dict with ids
0..nc-1; each a string of 1 to 256 characters, numbers are converted with a warning) and optional
``nc`` (must agree with ``names``; at most 100,000 classes). When ``path`` does not exist, a ``download`` key
that lists archives (URLs) is followed: they are fetched and unpacked safely (utils/data/dataset_download.py);
one that describes a dataset downloaded by hand converts it in place while train or val is missing; one that is
code is refused and never run. ``--data x.zip`` (or a tar) is a dataset and its YAML in one archive, unpacked once
into ../datasets/x beside the repository, as YOLOv5 takes it. Errors are ``DataConfigError`` naming the file, the key and the path
that was tried; values from the file are cut in messages. The file is read with the bounded YAML
loader (alias bombs refused).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from utils.errors import UserError, shorten
from utils.limits import MAX_CLASSES, MAX_NAME_LENGTH
from utils.paths import archive_stem
from utils.safe_yaml import read_yaml, yaml_reason

LOGGER = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = ROOT / "data"
DATASETS_DIR = ROOT.parent / "datasets"  # where YOLOv5 puts datasets: beside the repository
SPLITS = ("train", "val", "test")
REQUIRED_SPLITS = ("train", "val")
MAX_PATH_LENGTH = 4096  # characters in a path value (Linux PATH_MAX)


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
        content = read_yaml(file)
    except yaml.YAMLError as e:
        raise DataConfigError(f"{label}: invalid YAML ({yaml_reason(e)})") from None
    except OSError as e:
        raise DataConfigError(f"{label}: cannot read file ({e.strerror or e})") from None
    if not isinstance(content, dict):
        kind = type(content).__name__
        raise DataConfigError(f"{label}: expected a mapping of keys (path, train, val, names), got {kind}")
    return content


def parse_names(content: dict[str, Any], label: str) -> list[str]:
    """Class names from ``names`` (list or {id: name}) checked against the optional ``nc``."""
    names, nc = content.get("names"), content.get("nc")
    if nc is not None and (isinstance(nc, bool) or not isinstance(nc, int) or not 1 <= nc <= MAX_CLASSES):
        raise DataConfigError(f"{label}: nc: expected a positive integer (at most {MAX_CLASSES}), got {shorten(nc)}")
    if names is None:
        if nc is None:
            raise DataConfigError(f"{label}: names: missing (give a list of class names or an {{id: name}} mapping)")
        return [str(i) for i in range(nc)]
    if isinstance(names, dict):
        names = _names_by_id(names, label)
    elif not isinstance(names, list):
        raise DataConfigError(f"{label}: names: expected a list or an {{id: name}} mapping, got {type(names).__name__}")
    if not names:
        raise DataConfigError(f"{label}: names: empty (at least one class is needed)")
    if len(names) > MAX_CLASSES:
        raise DataConfigError(f"{label}: names: {len(names)} classes, more than the {MAX_CLASSES} supported")
    if nc is not None and nc != len(names):
        raise DataConfigError(f"{label}: nc: {nc} does not agree with names ({len(names)} names)")
    return _name_texts(names, label)


def _names_by_id(names: dict, label: str) -> list:
    ids = list(names)
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise DataConfigError(f"{label}: names: ids must be integers, got {shorten(ids)}")
    if sorted(ids) != list(range(len(ids))):
        raise DataConfigError(f"{label}: names: ids must be 0..{len(ids) - 1} without gaps, got {shorten(sorted(ids))}")
    return [names[i] for i in range(len(ids))]


def _name_texts(names: list, label: str) -> list[str]:
    """Each name as text: strings as they are, numbers converted (one warning), anything else refused."""
    converted = []
    for index, name in enumerate(names):
        number = isinstance(name, (int, float)) and not isinstance(name, bool) and \
            (isinstance(name, int) and abs(name) < 10 ** 18 or isinstance(name, float) and math.isfinite(name))
        if not (isinstance(name, str) or number):
            raise DataConfigError(f"{label}: names: class {index} must be a string, got {shorten(name)}")
        if number:
            converted.append(index)
        if not 0 < len(str(name)) <= MAX_NAME_LENGTH:
            raise DataConfigError(f"{label}: names: class {index} must have 1 to {MAX_NAME_LENGTH} characters, "
                                  f"got {shorten(name)}")
    if converted:
        LOGGER.warning(f"{label}: names: {len(converted)} class name(s) given as numbers, used as text "
                       f"(e.g. class {converted[0]}: {str(names[converted[0]])!r})")
    return [str(name) for name in names]


def _absolute(value, base: Path) -> Path:
    """``value`` (~ expanded) as an absolute path; relative paths are taken from ``base``."""
    path = Path(value).expanduser()
    return Path(os.path.abspath(path if path.is_absolute() else base / path))


def _check_path_text(value, key: str, label: str) -> None:
    """A path value must be a string without control characters, at most MAX_PATH_LENGTH long."""
    if not isinstance(value, (str, Path)):
        raise DataConfigError(f"{label}: {key}: expected a path, got {shorten(value)}")
    text = str(value)
    if len(text) > MAX_PATH_LENGTH or any(ord(char) < 32 for char in text):
        raise DataConfigError(f"{label}: {key}: not a usable path (control characters, or longer than "
                              f"{MAX_PATH_LENGTH} characters): {shorten(text)}")


def _resolve_root(content: dict[str, Any], file: Path, label: str, names: list[str] | None = None,
                  download_missing: bool = True) -> Path:
    folder = Path(os.path.abspath(file.parent))
    value = content.get("path")
    if value in (None, ""):
        return folder
    _check_path_text(value, "path", label)
    root = _absolute(value, folder)
    download = content.get("download")
    if download:
        from utils.data.dataset_download import by_hand, ensure_downloaded

        if not root.exists() or by_hand(download) and not _splits_exist(content, root):
            if not download_missing:
                raise DataConfigError(f"{label}: path: {root} is not ready and downloads are off (its download: key "
                                      "was not followed)")
            ensure_downloaded(root, download, label, names, ready=lambda: _splits_exist(content, root))
    if not root.is_dir():
        raise DataConfigError(f"{label}: path: {root} does not exist")
    return root


def _splits_exist(content: dict[str, Any], root: Path) -> bool:
    """Whether every path of train and val exists (values that are not paths count as there: resolve_split
    names them)."""
    for key in REQUIRED_SPLITS:
        value = content.get(key)
        for entry in value if isinstance(value, list) else [value]:
            if isinstance(entry, str) and entry and not split_path(entry, root).exists():
                return False
    return True


def split_path(entry: str, root: Path) -> Path:
    """A split's path ``entry`` resolved against ``root``; one starting with '../' that is not there is also looked
    for without that first '../', as YOLOv5 does (Roboflow's exports name ../train/images beside their data.yaml)."""
    source = _absolute(entry, root)
    if not source.exists() and entry.replace("\\", "/").startswith("../"):
        inside = _absolute(entry[3:], root)
        if inside.exists():
            LOGGER.info("%s: not found, using %s (a '../' path taken from the dataset folder, as YOLOv5 does)", source,
                        inside)
            return inside
    return source


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
        _check_path_text(entry, key, label)
        source = split_path(str(entry), root)
        if not source.exists():
            raise DataConfigError(f"{label}: {key}: {source} does not exist")
        sources.append(str(source))
    return sources


def load_data_config(path: str | Path, download: bool = True) -> DataConfig:
    """Read and check a dataset YAML; see the module docstring for the format. ``download=False``: a missing dataset
    is a DataConfigError instead of following its ``download:`` key."""
    given = Path(path).expanduser()
    archive = given.is_file() and archive_stem(given.name) is not None  # a dataset and its YAML in one archive
    if archive:
        from utils.data.dataset_download import unpack_dataset_archive

        file = unpack_dataset_archive(given, DATASETS_DIR, str(path))
        label = f"{path} ({file})"
    else:
        file = find_data_yaml(path)
        label = str(path) if given.is_file() else str(file)
    content = _read_yaml(file, label)
    names = parse_names(content, label)
    if archive:  # where it unpacked, whatever its path says, as YOLOv5 takes an archive
        if content.get("path") not in (None, "", "."):
            LOGGER.info("%s: path: %s not used: an archive's dataset is where it unpacked, as YOLOv5 takes it", label,
                        shorten(content["path"]))
        root = Path(os.path.abspath(file.parent))
    else:
        root = _resolve_root(content, file, label, names, download)
    splits = {key: resolve_split(content, key, root, label) for key in SPLITS}
    return DataConfig(path=root, names=names, nc=len(names), yaml_file=Path(os.path.abspath(file)), **splits)
