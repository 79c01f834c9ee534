from utils.paths import increment_path


def test_increment_path_never_reuses(tmp_path):
    first = increment_path(tmp_path / "exp", mkdir=True)
    second = increment_path(tmp_path / "exp", mkdir=True)
    third = increment_path(tmp_path / "exp", mkdir=True)
    assert [p.name for p in (first, second, third)] == ["exp", "exp2", "exp3"]
    assert all(p.is_dir() for p in (first, second, third))


def test_exist_ok_reuses(tmp_path):
    increment_path(tmp_path / "exp", mkdir=True)
    assert increment_path(tmp_path / "exp", exist_ok=True, mkdir=True).name == "exp"


def test_file_names_keep_their_suffix(tmp_path):
    (tmp_path / "crop.jpg").write_bytes(b"x")
    assert increment_path(tmp_path / "crop.jpg").name == "crop2.jpg"
