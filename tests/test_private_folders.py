"""utils.private_folders: the project's cache folders are this user's alone (the kernels it loads, the images it
caches); a folder others could change is refused with the reason. Cases with another owner need root."""
from __future__ import annotations

import os
import stat

import pytest

from utils.private_folders import UnsafeFolder, private_folder

needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="giving a folder to another user needs root")
OTHER_UID = 65534  # nobody


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_created_private_with_its_parents(tmp_path):
    folder = private_folder(tmp_path / "a" / "b" / "kernels")
    assert folder.is_dir() and all(mode(p) == 0o700 for p in (folder, folder.parent, folder.parent.parent))
    assert private_folder(folder) == folder  # again: nothing to do


def test_one_of_ours_that_others_may_read_is_made_private(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    private_folder(folder)
    assert mode(folder) == 0o700


@pytest.mark.parametrize("bits", [0o775, 0o757])
def test_a_folder_others_may_write_is_refused(tmp_path, bits):
    folder = tmp_path / "kernels"
    folder.mkdir()
    os.chmod(folder, bits)
    with pytest.raises(UnsafeFolder, match=f"{folder} may be written by other users"):
        private_folder(folder)


def test_a_world_writable_parent_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeFolder, match=f"{shared} may be written by other users .*not sticky"):
        private_folder(shared / "yolo-trainer" / "kernels")
    assert not (shared / "yolo-trainer").exists()  # refused before anything was made
    os.chmod(shared, 0o1777)  # like /tmp: others cannot rename or remove what is ours inside it
    assert mode(private_folder(shared / "yolo-trainer" / "kernels")) == 0o700


def test_a_link_in_place_of_our_folder_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "kernels").symlink_to(elsewhere)
    with pytest.raises(UnsafeFolder, match="is a link"):
        private_folder(tmp_path / "kernels")


@needs_root
def test_a_folder_of_another_user_is_refused(tmp_path):
    folder = tmp_path / "kernels"
    folder.mkdir(mode=0o700)
    os.chown(folder, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeFolder, match=f"{folder} belongs to another user"):
        private_folder(folder)
    above = tmp_path / "home"
    above.mkdir(mode=0o755)
    os.chown(above, OTHER_UID, OTHER_UID)  # they could rename our folder away and put theirs in its place
    with pytest.raises(UnsafeFolder, match=f"{above} belongs to another user"):
        private_folder(above / "cache" / "kernels")


@needs_root
def test_native_kernels_in_a_refused_folder_fall_back_to_torch(tmp_path, monkeypatch, caplog):
    import logging

    import models.native as native

    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True, mode=0o700)
    os.chown(cache / "kernels", OTHER_UID, OTHER_UID)
    monkeypatch.setenv("YOLO_TRAINER_CACHE", str(cache))
    monkeypatch.delenv(native.REQUIRED, raising=False)
    native.bn_silu_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="models.native"):
            assert native.bn_silu_library() is None
    finally:
        native.bn_silu_library.cache_clear()
    assert "belongs to another user" in caplog.text and "training uses torch's operations" in caplog.text
