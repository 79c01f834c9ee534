"""The model ``torch.hub.load`` returns (hubconf.py): images in, boxes out, like YOLOv5's AutoShape.

    model = torch.hub.load("path/to/repo", "custom", path="best.pt", source="local")
    results = model(["a.jpg", Image.open("b.jpg")], size=640)   # paths, URLs, PIL, numpy, lists; or a BCHW tensor
    results.xyxy[0]       # (n, 6) tensor: x1, y1, x2, y2, confidence, class (pixels of the original image)
    results.detections[0] # [Detection(xyxy, score, class_id, name), ...]
    results.print()       # or .show(), .save(), .crop(), .render(), .pandas(), .tolist(), as YOLOv5's

The results are ``Detections`` (utils/hub_results.py): YOLOv5's attributes and methods, with the images as
loaded in ``results.ims`` (RGB; an RGB array input is kept by reference, not copied); save() and crop() write
into a new runs/detect/expN folder, as YOLOv5's.

Inputs: a file path (read like detect.py: EXIF orientation applied), an image URL (fetched by utils/downloads.py
into a private temporary folder and removed once decoded; nothing is written where you work), a PIL image, a
numpy uint8 array in RGB order as YOLOv5's AutoShape takes it (HxWx3; CHW is transposed, gray and 4-channel
arrays converted; ``model(image, bgr=True)`` for ``cv2.imread`` arrays), or a list of these. A float
(B, 3, H, W) tensor in [0, 1] with sides that are multiples of the model's stride is run as given and returns
the model's raw output, pred ``(B, N, 5 + nc)`` before NMS, as YOLOv5's AutoShape returns it, so
``torch.jit.trace(model, [im])`` works.

The images of one call run as one batch at one shape, YOLOv5's AutoShape rule: each image scaled by
max(size) / its longer side, the largest of those shapes rounded up to the stride (a static-shape export: its
own size; another export: ``size``), each image letterboxed into it (centred, padded with grey). Then NMS with
the model's ``conf``, ``iou``, ``classes``, ``agnostic``, ``multi_label`` and ``max_det`` attributes, and the
boxes mapped back to each original image, not rounded (detect.py rounds them to whole pixels). Precision:
``amp`` False (YOLOv5's default) runs fp32; True runs fp16 autocast on CUDA, as YOLOv5's, and on a CPU the
precision val.py and detect.py choose (``--amp auto``: bf16 autocast where the CPU computes it natively, else
fp32); "auto", "bf16" and "off" are as ``--amp``. The default is "auto" (fp32 on CUDA).
"""
from __future__ import annotations

import logging
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
from utils.hub_results import Detections, Timing, file_stem
from utils.inference import InferenceError, forward, input_size, prepare_image, select_detections
from utils.precision import inference_autocast

LOGGER = logging.getLogger(__name__)
MAX_IMAGE_DOWNLOAD_BYTES = 256 << 20  # an image URL larger than this is refused as it arrives

__all__ = ["Detections", "HubModel", "load_hub_model", "load_image", "load_input", "training_hub_model"]


class HubModel(nn.Module):
    """A detector that takes images and returns ``Detections``; NMS settings are attributes, as in AutoShape."""

    conf = 0.25  # confidence threshold
    iou = 0.45  # NMS IoU threshold
    agnostic = False  # class-agnostic NMS
    multi_label = False  # a box may carry several classes
    classes = None  # keep only these class indices, e.g. [0, 15, 16]
    max_det = 1000  # detections per image
    amp = "auto"  # True/False as YOLOv5's, or "auto", "bf16", "off" as --amp (module doc)

    def __init__(self, model: nn.Module, names, stride: int, imgsz=None, path=None):
        super().__init__()
        self.model = model
        self.names = {index: str(name) for index, name in enumerate(names)}  # YOLOv5's {index: name}
        self.stride = int(stride)
        self.imgsz = imgsz  # (h, w) of a static-shape export, else None
        self.path = Path(path) if path is not None else None
        self.pt = getattr(model, "kind", "pytorch") == "pytorch"  # a checkpoint (YOLOv5's AutoShape.pt)

    @property
    def device(self) -> torch.device:
        parameter = next(self.model.parameters(), None)
        return parameter.device if parameter is not None else torch.device(getattr(self.model, "device", "cpu"))

    @property
    def dtype(self) -> torch.dtype:
        parameter = next(self.model.parameters(), None)
        return parameter.dtype if parameter is not None and parameter.is_floating_point() else torch.float32

    def forward(self, ims, size=640, augment: bool = False, profile: bool = False, *, bgr: bool = False
                ) -> "Detections":
        """Detect in ``ims`` (module doc); ``size``: the longer side (or (h, w)); ``augment``: test-time
        augmentation (checkpoints only, models/composite.py); ``profile``: YOLOv5's per-layer timing, which is
        ``python models/yolo.py --cfg X.yaml --profile`` here."""
        if profile:
            raise InferenceError("profile=True: per-layer timing is python models/yolo.py --cfg <model>.yaml "
                                 "--profile (or --line-profile)")
        device, dtype = self.device, self.dtype
        autocast = self._autocast(device)
        model = self.model
        if augment:
            from models.composite import AugmentedBackend

            model = AugmentedBackend(self.model)
        if isinstance(ims, torch.Tensor):
            return self._tensor_batch(model, ims, autocast, dtype)
        start = _now(device)
        items = list(ims) if isinstance(ims, (list, tuple)) else [ims]
        files, originals, images = [], [], []
        for index, item in enumerate(items):
            name, original, image = load_input(item, index, bgr)
            files.append(jpg_name(name, index))
            originals.append(original)
            images.append(image)
        shape = self._batch_shape([image.shape[:2] for image in images], size)
        batch = torch.cat([prepare_image(image, shape, self.stride, device, False, auto=False) for image in images]
                          ) if images else torch.zeros(0, 3, *shape, device=device)
        batch = batch.to(dtype)
        prepared = _now(device)
        output = forward(model, batch, autocast) if images else None
        inferred = _now(device)
        pred = select_detections(output, shape, [image.shape for image in images], self.conf, self.iou, self.classes,
                                 self.agnostic, self.max_det, self.multi_label, round_boxes=False) if images else []
        pred = [det.float().cpu() for det in pred]
        done = _now(device)
        times = (Timing(prepared - start), Timing(inferred - prepared), Timing(done - inferred))
        return Detections(originals, pred, files, times, self.names, tuple(batch.shape),
                          [image.shape[:2] for image in images])

    def _batch_shape(self, shapes: list, size) -> tuple[int, int]:
        """(h, w) every image of a call is letterboxed into (module doc)."""
        sizes = [int(s) for s in size] if isinstance(size, (list, tuple)) else [int(size)]
        if not sizes or min(sizes) <= 0 or len(sizes) > 2:
            raise InferenceError(f"size={size}: expected a positive size or (h, w)")
        if not self.pt or self.imgsz is not None:  # an export: its own size, else ``size`` as given
            return input_size(self, sizes * 2 if len(sizes) == 1 else sizes, option="size")[0]
        largest = [0, 0]
        for height, width in shapes:
            gain = max(sizes) / max(height, width)
            largest = [max(largest[0], int(height * gain)), max(largest[1], int(width * gain))]
        if not shapes:
            largest = [max(sizes)] * 2
        return tuple(max(int(np.ceil(side / self.stride)) * self.stride, self.stride) for side in largest)

    def _autocast(self, device: torch.device):
        """The forward passes' precision (module doc)."""
        kind = getattr(self.model, "kind", "pytorch")
        amp = self.amp
        if amp is True or amp is False:
            if device.type == "cuda" and amp and kind == "pytorch":
                return torch.autocast("cuda", dtype=torch.float16)
            amp = "auto" if amp else "off"
        return inference_autocast(device, False, amp, "" if kind == "pytorch" else kind)

    def _tensor_batch(self, model, images: torch.Tensor, autocast, dtype: torch.dtype):
        """pred, the raw output for a BCHW tensor (module doc), as YOLOv5's AutoShape; traceable (no inference
        mode)."""
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
            output = model(images.to(self.device, dtype).contiguous(memory_format=torch.channels_last))
        return output[0] if isinstance(output, (list, tuple)) else output


def jpg_name(name: str, index: int) -> str:
    """YOLOv5's ``files`` entry: the input's base name with a .jpg suffix ("a/street.png" -> "street.jpg"), made
    one safe file-name component (``image<index>.jpg`` when nothing usable is left)."""
    return f"{file_stem(name, index)}.jpg"


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
        if item.ndim == 3 and item.shape[0] in (1, 3, 4) and item.shape[2] not in (1, 3, 4):
            item = item.transpose(1, 2, 0)  # CHW, as YOLOv5's AutoShape takes it
        if item.ndim not in (2, 3) or (item.ndim == 3 and item.shape[2] not in (1, 3, 4)) or not item.size:
            raise InferenceError(f"image {index}: expected an HxWx3 (or HxW, HxWx4, CHW) array, got shape "
                                 f"{item.shape}")
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


def training_hub_model(cfg: Path, channels: int, classes: int, weights=None, device=None):
    """hubconf's ``yolov5s(pretrained=False)``, ``classes=N`` or ``channels=C`` (YOLOv5's ``_create``): a
    DetectionModel from ``cfg`` in training mode; from ``weights`` the tensors whose names and shapes fit (the
    anchors left out) and the class names when there are ``classes`` of them."""
    from models.yolo import DetectionModel
    from utils.device import select_device

    if not 1 <= int(channels) <= 16:
        raise UserError(f"channels={channels}: expected 1 to 16 input channels")
    model = DetectionModel(cfg, ch=int(channels), nc=int(classes))
    if weights is not None:
        from utils.checkpoint import class_names, load_checkpoint, model_entry
        from utils.trainer.setup import transfer_state

        entry = model_entry(load_checkpoint(weights))
        done, total = transfer_state(model, {k: v.float() for k, v in entry["state_dict"].items()}, ("anchors",))
        LOGGER.info("Transferred %d/%d items from %s", done, total, weights)
        names = class_names(entry.get("names") or [], str(weights))
        if len(names) == int(classes):
            model.names = [str(name) for name in names]
    return model.to(select_device("" if device is None else str(device)))
