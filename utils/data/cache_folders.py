"""Where the project keeps its caches outside a dataset's folders.

``user_cache_folder(kind)``: ``$YOLO_TRAINER_CACHE/<kind>``, by default ``~/.cache/yolo-trainer/<kind>``
(``labels``: label caches of datasets whose folder is read-only or not a dataset; ``images``: the
``--cache disk`` image stores). ``RAM_FOLDER``: the machine's shared-memory file system, where the
``--cache ram`` image store lives while a run uses it.
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_VARIABLE = "YOLO_TRAINER_CACHE"
RAM_FOLDER = Path("/dev/shm")


def user_cache_folder(kind: str) -> Path:
    configured = os.environ.get(CACHE_VARIABLE)
    root = Path(configured).expanduser() if configured else Path.home() / ".cache" / "yolo-trainer"
    return root / kind
