"""A model's CUDA training forward as PyTorch's dispatcher runs it, on a machine without a GPU.

The model's tensors are fake CUDA tensors (``FakeTensorMode``: shapes, dtypes and strides, no memory, no kernels) and
CUDA's autocast is switched on as training switches it on, so every operation is the one a GPU would run, with CUDA's
dtypes and memory formats, autocast's casts included. Printed: the operations by kind with the bytes they read and
write at the batch and size given (what bounds a step whose kernels are memory-bound: BatchNorm, SiLU, copies), and
each cast of an activation with the layer that asked for it.

The backward is not run: torch's autograd engine needs a real CUDA device for CUDA tensors. Each cast in the forward
has a cast of the same size back in the backward (its gradient), and a tensor read by two layers has its two
gradients added, in its dtype.

``--upsample-float32`` shows the forward as it was before the models' ``Upsample`` kept its input's dtype
(models/common.py): CUDA's autocast runs ``upsample_nearest2d`` in float32, so a float32 copy of the fp16 input,
float32 outputs, then float32 concatenations that the next layers cast back (docs/benchmarks.md, 2026-11-28 "Copies
beside the step").

    python benchmarks/cuda_forward_ops.py --cfg models/yolov5s.yaml --batch-size 64 --imgsz 640
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VIEWS = {"view", "_unsafe_view", "permute", "slice", "select", "expand", "unsqueeze", "squeeze", "t", "transpose",
         "detach", "split", "split_with_sizes", "alias", "as_strided", "narrow", "unbind", "chunk", "device",
         "_reshape_alias", "reshape", "view_as", "unfold", "lift_fresh"}  # no kernel of their own


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg", default=str(ROOT / "models/yolov5s.yaml"))
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--amp", default="fp16", choices=("fp16", "bf16"), help="CUDA autocast's dtype")
    parser.add_argument("--channels-last", default="on", choices=("on", "off"))
    parser.add_argument("--upsample-float32", action="store_true",
                        help="nearest upsampling as torch's autocast runs it, in float32 (see the docstring)")
    parser.add_argument("--json", default="", help="also write the figures to this JSON file")
    return parser.parse_args(argv)


def forward_operations(cfg: str, batch: int, imgsz: int, dtype, channels_last: bool = True,
                       upsample_float32: bool = False) -> dict:
    """{"kinds": {kind: [operations, bytes]}, "casts": [(layer, "from->to", shape, bytes)], "bytes": total} of one
    training forward of ``cfg`` on fake CUDA tensors under CUDA autocast to ``dtype`` (the module docstring)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from models.yolo import DetectionModel, activations_out_of_place

    model = DetectionModel(cfg, ch=3, nc=80)
    layer_names, current = {}, []
    for index, layer in enumerate(model.model):
        layer_names[layer] = f"{index}:{type(layer).__name__}"
        layer.register_forward_pre_hook(lambda module, inputs: current.append(layer_names[module]) and None)
        layer.register_forward_hook(lambda module, inputs, output: current.pop() and None)
    kinds, casts = defaultdict(lambda: [0, 0]), []

    def size(tensor) -> int:
        return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            kind = func.overloadpacket.__name__
            if kind in VIEWS:
                return out
            inputs = [a for a in args if isinstance(a, torch.Tensor)]
            inputs += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            outputs = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
            moved = sum(map(size, inputs)) + sum(map(size, outputs))
            kinds[kind][0] += 1
            kinds[kind][1] += moved
            if kind == "_to_copy" and not (inputs[0].is_leaf and inputs[0].requires_grad):  # not a weight's cast
                source, target = (str(t.dtype).replace("torch.", "") for t in (inputs[0], outputs[0]))
                casts.append((current[-1] if current else "input", f"{source}->{target}", list(inputs[0].shape),
                              moved))
            return out

    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    with FakeTensorMode(allow_non_fake_inputs=True):
        for module in model.modules():  # the parameters and buffers as fake CUDA tensors of their own kind
            for name, parameter in list(module._parameters.items()):
                if parameter is not None:
                    fake = torch.empty_like(parameter, device="cuda")
                    if fake.dim() == 4:
                        fake = fake.contiguous(memory_format=memory_format)
                    module._parameters[name] = torch.nn.Parameter(fake, requires_grad=parameter.requires_grad)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = torch.empty_like(buffer, device="cuda")
        activations_out_of_place(model)  # as training runs the model (utils/trainer/trainer.py)
        model.train()
        images = torch.empty((batch, 3, imgsz, imgsz), dtype=torch.uint8, device="cuda")
        images = images.contiguous(memory_format=memory_format)
        upsampling = _autocast_policy_upsampling() if upsample_float32 else contextlib.nullcontext()
        with Record(), upsampling:
            unit = images.div(255)  # the loop's conversion (utils/trainer/feed.py), outside autocast
            with _cuda_autocast(dtype):
                model(unit)
    return {"kinds": {kind: list(values) for kind, values in kinds.items()}, "casts": casts,
            "bytes": sum(values[1] for values in kinds.values())}


@contextlib.contextmanager
def _cuda_autocast(dtype):
    """CUDA's autocast switched on without a CUDA device (``torch.autocast`` refuses there, fake tensors need not)."""
    import torch

    enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_dtype("cuda", dtype)
    torch.set_autocast_enabled("cuda", True)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        torch.autocast_decrement_nesting()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous)


@contextlib.contextmanager
def _autocast_policy_upsampling():
    """The models' Upsample as torch's nn.Upsample, autocast's policy applying to it, for the call inside."""
    from torch import nn

    from models.common import Upsample

    forward = Upsample.forward
    Upsample.forward = nn.Upsample.forward
    try:
        yield
    finally:
        Upsample.forward = forward


def main(argv=None):
    import torch

    args = parse_args(argv)
    dtype = torch.float16 if args.amp == "fp16" else torch.bfloat16
    result = forward_operations(args.cfg, args.batch_size, args.imgsz, dtype, args.channels_last == "on",
                                args.upsample_float32)
    print(f"{Path(args.cfg).stem}, batch {args.batch_size} at {args.imgsz}, CUDA autocast {args.amp}, channels_last "
          f"{args.channels_last}{', nearest upsampling in float32 (autocast policy)' if args.upsample_float32 else ''}: "
          f"one training forward reads and writes {result['bytes'] / 1e9:.2f} GB")
    print(f"\n{'operation':28s} {'calls':>6s} {'GB':>8s}")
    for kind, (calls, moved) in sorted(result["kinds"].items(), key=lambda item: -item[1][1]):
        if moved >= 1e6:
            print(f"{kind:28s} {calls:6d} {moved / 1e9:8.3f}")
    print("\ncasts of activations (autocast's casts of the weights left out), bytes read and written:")
    for layer, dtypes, shape, moved in result["casts"]:
        print(f"  {layer:14s} {dtypes:18s} {str(shape):24s} {moved / 1e6:8.1f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
