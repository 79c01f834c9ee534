"""The model ``torch.hub.load`` returns (hubconf.py): images in, boxes out, like YOLOv5's AutoShape.

    model = torch.hub.load("path/to/repo", "custom", path="best.pt", source="local")
    results = model(["a.jpg", Image.open("b.jpg")], size=640)   # paths, PIL, numpy, lists; or a BCHW tensor
    results.xyxy[0]       # (n, 6) tensor: x1, y1, x2, y2, confidence, class (pixels of the original image)
    results.detections[0] # [Detection(xyxy, score, class_id, name), ...]

Inputs: a file path (read like detect.py: EXIF orientation applied), a PIL image, a numpy HxWx3 uint8 array
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

import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from utils.boxes import xyxy2xywh
from utils.data.images import read_image, to_bgr8
from utils.errors import UserError
from utils.inference import (Detection, InferenceError, as_detections, describe, forward, input_size, prepare_image,
                             select_detections)
from utils.precision import inference_autocast


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
        start = time.perf_counter()
        device = self.device
        kind = getattr(self.model, "kind", "pytorch")
        autocast = inference_autocast(device, False, self.amp, "" if kind == "pytorch" else kind)
        model = self.model
        if augment:
            from models.composite import AugmentedBackend

            model = AugmentedBackend(self.model)
        if isinstance(images, torch.Tensor):
            return self._tensor_batch(model, images, autocast, start)
        items = list(images) if isinstance(images, (list, tuple)) else [images]
        sizes = list(size) if isinstance(size, (list, tuple)) else [size]
        imgsz, auto = input_size(self, sizes * 2 if len(sizes) == 1 else sizes, option="size")
        files, shapes, results = [], [], []
        for index, item in enumerate(items):
            name, image = load_image(item, index, bgr)
            tensor = prepare_image(image, imgsz, self.stride, device, False, auto)
            output = forward(model, tensor, autocast)
            results.append(self._select(output, tensor.shape[2:], [image.shape])[0].cpu())
            files.append(name)
            shapes.append(image.shape[:2])
        return Detections(results, files, shapes, self.names, time.perf_counter() - start)

    def _tensor_batch(self, model, images: torch.Tensor, autocast, start: float):
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


def load_image(item, index: int, bgr: bool = False) -> tuple[str, np.ndarray]:
    """(name, uint8 BGR HxWx3) for a path, PIL image or numpy array (RGB unless ``bgr``)."""
    if isinstance(item, (str, Path)):
        return str(item), read_image(item)
    if isinstance(item, np.ndarray):
        if item.ndim not in (2, 3) or (item.ndim == 3 and item.shape[2] not in (1, 3, 4)) or not item.size:
            raise InferenceError(f"image {index}: expected an HxWx3 (or HxW, HxWx4) array, got shape {item.shape}")
        image = to_bgr8(item)  # 8-bit, 3 channels, colour order kept
        if not bgr and item.ndim == 3 and item.shape[2] in (3, 4):
            image = image[:, :, ::-1]  # RGB(A) -> BGR
        return f"image{index}", np.ascontiguousarray(image)
    try:
        from PIL import Image, ImageOps
    except ImportError:
        Image = None
    if Image is not None and isinstance(item, Image.Image):
        upright = ImageOps.exif_transpose(item)
        rgb = np.asarray(upright.convert("RGB"))
        name = Path(getattr(item, "filename", "") or f"image{index}").name
        return name, np.ascontiguousarray(rgb[:, :, ::-1])
    raise InferenceError(f"image {index}: cannot read a {type(item).__name__} (pass a file path, a PIL image, "
                         "a numpy HxWx3 array, a list of these, or a (B, 3, H, W) tensor)")


class Detections:
    """Per-image results: ``xyxy[i]`` (n, 6) tensors of x1, y1, x2, y2, confidence, class in the original image's
    pixels (``xywh``, ``xyxyn``, ``xywhn`` as in YOLOv5), ``detections[i]`` as Detection tuples, ``files``,
    ``names``; ``pandas()`` gives DataFrames when pandas is installed."""

    def __init__(self, xyxy: list[torch.Tensor], files: list[str], shapes: list, names: list[str], seconds: float):
        self.xyxy, self.files, self.shapes, self.names, self.seconds = xyxy, files, shapes, names, seconds
        self.n = len(xyxy)

    def __len__(self) -> int:
        return self.n

    @property
    def xywh(self) -> list[torch.Tensor]:
        return [torch.cat((xyxy2xywh(det[:, :4]), det[:, 4:]), 1) for det in self.xyxy]

    @property
    def xyxyn(self) -> list[torch.Tensor]:
        return [det / self._gain(shape) for det, shape in zip(self.xyxy, self.shapes)]

    @property
    def xywhn(self) -> list[torch.Tensor]:
        return [det / self._gain(shape) for det, shape in zip(self.xywh, self.shapes)]

    @staticmethod
    def _gain(shape) -> torch.Tensor:
        height, width = shape
        return torch.tensor([width, height, width, height, 1.0, 1.0])

    @property
    def detections(self) -> list[list[Detection]]:
        return [as_detections(det, self.names) for det in self.xyxy]

    def pandas(self):
        """An object whose ``xyxy``/``xywh``/``xyxyn``/``xywhn`` are lists of DataFrames (YOLOv5's columns)."""
        try:
            import pandas
        except ImportError:
            raise UserError("Detections.pandas() needs the optional package 'pandas': pip install pandas") from None
        from types import SimpleNamespace

        tables = {}
        for kind, corners in (("xyxy", ("xmin", "ymin", "xmax", "ymax")), ("xywh", ("xcenter", "ycenter", "width",
                                                                                    "height"))):
            for suffix in ("", "n"):
                rows = getattr(self, kind + suffix)
                tables[kind + suffix] = [self._frame(pandas, det, corners) for det in rows]
        return SimpleNamespace(**tables)

    def _frame(self, pandas, det: torch.Tensor, corners):
        frame = pandas.DataFrame(det[:, :5].tolist(), columns=[*corners, "confidence"])
        frame["class"] = det[:, 5].long().tolist()
        frame["name"] = [self.names[c] if 0 <= c < len(self.names) else str(c) for c in frame["class"]]
        return frame

    def __str__(self) -> str:
        lines = []
        for index, (det, name, shape) in enumerate(zip(self.xyxy, self.files, self.shapes), 1):
            found = describe(det, self.names).rstrip(", ") if len(det) else "(no detections)"
            lines.append(f"image {index}/{self.n} {name}: {shape[0]}x{shape[1]} {found}")
        lines.append(f"{self.seconds * 1e3 / max(self.n, 1):.1f}ms per image")
        return "\n".join(lines)

    __repr__ = __str__


def load_hub_model(path, autoshape: bool = True, device=None):
    """``custom(path=...)``: a checkpoint (ours or YOLOv5's) or an export.py file or folder (models/backends.py),
    wrapped in HubModel; with ``autoshape=False`` the bare model (a DetectionModel for checkpoints)."""
    from models.backends import load_backend
    from utils.device import select_device

    from utils.downloads import weights_file

    if not Path(path).suffix and not Path(path).is_dir():
        path = Path(path).with_suffix(".pt")  # custom(path='yolov5n') or path='runs/.../best', as YOLOv5's hub
    path = weights_file(path)  # a URL or a YOLOv5 release name is downloaded first
    if not path.exists():
        raise UserError(f"{path}: model file not found (pass path= a .pt from training, e.g. "
                        "runs/train/exp/weights/best.pt, a YOLOv5 .pt on disk, a URL or a release name such as "
                        "yolov5s.pt)")
    device = select_device("" if device is None else str(device))
    if not autoshape:
        from models import load_model

        exported = path.is_dir() or path.suffix.lower() in (".onnx", ".torchscript", ".xml")
        return load_backend(path, device) if exported else load_model(path, device)
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
