"""Datasets by name: data/coco128.yaml's archive fetched from a loopback server through YOLO_TRAINER_MIRROR and
unpacked beside the repository as YOLOv5 places it; an interrupted download restarts without fetching what is
done; archives that escape their folder, hold links or are bombs are refused before anything is written."""
from __future__ import annotations

import fcntl
import http.server
import json
import os
import shutil
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import make_tiny_dataset
from utils import archives, downloads
from utils.data import dataset_download
from utils.data.dataset_download import DatasetDownloadError, ensure_downloaded
from utils.data.dataset_yaml import load_data_config

ROOT = Path(__file__).resolve().parents[1]


class Files(http.server.BaseHTTPRequestHandler):
    files: dict = {}  # path -> bytes, or (bytes, announced length)
    requests: list = []

    def do_GET(self):  # noqa: N802
        self.requests.append(self.path)
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        body, announced = body if isinstance(body, tuple) else (body, len(body))
        self.send_response(200)
        self.send_header("Content-Type", "application/zip")
        self.send_header("Content-Length", str(announced))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve_as_mirror(handler, monkeypatch):
    """A loopback server of ``handler`` as YOLO_TRAINER_MIRROR, for the length of a test."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv(downloads.MIRROR_VARIABLE, f"http://127.0.0.1:{httpd.server_address[1]}")
    yield handler
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def mirror(monkeypatch):
    Files.files, Files.requests = {}, []
    yield from serve_as_mirror(Files, monkeypatch)


def zip_folder(folder: Path, prefix: str, extra=()) -> bytes:
    """A zip of ``folder`` under ``prefix/`` (as coco128.zip holds coco128/...), plus raw (ZipInfo, bytes)."""
    archive = folder.parent / f"{prefix}.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as out:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                out.write(path, f"{prefix}/{path.relative_to(folder).as_posix()}")
        for info, data in extra:
            out.writestr(info, data)
    return archive.read_bytes()


def coco128_standin(tmp_path: Path) -> bytes:
    """coco128.zip's layout (coco128/images/train2017, coco128/labels/train2017) from our own tiny images."""
    data = make_tiny_dataset(tmp_path / "made")
    tree = tmp_path / "standin"
    for kind in ("images", "labels"):
        shutil.copytree(data.parent / kind / "train", tree / kind / "train2017")
    return zip_folder(tree, "coco128")


def repo_copy_with(tmp_path: Path, name: str) -> Path:
    """data/NAME in a copy of the layout (repo/data/NAME), so its '../../datasets' lands in tmp_path."""
    (tmp_path / "repo" / "data").mkdir(parents=True)
    return Path(shutil.copy(ROOT / "data" / name, tmp_path / "repo" / "data" / name))


def test_coco128_by_name_is_fetched_once_and_loads(tmp_path, mirror):
    mirror.files["/coco128.zip"] = coco128_standin(tmp_path)
    config = load_data_config(repo_copy_with(tmp_path, "coco128.yaml"))
    root = tmp_path / "datasets" / "coco128"
    assert config.path == root and config.nc == 80 and config.names[:2] == ["person", "bicycle"]
    assert len(list((root / "images" / "train2017").iterdir())) == 8 and config.train == config.val
    assert sorted(p.name for p in (tmp_path / "datasets").iterdir()) == [".coco128.download.lock", "coco128"]
    load_data_config(tmp_path / "repo" / "data" / "coco128.yaml")
    assert mirror.requests == ["/coco128.zip"]  # there already: not fetched again


def test_an_interrupted_download_never_looks_like_a_dataset_and_restarts_where_it_stopped(tmp_path, mirror):
    labels = tmp_path / "labels-tree"
    (labels / "labels").mkdir(parents=True)
    (labels / "labels" / "a.txt").write_text("0 0.5 0.5 0.1 0.1\n")
    images = tmp_path / "images-tree"
    (images / "train").mkdir(parents=True)
    (images / "train" / "a.jpg").write_bytes(b"\xff\xd8 not really")
    mirror.files["/labels.zip"] = zip_folder(labels, "set")
    whole = zip_folder(images, "train-images")
    mirror.files["/images.zip"] = (whole[: len(whole) // 2], len(whole))  # the connection drops half-way
    download = [{"url": "https://example.org/a/labels.zip"}, {"url": "https://example.org/b/images.zip",
                                                              "into": "set/images"}]
    root = tmp_path / "datasets" / "set"
    with pytest.raises(DatasetDownloadError, match="truncated|broke off"):
        ensure_downloaded(root, download, "set.yaml")
    assert not root.exists()  # half a dataset is never in place
    staging = tmp_path / "datasets" / ".set.download"
    assert len(list(staging.glob("archives/*/labels.zip.unpacked"))) == 1 and not list(staging.rglob("*.part"))
    mirror.files["/images.zip"] = whole
    mirror.requests.clear()
    ensure_downloaded(root, download, "set.yaml")
    assert mirror.requests == ["/images.zip"]  # the labels archive was not fetched again
    assert (root / "labels" / "a.txt").is_file() and (root / "images" / "train-images" / "train" / "a.jpg").is_file()
    assert not staging.exists()


@pytest.mark.parametrize("member, message", [
    ("../escaped.txt", "outside the dataset folder"),
    ("/abs.txt", "outside the dataset folder"),
    ("ok/../../escaped.txt", "outside the dataset folder"),
    ("link", "is a link"),
])
def test_an_archive_that_escapes_or_links_is_refused_before_writing(tmp_path, mirror, member, message):
    info = zipfile.ZipInfo(member)
    if member == "link":
        info.external_attr = 0o120777 << 16  # a symbolic link to /etc
    folder = tmp_path / "tree" / "x"
    folder.mkdir(parents=True)
    (folder / "fine.txt").write_text("fine")
    mirror.files["/bad.zip"] = zip_folder(tmp_path / "tree", "x", [(info, "/etc" if member == "link" else "x")])
    with pytest.raises(DatasetDownloadError, match=message):
        ensure_downloaded(tmp_path / "datasets" / "x", "https://example.org/bad.zip", "x.yaml")
    assert not (tmp_path / "datasets" / "x").exists() and not (tmp_path / "escaped.txt").exists()
    assert not list((tmp_path / "datasets").rglob("fine.txt"))  # nothing unpacked


def test_a_yamls_path_cannot_send_the_download_where_files_become_code(tmp_path, mirror, monkeypatch):
    """path: ~/.local/lib/python3.11/site-packages/usercustomize (run at every Python start), ~/.ssh, a folder in
    a site-packages or /etc: refused before anything is written or fetched; beside importable modules, an archive
    with a Python package at its top (a folder named 'json' would shadow the standard library) is not moved in."""
    import site

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    folder = tmp_path / "tree" / "usercustomize"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("print('ran')\n")
    mirror.files["/usercustomize.zip"] = zip_folder(folder, "usercustomize")  # usercustomize/__init__.py
    fake_site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(fake_site)])
    for root, reason in ((home / ".local" / "lib" / "python3.11" / "site-packages" / "usercustomize", "hidden folder"),
                         (home / ".ssh", "hidden folder .ssh"), (fake_site / "usercustomize", "Python installation"),
                         (Path("/etc/cron.d/dataset"), "system folder /etc"),
                         (Path("/var/lib/dataset"), "system folder /var")):
        with pytest.raises(DatasetDownloadError, match=f"the download is not unpacked there \\(it is inside|in the "
                                                       f"{reason.split()[0]}"):
            ensure_downloaded(root, "https://example.org/usercustomize.zip", "evil.yaml")
        assert not root.exists() and not root.parent.exists() or root.parent in (Path("/etc/cron.d"), Path("/var/lib"))
    assert mirror.requests == [] and not home.exists() and not fake_site.exists()
    for allowed in (Path("/usr/src/datasets/coco128"), Path("/var/tmp/x/coco128"), tmp_path / "datasets" / "coco128"):
        dataset_download.check_download_root(allowed, "coco128.yaml")  # YOLOv5's Docker layout: /usr/src/app, /usr/src/datasets
    with pytest.raises(DatasetDownloadError, match=r"put Python code at the top of the dataset folder \('__init__.py'\)"):
        ensure_downloaded(tmp_path / "repo" / "usercustomize", "https://example.org/usercustomize.zip", "evil.yaml")
    assert not (tmp_path / "repo" / "usercustomize").exists()


def test_a_json_file_cut_short_is_not_placed_to_fail_every_later_run(tmp_path, mirror):
    """A .json the download places (Objects365's annotations) is read to its end first: one cut short is refused
    and not kept, so the next start fetches it again instead of failing the conversion each time."""
    folder = tmp_path / "tree" / "set"
    folder.mkdir(parents=True)
    (folder / "readme.txt").write_text("a dataset")
    mirror.files["/set.zip"] = zip_folder(folder, "set")
    whole = json.dumps({"images": [{"id": i, "file_name": f"{i}.jpg"} for i in range(200)], "annotations": []})
    mirror.files["/ann.json"] = whole[: len(whole) // 2].encode()  # served whole, as it is: a broken file
    download = [{"url": "https://example.org/set.zip"}, {"url": "https://example.org/ann.json", "into": "set"}]
    with pytest.raises(DatasetDownloadError, match=r"ann.json: the download is not usable \(.*(truncated|malformed)"):
        ensure_downloaded(tmp_path / "datasets" / "set", download, "x.yaml")
    assert not list((tmp_path / "datasets").rglob("ann.json")) and not (tmp_path / "datasets" / "set").exists()
    mirror.files["/ann.json"] = whole.encode()
    ensure_downloaded(tmp_path / "datasets" / "set", download, "x.yaml")
    assert json.loads((tmp_path / "datasets" / "set" / "ann.json").read_text()) == json.loads(whole)


def test_a_zip_bomb_and_a_full_disk_are_refused_before_writing(tmp_path, mirror, monkeypatch):
    folder = tmp_path / "tree" / "bomb"
    folder.mkdir(parents=True)
    (folder / "zeros.bin").write_bytes(bytes(40 << 20))  # 40 MB of zeros: ~40 kB deflated
    mirror.files["/bomb.zip"] = zip_folder(tmp_path / "tree", "bomb")
    with pytest.raises(DatasetDownloadError, match=r"more than 100x: a zip bomb"):
        ensure_downloaded(tmp_path / "datasets" / "bomb", "https://example.org/bomb.zip", "bomb.yaml")
    assert not list((tmp_path / "datasets").rglob("zeros.bin"))
    (folder / "zeros.bin").write_bytes(b"12345678" * 1000)
    mirror.files["/bomb.zip"] = zip_folder(tmp_path / "tree", "bomb")
    monkeypatch.setattr(archives.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 100))
    with pytest.raises(DatasetDownloadError, match=r"unpacks to 0.0[0-9] GB \(\d+ entries\), .* has 0.00 GB free"):
        ensure_downloaded(tmp_path / "datasets" / "bomb", "https://example.org/bomb.zip", "bomb.yaml")


@pytest.mark.parametrize("value", ["curl https://x/a.zip | unzip", "https://x/a.rar", [{"url": "https://x/a.zip",
                                                                                      "into": "../up"}],
                                   [{"url": "https://x/a.tgz", "from": "/etc"}],
                                   [{"url": "https://x/a.zip", "run": "rm -rf /"}], {"into": "x"}])
def test_download_values_that_are_not_archives_are_refused(tmp_path, value):
    with pytest.raises(DatasetDownloadError):
        ensure_downloaded(tmp_path / "datasets" / "x", value, "x.yaml")
    assert not (tmp_path / "datasets").exists()


def test_the_project_yamls_describe_their_downloads_as_data():
    from utils.data.dataset_download import parse_download
    from utils.safe_yaml import read_yaml

    for name, count, classes in (("coco128.yaml", 1, 80), ("coco.yaml", 4, 80), ("VOC.yaml", 5, 20),
                                  ("VisDrone.yaml", 7, 10), ("SKU-110K.yaml", 2, 1),
                                  ("GlobalWheat2020.yaml", 2, 1), ("Objects365.yaml", 98, 365),
                                  ("xView.yaml", 2, 60), ("Argoverse.yaml", 2, 8)):
        content = read_yaml(ROOT / "data" / name)
        assert len(parse_download(content["download"], name)) == count and len(content["names"]) == classes
        assert content["path"].startswith("../../datasets/")


def voc_zip(folder: Path, year: str, splits: dict, names=("cat", "dog")) -> bytes:
    """A VOCdevkit/VOC<year> zip (Annotations, JPEGImages, ImageSets/Main) with one 64x48 image per stem; the
    first object of each image is 'difficult' when its stem ends with 'd'."""
    import cv2
    import numpy as np

    root = folder / f"voc{year}" / "VOCdevkit" / f"VOC{year}"
    for sub in ("Annotations", "JPEGImages", "ImageSets/Main"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for split, stems in splits.items():
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(f"{s}\n" for s in stems))
        for index, stem in enumerate(stems):
            cv2.imwrite(str(root / "JPEGImages" / f"{stem}.jpg"), np.full((48, 64, 3), 90, np.uint8))
            objects = "".join(f"<object><name>{names[k % 2]}</name><difficult>{int(k == 0 and stem.endswith('d'))}"
                              f"</difficult><bndbox><xmin>{5 + k}</xmin><ymin>5</ymin><xmax>30</xmax><ymax>40</ymax>"
                              "</bndbox></object>" for k in range(2))
            (root / "Annotations" / f"{stem}.xml").write_text(
                f"<annotation><filename>{stem}.jpg</filename><size><width>64</width><height>48</height>"
                f"<depth>3</depth></size>{objects}</annotation>")
    return zip_folder(folder / f"voc{year}" / "VOCdevkit", "VOCdevkit")


def test_voc_by_name_is_fetched_and_imported_with_yolov5s_split(tmp_path, mirror):
    mirror.files["/VOCtrainval_06-Nov-2007.zip"] = voc_zip(tmp_path / "a", "2007", {"train": ["000001", "000002d"],
                                                                                     "val": ["000003"]})
    mirror.files["/VOCtest_06-Nov-2007.zip"] = voc_zip(tmp_path / "b", "2007", {"test": ["000004", "000005"]})
    mirror.files["/VOCtrainval_11-May-2012.zip"] = voc_zip(tmp_path / "c", "2012", {"train": ["2008_000001"],
                                                                                     "val": ["2008_000002"]})
    config = load_data_config(repo_copy_with(tmp_path, "VOC.yaml"))
    root = tmp_path / "datasets" / "VOC"
    assert config.path == root and config.nc == 20 and config.names[7] == "cat"
    images = {split: sorted(p.stem for p in (root / "images" / split).iterdir()) for split in ("train", "val", "test")}
    assert images == {"train": ["000001", "000002d", "2008_000001"], "val": ["000003", "2008_000002"],
                      "test": ["000004", "000005"]}
    assert config.train == [str(root / "images" / "train"), str(root / "images" / "val")]
    assert config.val == [str(root / "images" / "test")]
    labels = (root / "labels" / "train" / "000002d.txt").read_text().splitlines()
    assert len(labels) == 1 and labels[0].startswith("11 ")  # the difficult cat left out; dog is class 11
    assert (root / "labels" / "train" / "000001.txt").read_text().splitlines()[0].startswith("7 ")  # cat: 7


def visdrone_zip(folder: Path, split: str, annotations: dict | None) -> bytes:
    """VisDrone2019-DET-SPLIT.zip's layout: images/NAME.jpg (64x32) and, unless None, annotations/NAME.txt."""
    import cv2

    root = folder / f"VisDrone2019-DET-{split}"
    (root / "images").mkdir(parents=True)
    for stem, text in (annotations or {"c0": None}).items():
        cv2.imwrite(str(root / "images" / f"{stem}.jpg"), np.full((32, 64, 3), 90, np.uint8))
        if annotations is not None:
            (root / "annotations").mkdir(exist_ok=True)
            (root / "annotations" / f"{stem}.txt").write_text(text)
    return zip_folder(root, root.name)


def test_visdrone_by_name_is_fetched_and_labelled_in_yolov5s_layout(tmp_path, mirror):
    for split, annotations in (("train", {"t0": "8,4,16,8,1,4,0,0\n0,0,4,4,0,0,0,0\n", "t1": "0,0,8,8,1,10,0,0\n"}),
                               ("val", {"v0": "32,16,16,8,1,1,0,0,\n"}), ("test-dev", {"d0": ""}),
                               ("test-challenge", None)):
        mirror.files[f"/VisDrone2019-DET-{split}.zip"] = visdrone_zip(tmp_path / split, split, annotations)
    config = load_data_config(repo_copy_with(tmp_path, "VisDrone.yaml"))
    root = tmp_path / "datasets" / "VisDrone"
    assert config.path == root and config.nc == 10 and config.names[3] == "car" and config.names[9] == "motor"
    assert config.train == [str(root / "VisDrone2019-DET-train" / "images")]
    assert config.val == [str(root / "VisDrone2019-DET-val" / "images")]
    train_labels = root / "VisDrone2019-DET-train" / "labels"
    assert (train_labels / "t0.txt").read_text() == "3 0.250000 0.250000 0.250000 0.250000\n"  # the ignored region out
    assert (train_labels / "t1.txt").read_text().startswith("9 ")  # category 10, motor: class 9
    assert (root / "VisDrone2019-DET-val" / "labels" / "v0.txt").read_text().startswith("0 0.625000 0.625000 ")
    assert (root / "VisDrone2019-DET-test-dev" / "labels" / "d0.txt").read_text() == ""
    assert (root / "VisDrone2019-DET-test-challenge" / "images" / "c0.jpg").is_file()
    assert sorted(p.name for p in (tmp_path / "datasets").iterdir()) == [".VisDrone.download.lock", "VisDrone"]


def test_global_wheat_by_name_puts_each_source_under_images_and_its_labels_under_labels(tmp_path, mirror):
    """The images archive holds a folder per source (and a .json each) at its top, the labels archive labels/NAME:
    YOLOv5's layout after its moves, images/NAME beside labels/NAME."""
    import cv2

    images, labels = tmp_path / "wheat" / "images", tmp_path / "wheat" / "labels"
    sources = ("arvalis_1", "arvalis_2", "arvalis_3", "ethz_1", "rres_1", "inrae_1", "usask_1", "utokyo_1", "utokyo_2",
               "nau_1", "uq_1")
    for source in sources:
        (images / source).mkdir(parents=True)
        cv2.imwrite(str(images / source / f"{source}_0.png"), np.full((32, 32, 3), 90, np.uint8))
        (images / f"{source}.json").write_text("{}")
        (labels / "labels" / source).mkdir(parents=True)
        (labels / "labels" / source / f"{source}_0.txt").write_text("0 0.5 0.5 0.25 0.25\n")
    mirror.files["/global-wheat-codalab-official.zip"] = _zip_contents(images)
    mirror.files["/GlobalWheat2020_labels.zip"] = _zip_contents(labels)
    config = load_data_config(repo_copy_with(tmp_path, "GlobalWheat2020.yaml"))
    root = tmp_path / "datasets" / "GlobalWheat2020"
    assert config.path == root and config.names == ["wheat_head"] and len(config.train) == 7
    assert config.val == [str(root / "images" / "ethz_1")]
    for source in sources:
        assert (root / "images" / source / f"{source}_0.png").is_file()
        assert (root / "labels" / source / f"{source}_0.txt").read_text() == "0 0.5 0.5 0.25 0.25\n"
    assert sorted(p.name for p in root.iterdir()) == ["images", "labels"]


def _zip_contents(folder: Path) -> bytes:
    """A zip of what ``folder`` holds, at the archive's top (no folder of its own around it)."""
    archive = folder.parent / f"{folder.name}.top.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as out:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                out.write(path, path.relative_to(folder).as_posix())
    return archive.read_bytes()


def tar_folder(folder: Path, prefix: str, mode: str = "w:gz", extra=()) -> bytes:
    """A tar of ``folder`` under ``prefix/`` (gzip by default), plus raw (TarInfo, bytes or None) members."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as out:
        for path in sorted(folder.rglob("*")):
            out.add(path, f"{prefix}/{path.relative_to(folder).as_posix()}", recursive=False)
        for info, data in extra:
            out.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def test_sku110k_by_name_is_unpacked_renamed_and_labelled_as_yolov5_does(tmp_path, mirror):
    """SKU110K_fixed.tar.gz: its SKU110K_fixed/ becomes ../datasets/SKU-110K, the CSVs become labels/ (one class,
    normalised to each row's image size) and train.txt/val.txt/test.txt list ./images/NAME per split."""
    import cv2

    tree = tmp_path / "sku" / "SKU110K_fixed"
    (tree / "images").mkdir(parents=True)
    (tree / "annotations").mkdir()
    for name in ("train_0.jpg", "train_1.jpg", "val_0.jpg", "test_0.jpg"):
        cv2.imwrite(str(tree / "images" / name), np.full((40, 80, 3), 90, np.uint8))
    (tree / "annotations" / "annotations_train.csv").write_text(
        "train_1.jpg,8,4,24,12,object,80,40\ntrain_0.jpg,0,0,40,20,object,80,40\ntrain_0.jpg,70,30,90,50,object,80,40\n"
        "train_0.jpg,10,10,10,30,object,80,40\n")
    (tree / "annotations" / "annotations_val.csv").write_text("val_0.jpg,40,20,80,40,object,80,40\n"
                                                              "gone.jpg,1,1,5,5,object,80,40\n")
    (tree / "annotations" / "annotations_test.csv").write_text("test_0.jpg,0,0,80,40,object,80,40\n")
    mirror.files["/SKU110K_fixed.tar.gz"] = tar_folder(tree, "SKU110K_fixed")
    config = load_data_config(repo_copy_with(tmp_path, "SKU-110K.yaml"))
    root = tmp_path / "datasets" / "SKU-110K"
    assert config.path == root and config.nc == 1 and config.names == ["object"]
    assert config.train == [str(root / "train.txt")] and config.test == [str(root / "test.txt")]
    assert (root / "train.txt").read_text() == "./images/train_0.jpg\n./images/train_1.jpg\n"
    assert (root / "val.txt").read_text() == "./images/val_0.jpg\n"  # gone.jpg is not in the archive
    assert (root / "labels" / "train_0.txt").read_text().splitlines() == [
        "0 0.250000 0.250000 0.500000 0.500000", "0 0.937500 0.875000 0.125000 0.250000"]  # clipped; no-area out
    assert (root / "labels" / "train_1.txt").read_text() == "0 0.200000 0.200000 0.200000 0.200000\n"
    assert sorted(p.name for p in root.iterdir()) == ["annotations", "images", "labels", "test.txt", "train.txt",
                                                      "val.txt"]
    assert sorted(p.name for p in (tmp_path / "datasets").iterdir()) == [".SKU-110K.download.lock", "SKU-110K"]


@pytest.mark.parametrize("member, message", [("link", "is not a file or folder"), ("../up.txt", "outside"),
                                             ("/abs.txt", "outside"), ("fifo", "is not a file or folder")])
def test_a_tar_that_escapes_or_links_is_refused_and_leaves_nothing(tmp_path, mirror, member, message):
    import tarfile

    folder = tmp_path / "tree" / "t"
    folder.mkdir(parents=True)
    (folder / "ok.txt").write_text("ok")
    info = tarfile.TarInfo(member)
    if member == "link":
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    elif member == "fifo":
        info.type = tarfile.FIFOTYPE
    else:
        info.size = 2
    mirror.files["/t.tar.gz"] = tar_folder(folder, "t", extra=[(info, b"no" if info.size else None)])
    with pytest.raises(DatasetDownloadError, match=message):
        ensure_downloaded(tmp_path / "datasets" / "t", "https://example.org/t.tar.gz", "t.yaml")
    assert not list((tmp_path / "datasets").rglob("ok.txt")) and not (tmp_path / "datasets" / "up.txt").exists()
    assert not list((tmp_path / "datasets").rglob("*.unpack"))


def test_a_tar_bomb_a_full_disk_and_a_missing_from_folder_are_one_line(tmp_path, mirror, monkeypatch):
    folder = tmp_path / "tree" / "b"
    folder.mkdir(parents=True)
    (folder / "zeros.bin").write_bytes(bytes(8 << 20))  # 8 MB of zeros: a ~8 KB .tar.xz
    mirror.files["/b.tar.xz"] = tar_folder(folder, "b", mode="w:xz")
    with pytest.raises(DatasetDownloadError, match="more than 100x: a bomb"):
        ensure_downloaded(tmp_path / "datasets" / "b", "https://example.org/b.tar.xz", "b.yaml")
    assert not list((tmp_path / "datasets").rglob("zeros.bin"))
    (folder / "zeros.bin").write_bytes(b"12345678" * 1000)
    mirror.files["/b.tar"] = tar_folder(folder, "b", mode="w")
    disk_usage = shutil.disk_usage
    monkeypatch.setattr(archives.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 100))
    with pytest.raises(DatasetDownloadError, match=r"unpacks to more than 0.0[0-9] GB \(\d+ entries\), .* had 0.00 GB free"):
        ensure_downloaded(tmp_path / "datasets" / "b", "https://example.org/b.tar", "b.yaml")
    monkeypatch.setattr(archives.shutil, "disk_usage", disk_usage)
    with pytest.raises(DatasetDownloadError, match="b.tar holds no folder 'elsewhere' \\(its from:\\)"):
        ensure_downloaded(tmp_path / "datasets" / "b", [{"url": "https://example.org/b.tar", "from": "elsewhere",
                                                         "into": "b"}], "b.yaml")
    assert not (tmp_path / "datasets" / "b").exists()


class Ranges(http.server.BaseHTTPRequestHandler):
    """One archive with a strong ETag; Range requests honoured when If-Range names the current ETag; the first
    ``cut`` answers stop after half of what they announce (a dropped connection)."""
    body, etag, cut, requests = b"", '"v1"', 0, []

    def do_GET(self):  # noqa: N802
        type(self).requests.append({key: self.headers.get(key) for key in ("Range", "If-Range")})
        body, status, start = self.body, 200, 0
        asked = self.headers.get("Range", "")
        if asked.startswith("bytes=") and self.headers.get("If-Range") == self.etag:
            start, status = int(asked[6:].rstrip("-")), 206
        self.send_response(status)
        self.send_header("Content-Type", "application/zip")
        self.send_header("ETag", self.etag)
        self.send_header("Content-Length", str(len(body) - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.end_headers()
        part = body[start:]
        if type(self).cut:
            type(self).cut -= 1
            part = part[: len(part) // 2]
        self.wfile.write(part)

    def log_message(self, *args):
        pass


@pytest.fixture
def ranges(monkeypatch):
    Ranges.requests, Ranges.cut, Ranges.etag = [], 0, '"v1"'
    yield from serve_as_mirror(Ranges, monkeypatch)


def cut_archive(tmp_path, ranges, seed: int, size: int) -> tuple[Path, Path]:
    """(the archived folder, the dataset root): a zip of ``size`` incompressible bytes served by ``ranges``, whose
    first answer drops the connection half-way, and a first ensure_downloaded that stops there."""
    tree = tmp_path / "tree" / "big"
    tree.mkdir(parents=True)
    (tree / "noise.bin").write_bytes(np.random.default_rng(seed).bytes(size))
    ranges.body = zip_folder(tree, "big")
    ranges.cut = 1
    root = tmp_path / "datasets" / "big"
    with pytest.raises(DatasetDownloadError, match="broke off|truncated"):
        ensure_downloaded(root, "https://example.org/big.zip", "big.yaml")
    return tree, root


def test_an_interrupted_archive_resumes_with_a_range_request(tmp_path, ranges):
    tree, root = cut_archive(tmp_path, ranges, 0, 400_000)
    partial, = (tmp_path / "datasets" / ".big.download" / "archives").glob("*/.big.zip.partial")
    assert partial.stat().st_size == len(ranges.body) // 2
    ensure_downloaded(root, "https://example.org/big.zip", "big.yaml")
    assert ranges.requests[1] == {"Range": f"bytes={len(ranges.body) // 2}-", "If-Range": '"v1"'}
    assert (root / "noise.bin").read_bytes() == (tree / "noise.bin").read_bytes()
    assert not (tmp_path / "datasets" / ".big.download").exists()


def test_a_changed_archive_is_fetched_whole_instead_of_resumed(tmp_path, ranges):
    tree, root = cut_archive(tmp_path, ranges, 1, 300_000)
    (tree / "noise.bin").write_bytes(np.random.default_rng(2).bytes(300_000))  # a new release of the archive
    ranges.body, ranges.etag = zip_folder(tree, "big"), '"v2"'
    ensure_downloaded(root, "https://example.org/big.zip", "big.yaml")  # If-Range no longer matches: 200, whole
    assert ranges.requests[1]["If-Range"] == '"v1"'
    assert (root / "noise.bin").read_bytes() == (tree / "noise.bin").read_bytes()


def test_a_half_unpacked_archive_left_by_a_killed_start_is_removed(tmp_path, mirror):
    mirror.files["/coco128.zip"] = coco128_standin(tmp_path)
    staging = tmp_path / "datasets" / ".coco128.download"
    stale = staging / ".coco128.zip.k1ll3d.unpack"
    (stale / "coco128" / "images").mkdir(parents=True)
    (stale / "coco128" / "images" / "half.jpg").write_bytes(b"x" * 1000)
    load_data_config(repo_copy_with(tmp_path, "coco128.yaml"))
    assert not staging.exists() and (tmp_path / "datasets" / "coco128" / "images" / "train2017").is_dir()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to act as another user")
def test_another_users_lock_file_in_a_shared_folder_is_used_not_a_traceback(request):
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="shared-datasets-"))  # in /tmp: pytest's own folders are 0700
    request.addfinalizer(lambda: shutil.rmtree(shared, ignore_errors=True))
    os.chmod(shared, 0o1777)
    lock = shared / ".set.download.lock"
    lock.write_text("")
    os.chmod(lock, 0o644)  # root's, as another user's would be: we may read it, not write it
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the other user: nobody
        os.close(read)
        try:
            os.setgid(65534)
            os.setuid(65534)
            handle = dataset_download._open_lock(lock, "set.yaml")
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(write, b"locked")
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            os.write(write, repr(error).encode()[:500])
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    with os.fdopen(read, "rb") as pipe:
        assert pipe.read() == b"locked"


def test_the_member_count_is_checked_before_the_directory_is_parsed(tmp_path, monkeypatch):
    archive = tmp_path / "many.zip"
    with zipfile.ZipFile(archive, "w") as out:
        for index in range(10):
            out.writestr(f"many/{index}.txt", "x")
    assert archives.declared_members(archive) == 10
    monkeypatch.setattr(archives, "MAX_MEMBERS", 5)
    monkeypatch.setattr(zipfile, "ZipFile", lambda *args, **kwargs: pytest.fail("the directory was parsed"))
    with pytest.raises(downloads.DownloadError, match="10 entries, more than 5"):
        archives.check_zip(archive, tmp_path)


def test_many_empty_entries_count_the_disk_they_take(tmp_path, monkeypatch):
    """200 empty files declare 0 bytes, yet each takes a block and an inode: counted at ENTRY_BYTES against the
    free space, in a zip (before anything is written) and in a tar (as it is unpacked)."""
    import tarfile

    with zipfile.ZipFile(tmp_path / "empty.zip", "w") as out:
        for index in range(200):
            out.writestr(f"empty/{index}.txt", "")
    with tarfile.open(tmp_path / "empty.tar", "w") as out:
        for index in range(200):
            out.addfile(tarfile.TarInfo(f"empty/{index}.txt"))
    free = 199 * archives.ENTRY_BYTES
    monkeypatch.setattr(archives.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(free, 0, free))
    with pytest.raises(downloads.DownloadError, match=r"unpacks to 0.00 GB \(200 entries\)"):
        archives.check_zip(tmp_path / "empty.zip", tmp_path)
    with pytest.raises(downloads.DownloadError, match=r"unpacks to more than 0.00 GB \(200 entries\)"):
        archives.extract_tar(tmp_path / "empty.tar", tmp_path)
    free = 201 * archives.ENTRY_BYTES
    assert len(archives.check_zip(tmp_path / "empty.zip", tmp_path)) == 200


def test_the_zip64_member_count_is_read(tmp_path):
    archive = tmp_path / "zip64.zip"
    with zipfile.ZipFile(archive, "w") as out:
        for index in range(70_000):  # past 65,535 entries: only the zip64 record holds the count
            out.writestr(zipfile.ZipInfo(f"{index}"), b"")
    assert archives.declared_members(archive) == 70_000


def test_a_colon_in_a_member_name_is_a_legal_name_here(tmp_path):
    archive = tmp_path / "colon.zip"
    with zipfile.ZipFile(archive, "w") as out:
        out.writestr("set:v2/labels/a.txt", "0 0.5 0.5 0.1 0.1\n")
    assert [member.filename for member in archives.check_zip(archive, tmp_path)] == ["set:v2/labels/a.txt"]


def test_a_range_answer_for_other_bytes_is_refused_and_the_next_start_begins_again(tmp_path, ranges, monkeypatch):
    tree, root = cut_archive(tmp_path, ranges, 3, 200_000)
    original = Ranges.send_header

    def wrong_range(handler, key, value):  # a server that answers a range request with other bytes
        original(handler, key, "bytes 0-9/10" if key == "Content-Range" else value)
    monkeypatch.setattr(Ranges, "send_header", wrong_range)
    with pytest.raises(DatasetDownloadError, match="asked for the bytes from .* the server sent 'bytes 0-9/10'"):
        ensure_downloaded(root, "https://example.org/big.zip", "big.yaml")
    monkeypatch.setattr(Ranges, "send_header", original)
    ensure_downloaded(root, "https://example.org/big.zip", "big.yaml")
    assert ranges.requests[-1] == {"Range": None, "If-Range": None}  # started over: no validator kept
    assert (root / "noise.bin").read_bytes() == (tree / "noise.bin").read_bytes()
