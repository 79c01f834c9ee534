"""Run a detector on images, folders, globs, .txt lists and videos; save drawn results and labels.

    python detect.py --weights runs/train/exp/weights/best.pt --source data/images
    python detect.py --weights best.pt --source video.mp4 --save-txt --conf-thres 0.4
    python detect.py --weights best.onnx --source data/images      # or best.torchscript (export.py)

Outputs go to runs/detect/exp, exp2, ... (never overwriting an earlier run): drawn images and
videos (mp4), labels/<stem>.txt (YOLO class cx cy w h [conf], normalised; --save-format 1: class x1 y1 x2 y2
[conf], normalised too) with --save-txt, predictions.csv (Image Name,Prediction,Confidence: one row per
detection, in the label lines' order) with --save-csv, crops/<class>/<stem>.jpg with --save-crop (the class
name made one safe folder name, e.g. "../x" -> "_x", or the class index when nothing of it is usable: a model's
names never place files outside the run folder). --update strips each --weights file that is one of our own
checkpoints in place once detection is done (utils.checkpoint.strip_checkpoint); any other file, and an unfinished
run's last.pt (which --resume needs whole), is left as it is. --visualize writes <image>/stage{i}_{Type}_features.png
and .npy for each layer of a checkpoint's model (utils/feature_maps.py).

From Python, ``detect.run(weights="best.pt", source="data/images", conf_thres=0.4)`` takes the same flags as
keywords and returns a ``DetectResult``: the run folder and each image's detections; ``detect.run(...,
stream=True)`` yields them one image or video frame at a time instead, keeping none.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple

import cv2
import numpy as np
import torch
from tqdm import tqdm

from utils.api import StreamedCall
from utils.cli import (ArgumentParser, add_amp_flag, add_device_flag, add_half_flag, add_run_folder_flags, image_size,
                       int_in_range, max_detections, positive_int, probability)
from utils.device import select_device
from utils.drawing import colors, draw_box_label, save_one_box
from utils.errors import UserError, run_main
from utils.detect_outputs import VideoSink, WeightsFile, update_weights, write_labels, write_predictions
from utils.feature_maps import LayerOutputs, save_feature_maps
from utils.inference import LABEL_FORMATS, Detection, as_detections, class_name, describe, forward, input_size, \
    prepare_image, select_detections
from utils.limits import MAX_CLASSES
from utils.paths import crop_folder, increment_path, inside, safe_component
from utils.sources import SourceItem, Sources

SAMPLE_IMAGES = Path(__file__).resolve().parent / "data" / "images"  # YOLOv5's default source, our own images

LOGGER = logging.getLogger("detect")
PROGRESS_MIN_IMAGES = 20  # folders larger than this get a progress bar
_name = class_name  # a class index's name (its number when the weights have no name for it)


class DetectError(UserError):
    """A detect.py setting that cannot be used; one line naming it."""


@dataclass
class DetectConfig:
    weights: str | list = "yolov5s.pt"  # several: an ensemble
    source: str = str(SAMPLE_IMAGES)
    data: str | None = None
    imgsz: tuple[int, int] = (640, 640)
    conf_thres: float = 0.25
    iou_thres: float = 0.45
    max_det: int = 1000
    device: str = ""
    view_img: bool = False
    save_txt: bool = False
    save_format: int = 0  # --save-txt boxes: 0 YOLO (cx cy w h), 1 Pascal-VOC (x1 y1 x2 y2), both normalised
    save_csv: bool = False
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
    update: bool = False  # strip our own checkpoints among --weights in place after detection


@dataclass
class DetectResult:
    """What ``run`` returns: the run folder and, per image (``path``) or video frame (``path:frame``, 1-based), the
    detections as ``Detection(xyxy, score, class_id, name)`` tuples in the original image's pixels."""
    save_dir: Path
    detections: dict[str, list[Detection]] = field(default_factory=dict)


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
    if config.data:
        LOGGER.info("--data is not needed: class names come from the weights")


def _check_settings(config: DetectConfig) -> None:
    for flag, value in (("--conf-thres", config.conf_thres), ("--iou-thres", config.iou_thres)):
        if not 0.0 <= value <= 1.0:
            raise DetectError(f"{flag} {value}: must be between 0 and 1")
    for flag, value in (("--max-det", config.max_det), ("--line-thickness", config.line_thickness)):
        if value < 1:
            raise DetectError(f"{flag} {value}: must be 1 or more")
    if config.save_format not in LABEL_FORMATS:
        raise DetectError(f"--save-format {config.save_format}: must be 0 (YOLO) or 1 (Pascal-VOC)")


def _weights_files(config: DetectConfig) -> list[WeightsFile]:
    from utils.downloads import is_url, weights_file

    files = []
    for given in ([config.weights] if isinstance(config.weights, (str, Path)) else config.weights):
        downloaded = is_url(os.fspath(given)) or not Path(given).exists()
        weights = weights_file(given)  # a URL or a YOLOv5 release name is downloaded first
        if not weights.exists():  # a file, or an OpenVINO export folder
            raise DetectError(f"weights not found: {weights} (pass --weights path/to/weights.pt, e.g. "
                              "runs/train/exp/weights/best.pt, a URL or a YOLOv5 release name such as yolov5s.pt)")
        files.append(WeightsFile(weights, downloaded))
    return files


def _load_model(config: DetectConfig, paths: list[Path], device: torch.device):
    """The model behind ``--weights`` (.pt, .torchscript or .onnx: models/backends.py; several .pt: an ensemble;
    ``--augment``: test-time augmentation, models/composite.py) and whether it runs fp16."""
    from models.composite import load_models

    half = config.half and device.type == "cuda"
    if config.half and not half:
        LOGGER.warning(f"--half needs a CUDA device; running float32 on {device.type}")
    model = load_models(paths, device, half=half, augment=config.augment, dnn=config.dnn)
    anchors = model.anchors_text()
    if anchors:
        LOGGER.info("%s", anchors)
    return model, half


def _warmup(model, imgsz, device, half: bool) -> None:
    """One forward pass so the first image's time is not the one-off setup cost."""
    with torch.inference_mode():
        model(torch.zeros(1, 3, *imgsz, device=device, dtype=torch.half if half else torch.float))


def _annotate(item: SourceItem, det: torch.Tensor, names, config: DetectConfig, save_dir: Path) -> np.ndarray:
    """Draw the detections on a copy of the original image; save crops when asked."""
    image = item.image.copy()
    stem = item.name or Path(item.path).stem
    for *xyxy, conf, cls in det.tolist():
        if config.save_crop:
            save_one_box(xyxy, item.image, crop_folder(save_dir, names, int(cls)) / f"{stem}.jpg")
        if config.nosave and not config.view_img:
            continue
        label = None if config.hide_labels else \
            (_name(names, cls) if config.hide_conf else f"{_name(names, cls)} {conf:.2f}")
        draw_box_label(image, xyxy, label, colors(int(cls), bgr=True), config.line_thickness)
    return image


def _layered_model(model):
    """--visualize: the checkpoint's model whose layers' outputs are saved, or None (said once) for a model without
    layers to hook: an exported file, an ensemble, --augment."""
    if getattr(model, "kind", "") == "pytorch" and hasattr(getattr(model, "model", None), "model"):
        return model.model
    LOGGER.warning("WARNING: --visualize saves a checkpoint's layer outputs: not done for an exported model, an "
                   "ensemble or --augment")
    return None


def _predict(model, item: SourceItem, config: DetectConfig, context: dict):
    """One image -> (detections in original pixels, letterboxed shape, inference seconds)."""
    device, timings = context["device"], context["timings"]
    start = _now(device)
    tensor = prepare_image(item.image, context["imgsz"], context["stride"], device, context["half"], context["auto"])
    loaded = _now(device)
    layers = context["visualize"]
    with LayerOutputs(layers) if layers is not None else contextlib.nullcontext() as outputs:
        output = forward(model, tensor, context["autocast"])
    inferred = _now(device)
    det = select_detections(output, tensor.shape[2:], [item.image.shape], config.conf_thres, config.iou_thres,
                            config.classes, config.agnostic_nms, config.max_det)[0]
    done = _now(device)
    timings.pre += loaded - start
    timings.inference += inferred - loaded
    timings.nms += done - inferred
    timings.seen += 1
    if outputs is not None:  # --visualize: each image's (frame's) layer outputs in a folder of its own, untimed
        stem = safe_component(item.name or Path(item.path).stem, "image")
        save_feature_maps(outputs.maps, increment_path(inside(context["save_dir"], stem), mkdir=True))
    return det.cpu(), tensor.shape[2:], inferred - loaded


def _save_outputs(item: SourceItem, det, config: DetectConfig, context: dict) -> None:
    """The files of one image or frame. They take its detections least confident first, as YOLOv5's reversed(det):
    label lines, CSV rows and crops (``stem.jpg``, ``stem2.jpg``, ...) in its order, the most confident box drawn last,
    on top. The API's detections stay most confident first."""
    save_dir, names = context["save_dir"], context["names"]
    det = det.flip(0)
    stem = item.name or Path(item.path).stem
    if config.save_txt and len(det):
        label_name = f"{stem}_{item.frame}.txt" if item.is_video else f"{stem}.txt"
        write_labels(save_dir / "labels" / label_name, det, item.image.shape, config.save_conf, config.save_format)
    if config.save_csv and len(det):  # a file's name (a video's frames under it), as YOLOv5's p.name; a live source
        # under its output name (stream0, screen), never its URL, which may hold credentials
        write_predictions(save_dir / "predictions.csv", item.name or Path(item.path).name, det, names)
    if config.nosave and not config.save_crop:
        return
    image = _annotate(item, det, names, config, save_dir)
    if config.nosave:
        return
    if item.is_video:
        context["video"].write(save_dir / f"{stem}.mp4", image, item.fps, live=bool(item.name))
    elif not cv2.imwrite(str(save_dir / Path(item.path).name), image):
        LOGGER.warning(f"could not write {save_dir / Path(item.path).name}")


def _log_line(item: SourceItem, det, shape, seconds: float, names) -> str:
    if item.is_video:
        position = f"{item.frame}/{item.frames}" if item.frames else f"frame {item.frame}"  # live: no end known
        head = f"{'stream' if item.name else 'video'} {item.index}/{item.count} ({position}) {item.path}: "
    else:
        head = f"image {item.index}/{item.count} {item.path}: "
    found = describe(det, names) if len(det) else "(no detections), "
    return f"{head}{shape[0]}x{shape[1]} {found}{seconds * 1e3:.1f}ms"


def run(*args, stream: bool = False, **options):
    """Python API: ``detect.run(weights="best.pt", source="images/", conf_thres=0.4, save_txt=True)``.

    Keywords are detect.py's flags with underscores for dashes, with the same defaults and checks (a bad value
    or an unknown keyword raises ArgumentError with the command line's one-line message; a bad file a UserError).
    Positional arguments are YOLOv5's first parameters in its order (weights, source, data, imgsz, ...).
    Returns the run folder and the detections per image (``DetectResult``). With ``stream=True`` it returns a
    ``DetectStream`` instead: the model is loaded and the run folder made at once, then iterating yields one
    ``DetectedImage(path, frame, detections)`` per image or video frame as it is processed, keeping none (for long
    videos); each step runs under the API's guard, so the caller's code between items runs as it would alone.
    """
    from utils.api import DETECT_POSITIONS, api_call, keyword_argv, with_positions

    options = with_positions("detect.py", DETECT_POSITIONS, args, options)
    config = config_from_args(parse_args(keyword_argv(build_parser(), options)))
    if stream:
        return DetectStream(config)
    with api_call():
        return run_config(config, collect=True)


class DetectedImage(NamedTuple):
    """One processed image or video frame: its file, its 1-based frame number (0 for an image) and its detections
    as ``Detection(xyxy, score, class_id, name)`` tuples in the original image's pixels."""
    path: str
    frame: int
    detections: list[Detection]

    @property
    def key(self) -> str:
        """Its key in ``DetectResult.detections``: the path, ``path:frame`` for a video frame."""
        return f"{self.path}:{self.frame}" if self.frame else self.path


def run_config(config: DetectConfig, collect: bool = False, interrupted: threading.Event | None = None
               ) -> DetectResult:
    """Detect on ``config.source``: drawn images/videos and labels in the run folder (runs/detect/expN);
    ``collect``: also keep every image's detections in the result (the command line does not); ``interrupted``:
    see DetectRun."""
    detect_run = DetectRun(config, interrupted)
    result = DetectResult(detect_run.save_dir)
    for found in detect_run.images():
        if collect:
            result.detections[found.key] = found.detections
    return result


class DetectRun:
    """One detect run. Built: settings checked, sources resolved, model loaded and warmed up, run folder made.
    ``images()`` then processes the sources one image or video frame at a time (outputs written as it goes) and
    yields a DetectedImage for each, keeping nothing; its end logs the speed line, and however it ends the progress
    bar and the video being written are closed. ``interrupted`` (the command line's: ``interrupts_noted``), once
    set, ends it with KeyboardInterrupt before the next image, should the one Ctrl-C raised have been dropped."""

    def __init__(self, config: DetectConfig, interrupted: threading.Event | None = None):
        from utils.precision import inference_autocast

        _check_settings(config)
        _warn_unsupported(config)
        self.config = config
        self.interrupted = interrupted or threading.Event()
        self.sources = Sources(config.source, config.vid_stride)
        device = select_device(config.device)
        self.weights = _weights_files(config)
        self.model, half = _load_model(config, [weights.path for weights in self.weights], device)
        imgsz, auto = input_size(self.model, config.imgsz)
        self.save_dir = increment_path(Path(config.project) / config.name, exist_ok=config.exist_ok, mkdir=True)
        if config.save_txt:
            (self.save_dir / "labels").mkdir(parents=True, exist_ok=True)
        exported = "" if getattr(self.model, "kind", "pytorch") == "pytorch" else self.model.kind
        self.context = {"device": device, "half": half, "stride": self.model.stride, "imgsz": imgsz, "auto": auto,
                        "save_dir": self.save_dir, "names": list(self.model.names), "timings": Timings(),
                        "video": VideoSink(), "autocast": inference_autocast(device, half, config.amp, exported),
                        "visualize": _layered_model(self.model) if config.visualize else None}
        _warmup(self.model, imgsz, device, half)

    def images(self) -> Iterator[DetectedImage]:
        config, context, sources = self.config, self.context, self.sources
        show_bar = bool(sources.videos) or sources.num_images > PROGRESS_MIN_IMAGES
        bar = tqdm(total=sources.total_items() if show_bar else 0, disable=not show_bar, unit="img",
                   bar_format="{l_bar}{bar:10}{r_bar}")
        try:
            for item in sources:
                if self.interrupted.is_set():
                    raise KeyboardInterrupt
                det, shape, seconds = _predict(self.model, item, config, context)
                _save_outputs(item, det, config, context)
                LOGGER.info(_log_line(item, det, shape, seconds, context["names"]))
                bar.update(1)
                yield DetectedImage(item.path, item.frame if item.is_video else 0,
                                    as_detections(det, context["names"]))
        finally:
            bar.close()
            context["video"].close()
            sources.close()
        _log_summary(context, context["imgsz"], config)
        if config.update:
            update_weights(self.weights)


class DetectStream(StreamedCall):
    """What ``detect.run(stream=True)`` returns: an iterator of DetectedImage (see DetectRun.images) whose every
    step runs under the API's guard; ``save_dir`` is the run folder. ``close()`` (or a ``with`` block) ends it
    early; a video being written is then finished."""

    def __init__(self, config: DetectConfig):
        from utils.api import api_call

        with api_call():
            detect_run = DetectRun(config)  # a bad setting, source or weights file raises here, not at the first item
        self.save_dir = detect_run.save_dir
        super().__init__(detect_run.images())


def _log_summary(context: dict, imgsz, config: DetectConfig) -> None:
    timings, save_dir = context["timings"], context["save_dir"]
    seen = max(timings.seen, 1)
    LOGGER.info(f"Speed: {timings.pre / seen * 1e3:.1f}ms pre-process, {timings.inference / seen * 1e3:.1f}ms "
                f"inference, {timings.nms / seen * 1e3:.1f}ms NMS per image at shape (1, 3, {imgsz[0]}, {imgsz[1]})")
    saved = ""
    if config.save_txt:
        count = len(list((save_dir / "labels").glob("*.txt")))
        saved = f"\n{count} label{'s' * (count != 1)} saved to {save_dir / 'labels'}"
    if not config.nosave or config.save_txt or config.save_csv or config.save_crop:
        LOGGER.info(f"Results saved to {save_dir}{saved}")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="detect.py", description="Detect objects in images and videos.")
    add = parser.add_argument
    add("--weights", nargs="+", type=str, default=["yolov5s.pt"],
        help="model: .pt (ours or YOLOv5's; several: an ensemble), .torchscript, .onnx or an OpenVINO folder / .xml")
    add("--source", type=str, default=str(SAMPLE_IMAGES),
        help="image, folder, glob, .txt list, video, image/video URL, webcam index, stream URL, .streams list or "
             "'screen' (default: the sample images in data/images)")
    add("--data", type=str, default=None, help="dataset YAML (optional; names come from the weights)")
    add("--imgsz", "--img", "--img-size", nargs="+", type=image_size, default=[640],
        help="inference size h w (or one side)")
    add("--conf-thres", type=probability, default=0.25, help="confidence threshold")
    add("--iou-thres", type=probability, default=0.45, help="NMS IoU threshold")
    add("--max-det", type=max_detections, default=1000, help="maximum detections per image")
    add_device_flag(parser)
    add("--view-img", action="store_true", help="show results (needs a display; not available headless)")
    add("--save-txt", action="store_true", help="save results to labels/*.txt")
    add("--save-format", type=int_in_range(0, 1), default=0, metavar="{0,1}",
        help="--save-txt box format: 0 YOLO (cx cy w h), 1 Pascal-VOC (x1 y1 x2 y2), both normalised")
    add("--save-csv", action="store_true", help="save results to predictions.csv (image, class, confidence)")
    add("--save-conf", action="store_true", help="save confidences in --save-txt labels")
    add("--save-crop", action="store_true", help="save cropped prediction boxes")
    add("--nosave", action="store_true", help="do not save images/videos")
    add("--classes", nargs="+", type=int_in_range(0, MAX_CLASSES - 1),
        help="filter by class: --classes 0, or --classes 0 2 3")
    add("--agnostic-nms", action="store_true", help="class-agnostic NMS")
    add("--augment", action="store_true", help="augmented inference (TTA: 3 scales, a flip; checkpoints only)")
    add("--visualize", action="store_true",
        help="save each layer's output maps per image (stage*_features.png and .npy; checkpoints only)")
    add_run_folder_flags(parser, "runs/detect")
    add("--line-thickness", default=3, type=int_in_range(1, 100), help="bounding box thickness (pixels)")
    add("--hide-labels", action="store_true", help="hide labels")
    add("--hide-conf", action="store_true", help="hide confidences")
    add_half_flag(parser)
    add_amp_flag(parser)
    add("--dnn", action="store_true", help="run .onnx files on OpenCV's DNN module (CPU) instead of onnxruntime")
    add("--vid-stride", type=positive_int, default=1, help="video frame-rate stride")
    add("--update", action="store_true",
        help="after detection, strip optimizer and training state from --weights checkpoints of ours, in place "
             "(others are left as they are)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.imgsz) > 2:
        parser.error(f"argument --imgsz: expected one size or two (h w), got {len(args.imgsz)}")
    return args


def config_from_args(args: argparse.Namespace) -> DetectConfig:
    values = vars(args).copy()
    values["imgsz"] = tuple(values["imgsz"] * 2 if len(values["imgsz"]) == 1 else values["imgsz"][:2])
    if isinstance(values["weights"], list) and len(values["weights"]) == 1:
        values["weights"] = values["weights"][0]
    return DetectConfig(**values)


class _TqdmHandler(logging.StreamHandler):
    """Log lines printed above an active progress bar instead of through it. A line and its newline go out in one
    write (tqdm.write writes its ``end`` separately): a Ctrl-C raised between the two left the line open, and
    "detect.py: interrupted" was printed at its end."""

    def emit(self, record):
        try:
            tqdm.write(self.format(record) + "\n", file=sys.stderr, end="")
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
    with interrupts_noted() as interrupted:
        run_config(config_from_args(args), interrupted=interrupted)
    return 0


@contextlib.contextmanager
def interrupts_noted() -> Iterator[threading.Event]:
    """Ctrl-C for the command line: a SIGINT raises KeyboardInterrupt where it lands, as Python's own handler does,
    and also sets the Event yielded, which DetectRun checks before each image; one still set at the end raises.

    Python drops a KeyboardInterrupt raised inside a finalizer (a weakref callback or ``__del__``: it prints
    "Exception ignored in ..." and goes on), and mss runs a weakref finalizer for every screenshot: a Ctrl-C that
    landed there left ``--source screen`` (or a live stream, which never ends either) running on. SIGINT is left as it
    is when its handler is not Python's default one (ignored in a background job, or a caller's own) or outside the
    main thread; the Event is then never set."""
    interrupted = threading.Event()

    def on_interrupt(number, frame):
        interrupted.set()
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield interrupted
        return
    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted.is_set():  # dropped after the last image (closing the video, the summary)
        raise KeyboardInterrupt


if __name__ == "__main__":
    from utils.errors import exit_process

    exit_process(main())
