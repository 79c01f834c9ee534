""".onnx files on OpenCV's DNN module (val.py / detect.py --dnn, models/formats/dnn.py): the header reader against the
onnx package's own reading, static and dynamic exports computing what onnxruntime computes, the same detections and
mAP, and malformed files refused in one line naming them. Exporting to ONNX needs onnx and onnxruntime (optional);
the reader's malformed-input cases need neither."""
from __future__ import annotations

import pytest
import torch

from models.backends import BackendError, load_backend
from models.formats.dnn import OpenCvDnnBackend, ProtobufError, read_onnx_header
from tests.conftest import save_random_checkpoint

IMGSZ = 64


def export_onnx(folder, **options):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    import export

    weights = save_random_checkpoint(folder / "tiny.pt", ["cat", "dog"], confident=True)
    [result] = export.run(export.ExportConfig(weights=str(weights), imgsz=(IMGSZ, IMGSZ), include=("onnx",),
                                              **options))
    return weights, result.path


@pytest.fixture(scope="module")
def static_onnx(tmp_path_factory):
    return export_onnx(tmp_path_factory.mktemp("dnn_static"), batch_size=2)


@pytest.fixture(scope="module")
def dynamic_onnx(tmp_path_factory):
    return export_onnx(tmp_path_factory.mktemp("dnn_dynamic"), dynamic=True)


@pytest.mark.parametrize("which", ["static_onnx", "dynamic_onnx"])
def test_the_header_reader_reads_what_the_onnx_package_reads(which, request):
    import onnx

    path = request.getfixturevalue(which)[1]
    metadata, shape = read_onnx_header(path.read_bytes())
    model = onnx.load(str(path), load_external_data=False)
    assert metadata == {entry.key: entry.value for entry in model.metadata_props}
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert shape == [dim.dim_value if dim.HasField("dim_value") else None for dim in dims]
    assert shape == ([2, 3, IMGSZ, IMGSZ] if which == "static_onnx" else [None, 3, None, None])


@pytest.mark.parametrize("which", ["static_onnx", "dynamic_onnx"])
def test_opencv_computes_what_onnxruntime_computes(which, request):
    path = request.getfixturevalue(which)[1]
    dnn, runtime = load_backend(path, dnn=True), load_backend(path)
    assert isinstance(dnn, OpenCvDnnBackend) and dnn.names == runtime.names == ["cat", "dog"]
    assert (dnn.imgsz, dnn.dynamic, dnn.stride) == (runtime.imgsz, runtime.dynamic, runtime.stride)
    images = torch.rand(3, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(0))  # 3: static runs in chunks
    ours, theirs = dnn(images)[0], runtime(images)[0]
    assert ours.shape == theirs.shape and (ours - theirs).abs().max() <= 1e-3 * IMGSZ


def test_detect_and_val_with_dnn_equal_onnxruntime(dynamic_onnx, tmp_path):
    import detect
    import val
    from tests.conftest import make_tiny_dataset

    data = make_tiny_dataset(tmp_path / "data", num_train=1, num_val=4)
    onnx_path = dynamic_onnx[1]
    results = [val.run(data=str(data), weights=str(onnx_path), imgsz=IMGSZ, batch_size=2, workers=0, device="cpu",
                       project=str(tmp_path / "val"), plots=False, dnn=dnn) for dnn in (False, True)]
    assert results[0].map == pytest.approx(results[1].map, abs=1e-3) and results[0].seen == results[1].seen == 4
    images = tmp_path / "data" / "images" / "val"
    found = [detect.run_config(detect.DetectConfig(weights=str(onnx_path), source=str(images), imgsz=(IMGSZ, IMGSZ),
                                                   device="cpu", project=str(tmp_path / "detect"), nosave=True,
                                                   dnn=dnn), collect=True).detections for dnn in (False, True)]
    assert found[0].keys() == found[1].keys() and len(found[0]) == 4
    for key in found[0]:  # this model's scores saturate, so NMS's ties may break apart: counts and scores compared
        counts = [len(found[0][key]), len(found[1][key])]
        assert counts[0] > 0 and abs(counts[0] - counts[1]) <= 0.02 * counts[0]
        scores = [sorted(d.score for d in found[dnn][key]) for dnn in (0, 1)]
        assert abs(scores[0][-1] - scores[1][-1]) <= 1e-3


def test_dnn_leaves_other_formats_as_they_are(tmp_path, caplog):
    import logging

    weights = save_random_checkpoint(tmp_path / "tiny.pt", ["cat", "dog"])
    with caplog.at_level(logging.INFO):
        backend = load_backend(weights, dnn=True)
    assert backend.kind == "pytorch" and "--dnn applies to .onnx files" in caplog.text


@pytest.mark.parametrize("data, reason", [
    (b"\x08", "a number runs past its message"),
    (b"\x08" + b"\xff" * 11, "a number longer than 10 bytes"),
    (b"\x3a\x05ab", "field 7 holds 5 bytes, past the end of its message"),
    (b"\x0b", "field 1 has wire type 3"),
    (b"\x72\x04\x0a\x02\xff\xfe", "codec can't decode"),
])
def test_malformed_files_are_one_line_naming_the_file(tmp_path, data, reason):
    path = tmp_path / "broken.onnx"
    path.write_bytes(data)
    with pytest.raises(BackendError) as raised:
        load_backend(path, dnn=True)
    message = str(raised.value)
    assert message.startswith(f"{path}: not a readable ONNX model (") and reason in message and "\n" not in message


def test_no_metadata_is_refused_as_not_our_export(tmp_path):
    path = tmp_path / "plain.onnx"
    path.write_bytes(b"\x08\x07")  # ir_version 7 and nothing else
    assert read_onnx_header(path.read_bytes()) == ({}, None)
    with pytest.raises(BackendError, match="not an exported yolo-trainer/YOLOv5 model"):
        load_backend(path, dnn=True)


def test_too_much_metadata_is_refused_before_it_is_decoded(tmp_path):
    from models.export_info import MAX_METADATA_CHARS

    value = b"x" * (MAX_METADATA_CHARS + 10)
    entry = b"\x0a\x01k\x12" + _varint(len(value)) + value
    data = b"\x72" + _varint(len(entry)) + entry
    with pytest.raises(BackendError, match="more than"):
        read_onnx_header(data, "big.onnx")
    with pytest.raises(ProtobufError):
        read_onnx_header(data[:-5])


def _varint(number: int) -> bytes:
    out = bytearray()
    while True:
        byte, number = number & 0x7F, number >> 7
        out.append(byte | (0x80 if number else 0))
        if not number:
            return bytes(out)


def test_a_model_keeping_its_tensors_in_other_files_is_refused_by_both_runtimes(static_onnx, tmp_path):
    """ONNX external data: a tensor names a file that onnxruntime reads from beside the model, so a model from
    elsewhere could read a file of its choosing there into its weights. Found in the protobuf (initializers, and
    constants inside nodes) without the onnx package, and refused in one line before any runtime opens it."""
    import numpy as np
    import onnx

    from models.formats.dnn import uses_external_data

    _, path = static_onnx
    assert not uses_external_data(path.read_bytes())
    model = onnx.load(str(path))
    onnx.save_model(model, str(tmp_path / "split.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="secret_here.bin", size_threshold=0)
    assert (tmp_path / "secret_here.bin").is_file() and uses_external_data((tmp_path / "split.onnx").read_bytes())
    for dnn in (False, True):
        with pytest.raises(BackendError, match=r"split.onnx: its tensors are kept in other files \(ONNX external data"):
            load_backend(tmp_path / "split.onnx", dnn=dnn)
    constant = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(
            np.zeros(4, np.float32), "c"))], "g", [], [onnx.helper.make_tensor_value_info(
                "c", onnx.TensorProto.FLOAT, [4])]))
    constant.graph.node[0].attribute[0].t.data_location = onnx.TensorProto.EXTERNAL
    assert uses_external_data(constant.SerializeToString())
    with pytest.raises(ProtobufError):
        uses_external_data(b"\x0a\xff\xff\xff\xff\x0f")  # a field longer than the file


@pytest.mark.parametrize("dnn", [False, True])
def test_the_onnx_file_checked_is_the_one_run(static_onnx, tmp_path, monkeypatch, dnn):
    """A model with external data swapped in on disk after the check (a process that can write the folder) is never
    what the runtime opens: both runtimes take the bytes that were checked."""
    import onnx

    import models.backends as backends
    import models.formats.dnn as dnn_format

    _, path = static_onnx
    model_file = tmp_path / "model.onnx"
    model_file.write_bytes(path.read_bytes())
    import numpy as np

    other = onnx.load(str(path))  # other weights, read from a file beside it: what the swap would have run
    for tensor in other.graph.initializer:
        values = onnx.numpy_helper.to_array(tensor)
        if values.dtype == np.float32 and values.size > 1:
            tensor.CopyFrom(onnx.numpy_helper.from_array(-values, tensor.name))
    onnx.save_model(other, str(tmp_path / "split.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="secret_here.bin", size_threshold=0)
    check = backends.refuse_external_data

    def check_then_swap(data, where):
        check(data, where)
        if where == model_file and (tmp_path / "split.onnx").exists():
            (tmp_path / "split.onnx").replace(model_file)

    monkeypatch.setattr(dnn_format if dnn else backends, "refuse_external_data", check_then_swap)
    backend = load_backend(model_file, dnn=dnn)
    images = torch.rand(2, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(backend(images)[0], load_backend(path)(images)[0], atol=1e-3 * IMGSZ)
    with pytest.raises(BackendError, match="ONNX external data"):
        load_backend(model_file, dnn=dnn)  # the swap happened: the file on disk now is the refused one
