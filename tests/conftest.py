"""Shared fixtures: the read-only ../shared folder (skipped cleanly when absent), tiny images."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def shared_path(*parts: str) -> Path:
    """Path inside ../shared, or skip the calling test when it is not there."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"../shared not available ({path} missing)")
    return path


@pytest.fixture
def shared():
    return shared_path
