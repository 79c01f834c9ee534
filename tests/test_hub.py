"""torch.hub.load(repo, 'custom' | 'yolov5n' ..., source='local') on checkpoints saved by the project's own code:
offline, and the same detections as detect.py."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import detect
from tests.test_api import NAMES, detecting_checkpoint, make_images
from utils.errors import UserError
from utils.hub import Detections, HubModel, load_image
from utils.inference import InferenceError

ROOT = Path(__file__).resolve().parents[1]
SIZE = 96


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return detecting_checkpoint(tmp_path_factory.mktemp("hub") / "best.pt")


@pytest.fixture(scope="module")
def model(weights):
    loaded = torch.hub.load(str(ROOT), "custom", path=str(weights), source="local", device="cpu")
    loaded.amp = "off"  # fp32, as the detect.py run it is compared with (bf16 inference: test_amp.py)
    loaded.max_det = 20
    return loaded


def test_custom_matches_detect_py_on_paths_arrays_and_pil(model, weights, tmp_path):
    from PIL import Image

    images = make_images(tmp_path / "images")
    expected = detect.run(weights=weights, source=tmp_path / "images", imgsz=SIZE, device="cpu", amp="off", max_det=20,
                          nosave=True, project=tmp_path / "detect").detections
    assert isinstance(model, HubModel) and model.names == NAMES
    results = model([str(path) for path in images], size=SIZE)
    assert isinstance(results, Detections) and len(results) == 2 and results.files == [str(p) for p in images]
    for index, path in enumerate(images):
        rows = [(*d.xyxy, d.score, float(d.class_id)) for d in expected[str(path)]]
        assert rows and torch.equal(results.xyxy[index], torch.tensor(rows, dtype=results.xyxy[index].dtype))
        assert results.detections[index] == expected[str(path)]
    bgr = cv2.imread(str(images[0]))
    same = [model(bgr, size=SIZE, bgr=True), model(np.ascontiguousarray(bgr[:, :, ::-1]), size=SIZE),
            model(Image.open(images[0]), size=SIZE), model(images[0], size=(SIZE, SIZE))]
    for other in same:
        assert torch.equal(other.xyxy[0], results.xyxy[0])
    rgb = np.ascontiguousarray(bgr[:, :, ::-1])  # the pixels the model sees: BGR, whatever the input
    assert np.array_equal(load_image(rgb, 0)[1], bgr) and np.array_equal(load_image(bgr, 0, bgr=True)[1], bgr)
    assert np.array_equal(load_image(bgr, 0)[1], rgb)  # a cv2 array without bgr=True is read as RGB
    assert np.array_equal(load_image(np.dstack([rgb, np.full(rgb.shape[:2], 255, np.uint8)]), 0)[1], bgr)  # RGBA
    gray = load_image(bgr[:, :, 0], 0)[1]
    assert gray.shape == bgr.shape and np.array_equal(gray[:, :, 2], bgr[:, :, 0])


def test_results_views_and_nms_attributes(model, tmp_path):
    path = make_images(tmp_path / "images", 1)[0]
    height, width = cv2.imread(str(path)).shape[:2]
    results = model(path, size=SIZE)
    xyxy, xywh, xyxyn = results.xyxy[0], results.xywh[0], results.xyxyn[0]
    assert xyxy.shape[1] == 6 and torch.all(xyxy[:, 4] > model.conf)
    assert torch.allclose(xywh[:, :2], (xyxy[:, :2] + xyxy[:, 2:4]) / 2)
    assert torch.allclose(xyxyn[:, [0, 2]] * width, xyxy[:, [0, 2]]) and torch.allclose(xyxyn[:, 4:], xyxy[:, 4:])
    assert torch.all(xyxy[:, :4] >= 0) and torch.all(xyxy[:, [0, 2]] <= width) and torch.all(xyxy[:, [1, 3]] <= height)
    assert str(results).startswith(f"image 1/1 {path}: {height}x{width} ")
    model.classes = [1]
    try:
        only = model(path, size=SIZE).xyxy[0]
    finally:
        model.classes = None
    assert len(only) and set(only[:, 5].tolist()) == {1.0}
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match="optional package 'pandas'"):
            results.pandas()
    else:
        frame = results.pandas().xyxy[0]
        assert list(frame.columns) == ["xmin", "ymin", "xmax", "ymax", "confidence", "class", "name"]
        assert len(frame) == len(xyxy) and set(frame["name"]) <= set(NAMES)


def test_a_tensor_batch_returns_the_raw_output_and_traces(model):
    """As YOLOv5's AutoShape (and its CI: torch.jit.trace(model, [im])): a BCHW tensor runs as given, without
    letterboxing or NMS, and returns the model's raw output, which NMS turns into the boxes of detect.py."""
    from utils.inference import select_detections

    torch.manual_seed(0)
    batch = torch.rand(2, 3, 64, 96)
    pred = model(batch)[0]
    assert pred.shape[0] == 2 and pred.shape[2] == 5 + len(model.names)
    boxes = select_detections(pred, (64, 96), [(64, 96)] * 2, model.conf, model.iou)
    assert all(torch.all(det[:, [0, 2]] <= 96) and torch.all(det[:, [1, 3]] <= 64) for det in boxes)
    traced = torch.jit.trace(model, [torch.zeros(1, 3, 64, 64)], check_trace=False)
    assert torch.allclose(traced(batch[:1, :, :, :64])[0], model(batch[:1, :, :, :64])[0], atol=1e-4)
    with pytest.raises(InferenceError, match="multiples of the stride 32"):
        model(torch.rand(1, 3, 50, 64))
    with pytest.raises(InferenceError, match="cannot read a dict"):
        model([{}])


def test_named_entry_points_load_from_the_current_folder(weights, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("YOLO_TRAINER_MIRROR", str(tmp_path / "empty-mirror"))  # offline: tests/test_downloads.py
    with pytest.raises(UserError) as missing:
        torch.hub.load(str(ROOT), "yolov5s", source="local")
    assert f"put the file at {tmp_path / 'yolov5s.pt'} yourself" in str(missing.value)
    shutil.copy(weights, tmp_path / "yolov5n.pt")
    loaded = torch.hub.load(str(ROOT), "yolov5n", source="local", device="cpu")
    assert isinstance(loaded, HubModel) and loaded.names == NAMES
    raw = torch.hub.load(str(ROOT), "yolov5n", path=str(weights), autoshape=False, source="local", device="cpu")
    assert type(raw).__name__ == "DetectionModel" and not raw.training
    untrained = torch.hub.load(str(ROOT), "yolov5n", pretrained=False, classes=4, source="local", device="cpu")
    assert untrained.names == ["0", "1", "2", "3"]
    assert len(untrained(np.zeros((70, 90, 3), np.uint8), size=64)) == 1
    with pytest.raises(UserError, match="missing.pt: model file not found"):
        torch.hub.load(str(ROOT), "custom", path=str(tmp_path / "missing.pt"), source="local")


@pytest.mark.slow
def test_hub_load_in_a_fresh_interpreter_from_another_folder(weights, tmp_path):
    """As a user runs it: another working folder, the repository not on sys.path, inference after load returns."""
    image = make_images(tmp_path, 1)[0]
    shutil.copy(weights, tmp_path / "yolov5n.pt")
    code = (f"import torch\nmodel = torch.hub.load({str(ROOT)!r}, 'yolov5n', source='local', device='cpu')\n"
            f"model.amp = 'off'\nresults = model({image.name!r}, size={SIZE})\n"
            "print(len(results.xyxy[0]), results.detections[0][0].name)\n")
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    count, name = done.stdout.split()
    assert int(count) > 0 and name in NAMES
