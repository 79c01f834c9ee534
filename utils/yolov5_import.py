"""Import ultralytics/yolov5 ``.pt`` files without running any code from them.

YOLOv5 pickles whole nn.Modules. We read the torch zip archive ourselves (``<prefix>/data.pkl`` plus raw
storages in ``<prefix>/data/<key>``) and unpickle with a restricted Unpickler: an allow-list of globals
maps to inert stand-ins that only record their state, to plain containers, or to our own tensor
rebuilders. Every other global (``os.system``, ``builtins.eval``, ...) is refused by name. The model is
then rebuilt from the recorded YAML dict and the weights collected from the recorded module tree.
Never calls ``torch.load(weights_only=False)`` and never imports YOLOv5's modules.

Memory and time are bounded before anything is materialised (limits in ``utils.limits``):
``data.pkl`` may be at most 32 MB uncompressed, checked on the archive's declared size before it is
decompressed; unpickling yields only storage and tensor *records* (key, dtype, element count; offset,
size, stride), each checked against the archive member it names; a view that would cover more
elements than its storage holds (zero or overlapping strides) is refused; only the storages that the
"model" and "ema" trees use are read, at most 2 GB in all (yolov5x6 in float32 needs 1.13 GB), and the
tensors are views of them, so tensors sharing a storage never multiply it. The module-tree walk is
bounded in depth, modules and tensors. Each refusal is a one-line CheckpointError naming the file.
"""
from __future__ import annotations

import collections
import io
import logging
import math
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from utils.errors import CheckpointError, shorten
from utils.limits import (MAX_CLASSES, MAX_MODULES, MAX_PICKLE_BYTES, MAX_TENSOR_BYTES, MAX_TENSOR_DIMS,
                          MAX_TENSORS)

LOGGER = logging.getLogger(__name__)

YOLOV5_CLASSES = {
    "models.yolo": {"Detect", "DetectionModel", "Model", "Segment", "SegmentationModel", "ClassificationModel"},
    "models.common": {"Conv", "DWConv", "DWConvTranspose2d", "TransformerLayer", "TransformerBlock", "Bottleneck",
                      "BottleneckCSP", "CrossConv", "C3", "C3x", "C3TR", "C3SPP", "C3Ghost", "SPP", "SPPF", "Focus",
                      "GhostConv", "GhostBottleneck", "Contract", "Expand", "Concat", "Proto", "Classify"},
    "models.experimental": {"MixConv2d", "CrossConv", "Sum"},
}
EXTRA_TORCH_CLASSES = {("torch.nn.modules.linear", "NonDynamicallyQuantizableLinear")}
STORAGE_DTYPES = {"FloatStorage": torch.float32, "HalfStorage": torch.float16, "DoubleStorage": torch.float64,
                  "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
                  "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                  "BoolStorage": torch.bool}
DTYPE_NAMES = {"float32", "float16", "float64", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
NUMPY_DTYPES = {"f2", "f4", "f8", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "b1"}  # e.g. best_fitness
PLAIN_KEYS = ("epoch", "best_fitness", "date")
MAX_MODULE_DEPTH = 64


class Record:
    """Inert stand-in for a pickled class: keeps constructor args and the state it is given."""
    qualified_name = "?"

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        self.args = args
        self.state = {}

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = state if isinstance(state, dict) else {"state": state}


_STAND_INS: dict = {}


def _stand_in(qualified_name: str) -> type:
    if qualified_name not in _STAND_INS:
        _STAND_INS[qualified_name] = type(qualified_name.rsplit(".", 1)[-1], (Record,),
                                          {"qualified_name": qualified_name})
    return _STAND_INS[qualified_name]


class _StorageType:
    """What 'torch.HalfStorage' etc. resolve to: only carries the element dtype."""

    def __init__(self, dtype):
        self.dtype = dtype


@dataclass(frozen=True)
class StorageRecord:
    """A storage named by the pickle, not read yet: archive key, element type and count."""
    key: str
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _element_size(self.dtype)


@dataclass(frozen=True)
class TensorRecord:
    """A tensor named by the pickle, not materialised yet: a view (offset, size, stride) of a storage."""
    storage: StorageRecord
    offset: int
    size: tuple
    stride: tuple

    @property
    def shape(self) -> tuple:
        return self.size


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    """A TensorRecord after checking that the view lies inside its storage and does not expand it."""
    if not isinstance(storage, StorageRecord):
        raise CheckpointError("tensor record without a storage")
    if not (isinstance(size, (tuple, list)) and isinstance(stride, (tuple, list)) and len(size) == len(stride)
            <= MAX_TENSOR_DIMS and all(map(_is_index, size)) and all(map(_is_index, stride))
            and _is_index(storage_offset)):
        raise CheckpointError("malformed tensor record")
    numel = math.prod(size)
    if numel and storage_offset + sum((s - 1) * st for s, st in zip(size, stride)) >= storage.numel:
        raise CheckpointError("tensor record reaches past the end of its storage")
    if numel > storage.numel:
        raise CheckpointError(f"tensor of {numel} elements is a zero-stride or overlapping view of a storage of "
                              f"{storage.numel} (refused: loading it would expand memory)")
    return TensorRecord(storage, storage_offset, tuple(size), tuple(stride))


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


def _numpy_dtype(name, align=False, copy=False):
    import numpy

    if not isinstance(name, str) or name not in NUMPY_DTYPES:  # file content: type-checked before any str()
        raise CheckpointError(f"numpy dtype {shorten(name, 20)} is not allowed")
    return numpy.dtype(name)


def _numpy_scalar(dtype, data=b""):
    import numpy

    if not isinstance(data, bytes) or not hasattr(dtype, "itemsize") or len(data) != dtype.itemsize:
        raise CheckpointError("malformed numpy scalar record")
    return numpy.frombuffer(data, dtype=dtype)[0].item()


def _latin1_bytes(text, encoding="utf-8"):
    """What protocol-2 pickles call (``_codecs.encode``) to rebuild a bytes object: str -> latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise CheckpointError("malformed bytes record")
    return text.encode("latin-1")


class NumpyArrayRecord:
    """What numpy's array ``_reconstruct`` resolves to: keeps the state the pickle gives it, builds nothing."""

    def __init__(self, *args):
        self.state = None

    def __setstate__(self, state):
        self.state = state


def _numpy_reconstruct(cls, shape=(0,), typecode=b"b"):
    if cls is not NumpyArrayRecord:  # what "numpy.ndarray" resolves to
        raise CheckpointError("malformed numpy array record")
    return NumpyArrayRecord()


def _one_float(value):
    """A float from a one-element float numpy array record (YOLOv5's training checkpoints store
    best_fitness so); any other value unchanged."""
    import numpy

    if not isinstance(value, NumpyArrayRecord):
        return value
    state = value.state
    if not (isinstance(state, tuple) and len(state) == 5 and state[1] in ((), (1,))
            and isinstance(state[2], numpy.dtype) and state[2].str in ("<f2", "<f4", "<f8")):
        return None
    dtype = numpy.dtype(state[2].str)  # a fresh dtype, whatever state the pickle gave the recorded one
    raw = state[4]
    return float(numpy.frombuffer(raw, dtype)[0]) if isinstance(raw, bytes) and len(raw) == dtype.itemsize else None


def _plain_global(module: str, name: str):
    """Allowed non-class globals: containers, tensor rebuilders, storage types and dtypes; else None."""
    if (module, name) == ("_codecs", "encode"):
        return _latin1_bytes
    if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "_reconstruct":
        return _numpy_reconstruct
    if (module, name) == ("numpy", "ndarray"):
        return NumpyArrayRecord
    if (module, name) in (("collections", "OrderedDict"),):
        return collections.OrderedDict
    if module in ("builtins", "__builtin__") and name in ("set", "frozenset"):
        return {"set": set, "frozenset": frozenset}[name]
    if module == "torch._utils" and name == "_rebuild_tensor_v2":
        return _rebuild_tensor
    if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
        return _rebuild_parameter
    if module == "torch" and name in STORAGE_DTYPES:
        return _StorageType(STORAGE_DTYPES[name])
    if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "scalar":
        return _numpy_scalar
    if module == "numpy" and name == "dtype":
        return _numpy_dtype
    if module == "torch" and name in DTYPE_NAMES:
        return getattr(torch, name)
    return None


def _is_torch_module_class(module: str, name: str) -> bool:
    if (module, name) in EXTRA_TORCH_CLASSES:
        return True
    if not module.startswith("torch.nn.modules."):
        return False
    cls = getattr(torch.nn, name, None)
    return isinstance(cls, type) and issubclass(cls, torch.nn.Module)


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for YOLOv5 checkpoints that resolves only allow-listed globals, to inert objects.

    Storages become StorageRecords checked against the archive members they name; nothing is read."""

    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, source: str):
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.source = archive, prefix, source
        self.storages: dict = {}

    def find_class(self, module, name):
        plain = _plain_global(module, name)
        if plain is not None:
            return plain
        if name in YOLOV5_CLASSES.get(module, ()) or _is_torch_module_class(module, name):
            return _stand_in(f"{module}.{name}")
        raise CheckpointError(f"{self.source}: refused global {shorten(f'{module}.{name}', 120)} "
                              "(not on the YOLOv5 allow-list)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointError(f"{self.source}: unsupported persistent id {shorten(pid)}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(key, str) or not _is_index(numel):
            raise CheckpointError(f"{self.source}: unsupported storage record {shorten(pid)}")
        if key not in self.storages:
            self.storages[key] = self._storage_record(key, storage_type.dtype, numel)
        return self.storages[key]

    def _storage_record(self, key: str, dtype, numel: int) -> StorageRecord:
        record = StorageRecord(key, dtype, numel)
        if record.nbytes > MAX_TENSOR_BYTES:
            raise CheckpointError(f"{self.source}: storage {shorten(key)} claims {record.nbytes / 1e9:.4g} GB, more "
                                  f"than the {MAX_TENSOR_BYTES / 1e9:g} GB a checkpoint's weights may use")
        try:
            info = self.archive.getinfo(f"{self.prefix}/data/{key}")
        except KeyError:
            raise CheckpointError(f"{self.source}: storage {shorten(key)} missing from the archive") from None
        if info.file_size < record.nbytes:
            raise CheckpointError(f"{self.source}: storage {shorten(key)} is truncated")
        return record


def _read_storage(archive: zipfile.ZipFile, prefix: str, record: StorageRecord) -> torch.Tensor:
    """The storage's elements as a 1-D tensor, read into one buffer of exactly its size."""
    if record.numel == 0:
        return torch.empty(0, dtype=record.dtype)
    buffer = bytearray(record.nbytes)
    with archive.open(f"{prefix}/data/{record.key}") as member:
        read = member.readinto(memoryview(buffer))
    if read != record.nbytes:
        raise CheckpointError(f"storage {shorten(record.key)} is truncated")
    return torch.frombuffer(buffer, dtype=record.dtype)


def pickle_member(archive: zipfile.ZipFile, source: str) -> str:
    """The name of the pickle torch.load reads from a zip archive: ``<folder>/data.pkl`` in the folder of the
    archive's FIRST entry (torch's reader takes its record folder from that name, whatever other folders hold).
    CheckpointError when the first entry is in no folder."""
    infos = archive.infolist()
    folder, slash, _ = infos[0].filename.partition("/") if infos else ("", "", "")
    if not (folder and slash):
        raise CheckpointError(f"{source}: zip archive whose first entry is in no folder, not a torch checkpoint")
    return f"{folder}/data.pkl"


def find_pickle(archive: zipfile.ZipFile, source: str) -> zipfile.ZipInfo:
    """The member ``pickle_member`` names, refused (CheckpointError, one line) when the archive has entries
    outside that folder or twice under one name, letter case aside (torch refuses the first and looks names up
    case-blind; with either, a check could read another pickle than the loader), when it is missing, or when its declared size exceeds MAX_PICKLE_BYTES.
    zipfile never returns more than the declared size, so reading the member after this check is bounded too."""
    member = pickle_member(archive, source)
    folder = member[: -len("data.pkl")]
    names = archive.namelist()
    outside = next((name for name in names if not name.startswith(folder)), None)
    if outside is not None:
        raise CheckpointError(f"{source}: zip archive with entries outside its record folder {shorten(folder, 60)} "
                              f"(e.g. {shorten(outside, 60)}); torch refuses such archives, not a checkpoint")
    if len({name.lower() for name in names}) != len(names):  # torch's reader (miniz) finds names case-blind
        raise CheckpointError(f"{source}: zip archive with two entries under one name (letter case aside), not a "
                              "checkpoint")
    try:
        info = archive.getinfo(member)
    except KeyError:
        raise CheckpointError(f"{source}: zip archive without {shorten(member, 60)}, not a torch checkpoint") from None
    if info.file_size > MAX_PICKLE_BYTES:
        raise CheckpointError(f"{source}: data.pkl is {info.file_size / 1e6:.0f} MB uncompressed, more than "
                              f"the {MAX_PICKLE_BYTES / 1e6:.0f} MB a checkpoint's pickle may have")
    return info


def read_checkpoint_pickle(path) -> bytes:
    """The data.pkl bytes of a torch zip checkpoint, size-checked (``find_pickle``) before reading."""
    with zipfile.ZipFile(path) as archive:
        return archive.read(find_pickle(archive, str(path)))


def _unpickle(archive: zipfile.ZipFile, source: str) -> tuple[dict, str]:
    """(top-level dict of plain containers, Records and TensorRecords, archive prefix)."""
    info = find_pickle(archive, source)
    prefix = info.filename[: -len("/data.pkl")]
    if f"{prefix}/byteorder" in archive.namelist() and archive.read(f"{prefix}/byteorder") != b"little":
        raise CheckpointError(f"{source}: big-endian checkpoints are not supported")
    data = RestrictedUnpickler(archive.read(info), archive, prefix, source).load()
    if not isinstance(data, dict):
        raise CheckpointError(f"{source}: unsupported content ({type(data).__name__}), expected a checkpoint dict")
    return data, prefix


CORRUPT = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, pickle.UnpicklingError, RuntimeError,
           TypeError, ValueError, AttributeError, IndexError, KeyError, RecursionError, OverflowError)


def _corrupt(path: Path, error: BaseException) -> CheckpointError:
    if isinstance(error, CheckpointError):
        message = str(error)
        return CheckpointError(message if message.startswith(str(path)) else f"{path}: {message}")
    detail = str(error).splitlines()[0][:120] if str(error) else ""
    return CheckpointError(f"{path}: corrupt YOLOv5 checkpoint ({type(error).__name__}: {detail})")


class _Walk:
    """Counts for one module-tree walk: shared records (a DAG) are visited once per path, so the number
    of visits, not only the depth, is bounded."""

    def __init__(self):
        self.modules = 0
        self.tensors = 0

    def visit_module(self) -> None:
        self.modules += 1
        if self.modules > MAX_MODULES:
            raise CheckpointError(f"module tree has more than {MAX_MODULES} modules (shared or cyclic records?)")

    def visit_tensor(self) -> None:
        self.tensors += 1
        if self.tensors > MAX_TENSORS:
            raise CheckpointError(f"module tree has more than {MAX_TENSORS} tensors")


def _collect_state(record: Record, prefix: str, out: dict, walk: _Walk, depth: int = 0) -> None:
    """Walk recorded _parameters / _buffers / _modules like nn.Module.state_dict() does."""
    if depth > MAX_MODULE_DEPTH:
        raise CheckpointError("module tree too deep (cyclic?)")
    walk.visit_module()
    state = record.state if isinstance(record, Record) else {}
    skip = state.get("_non_persistent_buffers_set") or set()
    for group in ("_parameters", "_buffers"):
        for name, tensor in _items(state.get(group)):
            if tensor is None or (group == "_buffers" and name in skip):
                continue
            if not isinstance(tensor, TensorRecord) or not isinstance(name, str):
                label = prefix + name if isinstance(name, str) else prefix + shorten(name, 40)
                raise CheckpointError(f"{shorten(label, 120)} is not a tensor")
            walk.visit_tensor()
            out[prefix + name] = tensor
    for name, child in _items(state.get("_modules")):
        if child is not None:
            _collect_state(child, f"{prefix}{shorten(name, 100) if not isinstance(name, str) else name}.", out, walk,
                           depth + 1)


def _items(group) -> list:
    if group is None:
        return []
    if not isinstance(group, dict):
        raise CheckpointError(f"module state holds {type(group).__name__} where a dict belongs")
    return list(group.items())


def _names(names) -> list[str]:
    """Class names from a recorded list or {index: name} dict: strings (or small integers), at most
    MAX_CLASSES."""
    if isinstance(names, dict):  # {index: name}; keys of mixed types keep their stored order
        keys = sorted(names) if all(isinstance(k, int) for k in names) else list(names)
        names = [names[k] for k in keys]
    if not isinstance(names, (list, tuple)):
        return []
    if len(names) > MAX_CLASSES:
        raise CheckpointError(f"{len(names)} class names, more than {MAX_CLASSES}")
    for name in names:
        if not (isinstance(name, str) or isinstance(name, int) and abs(name) < 10 ** 18):
            raise CheckpointError(f"class names must be strings, got {shorten(name)}")
    return [str(name) for name in names]


def model_entry_from_record(record, source: str) -> dict:
    """A "model" entry (see utils.checkpoint) from a recorded YOLOv5 DetectionModel; its "state_dict"
    and "stride" hold TensorRecords until ``_materialise``."""
    if not isinstance(record, Record) or not record.qualified_name.startswith("models.yolo."):
        raise CheckpointError(f"{source}: 'model' is not a YOLOv5 model object")
    attributes = record.state
    if not isinstance(attributes.get("yaml"), dict):
        raise CheckpointError(f"{source}: YOLOv5 model without its YAML dict")
    state: dict = {}
    try:
        _collect_state(record, "", state, _Walk())
        names = _names(attributes.get("names") or [])
    except CheckpointError as error:
        raise CheckpointError(f"{source}: {error}") from None
    stride = attributes.get("stride")
    yaml_dict = dict(attributes["yaml"])
    yaml_file = attributes.get("yaml_file", "")
    yaml_dict.setdefault("yaml_file", yaml_file[:255] if isinstance(yaml_file, str) else "")
    return {"yaml": yaml_dict, "state_dict": state, "names": names,
            "stride": stride if isinstance(stride, TensorRecord) and math.prod(stride.size) <= 16 else None}


def _materialise(entries: list[dict], archive: zipfile.ZipFile, prefix: str, source: str,
                 extra: list | None = None) -> dict:
    """Read the storages the entries' TensorRecords (and ``extra`` records) use, each once, MAX_TENSOR_BYTES in all,
    and replace every entry's record by a view of its storage; returns {id(record): view} for ``extra``."""
    extra = extra or []
    records = [tensor for entry in entries for tensor in entry["state_dict"].values()]
    records += [entry["stride"] for entry in entries if entry["stride"] is not None] + extra
    storages = {record.storage.key: record.storage for record in records}
    total = sum(storage.nbytes for storage in storages.values())
    if total > MAX_TENSOR_BYTES:
        raise CheckpointError(f"{source}: the weights need {total / 1e9:.4g} GB, more than the "
                              f"{MAX_TENSOR_BYTES / 1e9:g} GB budget (yolov5x6 in float32 needs 1.13 GB)")
    loaded = {key: _read_storage(archive, prefix, storage) for key, storage in storages.items()}

    def view(record: TensorRecord) -> torch.Tensor:
        return torch.as_strided(loaded[record.storage.key], record.size, record.stride, record.offset)

    for entry in entries:
        entry["state_dict"] = {name: view(record) for name, record in entry["state_dict"].items()}
        stride = entry["stride"]
        entry["stride"] = [float(s) for s in view(stride).tolist()] if stride is not None else []
    return {id(record): view(record) for record in extra}


def _plain_fields(data: dict) -> dict:
    values = {key: _one_float(data.get(key)) for key in PLAIN_KEYS}
    fields = {key: value for key, value in values.items()
              if value is None or isinstance(value, (float, str)) or _small_int(value)}
    updates = data.get("updates")
    fields["ema_updates"] = updates if _small_int(updates) else None
    if data.get("optimizer") is None:  # YOLOv5's strip_optimizer (a finished run's files, the release weights)
        fields["finished"] = True
    return fields


def _small_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2 ** 63


# ---------------------------------------------------------------------- a YOLOv5 run's training state

MAX_STATE_KEYS = 8  # per-parameter optimizer state entries: SGD keeps 1, Adam 3 (4 with amsgrad)


def optimizer_records(optimizer, source: str) -> tuple[dict, list]:
    """A pickled ``optimizer.state_dict()`` checked for shape (parameter index -> dict of at most MAX_STATE_KEYS
    entries, at most MAX_TENSORS entries; groups as a list of dicts with a ``params`` list) and its TensorRecords."""
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict) \
            or not isinstance(optimizer.get("param_groups"), list):
        raise CheckpointError(f"{source}: 'optimizer' is not an optimizer state_dict (state, param_groups)")
    state, groups = optimizer["state"], optimizer["param_groups"]
    if len(state) > MAX_TENSORS or len(groups) > 16:
        raise CheckpointError(f"{source}: 'optimizer' holds {len(state)} parameter states in {len(groups)} groups, "
                              f"more than a model's {MAX_TENSORS} tensors")
    records = []
    for index, entry in state.items():
        if not _is_index(index) or not isinstance(entry, dict) or len(entry) > MAX_STATE_KEYS:
            raise CheckpointError(f"{source}: optimizer state {shorten(index, 20)}: expected a parameter index -> "
                                  f"dict of at most {MAX_STATE_KEYS} entries")
        records += [value for value in entry.values() if isinstance(value, TensorRecord)]
    for group in groups:
        params = group.get("params") if isinstance(group, dict) else None
        if not isinstance(params, list) or len(params) > MAX_TENSORS or not all(map(_is_index, params)):
            raise CheckpointError(f"{source}: optimizer group without a list of parameter indices")
    return {"state": state, "param_groups": [{"params": list(group["params"])} for group in groups]}, records


def _parameters_by_module(record, prefix: str, out: list, walk: _Walk, depth: int = 0) -> None:
    """(full name, name in its module, the module's class) of every parameter, in ``model.modules()`` order."""
    if depth > MAX_MODULE_DEPTH:
        raise CheckpointError("module tree too deep (cyclic?)")
    walk.visit_module()
    state = record.state if isinstance(record, Record) else {}
    kind = record.qualified_name if isinstance(record, Record) else "?"
    for name, tensor in _items(state.get("_parameters")):
        if tensor is not None and isinstance(name, str):
            out.append((prefix + name, name, kind))
    for name, child in _items(state.get("_modules")):
        if child is not None and isinstance(name, str):
            _parameters_by_module(child, f"{prefix}{name}.", out, walk, depth + 1)


def optimizer_layouts(record) -> dict[str, list[list[str]]]:
    """The parameter names of each YOLOv5 optimizer layout, group by group, for the model ``record``:

    - ``v6.2+`` (smart_optimizer): biases; other weights (decayed); normalisation weights (a torch.nn class
      whose name holds "Norm") -- the groups of utils.trainer.optim, in its order;
    - ``v6.1-``: BatchNorm2d weights; other modules' ``weight``; every ``bias`` (no other parameter)."""
    found: list = []
    _parameters_by_module(record, "", found, _Walk())
    norm = [full for full, name, kind in found if name == "weight" and "Norm" in kind.rsplit(".", 1)[-1]
            and kind.startswith("torch.nn.")]
    biases = [full for full, name, _ in found if name == "bias"]
    norm_set = set(norm)
    weights = [full for full, name, _ in found if name != "bias" and full not in norm_set]
    batchnorm = [full for full, name, kind in found if name == "weight" and kind.endswith(".BatchNorm2d")]
    batchnorm_set = set(batchnorm)
    old_weights = [full for full, name, _ in found if name == "weight" and full not in batchnorm_set]
    return {"v6.2+": [biases, weights, norm], "v6.1-": [batchnorm, old_weights, biases]}


def load_yolov5_checkpoint(path, training: bool = False, file=None) -> dict:
    """Our checkpoint format (utils.checkpoint) from a YOLOv5 file: "model" and "ema" entries plus
    plain fields (epoch, best_fitness, date, ema_updates; finished when it has no optimizer, as YOLOv5 strips
    them). With ``training`` (a resume: utils.checkpoint.yolov5_run) also "yolov5_training": the optimizer's
    state (its tensors read), YOLOv5's ``opt`` dict and ``optimizer_layouts`` of the model; otherwise the optimizer's
    storages are not read. ``file``: the file already open (``path`` then only names it)."""
    path = Path(path)
    source = str(path)
    try:
        with zipfile.ZipFile(path if file is None else file) as archive:
            data, prefix = _unpickle(archive, source)
            model, ema = data.get("model"), data.get("ema")
            if model is None and ema is None:
                raise CheckpointError(f"{source}: no 'model' or 'ema' in this YOLOv5 checkpoint")
            ckpt = {"source": "yolov5",
                    "model": model_entry_from_record(model if model is not None else ema, source),
                    "ema": model_entry_from_record(ema, source) if ema is not None else None}
            extra = []
            if training and data.get("optimizer") is not None:
                optimizer, extra = optimizer_records(data["optimizer"], source)
                ckpt["yolov5_training"] = {"optimizer": optimizer, "opt": data.get("opt"),
                                           "layouts": optimizer_layouts(model if model is not None else ema)}
            views = _materialise([entry for entry in (ckpt["model"], ckpt["ema"]) if entry], archive, prefix, source,
                                 extra)
            if extra:
                for entry in ckpt["yolov5_training"]["optimizer"]["state"].values():
                    entry.update({key: views[id(value)] for key, value in entry.items()
                                  if isinstance(value, TensorRecord)})
    except CORRUPT as error:
        raise _corrupt(path, error) from None
    ckpt.update(_plain_fields(data))
    LOGGER.info("Imported YOLOv5 checkpoint %s (%d tensors%s)", source, len(ckpt["model"]["state_dict"]),
                ", with EMA" if ema is not None else "")
    return ckpt
