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

Reading: ncnn prints what it cannot parse to stderr (its C++ code writes to file descriptor 2; ncnn has no switch
to silence it), so what it would complain about is refused here first, as one BackendError line: the ``.param``
text is checked (magic number, counts, one line per layer, ``key=value`` words as ncnn's ParamDict reads them,
layer types ncnn knows, every input blob made by an earlier layer), and the ``.bin`` is fed to ncnn through a
reader of ours (``weights_reader``) that notes a file shorter or longer than the weights ncnn reads, instead of
letting ncnn fail on a short read. Nothing redirects the process's stderr (another thread's errors stay
visible); what ncnn might still print for a file that passes these checks is left on stderr.
"""
from __future__ import annotations

import ctypes
import dataclasses
import io
import logging
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from models.backends import Backend, BackendError, ExportInfo, parse_info, read_metadata_yaml, require
from models.formats.int8 import calibration_batches, calibration_files
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
# A .param line's parameter words as ncnn's ParamDict reads them: ``id=value`` (id 0-31, a value of at most 15
# characters) or an array ``-(23300 + id)=count,item,...``; a number is a float when it holds '.', 'e' or 'E'.
MAX_PARAM_ID, ARRAY_BASE, MAX_VALUE_CHARS = 32, 23300, 15
PARAM_WORD = re.compile(r"(-?\d+)=(\S+)\Z")
NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\Z")
EXPORT_OPTIONS = ("int8", "data")  # the ExportConfig fields export() takes besides half


class NcnnExportError(UserError):
    """pnnx could not convert the model; one line with its reason."""


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
    require("pnnx", "--include ncnn", install=INSTALL)
    require("ncnn", "--include ncnn (the parity check)", install=INSTALL)
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
        fp16 = require("ncnn", "--include ncnn", install=INSTALL).cpu_support_arm_asimdhp()
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

    ncnn = require("ncnn", "--include ncnn --int8", install=INSTALL)
    net, input_name, _ = load_net(folder / PARAM, folder / WEIGHTS, half=False, layer_types=check_param(folder / PARAM))

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
    pnnx = require("pnnx", "--include ncnn", install=INSTALL)
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


def check_param(param: Path) -> list[str]:
    """The .param text checked as ncnn will read it, before it does (ncnn prints its parse errors to stderr and
    would allocate whatever counts the header states): a BackendError naming the fault. Returns the layer types
    (load_net checks that ncnn knows them)."""
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
    blobs: set[str] = set()
    for number, words in enumerate(lines[2:], start=3):
        counts = words[2:4]
        if (len(words) < 4 or not LAYER_TYPE.match(words[0]) or not all(word.isdecimal() for word in counts)
                or len(words) < 4 + sum(int(word) for word in counts) or max(map(len, words)) > 255):
            refuse(f"line {number} is not '<type> <name> <inputs> <outputs> <blobs...> <params...>'")
        inputs, outputs = int(counts[0]), int(counts[1])
        names = words[4:4 + inputs + outputs]
        missing = [name for name in names[:inputs] if name not in blobs]
        if missing:
            refuse(f"line {number} reads blob {missing[0]}, which no earlier layer makes")
        if any(name in blobs for name in names[inputs:]) or len(set(names[inputs:])) != outputs:
            refuse(f"line {number} makes a blob that already exists")
        blobs.update(names[inputs:])
        for word in words[4 + inputs + outputs:]:
            if not param_word_ok(word):
                refuse(f"line {number} has a parameter ncnn cannot read: {word[:40]}")
    if len(blobs) > blob_count:
        refuse(f"the header says {blob_count} blobs, the layers make {len(blobs)}")
    return [words[0] for words in lines[2:]]


def param_word_ok(word: str) -> bool:
    """One ``key=value`` word as ncnn's ParamDict parses it (PARAM_WORD): a scalar id below MAX_PARAM_ID with a
    number of at most MAX_VALUE_CHARS characters, or an array id with its stated count of such numbers."""
    match = PARAM_WORD.match(word)
    if not match:
        return False
    key, value = int(match[1]), match[2]
    if key >= 0:
        return key < MAX_PARAM_ID and len(value) <= MAX_VALUE_CHARS and bool(NUMBER.match(value))
    count, *items = value.split(",")
    return (0 <= -key - ARRAY_BASE < MAX_PARAM_ID and count.isdecimal() and int(count) == len(items)
            and all(len(item) <= MAX_VALUE_CHARS and NUMBER.match(item) for item in items))


def weights_reader(ncnn, file):
    """An ``ncnn.DataReader`` that fills ncnn's buffers from the open ``file``: a read past the end is filled with
    zeros and counted in ``short`` (ncnn would print "ModelBin read weight_data failed" to stderr and fail), so
    the loader can refuse a truncated file in its own words. ncnn hands each buffer over as a capsule; its address
    comes from a prototype of our own of PyCapsule_GetPointer (ctypes.pythonapi's shared one is left as it is)."""
    capsule_address = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi))

    class WeightsReader(ncnn.DataReader):
        def __init__(self):
            super().__init__()
            self.short = 0  # bytes asked for beyond the end of the file

        def read(self, buffer, size: int) -> int:
            address = capsule_address(buffer, None)
            got = file.readinto(memoryview((ctypes.c_char * size).from_address(address)).cast("B")) if size else 0
            if got < size:
                ctypes.memset(address + got, 0, size - got)
                self.short += size - got
            return size

    return WeightsReader()


class NcnnBackend(Backend):
    """An NCNN folder run by the optional ``ncnn`` package on the CPU, one image at a time, on as many threads as
    torch uses; fp32 files in fp32 (ncnn's fp16 storage and arithmetic off), --half files with ncnn's defaults,
    --int8 files with their int8 convolutions in int8."""

    kind = "ncnn"

    def __init__(self, path, device="cpu"):
        param, weights, metadata = ncnn_files(path)
        layer_types = check_param(param)
        info = parse_info(read_metadata_yaml(metadata, param), str(metadata))
        ncnn = require("ncnn", f"running {Path(path).name}", install=INSTALL)
        if torch.device(device).type != "cpu":
            LOGGER.warning("WARNING: NCNN models run on the CPU here; running %s on the CPU", Path(path).name)
        super().__init__(path, info, device)
        self.net, self.input_name, self.output_name = load_net(param, weights, info.half, layer_types)
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


def load_net(param: Path, weights: Path, half: bool, layer_types: list[str]):
    """(net, input name, output name): the model loaded by ncnn for the CPU, on as many threads as torch uses; fp32
    (ncnn's fp16 storage and arithmetic off) unless ``half``; int8 layers run in int8 (ncnn's default).
    ``layer_types``: what check_param returned for ``param``; the weights go through ``weights_reader``."""
    ncnn = require("ncnn", f"running {param.parent.name}", install=INSTALL)
    unknown = sorted({name for name in layer_types if ncnn.layer_to_index(name) < 0})
    if unknown:
        raise BackendError(f"{param}: not an NCNN model this ncnn can run (layer type {unknown[0]} unknown to it)")
    net = ncnn.Net()
    net.opt.num_threads = torch.get_num_threads()
    net.opt.use_vulkan_compute = False
    for option in ("use_fp16_storage", "use_fp16_packed", "use_fp16_arithmetic"):
        setattr(net.opt, option, half)
    net.opt.use_bf16_storage = False
    if net.load_param(str(param)) != 0:  # what check_param did not foresee; ncnn printed its reason to stderr
        raise BackendError(f"{param.parent}: not a readable NCNN model (ncnn could not read {param.name})")
    try:
        with open(weights, "rb") as file:
            reader = weights_reader(ncnn, file)
            status = net.load_model(reader)
            used, size = file.tell() + reader.short, os.fstat(file.fileno()).st_size
    except OSError as error:
        raise BackendError(f"{weights}: cannot read it ({error.strerror or error})") from None
    if used != size:
        raise BackendError(f"{param.parent}: not a readable NCNN model ({weights.name} holds {size:,} bytes, the "
                           f"layers of {param.name} read {used:,})")
    if status != 0:
        raise BackendError(f"{param.parent}: not a readable NCNN model (ncnn could not load {weights.name})")
    inputs, outputs = list(net.input_names()), list(net.output_names())
    if len(inputs) != 1 or not outputs:
        raise BackendError(f"{param}: expected one input (images) and an output, found {len(inputs)} inputs and "
                           f"{len(outputs)} outputs")
    return net, inputs[0], outputs[0]


def checked_backend(written: Path, info: ExportInfo, device) -> NcnnBackend:
    """The backend export.py's parity check runs on the folder it just wrote."""
    return NcnnBackend(written, device)

