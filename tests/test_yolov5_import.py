"""utils/yolov5_import.py on crafted YOLOv5-style checkpoints: sizes and views are checked before any
tensor is materialised, so hostile files are one-line CheckpointErrors in small, measured memory.

The pickles are written opcode by opcode (protocol 2), so no class of ours or YOLOv5's is needed.
"""
from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from utils.errors import CheckpointError
from utils.yolov5_import import find_pickle, load_yolov5_checkpoint

ROOT = Path(__file__).resolve().parents[1]
YAML = {"nc": 1, "depth_multiple": 1.0, "width_multiple": 1.0, "anchors": [[10, 13]],
        "backbone": [[-1, 1, "Conv", [8, 3, 2]]], "head": [[[0], 1, "Detect", ["nc", "anchors"]]]}


# ----------------------------------------------------------------------------- pickle opcodes
def text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def integer(value: int) -> bytes:
    raw = value.to_bytes(max(1, (value.bit_length() + 8) // 8), "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw if len(raw) < 256 else b"\x8b" + struct.pack("<I", len(raw)) + raw


def tuple_of(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def dict_of(*pairs: tuple[bytes, bytes]) -> bytes:
    return b"}(" + b"".join(key + value for key, value in pairs) + b"u"


def global_(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def plain(value) -> bytes:
    return pickle.dumps(value, protocol=2)[2:-1]


def storage(key: str, numel: int, dtype: str = "FloatStorage") -> bytes:
    return tuple_of(text("storage"), global_("torch", dtype), text(key), text("cpu"), integer(numel)) + b"Q"


def tensor(storage_bytes: bytes, offset: int, size, stride) -> bytes:
    return (global_("torch._utils", "_rebuild_tensor_v2")
            + tuple_of(storage_bytes, integer(offset), tuple_of(*map(integer, size)), tuple_of(*map(integer, stride)),
                       b"\x89", global_("collections", "OrderedDict") + b")R") + b"R")


def module(cls: tuple[str, str], *pairs) -> bytes:
    return global_(*cls) + b")\x81" + dict_of(*pairs) + b"b"


def put(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)


def get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)


def detection_model(parameters: bytes, *extra) -> bytes:
    return module(("models.yolo", "DetectionModel"), (text("yaml"), plain(YAML)), (text("_parameters"), parameters),
                  (text("_modules"), b"}"), *extra)


def checkpoint(path: Path, model: bytes, storages: dict, prefix: bytes = b"", extra=()) -> Path:
    """A torch zip archive whose data.pkl is {"model": model, **extra} (``prefix``: opcodes run first)."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02" + prefix + dict_of((text("model"), model), *extra) + b".")
        archive.writestr("archive/byteorder", "little")
        for key, raw in storages.items():
            archive.writestr(f"archive/data/{key}", raw)
    return path


ONE_FLOAT = {"0": np.zeros(1, np.float32).tobytes()}


def zero_stride(path: Path) -> Path:
    """One float in the archive; a tensor record claiming 1.15e9 elements of it (4.6 GB if expanded)."""
    view = tensor(storage("0", 1), 0, [1_150_000_000], [0])
    return checkpoint(path, detection_model(dict_of((text("w"), view))), ONE_FLOAT)


def oversized(path: Path) -> Path:
    """A storage record claiming 2^40 floats (4 TiB), backed by one float in the archive."""
    return checkpoint(path, detection_model(dict_of((text("w"), tensor(storage("0", 1 << 40), 0, [4], [1])))),
                      ONE_FLOAT)


def shared_storage(path: Path, count: int = 2500) -> Path:
    """``count`` tensors, each the whole of one 4 MB storage (10 GB if every one were copied)."""
    views = [(text(f"w{k}"), tensor(storage("0", 1 << 20), 0, [1 << 20], [1])) for k in range(count)]
    return checkpoint(path, detection_model(dict_of(*views)), {"0": np.arange(1 << 20, dtype=np.float32).tobytes()})


def module_dag(path: Path, levels: int = 40) -> Path:
    """Each level's module holds the previous one twice: 2^40 paths through 41 records."""
    conv = ("torch.nn.modules.conv", "Conv2d")
    body = module(conv, (text("_parameters"), dict_of((text("w"), tensor(storage("0", 1), 0, [1], [1]))))) + put(0)
    for level in range(1, levels + 1):
        body += module(conv, (text("_modules"), dict_of((text("a"), get(level - 1)), (text("b"), get(level - 1))))) \
            + put(level)
    model = module(("models.yolo", "DetectionModel"), (text("yaml"), plain(YAML)),
                   (text("_modules"), dict_of((text("model"), get(levels)))))
    return checkpoint(path, model, ONE_FLOAT, prefix=body)


def pickle_bomb(path: Path, size: int = 64_000_000) -> Path:
    """data.pkl of ``size`` zero bytes deflated to ~60 KB (zero bytes are not even a valid pickle)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("archive/data.pkl", "w") as member:
            chunk = bytes(1 << 20)
            for _ in range(size >> 20):
                member.write(chunk)
        archive.writestr("archive/byteorder", "little")
    return path


# ----------------------------------------------------------------------------- peak memory
PEAK_SCRIPT = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a regression fails here, not the machine
sys.path.insert(0, sys.argv[1])
import torch
from utils.errors import CheckpointError
from utils.yolov5_import import load_yolov5_checkpoint

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

baseline = peak()
for path in sys.argv[2:]:
    try:
        ckpt = load_yolov5_checkpoint(path)
        outcome = "loaded %d tensors" % len(ckpt["model"]["state_dict"])
        del ckpt
    except CheckpointError as error:
        outcome = str(error)
    print(json.dumps({"outcome": outcome, "peak_growth_mb": peak() - baseline}))
"""


def peak_growth(paths: list[Path]) -> list[dict]:
    """Load each path in turn in one fresh process: the outcome, and how far the process's peak RSS
    has grown above its level before the first load (a high-water mark, so it covers earlier loads)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(ROOT), *map(str, paths)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(paths):]]


def test_hostile_checkpoints_are_one_line_errors_in_small_memory(tmp_path):
    cases = [
        (zero_stride, "tensor of 1150000000 elements is a zero-stride or overlapping view of a storage of 1"),
        (oversized, "storage '0' claims 4398 GB, more than the 2 GB a checkpoint's weights may use"),
        (module_dag, "module tree has more than 100000 modules"),
        (pickle_bomb, "data.pkl is 64 MB uncompressed, more than the 32 MB a checkpoint's pickle may have"),
        (shared_storage, "loaded 2500 tensors"),  # loaded as views: 4 MB, not 10 GB
    ]
    paths = [craft(tmp_path / f"{craft.__name__}.pt") for craft, _ in cases]
    for path, (_, expected), result in zip(paths, cases, peak_growth(paths)):
        outcome = result["outcome"]
        assert outcome == expected or outcome.startswith(f"{path}: ") and expected in outcome, outcome
        assert result["peak_growth_mb"] < 32, (path.name, result)


def test_tensors_sharing_a_storage_are_views_of_it(tmp_path):
    ckpt = load_yolov5_checkpoint(shared_storage(tmp_path / "small.pt", count=3))
    state = ckpt["model"]["state_dict"]
    assert {t.untyped_storage().data_ptr() for t in state.values()} == {state["w0"].untyped_storage().data_ptr()}
    assert torch.equal(state["w2"], torch.arange(1 << 20, dtype=torch.float32))


# ----------------------------------------------------------------------------- record checks (in process)
def test_views_past_or_around_their_storage_are_refused(tmp_path):
    cases = {
        "past the end": (tensor(storage("0", 4), 2, [3], [1]), "reaches past the end of its storage"),
        "overlapping": (tensor(storage("0", 5), 0, [3, 3], [1, 1]),
                        "tensor of 9 elements is a zero-stride or overlapping view of a storage of 5"),
        "negative stride": (tensor(storage("0", 4), 0, [2], [-1]), "malformed tensor record"),
        "too many dims": (tensor(storage("0", 4), 0, [1] * 9, [1] * 9), "malformed tensor record"),
        "missing storage": (tensor(storage("9", 4), 0, [4], [1]), "storage '9' missing from the archive"),
        "short storage": (tensor(storage("0", 8), 0, [8], [1]), "storage '0' is truncated"),
        "too large": (tensor(storage("0", 600_000_000), 0, [4], [1]), "claims 2.4 GB, more than the 2 GB"),
    }
    for name, (view, expected) in cases.items():
        path = checkpoint(tmp_path / f"{name}.pt", detection_model(dict_of((text("w"), view))),
                          {"0": np.zeros(5, np.float32).tobytes()})
        with pytest.raises(CheckpointError) as error:
            load_yolov5_checkpoint(path)
        assert str(error.value).startswith(f"{path}: ") and expected in str(error.value), (name, str(error.value))


def test_non_string_names_are_refused(tmp_path):
    huge = detection_model(b"}", (text("names"), b"](" + integer(10 ** 5000) + b"e"))
    with pytest.raises(CheckpointError, match="class names must be strings, got <16610-bit integer>"):
        load_yolov5_checkpoint(checkpoint(tmp_path / "names.pt", huge, ONE_FLOAT))


def test_only_the_model_storages_are_read(tmp_path, monkeypatch):
    import utils.yolov5_import as importer

    read = []
    original = importer._read_storage
    monkeypatch.setattr(importer, "_read_storage", lambda archive, prefix, record: read.append(record.key)
                        or original(archive, prefix, record))
    model = detection_model(dict_of((text("w"), tensor(storage("0", 1), 0, [1], [1]))),
                            (text("names"), plain({0: "cat"})))
    optimizer = (text("optimizer"), tensor(storage("1", 1 << 20), 0, [1 << 20], [1]))
    path = checkpoint(tmp_path / "ckpt.pt", model, {**ONE_FLOAT, "1": bytes(4 << 20)}, extra=[optimizer])
    ckpt = load_yolov5_checkpoint(path)
    assert read == ["0"] and ckpt["model"]["names"] == ["cat"]
    assert ckpt["model"]["state_dict"]["w"].tolist() == [0.0]


def test_declared_pickle_size_is_checked_before_reading(tmp_path):
    path = pickle_bomb(tmp_path / "bomb.pt", size=40 << 20)
    with zipfile.ZipFile(path) as archive:
        with pytest.raises(CheckpointError, match="data.pkl is 42 MB uncompressed"):
            find_pickle(archive, str(path))


# ----------------------------------------------------------------------------- YOLOv5-format files
def test_lookalike_checkpoint_names_yolov5_classes_only(yolov5_lookalike):
    """The generated checkpoints pickle YOLOv5's module paths (so they test the importer as YOLOv5's
    files do), and every global they name is on the importer's allow-list."""
    from utils.checkpoint import pickle_globals
    from utils.yolov5_import import RestrictedUnpickler, read_checkpoint_pickle

    yolov5_classes = {"models.yolo.DetectionModel", "models.yolo.Detect", "models.common.Conv", "models.common.C3",
                      "models.common.Bottleneck", "models.common.SPPF", "models.common.Concat"}
    for path in (yolov5_lookalike.checkpoint, yolov5_lookalike.training_checkpoint):
        names = set(pickle_globals(read_checkpoint_pickle(path)))
        assert {name for name in names if name.startswith("models.")} == yolov5_classes
        assert {"torch.HalfStorage", "torch.nn.modules.conv.Conv2d", "torch.nn.modules.batchnorm.BatchNorm2d",
                "torch.nn.modules.upsampling.Upsample", "torch.nn.modules.pooling.MaxPool2d"} <= names
        with zipfile.ZipFile(path) as archive:
            unpickler = RestrictedUnpickler(b"", archive, "", str(path))
            for name in names:
                unpickler.find_class(*name.rsplit(".", 1))  # raises CheckpointError when refused


def test_numpy_arrays_and_protocol_2_bytes_are_read_as_records(tmp_path):
    """YOLOv5's training checkpoints hold best_fitness as a (1,) numpy array, which protocol 2 pickles with
    numpy's _reconstruct and _codecs.encode: both resolve to checked stand-ins, nothing else gets through."""
    model = detection_model(dict_of((text("w"), tensor(storage("0", 1), 0, [1], [1]))))

    def load(name: str, value: bytes) -> dict:
        return load_yolov5_checkpoint(checkpoint(tmp_path / f"{name}.pt", model, ONE_FLOAT,
                                                 extra=[(text("best_fitness"), value)]))

    assert load("one", plain(np.array([0.5])))["best_fitness"] == 0.5
    assert load("float32", plain(np.array([0.25], np.float32)))["best_fitness"] == 0.25
    assert load("two", plain(np.array([0.5, 0.7])))["best_fitness"] is None  # not one number: dropped
    assert load("int", plain(np.array([3])))["best_fitness"] is None
    refusals = {
        "object": (plain(np.array(["a"], dtype=object)), "numpy dtype 'O8' is not allowed"),
        "rot13": (global_("_codecs", "encode") + tuple_of(text("x"), text("rot13")) + b"R", "malformed bytes record"),
        "not an array": (global_("numpy.core.multiarray", "_reconstruct")
                         + tuple_of(global_("collections", "OrderedDict"), tuple_of(integer(0)), text("b")) + b"R",
                         "malformed numpy array record"),
    }
    for name, (value, expected) in refusals.items():
        with pytest.raises(CheckpointError, match=expected):
            load(name, value)
