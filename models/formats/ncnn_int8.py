"""NCNN ``--int8``: ncnn's int8 model format, written here because ncnn's own tools for it (ncnn2table, ncnn2int8)
are C++ programs that neither the ``ncnn`` nor the ``pnnx`` wheel ships.

Input: the fp32 folder pnnx wrote. Every Convolution (and ConvolutionDepthWise) before the Detect layer gets int8
weights (one scale per output channel, per group for a grouped convolution, 127 / max |w|) and an int8 input
scale from calibration; the Detect convolutions (those whose output the decode reshapes) and everything after
them stay float, so boxes and scores never share an int8 scale (the reason YOLOv5 users' int8 files lose their
scores). ncnn quantises each such convolution's input, convolves
in int8 and dequantises its output to float (``int8_scale_term`` 1: no requantisation between layers).

Calibration: the fp32 model runs on the calibration images (models/formats/int8.py: up to 100 train images of
``--data``, letterboxed as for inference); each quantised convolution's input gets a 2048-bin histogram of |x|,
and the threshold with the least squared quantisation error (rounding below it, clipping beyond it) gives the
scale 127 / threshold. Not ncnn2table's default (KL divergence, TensorRT's entropy calibration): on yolov5n it
clipped the [0, 1] image input at 0.3 and the model's outputs moved by hundreds of pixels.

The files: ``.param`` lines gain ``8=1``; in the ``.bin`` such a layer's weights are the int8 tag (0x000D4B38)
and one byte per weight padded to 4 bytes, then its float bias as before, then ``num_output`` weight scales
(ConvolutionDepthWise: ``group``) and one input scale (float32). The ``.bin`` is walked layer by layer from the
``.param``: a layer type whose weight layout is not known here stops the export in one line rather than writing a
file ncnn would misread.
"""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from utils.errors import UserError

LOGGER = logging.getLogger(__name__)
TAG_FLOAT32, TAG_INT8 = 0, 0x000D4B38  # the 4-byte storage tag before a layer's weights in the .bin
HISTOGRAM_BINS, LEVELS = 2048, 128  # bins of the |x| histograms; int8 levels of one sign (0 to 127)
# Layer types that carry nothing in the .bin (what pnnx writes for YOLOv5 models, and their simple relatives).
WEIGHTLESS = frozenset({"Input", "Split", "Concat", "Swish", "Sigmoid", "ReLU", "Clip", "HardSwish", "HardSigmoid",
                        "Mish", "TanH", "BinaryOp", "UnaryOp", "Pooling", "Interp", "Reshape", "Permute", "Slice",
                        "Crop", "Padding", "Flatten", "Softmax", "Noop", "Eltwise", "Dropout", "ShuffleChannel",
                        "ExpandDims", "Squeeze", "Tile", "MatMul"})


CONVOLUTIONS = ("Convolution", "ConvolutionDepthWise")  # the layers quantised (ConvolutionDepthWise: Ghost models)


class NcnnInt8Error(UserError):
    """The model cannot be written as an int8 NCNN model; one line with the reason."""


@dataclass
class Layer:
    type: str
    name: str
    inputs: list[str]
    outputs: list[str]
    params: dict[str, str]  # ncnn's "key=value" words, keys as written ("0", "-23300", ...)
    line: int  # index in the .param's lines


@dataclass
class Chunk:
    """A layer's stretch of the .bin: [start, end), and for a float convolution its weights (one row per weight scale:
    per output channel, per group for ConvolutionDepthWise) and bias."""
    layer: Layer
    start: int
    end: int
    weight: np.ndarray | None = None
    bias: np.ndarray | None = None


def parse_param(lines: list[str]) -> list[Layer]:
    """The layers of a text .param (already checked by ncnn.check_param: magic, counts, one line per layer)."""
    layers = []
    for index, line in enumerate(lines[2:], start=2):
        words = line.split()
        inputs, outputs = int(words[2]), int(words[3])
        blobs = words[4:4 + inputs + outputs]
        params = dict(word.split("=", 1) for word in words[4 + inputs + outputs:] if "=" in word)
        layers.append(Layer(words[0], words[1], blobs[:inputs], blobs[inputs:], params, index))
    return layers


def integer(layer: Layer, key: str, default: int = 0) -> int:
    try:
        return int(layer.params.get(key, default))
    except ValueError:
        raise NcnnInt8Error(f"NCNN --int8: layer {layer.name} has a non-integer parameter {key}") from None


def walk_weights(layers: list[Layer], data: bytes) -> list[Chunk]:
    """Each weight-carrying layer's stretch of the .bin, in order; the .bin must be used exactly to its end."""
    chunks, offset = [], 0

    def take(count: int) -> bytes:
        nonlocal offset
        if offset + count > len(data):
            raise NcnnInt8Error(f"NCNN --int8: the .bin ends before layer {layer.name}'s weights")
        piece, offset = data[offset:offset + count], offset + count
        return piece

    for layer in layers:
        start = offset
        if layer.type in CONVOLUTIONS:
            if integer(layer, "8") or integer(layer, "19"):  # already int8, or weights as an input blob
                raise NcnnInt8Error(f"NCNN --int8: layer {layer.name} is not a plain float convolution")
            tag = struct.unpack("<I", take(4))[0]
            if tag != TAG_FLOAT32:
                raise NcnnInt8Error(f"NCNN --int8: layer {layer.name}'s weights are not float32 (tag {tag:#x})")
            weight = np.frombuffer(take(4 * integer(layer, "6")), dtype="<f4")
            outputs = integer(layer, "0")
            bias = np.frombuffer(take(4 * outputs), dtype="<f4") if integer(layer, "5") else None
            # one weight scale per output channel; per group for a grouped (depthwise) convolution, as ncnn reads it
            rows = outputs if layer.type == "Convolution" else integer(layer, "7", 1)
            if rows < 1 or outputs % rows or weight.size % rows:
                raise NcnnInt8Error(f"NCNN --int8: layer {layer.name} has {weight.size} weights for {outputs} outputs "
                                    f"in {rows} scale groups")
            chunks.append(Chunk(layer, start, offset, weight.reshape(rows, -1), bias))
        elif layer.type == "MemoryData":  # constants (the decode grids), raw float32
            sizes = [integer(layer, key) for key in ("0", "1", "11", "2")]
            take(4 * int(np.prod([size for size in sizes if size > 0] or [0])))
            chunks.append(Chunk(layer, start, offset))
        elif layer.type not in WEIGHTLESS or (layer.type == "Padding" and integer(layer, "6")):  # per-channel pads
            raise NcnnInt8Error(f"NCNN --int8: layer type {layer.type} ({layer.name}) is not handled here; "
                                "export fp32 or --half")
    if offset != len(data):
        raise NcnnInt8Error(f"NCNN --int8: the .bin has {len(data) - offset} bytes after the last layer's weights")
    return chunks


def quantised_layers(layers: list[Layer], chunks: list[Chunk]) -> list[Chunk]:
    """The convolutions to quantise: every one except those feeding the decode (a Reshape takes their output) and
    any after them."""
    readers: dict[str, list[Layer]] = {}
    for layer in layers:
        for blob in layer.inputs:
            readers.setdefault(blob, []).append(layer)
    convolutions = [chunk for chunk in chunks if chunk.weight is not None]
    head = [chunk.layer.line for chunk in convolutions
            if any(reader.type == "Reshape" for reader in readers.get(chunk.layer.outputs[0], []))]
    if not head:
        raise NcnnInt8Error("NCNN --int8: no Detect convolutions found (none feeds the decode's Reshape)")
    return [chunk for chunk in convolutions if chunk.layer.line < min(head)]


def weight_scales(weight: np.ndarray) -> np.ndarray:
    """One scale per row (output channel, or group): 127 / max |w| (1 for an all-zero row)."""
    largest = np.abs(weight).max(axis=1)
    return np.where(largest > 0, 127 / np.maximum(largest, 1e-30), 1.0).astype(np.float32)


def mse_threshold(histogram: np.ndarray, width: float) -> float:
    """The |x| threshold that minimises the mean squared error of quantising the values to LEVELS - 1 steps of one
    sign, from a histogram of |x| with bins of ``width``: values below it round (error step^2 / 12 each), values
    beyond it clip to it (error (x - threshold)^2). Evenly spread values keep their whole range; a few outliers
    far out are clipped."""
    counts = histogram.astype(np.float64)
    centres = (np.arange(len(counts)) + 0.5) * width
    thresholds = np.arange(1, len(counts) + 1) * width  # the upper edge of each bin
    below = np.cumsum(counts)
    # sum over the bins beyond each threshold of count * (centre - threshold)^2, expanded into running sums
    beyond_count = below[-1] - below
    beyond_sum = np.cumsum((counts * centres)[::-1])[::-1] - counts * centres
    beyond_square = np.cumsum((counts * centres ** 2)[::-1])[::-1] - counts * centres ** 2
    clipped = beyond_square - 2 * thresholds * beyond_sum + thresholds ** 2 * beyond_count
    rounded = below * (thresholds / (LEVELS - 1)) ** 2 / 12
    return float(thresholds[np.argmin(clipped + rounded)])


class Calibration:
    """Per blob: the largest |x| (first pass), then a histogram of |x| up to it (second pass)."""

    def __init__(self, blobs: list[str]):
        self.blobs = blobs
        self.largest = dict.fromkeys(blobs, 0.0)
        self.histograms = {blob: np.zeros(HISTOGRAM_BINS, dtype=np.int64) for blob in blobs}

    def observe_range(self, values: dict[str, np.ndarray]) -> None:
        for blob, array in values.items():
            self.largest[blob] = max(self.largest[blob], float(np.abs(array).max(initial=0.0)))

    def observe_histogram(self, values: dict[str, np.ndarray]) -> None:
        for blob, array in values.items():
            top = self.largest[blob]
            if top > 0:
                counts, _ = np.histogram(np.abs(array), bins=HISTOGRAM_BINS, range=(0.0, top))
                self.histograms[blob] += counts

    def scale(self, blob: str) -> float:
        """127 / threshold for ``blob`` (1 where it was always zero)."""
        top = self.largest[blob]
        if top <= 0:
            return 1.0
        return 127 / mse_threshold(self.histograms[blob], top / HISTOGRAM_BINS)


def quantise_folder(folder: Path, param_name: str, weights_name: str, run_blobs, images) -> int:
    """Rewrite ``folder``'s fp32 NCNN model as int8 in place. ``run_blobs(images_chw, blobs)`` returns each named
    blob's values for one image; ``images`` gives (3, H, W) float arrays, twice (a callable). Returns the number of
    convolutions quantised."""
    param, weights = folder / param_name, folder / weights_name
    lines = [line for line in param.read_text(encoding="ascii").splitlines() if line.strip()]
    layers = parse_param(lines)
    data = weights.read_bytes()
    chunks = walk_weights(layers, data)
    targets = quantised_layers(layers, chunks)
    blobs = list(dict.fromkeys(chunk.layer.inputs[0] for chunk in targets))
    calibration = Calibration(blobs)
    count = 0
    for image in images():
        calibration.observe_range(run_blobs(image, blobs))
        count += 1
    for image in images():
        calibration.observe_histogram(run_blobs(image, blobs))
    LOGGER.info("NCNN --int8: calibrated %d convolutions on %d images", len(targets), count)
    rewritten = {chunk.start: chunk for chunk in targets}
    out, offset = bytearray(), 0
    for chunk in sorted(chunks, key=lambda chunk: chunk.start):
        out += data[offset:chunk.start]
        offset = chunk.end
        if chunk.start not in rewritten:
            out += data[chunk.start:chunk.end]
            continue
        scales = weight_scales(chunk.weight)
        quantised = np.clip(np.rint(chunk.weight * scales[:, None]), -127, 127).astype(np.int8).tobytes()
        out += struct.pack("<I", TAG_INT8) + quantised + bytes(-len(quantised) % 4)
        if chunk.bias is not None:
            out += chunk.bias.astype("<f4").tobytes()
        out += scales.astype("<f4").tobytes()
        out += struct.pack("<f", calibration.scale(chunk.layer.inputs[0]))
        lines[chunk.layer.line] += " 8=1"
    out += data[offset:]
    param.write_text("\n".join(lines) + "\n", encoding="ascii")
    weights.write_bytes(bytes(out))
    return len(targets)
