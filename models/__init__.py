"""Models: ``load_model`` gives an eval-mode float32 DetectionModel from any supported checkpoint."""
from __future__ import annotations


def load_model(path, device="cpu"):
    """Our checkpoints (EMA weights when present, else model) and YOLOv5's; eval mode, float32.

    Raises utils.checkpoint.CheckpointError (a ValueError) with a one-line message for bad files.
    """
    from utils.checkpoint import load_checkpoint, model_entry

    model = build_model(model_entry(load_checkpoint(path)), source=str(path))
    return model.float().to(device).eval()


def for_inference(model):
    """Fold BatchNorm into the convolutions and store weights channels_last; returns the model.

    channels_last took yolov5n's batch-32 inference at 320 on a 2-core CPU from 18.1 to 10.9 ms per
    image (benchmarks/bench_val.py --channels-last); callers feed channels_last inputs to match.
    """
    import torch

    return model.fuse().to(memory_format=torch.channels_last)


def is_channels_last(model) -> bool:
    """True when the model's first 4-D weight is stored channels_last (its inputs should follow it)."""
    import torch

    weight = next((p for p in model.parameters() if p.dim() == 4), None)
    return weight is not None and weight.is_contiguous(memory_format=torch.channels_last) and \
        not weight.is_contiguous()


def build_model(entry: dict, source: str = "checkpoint"):
    """A float32 DetectionModel from a "model"/"ema" entry (strict state_dict load); its class names must be a
    flat list (or {index: name} dict) of short strings, one per class (utils.checkpoint.class_names)."""
    import torch

    from models.yolo import DetectionModel, ModelConfigError
    from utils.checkpoint import CheckpointError, class_names

    if not isinstance(entry, dict) or not {"yaml", "state_dict"} <= entry.keys():
        raise CheckpointError(f"{source}: model entry needs 'yaml' and 'state_dict'")
    try:
        model = DetectionModel(entry["yaml"])
    except ModelConfigError as error:
        raise CheckpointError(f"{source}: stored model YAML does not build ({error})") from None
    state = entry["state_dict"]
    if not isinstance(state, dict):
        raise CheckpointError(f"{source}: state_dict is a {type(state).__name__}, expected a dict of tensors")
    ours = model.state_dict()
    missing = [k for k in ours if k not in state]
    unexpected = [k for k in state if k not in ours]
    wrong = [k for k in ours if k in state and (not torch.is_tensor(state[k]) or state[k].shape != ours[k].shape)]
    if missing or unexpected or wrong:
        detail = "; ".join(f"{label} {len(keys)} (e.g. {_key_text(keys[0])})" for label, keys in
                           (("missing", missing), ("unexpected", unexpected), ("shape mismatch", wrong)) if keys)
        raise CheckpointError(f"{source}: weights do not fit the stored model YAML: {detail}")
    model.load_state_dict(state, strict=True)
    model.float()
    model.anchors_placeholder = False  # the anchors buffer came with the weights
    names = entry.get("names")
    if names:
        names = class_names(names, f"{source}: names")  # types and sizes checked before any conversion
        if len(names) != model.model[-1].nc:
            raise CheckpointError(f"{source}: {len(names)} class names for a model of {model.model[-1].nc} classes")
        model.names = names
    return model


def _key_text(key) -> str:
    """A state_dict key for a message: as it is when it is a short string, else shortened (file content)."""
    from utils.errors import shorten

    return key if isinstance(key, str) and len(key) <= 200 else shorten(key, 80)
