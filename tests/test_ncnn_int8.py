"""ncnn's int8 model format as models/formats/ncnn_int8.py writes it, on hand-made .param/.bin files (no ncnn
package needed): the .bin walked layer by layer, the int8 layout of a quantised convolution, which convolutions
are quantised, the weight scales, the calibration threshold, and one-line refusals of what it cannot walk."""
from __future__ import annotations

import re
import struct

import numpy as np
import pytest

from models.formats import ncnn_int8
from models.formats.ncnn_int8 import NcnnInt8Error

# A stem convolution (bias), a second one (no bias), a decode constant, and the Detect convolution feeding Reshape.
PARAM = """7767517
7 7
Input in0 0 1 in0
Convolution conv_0 1 1 in0 1 0=4 1=3 5=1 6=108
Swish silu_0 1 1 1 2
Convolution conv_1 1 1 2 3 0=2 1=1 5=0 6=8
MemoryData grid 0 1 4 0=2 1=3 2=1
Convolution conv_det 1 1 3 5 0=3 1=1 5=1 6=6
Reshape reshape_0 1 1 5 6 0=3 1=-1
"""


def floats(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def model_files(tmp_path, weights: dict | None = None):
    rng = np.random.default_rng(0)
    weights = weights or {"conv_0": rng.normal(size=(4, 27)), "conv_1": rng.normal(size=(2, 4)),
                          "conv_det": rng.normal(size=(3, 2))}
    bias0, grid, bias_det = [0.1, 0.2, 0.3, 0.4], np.arange(6), [1.0, 2.0, 3.0]
    data = (struct.pack("<I", 0) + floats(weights["conv_0"]) + floats(bias0)
            + struct.pack("<I", 0) + floats(weights["conv_1"])
            + floats(grid)
            + struct.pack("<I", 0) + floats(weights["conv_det"]) + floats(bias_det))
    (tmp_path / "model.ncnn.param").write_text(PARAM)
    (tmp_path / "model.ncnn.bin").write_bytes(data)
    return weights, data


def fake_runner(values: dict):
    def run_blobs(image, blobs):
        return {blob: values[blob] * image.mean() for blob in blobs}
    return run_blobs


def test_the_body_convolutions_get_int8_weights_scales_and_the_head_stays_float(tmp_path):
    weights, original = model_files(tmp_path)
    activations = {"in0": np.linspace(0, 1, 300), "2": np.linspace(-3, 3, 300)}
    images = lambda: iter([np.ones((3, 4, 4), np.float32)] * 3)  # noqa: E731
    assert ncnn_int8.quantise_folder(tmp_path, "model.ncnn.param", "model.ncnn.bin", fake_runner(activations),
                                     images) == 2
    lines = (tmp_path / "model.ncnn.param").read_text().splitlines()
    assert lines[3].endswith(" 8=1") and lines[5].endswith(" 8=1") and not lines[7].endswith(" 8=1")
    assert [line.removesuffix(" 8=1") for line in lines] == PARAM.splitlines()
    data = (tmp_path / "model.ncnn.bin").read_bytes()
    offset = 0

    def read(count: int) -> bytes:
        nonlocal offset
        offset += count
        return data[offset - count:offset]

    for name, outputs, bias in (("conv_0", 4, [0.1, 0.2, 0.3, 0.4]), ("conv_1", 2, None)):
        assert struct.unpack("<I", read(4))[0] == 0x000D4B38
        size = weights[name].size
        quantised = np.frombuffer(read(size), dtype=np.int8).reshape(outputs, -1)
        read(-size % 4)  # padded to 4 bytes
        if bias is not None:
            assert np.frombuffer(read(4 * outputs), "<f4").tolist() == pytest.approx(bias)
        scales = np.frombuffer(read(4 * outputs), "<f4")
        assert scales == pytest.approx(127 / np.abs(weights[name]).max(axis=1), rel=1e-6)
        assert np.abs(quantised).max(axis=1).tolist() == [127] * outputs  # each channel's largest weight is 127
        assert np.abs(quantised / scales[:, None] - weights[name]).max() <= 0.5 / scales.min() + 1e-6
        input_scale = struct.unpack("<f", read(4))[0]
        largest = np.abs(activations["in0" if name == "conv_0" else "2"]).max()
        assert input_scale == pytest.approx(127 / largest, rel=0.01)  # evenly spread values: nothing clipped
    assert data[offset:] == original[-(24 + 4 + 24 + 12):]  # the grid and the Detect convolution, unchanged


@pytest.mark.parametrize("layer, name", [("PReLU prelu_0 1 1 1 2", "PReLU (prelu_0)"),
                                         ("Gemm gemm_0 1 1 1 2 10=1", "Gemm (gemm_0)"),  # B may be in the .bin
                                         ("Padding pad_0 1 1 1 2 6=4", "Padding (pad_0)")])  # per-channel values
def test_a_layer_with_weights_it_cannot_walk_is_refused_naming_it(tmp_path, layer, name):
    model_files(tmp_path)
    param = tmp_path / "model.ncnn.param"
    param.write_text(param.read_text().replace("Swish silu_0 1 1 1 2", layer))
    with pytest.raises(NcnnInt8Error, match=rf"^NCNN --int8: layer type {re.escape(name)} is not handled here; "
                                            r"export fp32 or --half$"):
        ncnn_int8.quantise_folder(tmp_path, "model.ncnn.param", "model.ncnn.bin", None, lambda: iter(()))


@pytest.mark.parametrize("change, message", [
    (lambda data: data + b"\0\0\0\0", "the .bin has 4 bytes after the last layer's weights"),
    (lambda data: data[:-8], "the .bin ends before layer conv_det's weights"),
    (lambda data: struct.pack("<I", 0x01306B47) + data[4:], "layer conv_0's weights are not float32 (tag 0x1306b47)"),
])
def test_a_bin_that_does_not_match_the_param_is_refused(tmp_path, change, message):
    _, data = model_files(tmp_path)
    (tmp_path / "model.ncnn.bin").write_bytes(change(data))
    before = (tmp_path / "model.ncnn.param").read_text()
    with pytest.raises(NcnnInt8Error, match="^NCNN --int8: " + message.replace("(", r"\(").replace(")", r"\)")):
        ncnn_int8.quantise_folder(tmp_path, "model.ncnn.param", "model.ncnn.bin", None, lambda: iter(()))
    assert (tmp_path / "model.ncnn.param").read_text() == before  # nothing rewritten


def test_without_a_decode_reshape_nothing_is_quantised(tmp_path):
    model_files(tmp_path)
    param = tmp_path / "model.ncnn.param"
    param.write_text(param.read_text().replace("Reshape reshape_0", "Flatten flatten_0"))
    with pytest.raises(NcnnInt8Error, match="no Detect convolutions found"):
        ncnn_int8.quantise_folder(tmp_path, "model.ncnn.param", "model.ncnn.bin", None, lambda: iter(()))


def test_the_threshold_keeps_an_even_range_and_clips_rare_outliers():
    width = 10.0 / ncnn_int8.HISTOGRAM_BINS
    uniform = np.full(ncnn_int8.HISTOGRAM_BINS, 100)
    assert ncnn_int8.mse_threshold(uniform, width) == pytest.approx(10.0, rel=0.01)  # nothing to clip
    image = np.zeros(ncnn_int8.HISTOGRAM_BINS)
    image[[300, 600, 1200, 2047]] = [5000, 300, 200, 100]  # an image: a grey mass, a few bright pixels
    assert ncnn_int8.mse_threshold(image, width) == pytest.approx(10.0, rel=0.01)  # the bright pixels count
    rng = np.random.default_rng(0)
    values = np.abs(np.concatenate([rng.normal(0, 0.5, 200_000), [10.0]]))  # one outlier sets the range
    histogram, _ = np.histogram(values, bins=ncnn_int8.HISTOGRAM_BINS, range=(0, 10.0))
    threshold = ncnn_int8.mse_threshold(histogram, width)
    assert 2.0 < threshold < 6.0  # beyond the bulk (4 sigma = 2), the lone outlier clipped


def test_weight_scales_are_per_output_channel_and_an_empty_channel_gets_one():
    weight = np.array([[0.5, -1.0], [0.0, 0.0], [2.0, 0.25]], dtype=np.float32)
    assert ncnn_int8.weight_scales(weight).tolist() == pytest.approx([127.0, 1.0, 63.5])


def test_a_depthwise_convolution_gets_one_weight_scale_per_group(tmp_path):
    """ConvolutionDepthWise (Ghost models): ncnn reads ``group`` weight scales, one per group of weights."""
    rng = np.random.default_rng(1)
    depthwise, head = rng.normal(size=(4, 9)), rng.normal(size=(3, 4))
    (tmp_path / "model.ncnn.param").write_text("7767517\n4 4\nInput in0 0 1 in0\n"
                                               "ConvolutionDepthWise convdw_0 1 1 in0 1 0=4 1=3 5=0 6=36 7=4\n"
                                               "Convolution conv_det 1 1 1 2 0=3 1=1 5=0 6=12\n"
                                               "Reshape reshape_0 1 1 2 3 0=3 1=-1\n")
    (tmp_path / "model.ncnn.bin").write_bytes(struct.pack("<I", 0) + floats(depthwise) + struct.pack("<I", 0)
                                              + floats(head))
    images = lambda: iter([np.ones((4, 4, 4), np.float32)])  # noqa: E731
    assert ncnn_int8.quantise_folder(tmp_path, "model.ncnn.param", "model.ncnn.bin",
                                     fake_runner({"in0": np.linspace(-2, 2, 100)}), images) == 1
    assert (tmp_path / "model.ncnn.param").read_text().splitlines()[3].endswith(" 7=4 8=1")
    data = (tmp_path / "model.ncnn.bin").read_bytes()
    assert struct.unpack("<I", data[:4])[0] == 0x000D4B38
    scales = np.frombuffer(data[4 + 36:4 + 36 + 16], "<f4")  # 36 int8 weights (a multiple of 4: no padding)
    assert scales == pytest.approx(127 / np.abs(depthwise).max(axis=1), rel=1e-6)
    assert struct.unpack("<f", data[56:60])[0] == pytest.approx(127 / 2, rel=0.01)  # the input scale
    assert data[60:] == struct.pack("<I", 0) + floats(head)  # the Detect convolution, unchanged
