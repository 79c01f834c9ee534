"""LiteRT (TFLite): ``export.py --include litert`` (YOLOv5's name ``tflite`` too) -> ``<stem>.tflite``
(``<stem>-fp16.tflite`` with ``--half``, ``<stem>-int8.tflite`` with ``--int8``, YOLOv5's names), and the backend
that runs it with ``ai-edge-litert``'s Interpreter on the CPU.

Layout: the model takes NHWC float images in [0, 1] (TFLite's layout, and YOLOv5's .tflite) and returns
``(batch, N, 5 + nc)`` with the box columns divided by the input's width and height (as YOLOv5's TensorFlow
export does); the backend transposes NCHW batches to NHWC and scales the boxes back to pixels. An int8 model
takes int8 images (the converter folds the first quantisation into the input): the backend quantises them
with the input's scale and zero point, and dequantises an integer output (YOLOv5's int8 files have one).

Export: ``litert-torch`` converts the PyTorch graph itself (no TensorFlow): the model up to its Detect layer
(``Body``), then the Detect convolutions and a decode written here (``Head``: YOLOv5's, with normalised boxes and
(2 sigma)^2 as a product, because litert-torch 0.10 cannot lower the power the model's own decode uses: "failed
to legalize operation 'tfl.pow'"). The decode grids are constants of the export size, so the file has a fixed
batch and input size (``--dynamic`` refused, as YOLOv5's TFLite export); batches of another size run in chunks.
``--half`` stores the convolution weights in fp16 (ai-edge-quantizer's float casting; they are expanded to fp32
when the model loads, and it computes in fp32): half the file. ``--int8`` quantises the body with PT2E static
quantisation (litert-torch's quantizer: int8 per-channel weights, int8 per-tensor activations), calibrated on up
to CALIBRATION_IMAGES train images of ``--data`` letterboxed exactly as detect.py letterboxes for a fixed-size
export (models/formats/int8.py, shared with ExecuTorch). The Detect convolutions and the decode stay in float, so
the output is float: boxes and scores never share one int8 scale (which, with boxes in pixels, rounds every score
to zero).

Metadata: a zip archive appended to the flatbuffer (as YOLOv5 does; TFLite reads the flatbuffer by its own
offsets and ignores what follows) with ``meta.txt`` first, YOLOv5's ``{'stride': ..., 'names': {...}}`` (which
YOLOv5 reads), then ``metadata.json``, the ExportInfo. A YOLOv5 .tflite (``meta.txt`` alone) is read too.
"""
from __future__ import annotations

import ast
import copy
import json
import logging
import os
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

from models.backends import MAX_METADATA_CHARS, Backend, BackendError, ExportInfo, first_line, parse_info, require
from models.export_info import MAX_LITERAL_CHARS
from models.formats import check_flatbuffer_identifier, place_file
from models.formats.int8 import Body, calibration_files, quantised_body
from utils.errors import ArgumentError, UnavailableOption, UserError

LOGGER = logging.getLogger(__name__)
SUFFIX = ".tflite"
INSTALL = "pip install -r requirements-litert.txt"
FILE_IDENTIFIER = b"TFL3"  # bytes 4-8 of every TFLite flatbuffer
YOLOV5_METADATA, METADATA = "meta.txt", "metadata.json"
EXPORT_OPTIONS = ("int8", "data")  # the ExportConfig fields export() takes besides half


class LiteRtExportError(UserError):
    """litert-torch could not convert or quantise the model; one line with the reason."""


def require_litert(module: str, purpose: str, package: str = "litert-torch"):
    """``litert_torch``, ``ai_edge_litert`` or ``ai_edge_quantizer`` (optional; models.backends.require)."""
    return require(module, purpose, package, install=INSTALL)


def import_interpreter(purpose: str):
    return require_litert("ai_edge_litert.interpreter", purpose, "ai-edge-litert")


@contextmanager
def environment_kept():
    """Put the environment back as it was: importing litert-torch (and jax under it) sets TF_CPP_MIN_LOG_LEVEL,
    TPU_SKIP_MDS_QUERY and TORCHINDUCTOR_CACHE_DIR, and its progress switch is an environment variable."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


# ------------------------------------------------------------------------------------------------ export

def check_options(config, device: torch.device) -> None:
    """Refuse the flags this export cannot honour, before any slow work (``config``: export.ExportConfig)."""
    if config.dynamic:
        raise ArgumentError("--include litert: .tflite files have a fixed batch and input size here (as YOLOv5's); "
                            "export without --dynamic")
    if config.int8 and config.half:
        raise ArgumentError("--include litert: --int8 and --half are two precisions; pick one")
    if device.type != "cpu":
        raise UnavailableOption(f"--include litert exports and runs on the CPU: use --device cpu (not {device.type})")
    with quiet_conversion():  # importing it imports torchao and jax
        require_litert("litert_torch", "--include litert")
    import_interpreter("--include litert (the parity check)")
    if config.half:
        require_litert("ai_edge_quantizer", "--include litert --half", "ai-edge-quantizer")
    if config.int8:
        calibration_files(config.data)  # a missing or empty dataset is refused now, not after the conversion


def output_path(weights: Path, config) -> Path:
    """``best.tflite``; ``best-fp16.tflite`` with --half and ``best-int8.tflite`` with --int8 (YOLOv5's names)."""
    tag = "-int8" if config.int8 else "-fp16" if config.half else ""
    return weights.with_name(f"{weights.stem}{tag}{SUFFIX}")


def export(graph: nn.Module, example: torch.Tensor, info: ExportInfo, path: Path, half: bool = False,
           int8: bool = False, data: str | None = None) -> Path:
    """Convert ``graph`` (export.PredictionOnly) at ``example``'s shape and write the .tflite with its metadata to
    a hidden temp file beside ``path``; export.py checks it against the PyTorch model, then ``place`` names it."""
    from utils.files import write_temp

    model = graph.model
    height, width = example.shape[2:]
    nhwc = example.detach().to("cpu", torch.float32).permute(0, 2, 3, 1).contiguous()
    body, head = Body(model, nhwc=True).eval(), Head(model.model[-1], height, width).eval()
    with quiet_conversion():
        if int8:
            body = quantised_body(body, nhwc, data, int8_quantizer(), LiteRtExportError, "LiteRT", fold_quantize=False)
        flatbuffer = convert(ExportGraph(body, head), nhwc, int8)
    if half:
        flatbuffer = fp16_weights(flatbuffer)
    temp = write_temp(path, flatbuffer)
    try:
        append_metadata(temp, info)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp


class Head(nn.Module):
    """Feature maps -> ``(batch, N, 5 + nc)``: the Detect layer's convolutions (its training-mode output, the raw
    maps), then YOLOv5's decode for a fixed input size with the boxes divided by the width and height."""

    def __init__(self, detect: nn.Module, height: int, width: int):
        super().__init__()
        self.detect = copy.deepcopy(detect).float()
        size = torch.tensor([width, height], dtype=torch.float32)
        for level, stride in enumerate(detect.stride.tolist()):
            rows, columns = int(height // stride), int(width // stride)
            grid = detect._make_grid(rows, columns, size)  # cell offsets minus 0.5, (1, 1, rows, columns, 2)
            self.register_buffer(f"offset{level}", grid * stride / size)
            self.register_buffer(f"step{level}", 2 * stride / size)
            self.register_buffer(f"anchor{level}", (detect.anchors[level] * stride / size).view(1, -1, 1, 1, 2))

    def forward(self, features):
        self.detect.training = True  # the raw maps, decoded below
        try:
            maps = self.detect(list(features))
        finally:
            self.detect.training = False
        decoded = []
        for level, raw in enumerate(maps):
            batch, outputs = raw.shape[0], raw.shape[-1]
            y = raw.sigmoid()
            xy = y[..., :2] * getattr(self, f"step{level}") + getattr(self, f"offset{level}")
            wh = y[..., 2:4] * 2
            wh = wh * wh * getattr(self, f"anchor{level}")
            decoded.append(torch.cat((xy, wh, y[..., 4:]), -1).view(batch, -1, outputs))
        return torch.cat(decoded, 1)


class ExportGraph(nn.Module):
    """NHWC images -> normalised predictions: ``body`` (float, or int8 from PT2E) then ``head`` (float)."""

    def __init__(self, body: nn.Module, head: Head):
        super().__init__()
        self.body, self.head = body, head
        self.training = False  # the parts are in eval mode already (.eval() is refused by a PT2E body)

    def forward(self, images):
        return self.head(self.body(images))


@contextmanager
def quiet_conversion():
    """Without the converter's chatter: litert-torch's progress lines (a switch it reads from the environment, put
    back by environment_kept) and its per-operator notes (info records on the root logger), jax's note that it
    found no TPU, torchao's deprecation notice (torch's pytree logger). Warnings and errors still show."""
    def not_a_converter_note(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "litert_torch" not in record.pathname

    root = logging.getLogger()
    quieted = {name: logging.getLogger(name) for name in ("jax._src.xla_bridge", "torch.utils._pytree")}
    levels = {name: logger.level for name, logger in quieted.items()}
    root.addFilter(not_a_converter_note)
    for logger in quieted.values():
        logger.setLevel(logging.ERROR)
    try:
        with environment_kept():
            os.environ["LITERT_TORCH_SHOW_PROGRESS"] = "0"
            yield
    finally:
        root.removeFilter(not_a_converter_note)
        for name, logger in quieted.items():
            logger.setLevel(levels[name])


def convert(graph: nn.Module, example: torch.Tensor, int8: bool) -> bytes:
    """The flatbuffer litert-torch makes of ``graph`` (NHWC ``example``)."""
    litert_torch = require_litert("litert_torch", "--include litert")
    options = {}
    if int8:
        from litert_torch.quantize.quant_config import QuantConfig

        options["quant_config"] = QuantConfig(pt2e_quantizer=int8_quantizer())
    try:
        with torch.no_grad():
            converted = litert_torch.convert(graph, (example,), **options)
        content = converted.model_content
        return bytes(content() if callable(content) else content)
    except Exception as error:  # torch.export and the MLIR converter raise many types
        raise LiteRtExportError(f"LiteRT conversion failed ({first_line(error)})") from None


def int8_quantizer():
    from litert_torch.quantize import pt2e_quantizer

    config = pt2e_quantizer.get_symmetric_quantization_config(is_per_channel=True)
    return pt2e_quantizer.PT2EQuantizer().set_global(config)


def fp16_weights(flatbuffer: bytes) -> bytes:
    """The same model with its convolution weights stored in fp16 (expanded to fp32 when it loads)."""
    quantizer = require_litert("ai_edge_quantizer", "--include litert --half", "ai-edge-quantizer")
    from ai_edge_quantizer import algorithm_manager, qtyping, recipe_manager

    recipes = recipe_manager.RecipeManager()
    recipes.add_weight_only_config(regex=".*", operation_name=qtyping.TFLOperationName.ALL_SUPPORTED, num_bits=16,
                                   algorithm_key=algorithm_manager.AlgorithmName.FLOAT_CASTING)
    try:
        result = quantizer.Quantizer(bytearray(flatbuffer), recipes.get_quantization_recipe()).quantize(
            enable_progress_report=False)
    except Exception as error:
        raise LiteRtExportError(f"LiteRT --half (fp16 weights) failed ({first_line(error)})") from None
    return bytes(result.quantized_model)


def append_metadata(path: Path, info: ExportInfo) -> None:
    """Append the zip archive of YOLOv5's ``meta.txt`` and our ``metadata.json`` to the .tflite at ``path``."""
    yolov5 = {"stride": info.stride, "names": dict(enumerate(info.names))}
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(YOLOV5_METADATA, repr(yolov5))
        archive.writestr(METADATA, json.dumps(info.to_dict(), ensure_ascii=False))


place = place_file  # the checked temp file takes its name


def checked_backend(written: Path, info: ExportInfo, device) -> LiteRtBackend:
    """The backend export.py's parity check runs on the file it just wrote."""
    return LiteRtBackend(written, device)


# ------------------------------------------------------------------------------------------------ backend

def check_identifier(path: Path) -> None:
    """Refuse a file that is not a TFLite model before the runtime parses it."""
    check_flatbuffer_identifier(path, FILE_IDENTIFIER, "a TFLite model")


def read_metadata(path: Path) -> dict:
    """Our ``metadata.json``, else YOLOv5's ``meta.txt``, from the zip archive appended to the model; each entry's
    size is checked before it is read, and YOLOv5's Python literal is parsed without eval."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            entry = METADATA if METADATA in names else YOLOV5_METADATA if YOLOV5_METADATA in names else None
            if entry is None:
                raise BackendError(f"{path}: no {METADATA} or {YOLOV5_METADATA} in the archive appended to it")
            limit = MAX_METADATA_CHARS if entry == METADATA else MAX_LITERAL_CHARS
            if archive.getinfo(entry).file_size > limit:
                raise BackendError(f"{path}: {entry} holds {archive.getinfo(entry).file_size:,} bytes of metadata, "
                                   f"more than {limit:,}")
            with archive.open(entry) as file:
                data = file.read(limit + 1)
    except BackendError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError):
        raise BackendError(f"{path}: no metadata inside (export it with export.py, which appends it)") from None
    except OSError as error:
        raise BackendError(f"{path}: cannot read its metadata ({error.strerror or error})") from None
    if len(data) > limit:  # an entry that says it is small but is not
        raise BackendError(f"{path}: {entry} holds more than {limit:,} bytes of metadata")
    try:
        text = data.decode("utf-8")
        values = json.loads(text) if entry == METADATA else ast.literal_eval(text)
    except (UnicodeDecodeError, ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as error:
        raise BackendError(f"{path}: {entry} inside is not {'JSON' if entry == METADATA else 'a Python literal'} "
                           f"({first_line(error)})") from None
    if not isinstance(values, dict):
        raise BackendError(f"{path}: {entry} inside is not a mapping of fields")
    return values


class LiteRtBackend(Backend):
    """A ``.tflite`` file run by ai-edge-litert's Interpreter on the CPU, on as many threads as torch uses."""

    kind = "litert"
    other_sizes = "export it again with --imgsz for other sizes"  # --dynamic is refused

    def __init__(self, path, device="cpu"):
        path = Path(path)
        check_identifier(path)
        values = read_metadata(path)
        interpreter_module = import_interpreter(f"running {path.name}")
        try:
            interpreter = interpreter_module.Interpreter(model_path=str(path), num_threads=torch.get_num_threads())
            interpreter.allocate_tensors()
        except Exception as error:  # the interpreter raises ValueError and RuntimeError for unreadable models
            raise BackendError(f"{path}: not a readable TFLite model ({first_line(error)})") from None
        inputs, outputs = interpreter.get_input_details(), interpreter.get_output_details()
        if len(inputs) != 1 or len(inputs[0]["shape"]) != 4 or inputs[0]["shape"][3] != 3 or len(outputs) != 1:
            raise BackendError(f"{path}: expected one NHWC image input and one output, found {len(inputs)} inputs "
                               f"{[list(item['shape']) for item in inputs]} and {len(outputs)} outputs")
        batch, height, width, channels = (int(side) for side in inputs[0]["shape"])
        info = parse_info(values, str(path), [batch, channels, height, width])
        if torch.device(device).type != "cpu":
            LOGGER.warning("WARNING: LiteRT models run on the CPU here; running %s on the CPU", path.name)
        super().__init__(path, info, device)
        self.interpreter, self.input, self.output = interpreter, inputs[0], outputs[0]
        self.int8 = np.issubdtype(self.input["dtype"], np.integer)  # an int8 input, quantised by _run
        self.box_scale = torch.tensor([width, height, width, height], dtype=torch.float32)

    def _run(self, images: torch.Tensor) -> torch.Tensor:
        array = images.detach().to("cpu", torch.float32).permute(0, 2, 3, 1).contiguous().numpy()
        self.interpreter.set_tensor(self.input["index"], quantise(array, self.input))
        self.interpreter.invoke()
        output = dequantise(self.interpreter.get_tensor(self.output["index"]), self.output)
        if output.ndim != 3 or output.shape[2] != 5 + self.info.nc:
            raise BackendError(f"{self.path}: the model gave an output of shape {list(output.shape)}, not "
                               f"(batch, N, {5 + self.info.nc}) for {self.info.nc} classes")
        output = torch.from_numpy(output.astype(np.float32))
        output[..., :4] *= self.box_scale  # normalised boxes back to pixels
        return output.to(images.device)


def quantise(array: np.ndarray, detail: dict) -> np.ndarray:
    """``array`` in the input's type: as is for a float input, else rounded with its scale and zero point."""
    if not np.issubdtype(detail["dtype"], np.integer):
        return array.astype(detail["dtype"])
    scale, zero_point = detail["quantization"]
    limits = np.iinfo(detail["dtype"])
    return np.clip(np.round(array / scale + zero_point), limits.min, limits.max).astype(detail["dtype"])


def dequantise(array: np.ndarray, detail: dict) -> np.ndarray:
    """A float copy of an output: an integer one through its scale and zero point."""
    if not np.issubdtype(array.dtype, np.integer):
        return array.astype(np.float32)
    scale, zero_point = detail["quantization"]
    return (array.astype(np.float32) - zero_point) * scale
