"""TensorRT: ``export.py --include engine --device 0`` and the backend that runs a ``.engine`` file on the GPU.

Export: the prediction graph is traced to ONNX on the GPU (fp16 with ``--half``, as ``--include onnx --half``) and
built by TensorRT's ONNX parser into a serialized engine for this GPU and this TensorRT version. The two APIs
differ in how precision is asked for: TensorRT 10 builds a weakly typed network and takes ``BuilderFlag.FP16``;
TensorRT 11 dropped the precision flags (fp16/int8 are decided by the ONNX itself, NVIDIA ModelOpt for int8) and
builds strongly typed networks, so the fp16 ONNX is what makes an fp16 engine. Both are read from the installed
module's attributes, not its version string. ``--int8`` is refused (it needs an int8-quantised ONNX from ModelOpt,
not made here), and so is ``--dynamic`` (an engine is built for one input shape here: batches of another size run
in chunks of ``--batch-size``, as other fixed-shape exports). As in YOLOv5, ``--workspace`` (GB, default 4) is the
builder's workspace memory-pool limit and ``--verbose`` logs the parse and build at TensorRT's VERBOSE severity
(WARNING otherwise).

File layout: a 4-byte little-endian length, the metadata as UTF-8 JSON (``ExportInfo``, as the other formats),
then TensorRT's serialized engine. A file without that header (YOLOv5 v7 writes the engine alone) is refused with
the command that re-exports it. The engine is deserialized with TensorRT's defaults, which refuse the host code
a version-compatible engine can embed (``engine_host_code_allowed`` stays False); still, load only engines you built.

Nothing here imports ``tensorrt`` until a file is exported or loaded; without a GPU or without the package, one
line (utils.errors.Unavailable).
"""
from __future__ import annotations

import io
import json
import logging
import struct
from pathlib import Path

import torch
from torch import nn

from models.backends import Backend, BackendError, ExportInfo, _check_metadata_size, parse_info, require
from models.formats import place_file
from utils.cli import positive_int
from utils.errors import ArgumentError, Unavailable, UnavailableOption, UserError

LOGGER = logging.getLogger(__name__)
SUFFIX = ".engine"
INSTALL = "pip install tensorrt (NVIDIA's wheel for your CUDA version; needs an NVIDIA GPU)"
HEADER = struct.Struct("<I")  # the metadata's length in bytes
MAX_METADATA_BYTES = 1 << 20
OPSET = 17
EXPORT_OPTIONS = ("workspace", "verbose")  # the ExportConfig fields export() takes besides half


class EngineError(UserError):
    """TensorRT could not parse the ONNX graph or build the engine; one line with its reason."""


class NoGpu(BackendError, Unavailable):
    """A TensorRT engine on a machine or device without CUDA."""


def import_tensorrt(purpose: str):
    return require("tensorrt", purpose, install=INSTALL)


# ------------------------------------------------------------------------------------------------ export

def check_options(config, device: torch.device) -> None:
    """Refuse what an engine build cannot do, before any slow work (``config``: export.ExportConfig)."""
    if device.type != "cuda":
        raise UnavailableOption(f"--include engine builds a TensorRT engine on an NVIDIA GPU: use --device 0 (not "
                                f"{device.type}); TensorRT engines do not run on the CPU")
    if config.dynamic:
        raise ArgumentError("--include engine: engines are built for one input shape here (batches of another size "
                            "run in chunks of --batch-size); export without --dynamic")
    if getattr(config, "int8", False):
        raise ArgumentError("--include engine --int8: TensorRT takes int8 from an int8-quantised ONNX (NVIDIA "
                            "ModelOpt), which export.py does not make; export fp32 or --half")
    try:
        positive_int.check(config.workspace)
    except ValueError as error:
        raise ArgumentError(f"--workspace: {error} (GB of TensorRT builder workspace)") from None
    import_tensorrt("--include engine")


def onnx_bytes(graph: nn.Module, example: torch.Tensor) -> bytes:
    """The fixed-shape ONNX graph TensorRT parses: input ``images``, output ``output0``."""
    buffer = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(graph, (example,), buffer, dynamo=False, opset_version=OPSET, input_names=["images"],
                          output_names=["output0"], do_constant_folding=True)
    return buffer.getvalue()


def build_engine(trt, onnx: bytes, half: bool, workspace: int = 4, verbose: bool = False) -> bytes:
    """TensorRT 10 (precision flags) or 11 (strongly typed): the serialized engine, or EngineError. ``workspace``:
    the builder's workspace limit in GB; ``verbose``: TensorRT's VERBOSE log instead of WARNING."""
    logger = trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    creation = getattr(trt, "NetworkDefinitionCreationFlag", None)
    weakly_typed = hasattr(trt.BuilderFlag, "FP16")
    if not weakly_typed and creation is not None and hasattr(creation, "STRONGLY_TYPED"):
        flags |= 1 << int(creation.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT could not parse the ONNX graph ({errors[:300] or 'no reason given'})")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace << 30)
    if half and weakly_typed:
        if not builder.platform_has_fast_fp16:
            LOGGER.warning("WARNING: this GPU has no fast fp16; the engine may run some layers in fp32")
        config.set_flag(trt.BuilderFlag.FP16)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineError("TensorRT could not build the engine (its log above says why)")
    return bytes(serialized)


def export(graph: nn.Module, example: torch.Tensor, info: ExportInfo, path: Path, half: bool = False,
           workspace: int = 4, verbose: bool = False) -> Path:
    """Build the engine for ``example``'s shape and write header + metadata + engine to a hidden temp file beside
    ``path``; export.py checks it against the PyTorch model, then renames it into place."""
    trt = import_tensorrt("--include engine")
    engine = build_engine(trt, onnx_bytes(graph, example), half, workspace, verbose)
    metadata = json.dumps(info.to_dict()).encode()
    from utils.files import write_temp

    return write_temp(path, HEADER.pack(len(metadata)) + metadata + engine)


place = place_file  # the checked temp file takes its name


# ------------------------------------------------------------------------------------------------ reading

def split_engine_file(path: Path) -> tuple[dict, bytes]:
    """(metadata, engine bytes) of a file written by export(); BackendError for anything else."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise BackendError(f"{path}: cannot read it ({error.strerror or error})") from None
    if len(data) < HEADER.size:
        raise BackendError(f"{path}: not a TensorRT engine from export.py ({len(data)} bytes)")
    (length,) = HEADER.unpack_from(data)
    if length > MAX_METADATA_BYTES or HEADER.size + length > len(data):
        raise BackendError(f"{path}: no export.py metadata at its start (a YOLOv5 engine?): rebuild it with "
                           "python export.py --weights best.pt --include engine --device 0")
    _check_metadata_size(length, path, "the engine header")
    try:
        values = json.loads(data[HEADER.size:HEADER.size + length].decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise BackendError(f"{path}: no export.py metadata at its start (a YOLOv5 engine?): rebuild it with "
                           "python export.py --weights best.pt --include engine --device 0") from None
    if not isinstance(values, dict):
        raise BackendError(f"{path}: the engine's metadata is not a JSON object")
    return values, data[HEADER.size + length:]


class EngineBackend(Backend):
    """A ``.engine`` file run by TensorRT on the CUDA device, through the tensor-name API (TensorRT 8.5 and later)."""

    kind = "engine"

    def __init__(self, path, device="cuda:0"):
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            where = "this machine has no CUDA device" if device.type == "cuda" else f"not on {device.type}"
            raise NoGpu(f"{Path(path).name}: TensorRT engines run on an NVIDIA GPU (--device 0), {where}; on the "
                        "CPU use the .pt, .onnx or OpenVINO export")
        values, engine_bytes = split_engine_file(Path(path))
        info = parse_info(values, str(path))
        trt = import_tensorrt(f"running {Path(path).name}")
        super().__init__(path, info, device)
        with torch.cuda.device(device):
            self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            self.engine = self.runtime.deserialize_cuda_engine(engine_bytes)
            if self.engine is None:
                raise BackendError(f"{path}: TensorRT could not load the engine (built by another TensorRT version "
                                   "or for another GPU? rebuild it on this machine with export.py --include engine)")
            self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if n not in inputs]
        if len(inputs) != 1 or len(outputs) != 1:
            raise BackendError(f"{path}: expected one input and one output, found {inputs} and {outputs}")
        self.input_name, self.output_name = inputs[0], outputs[0]
        self.input_dtype = _torch_dtype(trt, self.engine.get_tensor_dtype(self.input_name))
        self.output_dtype = _torch_dtype(trt, self.engine.get_tensor_dtype(self.output_name))
        shape = tuple(self.engine.get_tensor_shape(self.input_name))
        if shape != (info.batch, 3, *info.imgsz):
            raise BackendError(f"{path}: the engine takes {list(shape)}, its metadata says "
                               f"{[info.batch, 3, *info.imgsz]}")

    def _run(self, images: torch.Tensor) -> torch.Tensor:
        images = images.detach().to(self.device, self.input_dtype).contiguous()
        self.context.set_input_shape(self.input_name, tuple(images.shape))
        output = torch.empty(tuple(self.context.get_tensor_shape(self.output_name)), dtype=self.output_dtype,
                             device=self.device)
        self.context.set_tensor_address(self.input_name, images.data_ptr())
        self.context.set_tensor_address(self.output_name, output.data_ptr())
        stream = torch.cuda.current_stream(self.device)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise BackendError(f"{self.path}: TensorRT failed to run the engine")
        return output.float()


def _torch_dtype(trt, dtype) -> torch.dtype:
    known = {trt.float32: torch.float32, trt.float16: torch.float16}
    if dtype not in known:
        raise BackendError(f"engine tensor type {dtype} is not float32 or float16")
    return known[dtype]


def checked_backend(written: Path, info: ExportInfo, device) -> EngineBackend:
    """The backend export.py's parity check runs on the file it just wrote."""
    return EngineBackend(written, device)
