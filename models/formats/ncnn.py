"""NCNN: ``export.py --include ncnn`` and the backend that runs the result with the ``ncnn`` package.

Layout (YOLOv5's/Ultralytics' NCNN layout): ``<stem>_ncnn_model/`` holding ``model.ncnn.param`` (the graph, text),
``model.ncnn.bin`` (the weights) and ``metadata.yaml`` (``ExportInfo``, as the OpenVINO folder's ``<stem>.yaml``).

Export: the prediction graph is traced to TorchScript at batch 1 and converted by the ``pnnx`` program (the
PyPI wheel ships it as a binary; it is run as a subprocess on our own trace in a private temporary folder, never
its generated Python). The decode grids become constants of the export size, so an NCNN model has a fixed input
size: ``--dynamic`` is refused (pnnx 20261020 leaves the grid's ``torch.arange``/``meshgrid`` unconverted, and
ncnn cannot load the result). ncnn takes one image (C, H, W) at a time, so the metadata says batch 1 and the
backend runs a batch image by image. ``--half`` stores the weights in fp16 (half the file); ncnn then computes
in fp16 where the CPU has fp16 arithmetic (ARMv8.2) and in fp32 elsewhere (x86, which only converts the weights
on load). ``--int8`` (``<stem>-int8_ncnn_model/``) quantises the convolutions before the Detect layer, calibrated
on the train images of ``--data`` (models/formats/ncnn_int8.py: ncnn's int8 format written here, since ncnn's
own tools for it are not in the pip wheels).

Reading: the ``.param`` text is checked here (magic number, counts, one line per layer) before ncnn parses it,
and ncnn's own complaints (it prints them to stderr) are caught and reported as one BackendError line.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from models.backends import Backend, BackendError, ExportInfo, MissingPackage, parse_info
from models.formats.int8 import INT8_TOLERANCE, calibration_batches, calibration_files
from models.formats.int8 import parity_inputs  # noqa: F401  (export.py's parity check asks the module)
from utils.errors import ArgumentError, UnavailableOption, UserError

LOGGER = logging.getLogger(__name__)
FOLDER = "_ncnn_model"  # <stem>_ncnn_model/
PARAM, WEIGHTS, METADATA = "model.ncnn.param", "model.ncnn.bin", "metadata.yaml"
INSTALL = "pip install -r requirements-ncnn.txt"
PARAM_MAGIC = "7767517"  # the first line of every ncnn text .param file
MAX_PARAM_BYTES = 16 << 20  # yolov5x's graph is ~30 kB of text
MAX_LAYERS = 100_000
PNNX_SECONDS = 1_800  # pnnx converts yolov5s in a few seconds; a hung conversion is an error, not a wait forever
LAYER_TYPE = re.compile(r"[A-Za-z_][\w.:]*\Z")
EXPORT_OPTIONS = ("int8", "data")  # the ExportConfig fields export() takes besides half


class NcnnExportError(UserError):
    """pnnx could not convert the model; one line with its reason."""


def require(module: str, purpose: str):
    """Import ``ncnn`` or ``pnnx`` (optional) or raise a one-line MissingPackage with the install command."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackage(f"{purpose} needs the optional package '{module}': {INSTALL}") from None


# ------------------------------------------------------------------------------------------------ export

def check_options(config, device: torch.device) -> None:
    """Refuse the flags NCNN cannot honour, before any slow work (``config``: export.ExportConfig)."""
    if config.dynamic:
        raise ArgumentError("--include ncnn: NCNN models have a fixed input size (the decode grids become "
                            "constants; pnnx leaves the dynamic grid's arange/meshgrid to ops ncnn lacks); export "
                            "without --dynamic")
    if config.int8 and config.half:
        raise ArgumentError("--include ncnn: --int8 and --half are two precisions; pick one")
    if device.type != "cpu":
        raise UnavailableOption(f"--include ncnn exports and runs on the CPU: use --device cpu (not {device.type})")
    require("pnnx", "--include ncnn")
    require("ncnn", "--include ncnn (the parity check)")
    if config.int8:
        calibration_files(config.data)  # a missing or empty dataset is refused now, not after the conversion


def output_path(weights: Path, config) -> Path:
    """``best_ncnn_model``; ``best-int8_ncnn_model`` with --int8 (the LiteRT names' convention)."""
    return weights.with_name(f"{weights.stem}{'-int8' if config.int8 else ''}{FOLDER}")


def export(graph: nn.Module, example: torch.Tensor, info: ExportInfo, path: Path, half: bool = False,
           int8: bool = False, data: str | None = None) -> Path:
    """Convert ``graph`` (the decoded-prediction module) to NCNN in a new hidden folder beside ``path`` and return
    that folder (``model.ncnn.param``, ``model.ncnn.bin``, ``metadata.yaml``); the caller checks it and moves it.
    ``example``'s first image sets the fixed input size; ``half``: fp16 weights; ``int8``: int8 convolutions
    calibrated on the train images of ``data``."""
    import yaml

    if example.shape[0] > 1:
        LOGGER.info("NCNN takes one image at a time: exported for batch 1, batches of %d run image by image",
                    example.shape[0])
    if half:
        fp16 = require("ncnn", "--include ncnn").cpu_support_arm_asimdhp()
        LOGGER.info("NCNN --half: fp16 weights; %s", "fp16 arithmetic on this CPU" if fp16 else
                    "this CPU has no fp16 arithmetic, so ncnn computes in fp32 (the weights rounded to fp16)")
    folder = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        trace = folder / "model.torchscript"
        save_trace(graph, example[:1], trace)
        run_pnnx(trace, tuple(example.shape[1:]), folder, half)
        for item in folder.iterdir():  # pnnx's intermediate files (its own .param/.bin/.py/.onnx) and our trace
            if item.name not in (PARAM, WEIGHTS):
                shutil.rmtree(item) if item.is_dir() and not item.is_symlink() else item.unlink()
        if int8:
            quantise(folder, data, tuple(example.shape[2:]))
        values = dataclasses.replace(info, batch=1, dynamic=False, half=half).to_dict()
        (folder / METADATA).write_text(yaml.safe_dump(values, sort_keys=False, allow_unicode=True), encoding="utf-8")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def quantise(folder: Path, data: str, imgsz: tuple) -> None:
    """The fp32 model pnnx wrote in ``folder``, rewritten with int8 convolutions calibrated on ``data``'s train
    images (letterboxed to ``imgsz`` as for inference) run through that fp32 model."""
    import numpy as np

    from models.formats.ncnn_int8 import quantise_folder

    ncnn = require("ncnn", "--include ncnn --int8")
    net, input_name, _ = load_net(folder / PARAM, folder / WEIGHTS, half=False)

    def run_blobs(image: np.ndarray, blobs: list[str]) -> dict:
        with net.create_extractor() as extractor:
            extractor.input(input_name, ncnn.Mat(image).clone())
            values = {}
            for blob in blobs:
                status, value = extractor.extract(blob)
                if status != 0:
                    raise NcnnExportError(f"NCNN --int8: ncnn could not compute blob {blob} (status {status})")
                values[blob] = np.array(value)
            return values

    def images():
        for batch in calibration_batches(data, imgsz, 1):
            yield np.ascontiguousarray(batch[0].numpy())

    quantise_folder(folder, PARAM, WEIGHTS, run_blobs, images)


def save_trace(graph: nn.Module, example: torch.Tensor, file: Path) -> None:
    """The TorchScript trace pnnx reads (no metadata: pnnx ignores it)."""
    with warnings.catch_warnings():  # the tracer's notes on Python values and torch.jit's deprecation notice
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.")
        with torch.no_grad():
            module = torch.jit.trace(graph, example.float().contiguous(), strict=False)
        buffer = io.BytesIO()
        torch.jit.save(module, buffer)
    file.write_bytes(buffer.getvalue())


def run_pnnx(trace: Path, chw: tuple, folder: Path, half: bool) -> None:
    """Run the pnnx program on ``trace`` with every output named inside ``folder`` (its working folder)."""
    pnnx = require("pnnx", "--include ncnn")
    program = Path(pnnx.EXEC_PATH)
    if not os.access(program, os.X_OK):
        raise NcnnExportError(f"{program}: the pnnx program is missing or not executable (reinstall: {INSTALL})")
    channels, height, width = chw
    outputs = {"ncnnparam": PARAM, "ncnnbin": WEIGHTS, "ncnnpy": "model_ncnn.py", "pnnxparam": "model.pnnx.param",
               "pnnxbin": "model.pnnx.bin", "pnnxpy": "model_pnnx.py", "pnnxonnx": "model.pnnx.onnx"}
    command = [str(program), trace.name, f"inputshape=[1,{channels},{height},{width}]f32", "device=cpu",
               f"fp16={int(half)}", *(f"{key}={name}" for key, name in outputs.items())]
    try:
        result = subprocess.run(command, cwd=folder, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                errors="replace", timeout=PNNX_SECONDS)
    except subprocess.TimeoutExpired:
        raise NcnnExportError(f"pnnx did not finish converting {trace.name} in {PNNX_SECONDS} s") from None
    if result.returncode != 0 or not (folder / PARAM).is_file() or not (folder / WEIGHTS).is_file():
        lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        reason = lines[-1][:200] if lines else f"exit status {result.returncode}"
        raise NcnnExportError(f"pnnx could not convert the model to NCNN ({reason})")


# ------------------------------------------------------------------------------------------------ backend

def is_ncnn_folder(path) -> bool:
    """A folder holding ``model.ncnn.param`` (what tells an NCNN folder from an OpenVINO one)."""
    return (Path(path) / PARAM).is_file()


def ncnn_files(path) -> tuple[Path, Path, Path]:
    """(param, weights, metadata) for the folder ``path`` or its ``model.ncnn.param``."""
    path = Path(path)
    folder = path.parent if path.is_file() else path
    param = path if path.is_file() else path / PARAM
    if not param.is_file():
        raise BackendError(f"{path}: a folder without an NCNN model ({PARAM}); pass an export.py _ncnn_model folder")
    weights = param.with_name(param.name.removesuffix(".param") + ".bin")
    if not weights.is_file():
        raise BackendError(f"{param}: no weights file {weights.name} beside it")
    return param, weights, folder / METADATA


def check_param(param: Path) -> None:
    """The .param text's lines, checked for ncnn's structure before ncnn reads it (ncnn prints its parse
    errors to stderr and would allocate whatever counts the header states): a BackendError naming the fault."""
    from utils.files import FileTooLarge, read_regular

    def refuse(reason: str):
        raise BackendError(f"{param}: not an NCNN model ({reason})")

    try:
        data = read_regular(param, MAX_PARAM_BYTES)
    except FileTooLarge:
        refuse(f"larger than {MAX_PARAM_BYTES >> 20} MB")
    except OSError as error:
        raise BackendError(f"{param}: cannot read it ({error.strerror or error})") from None
    try:
        lines = [line.split() for line in data.decode("ascii").splitlines() if line.strip()]
    except UnicodeDecodeError:
        refuse("not a text .param file")
    if not lines or lines[0] != [PARAM_MAGIC]:
        refuse(f"no {PARAM_MAGIC} magic number on the first line")
    if len(lines) < 2 or len(lines[1]) != 2 or not all(word.isdecimal() for word in lines[1]):
        refuse("the second line must be '<layer count> <blob count>'")
    layer_count, blob_count = (int(word) for word in lines[1])
    if not 1 <= layer_count <= MAX_LAYERS or not 1 <= blob_count <= 4 * MAX_LAYERS:
        refuse(f"{layer_count} layers and {blob_count} blobs")
    if len(lines) - 2 != layer_count:
        refuse(f"the header says {layer_count} layers, the file has {len(lines) - 2} layer lines")
    for number, words in enumerate(lines[2:], start=3):
        counts = words[2:4]
        if (len(words) < 4 or not LAYER_TYPE.match(words[0]) or not all(word.isdecimal() for word in counts)
                or len(words) < 4 + sum(int(word) for word in counts)):
            refuse(f"line {number} is not '<type> <name> <inputs> <outputs> <blobs...> <params...>'")


@contextmanager
def captured_stderr():
    """Collect what C code writes to file descriptor 2 meanwhile (ncnn's load errors) into ``lines``."""
    import sys

    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(line.strip() for line in sink.read(65_536).decode("utf-8", "replace").splitlines()
                         if line.strip())


class NcnnBackend(Backend):
    """An NCNN folder run by the optional ``ncnn`` package on the CPU, one image at a time, on as many threads as
    torch uses; fp32 files in fp32 (ncnn's fp16 storage and arithmetic off), --half files with ncnn's defaults,
    --int8 files with their int8 convolutions in int8."""

    kind = "ncnn"

    def __init__(self, path, device="cpu"):
        param, weights, metadata = ncnn_files(path)
        check_param(param)
        values = read_metadata(metadata, param)
        info = parse_info(values, str(metadata))
        ncnn = require("ncnn", f"running {Path(path).name}")
        if torch.device(device).type != "cpu":
            LOGGER.warning("WARNING: NCNN models run on the CPU here; running %s on the CPU", Path(path).name)
        super().__init__(path, info, device)
        self.parity_tolerance = INT8_TOLERANCE if info.int8 else None  # read by export.py's parity check
        self.net, self.input_name, self.output_name = load_net(param, weights, info.half)
        self.ncnn = ncnn

    def _run(self, images: torch.Tensor) -> torch.Tensor:
        return torch.stack([self._run_one(image) for image in images.detach().to("cpu", torch.float32)])

    def _run_one(self, image: torch.Tensor) -> torch.Tensor:
        """One (C, H, W) image -> its (N, 5 + nc) predictions."""
        import numpy as np

        array = np.ascontiguousarray(image.numpy())
        with self.net.create_extractor() as extractor:
            extractor.input(self.input_name, self.ncnn.Mat(array).clone())
            status, output = extractor.extract(self.output_name)
            result = np.array(output)
        if status != 0 or result.ndim != 2 or result.shape[1] != 5 + self.info.nc:
            raise BackendError(f"{self.path}: the NCNN model gave an output of shape {list(result.shape)} (status "
                               f"{status}), not (N, {5 + self.info.nc}) for {self.info.nc} classes")
        return torch.from_numpy(result)


def load_net(param: Path, weights: Path, half: bool):
    """(net, input name, output name): the model loaded by ncnn for the CPU, on as many threads as torch uses; fp32
    (ncnn's fp16 storage and arithmetic off) unless ``half``; int8 layers run in int8 (ncnn's default)."""
    ncnn = require("ncnn", f"running {param.parent.name}")
    net = ncnn.Net()
    net.opt.num_threads = torch.get_num_threads()
    net.opt.use_vulkan_compute = False
    for option in ("use_fp16_storage", "use_fp16_packed", "use_fp16_arithmetic"):
        setattr(net.opt, option, half)
    net.opt.use_bf16_storage = False
    with captured_stderr() as complaints:
        status = net.load_param(str(param))
        status = status or net.load_model(str(weights))
    if status != 0:
        reason = complaints[0][:200] if complaints else "ncnn could not read it"
        raise BackendError(f"{param.parent}: not a readable NCNN model ({reason})")
    inputs, outputs = list(net.input_names()), list(net.output_names())
    if len(inputs) != 1 or not outputs:
        raise BackendError(f"{param}: expected one input (images) and an output, found {len(inputs)} inputs and "
                           f"{len(outputs)} outputs")
    return net, inputs[0], outputs[0]


def read_metadata(metadata: Path, param: Path) -> dict:
    """``metadata.yaml`` beside the model, read with the bounded YAML reader."""
    import yaml

    from utils.safe_yaml import read_yaml, yaml_reason

    if not metadata.is_file():
        raise BackendError(f"{param}: no metadata file {metadata.name} beside it (export.py writes it with the model)")
    try:
        return read_yaml(metadata)
    except OSError as error:
        raise BackendError(f"{metadata}: cannot read it ({error.strerror or error})") from None
    except yaml.YAMLError as error:
        raise BackendError(f"{metadata}: not valid YAML ({yaml_reason(error)})") from None


def checked_backend(written: Path, info: ExportInfo, device) -> NcnnBackend:
    """The backend export.py's parity check runs on the folder it just wrote."""
    return NcnnBackend(written, device)

