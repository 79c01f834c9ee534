"""Export a checkpoint to TorchScript, ONNX and/or OpenVINO, beside the weights (YOLOv5 export.py flags).

    python export.py --weights runs/train/exp/weights/best.pt --include torchscript onnx openvino
    python export.py --weights best.pt --include onnx --dynamic            # any batch and image size
    python export.py --weights best.pt --include onnx --imgsz 320 --batch-size 8
    python export.py --weights best.pt --include openvino --half           # fp16 weights, runs on the CPU

Writes ``best.torchscript`` / ``best.onnx`` / ``best_openvino_model/`` (``best.xml``, ``best.bin`` and
``best.yaml``, YOLOv5's layout) next to ``best.pt``, each holding its metadata (names, stride, input size,
batch, dynamic, nc, format version; see models/export_info.py) so val.py and detect.py take it as
``--weights``. The exported model returns the decoded ``(batch, N, 5 + nc)`` output that NMS takes.
ONNX and OpenVINO need the optional packages in requirements-export.txt. OpenVINO IR is converted from
the ONNX graph (as YOLOv5 does) on the CPU; ``--half`` stores its weights in fp16 (half the size; the
CPU still computes in fp32) and needs no GPU, unlike ``--half`` for TorchScript and ONNX.
Further formats live in models/formats/ (FORMAT_MODULES), each with its own requirements file:
``--include ncnn`` writes ``best_ncnn_model/`` (``best-int8_ncnn_model/`` with ``--int8``;
requirements-ncnn.txt) and ``--include coreml`` writes
``best.mlpackage`` (requirements-coreml.txt; Core ML runs on Apple platforms only, so elsewhere its check
opens the written package back instead of running it).
``--include executorch`` writes ``best.pte`` or ``best-int8.pte`` with ``--int8`` (XNNPACK;
requirements-executorch.txt) and ``--include litert`` (YOLOv5's ``tflite``) writes ``best.tflite``,
``best-fp16.tflite`` with ``--half`` or ``best-int8.tflite`` with ``--int8`` (requirements-litert.txt), both
fixed-shape. ``--int8`` is calibrated on the train images of ``--data`` (models/formats/int8.py).
``--include engine`` takes YOLOv5's ``--workspace`` (GB) and ``--verbose`` (TensorRT's log). Every other flag of
YOLOv5 v7.0's export.py is accepted: ``--inplace`` changes nothing (the output is the same), ``--keras``, ``--nms``
and ``--agnostic-nms`` (its TensorFlow formats only) are refused in one line, and its NMS settings do nothing
without ``--nms``, as there (TENSORFLOW_FLAGS).

Each file is checked before it is kept: the exported model is loaded back and run on the same random
input as the PyTorch model (and, for ``--dynamic``, on a second batch and image size); the largest
difference above ``TOLERANCE`` of the output's scale is an error (exit 1) and nothing is written.
An ``--int8`` file (any format) is checked on its first calibration images instead, by its detections
(models/formats/int8.py: compare_detections); ``compare_output`` is where the check is chosen.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models.backends import (BACKENDS, OPENVINO_FOLDER, TORCHSCRIPT_METADATA, ExportInfo, first_line,  # noqa: E402
                             import_openvino, openvino_reason, require)
from utils.cli import ArgumentParser, add_device_flag, positive_int  # noqa: E402
from utils.errors import ArgumentError, UnavailableOption, UserError  # noqa: E402
from utils.files import AtomicFile  # noqa: E402
from utils.limits import MAX_BATCH_SIZE, MAX_IMAGE_SIZE  # noqa: E402

LOGGER = logging.getLogger("export")
SUFFIXES = {"torchscript": ".torchscript", "onnx": ".onnx", "openvino": OPENVINO_FOLDER}  # OpenVINO: a folder
TITLES = {"torchscript": "TorchScript", "onnx": "ONNX", "openvino": "OpenVINO"}
# Formats whose export, check and backend live in their own module (models/formats/<name>.py), imported only
# when the format is asked for: each has check_options(config, device), export(graph, example, info, path, half)
# -> a temp file or folder beside path, checked_backend(written, info, device) and optionally place(temp, path).
# Optional too: EXPORT_OPTIONS (ExportConfig fields export() also takes as keywords), output_path(weights, config)
# (a name of its own). An --int8 export is checked by compare_output's int8 check, whatever its format.
FORMAT_MODULES = {"ncnn": "models.formats.ncnn"}
SUFFIXES["ncnn"], TITLES["ncnn"] = "_ncnn_model", "NCNN"  # a folder: model.ncnn.param/.bin, metadata.yaml
FORMAT_MODULES["coreml"] = "models.formats.coreml"
SUFFIXES["coreml"], TITLES["coreml"] = ".mlpackage", "CoreML"  # a package folder; runs on Apple platforms only
FORMAT_MODULES["engine"] = "models.formats.engine"
SUFFIXES["engine"], TITLES["engine"] = ".engine", "TensorRT"  # metadata header + serialized engine; GPU only
FORMAT_MODULES["executorch"] = "models.formats.executorch"
SUFFIXES["executorch"], TITLES["executorch"] = ".pte", "ExecuTorch"  # XNNPACK program, metadata method inside
FORMAT_MODULES["litert"] = "models.formats.litert"
SUFFIXES["litert"], TITLES["litert"] = ".tflite", "LiteRT"  # -fp16/-int8.tflite with --half/--int8; NHWC input
ALIASES = {"tflite": "litert"}  # YOLOv5's names for the same formats
RUNS_ELSEWHERE = {"coreml": "runs on macOS/iOS (Core ML); val.py and detect.py run it there",
                  "engine": "runs where it was built (this GPU, this TensorRT): val.py/detect.py --device 0"}
INT8_FORMATS = {"ncnn", "executorch", "litert"}  # --int8 quantises these; the others export float beside them
CPU_HALF = {"openvino", "ncnn", "coreml", "litert"}  # --half is fp16 weights (CoreML: fp16 compute), made on the CPU
# YOLOv5's flags for its TensorFlow exports (saved_model, pb, tflite, edgetpu, tfjs), which this project does not
# make: set, each is refused in one line (check_tensorflow_flags). Its NMS settings (--topk-per-class, --topk-all,
# --iou-thres, --conf-thres) only apply with --nms, so alone they are accepted and change nothing, as in YOLOv5.
TENSORFLOW_FLAGS = {"keras": "--keras", "nms": "--nms", "agnostic_nms": "--agnostic-nms"}
OPSETS = range(11, 21)  # Range/Resize need 11; 20 is the TorchScript-based ONNX exporter's newest
# Largest allowed |exported - PyTorch| as a fraction of the output's scale: the input's longest side for
# the box columns (pixels), 1 for objectness and class scores. fp32 rounding differences between
# kernels stay near 1e-6 of the scale; 1e-3 leaves room for that and still catches a real fault (half a
# cell's offset at stride 8 is 4 px, 6e-3 of 640). fp16 keeps ~3 significant digits, hence 1e-2.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2}


class ExportError(UserError):
    """A flag or file export.py cannot use; one line naming it."""


class ParityError(RuntimeError):
    """The exported model's output differs from the PyTorch model's beyond the tolerance."""


class ExportFailures(ExportError):
    """Formats of one checkpoint that failed while the others were exported (as YOLOv5 goes on past a failed
    format): ``failures`` holds (format, error) in order, ``results`` what was written. The message is the errors'
    own lines (each names its file and reason), joined."""

    def __init__(self, failures: list[tuple[str, Exception]], results: list[ExportResult]):
        super().__init__("; ".join(str(error) for _, error in failures))
        self.failures, self.results = failures, results


@dataclass
class ExportConfig:
    weights: str = "yolov5s.pt"
    imgsz: tuple = (640, 640)  # (height, width)
    batch_size: int = 1
    include: tuple = ("torchscript",)
    device: str = "cpu"
    half: bool = False
    dynamic: bool = False
    simplify: bool = False
    opset: int = 17
    optimize: bool = False
    int8: bool = False  # NCNN, ExecuTorch, LiteRT: int8 weights and activations, calibrated on images of --data
    data: str = "data/coco128.yaml"  # the dataset YAML whose train images calibrate --int8 (YOLOv5's default)
    workspace: int = 4  # TensorRT (--include engine): the builder's workspace memory-pool limit, GB (YOLOv5's default)
    verbose: bool = False  # TensorRT: the builder logs at VERBOSE instead of WARNING
    inplace: bool = False  # YOLOv5's Detect(inplace=True): accepted; the exported output is the same either way
    # YOLOv5's TensorFlow-only options (TENSORFLOW_FLAGS): keras, nms and agnostic_nms are refused when set; the NMS
    # settings below are YOLOv5's defaults and do nothing without --nms, as there
    keras: bool = False
    nms: bool = False
    agnostic_nms: bool = False
    topk_per_class: int = 100
    topk_all: int = 100
    iou_thres: float = 0.45
    conf_thres: float = 0.25


@dataclass
class Parity:
    shape: tuple
    box_pixels: float  # max |diff| of the box columns, pixels
    scores: float  # max |diff| of objectness and class scores
    box_limit: float
    score_limit: float

    @property
    def ok(self) -> bool:
        return self.box_pixels <= self.box_limit and self.scores <= self.score_limit

    def describe(self) -> str:
        shape = "x".join(str(s) for s in self.shape)
        return (f"max |diff| {self.box_pixels:.3g} px (boxes), {self.scores:.3g} (scores) at {shape}; "
                f"tolerance {self.box_limit:.3g} px, {self.score_limit:.3g}")


@dataclass
class ExportResult:
    format: str
    path: Path
    megabytes: float
    seconds: float
    parity: list = field(default_factory=list)

    def __fspath__(self) -> str:  # YOLOv5's export.run returns the files' paths: ``val.run(weights=results[-1])``
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)


class PredictionOnly(nn.Module):
    """The exported graph: the eval-mode model's decoded output alone (the raw maps are for the loss)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images):
        return self.model(images)[0]


def run(config: ExportConfig | None = None, **options) -> list[ExportResult]:
    """Export ``config.weights`` to each format in ``config.include``; returns what was written. Or, as YOLOv5's
    ``export.run(weights="best.pt", include=("onnx",), imgsz=(640, 640))``: keywords named like export.py's flags,
    with its defaults and checks (utils/api.py), each of several weights in turn; each result is also the exported
    file's path (``str(result)``, ``Path(result)``), as YOLOv5 returns the paths."""
    if config is None:
        from utils.api import api_call, keyword_argv

        args = build_parser().parse_args(keyword_argv(build_parser(), options))
        with api_call():
            return [result for weights in args.weights for result in run(config_from_args(args, weights))]
    if options:
        raise TypeError(f"export.run: pass an ExportConfig or keywords, not both ({', '.join(options)})")
    from models import for_inference, load_model
    from utils.device import select_device

    formats = check_formats(config.include)
    check_tensorflow_flags(config)
    from utils.downloads import weights_file

    weights = weights_file(config.weights)  # a URL or a YOLOv5 release name is downloaded first
    if not weights.is_file():
        raise ExportError(f"{weights}: weights file not found (--weights)")
    check_writable(weights.parent)
    device = select_device(config.device)
    check_options(config, formats, device)
    model = for_inference(load_model(weights, device=device))
    if config.half and device.type == "cuda":  # on the CPU --half is OpenVINO's fp16 weights, converted at the end
        model.half()
    stride = int(model.stride.max())
    info = ExportInfo(names=tuple(model.names), stride=stride, imgsz=round_size(config.imgsz, stride),
                      batch=config.batch_size, dynamic=config.dynamic, half=config.half, int8=config.int8,
                      channels_last=True, device=device.type)
    LOGGER.info("Exporting %s (%d classes, stride %d) at %s, batch %d%s", weights, info.nc, stride,
                "x".join(map(str, info.imgsz)), info.batch, ", dynamic" if info.dynamic else "")
    exporter = Exporter(model, info, device, config)
    results, failures = [], []
    for index, fmt in enumerate(formats):  # as YOLOv5: a format that fails is reported and the rest are exported
        try:
            results.append(exporter.export(fmt, output_path(weights, fmt, config)))
        except (UserError, ParityError) as error:  # a converter's or the parity check's verdict, one line each
            failures.append((fmt, error))
            if index + 1 < len(formats):
                LOGGER.error("%s: export failed: %s; going on with %s", TITLES[fmt], error,
                             ", ".join(TITLES[rest] for rest in formats[index + 1:]))
    if failures:
        raise ExportFailures(failures, results)
    return results


def output_path(weights: Path, fmt: str, config: ExportConfig | None = None) -> Path:
    """``best.torchscript`` / ``best.onnx`` / the folder ``best_openvino_model`` beside ``best.pt`` (a format
    module may name its own, e.g. ``best-int8.tflite``)."""
    if fmt in FORMAT_MODULES and config is not None and hasattr(format_module(fmt), "output_path"):
        return format_module(fmt).output_path(weights, config)
    suffix = SUFFIXES[fmt]
    return weights.with_suffix(suffix) if suffix.startswith(".") else weights.with_name(weights.stem + suffix)


def check_formats(include) -> list[str]:
    formats = [ALIASES.get(str(name).lower(), str(name).lower()) for name in include]
    unknown = [name for name in formats if name not in SUFFIXES]
    if unknown or not formats:
        raise ArgumentError(f"--include {' '.join(unknown) or '(none)'}: not supported "
                          f"(supported: {', '.join(SUFFIXES)})")
    return list(dict.fromkeys(formats))


def check_tensorflow_flags(config: ExportConfig) -> None:
    """Refuse YOLOv5's TensorFlow-only flags (TENSORFLOW_FLAGS) in one line naming them, before any work."""
    given = [flag for name, flag in TENSORFLOW_FLAGS.items() if getattr(config, name)]
    if given:
        raise ArgumentError(f"{' '.join(given)}: YOLOv5 uses {'it' if len(given) == 1 else 'them'} for its TensorFlow "
                            "exports only (saved_model, pb, tflite, edgetpu, tfjs); there are none here (tflite/litert "
                            "is converted from PyTorch): exports carry the model's output before NMS, which runs in "
                            "detect.py / val.py")


def check_options(config: ExportConfig, formats: list[str], device: torch.device) -> None:
    """Refuse flag combinations that cannot work, before any slow work; load optional packages early."""
    cpu_half = set(formats) <= CPU_HALF
    floats = [fmt for fmt in formats if fmt in ("torchscript", "onnx", "openvino")]
    if config.int8 and len(floats) == len(formats):  # CoreML and TensorRT refuse --int8 themselves, saying why
        raise ArgumentError("--int8: TorchScript, ONNX and OpenVINO exports are fp32 (or --half); --include ncnn, "
                            "executorch and litert take --int8")
    if config.int8 and floats and set(formats) & INT8_FORMATS:  # as YOLOv5: the rest exported as usual
        LOGGER.warning("--int8 quantises %s; %s exported without it (float)",
                       ", ".join(TITLES[fmt] for fmt in formats if fmt in INT8_FORMATS),
                       ", ".join(TITLES[fmt] for fmt in floats))
    if config.half and device.type != "cuda" and not cpu_half:
        raise UnavailableOption("--half needs a CUDA device (--device 0) for TorchScript and ONNX; CPU exports are "
                            f"float32 (--include {' / '.join(sorted(CPU_HALF))} alone take --half: fp16 weights)")
    if config.half and config.dynamic and not cpu_half:
        raise ArgumentError("--half and --dynamic cannot be combined (as in YOLOv5) for TorchScript and ONNX")
    if config.optimize and device.type != "cpu":
        raise ArgumentError("--optimize (TorchScript mobile optimisation) is CPU only: use --device cpu")
    if config.optimize and not getattr(torch._C, "_is_xnnpack_enabled", lambda: True)():
        raise ArgumentError("--optimize needs a torch build with XNNPACK, which this one lacks; export without it")
    if not 1 <= config.batch_size <= MAX_BATCH_SIZE:  # the bounds val.py and detect.py check in the metadata
        raise ArgumentError(f"--batch-size {config.batch_size}: must be 1 to {MAX_BATCH_SIZE}")
    if min(config.imgsz) < 1 or max(config.imgsz) > MAX_IMAGE_SIZE:
        raise ArgumentError(f"--imgsz {' '.join(map(str, config.imgsz))}: sizes must be 1 to {MAX_IMAGE_SIZE}")
    if "openvino" in formats and device.type != "cpu":
        raise UnavailableOption(f"--include openvino exports and runs on the CPU: use --device cpu (not {device.type})")
    if "onnx" in formats or "openvino" in formats:
        if config.opset not in OPSETS:
            raise ArgumentError(f"--opset {config.opset}: supported {OPSETS.start} to {OPSETS.stop - 1}")
        require("onnx", purpose=f"--include {'onnx' if 'onnx' in formats else 'openvino (converted from ONNX)'}")
    if "onnx" in formats:
        require("onnxruntime", purpose="the ONNX parity check")
        if config.simplify:
            require("onnxsim", purpose="--simplify")
    elif config.simplify:
        LOGGER.info("--simplify ignored: it applies to --include onnx")
    if "openvino" in formats:
        import_openvino("--include openvino")
    for fmt in formats:
        if fmt in FORMAT_MODULES:
            format_module(fmt).check_options(config, device)


def format_module(fmt: str):
    """The module of a format in FORMAT_MODULES, imported now (it may import optional packages when used)."""
    import importlib

    return importlib.import_module(FORMAT_MODULES[fmt])


def round_size(imgsz, stride: int) -> tuple[int, int]:
    """(height, width), each rounded up to a multiple of ``stride`` (with a warning, as YOLOv5 does)."""
    sizes = list(imgsz) * 2 if len(imgsz) == 1 else list(imgsz)[:2]
    rounded = tuple(max(-(-int(side) // stride) * stride, stride) for side in sizes)
    if rounded != tuple(sizes):
        LOGGER.warning("WARNING: --imgsz %s must be a multiple of max stride %d, updating to %s", sizes, stride,
                       list(rounded))
    return rounded


def check_writable(folder: Path) -> None:
    try:
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".export-probe-")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise ExportError(f"{folder}: export folder is not writable ({error.strerror or error})") from None


def lite_interpreter_bytes(module, extra_files: dict) -> bytes:
    """A TorchScript file that PyTorch Mobile's lite interpreter loads (``bytecode.pkl`` beside the full program,
    which ``torch.jit.load`` and so val.py and detect.py still read), with ``extra_files``."""
    with quiet_tracing():
        return bytes(module._save_to_buffer_for_lite_interpreter(_extra_files=extra_files))


class Exporter:
    """Exports one loaded model to several formats, checking each file against the model."""

    def __init__(self, model: nn.Module, info: ExportInfo, device: torch.device, config: ExportConfig):
        self.model, self.info, self.device, self.config = model, info, device, config
        self.run_info = info  # the run's; ``info`` is the format's own (int8 only for INT8_FORMATS), set by export()
        self.graph = PredictionOnly(model).eval()
        self.dtype = torch.float16 if info.half and device.type == "cuda" else torch.float32  # see run()
        self.example = self.input((info.batch, 3, *info.imgsz))
        with torch.no_grad():
            self.graph(self.example)  # one eager pass first, as inference would

    def input(self, shape) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        image = torch.rand(shape, generator=generator).to(self.device, self.dtype)
        return image.contiguous(memory_format=torch.channels_last)

    def export(self, fmt: str, path: Path) -> ExportResult:
        start = time.perf_counter()
        self.info = replace(self.run_info, int8=self.run_info.int8 and fmt in INT8_FORMATS)
        if fmt in FORMAT_MODULES:
            module = format_module(fmt)
            options = {name: getattr(self.config, name) for name in getattr(module, "EXPORT_OPTIONS", ())}
            temp = module.export(self.graph, self.example, self.info, path, self.info.half, **options)
            seconds = time.perf_counter() - start
            try:
                parity = self.check(fmt, temp, path)
                getattr(module, "place", place_folder)(temp, path)
            finally:
                remove(temp)
        elif fmt == "openvino":
            temp = self.openvino(path)
            seconds = time.perf_counter() - start
            try:
                parity = self.check(fmt, temp, path)
                place_folder(temp, path)
            finally:
                remove(temp)
        else:
            data = self.torchscript() if fmt == "torchscript" else self.onnx()
            with AtomicFile(path) as out:  # utils.files: takes the name only once checked (a failure removes it)
                out.write(data)
                out.file.flush()
                seconds = time.perf_counter() - start
                parity = self.check(fmt, out.temp, path)
        result = ExportResult(fmt, path, size_bytes(path) / 1e6, seconds, parity)
        LOGGER.info("%s: saved %s (%.1f MB) in %.1f s", TITLES[fmt], path, result.megabytes, seconds)
        for figure in parity:
            LOGGER.info("%s parity: %s", TITLES[fmt], figure.describe())
        return result

    def torchscript(self) -> bytes:
        with quiet_tracing(), torch.no_grad():
            module = torch.jit.trace(self.graph, self.example, strict=False)
        extra_files = {TORCHSCRIPT_METADATA: json.dumps(self.info.to_dict())}
        if self.config.optimize:  # as YOLOv5: optimised for mobile, saved for PyTorch Mobile's lite interpreter
            from torch.utils.mobile_optimizer import optimize_for_mobile
            try:
                module = optimize_for_mobile(module)
            except RuntimeError as error:
                raise ExportError(f"--optimize failed ({str(error).strip().splitlines()[-1][:200]})") from None
            return lite_interpreter_bytes(module, extra_files)
        buffer = io.BytesIO()
        with quiet_tracing():
            torch.jit.save(module, buffer, _extra_files=extra_files)
        return buffer.getvalue()

    def trace_onnx(self) -> bytes:
        """The ONNX graph (no metadata): input ``images``, output ``output0``, free axes with --dynamic."""
        axes = {"images": {0: "batch", 2: "height", 3: "width"}, "output0": {0: "batch", 1: "anchors"}}
        buffer = io.BytesIO()
        try:
            with quiet_tracing(), torch.no_grad():
                torch.onnx.export(self.graph, (self.example,), buffer, dynamo=False, opset_version=self.config.opset,
                                  input_names=["images"], output_names=["output0"], do_constant_folding=True,
                                  dynamic_axes=axes if self.info.dynamic else None)
        except (RuntimeError, ValueError) as error:
            raise ExportError(f"ONNX export at --opset {self.config.opset} failed ({first_line(error)})") from None
        return buffer.getvalue()

    def onnx(self) -> bytes:
        import onnx

        proto = onnx.load_from_string(self.trace_onnx())
        onnx.checker.check_model(proto)
        if self.config.simplify:
            proto = simplify(proto)
        for key, value in self.info.to_dict().items():
            entry = proto.metadata_props.add()
            entry.key, entry.value = key, json.dumps(value)
        return proto.SerializeToString()

    def openvino(self, path: Path) -> Path:
        """The OpenVINO IR converted from the ONNX graph, with its metadata YAML, in a hidden folder beside
        ``path`` (``<stem>.xml``, ``<stem>.bin``, ``<stem>.yaml``); fp16 weights with --half."""
        import yaml

        ov = import_openvino("--include openvino")
        stem = path.name.removesuffix(OPENVINO_FOLDER)
        folder = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
        try:
            graph = folder / f"{stem}.onnx"
            graph.write_bytes(self.trace_onnx())
            try:
                model = ov.Core().read_model(str(graph))
                ov.save_model(model, str(folder / f"{stem}.xml"), compress_to_fp16=self.info.half)
            except Exception as error:  # openvino's conversion errors are RuntimeErrors and its own types
                raise ExportError(f"OpenVINO conversion failed ({openvino_reason(error)})") from None
            graph.unlink()
            text = yaml.safe_dump(self.info.to_dict(), sort_keys=False, allow_unicode=True)
            (folder / f"{stem}.yaml").write_text(text, encoding="utf-8")
        except BaseException:
            remove(folder)
            raise
        return folder

    def check(self, fmt: str, written: Path, path: Path) -> list:
        """Load the ``written`` file back and compare it with the PyTorch model (compare_output); ParityError
        where it differs (``path`` is the name it is meant to get). Returns the figures (Parity or DetectionParity)."""
        if fmt in FORMAT_MODULES:
            backend = format_module(fmt).checked_backend(written, self.info, self.device)
            if backend is None:  # a format that cannot run here: its module checked the file's description
                return []
        else:
            backend = BACKENDS[".xml" if fmt == "openvino" else SUFFIXES[fmt]](written, self.device)
        shapes = [tuple(self.example.shape)]
        if self.info.dynamic:
            shapes.append(second_shape(self.example.shape, self.info.stride))
        figures = []
        for shape in shapes:
            image = self.parity_input(shape)
            shape = tuple(image.shape)  # an int8 check runs PARITY_IMAGES images
            with torch.no_grad():
                reference = self.graph(image).float()
                try:
                    exported, _ = backend(image)
                except Exception as error:  # e.g. a size baked into the graph: a parity failure, not a crash
                    raise ParityError(f"{path}: the {TITLES[fmt]} model fails on a {'x'.join(map(str, shape))} "
                                      f"input ({first_line(error)}); not written") from None
            figure = compare_output(reference, exported, shape, self.info)
            figures.append(figure)
            if not figure.ok:
                raise ParityError(f"{path}: the {TITLES[fmt]} model differs from the PyTorch model: "
                                  f"{figure.describe()}; not written")
        return figures

    def parity_input(self, shape) -> torch.Tensor:
        """Random images of ``shape``; for an int8 export, calibration images of its size (int8.parity_inputs)."""
        if not self.info.int8:
            return self.input(shape)
        from models.formats.int8 import parity_inputs

        images = parity_inputs(self.config, shape)
        return images.to(self.device, self.dtype).contiguous(memory_format=torch.channels_last)


def second_shape(shape, stride: int) -> tuple:
    """Another batch and a non-square smaller size, to check a --dynamic export away from its example."""
    batch, channels, height, width = shape
    new_height = max(stride, height * 3 // 4 // stride * stride)
    new_width = max(stride, width // 2 // stride * stride)
    if (new_height, new_width) == (height, width):
        new_height += stride
    return batch + 1, channels, new_height, new_width


def compare_output(reference: torch.Tensor, exported: torch.Tensor, shape, info: ExportInfo):
    """The one place that picks the parity check, from the export's int8 flag (the flag its metadata carries):
    an int8 file's detections against the PyTorch model's (models/formats/int8.py: a DetectionParity), any other
    file's outputs within TOLERANCE (fp16 with --half) of their scale (``compare``: a Parity). Both have ``ok``
    and ``describe()``."""
    if info.int8:
        from models.formats.int8 import compare_detections

        return compare_detections(reference, exported, shape)
    return compare(reference, exported, shape, TOLERANCE[torch.float16 if info.half else torch.float32])


def compare(reference: torch.Tensor, exported: torch.Tensor, shape, tolerance: float) -> Parity:
    """Max |diff| of the box columns (pixels) and of the score columns; non-finite values count as inf."""
    if exported.shape != reference.shape:
        return Parity(tuple(shape), float("inf"), float("inf"), tolerance * max(shape[2:]), tolerance)
    difference = (exported.float() - reference.float()).abs()
    difference = torch.where(torch.isfinite(difference), difference, torch.full_like(difference, float("inf")))
    boxes = float(difference[..., :4].max()) if difference.numel() else 0.0
    scores = float(difference[..., 4:].max()) if difference.numel() else 0.0
    return Parity(tuple(shape), boxes, scores, tolerance * max(shape[2:]), tolerance)


def simplify(proto):
    import onnxsim

    try:
        simplified, valid = onnxsim.simplify(proto)
    except Exception as error:  # onnxsim raises its own and onnxruntime's exception types
        raise ExportError(f"--simplify failed ({first_line(error)})") from None
    if not valid:
        raise ExportError("--simplify produced a model onnxsim could not validate; export without --simplify")
    return simplified


def place_folder(temp: Path, path: Path) -> None:
    """Move the checked files of ``temp`` into the folder ``path``: a rename when ``path`` is new, else each
    file replaced in turn (other files there are left alone); the folder gets a new folder's permissions."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ExportError(f"{path}: exists and is not a folder; move it away to export here")
    from utils.files import new_mode

    os.chmod(temp, new_mode(folder=True))
    if not path.exists():
        try:
            os.rename(temp, path)
            return
        except OSError:  # created meanwhile: replace file by file below
            pass
    # the weights first, so a reader never pairs the new description with old weights
    for file in sorted(temp.iterdir(), key=lambda item: item.suffix != ".bin"):
        os.replace(file, path / file.name)


def remove(path: Path) -> None:
    """Delete a temp file or folder of ours, if still there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def size_bytes(path: Path) -> int:
    """A file's size, or the total of the files in a folder and its subfolders (OpenVINO, NCNN, a CoreML package)."""
    if path.is_dir():
        return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())
    return path.stat().st_size


@contextmanager
def quiet_tracing():
    """Silence the tracer's notes on Python values and torch's deprecation notices for TorchScript/ONNX
    (torch.jit is deprecated in favour of torch.export, but it is what runs without extra packages)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.")
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export")
        yield


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="export.py", description="Export a checkpoint to TorchScript / ONNX / OpenVINO and "
                                                          "the formats of models/formats/ (YOLOv5 export.py's flags)")
    add = parser.add_argument
    add("--weights", nargs="+", type=str, default=["yolov5s.pt"], help="checkpoint path(s) (ours or YOLOv5's .pt), "
                                                                     "each exported in turn")
    add("--imgsz", "--img", "--img-size", nargs="+", type=int, default=[640, 640], help="image size h w (or one)")
    add("--batch-size", type=int, default=1, help="batch size")
    add_device_flag(parser)
    parser.set_defaults(device="cpu")
    add("--half", action="store_true", help="FP16 half-precision export (CUDA; OpenVINO/LiteRT: fp16 weights, CPU)")
    add("--inplace", action="store_true", help="YOLOv5's Detect() inplace=True: accepted for compatibility; changes "
                                               "nothing here (the exported output is the same either way)")
    add("--optimize", action="store_true", help="TorchScript: optimize for mobile (CPU only)")
    add("--dynamic", action="store_true", help="dynamic batch and image size (TorchScript, ONNX, OpenVINO)")
    add("--simplify", action="store_true", help="ONNX: simplify the model (needs onnxsim)")
    add("--opset", type=int, default=17, help="ONNX (and OpenVINO, converted from ONNX): opset version")
    add("--int8", action="store_true", help="NCNN, ExecuTorch, LiteRT: int8 quantisation, calibrated on the train "
                                            "images of --data")
    add("--data", type=str, default="data/coco128.yaml", help="dataset YAML for --int8 calibration images")
    add("--verbose", action="store_true", help="TensorRT (--include engine): verbose builder log")
    add("--workspace", type=positive_int, default=4, help="TensorRT (--include engine): builder workspace size, GB")
    add_tensorflow_flags(parser)
    add("--include", nargs="+", default=["torchscript"], help=f"formats: {', '.join(SUFFIXES)}")
    return parser


def add_tensorflow_flags(parser: argparse.ArgumentParser) -> None:
    """YOLOv5's flags for its TensorFlow exports, with its defaults (TENSORFLOW_FLAGS says what happens to them)."""
    add = parser.add_argument
    refused = "YOLOv5's TensorFlow exports only: refused here (no TensorFlow formats; NMS runs in detect.py / val.py)"
    add("--keras", action="store_true", help=f"Keras SavedModel; {refused}")
    add("--nms", action="store_true", help=f"NMS inside the model; {refused}")
    add("--agnostic-nms", action="store_true", help=f"class-agnostic NMS inside the model; {refused}")
    no_effect = "accepted, no effect: YOLOv5 uses it with --nms only (NMS runs in detect.py / val.py here)"
    add("--topk-per-class", type=int, default=100, help=f"YOLOv5's TensorFlow NMS: boxes kept per class; {no_effect}")
    add("--topk-all", type=int, default=100, help=f"YOLOv5's TensorFlow NMS: boxes kept in all; {no_effect}")
    add("--iou-thres", type=float, default=0.45, help=f"YOLOv5's TensorFlow NMS: IoU threshold; {no_effect}")
    add("--conf-thres", type=float, default=0.25, help=f"YOLOv5's TensorFlow NMS: confidence threshold; {no_effect}")


def config_from_args(args: argparse.Namespace, weights: str | None = None) -> ExportConfig:
    """The ExportConfig of one of ``--weights`` (the first when ``weights`` is None)."""
    values = vars(args).copy()
    values["weights"] = weights if weights is not None else values["weights"][0]
    values["imgsz"] = tuple(values["imgsz"] * 2 if len(values["imgsz"]) == 1 else values["imgsz"][:2])
    values["include"] = tuple(values["include"])
    return ExportConfig(**values)


def main(argv=None) -> int:
    from utils.errors import run_main

    return run_main("export.py", _main, argv)


def _main(argv) -> int:
    args = parse_args(argv)
    from utils.loggers import setup_logging

    setup_logging()
    start = time.perf_counter()
    results, failed = [], []
    try:
        for weights in args.weights:  # as YOLOv5: each checkpoint in turn, each format's failure reported at the end
            try:  # a flag or weights file that cannot be used still ends the command (run_main), before its export
                results += run(config_from_args(args, weights))
            except ExportFailures as error:
                results += error.results
                failed.append(error)
        if results:
            LOGGER.info("Export complete (%.1f s): %s", time.perf_counter() - start,
                        ", ".join(str(result.path) for result in results))
        for result in results:
            if result.format in RUNS_ELSEWHERE:
                LOGGER.info("%s: %s", result.path, RUNS_ELSEWHERE[result.format])
                continue
            LOGGER.info("Validate: python val.py --weights %s --data data.yaml | Detect: python detect.py --weights %s",
                        result.path, result.path)
    finally:  # also when a later checkpoint ends the command: the earlier ones' failures are said
        for error in failed:  # the exported file is not written: a failure of the export, not a bug
            print(f"export.py: error: {error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
