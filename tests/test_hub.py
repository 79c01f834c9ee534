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
    """One image: detect.py's letterbox and boxes, which detect.py rounds to whole pixels and the hub model does
    not (YOLOv5's AutoShape); ``files`` and ``names`` are YOLOv5's."""
    from PIL import Image

    images = make_images(tmp_path / "images")
    expected = detect.run(weights=weights, source=tmp_path / "images", imgsz=SIZE, device="cpu", amp="off", max_det=20,
                          nosave=True, project=tmp_path / "detect").detections
    assert isinstance(model, HubModel) and model.names == dict(enumerate(NAMES)) and model.pt
    for path in images:
        results = model(str(path), size=SIZE)
        assert isinstance(results, Detections) and len(results) == 1 and results.files == [path.stem + ".jpg"]
        rows = torch.tensor([(*d.xyxy, d.score, float(d.class_id)) for d in expected[str(path)]])
        boxes = results.xyxy[0]
        assert len(rows) and boxes.dtype == torch.float32 and not torch.equal(boxes[:, :4], boxes[:, :4].round())
        assert torch.equal(torch.cat((boxes[:, :4].round(), boxes[:, 4:]), 1), rows)
    results = model(str(images[0]), size=SIZE)
    bgr = cv2.imread(str(images[0]))
    same = [model(bgr, size=SIZE, bgr=True), model(np.ascontiguousarray(bgr[:, :, ::-1]), size=SIZE),
            model(Image.open(images[0]), size=SIZE), model(images[0], size=(SIZE, SIZE)),
            model(np.ascontiguousarray(bgr[:, :, ::-1].transpose(2, 0, 1)), size=SIZE)]  # CHW, as YOLOv5 takes it
    for other in same:
        assert torch.equal(other.xyxy[0], results.xyxy[0])
    assert same[0].files == ["image0.jpg"] and same[2].files == [images[0].stem + ".jpg"]
    rgb = np.ascontiguousarray(bgr[:, :, ::-1])  # the pixels the model sees: BGR, whatever the input
    assert np.array_equal(load_image(rgb, 0)[1], bgr) and np.array_equal(load_image(bgr, 0, bgr=True)[1], bgr)
    assert np.array_equal(load_image(bgr, 0)[1], rgb)  # a cv2 array without bgr=True is read as RGB
    assert np.array_equal(load_image(np.dstack([rgb, np.full(rgb.shape[:2], 255, np.uint8)]), 0)[1], bgr)  # RGBA
    gray = load_image(bgr[:, :, 0], 0)[1]
    assert gray.shape == bgr.shape and np.array_equal(gray[:, :, 2], bgr[:, :, 0])


def test_a_call_runs_as_one_batch_at_yolov5s_shared_shape(model):
    """YOLOv5's AutoShape: each image scaled by max(size) / its longer side, the largest shape rounded up to the
    stride, every image letterboxed into it and run in one batch. 300x400 and 100x400 at 320 run at 256x320 (the
    second alone would run at 96x320); the second image's boxes are those of that image alone at 256x320."""
    from utils.inference import prepare_image, select_detections

    rng = np.random.default_rng(0)
    tall = rng.integers(0, 255, (300, 400, 3), dtype=np.uint8)
    wide = rng.integers(0, 255, (100, 400, 3), dtype=np.uint8)
    results = model([tall, wide], size=320)
    assert results.s == (2, 3, 256, 320) and model(wide, size=320).s == (1, 3, 96, 320)
    assert model([wide], size=(100, 320)).s == (1, 3, 96, 320)  # only max(size) counts, as YOLOv5's
    tensor = prepare_image(np.ascontiguousarray(wide[:, :, ::-1]), (256, 320), 32, "cpu", False, auto=False)
    alone = select_detections(model(tensor), (256, 320), [wide.shape], model.conf, model.iou, max_det=model.max_det,
                              round_boxes=False)[0]
    assert len(alone) and torch.allclose(results.xyxy[1], alone, atol=1e-3)
    assert str(results).splitlines()[-1].endswith("per image at shape (2, 3, 256, 320)")
    assert len(results.times) == 3 and all(timing.t >= 0 for timing in results.times)
    assert results.t == tuple(timing.t * 1e3 / 2 for timing in results.times)


def test_amp_takes_yolov5s_booleans(model):
    """YOLOv5's ``model.amp = True`` (fp16 autocast on CUDA) and False (fp32): on a CPU False is fp32 and True the
    precision --amp auto chooses."""
    image = np.full((70, 90, 3), 120, np.uint8)
    try:
        model.amp = False
        fp32 = model(image, size=SIZE).xyxy[0]
        model.amp = "off"
        assert torch.equal(model(image, size=SIZE).xyxy[0], fp32)
        model.amp = True
        assert model(image, size=SIZE).xyxy[0].shape[1] == 6
    finally:
        model.amp = "off"
    with pytest.raises(InferenceError, match="models/yolo.py --cfg <model>.yaml --profile"):
        model(image, size=SIZE, profile=True)


def test_results_views_and_nms_attributes(model, tmp_path):
    path = make_images(tmp_path / "images", 1)[0]
    height, width = cv2.imread(str(path)).shape[:2]
    results = model(path, size=SIZE)
    xyxy, xywh, xyxyn = results.xyxy[0], results.xywh[0], results.xyxyn[0]
    assert xyxy.shape[1] == 6 and torch.all(xyxy[:, 4] > model.conf)
    assert torch.allclose(xywh[:, :2], (xyxy[:, :2] + xyxy[:, 2:4]) / 2)
    assert torch.allclose(xyxyn[:, [0, 2]] * width, xyxy[:, [0, 2]]) and torch.allclose(xyxyn[:, 4:], xyxy[:, 4:])
    assert torch.all(xyxy[:, :4] >= 0) and torch.all(xyxy[:, [0, 2]] <= width) and torch.all(xyxy[:, [1, 3]] <= height)
    assert str(results).startswith(f"image 1/1: {height}x{width} ")
    model.classes = [1]
    try:
        only = model(path, size=SIZE).xyxy[0]
    finally:
        model.classes = None
    assert len(only) and set(only[:, 5].tolist()) == {1.0}
    tables = results.pandas()  # pandas is in requirements.txt, as in YOLOv5's
    frame = tables.xyxy[0]
    assert list(frame.columns) == ["xmin", "ymin", "xmax", "ymax", "confidence", "class", "name"]
    assert len(frame) == len(xyxy) and set(frame["name"]) <= set(NAMES)
    assert str(frame["class"].dtype) == "int64" and np.allclose(frame[["xmin", "ymin"]].values, xyxy[:, :2])
    assert list(tables.xywhn[0].columns)[:4] == ["xcenter", "ycenter", "width", "height"]
    assert isinstance(tables, Detections) and tables.files == results.files and tables.n == 1
    assert torch.is_tensor(results.xyxy[0])  # the copy's frames, not the results' own tensors
    model.conf = 0.999999
    try:
        empty = model(np.zeros((64, 64, 3), np.uint8), size=SIZE).pandas().xyxy[0]
    finally:
        model.conf = 0.25
    assert len(empty) == 0 and list(empty.columns)[-2:] == ["class", "name"]


def test_a_tensor_batch_returns_the_raw_output_and_traces(model):
    """As YOLOv5's AutoShape (and its CI: torch.jit.trace(model, [im])): a BCHW tensor runs as given, without
    letterboxing or NMS, and returns the model's raw output, which NMS turns into the boxes of detect.py."""
    from utils.inference import select_detections

    torch.manual_seed(0)
    batch = torch.rand(2, 3, 64, 96)
    pred = model(batch)
    assert torch.is_tensor(pred) and pred.shape[0] == 2 and pred.shape[2] == 5 + len(model.names)
    assert torch.equal(model(batch[:1])[0], pred[0]) or torch.allclose(model(batch[:1])[0], pred[0], atol=1e-5)
    boxes = select_detections(pred, (64, 96), [(64, 96)] * 2, model.conf, model.iou)
    assert all(torch.all(det[:, [0, 2]] <= 96) and torch.all(det[:, [1, 3]] <= 64) for det in boxes)
    traced = torch.jit.trace(model, [torch.zeros(1, 3, 64, 64)], check_trace=False)
    assert torch.allclose(traced(batch[:1, :, :, :64]), model(batch[:1, :, :, :64]), atol=1e-4)
    with pytest.raises(InferenceError, match="multiples of the stride 32"):
        model(torch.rand(1, 3, 50, 64))
    with pytest.raises(InferenceError, match="cannot read a dict"):
        model([{}])


def test_named_entry_points_load_from_the_current_folder(weights, tmp_path, monkeypatch):
    """YOLOv5's ``_create``: pretrained with 3 channels and 80 classes loads the file; pretrained=False, classes=N
    or channels=C give a DetectionModel from the model YAML in training mode, with the fitting weights when
    pretrained (the hub's fine-tuning recipe) and the file's class names when the count matches."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("YOLO_TRAINER_MIRROR", str(tmp_path / "empty-mirror"))  # offline: tests/test_downloads.py
    with pytest.raises(UserError) as missing:
        torch.hub.load(str(ROOT), "yolov5s", source="local")
    assert f"put the file at {tmp_path / 'yolov5s.pt'} yourself" in str(missing.value)
    shutil.copy(weights, tmp_path / "yolov5n.pt")
    loaded = torch.hub.load(str(ROOT), "yolov5n", source="local", device="cpu")
    assert isinstance(loaded, HubModel) and loaded.names == dict(enumerate(NAMES))
    raw = torch.hub.load(str(ROOT), "yolov5n", path=str(weights), autoshape=False, source="local", device="cpu")
    assert type(raw).__name__ == "DetectionModel" and not raw.training
    untrained = torch.hub.load(str(ROOT), "yolov5n", pretrained=False, classes=4, source="local", device="cpu")
    assert type(untrained).__name__ == "DetectionModel" and untrained.training and untrained.names == ["0", "1", "2",
                                                                                                        "3"]
    assert len(untrained(torch.zeros(1, 3, 64, 64))) == 3  # training mode: the three levels' raw maps
    trained = raw.state_dict()
    for classes, names in ((3, NAMES), (10, [str(i) for i in range(10)])):
        tuned = torch.hub.load(str(ROOT), "yolov5n", classes=classes, source="local", device="cpu")
        assert type(tuned).__name__ == "DetectionModel" and tuned.training and tuned.names == names
        state = tuned.state_dict()
        assert torch.equal(state["model.0.conv.weight"], trained["model.0.conv.weight"])  # the backbone transferred
        head = "model.24.m.0.weight"
        assert state[head].shape[0] == 3 * (5 + classes)
        assert torch.equal(state[head], trained[head]) == (classes == 3)
    gray = torch.hub.load(str(ROOT), "yolov5n", channels=1, pretrained=False, source="local", device="cpu")
    assert gray.model[0].conv.weight.shape[1] == 1 and len(gray(torch.zeros(1, 1, 64, 64))) == 3
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
