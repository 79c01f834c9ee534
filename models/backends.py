"""Inference backends: one interface over our checkpoints, TorchScript files, ONNX Runtime and OpenVINO.

``load_backend(path, device)`` picks the backend from the file's suffix (``.onnx``, ``.torchscript``,
``.xml`` or a folder for OpenVINO, anything else is a checkpoint) and returns an ``nn.Module`` that
val.py's ``validate()`` and detect.py use like a DetectionModel:

    backend(images)  # float (B, 3, H, W) in [0, 1] -> (pred (B, N, 5 + nc), raw)
    backend.names, backend.nc, backend.stride (max stride, int)
    backend.imgsz    # (height, width) the file was exported for; None for a checkpoint
    backend.dynamic  # any batch and any stride-multiple size accepted

``raw`` (the per-level maps the loss needs) only comes from checkpoints; exported files return the
decoded output alone, so ``raw`` is ``[]``. A static-shape export only takes its own (height, width);
batches of another size are run in chunks of the exported batch (the last one zero-padded).

Exported files carry their metadata (``METADATA_KEYS``, models/export_info.py): ONNX as ``metadata_props``
(one JSON value per key), TorchScript as the ``config.txt`` extra file (one JSON object), OpenVINO as
``<stem>.yaml`` beside ``<stem>.xml`` in the ``<stem>_openvino_model`` folder. YOLOv5's exports, which only
store ``stride`` and ``names``, are read too (sizes then come from the graph's input shape or the
TorchScript ``shape`` entry). Every field is checked (type, the command line's bounds, text sizes before
parsing) and a bad one is a one-line BackendError naming the file and the field.

A ``.torchscript`` file is a program: loading it runs its graph. Load only files from a trusted source;
nothing here loads one unless it is named explicitly. ONNX and OpenVINO files are data run by
onnxruntime / openvino (optional packages: requirements-export.txt).
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from models.export_info import (EXPORT_FORMAT, MAX_METADATA_CHARS, METADATA_KEYS, ExportInfo,  # noqa: F401
                                MetadataError, info_from_metadata)
from utils.errors import Unavailable, UserError

LOGGER = logging.getLogger(__name__)
TORCHSCRIPT_METADATA = "config.txt"  # the extra file YOLOv5 also uses
OPENVINO_FOLDER = "_openvino_model"  # <stem>_openvino_model/<stem>.xml, .bin and .yaml (YOLOv5's layout)
INSTALL_HINT = "pip install -r requirements-export.txt"


class BackendError(UserError):
    """A model file that cannot be run (corrupt, wrong metadata, wrong input size); one line naming it."""


class MissingPackage(BackendError, Unavailable):
    """An optional package a format needs is not installed; names the install command."""


def require(module: str, purpose: str = "", package: str | None = None, install: str | None = None):
    """Import an optional package (``module``, e.g. ``ncnn`` or ``executorch.runtime``) or raise a one-line
    MissingPackage: ``<purpose> needs the optional package '<package>': <install>``. ``package``: its PyPI name
    (default: the module's top name); ``install``: the command (a format's requirements file; default
    ``pip install <package> (or pip install -r requirements-export.txt)``). The one optional-import helper:
    the format modules call it with their requirements file."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = package or module.split(".")[0]
        install = install or f"pip install {package} (or {INSTALL_HINT})"
        raise MissingPackage(f"{purpose + ' needs' if purpose else 'needs'} the optional package '{package}': "
                             f"{install}") from None


def parse_info(values, source: str, input_shape=None) -> ExportInfo:
    """ExportInfo from a file's metadata mapping, every field checked (models/export_info.py); a
    BackendError naming ``source`` and the field otherwise. ``input_shape``: the graph's (B, C, H, W)."""
    try:
        return info_from_metadata(values, input_shape)
    except MetadataError as error:
        raise BackendError(f"{source}: not an exported yolo-trainer/YOLOv5 model (metadata: {error})") from None


def _check_metadata_size(characters: int, source, what: str) -> None:
    """Refuse more than MAX_METADATA_CHARS characters of metadata text, before any of it is parsed."""
    if characters > MAX_METADATA_CHARS:
        raise BackendError(f"{source}: {what} holds {characters:,} characters of metadata, more than "
                           f"{MAX_METADATA_CHARS:,}")


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

    # what a fixed-size file's refusal of another size suggests (a format that refuses --dynamic says --imgsz)
    other_sizes = "export with --dynamic for other sizes"

    def _checked_run(self, images: torch.Tensor) -> torch.Tensor:
        if not self.info.dynamic and tuple(images.shape[2:]) != self.info.imgsz:
            height, width = self.info.imgsz
            raise BackendError(f"{self.path.name} was exported for {height}x{width} inputs, got "
                               f"{images.shape[2]}x{images.shape[3]}; {self.other_sizes}")
        return self._run(images)

    def _run(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def anchors_text(self) -> str | None:
        """The anchors in pixels per level (printed at start), where the file keeps them (checkpoints)."""
        return None


class PyTorchBackend(Backend):
    """A checkpoint (ours or YOLOv5's), BatchNorm folded and channels_last as val.py always ran it."""

    kind = "pytorch"

    def __init__(self, path, device="cpu", half=False, model=None):
        """``model``: an eval-mode DetectionModel already loaded (YOLOv5's AutoShape(model)), used as it is."""
        if model is None:
            from models import for_inference, load_model
            from models.fused import fuse_silu

            model = for_inference(load_model(path, device=device))
            fuse_silu(model)  # eager inference on the CPU: conv + SiLU in one call
        names = model.names.values() if isinstance(model.names, dict) else model.names  # YOLOv5's {i: name} too
        info = ExportInfo(names=tuple(names), stride=int(model.stride.max()), imgsz=None, batch=1,
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
        text = extra[TORCHSCRIPT_METADATA]
        _check_metadata_size(len(text), path, TORCHSCRIPT_METADATA)
        try:
            values = json.loads(text or "null")
        except (json.JSONDecodeError, RecursionError) as error:
            raise BackendError(f"{path}: {TORCHSCRIPT_METADATA} inside is not JSON ({first_line(error)})") from None
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
            data = Path(path).read_bytes()
        except OSError as error:
            raise BackendError(f"{path}: cannot read it ({error.strerror or error})") from None
        refuse_external_data(data, path)
        try:  # the bytes checked, not the path again: a file swapped in meanwhile is never the one run
            session = ort.InferenceSession(data, options, providers=providers)
        except Exception as error:  # onnxruntime's own exception types (InvalidProtobuf, Fail, ...)
            raise BackendError(f"{path}: not a readable ONNX model ({first_line(error)})") from None
        del data
        meta = session.get_modelmeta().custom_metadata_map
        _check_metadata_size(sum(len(key) + len(value) for key, value in meta.items()), path, "metadata_props")
        values = {key: json_or_text(value) for key, value in meta.items()}
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


def refuse_external_data(data: bytes, path) -> None:
    """BackendError for the ONNX file ``path`` (its bytes ``data``) whose tensors name other files (a model from
    elsewhere would read files of its choosing beside it into its weights); export.py's files and YOLOv5's keep
    every tensor inside."""
    from models.formats.onnx_proto import ProtobufError, uses_external_data

    try:
        external = uses_external_data(data)
    except ProtobufError as error:
        raise BackendError(f"{path}: not a readable ONNX model ({first_line(error)})") from None
    if external:
        raise BackendError(f"{path}: its tensors are kept in other files (ONNX external data), which are not read "
                           "here; export the model as one file")


class OpenVinoBackend(Backend):
    """An OpenVINO IR (``<stem>.xml`` + ``.bin``, metadata in ``<stem>.yaml`` beside them) run by the
    optional ``openvino`` package on the CPU, in float32, on as many threads as torch uses."""

    kind = "openvino"

    def __init__(self, path, device="cpu"):
        xml = openvino_xml(path)
        ir = _read_ir(xml)
        ov = import_openvino(f"running {xml.name}")
        weights = _read_ir_weights(xml)
        source = xml.with_suffix(".yaml")  # YOLOv5's layout: <stem>.yaml beside <stem>.xml
        values = read_metadata_yaml(source, xml)
        core = ov.Core()
        try:  # the bytes checked, not the path again: a file swapped in meanwhile is never the one run
            model = core.read_model(ir, weights)
        except Exception as error:  # openvino raises RuntimeError and its own types for unreadable IR
            raise BackendError(f"{xml}: not a readable OpenVINO model ({openvino_reason(error)})") from None
        del ir, weights
        if len(model.inputs) != 1 or len(model.outputs) < 1:
            raise BackendError(f"{xml}: expected one input (images) and an output, found {len(model.inputs)} "
                               f"inputs and {len(model.outputs)} outputs")
        dims = model.input(0).get_partial_shape()
        shape = [dim.get_length() if dim.is_static else None for dim in dims] if dims.rank.is_static else None
        info = parse_info(values, str(source), shape)
        if torch.device(device).type != "cpu":
            LOGGER.warning("WARNING: OpenVINO models run on the CPU here; running %s on the CPU", xml.name)
        super().__init__(xml, info, device)
        config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": torch.get_num_threads()}
        with kept_signal_stack():  # compiling starts OpenVINO's CPU plugin, which swaps the thread's signal stack
            try:
                compiled = core.compile_model(model, "CPU", config)
            except Exception as error:
                reason = openvino_reason(error)
                raise BackendError(f"{xml}: OpenVINO cannot compile it for the CPU ({reason})") from None
            self.request = compiled.create_infer_request()
        self.output = compiled.output(0)

    def _run(self, images: torch.Tensor) -> torch.Tensor:
        array = images.detach().to("cpu", torch.float32).contiguous().numpy()
        output = self.request.infer({0: array})[self.output]
        return torch.from_numpy(output.copy()).to(images.device).float()


def _read_ir(xml: Path) -> bytes:
    """The bytes of an IR's ``.xml``, read once. It must start with an XML declaration or ``<net``: anything else
    would make openvino try every other frontend it has on it (TensorFlow's prints its parse errors to stderr)."""
    try:
        ir = xml.read_bytes()
    except OSError as error:
        raise BackendError(f"{xml}: cannot read it ({error.strerror or error})") from None
    if not ir[:512].lstrip(b"\xef\xbb\xbf \t\r\n").startswith((b"<?xml", b"<net")):
        raise BackendError(f"{xml}: not a readable OpenVINO model (not an OpenVINO IR .xml file)")
    return ir


def _read_ir_weights(xml: Path) -> bytes:
    """The bytes of the ``.bin`` beside an IR's ``.xml``, read once."""
    weights = xml.with_suffix(".bin")
    try:
        return weights.read_bytes()
    except FileNotFoundError:
        raise BackendError(f"{xml}: its weights file {weights.name} is missing (an OpenVINO IR is a .xml and a .bin "
                           "beside it)") from None
    except OSError as error:
        raise BackendError(f"{weights}: cannot read it ({error.strerror or error})") from None


def openvino_reason(error: Exception) -> str:
    """The informative line of an openvino exception (its first lines are C++ source locations)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(("Exception from ", "Check '")) and not line.endswith(":")]
    return useful[-1][:200] if useful else first_line(error)


def openvino_xml(path) -> Path:
    """The IR behind ``path``: the ``.xml`` itself, or in a folder ``<stem>.xml`` for ``<stem>_openvino_model``
    (else the folder's only ``.xml``)."""
    path = Path(path)
    if path.is_file():
        return path
    named = path / f"{path.name.removesuffix(OPENVINO_FOLDER)}.xml"
    if named.is_file():
        return named
    found = sorted(path.glob("*.xml"))
    if not found:
        raise BackendError(f"{path}: a folder without an OpenVINO model (.xml file); pass a model file")
    if len(found) > 1:
        raise BackendError(f"{path}: a folder with {len(found)} .xml files; pass the OpenVINO model's .xml file")
    return found[0]


def read_metadata_yaml(source: Path, model: Path) -> dict:
    """The metadata YAML export.py writes beside ``model`` (OpenVINO's ``<stem>.yaml``, NCNN's ``metadata.yaml``),
    read with the bounded YAML reader (utils/safe_yaml.py); a one-line BackendError when it is missing, unreadable
    or not YAML (the fields are checked by parse_info)."""
    import yaml

    from utils.safe_yaml import read_yaml, yaml_reason

    if not source.is_file():
        raise BackendError(f"{model}: no metadata file {source.name} beside it (export.py writes it with the model)")
    try:
        return read_yaml(source)
    except OSError as error:
        raise BackendError(f"{source}: cannot read it ({error.strerror or error})") from None
    except yaml.YAMLError as error:
        raise BackendError(f"{source}: not valid YAML ({yaml_reason(error)})") from None


@contextmanager
def _no_telemetry():
    """Importing openvino imports its converter, which starts usage telemetry: it writes a client id under
    the home folder and sends events over the network unless the user opted out. The converter falls back
    to its own no-op stub when ``openvino_telemetry`` cannot be imported, so hide that package meanwhile."""
    hidden = "openvino_telemetry" not in sys.modules
    if hidden:
        sys.modules["openvino_telemetry"] = None  # import openvino_telemetry now raises ImportError
    try:
        yield
    finally:
        if hidden and sys.modules.get("openvino_telemetry", 0) is None:
            del sys.modules["openvino_telemetry"]


class _SignalStack(ctypes.Structure):
    """``stack_t`` of <signal.h> on Linux: a thread's alternate signal stack."""

    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


SS_DISABLE = 2  # <signal.h>: no alternate stack


def _libc_sigaltstack():
    """libc's ``sigaltstack`` (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sigaltstack
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.POINTER(_SignalStack), ctypes.POINTER(_SignalStack))
    function.restype = ctypes.c_int
    return function


@contextmanager
def kept_signal_stack():
    """Leave the calling thread's alternate signal stack as it was.

    Starting OpenVINO's CPU plugin (the first ``compile_model`` of each ``ov.Core``) gives the calling thread
    an alternate signal stack that the plugin maps itself; destroying the plugin unmaps it and puts the previous
    stack back only when its own is still the current one. Two models loaded one after the other and freed in
    that order (``model = load_backend(a)`` then ``model = load_backend(b)``) therefore leave the thread on the
    first plugin's stack, already unmapped. The next signal that Python handles on that thread (SIGCHLD from a
    loader worker or child process that ends, once torch's DataLoader has installed its handler; Ctrl-C) cannot
    be delivered and the kernel kills the process with SIGSEGV, before faulthandler can say anything (its handler
    runs on that stack too). With the thread's own stack put back right after the plugin started, no plugin's
    stack is ever in use, so plugins may be freed in any order. The thread's own stack serves as well: without one
    signals run on the thread's stack, and faulthandler's is the larger (16,880 bytes against the plugin's 11,568
    on a Zen 4 EPYC)."""
    sigaltstack = _libc_sigaltstack()
    saved = _SignalStack()
    if sigaltstack is None or sigaltstack(None, ctypes.byref(saved)) != 0:
        yield
        return
    saved.ss_flags &= SS_DISABLE  # SS_ONSTACK is a state, not a flag sigaltstack() accepts
    try:
        yield
    finally:
        if sigaltstack(ctypes.byref(saved), None) != 0:
            LOGGER.debug("could not restore the thread's alternate signal stack: %s",
                         os.strerror(ctypes.get_errno()))


def import_openvino(purpose: str):
    """The ``openvino`` package (optional), imported without its telemetry; a one-line BackendError without it."""
    with _no_telemetry():
        return require("openvino", purpose=purpose)


def json_or_text(value: str):
    """A metadata value stored as text, one JSON value per key (ONNX ``metadata_props``, CoreML's user-defined
    metadata): its JSON value, else the text itself (e.g. YOLOv5's names, a Python dict literal that
    models/export_info.py parses with ast.literal_eval)."""
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        return value


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


BACKENDS = {".onnx": OnnxBackend, ".torchscript": TorchScriptBackend, ".xml": OpenVinoBackend}
# Backends in their own modules (models/formats/), imported when a file of theirs is loaded: suffix -> module, class.
FORMAT_BACKENDS = {".param": ("models.formats.ncnn", "NcnnBackend")}
FORMAT_BACKENDS[".mlpackage"] = ("models.formats.coreml", "CoreMLBackend")  # a folder with a suffix of its own
FORMAT_BACKENDS[".engine"] = ("models.formats.engine", "EngineBackend")
FORMAT_BACKENDS[".pte"] = ("models.formats.executorch", "ExecuTorchBackend")
FORMAT_BACKENDS[".tflite"] = ("models.formats.litert", "LiteRtBackend")
DNN_BACKEND = ("models.formats.dnn", "OpenCvDnnBackend")  # --dnn: .onnx files on OpenCV's DNN module
# Exported folders told apart by a file inside (OpenVINO's is the one left): file name -> suffix above.
FOLDER_MARKERS = {"model.ncnn.param": ".param"}
# YOLOv5's export formats that are not run here, by the suffix or folder-name ending YOLOv5 gives them
NOT_RUN_HERE = {".mlmodel": "a Core ML neural-network model (YOLOv5's CoreML export; Core ML here is the .mlpackage "
                            "that export.py --include coreml writes)",
                ".pb": "a TensorFlow GraphDef (YOLOv5's --include pb)",
                "_saved_model": "a TensorFlow SavedModel (YOLOv5's --include saved_model)",
                "_web_model": "a TensorFlow.js model (YOLOv5's --include tfjs)",
                "_paddle_model": "a PaddlePaddle model (YOLOv5's --include paddle)"}


def _backend_class(path: Path):
    """The backend class for ``path`` (a folder by the files it holds, else the suffix); None for a checkpoint."""
    suffix = path.suffix.lower()
    if path.is_dir():  # told by a file inside (NCNN), else by a folder suffix of its own, else OpenVINO
        markers = [FOLDER_MARKERS[name] for name in FOLDER_MARKERS if (path / name).is_file()]
        if markers:
            suffix = markers[0]
        elif suffix not in FORMAT_BACKENDS:
            suffix = ".xml"
    if suffix in FORMAT_BACKENDS:
        return _format_backend(FORMAT_BACKENDS[suffix])
    return BACKENDS.get(suffix)


def _format_backend(where: tuple[str, str]):
    """A Backend class of models/formats/ by (module, class name), imported when first used."""
    import importlib

    module, name = where
    return getattr(importlib.import_module(module), name)


def is_exported(path) -> bool:
    """True for a file or folder export.py writes (any format above), False for a checkpoint."""
    return _backend_class(Path(path)) is not None


def _refuse_formats_not_run_here(path: Path) -> None:
    """One line for a YOLOv5 export of a format not run here (NOT_RUN_HERE), instead of a checkpoint's error."""
    name = path.name.lower()
    for ending, what in NOT_RUN_HERE.items():
        told = path.suffix.lower() == ending if ending.startswith(".") else name.endswith(ending)
        if told:
            raise BackendError(f"{path}: {what}, a format this project does not run; give the .pt it was exported "
                               "from, or export that with export.py (--include torchscript, onnx, openvino, ncnn, "
                               "litert, executorch, coreml or engine)")


def load_backend(path, device="cpu", half: bool = False, dnn: bool = False) -> Backend:
    """The backend for ``path`` by suffix: ``.onnx``, ``.torchscript``, ``.xml`` or a folder (OpenVINO; NCNN when it
    holds ``model.ncnn.param``), ``.param`` (NCNN), else a checkpoint (``half``: fp16 weights, checkpoints only; an
    exported file runs in the precision it was exported in). ``dnn`` (--dnn): an ``.onnx`` file runs on OpenCV's DNN
    module (models/formats/dnn.py) instead of onnxruntime."""
    path = Path(path)
    if not path.exists():
        raise BackendError(f"{path}: model file not found")
    _refuse_formats_not_run_here(path)
    backend = _backend_class(path)
    if dnn and backend is OnnxBackend:
        backend = _format_backend(DNN_BACKEND)
    elif dnn:
        LOGGER.info("--dnn applies to .onnx files (OpenCV's DNN module): %s runs as without it", path.name)
    if backend is None:
        return PyTorchBackend(path, device, half)
    if half:
        LOGGER.info("--half ignored for %s: it runs in the precision it was exported in", path.name)
    if backend is TorchScriptBackend:
        LOGGER.info("Loading TorchScript %s (runs the file's code: load only trusted files)", path.name)
    return backend(path, device)
