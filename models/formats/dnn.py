"""``--dnn``: an ``.onnx`` file run by OpenCV's DNN module (``cv2.dnn``), as YOLOv5's val.py and detect.py run one
with ``--dnn``. OpenCV is a core requirement, so this runs ONNX files where onnxruntime is not installed.

OpenCV reads the graph. The metadata (names, stride, size: ``metadata_props``, as the ONNX backend reads it) and the
graph's input shape are read here from the file's protobuf, without the onnx package: ``ModelProto`` field 14
(``metadata_props``: key 1, value 2) and field 7 (``graph``) -> field 11 (``input``, the first) -> type 2 ->
tensor_type 1 -> shape 2 -> dim 1 (``dim_value`` 1 or ``dim_param`` 2). The reader only walks those fields: each
length is checked against the bytes that hold it, varints are at most 10 bytes, and the metadata's text is bounded
before it is decoded, so a malformed file is a one-line BackendError naming it. Inference runs on the CPU in float32
(an OpenCV built with CUDA is not assumed).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from models.backends import (Backend, BackendError, _check_metadata_size, first_line, json_or_text, parse_info,
                             refuse_external_data)
from models.formats.onnx_proto import (LENGTH_DELIMITED, MODEL_GRAPH, VARINT, ProtobufError,  # noqa: F401
                                       fields, uses_external_data)

LOGGER = logging.getLogger(__name__)
MODEL_METADATA = 14  # ModelProto.metadata_props
GRAPH_INPUT = 11  # GraphProto.input


def _first(data: memoryview, span, number: int):
    """The span of the first length-delimited field ``number`` of the message at ``span``, else None."""
    return next((value for field, wire, value in fields(data, *span) if field == number
                 and wire == LENGTH_DELIMITED), None)


def _text(data: memoryview, span) -> str:
    return bytes(data[span[0]:span[1]]).decode("utf-8")


def read_onnx_header(data: bytes, source: str = "<bytes>") -> tuple[dict[str, str], list | None]:
    """(metadata_props as a dict, the first graph input's (B, C, H, W) with None for a free axis, or None when the
    graph states no 4-dimensional input) from the bytes of the ONNX file ``source``; ProtobufError when they are not
    one, BackendError for more metadata than MAX_METADATA_CHARS."""
    view = memoryview(data)
    metadata, graph, characters = {}, None, 0
    for number, wire, value in fields(view, 0, len(view)):
        if number == MODEL_METADATA and wire == LENGTH_DELIMITED:
            characters += value[1] - value[0]
            _check_metadata_size(characters, source, "metadata_props")
            entry = {field: _text(view, span) for field, kind, span in fields(view, *value)
                     if field in (1, 2) and kind == LENGTH_DELIMITED}
            metadata[entry.get(1, "")] = entry.get(2, "")
        elif number == MODEL_GRAPH and wire == LENGTH_DELIMITED:
            graph = value
    return metadata, _input_shape(view, graph) if graph else None


def _input_shape(view: memoryview, graph) -> list | None:
    span = _first(view, graph, GRAPH_INPUT)
    for number in (2, 1, 2):  # ValueInfoProto.type -> TypeProto.tensor_type -> Tensor.shape
        span = _first(view, span, number) if span else None
    if span is None:
        return None
    dims = []
    for number, wire, dim in fields(view, *span):
        if number != 1 or wire != LENGTH_DELIMITED:
            continue
        size = next((value for field, kind, value in fields(view, *dim) if field == 1 and kind == VARINT), None)
        dims.append(size if size and size < 2 ** 31 else None)  # dim_param (a name) or 0: a free axis
    return dims if len(dims) == 4 else None


class OpenCvDnnBackend(Backend):
    """An ``.onnx`` file run by ``cv2.dnn`` on the CPU (val.py / detect.py ``--dnn``)."""

    kind = "onnx (OpenCV DNN)"

    def __init__(self, path, device="cpu"):
        import cv2

        path = Path(path)
        try:
            data = path.read_bytes()
            metadata, input_shape = read_onnx_header(data, str(path))
        except (OSError, ProtobufError, UnicodeDecodeError) as error:
            raise BackendError(f"{path}: not a readable ONNX model ({first_line(error)})") from None
        refuse_external_data(data, path)
        info = parse_info({key: json_or_text(value) for key, value in metadata.items()}, str(path), input_shape)
        if info.half:
            raise BackendError(f"{path}: an fp16 export runs on CUDA; --dnn runs OpenCV on the CPU (export without "
                               f"--half, or run it without --dnn)")
        try:
            net = cv2.dnn.readNetFromONNX(np.frombuffer(data, np.uint8))
        except cv2.error as error:
            raise BackendError(f"{path}: OpenCV's DNN module cannot read it ({first_line(error)}); run it without "
                               f"--dnn (onnxruntime)") from None
        if torch.device(device).type != "cpu":
            LOGGER.info("--dnn: OpenCV runs %s on the CPU", path.name)
        super().__init__(path, info, "cpu")
        self.net = net

    def _run(self, images: torch.Tensor) -> torch.Tensor:
        self.net.setInput(images.detach().to("cpu", torch.float32).contiguous().numpy())
        output = self.net.forward()
        return torch.from_numpy(np.ascontiguousarray(output)).to(images.device).float()
