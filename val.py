"""Validate a detector on a dataset split (YOLOv5 val.py flags and output).

Usage:
    python val.py --weights runs/train/exp/weights/best.pt --data data.yaml --img 640
    python val.py --weights best.pt --data data.yaml --save-json     # + COCO JSON scored by pycocotools
    python val.py --weights best.pt --data data.yaml --task speed    # timing only (each of several weights alone)
    python val.py --weights a.pt b.pt --data data.yaml --task study  # mAP and speed at 256..1536: study.png

From Python, ``val.run(data="data.yaml", weights="best.pt", imgsz=640)`` takes the same flags as keywords and
returns the metrics (``utils.validation.ValResult``: overall and per class); ``val.run(data, model=model,
dataloader=..., compute_loss=...)`` validates a model in memory, as YOLOv5's train.py calls it (``validate_model``).

``--task train``/``val``/``test`` validate that split; ``speed`` times the val split (conf 0.25, IoU 0.45, square
batches, no plots) and ``study`` validates it at image sizes 256 to 1536 in steps of 128 (YOLOv5's); both take
several ``--weights`` one at a time (``val``/``test`` take them as an ensemble). A study writes, in one run folder,
``study_<data>_<weights>.txt`` per model (a row per size: P, R, mAP50, mAP50-95, three zeros where YOLOv5 puts the
val losses, then pre-process, inference and NMS ms per image; rewritten after each size) and ``study.png``
(mAP50-95 against inference time, one curve per model, each point labelled with its size).

``validate_weights(...)`` loads the model through ``models.composite.load_models`` (a checkpoint, or a
``.torchscript`` / ``.onnx`` file from export.py), builds a rectangular-batch loader and calls
``utils.validation.validate`` (the loop the trainer also runs every epoch on the EMA model). A static-shape
export only takes the input size it was exported at: it is validated on square letterboxed batches of that
size (rectangular batches need a ``--dynamic`` export), and a non-square static export is refused.
"""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models import is_channels_last  # noqa: E402
from utils.cli import (ArgumentParser, add_amp_flag, add_device_flag, add_half_flag, add_run_folder_flags, batch_size,  # noqa: E402
                       image_size, max_detections, probability, workers)
from utils.errors import UserError, run_main  # noqa: E402
from utils.validation import ValResult, model_dtype, validate  # noqa: E402

LOGGER = logging.getLogger("val")
TASKS = ("train", "val", "test", "speed", "study")
STUDY_SIZES = tuple(range(256, 1536 + 128, 128))  # --task study's image sizes, as YOLOv5's
ONE_AT_A_TIME = ("speed", "study")  # tasks that take several --weights one model at a time, as YOLOv5's
IN_MEMORY = ("model", "dataloader", "compute_loss", "save_dir")  # val.run's keywords for a model in memory (YOLOv5's)


@dataclass
class StudyResult:
    """``--task study``: the run folder, the image sizes and, per weights file, a row per size (``study_*.txt``'s)."""
    save_dir: Path
    sizes: tuple
    rows: dict = field(default_factory=dict)  # weights -> [[P, R, mAP50, mAP50-95, 0, 0, 0, pre, inference, NMS], ...]


class ValError(UserError):
    """A user mistake (missing file, mismatched data); val.py prints it as one line and exits 1."""


def run(*args, **options) -> ValResult:
    """Python API: ``val.run(data="data.yaml", weights="best.pt", imgsz=640, batch_size=32)``; positional
    arguments are YOLOv5's first parameters in its order (data, weights, batch_size, imgsz, ...). A ValResult
    also unpacks as YOLOv5's return value: ``(mp, mr, map50, map, *losses), maps, t = val.run(...)``.

    Keywords are val.py's flags with underscores for dashes, with the same defaults and checks (a bad value or an
    unknown keyword raises ArgumentError with the command line's one-line message; a bad file a UserError), plus
    ``plots`` (default True; False writes no plots). Returns the ``ValResult`` (mp, mr, map50, map, per_class,
    speed, save_dir); several ``weights`` (a list) are validated as their ensemble, as YOLOv5's val.py does.
    ``task="speed"`` with several weights returns a list of ValResults, one per model; ``task="study"`` a StudyResult.
    ``callbacks`` (utils.callbacks.Callbacks): YOLOv5's validation hooks, with a model or one validation of weights.
    """
    from utils.api import VAL_POSITIONS, api_call, keyword_argv, with_positions
    from utils.errors import ArgumentError

    options = with_positions("val.py", VAL_POSITIONS, args, options)
    plots = options.pop("plots", True)
    if plots is not True and plots is not False:
        raise ArgumentError(f"plots takes True or False, got {plots!r}")
    callbacks = options.pop("callbacks", None)
    in_memory = {key: options.pop(key) for key in IN_MEMORY if key in options}
    if in_memory.get("model") is None:
        if any(value is not None for value in in_memory.values()):
            raise ArgumentError(f"val.run: {', '.join(key for key in in_memory if key != 'model')} go with model=")
    elif isinstance(options.get("data"), dict):  # YOLOv5's train.py passes check_dataset's dict
        in_memory["data_dict"] = options.pop("data")
    values = vars(parse_args(keyword_argv(build_parser(), options)))
    with api_call():
        if in_memory.get("model") is not None:
            return validate_model(plots=plots, callbacks=callbacks, **in_memory, **values)
        if callbacks is not None and values["task"] in ("study", "speed"):
            raise ArgumentError(f"val.run: callbacks go with one validation, not task={values['task']}")
        return _run_task(values, plots, callbacks)


def _run_task(values: dict, plots: bool = True, callbacks=None):
    """The task of val.py's parsed flags: a ValResult, a list of them (``speed`` with several weights), or a
    StudyResult."""
    weights = values.pop("weights")
    if values["task"] in ONE_AT_A_TIME and not values["half"] and torch.cuda.is_available() \
            and values["device"] != "cpu":
        LOGGER.info("--task %s: FP16 on CUDA (--half), as YOLOv5 times its models", values["task"])
        values["half"] = True
    if values["task"] not in ONE_AT_A_TIME and values["conf_thres"] > 0.001:
        LOGGER.warning("WARNING: --conf-thres %g > 0.001: mAP is computed over the detections above it, so it comes "
                       "out lower than the model's (as YOLOv5 warns)", values["conf_thres"])
    if values["task"] == "study":
        return study(weights, sizes=STUDY_SIZES, plots=plots, **values)
    if values["task"] == "speed" and len(weights) > 1:
        return [validate_weights(weights=one, plots=plots, **values) for one in weights]
    return validate_weights(weights=weights[0] if len(weights) == 1 else weights, plots=plots, callbacks=callbacks,
                            **values)


def study(weights, sizes=STUDY_SIZES, plots: bool = True, project=ROOT / "runs/val", name="exp", exist_ok=False,
          data=None, imgsz=None, **options) -> StudyResult:
    """``--task study``: each of ``weights`` validated on the val split at each of ``sizes`` (``imgsz`` is not used),
    in one run folder: ``study_<data>_<weights>.txt`` (rewritten after each size, so an interrupted study keeps what it
    measured) and study.png."""
    from utils.files import atomic_write
    from utils.paths import increment_path
    from utils.plots import plot_val_study

    save_dir = increment_path(Path(project) / name, exist_ok=exist_ok, mkdir=True)
    result = StudyResult(save_dir, tuple(sizes))
    data_name = Path(data).stem if data else "data"
    for given in weights:
        rows = result.rows.setdefault(str(given), [])
        text = save_dir / f"study_{data_name}_{Path(given).stem}.txt"
        for size in sizes:
            LOGGER.info("\nRunning %s --imgsz %d...", text.name, size)
            one = validate_weights(weights=given, imgsz=size, data=data, plots=False, save_dir=save_dir, **options)
            map50_95, map50 = one.coco if one.coco else (one.map, one.map50)  # pycocotools' when scored, as YOLOv5
            rows.append([one.mp, one.mr, map50, map50_95, 0.0, 0.0, 0.0, *one.speed])
            atomic_write(text, "".join(" ".join(f"{value:10.4g}" for value in row) + "\n" for row in rows))
    if plots:
        plot_val_study(save_dir, sizes)
    LOGGER.info("Study saved to %s", save_dir)
    return result


def validate_weights(data=None, weights="yolov5s.pt", batch_size=32, imgsz=640, conf_thres=0.001, iou_thres=0.6,
                     max_det=300, task="val", device="", workers=8, single_cls=False, augment=False, verbose=False,
                     save_txt=False, save_hybrid=False, save_conf=False, save_json=False, project=ROOT / "runs/val",
                     name="exp", exist_ok=False, half=False, dnn=False, plots=True, amp="auto", save_dir=None,
                     callbacks=None) -> ValResult:
    """Standalone validation: model from ``weights``, rectangular batches (pad 0.5) of ``data``'s ``task`` split.

    ``task='speed'``: timing only (conf 0.25, IoU 0.45, square batches, no plots or JSON); ``'study'``: the val split
    (``study`` calls this at each size). ``save_dir``: an existing folder to write in instead of a new run folder.
    Raises ValError (and the data/checkpoint/device errors, all ValueErrors) for user mistakes.
    """
    from utils.data.loader import create_dataloader
    from utils.device import select_device
    from utils.paths import increment_path

    from models.composite import load_models
    from utils.coco import coco_val
    from utils.downloads import weights_file

    _warn_hybrid(save_hybrid)
    save_txt = save_txt or save_hybrid  # the hybrid labels are what --save-hybrid is for, as YOLOv5
    if task == "speed":
        conf_thres, iou_thres, save_json, plots = 0.25, 0.45, False, False
    paths = []
    for given in ([weights] if isinstance(weights, (str, Path)) or not weights else list(weights)):
        path = weights_file(given) if given else given  # a URL or a YOLOv5 release name is downloaded first
        if not path or not Path(path).exists():  # a file, or an OpenVINO export folder
            raise ValError(f"{path}: weights file not found")
        paths.append(Path(path))
    weights = paths[0] if len(paths) == 1 else paths
    config = _load_data(data, paths[0])
    split = "val" if task in ONE_AT_A_TIME else task
    sources = config.split(split)
    if not sources:
        raise ValError(f"{config.yaml_file}: no '{split}' split in the dataset YAML")
    device = select_device(device)
    half = half and device.type == "cuda"
    model = load_models(paths, device=device, half=half, augment=augment, dnn=dnn)
    anchors = model.anchors_text()
    if anchors:
        LOGGER.info("%s", anchors)
    names = ["item"] if single_cls and config.nc != 1 else config.names
    if not single_cls and model.nc != config.nc:
        raise ValError(f"{weights} ({model.nc} classes) was trained on other data than {config.yaml_file} "
                       f"({config.nc} classes); pass matching --data and --weights")
    stride = model.stride
    imgsz, rect, pad = _batch_geometry(model, imgsz, task, weights)
    save_dir = save_dir or increment_path(Path(project) / name, exist_ok=exist_ok, mkdir=True)
    loader, _ = create_dataloader(sources, imgsz, batch_size, stride, rect=rect, pad=pad, workers=workers,
                                  single_cls=single_cls, names=config.names, prefix=f"{split}: ")
    from utils.precision import inference_autocast

    exported = "" if getattr(model, "kind", "pytorch") == "pytorch" else model.kind
    per_class = verbose or len(names) < 50  # as YOLOv5's val.py: a row per class below 50 classes
    with inference_autocast(device, half, amp, exported):  # bf16 on CPUs with native bf16 (--amp auto); no-op on CUDA
        _warmup(model, device, imgsz)
        result = validate(model, loader, names, device, conf_thres=conf_thres, iou_thres=iou_thres, max_det=max_det,
                          save_dir=save_dir, plots=plots, half=half, verbose=per_class, single_cls=single_cls,
                          save_json=save_json, save_txt=save_txt, save_conf=save_conf,
                          save_hybrid=save_hybrid, coco=coco_val(config) if save_json else None,
                          json_name=f"{paths[0].stem}_predictions.json", callbacks=callbacks)
    if save_txt:
        count = len(list((save_dir / "labels").glob("*.txt")))
        LOGGER.info("%d labels saved to %s", count, save_dir / "labels")
    if task != "study":  # a study says where its files are once, at its end
        LOGGER.info("Results saved to %s", save_dir)
    return result


def validate_model(model, dataloader=None, compute_loss=None, save_dir=None, data_dict=None, data=None, batch_size=32,
                   imgsz=640, conf_thres=0.001, iou_thres=0.6, max_det=300, task="val", workers=8, single_cls=False,
                   verbose=False, save_txt=False, save_conf=False, project=ROOT / "runs/val", name="exp",
                   exist_ok=False, half=False, plots=True, amp="auto", augment=False, save_hybrid=False,
                   save_json=False, dnn=False, weights=None, device=None, callbacks=None) -> ValResult:
    """YOLOv5's ``val.run(model=...)``, the form its train.py calls: ``model`` a DetectionModel in memory (a training
    script's ``ema.ema``), validated on its own device; ``dataloader`` one of ``utils.dataloaders.create_dataloader``
    (YOLOv5's) or None for the ``task`` split of ``data`` (a YAML, or check_dataset's dict as ``data_dict``) at
    ``imgsz`` in rectangular batches (pad 0.5); ``compute_loss``: the val losses too; ``save_dir``: where the plots
    and ``--save-txt`` labels go (None: a new run folder when there are any). ``weights`` and ``device`` are not
    used (the model and its device are), as in YOLOv5's. The model's mode and parameters are left as they were
    (YOLOv5's casts the model to fp16 with ``half``; here fp16 autocast runs it on CUDA)."""
    from utils.data.loader import create_dataloader
    from utils.paths import increment_path
    from utils.precision import inference_autocast

    refused = [flag for flag, given in (("augment", augment), ("save_hybrid", save_hybrid), ("save_json", save_json),
                                        ("dnn", dnn)) if given]
    if refused or task in ONE_AT_A_TIME:
        what = ", ".join(refused) or f"task={task}"
        raise ValError(f"val.run(model=...): {what} validate weights files (weights=...), not a model")
    device = next(model.parameters()).device
    half = half and device.type == "cuda"
    if data_dict is not None:
        names, sources = data_dict["names"], data_dict.get(task)
        sources = [sources] if isinstance(sources, (str, Path)) else sources
    elif data is not None:
        config = _load_data(data, None)
        names, sources = config.names, config.split(task)
    else:
        names, sources = model.names, None
    names = list(names.values()) if isinstance(names, dict) else list(names)  # YOLOv5's {i: name} or a list
    names = ["item"] if single_cls and len(names) != 1 else names
    if dataloader is None:
        if not sources:
            raise ValError(f"val.run(model=...): no dataloader, and no '{task}' split in data to build one from")
        stride = int(max(model.stride))
        dataloader, _ = create_dataloader(sources, _check_imgsz(imgsz, stride), batch_size, stride, rect=True,
                                          pad=0.5, workers=workers, single_cls=single_cls, names=names,
                                          prefix=f"{task}: ")
    if save_dir is None or str(save_dir) in ("", "."):  # YOLOv5's default, Path(''), would write into the cwd
        save_dir = increment_path(Path(project) / name, exist_ok=exist_ok, mkdir=True) if plots or save_txt else None
    with inference_autocast(device, half, amp, ""):
        return validate(model, dataloader, names, device, conf_thres=conf_thres, iou_thres=iou_thres,
                        max_det=max_det, compute_loss=compute_loss, save_dir=save_dir, plots=plots, half=half,
                        verbose=verbose or len(names) < 50, single_cls=single_cls, save_txt=save_txt,
                        save_conf=save_conf, callbacks=callbacks)


def _batch_geometry(model, imgsz, task: str, weights) -> tuple[int, bool, float]:
    """(image size, rectangular batches, pad) for the loader. Checkpoints and --dynamic exports: YOLOv5's
    rectangular batches (square for --task speed). Static exports: square batches of their own size."""
    if model.imgsz is None:
        size = _check_imgsz(imgsz, model.stride)
        return (size, False, 0.0) if task == "speed" else (size, True, 0.5)
    height, width = model.imgsz
    if height != width:
        raise ValError(f"{weights} was exported for {height}x{width} inputs; val.py needs a square or a --dynamic "
                       f"export (python export.py --imgsz {max(height, width)}, or --dynamic)")
    requested = int(imgsz[0] if isinstance(imgsz, (list, tuple)) else imgsz)
    if requested != height:
        LOGGER.warning("WARNING: %s was exported for %dx%d inputs; validating at %d instead of --imgsz %d",
                       weights, height, width, height, requested)
    LOGGER.info("%s has a static input size: square %dx%d batches (a --dynamic export allows rectangular ones)",
                Path(weights).name, height, width)
    return height, False, 0.0


def _warn_hybrid(save_hybrid: bool) -> None:
    if save_hybrid:
        LOGGER.warning("WARNING: --save-hybrid: the labels and mAP are those of the ground truth and the predictions "
                       "together (YOLOv5's autolabelling), not of the predictions alone")


def _load_data(data, weights):
    """``data``, else what YOLOv5 would use: the dataset a checkpoint of ours was trained on (its stored --data;
    the embedded dataset when it was trained on that), else coco128.yaml (fetched on first use)."""
    from utils.data.dataset_yaml import load_data_config
    if data is None:
        data = _trained_on(weights)
        if data == "":
            from utils.data.synthetic import ensure_default_dataset
            data = ensure_default_dataset()
        LOGGER.info("--data not given: %s (%s)", data, "the weights were trained on it" if data != "coco128.yaml"
                    else "YOLOv5's default")
    return load_data_config(data)


def _trained_on(weights) -> str:
    """The --data a checkpoint of ours stores ('' for the embedded dataset) when that file is there, else
    'coco128.yaml' (YOLOv5's checkpoints, exported files, and checkpoints whose dataset is elsewhere)."""
    from utils.checkpoint import CheckpointError, load_checkpoint
    from utils.data.dataset_yaml import DataConfigError, find_data_yaml

    if Path(weights).suffix != ".pt":
        return "coco128.yaml"
    try:
        stored = load_checkpoint(weights).get("config")
    except CheckpointError:
        return "coco128.yaml"  # the model's own loader reports the file's problem
    data = stored.get("data") if isinstance(stored, dict) else None
    if data == "":
        return ""
    if isinstance(data, str) and data:
        try:
            return str(find_data_yaml(data))
        except DataConfigError:
            pass
    return "coco128.yaml"


def _check_imgsz(imgsz, stride: int) -> int:
    size = int(imgsz[0] if isinstance(imgsz, (list, tuple)) else imgsz)
    rounded = max(int(np.ceil(size / stride) * stride), stride)
    if rounded != size:
        LOGGER.warning("WARNING: --img-size %d must be a multiple of max stride %d, updating to %d", size, stride,
                       rounded)
    return rounded


def _warmup(model, device, imgsz: int) -> None:
    """One forward pass so one-time setup (allocations, kernel selection) is not timed as inference."""
    image = torch.zeros(1, 3, imgsz, imgsz, device=device, dtype=model_dtype(model))
    if is_channels_last(model):
        image = image.to(memory_format=torch.channels_last)
    with torch.inference_mode():
        model(image)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="val.py", description="Validate a detector on a dataset split")
    parser.add_argument("--data", type=str, default=None,
                        help="dataset.yaml path or name in data/ (default: the dataset the checkpoint was trained on, "
                             "else coco128.yaml)")
    parser.add_argument("--weights", nargs="+", type=str, default=["yolov5s.pt"],
                        help="model path(s): .pt, .torchscript, .onnx or an OpenVINO folder / .xml")
    parser.add_argument("--batch-size", type=batch_size, default=32, help="batch size")
    parser.add_argument("--imgsz", "--img", "--img-size", type=image_size, default=640, help="inference size (pixels)")
    parser.add_argument("--conf-thres", type=probability, default=0.001, help="confidence threshold")
    parser.add_argument("--iou-thres", type=probability, default=0.6, help="NMS IoU threshold")
    parser.add_argument("--max-det", type=max_detections, default=300, help="maximum detections per image")
    parser.add_argument("--task", default="val", choices=TASKS,
                        help="train, val or test (that split), speed (timing) or study (mAP and speed at image sizes "
                             "256-1536: study.png)")
    add_device_flag(parser)
    parser.add_argument("--workers", type=workers, default=8, help="max dataloader workers")
    parser.add_argument("--single-cls", action="store_true", help="treat as single-class dataset")
    parser.add_argument("--augment", action="store_true", help="augmented inference (TTA: 3 scales, a flip; .pt only)")
    parser.add_argument("--verbose", action="store_true", help="report mAP by class (always below 50 classes)")
    parser.add_argument("--save-txt", action="store_true", help="save results to *.txt")
    parser.add_argument("--save-hybrid", action="store_true",
                        help="save label+prediction hybrid results to *.txt (the ground truth joins the predictions "
                             "before NMS, as YOLOv5's autolabelling: mAP is then not the model's)")
    parser.add_argument("--save-conf", action="store_true", help="save confidences in --save-txt labels")
    parser.add_argument("--save-json", action="store_true", help="save a COCO-JSON results file")
    add_run_folder_flags(parser, str(ROOT / "runs/val"))
    add_half_flag(parser)
    add_amp_flag(parser)
    parser.add_argument("--dnn", action="store_true",
                        help="run .onnx files on OpenCV's DNN module (CPU) instead of onnxruntime")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.save_json |= bool(args.data) and str(args.data).endswith("coco.yaml")
    return args


def main(argv=None) -> int:
    """Exit code 0, 1 for a bad input file, 2 for a bad flag (see utils.errors.run_main)."""
    return run_main("val.py", _main, argv)


def _main(argv) -> int:
    args = parse_args(argv)
    from utils.loggers import setup_logging
    from utils.memory import keep_freed_memory

    setup_logging()
    keep_freed_memory()  # whole-process choice: see utils/memory.py
    _run_task(vars(args).copy())  # several weights: their ensemble, or one at a time for speed and study
    return 0


if __name__ == "__main__":
    from utils.errors import exit_process

    exit_process(main())
