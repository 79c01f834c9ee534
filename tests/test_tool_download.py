"""python -m tools.download and data/scripts/*.sh: YOLOv5's release weights and dataset YAMLs fetched ahead of
training from a loopback server, through the same checked downloads as train.py's."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.test_dataset_download import Files, coco128_standin, mirror, repo_copy_with  # noqa: F401 (fixture)
from tests.test_downloads import checkpoint_bytes, server, workdir  # noqa: F401 (fixtures)
from tools import download
from utils import downloads

ROOT = Path(__file__).resolve().parents[1]


def test_release_weights_are_fetched_into_the_folder_given_and_kept(server, workdir, monkeypatch, checkpoint_bytes,
                                                                    capsys):
    base, routes = server
    routes["/yolov5n.pt"] = (200, "application/octet-stream", checkpoint_bytes, None)
    monkeypatch.setenv(downloads.MIRROR_VARIABLE, base)
    assert download.main(["yolov5n.pt", "--dir", "weights"]) == 0
    assert (workdir / "weights" / "yolov5n.pt").read_bytes() == checkpoint_bytes
    assert capsys.readouterr().out == "yolov5n.pt: weights/yolov5n.pt\n"
    routes.clear()  # already there: nothing asked of the server
    assert download.main(["yolov5n.pt", "--dir", "weights"]) == 0
    assert capsys.readouterr().out == "yolov5n.pt: weights/yolov5n.pt (already there)\n"


def test_a_dataset_yaml_is_fetched_as_train_py_would(tmp_path, mirror, capsys):
    Files.files["/coco128.zip"] = coco128_standin(tmp_path)
    yaml = repo_copy_with(tmp_path, "coco128.yaml")
    assert download.main([str(yaml)]) == 0
    root = tmp_path / "datasets" / "coco128"
    assert capsys.readouterr().out.splitlines()[-1] == f"{yaml}: dataset in {root}"
    assert len(list((root / "images" / "train2017").iterdir())) == 8


def test_other_names_are_one_line_and_nothing_is_a_usage_error(workdir, capsys):
    assert download.main(["yolov5s-seg.pt"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a YOLOv5 release weights name" in err[0] and "yolov5x6.pt" in err[0]
    assert download.main([]) == 2
    assert set(download.ALL_WEIGHTS) == downloads.RELEASE_WEIGHTS and len(download.ALL_WEIGHTS) == 10


def test_yolov5s_download_weights_script_fetches_all_ten(server, workdir, checkpoint_bytes):
    base, routes = server
    for name in download.ALL_WEIGHTS:
        routes[f"/{name}"] = (200, "application/octet-stream", checkpoint_bytes, None)
    environment = {**os.environ, downloads.MIRROR_VARIABLE: base, "PATH": f"{Path(sys.executable).parent}:"
                   f"{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", str(ROOT / "data" / "scripts" / "download_weights.sh")], cwd=workdir,
                          env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(path.name for path in workdir.glob("*.pt")) == sorted(download.ALL_WEIGHTS)
    assert done.stdout.splitlines()[0] == "yolov5n.pt: yolov5n.pt"
