"""Run a detector on images, folders, globs, .txt lists and videos; save drawn results and labels.

    python detect.py --weights runs/train/exp/weights/best.pt --source data/images
    python detect.py --weights best.pt --source video.mp4 --save-txt --conf-thres 0.4
    python detect.py --weights best.onnx --source data/images      # or best.torchscript (export.py)

Outputs go to runs/detect/exp, exp2, ... (never overwriting an earlier run): drawn images and
videos (mp4), labels/<stem>.txt (YOLO class cx cy w h [conf], normalised) with --save-txt,
crops/<class>/<stem>.jpg with --save-crop.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch
from tqdm import tqdm

from utils.boxes import scale_boxes, xyxy2xywh
from utils.cli import (ArgumentParser, add_amp_flag, add_device_flag, add_half_flag, add_run_folder_flags, image_size,
                       int_in_range, max_detections, positive_int, probability)
from utils.data.transforms import letterbox
from utils.device import select_device
from utils.drawing import colors, draw_box_label, save_one_box
from utils.errors import UserError, run_main
from utils.limits import MAX_CLASSES
from utils.nms import non_max_suppression
from utils.paths import increment_path
from utils.sources import SourceItem, Sources

LOGGER = logging.getLogger("detect")
PROGRESS_MIN_IMAGES = 20  # folders larger than this get a progress bar


class DetectError(UserError):
    """A detect.py setting that cannot be used; one line naming it."""


@dataclass
class DetectConfig:
    weights: str = "yolov5s.pt"
    source: str = "data/images"
    data: str | None = None
    imgsz: tuple[int, int] = (640, 640)
    conf_thres: float = 0.25
    iou_thres: float = 0.45
    max_det: int = 1000
    device: str = ""
    view_img: bool = False
    save_txt: bool = False
    save_conf: bool = False
    save_crop: bool = False
    nosave: bool = False
    classes: list[int] | None = None
    agnostic_nms: bool = False
    augment: bool = False
    visualize: bool = False
    project: str = "runs/detect"
    name: str = "exp"
    exist_ok: bool = False
    line_thickness: int = 3
    hide_labels: bool = False
    hide_conf: bool = False
    half: bool = False
    dnn: bool = False
    vid_stride: int = 1
    amp: str = "auto"  # CPU: bf16 autocast with AMX (auto), fp32 otherwise


@dataclass
class Timings:
    """Accumulated seconds per stage, for the final speed line."""
    pre: float = 0.0
    inference: float = 0.0
    nms: float = 0.0
    seen: int = 0


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _warn_unsupported(config: DetectConfig) -> None:
    if config.view_img:
        LOGGER.warning("--view-img: no display available with headless OpenCV; results are saved instead")
    if config.augment:
        LOGGER.warning("--augment (test-time augmentation) is not supported; ignored")
    if config.visualize:
        LOGGER.warning("--visualize (feature maps) is not supported; ignored")
    if config.dnn:
        LOGGER.warning("--dnn (OpenCV DNN for ONNX) is not supported; .onnx files run on onnxruntime")
    if config.data:
        LOGGER.info("--data is not needed: class names come from the weights")


def _check_settings(config: DetectConfig) -> None:
    for flag, value in (("--conf-thres", config.conf_thres), ("--iou-thres", config.iou_thres)):
        if not 0.0 <= value <= 1.0:
            raise DetectError(f"{flag} {value}: must be between 0 and 1")
    for flag, value in (("--max-det", config.max_det), ("--line-thickness", config.line_thickness)):
        if value < 1:
            raise DetectError(f"{flag} {value}: must be 1 or more")


def _check_image_size(imgsz, stride: int) -> tuple[int, int]:
    sizes = [int(s) for s in imgsz]
    sizes = sizes * 2 if len(sizes) == 1 else sizes[:2]
    if min(sizes) <= 0:
        raise DetectError(f"--imgsz {imgsz}: sizes must be positive")
    rounded = tuple(max(int(np.ceil(s / stride) * stride), stride) for s in sizes)
    if rounded != tuple(sizes):
        LOGGER.warning(f"--imgsz {sizes} must be a multiple of max stride {stride}, updating to {list(rounded)}")
    return rounded


def _load_model(config: DetectConfig, device: torch.device):
    """The model behind ``--weights`` (.pt, .torchscript or .onnx: models/backends.py) and whether it runs fp16."""
    from models.backends import load_backend

    weights = Path(config.weights)
    if not weights.is_file():
        raise DetectError(f"weights not found: {weights} (nothing is downloaded; pass --weights "
                          "path/to/weights.pt, e.g. runs/train/exp/weights/best.pt)")
    half = config.half and device.type == "cuda"
    if config.half and not half:
        LOGGER.warning(f"--half needs a CUDA device; running float32 on {device.type}")
    model = load_backend(weights, device, half=half)
    anchors = model.anchors_text()
    if anchors:
        LOGGER.info("%s", anchors)
    return model, half


def _input_size(model, imgsz) -> tuple[tuple[int, int], bool]:
    """(letterbox size, minimal-padding letterbox?): a static-shape export takes exactly its own size."""
    if model.imgsz is None:
        return _check_image_size(imgsz, model.stride), True
    if tuple(imgsz) != tuple(model.imgsz):
        LOGGER.warning(f"{Path(model.path).name} was exported for {model.imgsz[0]}x{model.imgsz[1]} inputs; "
                       f"using that instead of --imgsz {imgsz[0]} {imgsz[1]} (export with --dynamic for any size)")
    return tuple(model.imgsz), False


def _prepare(image: np.ndarray, imgsz, stride: int, device, half: bool, auto: bool = True) -> torch.Tensor:
    """BGR HxWx3 -> letterboxed RGB (1, 3, h, w) float in [0, 1] on ``device``; ``auto``: pad only to a
    multiple of ``stride`` (else exactly ``imgsz``)."""
    boxed = letterbox(image, imgsz, stride=stride, auto=auto)[0]
    array = np.ascontiguousarray(boxed[:, :, ::-1].transpose(2, 0, 1))
    tensor = torch.from_numpy(array).to(device)
    tensor = tensor.half() if half else tensor.float()
    return (tensor / 255)[None]


def _warmup(model, imgsz, device, half: bool) -> None:
    """One forward pass so the first image's time is not the one-off setup cost."""
    with torch.inference_mode():
        model(torch.zeros(1, 3, *imgsz, device=device, dtype=torch.half if half else torch.float))


def _describe(det: torch.Tensor, names: list[str]) -> str:
    """'2 RBCs, 1 WBC, ' (per class counts, class order)."""
    text = ""
    for cls in det[:, 5].unique():
        count = int((det[:, 5] == cls).sum())
        name = _name(names, cls)
        text += f"{count} {name}{'s' * (count > 1 and not name.endswith('s'))}, "
    return text


def _name(names: list[str], cls) -> str:
    index = int(cls)
    return names[index] if 0 <= index < len(names) else str(index)


def _write_labels(path: Path, det: torch.Tensor, shape, save_conf: bool) -> None:
    """YOLO label lines: class cx cy w h [conf], normalised to the original image."""
    gain = torch.tensor(shape)[[1, 0, 1, 0]].float()
    lines = []
    for *xyxy, conf, cls in det.tolist():
        xywh = (xyxy2xywh(torch.tensor(xyxy).view(1, 4)) / gain).view(-1).tolist()
        values = (int(cls), *xywh, conf) if save_conf else (int(cls), *xywh)
        lines.append(("%g " * len(values)).rstrip() % values + "\n")
    with open(path, "a", encoding="utf-8") as file:
        file.writelines(lines)


def _annotate(item: SourceItem, det: torch.Tensor, names, config: DetectConfig, save_dir: Path) -> np.ndarray:
    """Draw the detections on a copy of the original image; save crops when asked."""
    image = item.image.copy()
    stem = Path(item.path).stem
    for *xyxy, conf, cls in det.tolist():
        if config.save_crop:
            save_one_box(xyxy, item.image, save_dir / "crops" / _name(names, cls) / f"{stem}.jpg")
        if config.nosave and not config.view_img:
            continue
        label = None if config.hide_labels else \
            (_name(names, cls) if config.hide_conf else f"{_name(names, cls)} {conf:.2f}")
        draw_box_label(image, xyxy, label, colors(int(cls), bgr=True), config.line_thickness)
    return image


class VideoSink:
    """One cv2.VideoWriter (mp4v) per input video, opened on its first frame."""

    def __init__(self):
        self.path, self.writer = None, None

    def write(self, path: Path, image: np.ndarray, fps: float) -> None:
        if path != self.path:
            self.close()
            self.path = path
            height, width = image.shape[:2]
            self.writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps or 30.0, (width, height))
        self.writer.write(image)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.release()
        self.path, self.writer = None, None


def _predict(model, item: SourceItem, config: DetectConfig, context: dict):
    """One image -> (detections in original pixels, letterboxed shape, inference seconds)."""
    device, timings = context["device"], context["timings"]
    start = _now(device)
    tensor = _prepare(item.image, context["imgsz"], context["stride"], device, context["half"], context["auto"])
    loaded = _now(device)
    with torch.inference_mode(), context["autocast"]:
        output = model(tensor.contiguous(memory_format=torch.channels_last))
    inferred = _now(device)
    det = non_max_suppression(output, config.conf_thres, config.iou_thres, config.classes,
                              config.agnostic_nms, max_det=config.max_det)[0]
    det[:, :4] = scale_boxes(tensor.shape[2:], det[:, :4], item.image.shape).round()
    done = _now(device)
    timings.pre += loaded - start
    timings.inference += inferred - loaded
    timings.nms += done - inferred
    timings.seen += 1
    return det.cpu(), tensor.shape[2:], inferred - loaded


def _save_outputs(item: SourceItem, det, config: DetectConfig, context: dict) -> None:
    save_dir, names = context["save_dir"], context["names"]
    stem = Path(item.path).stem
    if config.save_txt and len(det):
        label_name = f"{stem}_{item.frame}.txt" if item.is_video else f"{stem}.txt"
        _write_labels(save_dir / "labels" / label_name, det, item.image.shape, config.save_conf)
    if config.nosave and not config.save_crop:
        return
    image = _annotate(item, det, names, config, save_dir)
    if config.nosave:
        return
    if item.is_video:
        context["video"].write(save_dir / f"{stem}.mp4", image, item.fps)
    elif not cv2.imwrite(str(save_dir / Path(item.path).name), image):
        LOGGER.warning(f"could not write {save_dir / Path(item.path).name}")


def _log_line(item: SourceItem, det, shape, seconds: float, names) -> str:
    if item.is_video:
        head = f"video {item.index}/{item.count} ({item.frame}/{item.frames}) {item.path}: "
    else:
        head = f"image {item.index}/{item.count} {item.path}: "
    found = _describe(det, names) if len(det) else "(no detections), "
    return f"{head}{shape[0]}x{shape[1]} {found}{seconds * 1e3:.1f}ms"


def run(config: DetectConfig) -> Path:
    """Detect on ``config.source``; returns the run folder (runs/detect/expN)."""
    _check_settings(config)
    _warn_unsupported(config)
    sources = Sources(config.source, config.vid_stride)
    device = select_device(config.device)
    model, half = _load_model(config, device)
    stride = model.stride
    imgsz, auto = _input_size(model, config.imgsz)
    save_dir = increment_path(Path(config.project) / config.name, exist_ok=config.exist_ok, mkdir=True)
    if config.save_txt:
        (save_dir / "labels").mkdir(parents=True, exist_ok=True)
    from utils.precision import inference_autocast

    context = {"device": device, "half": half, "stride": stride, "imgsz": imgsz, "auto": auto, "save_dir": save_dir,
               "names": list(model.names), "timings": Timings(), "video": VideoSink(),
               "autocast": inference_autocast(device, half, config.amp)}
    _warmup(model, imgsz, device, half)
    show_bar = bool(sources.videos) or sources.num_images > PROGRESS_MIN_IMAGES
    bar = tqdm(total=sources.total_items() if show_bar else 0, disable=not show_bar, unit="img",
               bar_format="{l_bar}{bar:10}{r_bar}")
    try:
        for item in sources:
            det, shape, seconds = _predict(model, item, config, context)
            _save_outputs(item, det, config, context)
            LOGGER.info(_log_line(item, det, shape, seconds, context["names"]))
            bar.update(1)
    finally:
        bar.close()
        context["video"].close()
    _log_summary(context, imgsz, config)
    return save_dir


def _log_summary(context: dict, imgsz, config: DetectConfig) -> None:
    timings, save_dir = context["timings"], context["save_dir"]
    seen = max(timings.seen, 1)
    LOGGER.info(f"Speed: {timings.pre / seen * 1e3:.1f}ms pre-process, {timings.inference / seen * 1e3:.1f}ms "
                f"inference, {timings.nms / seen * 1e3:.1f}ms NMS per image at shape (1, 3, {imgsz[0]}, {imgsz[1]})")
    saved = ""
    if config.save_txt:
        count = len(list((save_dir / "labels").glob("*.txt")))
        saved = f"\n{count} label{'s' * (count != 1)} saved to {save_dir / 'labels'}"
    if not config.nosave or config.save_txt or config.save_crop:
        LOGGER.info(f"Results saved to {save_dir}{saved}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(prog="detect.py", description="Detect objects in images and videos.")
    add = parser.add_argument
    add("--weights", type=str, default="yolov5s.pt", help="model: .pt (ours or YOLOv5's), .torchscript or .onnx")
    add("--source", type=str, default="data/images", help="image, folder, glob, .txt list or video file")
    add("--data", type=str, default=None, help="dataset YAML (optional; names come from the weights)")
    add("--imgsz", "--img", "--img-size", nargs="+", type=image_size, default=[640],
        help="inference size h w (or one side)")
    add("--conf-thres", type=probability, default=0.25, help="confidence threshold")
    add("--iou-thres", type=probability, default=0.45, help="NMS IoU threshold")
    add("--max-det", type=max_detections, default=1000, help="maximum detections per image")
    add_device_flag(parser)
    add("--view-img", action="store_true", help="show results (needs a display; not available headless)")
    add("--save-txt", action="store_true", help="save results to labels/*.txt")
    add("--save-conf", action="store_true", help="save confidences in --save-txt labels")
    add("--save-crop", action="store_true", help="save cropped prediction boxes")
    add("--nosave", action="store_true", help="do not save images/videos")
    add("--classes", nargs="+", type=int_in_range(0, MAX_CLASSES - 1),
        help="filter by class: --classes 0, or --classes 0 2 3")
    add("--agnostic-nms", action="store_true", help="class-agnostic NMS")
    add("--augment", action="store_true", help="augmented inference (not supported; ignored)")
    add("--visualize", action="store_true", help="visualize features (not supported; ignored)")
    add_run_folder_flags(parser, "runs/detect")
    add("--line-thickness", default=3, type=int_in_range(1, 100), help="bounding box thickness (pixels)")
    add("--hide-labels", action="store_true", help="hide labels")
    add("--hide-conf", action="store_true", help="hide confidences")
    add_half_flag(parser)
    add_amp_flag(parser)
    add("--dnn", action="store_true", help="OpenCV DNN for ONNX inference (not supported; ignored)")
    add("--vid-stride", type=positive_int, default=1, help="video frame-rate stride")
    args = parser.parse_args(argv)
    if len(args.imgsz) > 2:
        parser.error(f"argument --imgsz: expected one size or two (h w), got {len(args.imgsz)}")
    return args


def config_from_args(args: argparse.Namespace) -> DetectConfig:
    values = vars(args).copy()
    values["imgsz"] = tuple(values["imgsz"] * 2 if len(values["imgsz"]) == 1 else values["imgsz"][:2])
    return DetectConfig(**values)


class _TqdmHandler(logging.StreamHandler):
    """Log lines printed above an active progress bar instead of through it."""

    def emit(self, record):
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def main(argv=None) -> int:
    """Exit code 0, 1 for a bad input file, 2 for a bad flag (see utils.errors.run_main)."""
    return run_main("detect.py", _main, argv)


def _main(argv) -> int:
    args = parse_args(argv)
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    from utils.memory import keep_freed_memory

    keep_freed_memory()  # whole-process choice: see utils/memory.py
    run(config_from_args(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
