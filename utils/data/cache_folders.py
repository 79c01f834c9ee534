"""Where the project keeps its caches outside a dataset's folders.

``user_cache_folder(kind)``: ``$YOLO_TRAINER_CACHE/<kind>``, by default ``~/.cache/yolo-trainer/<kind>``
(``labels``: label caches of datasets whose folder is read-only or not a dataset; ``images``: the
``--cache disk`` image stores). ``RAM_FOLDER``: the machine's shared-memory file system, where the
``--cache ram`` image store lives while a run uses it.

``private_cache_folder(kind)``: the same folder, made this user's alone (0700) before anything is written in it:
caches hold a dataset's pixels and file names, which other users of the machine must not read.
"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from utils.errors import UserError

LOGGER = logging.getLogger(__name__)

CACHE_VARIABLE = "YOLO_TRAINER_CACHE"
RAM_FOLDER = Path("/dev/shm")
PRIVATE_MODE = 0o700


class CacheFolderError(UserError):
    """A cache folder that this user does not own; one line."""


def user_cache_folder(kind: str) -> Path:
    configured = os.environ.get(CACHE_VARIABLE)
    root = Path(configured).expanduser() if configured else Path.home() / ".cache" / "yolo-trainer"
    return root / kind


def private_cache_folder(kind: str) -> Path:
    """``user_cache_folder(kind)``, created 0700 (its root too when made here; an existing root is left as it is),
    whatever the umask. An existing one of this user's that others may enter is narrowed to 0700 (said once: it
    stays so); one owned by another user is refused (CacheFolderError)."""
    folder = user_cache_folder(kind)
    folder.parent.mkdir(mode=PRIVATE_MODE, parents=True, exist_ok=True)
    folder.mkdir(mode=PRIVATE_MODE, exist_ok=True)
    info = folder.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise CacheFolderError(f"{folder}: owned by user {info.st_uid}, not by this user ({os.getuid()}): set "
                               f"{CACHE_VARIABLE} to a folder of your own")
    if stat.S_IMODE(info.st_mode) & ~PRIVATE_MODE:
        os.chmod(folder, PRIVATE_MODE)
        LOGGER.info("%s: was mode %03o, others could read the caches in it: now %03o (this user's alone)", folder,
                    stat.S_IMODE(info.st_mode), PRIVATE_MODE)
    return folder
