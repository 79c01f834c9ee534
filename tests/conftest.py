"""Shared fixtures: generated test data (bad-input dataset, YOLOv5-format checkpoints), tiny images, and
the optional read-only ../shared folder of real data (its checks skip cleanly when it is absent).

``YOLO_TRAINER_SHARED`` overrides where that folder is (point it at an empty folder to run the suite
as a fresh clone would).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def fresh_python(code: str, timeout: int = 120, exit_code: int = 0) -> list[str]:
    """The lines ``code`` prints when a fresh interpreter runs it in the repository (what a process imports is seen
    only in a new one); the test fails with the interpreter's stderr when it exits with another code than
    ``exit_code``."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == exit_code, done.stderr[-2000:]
    return done.stdout.strip().splitlines()


SHARED = Path(os.environ.get("YOLO_TRAINER_SHARED") or ROOT.parent / "shared")
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False (python benchmarks/gpu_check.py runs these on a GPU)"
CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]  # a GPU test's marks


def shared_path(*parts: str, why: str = "") -> Path:
    """Path inside ../shared, or skip the calling test when it is not there (``why``: what only that
    data can check, added to the skip reason)."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"../shared not available ({path} missing)" + (f": {why}" if why else ""))
    return path


@pytest.fixture
def shared():
    return shared_path


@pytest.fixture(scope="session")
def badinputs(tmp_path_factory):
    """The generated bad-input dataset (tests/generate_badinputs.py), read-only like a shared copy;
    returns its root folder (data.yaml inside)."""
    from tests.generate_badinputs import make_badinputs, set_folders_writable

    root = tmp_path_factory.mktemp("badinputs")
    make_badinputs(root)
    set_folders_writable(root, False)
    yield root
    set_folders_writable(root, True)


@pytest.fixture(scope="session")
def yolov5_lookalike(tmp_path_factory):
    """YOLOv5-v7-format checkpoints written by look-alike classes (tests/generate_yolov5.py)."""
    from tests.generate_yolov5 import write_yolov5_lookalike

    return write_yolov5_lookalike(tmp_path_factory.mktemp("yolov5"))


@pytest.fixture(scope="session", autouse=True)
def private_user_cache(tmp_path_factory):
    """Caches the code keeps in the user's home (image stores, label caches beside read-only datasets) go to a
    session folder: the tests never write into ~/.cache/yolo-trainer (subprocesses inherit the variable)."""
    saved = os.environ.get("YOLO_TRAINER_CACHE")
    os.environ["YOLO_TRAINER_CACHE"] = str(tmp_path_factory.mktemp("user-cache"))
    yield
    if saved is None:
        os.environ.pop("YOLO_TRAINER_CACHE", None)
    else:
        os.environ["YOLO_TRAINER_CACHE"] = saved


@pytest.fixture
def outside(tmp_path):
    """(an empty folder, a file outside it holding "precious"): for links planted in the folder that point out."""
    target = tmp_path / "outside.txt"
    target.write_text("precious\n")
    folder = tmp_path / "folder"
    folder.mkdir()
    return folder, target


def make_tiny_dataset(root: Path, num_train: int = 8, num_val: int = 4, size: int = 96, nc: int = 2) -> Path:
    """A tiny YOLO-layout dataset of coloured rectangles on noise; returns its data.yaml."""
    import cv2
    import numpy as np

    rng = np.random.default_rng(0)
    for split, count in (("train", num_train), ("val", num_val)):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            img = rng.integers(0, 80, (size, size + 16, 3), dtype=np.uint8)
            rows = []
            for _ in range(rng.integers(1, 4)):
                cls = int(rng.integers(0, nc))
                w, h = rng.integers(size // 6, size // 2, 2)
                x1, y1 = rng.integers(0, size + 16 - w), rng.integers(0, size - h)
                color = (0, 0, 255) if cls == 0 else (0, 255, 0)
                cv2.rectangle(img, (int(x1), int(y1)), (int(x1 + w), int(y1 + h)), color, -1)
                rows.append(f"{cls} {(x1 + w / 2) / (size + 16):.6f} {(y1 + h / 2) / size:.6f} "
                            f"{w / (size + 16):.6f} {h / size:.6f}")
            cv2.imwrite(str(root / "images" / split / f"im{i}.jpg"), img)
            (root / "labels" / split / f"im{i}.txt").write_text("\n".join(rows) + "\n")
    names = "\n".join(f"  {i}: class{i}" for i in range(nc))
    data = root / "data.yaml"
    data.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n{names}\n")
    return data


def make_tiny_run(root: Path, num_train: int = 8, num_val: int = 4) -> tuple[Path, Path]:
    """A tiny dataset and the tiny model's YAML under ``root``: (data.yaml, model yaml) for short training runs."""
    data = make_tiny_dataset(root / "data", num_train=num_train, num_val=num_val)
    cfg = root / "tiny.yaml"
    cfg.write_text(TINY_MODEL_YAML)
    return data, cfg


@pytest.fixture(scope="session")
def int8_trained(tmp_path_factory) -> tuple[Path, Path]:
    """(weights, data.yaml): the tiny model trained for 30 epochs on 16 tiny 96x112 images (4 val), for the int8
    exports (LiteRT, ExecuTorch): a randomly initialised model's features fade to ~1e-6 by the head, which any
    quantisation passes, while a trained one's outputs depend on the image. Ask for it after the test's skip check
    (``request.getfixturevalue``) so that a machine without the format's package does not train it."""
    import shutil

    import train

    root = tmp_path_factory.mktemp("int8")
    data, cfg = make_tiny_run(root, num_train=16, num_val=4)
    assert train.main(["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size", "4",
                       "--epochs", "30", "--workers", "0", "--device", "cpu", "--project", str(root / "runs"),
                       "--noautoanchor", "--noplots", "--no-tensorboard"]) == 0
    weights = root / "weights" / "best.pt"
    weights.parent.mkdir()
    shutil.copy(root / "runs" / "exp" / "weights" / "last.pt", weights)
    return weights, data


def save_random_checkpoint(path: Path, names, cfg: Path | None = None, seed: int = 0,
                           confident: bool = False) -> Path:
    """A randomly initialised model saved by the project's checkpoint code (model only, no EMA) at ``path``: the
    tiny model (``cfg`` None; its YAML has nc 2) or ``cfg`` with one class per name. ``confident`` raises the
    objectness and class biases so every image yields detections (scores then saturate: NMS chooses among ties)."""
    import torch
    import yaml

    from models.yolo import DetectionModel
    from utils.checkpoint import model_state, save_checkpoint

    torch.manual_seed(seed)
    model = (DetectionModel(yaml.safe_load(TINY_MODEL_YAML)) if cfg is None
             else DetectionModel(cfg, nc=len(names)))
    model.names = list(names)
    if confident:
        head = model.model[-1]
        with torch.no_grad():
            for conv in head.m:
                conv.bias.view(head.na, -1)[:, 4:] += 12.0
    save_checkpoint({"model": model_state(model), "ema": None}, path)
    return path


TINY_MODEL_YAML = """
nc: 2
depth_multiple: 0.33
width_multiple: 0.125
anchors:
  - [10,13, 16,30, 33,23]
  - [30,61, 62,45, 59,119]
  - [116,90, 156,198, 373,326]
backbone:
  [[-1, 1, Conv, [64, 6, 2, 2]],
   [-1, 1, Conv, [128, 3, 2]],
   [-1, 1, C3, [128]],
   [-1, 1, Conv, [256, 3, 2]],
   [-1, 1, C3, [256]],
   [-1, 1, Conv, [512, 3, 2]],
   [-1, 1, C3, [512]],
   [-1, 1, Conv, [1024, 3, 2]],
   [-1, 1, C3, [1024]],
   [-1, 1, SPPF, [1024, 5]],
  ]
head:
  [[-1, 1, Conv, [512, 1, 1]],
   [-1, 1, nn.Upsample, [None, 2, 'nearest']],
   [[-1, 6], 1, Concat, [1]],
   [-1, 1, C3, [512, False]],
   [-1, 1, Conv, [256, 1, 1]],
   [-1, 1, nn.Upsample, [None, 2, 'nearest']],
   [[-1, 4], 1, Concat, [1]],
   [-1, 1, C3, [256, False]],
   [-1, 1, Conv, [256, 3, 2]],
   [[-1, 14], 1, Concat, [1]],
   [-1, 1, C3, [512, False]],
   [-1, 1, Conv, [512, 3, 2]],
   [[-1, 10], 1, Concat, [1]],
   [-1, 1, C3, [1024, False]],
   [[17, 20, 23], 1, Detect, [nc, anchors]],
  ]
"""
