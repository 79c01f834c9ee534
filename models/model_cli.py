"""``python models/yolo.py``: build a model YAML and describe it, as YOLOv5's models/yolo.py does.

    python models/yolo.py --cfg yolov5n.yaml                 # build it, print the summary line
    python models/yolo.py --cfg yolov5s.yaml --profile       # + the time of one forward and backward pass
    python models/yolo.py --cfg yolov5s.yaml --line-profile  # + each layer's forward time, parameters, type
    python models/yolo.py --test                             # build every yolo*.yaml in models/ and models/hub/

``--cfg`` takes a path or a bare name found in models/ or models/hub/.
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

LOGGER = logging.getLogger(__name__)
MODELS_DIR = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    from utils.cli import add_device_flag

    parser = argparse.ArgumentParser(prog="yolo.py", description="Build a YOLOv5 model YAML and describe it")
    parser.add_argument("--cfg", type=str, default="yolov5s.yaml", help="model.yaml (path or name in models/)")
    parser.add_argument("--batch-size", type=int, default=1, help="batch of the profiled pass")
    parser.add_argument("--imgsz", "--img", type=int, default=640, help="image size of the profiled pass")
    add_device_flag(parser)
    parser.add_argument("--profile", action="store_true", help="time one forward and backward pass")
    parser.add_argument("--line-profile", action="store_true", help="time each layer's forward pass")
    parser.add_argument("--test", action="store_true", help="build every yolo*.yaml in models/ and models/hub/")
    return parser.parse_args(argv)


def _timed(device, work) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1000


def profile(model, images) -> str:
    """One warm-up, then the forward and backward pass of ``images`` (training mode) in ms."""
    model.train()
    model(images)
    forward_ms = _timed(images.device, lambda: model(images))
    outputs = model(images)
    backward_ms = _timed(images.device, lambda: sum(output.sum() for output in outputs).backward())
    batch, size = images.shape[0], images.shape[-1]
    return f"forward {forward_ms:.1f} ms, backward {backward_ms:.1f} ms (batch {batch}, {size} px)"


def line_profile(model, images) -> list[str]:
    """Each top-level layer's forward time (ms), parameters and module type, YOLOv5's table."""
    times = {}

    def before(module, inputs):
        module._started = time.perf_counter()

    def after(module, inputs, output):
        times[module.i] = (time.perf_counter() - module._started) * 1000
    handles = [h for layer in model.model for h in (layer.register_forward_pre_hook(before),
                                                     layer.register_forward_hook(after))]
    try:
        model.eval()
        with torch.no_grad():
            model(images)  # warm-up
            model(images)
    finally:
        for handle in handles:
            handle.remove()
    lines = [f"{'time (ms)':>10s} {'params':>10s}  module"]
    for layer in model.model:
        lines.append(f"{times.get(layer.i, 0.0):10.2f} {sum(p.numel() for p in layer.parameters()):10d}  {layer.type}")
    lines.append(f"{sum(times.values()):10.2f} {'':>10s}  Total")
    return lines


def parameter_table(model) -> list[str]:
    """YOLOv5's verbose model summary: per parameter its index, name, whether it trains, size, shape, mean, std."""
    lines = [f"{'layer':>5} {'name':>40} {'gradient':>9} {'parameters':>12} {'shape':>20} {'mu':>10} {'sigma':>10}"]
    for index, (name, parameter) in enumerate(model.named_parameters()):
        values = parameter.detach().float()
        sigma = values.std().item() if values.numel() > 1 else 0.0
        lines.append(f"{index:5d} {name:>40} {str(parameter.requires_grad):>9} {parameter.numel():12d} "
                     f"{str(list(parameter.shape)):>20} {values.mean().item():10.3g} {sigma:10.3g}")
    return lines


def build_all(model_class) -> list[str]:
    lines, failed = [], []
    for path in sorted([*MODELS_DIR.glob("yolo*.yaml"), *(MODELS_DIR / "hub").glob("yolo*.yaml")]):
        try:
            LOGGER.info("%s", path.relative_to(MODELS_DIR))
            model_class(path).info()  # logs its summary line
            lines.append(str(path.relative_to(MODELS_DIR)))
        except Exception as error:  # noqa: BLE001 - every file is tried; the failures are listed
            failed.append(f"{path.relative_to(MODELS_DIR)}: {error}")
    if failed:
        from utils.errors import UserError

        raise UserError(f"{len(failed)} of {len(lines) + len(failed)} model YAMLs failed to build: "
                        + "; ".join(failed))
    return lines


def main(model_class, argv=None) -> int:
    """``model_class``: models.yolo's DetectionModel, handed over by yolo.py, which runs this: the dependency goes
    one way (yolo.py -> this module), so ``python models/yolo.py`` loads yolo.py once."""
    from utils.errors import run_main

    def work(argv):
        from utils.device import select_device
        from utils.loggers import setup_logging

        args = parse_args(argv)
        setup_logging()
        if args.test:
            LOGGER.info("%d model YAMLs built", len(build_all(model_class)))
            return 0
        device = select_device(args.device)
        model = model_class(args.cfg).to(device)
        model.info(img_size=args.imgsz)  # logs YOLOv5's summary line
        images = torch.rand(args.batch_size, 3, args.imgsz, args.imgsz, device=device)
        if args.profile:
            print(profile(model, images))
        if args.line_profile:
            print("\n".join(line_profile(model, images)))
        return 0
    return run_main("yolo.py", work, argv)
