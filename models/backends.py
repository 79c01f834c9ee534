"""Inference backends: one interface over our checkpoints, TorchScript files and ONNX Runtime.

``load_backend(path, device)`` picks the backend from the file's suffix (``.onnx``, ``.torchscript``,
anything else is a checkpoint) and returns an ``nn.Module`` that val.py's ``validate()`` and detect.py
use like a DetectionModel:

    backend(images)  # float (B, 3, H, W) in [0, 1] -> (pred (B, N, 5 + nc), raw)
    backend.names, backend.nc, backend.stride (max stride, int)
    backend.imgsz    # (height, width) the file was exported for; None for a checkpoint
    backend.dynamic  # any batch and any stride-multiple size accepted

``raw`` (the per-level maps the loss needs) only comes from checkpoints; exported files return the
decoded output alone, so ``raw`` is ``[]``. A static-shape export only takes its own (height, width);
batches of another size are run in chunks of the exported batch (the last one zero-padded).

Exported files carry their metadata inside (``METADATA_KEYS``): ONNX as ``metadata_props`` (one JSON
value per key), TorchScript as the ``config.txt`` extra file (one JSON object). YOLOv5's exports, which
only store ``stride`` and ``names``, are read too (sizes then come from the ONNX input shape or the
TorchScript ``shape`` entry).

A ``.torchscript`` file is a program: loading it runs its graph. Load only files from a trusted source;
nothing here loads one unless it is named explicitly. ONNX files are data run by onnxruntime.
"""
from __future__ import annotations

import ast
import json
import logging
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from utils.errors import UserError

LOGGER = logging.getLogger(__name__)
EXPORT_FORMAT = "yolo-trainer-export/1"
TORCHSCRIPT_METADATA = "config.txt"  # the extra file YOLOv5 also uses
METADATA_KEYS = ("format", "names", "nc", "stride", "imgsz", "batch", "dynamic", "half", "channels_last", "device")
INSTALL_HINT = "pip install -r requirements-export.txt"


class BackendError(UserError):
    """A model file that cannot be run (corrupt, wrong metadata, wrong input size); one line naming it."""


def require(module: str, package: str | None = None, purpose: str = ""):
    """Import an optional package or raise a one-line BackendError naming it and how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = package or module
        raise BackendError(f"{purpose + ' needs' if purpose else 'needs'} the optional package '{package}': "
                           f"pip install {package} (or {INSTALL_HINT})") from None


@dataclass(frozen=True)
class ExportInfo:
    """What an exported file says about itself (``METADATA_KEYS``)."""
    names: tuple
    stride: int
    imgsz: tuple  # (height, width) the file was exported for
    batch: int
    dynamic: bool = False
    half: bool = False
    channels_last: bool = False
    device: str | None = None  # device type traced on ("cpu", "cuda"); None when the file does not say
    format: str = EXPORT_FORMAT

    @property
    def nc(self) -> int:
        return len(self.names)

    def to_dict(self) -> dict:
        values = asdict(self)
        values.update(names=list(self.names), imgsz=list(self.imgsz), nc=self.nc)
        return {key: values[key] for key in METADATA_KEYS}


def parse_info(values: dict, source: str, input_shape=None) -> ExportInfo:
    """ExportInfo from a file's metadata mapping (our keys, or YOLOv5's ``stride``/``names``/``shape``).

    ``input_shape`` (B, C, H, W) with None or names for dynamic axes fills in what YOLOv5 files lack.
    """
    try:
        fmt = values.get("format")
        if fmt is not None and fmt != EXPORT_FORMAT:
            raise ValueError(f"export format {fmt!r} is not {EXPORT_FORMAT!r} (written by another version?)")
        names = _names(values["names"])
        stride = int(values["stride"])
        shape = values.get("shape") or input_shape  # YOLOv5 TorchScript: "shape"; ONNX: the graph input
        imgsz = values.get("imgsz") or (shape[2:4] if shape else None)
        batch = values.get("batch") or (shape[0] if shape else None)
        dynamic = bool(values.get("dynamic", not _static(shape)))
        if fmt is not None and int(values.get("nc", len(names))) != len(names):
            raise ValueError(f"nc {values['nc']} but {len(names)} names")
        info = ExportInfo(names=names, stride=stride, imgsz=_size_pair(imgsz, dynamic),
                          batch=int(batch) if _static([batch]) else 1, dynamic=dynamic,
                          half=bool(values.get("half", False)), channels_last=bool(values.get("channels_last", False)),
                          device=values.get("device"))
    except (KeyError, TypeError, ValueError, SyntaxError, RecursionError) as error:
        detail = f"missing {error}" if isinstance(error, KeyError) else str(error).splitlines()[0]
        raise BackendError(f"{source}: not an exported yolo-trainer/YOLOv5 model (metadata: {detail})") from None
    if stride < 1 or not names:
        raise BackendError(f"{source}: metadata has stride {stride} and {len(names)} names")
    return info


def _names(value) -> tuple:
    """Names as a list, or YOLOv5's ``{0: 'name', ...}`` (a Python literal: read without eval)."""
    if isinstance(value, str):
        value = ast.literal_eval(value)
    if isinstance(value, dict):
        value = [value[key] for key in sorted(value, key=int)]
    return tuple(str(name) for name in value)


def _static(shape) -> bool:
    return bool(shape) and all(isinstance(dim, int) and dim > 0 for dim in shape)


def _size_pair(imgsz, dynamic: bool):
    if imgsz is None or not _static(list(imgsz)):
        if dynamic:
            return None
        raise ValueError("no input size")
    return tuple(int(side) for side in imgsz)


class Backend(nn.Module):
    """The shared interface (see the module docstring); subclasses implement ``_run``."""

    kind = ""

    def __init__(self, path, info: ExportInfo, device):
        super().__init__()
        self.path, self.info, self.device = Path(path), info, torch.device(device)

    @property
    def names(self) -> list:
        return list(self.info.names)

    @property
    def nc(self) -> int:
        return self.info.nc

    @property
    def stride(self) -> int:
        return self.info.stride

    @property
    def imgsz(self):
        return None if self.info.dynamic else self.info.imgsz

    @property
    def dynamic(self) -> bool:
        return self.info.dynamic

    def forward(self, images: torch.Tensor):
        if self.info.dynamic or images.shape[0] == self.info.batch:
            return self._checked_run(images), []
        chunks = []
        for start in range(0, images.shape[0], self.info.batch):
            chunk = images[start:start + self.info.batch]
            missing = self.info.batch - chunk.shape[0]
            padded = torch.cat((chunk, chunk.new_zeros((missing, *chunk.shape[1:])))) if missing else chunk
            chunks.append(self._checked_run(padded)[:chunk.shape[0]])
        return torch.cat(chunks), []

    def _checked_run(self, images: torch.Tensor) -> torch.Tensor:
        if not self.info.dynamic and tuple(images.shape[2:]) != self.info.imgsz:
            height, width = self.info.imgsz
            raise BackendError(f"{self.path.name} was exported for {height}x{width} inputs, got "
                               f"{images.shape[2]}x{images.shape[3]}; export with --dynamic for other sizes")
        return self._run(images)

    def _run(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def anchors_text(self) -> str | None:
        """The anchors in pixels per level (printed at start), where the file keeps them (checkpoints)."""
        return None


class PyTorchBackend(Backend):
    """A checkpoint (ours or YOLOv5's), BatchNorm folded and channels_last as val.py always ran it."""

    kind = "pytorch"

    def __init__(self, path, device="cpu", half=False):
        from models import for_inference, load_model
        from models.fused import fuse_silu

        model = for_inference(load_model(path, device=device))
        fuse_silu(model)  # eager inference on the CPU: conv + SiLU in one call
        info = ExportInfo(names=tuple(model.names), stride=int(model.stride.max()), imgsz=None, batch=1,
                          dynamic=True, half=half, channels_last=True)
        super().__init__(path, info, device)
        self.model = model.half() if half else model

    def forward(self, images: torch.Tensor):
        return self.model(images)  # (pred, raw) as the model gives them

    def anchors_text(self) -> str | None:
        from utils.autoanchor import format_anchors

        return format_anchors(self.model)


class TorchScriptBackend(Backend):
    """A traced ``.torchscript`` file; loading it runs its code, so only trusted files belong here."""

    kind = "torchscript"

    def __init__(self, path, device="cpu"):
        extra = {TORCHSCRIPT_METADATA: ""}
        try:
            with warnings.catch_warnings():  # torch.jit's deprecation notice: not the user's concern
                warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.")
                module = torch.jit.load(str(path), map_location=torch.device(device), _extra_files=extra)
        except (RuntimeError, ValueError, OSError) as error:
            raise BackendError(f"{path}: not a readable TorchScript file ({first_line(error)})") from None
        try:
            values = json.loads(extra[TORCHSCRIPT_METADATA] or "null")
        except json.JSONDecodeError as error:
            raise BackendError(f"{path}: {TORCHSCRIPT_METADATA} inside is not JSON ({error})") from None
        if not isinstance(values, dict):
            raise BackendError(f"{path}: no {TORCHSCRIPT_METADATA} metadata inside (export it with export.py)")
        info = parse_info(values, str(path))
        _check_device(info, path, device)
        super().__init__(path, info, device)
        self.module = module.eval()
        self.dtype = torch.float16 if info.half else torch.float32

    def _run(self, images: torch.Tensor) -> torch.Tensor:
        layout = torch.channels_last if self.info.channels_last else torch.contiguous_format
        images = images.to(self.device, self.dtype).contiguous(memory_format=layout)
        output = self.module(images)
        return (output[0] if isinstance(output, (list, tuple)) else output).float()


class OnnxBackend(Backend):
    """An ``.onnx`` file run by onnxruntime (optional package), on as many threads as torch uses."""

    kind = "onnx"

    def __init__(self, path, device="cpu"):
        ort = require("onnxruntime", purpose=f"running {Path(path).name}")
        device = torch.device(device)
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        options.log_severity_level = 4  # failures come back as exceptions, reported as one line
        providers = ["CPUExecutionProvider"]
        if device.type == "cuda":
            if "CUDAExecutionProvider" in ort.get_available_providers():
                providers.insert(0, "CUDAExecutionProvider")
            else:
                LOGGER.warning("WARNING: this onnxruntime has no CUDA support; running %s on the CPU", Path(path).name)
        try:
            session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as error:  # onnxruntime's own exception types (InvalidProtobuf, Fail, ...)
            raise BackendError(f"{path}: not a readable ONNX model ({first_line(error)})") from None
        meta = session.get_modelmeta().custom_metadata_map
        values = {key: _json_or_text(value) for key, value in meta.items()}
        graph_input = session.get_inputs()[0]
        info = parse_info(values, str(path), [dim if isinstance(dim, int) else None for dim in graph_input.shape])
        super().__init__(path, info, device)
        self.session, self.input_name = session, graph_input.name
        self.output_name = session.get_outputs()[0].name
        self.input_dtype = torch.float16 if "float16" in graph_input.type else torch.float32

    def _run(self, images: torch.Tensor) -> torch.Tensor:
        array = images.detach().to("cpu", self.input_dtype).contiguous().numpy()
        output = self.session.run([self.output_name], {self.input_name: array})[0]
        return torch.from_numpy(output).to(images.device).float()


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value  # e.g. YOLOv5's names, a Python dict literal (parsed with ast.literal_eval)


def _check_device(info: ExportInfo, path, device) -> None:
    """A traced graph keeps the device of the tensors it creates (the decode grids): run it where it was traced."""
    wanted = torch.device(device).type
    if info.half and wanted != "cuda":
        raise BackendError(f"{path}: exported in fp16 for CUDA; run it with --device 0 or export without --half")
    if info.device is not None and info.device != wanted:
        raise BackendError(f"{path}: TorchScript traced on {info.device} runs only there; use --device "
                           f"{'cpu' if info.device == 'cpu' else 0} or export again with --device {device}")


def first_line(error: Exception) -> str:
    """An exception's message cut to its first line and, when that is long, its first sentence."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    line = text.splitlines()[0]
    return line.split(". ")[0][:200] if len(line) > 120 else line


BACKENDS = {".onnx": OnnxBackend, ".torchscript": TorchScriptBackend}


def load_backend(path, device="cpu", half: bool = False) -> Backend:
    """The backend for ``path`` by suffix: ``.onnx``, ``.torchscript``, else a checkpoint (``half``: fp16
    weights, checkpoints only; an exported file runs in the precision it was exported in)."""
    path = Path(path)
    if not path.is_file():
        raise BackendError(f"{path}: model file not found")
    backend = BACKENDS.get(path.suffix.lower())
    if backend is None:
        return PyTorchBackend(path, device, half)
    if half:
        LOGGER.info("--half ignored for %s: it runs in the precision it was exported in", path.name)
    if backend is TorchScriptBackend:
        LOGGER.info("Loading TorchScript %s (runs the file's code: load only trusted files)", path.name)
    return backend(path, device)
