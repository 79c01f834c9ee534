"""Inference scripts written against YOLOv5's modules (docs/yolov5-scripts.md): YOLOv5's import paths, signatures and
return values, and a script's detections equal to detect.py's on the same files."""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import detect
from tests.conftest import CUDA_ONLY, fresh_python, save_random_checkpoint, shared_path
from utils.errors import UserError

CONF, IOU, MAX_DET = 0.01, 0.45, 1000


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("weights") / "tiny.pt", ["cat", "dog"], seed=3, confident=True)


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """Two images of different shapes and a 4-frame video, in one folder (the video's name sorts first)."""
    folder = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    for name, shape in (("b.jpg", (96, 128)), ("c.png", (120, 80))):
        image = rng.integers(0, 255, (*shape, 3), dtype=np.uint8)
        cv2.rectangle(image, (10, 20), (60, 70), (0, 200, 255), -1)
        cv2.imwrite(str(folder / name), image)
    writer = cv2.VideoWriter(str(folder / "a.avi"), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (128, 96))
    for i in range(4):
        frame = np.full((96, 128, 3), 50 * i, np.uint8)
        cv2.rectangle(frame, (20 + 5 * i, 20), (70 + 5 * i, 70), (255, 200, 0), -1)
        writer.write(frame)
    writer.release()
    return folder


def script_detections(weights, source, imgsz=(96, 96)) -> dict:
    """What a user's YOLOv5-style detection script finds, per image or ``path:frame``: YOLOv5's imports and calls."""
    from models.common import DetectMultiBackend
    from utils.dataloaders import LoadImages
    from utils.general import check_img_size, non_max_suppression, scale_boxes
    from utils.plots import Annotator, colors
    from utils.torch_utils import select_device, smart_inference_mode

    @smart_inference_mode()
    def run():
        device = select_device("cpu")
        model = DetectMultiBackend(weights, device=device, dnn=False, data=None, fp16=False)
        stride, names, pt = model.stride, model.names, model.pt
        size = check_img_size(imgsz, s=stride)
        model.warmup(imgsz=(1, 3, *size))
        found = {}
        dataset = LoadImages(source, img_size=size, stride=stride, auto=pt)
        for path, im, im0s, vid_cap, s in dataset:
            im = torch.from_numpy(im).to(model.device)
            im = im.half() if model.fp16 else im.float()
            im /= 255
            if len(im.shape) == 3:
                im = im[None]
            pred = model(im, augment=False, visualize=False)
            pred = non_max_suppression(pred, CONF, IOU, None, False, max_det=MAX_DET)
            for det in pred:
                im0 = im0s.copy()
                annotator = Annotator(im0, line_width=2, example=str(names))
                if len(det):
                    det[:, :4] = scale_boxes(im.shape[2:], det[:, :4], im0.shape).round()
                    for *xyxy, conf, cls in reversed(det):
                        annotator.box_label(xyxy, f"{names[int(cls)]} {conf:.2f}", color=colors(int(cls), True))
                assert annotator.result().shape == im0s.shape
                key = path if dataset.mode == "image" else f"{path}:{dataset.frame}"
                found[key] = det.tolist()
        return found
    return run()


def detect_py_detections(weights, source, tmp_path, imgsz=(96, 96)) -> dict:
    result = detect.run(weights=str(weights), source=str(source), imgsz=list(imgsz), conf_thres=CONF, iou_thres=IOU,
                        max_det=MAX_DET, nosave=True, amp="off", project=str(tmp_path / "runs"), device="cpu")
    return {key: [[*d.xyxy, d.score, float(d.class_id)] for d in dets] for key, dets in result.detections.items()}


def test_a_yolov5_style_script_finds_what_detect_py_finds(weights, media, tmp_path):
    ours = detect_py_detections(weights, media, tmp_path)
    theirs = script_detections(weights, str(media))
    assert list(theirs) == list(ours)  # the images first, then the video's frames, as YOLOv5 orders them
    assert [Path(key).name for key in theirs][:3] == ["b.jpg", "c.png", "a.avi:1"] and len(theirs) == 6
    assert sum(len(rows) for rows in theirs.values()) > 20
    for key in ours:
        assert torch.allclose(torch.tensor(theirs[key]), torch.tensor(ours[key]), atol=1e-5), key


def test_load_images_yields_yolov5s_five_tuple(media):
    from utils.dataloaders import IMG_FORMATS, VID_FORMATS, LoadImages

    assert "jpg" in IMG_FORMATS and "mp4" in VID_FORMATS
    dataset = LoadImages([str(media / "c.png"), str(media / "a.avi")], img_size=64, stride=32, vid_stride=2)
    assert len(dataset) == 2 and dataset.video_flag == [False, True]
    items, rates = [], []
    for item in dataset:  # a script reads the capture while its video is read
        items.append(item)
        rates.append(item[3].get(cv2.CAP_PROP_FPS) if item[3] is not None else None)
    assert len(items) == 3  # the image, then frames 1 and 2 of the video's 4 (every 2nd)
    path, im, im0, cap, s = items[0]
    assert Path(path).name == "c.png" and cap is None and s == f"image 1/2 {path}: "
    assert im0.shape == (120, 80, 3) and im.shape == (3, 64, 64) and im.dtype == np.uint8 and im.flags.c_contiguous
    boxed = cv2.copyMakeBorder(cv2.resize(im0, (43, 64)), 0, 0, 10, 11, cv2.BORDER_CONSTANT, value=(114,) * 3)
    assert np.array_equal(im, boxed[:, :, ::-1].transpose(2, 0, 1))  # RGB, CHW
    path, im, im0, cap, s = items[2]
    assert Path(path).name == "a.avi" and dataset.mode == "video" and dataset.frame == 2 and dataset.frames == 2
    assert s == f"video 2/2 (2/2) {path}: "
    assert rates == [None, pytest.approx(10.0), pytest.approx(10.0)]  # what a script reads to write its own video
    rgb_half = LoadImages(str(media / "b.jpg"), transforms=lambda image: image[::2, ::2])
    assert next(iter(rgb_half))[1].shape == (48, 64, 3)


def test_attempt_load_gives_yolov5s_model_and_options(weights, tmp_path, caplog):
    from models.experimental import Ensemble, attempt_load
    from models.composite import load_models

    model = attempt_load(str(weights))
    assert not model.training and model.names == {0: "cat", 1: "dog"} and model.stride.tolist() == [8.0, 16.0, 32.0]
    image = torch.rand(1, 3, 64, 96)
    backend = load_models(weights)
    with torch.no_grad():
        pred, raw = model(image)
        assert torch.allclose(pred, backend(image)[0], atol=1e-5) and len(raw) == 3
        tta, none = model(image, augment=True)
        assert none is None and torch.allclose(tta, load_models(weights, augment=True)(image)[0], atol=1e-5)
        with caplog.at_level(logging.INFO, logger="models.forward_options"):
            assert torch.equal(model(image, profile=True)[0], pred)
        assert any(line.strip().endswith("Total") for line in caplog.messages)
        assert torch.equal(model(image, visualize=tmp_path / "maps")[0], pred)
    assert (tmp_path / "maps" / "stage0_Conv_features.png").is_file()
    pair = attempt_load([str(weights), str(weights)])
    assert isinstance(pair, Ensemble) and pair.names == model.names and pair.nc == 2
    with torch.no_grad():
        both, _ = pair(image)
    assert both.shape[1] == 2 * pred.shape[1] and torch.allclose(both[:, pred.shape[1]:], pred, atol=1e-5)


def test_detect_multibackend_attributes_and_outputs(weights):
    from models.common import DetectMultiBackend

    with pytest.raises(UserError, match="CUDA is not available") if not torch.cuda.is_available() else \
            contextlib.nullcontext():
        DetectMultiBackend(str(weights), device="0")  # a --device string, as select_device takes it
    from models.backends import BackendError
    from models.experimental import attempt_load
    for load in (DetectMultiBackend, attempt_load):
        with pytest.raises(BackendError, match="weights not found: .*missing.pt"):
            load(str(weights.parent / "missing.pt"))
    model = DetectMultiBackend(str(weights), device="cpu")
    assert model.pt and not (model.jit or model.onnx or model.engine or model.tflite) and not model.fp16
    assert model.stride == 32 and model.names == {0: "cat", 1: "dog"} and model.device == torch.device("cpu")
    image = torch.rand(2, 3, 64, 96)
    with torch.no_grad():
        output = model(image)
        assert isinstance(output, list) and output[0].shape[:2] == (2, 3 * (8 * 12 + 4 * 6 + 2 * 3))
        tta = model(image, augment=True)[0]
    assert tta.shape[0] == 2 and tta.shape[1] != output[0].shape[1]
    ensemble = DetectMultiBackend([str(weights), str(weights)])
    with torch.no_grad():
        assert ensemble(image)[0].shape[1] == 2 * output[0].shape[1]


@pytest.mark.parametrize("fp16", [pytest.param(False, marks=CUDA_ONLY), pytest.param(True, marks=CUDA_ONLY)])
def test_detect_multibackend_on_cuda_in_fp16_and_fp32(weights, fp16):
    from models.common import DetectMultiBackend

    model = DetectMultiBackend(str(weights), device=torch.device("cuda:0"), fp16=fp16)
    assert model.fp16 == fp16 and next(model.model.parameters()).dtype == (torch.half if fp16 else torch.float)
    model.warmup(imgsz=(1, 3, 64, 96))
    image = torch.rand(1, 3, 64, 96)
    with torch.no_grad():
        pred = model(image.cuda())[0]
        reference = DetectMultiBackend(str(weights))(image)[0]
    assert pred.dtype == (torch.half if fp16 else torch.float) and pred.device.type == "cuda"
    assert torch.allclose(pred.float().cpu(), reference, rtol=1e-2, atol=0.5 if fp16 else 1e-2)


def test_detect_multibackend_runs_an_onnx_export_as_the_checkpoint(weights, tmp_path):
    pytest.importorskip("onnx", reason="pip install -r requirements-export.txt")
    pytest.importorskip("onnxruntime", reason="pip install -r requirements-export.txt")
    import export
    from models.common import DetectMultiBackend

    onnx_file = export.run(weights=str(weights), include=["onnx"], imgsz=[64, 96], device="cpu")[0]
    model = DetectMultiBackend(str(onnx_file))
    assert model.onnx and not model.pt and model.names == {0: "cat", 1: "dog"}
    image = torch.rand(1, 3, 64, 96)
    with torch.no_grad():
        pred = model(image)
        assert isinstance(pred, torch.Tensor)
        assert torch.allclose(pred, DetectMultiBackend(str(weights))(image)[0], atol=1e-3)


def test_detect_multibackend_on_yolov5s_own_file_reproduces_yolov5():
    """A file YOLOv5 saved, run as YOLOv5's DetectMultiBackend runs it, against YOLOv5's recorded output."""
    why = "compares with YOLOv5's own recorded inference output, which cannot be generated without YOLOv5"
    model_file = shared_path("fixtures", "yolov5", "yolov5n_v7_random.pt", why=why)
    reference = torch.load(shared_path("fixtures", "yolov5", "yolov5n_v7_random_io.pt", why=why), weights_only=True)
    from models.common import DetectMultiBackend

    model = DetectMultiBackend(model_file)
    with torch.no_grad():
        pred = model(reference["input"])[0]
    assert torch.allclose(pred, reference["output"], rtol=1e-4, atol=1e-3)
    assert model.names[0] == "person" and len(model.names) == 80 and model.stride == 32


def test_general_helpers_behave_as_yolov5s(tmp_path, caplog):
    from utils import general

    with caplog.at_level(logging.WARNING, logger="yolov5"):
        assert general.check_img_size(640, s=32) == 640 and not caplog.messages
        assert general.check_img_size(641, s=torch.tensor([8.0, 16.0, 32.0])) == 672
        assert general.check_img_size([640, 481], s=32) == [640, 512]
        assert general.check_img_size(20, s=32, floor=64) == 64
    assert len(caplog.messages) == 3 and "updating to 672" in caplog.messages[0]
    assert general.colorstr("hi") == "\033[34m\033[1mhi\033[0m"
    assert general.colorstr("red", "underline", "x") == "\033[31m\033[4mx\033[0m"
    (tmp_path / "exp").mkdir()
    assert general.increment_path(tmp_path / "exp").name == "exp2"
    assert general.increment_path(tmp_path / "exp", sep="-", mkdir=True).name == "exp-2"
    assert (tmp_path / "exp-2").is_dir() and general.increment_path(tmp_path / "exp", exist_ok=True).name == "exp"
    (tmp_path / "a.txt").write_text("x")
    assert general.increment_path(tmp_path / "a.txt").name == "a2.txt"
    timer = general.Profile()
    for _ in range(2):
        with timer:
            sum(range(10000))
    assert timer.t >= timer.dt > 0 and timer.t > timer.dt
    assert not general.Profile(device=torch.device("cpu")).cuda  # YOLOv5 master's keyword
    assert general.scale_coords is general.scale_boxes and general.clip_coords is general.clip_boxes
    ramp = general.one_cycle(1.0, 0.01, 100)
    assert ramp(0) == 1.0 and ramp(100) == pytest.approx(0.01) and ramp(50) == pytest.approx(0.505)
    kept = general.intersect_dicts({"a.w": torch.zeros(2), "b.w": torch.zeros(3), "anchors": torch.zeros(1)},
                                   {"a.w": torch.ones(2), "b.w": torch.ones(4), "anchors": torch.ones(1)}, ["anchor"])
    assert list(kept) == ["a.w"]
    assert general.check_version("2.14.1", "1.8.0") and not general.check_version("1.7", "1.8.0")
    assert not general.check_version("1.8.1", "1.8.0", pinned=True)
    with pytest.raises(UserError, match="torch 3.0 is required"):
        general.check_version("2.1", "3.0", name="torch ", hard=True)
    general.init_seeds(7)
    first = torch.rand(3)
    general.init_seeds(7)
    assert torch.equal(first, torch.rand(3))
    from utils.metrics import bbox_iou, box_iou  # YOLOv5's module for them
    boxes = torch.tensor([[0.0, 0, 10, 10], [5, 0, 15, 10]])
    assert box_iou(boxes[:1], boxes[1:]).item() == pytest.approx(1 / 3)
    assert bbox_iou(boxes[:1], boxes[1:], xywh=False).item() == pytest.approx(1 / 3)


def test_non_max_suppression_takes_yolov5s_parameter_order():
    from utils.general import non_max_suppression

    pred = torch.zeros(1, 3, 7)
    pred[0, :, :4] = torch.tensor([[50, 50, 20, 20], [52, 50, 20, 20], [150, 150, 20, 20]], dtype=torch.float)
    pred[0, :, 4] = torch.tensor([0.9, 0.8, 0.7])
    pred[0, :, 5:] = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.1, 0.9]])
    kept = non_max_suppression([pred, None], 0.25, 0.45)[0]
    assert kept[:, 5].tolist() == [0, 1] and kept[0, :4].tolist() == [40, 40, 60, 60]
    assert len(non_max_suppression(pred, 0.25, 0.45, None, False, False, (), 1)[0]) == 1  # max_det 8th, labels 7th
    assert non_max_suppression(pred, 0.25, 0.45, [1])[0][:, 5].tolist() == [1]
    truth = [torch.tensor([[1.0, 300, 300, 10, 10]])]
    assert len(non_max_suppression(pred, 0.25, 0.45, labels=truth)[0]) == 3
    with pytest.raises(ValueError, match="segmentation"):
        non_max_suppression(pred, nm=32)


def test_letterbox_print_args_and_file_checks(tmp_path, caplog):
    from utils.augmentations import letterbox
    from utils.general import check_file, check_requirements, check_suffix, print_args

    image = np.zeros((100, 200, 3), np.uint8)
    boxed, ratio, pad = letterbox(image, (128, 128), auto=False)
    assert boxed.shape == (128, 128, 3) and ratio == (0.64, 0.64) and pad == (0.0, 32.0)
    stretched, ratio, pad = letterbox(image, (128, 128), auto=False, scaleFill=True)
    assert stretched.shape == (128, 128, 3) and ratio == (0.64, 1.28) and pad == (0.0, 0.0)

    def run(weights="a.pt", conf_thres=0.25):
        print_args()
    general_logger = logging.getLogger("yolov5")
    with caplog.at_level(logging.INFO, logger="yolov5"):
        run(conf_thres=0.5)
        print_args({"x": 1}, show_file=False)
    assert general_logger.name == "yolov5"
    assert caplog.messages[0].endswith("weights=a.pt, conf_thres=0.5") and "test_yolov5_scripts" in caplog.messages[0]
    assert caplog.messages[1].endswith("x=1")
    assert check_file("coco128.yaml").endswith("data/coco128.yaml")
    (tmp_path / "mine.yaml").write_text("nc: 1")
    assert check_file(tmp_path / "mine.yaml") == str(tmp_path / "mine.yaml") and check_file("") == ""
    with pytest.raises(FileNotFoundError, match="File not found: nothing-here.yaml"):
        check_file("nothing-here.yaml")
    with pytest.raises(ValueError, match="acceptable suffix"):
        check_suffix("model.onnx", (".pt",))
    assert check_requirements(["numpy", "torch>=1.8"]) is True
    from utils.errors import UserError
    with pytest.raises(UserError, match="not-a-package-xyz"):
        check_requirements(["numpy", "not-a-package-xyz>=1"])
    with pytest.raises(UserError, match=r"numpy<1 \(installed"):
        pytest.importorskip("packaging")
        check_requirements("numpy<1")


def test_annotator_draws_in_place_and_with_pillow():
    from utils.plots import Annotator, colors, save_one_box

    image = np.zeros((100, 160, 3), np.uint8)
    annotator = Annotator(image, line_width=2)
    annotator.box_label([20, 40, 80, 90], "cat 0.90", color=(0, 0, 255))
    annotator.text((100, 20), "hello", txt_color=(0, 255, 0))
    annotator.rectangle((120, 60, 150, 90), fill=(255, 0, 0))
    result = annotator.result()
    assert np.shares_memory(result, image)  # drawn on the caller's array, as YOLOv5's
    assert tuple(image[65, 20]) == (0, 0, 255) and tuple(image[75, 135]) == (255, 0, 0)
    assert image[10:40, 20:80].any() and image[5:25, 100:160, 1].any()  # the label above the box, the text
    assert colors(1) == colors(1, True)[::-1]
    with pytest.raises(ValueError, match="contiguous"):
        Annotator(np.zeros((100, 160, 3), np.uint8)[:, ::-1])
    drawn = Annotator(np.zeros((100, 160, 3), np.uint8), pil=True)
    drawn.box_label([20, 40, 80, 90], "cat", color=(0, 0, 255))
    drawn.text((100, 20), "x", anchor="bottom")
    picture = drawn.result()
    assert picture.shape == (100, 160, 3) and tuple(picture[65, 20]) == (0, 0, 255)
    crop = np.zeros((50, 50, 3), np.uint8)
    crop[..., 0] = 255  # blue in BGR
    assert tuple(save_one_box([10, 10, 30, 30], crop, save=False)[0, 0]) == (0, 0, 255)  # RGB unless BGR=True
    assert tuple(save_one_box([10, 10, 30, 30], crop, save=False, BGR=True)[0, 0]) == (255, 0, 0)


def test_torch_utils_names(caplog):
    from utils.torch_utils import select_device, smart_inference_mode, time_sync

    with caplog.at_level(logging.INFO, logger="yolov5"):
        assert select_device("cpu") == torch.device("cpu")
    assert caplog.messages[-1].startswith("Python-") and caplog.messages[-1].rstrip().endswith("CPU")

    @smart_inference_mode()
    def infer(x):
        return x * 2
    assert infer(torch.ones(2)).is_inference() and isinstance(time_sync(), float)
    from utils.datasets import LoadImages, letterbox  # YOLOv5 v6.1's module name
    from utils.torch_utils import time_synchronized
    assert LoadImages.__module__ == "utils.dataloaders" and letterbox.__module__ == "utils.augmentations"
    assert time_synchronized is time_sync


def test_the_layers_module_loads_detect_multibackend_only_when_asked():
    lines = fresh_python("import sys, models.common\n"
                         "print('models.multibackend' in sys.modules)\n"
                         "from models.common import DetectMultiBackend\n"
                         "print(DetectMultiBackend.__module__)\n")
    assert lines[-2:] == ["False", "models.multibackend"]


def test_the_project_itself_never_imports_the_yolov5_named_modules():
    """These modules are for scripts: none of the project's own code depends on them (models.common reaches
    models.multibackend only through its __getattr__, for ``from models.common import DetectMultiBackend``)."""
    from tests.test_import_direction import imports, project_modules

    facades = {"utils.general", "utils.augmentations", "utils.torch_utils", "utils.dataloaders", "utils.datasets",
               "utils.yolov5_loaders", "models.multibackend", "models.experimental"}
    modules = project_modules()
    users = {name: sorted(imports(path, modules) & facades) for name, path in modules.items() if name not in facades}
    assert {name: found for name, found in users.items() if found} == {"models.common": ["models.multibackend"]}


def test_load_streams_gives_every_streams_newest_frame_until_one_ends(tmp_path, monkeypatch):
    """Two MJPEG cameras on 127.0.0.1, 20 and 2 frames a second for 2 s: each batch holds both streams' newest
    frames (never older than the last batch's), the fast one sets the pace, and the readers stop at the end."""
    import threading

    from tests.test_streams import Camera, frame_number
    from utils import streams
    from utils.augmentations import letterbox
    from utils.dataloaders import LoadStreams

    monkeypatch.setattr(streams, "RECONNECTS", 0)
    fast, slow = Camera([(1, 40, 20, "close")], warmup=3), Camera([(1, 4, 2, "close")], warmup=3)
    try:
        listing = tmp_path / "cams.streams"
        listing.write_text(f"{fast.url}\n{slow.url}\n")
        dataset = LoadStreams(str(listing), img_size=64, stride=32)
        assert len(dataset) == 2 and dataset.rect and dataset.fps[0] > 0
        fast.go.set(), slow.go.set()
        batches = []
        for sources, im, im0, cap, s in dataset:
            assert sources == [fast.url, slow.url] and cap is None and s == "" and im.shape == (2, 3, 64, 64)
            assert np.array_equal(im[1], letterbox(im0[1], 64, stride=32)[0][:, :, ::-1].transpose(2, 0, 1))
            batches.append([frame_number(frame) for frame in im0])
    finally:
        fast.stop(), slow.stop()
    for stream in (0, 1):
        numbers = [batch[stream] for batch in batches]
        assert numbers == sorted(numbers), stream  # a stream's frames never go back
    assert len(batches) >= 10 and len({batch[0] for batch in batches}) >= 10  # the fast camera's pace (slow: 4)
    assert not any(thread.name.startswith("stream ") for thread in threading.enumerate())  # readers stopped


def test_load_screenshots_and_yolov5_v5s_drawing_names(monkeypatch, tmp_path):
    from utils import streams
    from utils.dataloaders import LoadScreenshots
    from utils.general import save_one_box
    from utils.plots import plot_one_box

    shots = [np.full((40, 80, 3), value, np.uint8) for value in (10, 20, 30)]
    monkeypatch.setattr(streams, "read_screen", lambda text: iter(shots))
    dataset = LoadScreenshots("screen 1 5 6 80 40", img_size=64, stride=32)
    taken = [next(dataset) for _ in range(3)]
    screen, im, im0, cap, s = taken[2]
    assert screen == "1" and cap is None and s == "screen 1 (LTWH): 5,6,80,40: " and im0 is shots[2]
    assert im.shape == (3, 32, 64) and (im == 30).all()  # 40x80 scaled by 0.8: no padding needed at stride 32
    with pytest.raises(streams.StreamError, match="expected 'screen'"):
        LoadScreenshots("screen one")
    image = np.zeros((60, 60, 3), np.uint8)
    plot_one_box([10, 20, 50, 55], image, color=(0, 255, 0), label="cell", line_thickness=2)
    assert tuple(image[40, 10]) == (0, 255, 0) and image[5:20, 10:50].any()
    crop = save_one_box([10, 20, 50, 55], image, file=tmp_path / "crop.jpg", BGR=True)
    assert (tmp_path / "crop.jpg").is_file() and crop.shape[2] == 3


def test_check_dataset_and_yaml_helpers(tmp_path):
    from tests.conftest import make_tiny_dataset
    from utils.data.dataset_yaml import DataConfigError
    from utils.errors import UserError
    from utils.general import check_dataset, yaml_load, yaml_save

    data = make_tiny_dataset(tmp_path / "tiny")
    found = check_dataset(str(data))
    assert found["nc"] == 2 and found["names"] == {0: "class0", 1: "class1"} and found["path"] == str(tmp_path / "tiny")
    assert Path(found["train"]).is_absolute() and Path(found["train"]).exists() and Path(found["val"]).exists()
    missing = tmp_path / "missing.yaml"
    yaml_save(missing, {"path": tmp_path / "not-here", "train": "images/train", "val": "images/val",
                        "names": ["a"], "download": "https://example.com/not-fetched.zip"})
    assert yaml_load(missing)["path"] == str(tmp_path / "not-here")  # a Path saved as text
    with pytest.raises(DataConfigError, match="downloads are off"):
        check_dataset(str(missing), autodownload=False)
    assert not (tmp_path / "not-here").exists()
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(9)))
    with pytest.raises(UserError, match="bomb.yaml"):
        yaml_load(bomb)


def test_model_info_prune_and_sparsity_as_yolov5s_tutorials(weights, caplog):
    from models.experimental import attempt_load
    from utils.torch_utils import model_info, prune, sparsity

    model = attempt_load(str(weights), fuse=False)
    with caplog.at_level(logging.INFO):
        model_info(model, verbose=True, imgsz=64)
    table = [line for line in caplog.messages if line.lstrip().startswith(("layer", "0 "))]
    assert table[0].split()[:3] == ["layer", "name", "gradient"] and "model.0.conv.weight" in table[1]
    import re
    assert re.fullmatch(r"Model summary: \d+ layers, (\d+) parameters, \1 gradients, [\d.]+ GFLOPs", caplog.messages[-1])
    before = sparsity(model)
    image = torch.rand(1, 3, 64, 64)
    prune(model, 0.3)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    zero_share = sum(int((m.weight == 0).sum()) for m in convs) / sum(m.weight.numel() for m in convs)
    assert before < 0.01 and zero_share == pytest.approx(0.3, abs=0.01) and sparsity(model) > 0.25
    assert not any(hasattr(m, "weight_orig") for m in convs)  # made permanent, a plain model again
    with torch.no_grad():
        assert model(image)[0].shape[1] == 3 * (8 * 8 + 4 * 4 + 2 * 2)


def test_autoshape_wraps_a_multibackend_or_a_model_as_the_hub_model_does(weights, media):
    from models.common import AutoShape, DetectMultiBackend
    from models.experimental import attempt_load
    from utils.hub import load_hub_model

    images = [cv2.imread(str(media / "b.jpg"))[:, :, ::-1], str(media / "c.png")]
    hub = load_hub_model(str(weights))(images)
    for model in (DetectMultiBackend(str(weights)), attempt_load(str(weights))):
        shaped = AutoShape(model)
        assert shaped.names == {0: "cat", 1: "dog"} and shaped.stride == 32
        results = shaped(images)
        assert len(results.xyxy) == 2 and results.files == hub.files
        for ours, theirs in zip(results.xyxy, hub.xyxy):
            assert ours.shape == theirs.shape and torch.allclose(ours, theirs, atol=1e-3)
    with pytest.raises(TypeError, match="AutoShape"):
        AutoShape(torch.nn.Linear(2, 2))
