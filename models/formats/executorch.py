"""ExecuTorch: ``export.py --include executorch`` -> ``<stem>.pte`` (``<stem>-int8.pte`` with ``--int8``), and the
backend that runs it with ExecuTorch's Python runtime (its XNNPACK kernels on the CPU).

Export: the prediction graph is captured with ``torch.export`` at the example's batch and size, lowered with
``to_edge_transform_and_lower`` and the XNNPACK partitioner, and serialised to a ``.pte`` program. XNNPACK's
lowering refuses channels_last parameters, so a channels-first copy of the model is exported (XNNPACK picks its
own layout inside). The metadata (``ExportInfo``, as the other formats) travels inside the file: a second method,
``yolo_metadata``, returns it as UTF-8 JSON bytes in a uint8 tensor (ExecuTorch's constant methods hold tensors
and numbers, not text). The decode grids are constants of the export size, so a ``.pte`` has a fixed batch and
input size, like a static ONNX export: batches of another size run in chunks of the exported batch, and other
image sizes are refused (``--dynamic`` is refused: ExecuTorch plans memory for an upper bound of every dynamic
dimension, which for any image size up to MAX_IMAGE_SIZE is far beyond a device's memory).

``--int8``: the model up to its Detect layer is quantised with XNNPACK's PT2E quantizer (int8 per-channel
weights, int8 per-tensor activations) calibrated on the train images of ``--data``; the Detect convolutions and
the decode stay float (models/formats/int8.py, shared with LiteRT). XNNPACK runs the quantised operators.
``--half`` is refused: XNNPACK's fp16 lowering of this model (ExecuTorch 1.5.1) split it into hundreds of
delegate calls, kept the file at its fp32 size and ran about 2x slower than fp32 on an x86 CPU (measured on
yolov5n at 320), so it is no deployment format.

Reading: a ``.pte`` is data (a flatbuffer of operators the runtime interprets), not Python code. The file
identifier is checked before the runtime parses it (which then verifies the program's internal consistency),
and the metadata method's output size is checked before it runs. Needs the optional ``executorch`` package
(requirements-executorch.txt), imported only when a ``.pte`` is exported or loaded.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from models.backends import (MAX_METADATA_CHARS, Backend, BackendError, ExportInfo, _check_metadata_size, first_line,
                             parse_info)
from models.backends import require as require_package
from models.formats import check_flatbuffer_identifier, place_file
from models.formats.int8 import Body, calibration_files, quantised_body
from utils.errors import ArgumentError, UnavailableOption, UserError

LOGGER = logging.getLogger(__name__)
SUFFIX = ".pte"
METADATA_METHOD = "yolo_metadata"
INSTALL = "pip install -r requirements-executorch.txt"
FILE_IDENTIFIER = b"ET12"  # bytes 4-8 of every ExecuTorch program (its flatbuffer file identifier)
EXPORT_OPTIONS = ("int8", "data")  # the ExportConfig fields export() takes besides half


class ExecuTorchExportError(UserError):
    """torch.export or the XNNPACK lowering could not convert the model; one line with the reason."""


def require(module: str, purpose: str):
    """Import a part of ``executorch`` (optional) or raise a one-line MissingPackage with the install command
    (models.backends.require).

    Importing it leaves the process as it was: its runtime module sets ``OPENVINO_LIB_PATH`` in the environment
    when openvino is installed (for an ExecuTorch OpenVINO backend this project does not use), which is undone;
    its "experimental API" warning and torchao's deprecation notice (torch's pytree logger) are not shown."""
    import warnings

    pytree_log = logging.getLogger("torch.utils._pytree")
    level, had_variable = pytree_log.level, "OPENVINO_LIB_PATH" in os.environ
    pytree_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This API is experimental")
            return require_package(module, purpose, "executorch", install=INSTALL)
    finally:
        pytree_log.setLevel(level)
        if not had_variable:
            os.environ.pop("OPENVINO_LIB_PATH", None)


# ------------------------------------------------------------------------------------------------ export

def check_options(config, device: torch.device) -> None:
    """Refuse the flags this export cannot honour, before any slow work (``config``: export.ExportConfig)."""
    if config.dynamic:
        raise ArgumentError("--include executorch: .pte files have a fixed batch and input size here (ExecuTorch "
                            "plans memory for the largest size a dynamic input may take); export without --dynamic")
    if device.type != "cpu":
        raise UnavailableOption(f"--include executorch exports for XNNPACK on the CPU: use --device cpu "
                                f"(not {device.type})")
    if config.half:  # what this format lacks (benchmarks.py --half: an unavailable row, not a failed one)
        raise UnavailableOption("--include executorch --half: not supported (XNNPACK's fp16 lowering of this model "
                                "is no smaller and slower than fp32); export fp32 or --int8")
    require("executorch.exir", "--include executorch")
    require("executorch.runtime", "--include executorch (the parity check)")
    if config.int8:
        require("executorch.backends.xnnpack.quantizer.xnnpack_quantizer", "--include executorch --int8")
        calibration_files(config.data)  # a missing or empty dataset is refused now, not after the conversion


def output_path(weights: Path, config) -> Path:
    """``best.pte``; ``best-int8.pte`` with --int8 (the LiteRT names' convention)."""
    return weights.with_name(f"{weights.stem}{'-int8' if config.int8 else ''}{SUFFIX}")


def export(graph: nn.Module, example: torch.Tensor, info: ExportInfo, path: Path, half: bool = False,
           int8: bool = False, data: str | None = None) -> Path:
    """Lower ``graph`` (the decoded-prediction module; with ``int8``, its body quantised on the calibration images
    of ``data``) for XNNPACK at ``example``'s shape and write the program to a hidden temp file beside ``path``;
    export.py checks it against the PyTorch model, then ``place`` names it."""
    if int8:
        module = Int8Graph(graph.model, example, data)
    else:  # XNNPACK's lowering refuses channels_last parameters (see the module docstring)
        module = copy.deepcopy(graph).float().to(memory_format=torch.contiguous_format).eval()
    content = program_bytes(module, example, info)
    from utils.files import write_temp

    return write_temp(path, content)


class Int8Graph(nn.Module):
    """Images -> predictions: the model up to Detect with int8 weights and activations (PT2E, XNNPACK's quantizer),
    then the float Detect layer with its own decode."""

    def __init__(self, model: nn.Module, example: torch.Tensor, data: str):
        super().__init__()
        quantizer = require("executorch.backends.xnnpack.quantizer.xnnpack_quantizer", "--include executorch --int8")
        config = quantizer.get_symmetric_quantization_config(is_per_channel=True)
        example = example.detach().to("cpu", torch.float32).contiguous()
        self.body = quantised_body(Body(model).eval(), example, data, quantizer.XNNPACKQuantizer().set_global(config),
                                   ExecuTorchExportError, "ExecuTorch", fold_quantize=True)
        self.detect = copy.deepcopy(model.model[-1]).float().to(memory_format=torch.contiguous_format).eval()
        self.training = False  # the parts are in eval mode already (.eval() is refused by a PT2E body)

    def forward(self, images):
        return self.detect(list(self.body(images)))[0]


def program_bytes(module: nn.Module, example: torch.Tensor, info: ExportInfo) -> bytes:
    """The serialised ``.pte`` program of ``module`` (float32, channels-first parameters, in eval mode):
    ``forward`` (images -> predictions) and ``yolo_metadata``."""
    exir = require("executorch.exir", "--include executorch")
    partitioner = require("executorch.backends.xnnpack.partition.xnnpack_partitioner", "--include executorch")
    example = example.detach().to("cpu", torch.float32).contiguous()
    try:
        with torch.no_grad():
            program = torch.export.export(module, (example,), strict=False)
        edge = exir.to_edge_transform_and_lower(program, partitioner=[partitioner.XnnpackPartitioner()],
                                                constant_methods={METADATA_METHOD: metadata_tensor(info)})
        return bytes(edge.to_executorch().buffer)
    except Exception as error:  # torch.export and exir raise many types (RuntimeError, their own, AssertionError)
        raise ExecuTorchExportError(f"ExecuTorch export failed ({first_line(error)})") from None


def metadata_tensor(info: ExportInfo) -> torch.Tensor:
    """The metadata as UTF-8 JSON bytes in a uint8 tensor (what a constant method can return)."""
    text = json.dumps(info.to_dict(), ensure_ascii=False).encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


place = place_file  # the checked temp file takes its name


def checked_backend(written: Path, info: ExportInfo, device) -> ExecuTorchBackend:
    """The backend export.py's parity check runs on the file it just wrote."""
    return ExecuTorchBackend(written, device)


# ------------------------------------------------------------------------------------------------ backend

def check_identifier(path: Path) -> None:
    """Refuse a file that is not an ExecuTorch program before the runtime parses it."""
    check_flatbuffer_identifier(path, FILE_IDENTIFIER, "an ExecuTorch program")


class ExecuTorchBackend(Backend):
    """A ``.pte`` program run by ExecuTorch's Python runtime on the CPU (XNNPACK): float32 images in, float32
    predictions out (an int8 program quantises inside)."""

    kind = "executorch"
    other_sizes = "export it again with --imgsz for other sizes"  # --dynamic is refused

    def __init__(self, path, device="cpu"):
        path = Path(path)
        check_identifier(path)
        runtime = require("executorch.runtime", f"running {path.name}")
        try:
            program = runtime.Runtime.get().load_program(path)
        except Exception as error:  # the runtime raises RuntimeError and ValueError for unreadable programs
            raise BackendError(f"{path}: not a readable ExecuTorch program ({first_line(error)})") from None
        names = program.method_names
        if "forward" not in names or METADATA_METHOD not in names:
            raise BackendError(f"{path}: no {METADATA_METHOD} metadata inside (not exported by export.py; methods: "
                               f"{', '.join(sorted(names))[:200]})")
        values = read_metadata(program, path)
        meta = program.metadata("forward")
        if meta.num_inputs() != 1 or meta.num_outputs() < 1:
            raise BackendError(f"{path}: expected one input (images) and an output, found {meta.num_inputs()} "
                               f"inputs and {meta.num_outputs()} outputs")
        shape = list(meta.input_tensor_meta(0).sizes())
        info = parse_info(values, str(path), shape if len(shape) == 4 else None)
        if torch.device(device).type != "cpu":
            LOGGER.warning("WARNING: ExecuTorch (XNNPACK) models run on the CPU here; running %s on the CPU", path.name)
        super().__init__(path, info, device)
        try:
            self.method = program.load_method("forward")
        except Exception as error:
            raise BackendError(f"{path}: ExecuTorch cannot load its forward method ({first_line(error)})") from None
        self.program = program  # the method runs inside the program's memory

    def _run(self, images: torch.Tensor) -> torch.Tensor:
        array = images.detach().to("cpu", torch.float32).contiguous()
        output = self.method.execute([array])[0]
        return output.clone().to(images.device).float()  # the runtime reuses its output buffer on the next call


def read_metadata(program, path: Path) -> dict:
    """The ``yolo_metadata`` method's JSON, its size checked before it runs."""
    meta = program.metadata(METADATA_METHOD)
    if meta.num_inputs() != 0 or meta.num_outputs() != 1:
        raise BackendError(f"{path}: {METADATA_METHOD} is not a metadata method (it takes inputs or has no output)")
    _check_metadata_size(int(meta.output_tensor_meta(0).nbytes()), path, METADATA_METHOD)
    try:
        output = program.load_method(METADATA_METHOD).execute([])[0]
    except Exception as error:
        raise BackendError(f"{path}: cannot read its {METADATA_METHOD} ({first_line(error)})") from None
    if not isinstance(output, torch.Tensor) or output.dtype != torch.uint8 or output.numel() > MAX_METADATA_CHARS:
        raise BackendError(f"{path}: {METADATA_METHOD} does not hold UTF-8 JSON bytes")
    try:
        values = json.loads(output.contiguous().numpy().tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise BackendError(f"{path}: {METADATA_METHOD} inside is not JSON ({first_line(error)})") from None
    if not isinstance(values, dict):
        raise BackendError(f"{path}: {METADATA_METHOD} inside is not a JSON object")
    return values
