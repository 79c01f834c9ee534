"""YOLOv5's own scripts and defaults, as its CI and tutorials run them: models/yolo.py as a script, hubconf.py
--model, the sample images in data/images, val.py's default --data, train.py's default --weights."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_models_yolo_py_runs_as_a_script_with_bare_cfg_names():
    done = subprocess.run([sys.executable, "models/yolo.py", "--cfg", "yolov5n.yaml", "--imgsz", "64", "--profile",
                           "--line-profile"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "YOLOv5n summary: " in done.stderr + done.stdout
    assert "forward " in done.stdout and "backward " in done.stdout and "Total" in done.stdout
    done = subprocess.run([sys.executable, "models/yolo.py", "--cfg", "nothing.yaml"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == \
        ["yolo.py: error: nothing.yaml: model YAML not found"]


def test_sample_images_are_ours_and_detect_py_defaults_to_them():
    import detect

    images = sorted(p.name for p in (ROOT / "data" / "images").iterdir())
    assert images == ["shapes1.jpg", "shapes2.jpg"]
    assert detect.config_from_args(detect.parse_args([])).source == str(ROOT / "data" / "images")


def test_hubconf_py_model_runs_on_the_sample_images(tmp_path, yolov5_lookalike):
    import shutil

    shutil.copy(yolov5_lookalike.checkpoint, tmp_path / "yolov5n.pt")
    done = subprocess.run([sys.executable, str(ROOT / "hubconf.py"), "--model", "yolov5n"], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "image 1/2: " in done.stdout and "image 2/2: " in done.stdout and " at shape (2, 3, " in done.stdout
    assert sorted(p.name for p in (tmp_path / "runs" / "detect" / "exp").iterdir()) == ["shapes1.jpg", "shapes2.jpg"]
    done = subprocess.run([sys.executable, str(ROOT / "hubconf.py"), "--model", "custom"], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--model custom: not a model name (yolov5n, " in done.stderr


def test_val_without_data_uses_what_the_weights_were_trained_on_else_coco128(tmp_path, yolov5_lookalike):
    import torch

    import val
    from tests.conftest import make_tiny_run, save_random_checkpoint

    data, _ = make_tiny_run(tmp_path)
    plain = save_random_checkpoint(tmp_path / "plain.pt", ["a", "b"])
    assert val._trained_on(plain) == "coco128.yaml"  # nothing stored: YOLOv5's default
    assert val._trained_on(yolov5_lookalike.checkpoint) == "coco128.yaml"
    assert val._trained_on(tmp_path / "model.onnx") == "coco128.yaml"
    stored = torch.load(plain, weights_only=True)
    for given, expected in ((str(data), str(data)), ("", ""), (str(tmp_path / "gone.yaml"), "coco128.yaml")):
        torch.save({**stored, "config": {"data": given}}, tmp_path / "trained.pt")
        assert val._trained_on(tmp_path / "trained.pt") == expected


@pytest.mark.parametrize("argv, weights", [([], ""), (["--data", "x.yaml"], "yolov5s.pt"),
                                           (["--data", "x.yaml", "--cfg", "yolov5n.yaml"], "yolov5s.pt"),
                                           (["--data", "x.yaml", "--weights", ""], ""),
                                           (["--weights", "a.pt"], "a.pt")])
def test_train_defaults_to_yolov5s_with_data_and_to_scratch_for_the_quick_start(argv, weights):
    import train

    assert train.config_from_args(train.parse_args(argv)).weights == weights


def test_train_offline_without_weights_says_how_to_train_from_scratch(tmp_path, monkeypatch, capsys):
    import train
    from tests.conftest import make_tiny_run
    from utils import downloads

    data, cfg = make_tiny_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(downloads.MIRROR_VARIABLE, "http://127.0.0.1:9/")  # nothing listens: no network
    code = train.main(["--data", str(data), "--cfg", str(cfg), "--epochs", "1", "--device", "cpu", "--workers", "0",
                       "--project", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "yolov5s.pt: could not download" in err[0]
    assert err[0].endswith("or pass --weights '' to train from scratch")
