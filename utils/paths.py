"""Output folders: where a run writes, and names from files made safe to use as folder names.

- Run folders: runs/<task>/exp, exp2, exp3, ... never overwriting an earlier run (``increment_path``).
- Names taken from files (class names of a model) become one safe path component (``safe_component``) and
  the folder they name must resolve inside the output folder (``inside``); ``crop_folder`` is detect.py's
  crops/<class>/ folder.
- A run folder that holds symbolic links is refused before a resumed run writes into it (``symlinks_in``);
  ``linked_part`` finds a link on the way from a folder to a file in it.

Files themselves are written, read and locked through utils.files.
"""
from __future__ import annotations

import os
from pathlib import Path

from utils.errors import UserError

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
ARCHIVE_SUFFIXES = (".zip", *TAR_SUFFIXES)  # what utils/archives.py unpacks


def archive_stem(name: str) -> str | None:
    """``name`` without its archive suffix (.zip, or a tar's), or None when it names no archive."""
    lower = name.lower()
    suffix = next((suffix for suffix in ARCHIVE_SUFFIXES if lower.endswith(suffix)), None)
    return name[: -len(suffix)] if suffix and len(name) > len(suffix) else None

MAX_COMPONENT = 100  # characters kept of a name used as a folder name
UNSAFE_CHARACTERS = '/\\:*?"<>|'  # separators here or on Windows, and characters Windows refuses in names


class OutsideFolderError(UserError):
    """A name from a file would place an output outside the folder the user asked for."""


def increment_path(path: str | os.PathLike, exist_ok: bool = False, mkdir: bool = False, sep: str = "") -> Path:
    """Return ``path`` if it is free (or ``exist_ok``), else the first free ``path2``, ``path3``, ... (``sep``
    between the name and the number).

    With ``mkdir`` the folder is created atomically (``os.mkdir`` fails if another process took the
    name first, and the next number is tried), so concurrent runs never share a folder.
    """
    path = Path(path)
    if exist_ok:
        if mkdir:
            path.mkdir(parents=True, exist_ok=True)
        return path
    stem, suffix = (path.stem, path.suffix) if path.suffix and not mkdir else (path.name, "")
    for number in range(1, 100000):
        candidate = path if number == 1 else path.with_name(f"{stem}{sep}{number}{suffix}")
        if candidate.exists():
            continue
        if not mkdir:
            return candidate
        candidate.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(candidate)
        except FileExistsError:  # another process took it between the check and the mkdir
            continue
        return candidate
    raise RuntimeError(f"no free run folder next to {path}")


# ---------------------------------------------------------------------- names from files

def safe_component(name, fallback: str) -> str:
    """``name`` as one file-name component: separators, control and Windows-reserved characters become
    "_", leading dots and spaces are dropped, at most MAX_COMPONENT characters; ``fallback`` (e.g. the class
    index) when nothing usable is left or ``name`` is not a string. "../../x" -> "_.._x", "/abs/x" -> "_abs_x"."""
    if not isinstance(name, str):
        return fallback
    cleaned = "".join("_" if ch in UNSAFE_CHARACTERS or not ch.isprintable() else ch for ch in name[:MAX_COMPONENT])
    cleaned = cleaned.lstrip(". ").rstrip(" ")
    return cleaned if cleaned and cleaned not in (".", "..") else fallback


def inside(folder: Path, *parts: str) -> Path:
    """``folder / parts``, refused (OutsideFolderError) unless it resolves inside ``folder`` (following any
    symbolic link already on disk)."""
    base = Path(folder).resolve()
    target = Path(folder).joinpath(*parts)
    if not target.resolve().is_relative_to(base):
        raise OutsideFolderError(f"{target}: resolves outside {folder}; refusing to write there")
    return target


def crop_folder(save_dir: Path, names, index: int) -> Path:
    """detect.py --save-crop's folder for class ``index``: crops/<class name as one safe component>, or
    crops/<index> when the name has nothing usable (or the index has no name)."""
    name = names[index] if 0 <= index < len(names) else None
    return inside(Path(save_dir) / "crops", safe_component(name, str(index)))


# ---------------------------------------------------------------------- links in run folders

def symlinks_in(folder: Path, subfolders: tuple[str, ...] = ("weights",)) -> list[str]:
    """Names of the symbolic links directly in ``folder`` and in its ``subfolders`` ("weights/last.pt")."""
    found = []
    for prefix in ("", *subfolders):
        where = Path(folder) / prefix if prefix else Path(folder)
        if prefix and (where.is_symlink() or not where.is_dir()):
            continue  # a linked subfolder is reported as an entry of the folder itself
        try:
            entries = list(os.scandir(where))
        except OSError:
            continue
        found += [f"{prefix}/{entry.name}" if prefix else entry.name for entry in entries if entry.is_symlink()]
    return sorted(found)


def linked_part(base: Path, path: Path) -> Path | None:
    """The first symbolic link on the way from ``base`` down to ``path`` (``path`` itself included; ``base`` and
    the folders above it are not looked at), or None. ``path`` must be ``base / relative parts``."""
    current = Path(base)
    for part in Path(path).relative_to(base).parts:
        current = current / part
        if current.is_symlink():
            return current
    return None
