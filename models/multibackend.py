"""YOLOv5's ``models.common.DetectMultiBackend`` and ``AutoShape``, for inference scripts written against YOLOv5
(docs/yolov5-scripts.md): one object for a checkpoint or an exported file, with YOLOv5's attributes (``stride``,
``names``, ``pt``, ``onnx``, ..., ``fp16``, ``device``), ``warmup`` and outputs. It loads through
models/backends.py as detect.py does: weights by YOLOv5 release name or URL downloaded first, every file checked
before it is read, exported files run by their runtimes.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

LOGGER = logging.getLogger(__name__)

# YOLOv5's format flags -> the backends' kinds that set them (models/backends.py, models/formats/)
FORMAT_FLAGS = {"pt": ("pytorch",), "jit": ("torchscript",), "onnx": ("onnx", "onnx (OpenCV DNN)"), "xml": ("openvino",),
                "engine": ("engine",), "coreml": ("coreml",), "tflite": ("litert",), "ncnn": ("ncnn",),
                "executorch": ("executorch",), "saved_model": (), "pb": (), "edgetpu": (), "tfjs": (), "paddle": (),
                "triton": ()}


def weights_path(given) -> Path:
    """``given`` as a file on disk: a path, or a URL or YOLOv5 release name downloaded first (utils/downloads.py);
    BackendError when there is no such file."""
    from models.backends import BackendError
    from utils.downloads import weights_file

    path = weights_file(given)
    if not Path(path).exists():
        raise BackendError(f"weights not found: {path} (a file, a URL or a YOLOv5 release name such as yolov5s.pt)")
    return Path(path)


def as_device(device) -> torch.device:
    """A torch.device as given, else the device a --device value names ('', 'cpu', '0', 'cuda:1', 0)."""
    from utils.device import select_device

    return device if isinstance(device, torch.device) else select_device("" if device is None else str(device))


class DetectMultiBackend(nn.Module):
    """``DetectMultiBackend(weights, device, dnn, data, fp16, fuse)``: ``weights`` a path, URL, YOLOv5 release name
    (``yolov5s.pt``) or a list of checkpoints (an ensemble); ``fp16`` half weights for a checkpoint on CUDA (on the
    CPU it runs float32, with a warning, as detect.py --half); ``dnn`` runs an .onnx file on OpenCV's DNN module.
    ``data`` and ``fuse`` are accepted: class names come from the file, and checkpoints are always fused."""

    def __init__(self, weights="yolov5s.pt", device=torch.device("cpu"), dnn: bool = False, data=None,
                 fp16: bool = False, fuse: bool = True):
        from models.composite import load_models

        super().__init__()
        device = as_device(device)
        paths = [weights_path(given) for given in (weights if isinstance(weights, (list, tuple)) else [weights])]
        half = fp16 and device.type == "cuda"
        if fp16 and not half:
            LOGGER.warning(f"WARNING: fp16 needs a CUDA device; running float32 on {device.type}")
        self.backend = load_models(paths if len(paths) > 1 else paths[0], device, half=half, dnn=dnn)
        kind = self.backend.kind
        for flag, kinds in FORMAT_FLAGS.items():
            setattr(self, flag, kind in kinds)
        self.dnn, self.data, self.device = dnn, data, device
        self.fp16 = half if self.pt else bool(self.backend.info.half)
        self.nhwc = False  # every runtime here takes (B, 3, H, W)
        self.dynamic = self.backend.dynamic
        self.stride = max(int(self.backend.stride), 32)
        self.names = dict(enumerate(self.backend.names))
        if self.pt:
            self.model = self.backend.model  # the DetectionModel (an ensemble's first), as YOLOv5's .model

    def forward(self, im: torch.Tensor, augment: bool = False, visualize=False):
        """A checkpoint: ``[pred, raw]`` as YOLOv5's (``pred`` (B, N, 5 + nc) boxes in input pixels); an exported
        file: ``pred``. ``augment``: test-time augmentation; ``visualize``: a folder for the layers' feature maps
        (checkpoints only, as in YOLOv5)."""
        if self.fp16 and im.dtype != torch.float16:
            im = im.half()
        if not self.pt:
            if augment or visualize:
                LOGGER.warning("WARNING: augment and visualize work with .pt checkpoints only; ignored")
            return self.backend(im)[0]
        im = im.contiguous(memory_format=torch.channels_last)  # the checkpoint's weights are channels_last
        if augment or visualize:
            members = getattr(self.backend, "members", None)
            models = [member.model for member in members] if members is not None else [self.model]
            outputs = [model(im, augment=augment, visualize=visualize) for model in models]
            pred = outputs[0][0] if len(outputs) == 1 else torch.cat([output[0] for output in outputs], 1)
            return [pred, outputs[0][1] if len(outputs) == 1 else None]
        return list(self.backend(im))

    def warmup(self, imgsz=(1, 3, 640, 640)) -> None:
        """One forward pass on zeros (two for TorchScript) on a GPU, as YOLOv5's; nothing to warm on the CPU."""
        if self.device.type == "cpu" or not (self.pt or self.jit or self.onnx or self.engine):
            return
        im = torch.zeros(*imgsz, dtype=torch.half if self.fp16 else torch.float, device=self.device)
        with torch.inference_mode():
            for _ in range(2 if self.jit else 1):
                self.forward(im)

    @staticmethod
    def from_numpy(x):
        return torch.from_numpy(x) if not isinstance(x, torch.Tensor) and hasattr(x, "dtype") else x


def AutoShape(model, verbose: bool = True):  # noqa: N802 - YOLOv5's class name, called as a constructor
    """YOLOv5's ``AutoShape(model)``: the hub model (utils/hub.py: paths, URLs, PIL images, arrays and lists in,
    ``Detections`` out) around a DetectMultiBackend, a backend (models/backends.py) or an eval-mode DetectionModel
    (e.g. from attempt_load), which is used as it is. ``verbose`` is accepted."""
    from models.backends import Backend, PyTorchBackend
    from models.yolo import DetectionModel
    from utils.hub import HubModel

    if isinstance(model, DetectMultiBackend):
        backend = model.backend
    elif isinstance(model, Backend):
        backend = model
    elif isinstance(model, DetectionModel):
        device = next(model.parameters()).device
        backend = PyTorchBackend(Path(getattr(model, "yaml_file", "") or "model.pt"), device, model=model.eval())
    else:
        raise TypeError(f"AutoShape: expected a DetectMultiBackend or a DetectionModel, got {type(model).__name__}")
    return HubModel(backend, backend.names, backend.stride, backend.imgsz, backend.path).eval()
