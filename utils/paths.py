"""Run folders: runs/<task>/exp, exp2, exp3, ... never overwriting an earlier run."""
from __future__ import annotations

import os
from pathlib import Path


def increment_path(path: str | os.PathLike, exist_ok: bool = False, mkdir: bool = False) -> Path:
    """Return ``path`` if it is free (or ``exist_ok``), else the first free ``path2``, ``path3``, ...

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
        candidate = path if number == 1 else path.with_name(f"{stem}{number}{suffix}")
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
