"""The model ``torch.hub.load`` returns (hubconf.py): images in, boxes out, like YOLOv5's AutoShape.

    model = torch.hub.load("path/to/repo", "custom", path="best.pt", source="local")
    results = model(["a.jpg", Image.open("b.jpg")], size=640)   # paths, PIL, numpy, lists; or a BCHW tensor
    results.xyxy[0]       # (n, 6) tensor: x1, y1, x2, y2, confidence, class (pixels of the original image)
    results.detections[0] # [Detection(xyxy, score, class_id, name), ...]
    results.print()       # or .show(), .save(), .crop(), .render(), .pandas(), .tolist(), as YOLOv5's

The results are ``Detections`` (utils/hub_results.py): YOLOv5's box views and methods, with the images as
loaded in ``results.ims`` (RGB; an RGB array input is kept by reference, not copied); save() and crop() write
into a new runs/detect/expN folder, as YOLOv5's.

Inputs: a file path (read like detect.py: EXIF orientation applied), an image URL (fetched by utils/downloads.py
into a private temporary folder and removed once decoded; nothing is written where you work), a PIL image, a numpy HxWx3 uint8 array
in RGB order as YOLOv5's AutoShape takes it (``model(image, bgr=True)`` for ``cv2.imread`` arrays; gray and
4-channel arrays are converted), or a list of these. A float (B, 3, H, W) tensor in [0, 1] with sides that are
multiples of the model's stride is run as given and returns the model's raw output, ``(pred, ...)`` with pred
``(B, N, 5 + nc)`` before NMS, as YOLOv5's AutoShape returns it, so ``torch.jit.trace(model, [im])`` works.
Each image runs through detect.py's own steps (utils/inference.py): letterbox to ``size`` with minimal padding,
the precision val.py and detect.py use (``--amp auto``: bf16 autocast on CPUs with native bf16, else fp32),
NMS with the model's ``conf``, ``iou``, ``classes``, ``agnostic``, ``multi_label`` and ``max_det`` attributes,
boxes scaled back to the original image and rounded to whole pixels: the results equal detect.py's.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import torch
from torch import nn

from utils.data.images import read_image, to_bgr8
from utils.downloads import is_url
from utils.errors import UserError
from utils.hub_results import Detections
from utils.inference import InferenceError, forward, input_size, prepare_image, select_detections
from utils.precision import inference_autocast

MAX_IMAGE_DOWNLOAD_BYTES = 256 << 20  # an image URL larger than this is refused as it arrives

__all__ = ["Detections", "HubModel", "load_hub_model", "load_image", "load_input", "untrained_hub_model"]


class HubModel(nn.Module):
    """A detector that takes images and returns ``Detections``; NMS settings are attributes, as in AutoShape."""

    conf = 0.25  # confidence threshold
    iou = 0.45  # NMS IoU threshold
    agnostic = False  # class-agnostic NMS
    multi_label = False  # a box may carry several classes
    classes = None  # keep only these class indices, e.g. [0, 15, 16]
    max_det = 1000  # detections per image
    amp = "auto"  # CPU precision, as --amp: "auto" (bf16 where the CPU computes it natively), "bf16", "off"

    def __init__(self, model: nn.Module, names, stride: int, imgsz=None, path=None):
        super().__init__()
        self.model = model
        self.names = [str(name) for name in names]
        self.stride = int(stride)
        self.imgsz = imgsz  # (h, w) of a static-shape export, else None
        self.path = Path(path) if path is not None else None

    @property
    def device(self) -> torch.device:
        parameter = next(self.model.parameters(), None)
        return parameter.device if parameter is not None else torch.device(getattr(self.model, "device", "cpu"))

    def forward(self, images, size=640, augment: bool = False, bgr: bool = False) -> "Detections":
        """Detect in ``images`` (see the module docstring); ``size``: letterbox size (one side or (h, w));
        ``augment``: test-time augmentation (checkpoints only, models/composite.py)."""
        device = self.device
        kind = getattr(self.model, "kind", "pytorch")
        autocast = inference_autocast(device, False, self.amp, "" if kind == "pytorch" else kind)
        model = self.model
        if augment:
            from models.composite import AugmentedBackend

            model = AugmentedBackend(self.model)
        if isinstance(images, torch.Tensor):
            return self._tensor_batch(model, images, autocast)
        items = list(images) if isinstance(images, (list, tuple)) else [images]
        sizes = list(size) if isinstance(size, (list, tuple)) else [size]
        imgsz, auto = input_size(self, sizes * 2 if len(sizes) == 1 else sizes, option="size")
        files, shapes, results, originals, times, input_shapes = [], [], [], [], [], []
        for index, item in enumerate(items):
            begin = _now(device)
            name, original, image = load_input(item, index, bgr)
            tensor = prepare_image(image, imgsz, self.stride, device, False, auto)
            prepared = _now(device)
            output = forward(model, tensor, autocast)
            inferred = _now(device)
            results.append(self._select(output, tensor.shape[2:], [image.shape])[0].cpu())
            done = _now(device)
            files.append(name)
            shapes.append(image.shape[:2])
            originals.append(original)
            times.append((prepared - begin, inferred - prepared, done - inferred))
            input_shapes.append(tuple(tensor.shape))
        return Detections(results, files, shapes, self.names, times, originals, input_shapes)

    def _tensor_batch(self, model, images: torch.Tensor, autocast):
        """The raw output for a BCHW tensor (module doc), as YOLOv5's AutoShape; traceable (no inference mode)."""
        if images.dim() == 3:
            images = images[None]
        if images.dim() != 4 or images.shape[1] != 3 or not images.is_floating_point():
            raise InferenceError(f"a tensor input must be float (B, 3, H, W) in [0, 1], got {images.dtype} "
                                 f"{tuple(images.shape)}")
        height, width = images.shape[2:]
        if height % self.stride or width % self.stride:
            raise InferenceError(f"a tensor input's sides must be multiples of the stride {self.stride}, got "
                                 f"{height}x{width} (or pass images or arrays, which are letterboxed)")
        with torch.no_grad(), autocast:
            return model(images.to(self.device, torch.float32).contiguous(memory_format=torch.channels_last))

    def _select(self, output, input_shape, original_shapes) -> list[torch.Tensor]:
        return select_detections(output, input_shape, original_shapes, self.conf, self.iou, self.classes,
                                 self.agnostic, self.max_det, self.multi_label)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the stage's kernels are done when its time is read, as detect.py's
    return time.perf_counter()


def load_image(item, index: int, bgr: bool = False) -> tuple[str, np.ndarray]:
    """(name, uint8 BGR HxWx3 as the model reads it) for a path, PIL image or numpy array (RGB unless ``bgr``)."""
    name, _, image = load_input(item, index, bgr)
    return name, image


def load_input(item, index: int, bgr: bool = False) -> tuple[str, np.ndarray, np.ndarray]:
    """(name, the image as Detections keeps it: RGB uint8 HxWx3, the contiguous BGR copy the model reads).
    An RGB uint8 HxWx3 array is kept as it is: the caller's own array, referenced, not copied."""
    if isinstance(item, str) and is_url(item):
        name, image = read_url_image(item)
        return name, cv2.cvtColor(image, cv2.COLOR_BGR2RGB), image
    if isinstance(item, (str, Path)):
        image = read_image(item)
        return str(item), cv2.cvtColor(image, cv2.COLOR_BGR2RGB), image
    if isinstance(item, np.ndarray):
        if item.ndim not in (2, 3) or (item.ndim == 3 and item.shape[2] not in (1, 3, 4)) or not item.size:
            raise InferenceError(f"image {index}: expected an HxWx3 (or HxW, HxWx4) array, got shape {item.shape}")
        image = to_bgr8(item)  # 8-bit, 3 channels, colour order kept (the array itself when it is uint8 HxWx3)
        if bgr:
            return f"image{index}", cv2.cvtColor(image, cv2.COLOR_BGR2RGB), np.ascontiguousarray(image)
        return f"image{index}", image, np.ascontiguousarray(image[:, :, ::-1])  # RGB(A) (gray: any order)
    try:
        from PIL import Image, ImageOps
    except ImportError:
        Image = None
    if Image is not None and isinstance(item, Image.Image):
        upright = ImageOps.exif_transpose(item)
        rgb = np.asarray(upright.convert("RGB"))
        name = Path(getattr(item, "filename", "") or f"image{index}").name
        return name, rgb, np.ascontiguousarray(rgb[:, :, ::-1])
    raise InferenceError(f"image {index}: cannot read a {type(item).__name__} (pass a file path, a PIL image, "
                         "a numpy HxWx3 array, a list of these, or a (B, 3, H, W) tensor)")


def read_url_image(url: str) -> tuple[str, np.ndarray]:
    """An image URL (YOLOv5's ``model("https://.../zidane.jpg")``): fetched by utils/downloads.py into a private
    temporary folder, decoded like a file (EXIF orientation applied), the file removed; (the URL's file name, BGR)."""
    from utils.downloads import fetch, url_file_name

    name = url_file_name(url)
    with tempfile.TemporaryDirectory(prefix="yolo-trainer-image-") as folder:
        image = read_image(fetch(url, Path(folder) / name, what="image", max_bytes=MAX_IMAGE_DOWNLOAD_BYTES))
    return name, image


def load_hub_model(path, autoshape: bool = True, device=None):
    """``custom(path=...)``: a checkpoint (ours or YOLOv5's) or an export.py file or folder (models/backends.py),
    wrapped in HubModel; with ``autoshape=False`` the bare model (a DetectionModel for checkpoints)."""
    from models.backends import load_backend
    from utils.device import select_device

    from utils.downloads import weights_file

    if not is_url(path) and not Path(path).suffix and not Path(path).is_dir():
        path = Path(path).with_suffix(".pt")  # custom(path='yolov5n') or path='runs/.../best', as YOLOv5's hub
    path = weights_file(path)  # a URL or a YOLOv5 release name is downloaded first
    if not path.exists():
        raise UserError(f"{path}: model file not found (pass path= a .pt from training, e.g. "
                        "runs/train/exp/weights/best.pt, a YOLOv5 .pt on disk, a URL or a release name such as "
                        "yolov5s.pt)")
    device = select_device("" if device is None else str(device))
    if not autoshape:
        from models import load_model
        from models.backends import is_exported

        return load_backend(path, device) if is_exported(path) else load_model(path, device)
    backend = load_backend(path, device)
    return HubModel(backend, backend.names, backend.stride, backend.imgsz, path).eval()


def untrained_hub_model(cfg: Path, classes: int, autoshape: bool = True, device=None):
    """``yolov5s(pretrained=False)``: a randomly initialised model from its YAML with ``classes`` classes."""
    from models import for_inference
    from models.yolo import DetectionModel
    from utils.device import select_device

    model = DetectionModel(cfg, nc=classes).to(select_device("" if device is None else str(device)))
    if not autoshape:
        return model
    model = for_inference(model.eval())
    names = model.names if getattr(model, "names", None) else [f"class{i}" for i in range(classes)]
    return HubModel(model, names, int(model.stride.max())).eval()
