"""An ONNX file's protobuf read without the onnx package: the fields of a message, and whether any tensor keeps its
values in another file (ONNX external data). Each length is checked against the bytes that hold it and varints are at
most 10 bytes, so malformed bytes are a ProtobufError, never a read past the data."""
from __future__ import annotations

MODEL_GRAPH = 7  # ModelProto.graph
LENGTH_DELIMITED, VARINT, FIXED64, FIXED32 = 2, 0, 1, 5


class ProtobufError(ValueError):
    """Bytes that are not the protobuf message they should be."""


def _varint(data: memoryview, position: int, end: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):
        if position >= end:
            raise ProtobufError("a number runs past its message")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
    raise ProtobufError("a number longer than 10 bytes")


def fields(data: memoryview, start: int, end: int):
    """(field number, wire type, value) of each field of the message in ``data[start:end]``: an int for a varint, a
    (start, end) span for a length-delimited field, None for a fixed-size one (skipped)."""
    position = start
    while position < end:
        key, position = _varint(data, position, end)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            value, position = _varint(data, position, end)
        elif wire == LENGTH_DELIMITED:
            length, position = _varint(data, position, end)
            if length > end - position:
                raise ProtobufError(f"field {number} holds {length} bytes, past the end of its message")
            value, position = (position, position + length), position + length
        elif wire in (FIXED64, FIXED32):
            position += 8 if wire == FIXED64 else 4
            if position > end:
                raise ProtobufError(f"field {number} runs past its message")
            value = None
        else:
            raise ProtobufError(f"field {number} has wire type {wire}")
        yield number, wire, value


# Where a TensorProto can be: ModelProto.graph / .functions -> FunctionProto.node; GraphProto.node / .initializer /
# .sparse_initializer; NodeProto.attribute -> AttributeProto.t / .g / .tensors / .graphs / .sparse_tensor(s);
# SparseTensorProto.values / .indices. TensorProto.external_data (13) or data_location EXTERNAL (14 = 1) names a file.
_CHILDREN = {
    "model": {MODEL_GRAPH: "graph", 25: "function"},
    "function": {7: "node"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 10: "tensor", 6: "graph", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
}
TENSOR_EXTERNAL_DATA, TENSOR_DATA_LOCATION, EXTERNAL = 13, 14, 1


def uses_external_data(data) -> bool:
    """Whether any tensor of the ONNX model in ``data`` (its bytes) keeps its values in another file
    (``external_data``): onnxruntime would read that file from beside the model; ProtobufError when the bytes are
    not a model."""
    view = memoryview(data)
    stack = [("model", (0, len(view)), 0)]
    while stack:
        kind, span, depth = stack.pop()
        if depth > 64:
            raise ProtobufError("graphs nested more than 64 deep")
        for number, wire, value in fields(view, *span):
            if kind == "tensor":
                if number == TENSOR_EXTERNAL_DATA and wire == LENGTH_DELIMITED or \
                        number == TENSOR_DATA_LOCATION and wire == VARINT and value == EXTERNAL:
                    return True
            elif wire == LENGTH_DELIMITED and number in _CHILDREN[kind]:
                stack.append((_CHILDREN[kind][number], value, depth + 1))
    return False
