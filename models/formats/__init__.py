"""Export formats beyond TorchScript/ONNX/OpenVINO, one module each: its export, its backend and its metadata."""
from __future__ import annotations

import os
from pathlib import Path


def place_file(temp: Path, path: Path) -> None:
    """Give a checked temp file the name ``path`` (a rename in the same folder, then the folder synced)."""
    from utils.files import fsync_folder

    os.replace(temp, path)
    fsync_folder(Path(path).parent)


def check_flatbuffer_identifier(path: Path, identifier: bytes, kind: str) -> None:
    """Refuse a file whose flatbuffer identifier (bytes 4-8) is not ``identifier`` before a runtime parses it."""
    from models.backends import BackendError

    try:
        with open(path, "rb") as file:
            head = file.read(8)
    except OSError as error:
        raise BackendError(f"{path}: cannot read it ({error.strerror or error})") from None
    if head[4:8] != identifier:
        raise BackendError(f"{path}: not {kind} (no {identifier.decode()} identifier)")
