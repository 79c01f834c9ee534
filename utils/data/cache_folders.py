"""Where the project keeps its caches outside a dataset's folders.

``user_cache_folder(kind)``: ``$YOLO_TRAINER_CACHE/<kind>``, by default ``~/.cache/yolo-trainer/<kind>``
(``labels``: label caches of datasets whose folder is read-only or not a dataset; ``images``: the
``--cache disk`` image stores). ``RAM_FOLDER``: the machine's shared-memory file system, where the
``--cache ram`` image store lives while a run uses it.

``private_cache_folder(kind)``: the same folder, made this user's alone (0700) before anything is written in it:
caches hold a dataset's pixels and file names, which other users of the machine must not read.
"""
from __future__ import annotations

import os
from pathlib import Path

from utils.errors import UserError
from utils.private_folders import UnsafeFolder, private_folder

CACHE_VARIABLE = "YOLO_TRAINER_CACHE"
RAM_FOLDER = Path("/dev/shm")


class CacheFolderError(UserError):
    """A cache folder that this user does not own; one line."""


def user_cache_folder(kind: str) -> Path:
    configured = os.environ.get(CACHE_VARIABLE)
    root = Path(configured).expanduser() if configured else Path.home() / ".cache" / "yolo-trainer"
    return root / kind


def private_cache_folder(kind: str) -> Path:
    """``user_cache_folder(kind)`` made this user's alone (``utils.private_folders``: created 0700 whatever the
    umask, one of ours that others may read narrowed to 0700); one that others could change (another user's, or
    writable by others, or below such a folder) is refused with CacheFolderError."""
    try:
        return private_folder(user_cache_folder(kind))
    except UnsafeFolder as error:
        raise CacheFolderError(f"{error}: set {CACHE_VARIABLE} to a folder of your own") from None
