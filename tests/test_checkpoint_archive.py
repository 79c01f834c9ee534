"""The pickle checks read the member torch.load reads: the data.pkl in the folder of a zip's FIRST entry; archives
with other folders (torch refuses them) or duplicate names are refused in one line naming the file."""
from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch

from utils.checkpoint import CheckpointError, load_checkpoint
from utils.yolov5_import import find_pickle, pickle_member

DECOY = b"\x80\x02}q\x00."  # an empty dict: a harmless pickle that a check could be fooled into reading


def torch_entries() -> list[tuple[str, bytes]]:
    """The entries of a real torch.save archive (folder "archive/"), data.pkl first as torch writes it."""
    buffer = io.BytesIO()
    torch.save({"format": "yolo-trainer/1", "weights": torch.zeros(3)}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        return [(name, archive.read(name)) for name in archive.namelist()]


def write_zip(path: Path, entries) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries:
            archive.writestr(name, data)
    return path


def decoy_before_the_real_pickle(path: Path) -> Path:
    """archive/version first (so torch's record folder is archive/), then other/data.pkl, then archive/data.pkl:
    a check taking the first */data.pkl listed would read the decoy."""
    entries = torch_entries()
    real = [entry for entry in entries if entry[0] == "archive/data.pkl"]
    rest = [entry for entry in entries if entry[0] != "archive/data.pkl"]
    return write_zip(path, [*rest, ("other/data.pkl", DECOY), *real])


def decoy_first(path: Path) -> Path:
    """other/data.pkl as the first entry: torch's record folder is other/, whatever archive/ holds."""
    return write_zip(path, [("other/data.pkl", DECOY), *torch_entries()])


@pytest.mark.parametrize("make, member", [(decoy_before_the_real_pickle, "archive/data.pkl"),
                                          (decoy_first, "other/data.pkl")])
def test_the_member_checked_is_the_one_torch_reads(tmp_path, make, member):
    path = make(tmp_path / "crafted.pt")
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        assert pickle_member(archive, str(path)) == member
        first_listed = next(name for name in names if name.endswith("/data.pkl"))
        assert first_listed != member or make is decoy_first  # the old rule read the decoy in the first case
    with pytest.raises(RuntimeError):
        torch.load(path, weights_only=True)  # torch itself refuses an archive with entries in two folders


@pytest.mark.parametrize("make", [decoy_before_the_real_pickle, decoy_first])
def test_an_archive_with_entries_in_several_folders_is_refused_in_one_line(tmp_path, make, capsys):
    path = make(tmp_path / "crafted.pt")
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and "outside its record folder" in message and "\n" not in message
    import cv2
    import numpy as np

    import detect

    cv2.imwrite(str(tmp_path / "image.jpg"), np.zeros((32, 32, 3), np.uint8))
    assert detect.main(["--weights", str(path), "--source", str(tmp_path / "image.jpg"), "--project",
                        str(tmp_path / "runs")]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and str(path) in error[0] and "outside its record folder" in error[0]


def test_a_single_folder_archive_of_any_name_is_read_from_that_folder(tmp_path):
    from tests.conftest import save_random_checkpoint

    saved = save_random_checkpoint(tmp_path / "saved.pt", ["a", "b"])
    with zipfile.ZipFile(saved) as archive:
        folder = archive.namelist()[0].split("/")[0]
        entries = [(f"mymodel/{name.split('/', 1)[1]}", archive.read(name)) for name in archive.namelist()]
    path = write_zip(tmp_path / "renamed.pt", entries)
    with zipfile.ZipFile(path) as archive:
        assert folder != "mymodel" and find_pickle(archive, str(path)).filename == "mymodel/data.pkl"
    assert load_checkpoint(path)["model"]["names"] == ["a", "b"]


def test_duplicate_names_and_folderless_archives_are_refused(tmp_path):
    entries = torch_entries()
    with pytest.warns(UserWarning, match="Duplicate name"):
        duplicated = write_zip(tmp_path / "duplicated.pt", [*entries, ("archive/data.pkl", DECOY)])
    with pytest.raises(CheckpointError, match="two entries under one name"):
        load_checkpoint(duplicated)
    # torch's reader looks names up case-blind: with archive/DATA.PKL beside archive/data.pkl the scan read one
    # pickle and torch.load the other (a hash bomb the scan never saw)
    cased = write_zip(tmp_path / "cased.pt", [*entries, ("archive/DATA.PKL", DECOY)])
    with pytest.raises(CheckpointError, match=r"two entries under one name \(letter case aside\)"):
        load_checkpoint(cased)
    flat = write_zip(tmp_path / "flat.pt", [("data.pkl", DECOY)])
    with pytest.raises(CheckpointError, match="first entry is in no folder"):
        load_checkpoint(flat)


def test_a_compressed_storage_or_a_zero_stride_view_is_refused_before_it_costs_memory(tmp_path):
    """torch.save stores tensor storages as they are: a deflated one (1.7 MB declaring 400 MB) is refused before
    torch.load inflates it. A zero-stride view of one value declaring 16384 x 16384 loads as a view, and is
    refused before anything converts it (``.float()``: 1 GB)."""
    buffer = io.BytesIO()
    torch.save({"format": "yolo-trainer/1", "weights": torch.zeros(1 << 16)}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as stored:
        entries = [(info, stored.read(info)) for info in stored.infolist()]
    packed = tmp_path / "packed.pt"
    with zipfile.ZipFile(packed, "w") as archive:
        for info, data in entries:
            archive.writestr(info.filename, data, zipfile.ZIP_DEFLATED if "/data/" in info.filename else
                             zipfile.ZIP_STORED)
    assert torch.load(packed, weights_only=True)["weights"].shape == (1 << 16,)  # torch itself would inflate it
    with pytest.raises(CheckpointError, match=r"tensor storage 'archive/data/0' is compressed"):
        load_checkpoint(packed)
    expanded = tmp_path / "expanded.pt"
    torch.save({"format": "yolo-trainer/1", "model": {"yaml": {}, "state_dict": {
        "w": torch.zeros(1, dtype=torch.float16).expand(16384, 16384)}}}, expanded)
    assert expanded.stat().st_size < 10_000
    with pytest.raises(CheckpointError, match=r"a tensor of 268435456 elements is a zero-stride or overlapping view "
                                              r"of a storage of 2 bytes"):
        load_checkpoint(expanded)
