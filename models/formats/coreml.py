"""CoreML: ``export.py --include coreml`` writes ``<stem>.mlpackage`` (an ML Program) with coremltools, on any OS.

The prediction graph is traced to TorchScript at the export's batch and size (a fixed input shape: ``--dynamic``
is refused) and converted by coremltools 9 to an ML Program for iOS 15 / macOS 12 or later, input ``images``
(float32, B x 3 x H x W in [0, 1]) and output ``output0`` (B x N x (5 + nc), the decoded predictions NMS takes).
fp32 by default; ``--half`` converts with fp16 compute precision (weights and arithmetic in fp16 on the device).
Metadata (``ExportInfo``) is the package's user-defined metadata, one JSON value per key as in ONNX files.

Core ML itself (compiling and running a model) exists only on Apple platforms. On Linux and Windows the export's
check is therefore a check of what was written: the package is opened back from disk with coremltools (its
specification, without compiling it) and its input, output, precision and metadata must be what was exported;
a package that differs is an error and is not kept. ``load_backend`` of a package off Apple platforms is one line
saying so. On macOS the backend runs the package through coremltools' ``MLModel.predict`` on the CPU, and
export.py's numeric parity check runs on it; that path has not been run by this project's tests (Linux only).
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from models.backends import (MAX_METADATA_CHARS, METADATA_KEYS, Backend, BackendError, ExportInfo, json_or_text,
                             parse_info, require)
from utils.errors import ArgumentError, Unavailable, UnavailableOption, UserError

LOGGER = logging.getLogger(__name__)
SUFFIX = ".mlpackage"
INSTALL = "pip install -r requirements-coreml.txt"
INPUT, OUTPUT = "images", "output0"
MIN_SPEC_VERSION = 6  # Core ML 5: ML Programs, iOS 15 / macOS 12


class CoreMLError(UserError):
    """coremltools could not convert the model, or the written package is not what was exported; one line."""


class AppleOnly(BackendError, Unavailable):
    """A Core ML package asked to run where Core ML does not exist."""


def require_coremltools(purpose: str):
    """coremltools (optional), imported without its import-time notices (unsupported scikit-learn/torch versions,
    the missing macOS-only runtime): a one-line MissingPackage without it."""
    with quiet_coremltools():
        return require("coremltools", purpose, install=INSTALL)


@contextlib.contextmanager
def quiet_coremltools():
    """coremltools logs warnings on import and conversion (versions it has not tested, int64 constants stored as
    int32, its runtime missing off macOS) and draws progress bars on stderr: hold those back meanwhile; what was
    said is logged at debug level."""
    logger = logging.getLogger("coremltools")
    level = logger.level
    logger.setLevel(logging.ERROR)
    said = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(said):
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.")
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            yield
    finally:
        logger.setLevel(level)
        if said.getvalue().strip():
            LOGGER.debug("coremltools said: %s", said.getvalue().strip()[-2000:])


# ------------------------------------------------------------------------------------------------ export

def check_options(config, device: torch.device) -> None:
    """Refuse the flags a CoreML export cannot honour, before any slow work (``config``: export.ExportConfig)."""
    if config.dynamic:
        raise ArgumentError("--include coreml: the package has a fixed input shape here (flexible shapes cannot be "
                            "checked off Apple platforms); export without --dynamic")
    if getattr(config, "int8", False):
        raise ArgumentError("--include coreml --int8: not supported (an int8 package cannot be run off Apple "
                            "platforms to measure it); export fp32 or --half")
    if device.type != "cpu":
        raise UnavailableOption(f"--include coreml converts on the CPU: use --device cpu (not {device.type})")
    require_coremltools("--include coreml")


def export(graph: nn.Module, example: torch.Tensor, info: ExportInfo, path: Path, half: bool = False) -> Path:
    """Convert ``graph`` to an ML Program saved as a new hidden ``.mlpackage`` beside ``path``, opened back and
    checked (``check_package``) before it is returned; the caller moves it to ``path`` (``place``)."""
    ct = require_coremltools("--include coreml")
    check_target(path)  # before the slow conversion
    example = example.float().contiguous()
    with torch.no_grad():
        expected = tuple(graph(example).shape)
    with quiet_coremltools(), torch.no_grad():
        traced = torch.jit.trace(graph, example, strict=False)
        try:
            model = ct.convert(traced, source="pytorch", convert_to="mlprogram",
                               inputs=[ct.TensorType(name=INPUT, shape=tuple(example.shape))],
                               outputs=[ct.TensorType(name=OUTPUT)], minimum_deployment_target=ct.target.iOS15,
                               compute_precision=ct.precision.FLOAT16 if half else ct.precision.FLOAT32)
        except Exception as error:  # coremltools raises ValueError, RuntimeError, NotImplementedError and its own
            raise CoreMLError(f"coremltools could not convert the model ({reason(error)})") from None
    model.short_description = f"yolo-trainer detector: {info.nc} classes, decoded (batch, N, 5 + nc) predictions"
    for key, value in info.to_dict().items():
        model.user_defined_metadata[key] = json.dumps(value)
    package = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.stem}.", suffix=SUFFIX))
    try:
        with quiet_coremltools():
            model.save(str(package))
        check_package(package, info, tuple(example.shape), expected, name=path)
    except BaseException:
        shutil.rmtree(package, ignore_errors=True)
        raise
    finally:
        drop_temp_package(model)
    return package


def drop_temp_package(model) -> None:
    """coremltools keeps each converted package in the system temp folder until the process exits: remove ours."""
    temp = getattr(model, "package_path", None)
    if getattr(model, "is_temp_package", False) and temp and Path(temp).is_dir():
        shutil.rmtree(temp, ignore_errors=True)


def check_package(package: Path, info: ExportInfo, input_shape: tuple, output_shape: tuple, name=None) -> str:
    """Open ``package`` from disk with coremltools (its specification; nothing is compiled) and check it against
    the export: an ML Program, input ``images`` and output ``output0`` float32 of ``input_shape`` and
    ``output_shape``, the metadata read back equal to ``info``, fp16 tensors in the program exactly when
    ``info.half``. ``name``: what the package is to be called (messages). Returns the summary it logged."""
    name = Path(name or package)
    spec, metadata = read_package(package)
    found = describe(spec)
    wanted = ((INPUT, "FLOAT32", list(input_shape)), (OUTPUT, "FLOAT32", list(output_shape)))
    if found != wanted:
        raise CoreMLError(f"{name}: the Core ML package has input {found[0]} and output {found[1]}, exported as "
                          f"{wanted[0]} and {wanted[1]}; not written")
    read = parse_info(metadata, str(name), list(input_shape))
    if read.to_dict() != info.to_dict():
        raise CoreMLError(f"{name}: the metadata read back ({read.to_dict()}) differs from the export's; not written")
    fp16 = count_fp16_tensors(spec)
    if bool(fp16) != info.half:
        raise CoreMLError(f"{name}: the Core ML program has {fp16} fp16 tensors, exported "
                          f"{'with' if info.half else 'without'} --half; not written")
    summary = (f"{name.name} opened with coremltools: ML Program (spec {spec.specificationVersion}), "
               f"{'fp16' if fp16 else 'fp32'} compute, {INPUT} {'x'.join(map(str, input_shape))} -> {OUTPUT} "
               f"{'x'.join(map(str, output_shape))} float32, metadata {read.nc} classes, stride {read.stride}, "
               f"imgsz {'x'.join(map(str, read.imgsz))}")
    LOGGER.info("CoreML check: %s", summary)
    return summary


def count_fp16_tensors(spec) -> int:
    """Operation outputs of type fp16 in the program (0 for an fp32 conversion; most of them under --half)."""
    from coremltools.proto import MIL_pb2

    fp16 = MIL_pb2.DataType.FLOAT16
    return sum(output.type.tensorType.dataType == fp16
               for function in spec.mlProgram.functions.values()
               for block in function.block_specializations.values()
               for operation in block.operations for output in operation.outputs)


def describe(spec) -> tuple:
    """((name, data type, shape) of the one input, of the first output) of a model specification."""
    if len(spec.description.input) != 1 or not spec.description.output:
        return (f"{len(spec.description.input)} inputs", "", []), (f"{len(spec.description.output)} outputs", "", [])
    return tuple(_feature(feature) for feature in (spec.description.input[0], spec.description.output[0]))


def _feature(feature) -> tuple:
    from coremltools.proto import FeatureTypes_pb2

    array = feature.type.multiArrayType
    kind = FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name(array.dataType) if feature.type.HasField(
        "multiArrayType") else feature.type.WhichOneof("Type") or "none"
    return feature.name, kind, list(array.shape)


def read_package(package: Path) -> tuple:
    """(specification, metadata dict) of the ``.mlpackage`` folder ``package``, read with coremltools without
    compiling it; a one-line BackendError for what is not a readable ML Program package."""
    package = Path(package)
    if not (package / "Manifest.json").is_file():
        raise BackendError(f"{package}: not a Core ML package (no Manifest.json inside)")
    ct = require_coremltools(f"reading {package.name}")
    try:
        with quiet_coremltools():
            spec = ct.utils.load_spec(str(package))
    except Exception as error:  # protobuf's DecodeError, coremltools' own, OSError for missing parts
        raise BackendError(f"{package}: not a readable Core ML package ({reason(error)})") from None
    if spec.WhichOneof("Type") != "mlProgram" or spec.specificationVersion < MIN_SPEC_VERSION:
        raise BackendError(f"{package}: not an ML Program package (a {spec.WhichOneof('Type')} model, spec "
                           f"{spec.specificationVersion}); export it with export.py --include coreml")
    weights = package / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    if not weights.is_file():
        raise BackendError(f"{package}: not a readable Core ML package (its weights file {weights.name} is missing)")
    metadata = dict(spec.description.metadata.userDefined)
    if sum(len(key) + len(value) for key, value in metadata.items()) > MAX_METADATA_CHARS:
        raise BackendError(f"{package}: its user-defined metadata holds more than {MAX_METADATA_CHARS:,} characters")
    return spec, {key: json_or_text(value) for key, value in metadata.items() if key in METADATA_KEYS}


def reason(error: Exception) -> str:
    """The last informative line of a coremltools exception, cut to 200 characters."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1][:200] if lines else type(error).__name__


def check_target(path: Path) -> None:
    """``path`` may be replaced: absent, or an earlier Core ML package (not a link, a file or another folder)."""
    if path.is_symlink() or (path.exists() and not (path / "Manifest.json").is_file()):
        raise CoreMLError(f"{path}: exists and is not a Core ML package; move it away to export here")


def place(temp: Path, path: Path) -> None:
    """Give the checked package ``temp`` the name ``path``: a rename, or, over an earlier package, the old one moved
    aside first and removed after (a package is a folder tree, so it is replaced whole)."""
    check_target(path)
    from utils.files import new_mode

    os.chmod(temp, new_mode(folder=True))
    old = None
    if path.exists():
        old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old."))
        os.replace(path, old / path.name)
    os.replace(temp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ backend

def checked_backend(written: Path, info: ExportInfo, device):
    """What export.py's parity check runs: the backend on Apple platforms; elsewhere None, as ``export`` already
    opened the package back and checked its description (nothing can run it here)."""
    if sys.platform == "darwin":
        return CoreMLBackend(written, device)
    LOGGER.info("CoreML: no numeric parity check off Apple platforms (Core ML runs on macOS/iOS only)")
    return None


class CoreMLBackend(Backend):
    """A ``.mlpackage`` run by Core ML through coremltools (macOS only; one-line AppleOnly elsewhere)."""

    kind = "coreml"

    def __init__(self, path, device="cpu"):
        path = Path(path)
        if not (path / "Manifest.json").is_file():
            raise BackendError(f"{path}: not a Core ML package (no Manifest.json inside)")
        if sys.platform != "darwin":
            raise AppleOnly(f"CoreML runs on Apple platforms only (macOS/iOS): {path} cannot run on {sys.platform}; "
                            "export --include onnx, openvino or ncnn to run here")
        spec, metadata = read_package(path)
        (_, _, input_shape), _ = describe(spec)
        info = parse_info(metadata, str(path), input_shape or None)
        super().__init__(path, info, device)
        ct = require_coremltools(f"running {path.name}")
        try:
            with quiet_coremltools():
                self.model = ct.models.MLModel(str(path), compute_units=ct.ComputeUnit.CPU_ONLY)
        except Exception as error:
            raise BackendError(f"{path}: Core ML cannot load it ({reason(error)})") from None

    def _run(self, images: torch.Tensor) -> torch.Tensor:
        array = images.detach().to("cpu", torch.float32).contiguous().numpy()
        output = self.model.predict({INPUT: array})[OUTPUT]
        return torch.from_numpy(output.copy()).to(images.device).float()
