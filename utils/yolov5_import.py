"""Import ultralytics/yolov5 ``.pt`` files without running any code from them.

YOLOv5 pickles whole nn.Modules. We read the torch zip archive ourselves (``<prefix>/data.pkl`` plus raw
storages in ``<prefix>/data/<key>``) and unpickle with a restricted Unpickler: an allow-list of globals
maps to inert stand-ins that only record their state, to plain containers, or to our own tensor
rebuilders. Every other global (``os.system``, ``builtins.eval``, ...) is refused by name. The model is
then rebuilt from the recorded YAML dict and the weights collected from the recorded module tree.
Never calls ``torch.load(weights_only=False)`` and never imports YOLOv5's modules.
"""
from __future__ import annotations

import collections
import io
import logging
import pickle
import zipfile
from pathlib import Path

import torch

from utils.errors import CheckpointError

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


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if not torch.is_tensor(storage):
        raise CheckpointError("tensor record without a storage")
    size, stride = tuple(size), tuple(stride)
    if len(size) != len(stride) or any(s < 0 for s in size) or storage_offset < 0:
        raise CheckpointError("malformed tensor record")
    last = storage_offset + sum((s - 1) * st for s, st in zip(size, stride)) if all(size) else -1
    if last >= storage.numel():
        raise CheckpointError("tensor record reaches past the end of its storage")
    return torch.as_strided(storage, size, stride, storage_offset)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


def _numpy_dtype(name, align=False, copy=False):
    import numpy

    if str(name) not in NUMPY_DTYPES:
        raise CheckpointError(f"numpy dtype {str(name)[:20]!r} is not allowed")
    return numpy.dtype(name)


def _numpy_scalar(dtype, data=b""):
    import numpy

    if not isinstance(data, bytes) or not hasattr(dtype, "itemsize") or len(data) != dtype.itemsize:
        raise CheckpointError("malformed numpy scalar record")
    return numpy.frombuffer(data, dtype=dtype)[0].item()


def _plain_global(module: str, name: str):
    """Allowed non-class globals: containers, tensor rebuilders, storage types and dtypes; else None."""
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
    """Unpickler for YOLOv5 checkpoints that resolves only allow-listed globals, to inert objects."""

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
        raise CheckpointError(f"{self.source}: refused global '{module}.{name}' (not on the YOLOv5 allow-list)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointError(f"{self.source}: unsupported persistent id {str(pid)[:80]}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(numel, int):
            raise CheckpointError(f"{self.source}: unsupported storage record {str(pid)[:80]}")
        if key not in self.storages:
            self.storages[key] = self._read_storage(str(key), storage_type.dtype, numel)
        return self.storages[key]

    def _read_storage(self, key: str, dtype, numel: int) -> torch.Tensor:
        try:
            raw = self.archive.read(f"{self.prefix}/data/{key}")
        except KeyError:
            raise CheckpointError(f"{self.source}: storage '{key}' missing from the archive") from None
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if len(raw) < nbytes:
            raise CheckpointError(f"{self.source}: storage '{key}' is truncated")
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(bytearray(raw[:nbytes]), dtype=dtype)


def read_yolov5_pickle(path) -> dict:
    """Unpickle a YOLOv5 torch-zip checkpoint into plain containers, tensors and Records."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if not pickles:
                raise CheckpointError(f"{path}: zip archive without data.pkl, not a torch checkpoint")
            prefix = pickles[0][: -len("/data.pkl")]
            if f"{prefix}/byteorder" in archive.namelist() and archive.read(f"{prefix}/byteorder") != b"little":
                raise CheckpointError(f"{path}: big-endian checkpoints are not supported")
            unpickler = RestrictedUnpickler(archive.read(pickles[0]), archive, prefix, str(path))
            data = unpickler.load()
    except CheckpointError as error:
        message = str(error)
        raise CheckpointError(message if message.startswith(str(path)) else f"{path}: {message}") from None
    except (zipfile.BadZipFile, EOFError, OSError, pickle.UnpicklingError, RuntimeError, TypeError,
            ValueError, AttributeError, IndexError, KeyError, RecursionError) as error:
        raise CheckpointError(f"{path}: corrupt YOLOv5 checkpoint ({type(error).__name__}: "
                              f"{str(error).splitlines()[0][:120] if str(error) else ''})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: unsupported content ({type(data).__name__}), expected a checkpoint dict")
    return data


def _collect_state(record: Record, prefix: str, out: dict, depth: int = 0) -> None:
    """Walk recorded _parameters / _buffers / _modules like nn.Module.state_dict() does."""
    if depth > MAX_MODULE_DEPTH:
        raise CheckpointError("module tree too deep (cyclic?)")
    state = record.state if isinstance(record, Record) else {}
    skip = state.get("_non_persistent_buffers_set") or set()
    for group in ("_parameters", "_buffers"):
        for name, tensor in (state.get(group) or {}).items():
            if tensor is None or (group == "_buffers" and name in skip):
                continue
            if not torch.is_tensor(tensor):
                raise CheckpointError(f"'{prefix}{name}' is not a tensor")
            out[prefix + name] = tensor
    for name, child in (state.get("_modules") or {}).items():
        if child is not None:
            _collect_state(child, f"{prefix}{name}.", out, depth + 1)


def model_entry_from_record(record, source: str) -> dict:
    """A "model" entry (see utils.checkpoint) from a recorded YOLOv5 DetectionModel."""
    if not isinstance(record, Record) or not record.qualified_name.startswith("models.yolo."):
        raise CheckpointError(f"{source}: 'model' is not a YOLOv5 model object")
    attributes = record.state
    if not isinstance(attributes.get("yaml"), dict):
        raise CheckpointError(f"{source}: YOLOv5 model without its YAML dict")
    state: dict = {}
    try:
        _collect_state(record, "", state)
    except CheckpointError as error:
        raise CheckpointError(f"{source}: {error}") from None
    names = attributes.get("names") or []
    if isinstance(names, dict):  # {index: name}; keys of mixed types keep their stored order
        keys = sorted(names) if all(isinstance(k, int) for k in names) else list(names)
        names = [names[k] for k in keys]
    names = [str(n) for n in names] if isinstance(names, (list, tuple)) else []
    stride = attributes.get("stride")
    stride = [float(s) for s in stride.tolist()] if torch.is_tensor(stride) else []
    yaml_dict = {k: v for k, v in attributes["yaml"].items()}
    yaml_dict.setdefault("yaml_file", str(attributes.get("yaml_file", "")))
    return {"yaml": yaml_dict, "state_dict": {k: v.clone() for k, v in state.items()}, "names": names,
            "stride": stride}


def load_yolov5_checkpoint(path) -> dict:
    """Our checkpoint format (utils.checkpoint) from a YOLOv5 file: "model" and "ema" entries plus
    plain fields (epoch, best_fitness, date, ema_updates). YOLOv5 optimizer state is not carried over."""
    data = read_yolov5_pickle(path)
    source = str(path)
    model = data.get("model")
    ema = data.get("ema")
    if model is None and ema is None:
        raise CheckpointError(f"{source}: no 'model' or 'ema' in this YOLOv5 checkpoint")
    ckpt = {"source": "yolov5",
            "model": model_entry_from_record(model if model is not None else ema, source),
            "ema": model_entry_from_record(ema, source) if ema is not None else None}
    for key in PLAIN_KEYS:
        value = data.get(key)
        if value is None or isinstance(value, (int, float, str)):
            ckpt[key] = value
    updates = data.get("updates")
    ckpt["ema_updates"] = updates if isinstance(updates, int) else None
    LOGGER.info("Imported YOLOv5 checkpoint %s (%d tensors%s)", source, len(ckpt["model"]["state_dict"]),
                ", with EMA" if ema is not None else "")
    return ckpt
