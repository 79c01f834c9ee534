"""Exported models' metadata is checked field by field when loaded (models/export_info.py, models/backends.py):
types, the command line's bounds, and text sizes before parsing; a bad field is one line naming the file and
the field, in bounded time and memory. Crafted TorchScript, ONNX and OpenVINO files (tiny identity graphs)."""
from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path

import pytest
import torch
import yaml

from models.backends import TORCHSCRIPT_METADATA, BackendError, import_openvino, load_backend
from models.export_info import (EXPORT_FORMAT, MAX_LITERAL_CHARS, MAX_METADATA_CHARS, ExportInfo, MetadataError,
                                info_from_metadata)

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")  # the crafted TorchScript files

GOOD = {"format": EXPORT_FORMAT, "names": ["cat", "dog"], "nc": 2, "stride": 32, "imgsz": [64, 64], "batch": 1,
        "dynamic": False, "half": False, "int8": False, "channels_last": True, "device": "cpu"}


def shared_bomb(depth: int = 60):
    """A list of two references to a list of two references ...: 2**depth leaves in a few hundred bytes."""
    value = ["x"]
    for _ in range(depth):
        value = [value, value]
    return value


def test_our_and_yolov5_metadata_are_read():
    assert info_from_metadata(GOOD) == ExportInfo(names=("cat", "dog"), stride=32, imgsz=(64, 64), batch=1,
                                                  channels_last=True, device="cpu")
    assert info_from_metadata({**GOOD, "int8": True}).int8
    assert not info_from_metadata({key: value for key, value in GOOD.items() if key != "int8"}).int8  # older files
    yolov5_onnx = {"stride": 32, "names": "{0: 'cat', 1: 'dog'}"}  # sizes from the graph input
    info = info_from_metadata(yolov5_onnx, (2, 3, 640, 320))
    assert (info.names, info.imgsz, info.batch, info.dynamic) == (("cat", "dog"), (640, 320), 2, False)
    yolov5_torchscript = {"shape": [1, 3, 320, 320], "stride": 32, "names": {"0": "cat", "1": "dog"}}  # JSON keys
    assert info_from_metadata(yolov5_torchscript).imgsz == (320, 320)
    dynamic = info_from_metadata({"stride": 64, "names": {1: 7, 0: "a"}}, (None, 3, None, None))
    assert (dynamic.names, dynamic.imgsz, dynamic.batch, dynamic.dynamic) == (("a", "7"), None, 1, True)


@pytest.mark.parametrize("changes, input_shape, expected", [
    ({"imgsz": [10 ** 9, 64]}, None, "'imgsz' must be [height, width], multiples of the stride 32 up to 16384, "
                                     "got [1000000000, 64]"),
    ({"imgsz": [100, 64]}, None, "'imgsz' must be [height, width], multiples of the stride 32"),
    ({"imgsz": "640"}, None, "'imgsz' must be [height, width]"),
    ({"imgsz": [64, 64, 64]}, None, "'imgsz' must be [height, width]"),
    ({"batch": -1}, None, "'batch' must be an integer in [1, 4096], got -1"),
    ({"batch": 10 ** 15}, None, "'batch' must be an integer in [1, 4096], got 1000000000000000"),
    ({"batch": 2.5}, None, "'batch' must be an integer in [1, 4096], got 2.5"),
    ({"stride": 0}, None, "'stride' must be an integer in [1, 1024], got 0"),
    ({"stride": 10 ** 9}, None, "'stride' must be an integer in [1, 1024], got 1000000000"),
    ({"stride": True}, None, "'stride' must be an integer in [1, 1024], got True"),
    ({"names": shared_bomb()}, None, "'names' entry 0 must be a text of at most 256 characters, got [["),
    ({"names": ["a"] * 100_001}, None, "'names' must be a list or {index: name} dict of 1 to 100000 names"),
    ({"names": []}, None, "'names' must be a list or {index: name} dict of 1 to 100000 names, got []"),
    ({"names": ["a", "b" * 10 ** 6]}, None, "'names' entry 1 must be a text of at most 256 characters, got 'bbb"),
    ({"names": {0: "a", 2: "b"}}, None, "'names' keys must be the indices 0 to 1, got 2"),
    ({"names": {"0": "a", "01234567": "b"}}, None, "'names' keys must be the indices 0 to 1, got '01234567'"),
    ({"names": "{0: 'a', " * (MAX_LITERAL_CHARS // 9 + 1)}, None,
     "'names' is a text of 2,000,007 characters, more than 2,000,000"),
    ({"names": "__import__('os').system('echo hacked')"}, None, "'names' must be a list or dict literal"),
    ({"names": "[" * 100_000}, None, "'names' must be a list or dict literal, got '[[["),
    ({"nc": 3}, None, "'nc' 3 but 2 names"),
    ({"nc": "2"}, None, "'nc' '2' but 2 names"),
    ({"dynamic": "yes"}, None, "'dynamic' must be true or false, got 'yes'"),
    ({"half": 1}, None, "'half' must be true or false, got 1"),
    ({"int8": "int8"}, None, "'int8' must be true or false, got 'int8'"),
    ({"device": "tpu" * 1000}, None, "'device' must be one of cpu, cuda, mps, got 'tputputpu"),
    ({"format": "other/2"}, None, "'format' 'other/2' is not 'yolo-trainer-export/1'"),
    ({"format": None, "imgsz": None, "batch": None, "shape": [1, 3, 10 ** 9, 64]}, None,
     "'shape' must be 4 sizes in [1, 16384] (batch, channels, height, width), got [1, 3, 1000000000, 64]"),
    ({"imgsz": None}, None, "missing 'imgsz' (and the model's input has no fixed size)"),
    ({}, (2, 3, 64, 64), "'imgsz' [64, 64] and 'batch' 1 do not match the model's input shape [2, 3, 64, 64]"),
    ({"dynamic": True}, (1, 3, 64, 64), "'dynamic' is true but the model's input has the fixed shape [1, 3, 64, 64]"),
])
def test_bad_fields_are_refused_naming_the_field(changes, input_shape, expected):
    values = {key: value for key, value in {**GOOD, **changes}.items() if value is not None}
    start = time.perf_counter()
    with pytest.raises(MetadataError) as error:
        info_from_metadata(values, input_shape)
    message = str(error.value)
    assert time.perf_counter() - start < 5  # bounded work, whatever the value (a generous bound for a busy CPU)
    assert message.startswith(expected) or expected in message, message
    assert "\n" not in message and len(message) < 400


def test_missing_fields_and_non_mappings():
    for key in ("names", "stride"):
        with pytest.raises(MetadataError, match=f"^missing '{key}'$"):
            info_from_metadata({name: value for name, value in GOOD.items() if name != key})
    with pytest.raises(MetadataError, match=r"not a mapping of fields \(list\)"):
        info_from_metadata([1, 2])


# --- the same through each backend, with files made here -------------------------------------------------------

class Identity(torch.nn.Module):
    def forward(self, images):
        return images


def torchscript_file(path: Path, text: str) -> Path:
    torch.jit.save(torch.jit.script(Identity()), str(path), _extra_files={TORCHSCRIPT_METADATA: text})
    return path


def onnx_file(path: Path, props: dict) -> Path:
    """An Identity graph (images 1x3x64x64 -> output0) with ``props`` as metadata_props (text values)."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    images = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 64, 64])
    output = helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 3, 64, 64])
    graph = helper.make_graph([helper.make_node("Identity", ["images"], ["output0"])], "identity", [images], [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    for key, value in props.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(path))
    return path


def openvino_folder(folder: Path, metadata_text: str, onnx_source: Path) -> Path:
    """``<folder>/<stem>.xml`` + ``.bin`` converted from ``onnx_source``, with ``metadata_text`` as ``<stem>.yaml``."""
    if importlib.util.find_spec("openvino") is None:  # not importorskip: a plain import starts openvino's telemetry
        pytest.skip("could not import 'openvino': optional (pip install -r requirements-export.txt)")
    ov = import_openvino("test")
    folder.mkdir()
    stem = folder.name.removesuffix("_openvino_model")
    ov.save_model(ov.Core().read_model(str(onnx_source)), str(folder / f"{stem}.xml"), compress_to_fp16=False)
    (folder / f"{stem}.yaml").write_text(metadata_text)
    return folder


CRAFTED = {  # name: (changed fields, the field named in the error)
    "huge_imgsz": ({"imgsz": [10 ** 9, 10 ** 9]}, "'imgsz' must be [height, width]"),
    "negative_batch": ({"batch": -4}, "'batch' must be an integer in [1, 4096], got -4"),
    "names_bomb": ({"names": ["a"] * 100_001}, "'names' must be a list or {index: name} dict of 1 to 100000"),
    "nested_names": ({"names": [[["a"]] * 3] * 2}, "'names' entry 0 must be a text of at most 256 characters"),
}


def expect_refusal(path: Path, named: Path, detail: str) -> None:
    start = time.perf_counter()
    with pytest.raises(BackendError) as error:
        load_backend(path)
    message = str(error.value)
    assert time.perf_counter() - start < 30
    assert message.startswith(f"{named}: ") and detail in message, message
    assert "\n" not in message and len(message) < 500


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_torchscript_with_bad_metadata_is_refused(case, tmp_path):
    changes, detail = CRAFTED[case]
    path = torchscript_file(tmp_path / f"{case}.torchscript", json.dumps({**GOOD, **changes}))
    expect_refusal(path, path, detail)


def test_torchscript_oversized_or_deeply_nested_metadata_is_refused_before_parsing(tmp_path):
    path = torchscript_file(tmp_path / "big.torchscript", " " * (MAX_METADATA_CHARS + 1))
    expect_refusal(path, path, f"config.txt holds {MAX_METADATA_CHARS + 1:,} characters of metadata, more than")
    path = torchscript_file(tmp_path / "deep.torchscript", "[" * 1_000_000)
    expect_refusal(path, path, "config.txt inside is not JSON")


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_onnx_with_bad_metadata_is_refused(case, tmp_path):
    changes, detail = CRAFTED[case]
    props = {key: json.dumps(value) for key, value in {**GOOD, **changes}.items()}
    path = onnx_file(tmp_path / f"{case}.onnx", props)
    expect_refusal(path, path, detail)


def test_onnx_oversized_or_deeply_nested_metadata_is_refused(tmp_path):
    props = {key: json.dumps(value) for key, value in GOOD.items()}
    path = onnx_file(tmp_path / "big.onnx", {**props, "notes": "x" * MAX_METADATA_CHARS})
    expect_refusal(path, path, "metadata_props holds")
    path = onnx_file(tmp_path / "deep.onnx", {**props, "names": "[" * (MAX_LITERAL_CHARS + 1)})
    expect_refusal(path, path, "'names' is a text of 2,000,001 characters, more than 2,000,000")  # not parsed
    path = onnx_file(tmp_path / "deep_small.onnx", {**props, "names": "[" * 100_000})
    expect_refusal(path, path, "'names' must be a list or dict literal")


# OpenVINO's names bomb is the YAML alias bomb below: 100,001 plain names take the pure-Python YAML reader seconds
@pytest.mark.parametrize("case", sorted(set(CRAFTED) - {"names_bomb"}))
def test_openvino_with_bad_metadata_is_refused(case, tmp_path):
    changes, detail = CRAFTED[case]
    source = onnx_file(tmp_path / "identity.onnx", {})
    folder = openvino_folder(tmp_path / f"{case}_openvino_model", yaml.safe_dump({**GOOD, **changes}), source)
    expect_refusal(folder, folder / f"{case}.yaml", detail)


def test_openvino_yaml_alias_bomb_is_refused(tmp_path):
    source = onnx_file(tmp_path / "identity.onnx", {})
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10**9 leaves once expanded
    lines += ["stride: 32", "names: *a8"]
    folder = openvino_folder(tmp_path / "bomb_openvino_model", "\n".join(lines) + "\n", source)
    expect_refusal(folder, folder / "bomb.yaml", "not valid YAML (document too large once aliases are expanded")


def test_messages_name_the_file_and_field_with_good_metadata_accepted(tmp_path):
    path = torchscript_file(tmp_path / "good.torchscript", json.dumps(GOOD))
    assert load_backend(path).names == ["cat", "dog"]
    bad = torchscript_file(tmp_path / "bad.torchscript", json.dumps({**GOOD, "batch": 0}))
    with pytest.raises(BackendError, match=rf"^{re.escape(str(bad))}: not an exported yolo-trainer/YOLOv5 model "
                                           r"\(metadata: 'batch' must be an integer in \[1, 4096\], got 0\)$"):
        load_backend(bad)
