"""gpu_check.py's ``throughput_*`` steps: training throughput of this tree against a baseline tree, one after the
other on the same card in the same lease (absolute GPU figures from different leases do not compare).

Each step trains with ``train.py --epochs 4 --noval --noplots`` at 640 on the dataset's train images repeated
REPEAT times as hard links (BCCD x8: 1,640 images), from the baseline tree first, then from this one, and reports
per tree: training images/s over epochs 2-4 (the progress bars' own times), the whole process's wall time, the time
to the first progress line, and the largest reserved GPU memory the progress bar showed. The baseline is a folder
with another commit's files and no .git, e.g.::

    mkdir -p .gpu/base && git archive 6e07f71 | tar -x -C .gpu/base
    python benchmarks/gpu_check.py --data .gpu/bccd/data.yaml --baseline .gpu/base --only throughput
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from gpu_check_runner import PROGRESS, Context, StepFailed, StepSkipped, checked, run_command, training_figures

ROOT = Path(__file__).resolve().parents[1]
REPEAT = 8
EPOCHS = 4
DECISION_EPOCHS = 10  # issue 48: --compile, --cuda-graphs kept only if a 10-epoch run, its start included, is faster
IMGSZ = 640
FEW_CORES = "0-3"  # runs with 4 workers are held to these CPUs (taskset), as the 4-cores-per-GPU target
CASES = {  # step name -> (model, batch, --cache, --workers); most telling first (issue 48's targets)
    "throughput_s64_ram": ("yolov5s", 64, "ram", 8),
    "throughput_s64_ram_w4": ("yolov5s", 64, "ram", 4),  # 4 CPU cores per GPU (FEW_CORES): a 4-GPU node, 16 cores
    "throughput_s16_ram": ("yolov5s", 16, "ram", 8),
    "throughput_n64_ram": ("yolov5n", 64, "ram", 8),
    "throughput_s64_off": ("yolov5s", 64, "off", 8),
    "throughput_s16_off": ("yolov5s", 16, "off", 8),
}


def repeated_dataset(data_yaml: str, times: int, root: Path) -> tuple[Path, int]:
    """(data.yaml, train images) of ``data_yaml``'s train images and labels repeated ``times`` times as hard links
    under ``root`` (a copy where the file system refuses links), its val split as it is. Made once; a later call
    finds it."""
    import yaml

    from utils.data.dataset_yaml import load_data_config
    from utils.data.verify import img2label_paths, list_image_files

    config = load_data_config(data_yaml)
    images = [Path(p) for p in list_image_files(config.split("train"))]
    labels = [Path(p) for p in img2label_paths([str(p) for p in images])]
    target = root / "data.yaml"
    if not target.exists():
        for folder in ("images", "labels"):
            (root / folder / "train").mkdir(parents=True, exist_ok=True)
        for copy in range(times):
            for image, label in zip(images, labels):
                _link(image, root / "images" / "train" / f"{image.stem}_{copy}{image.suffix}")
                if label.exists():
                    _link(label, root / "labels" / "train" / f"{image.stem}_{copy}.txt")
        values = {"path": str(root.resolve()), "train": "images/train",
                  "val": [str(Path(p).resolve()) for p in config.split("val")], "names": list(config.names)}
        target.write_text(yaml.safe_dump(values, sort_keys=False))
    return target, len(images) * times


def _link(source: Path, destination: Path) -> None:
    if destination.exists():
        return
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def first_progress_seconds(completed) -> float | None:
    """Seconds from the process's start to its first progress-bar line (the first training step)."""
    return next((seconds for seconds, text in completed.fragments if PROGRESS.match(text)), None)


def step_throughput(context: Context, name: str) -> dict:
    """A CASES row: the baseline tree, then this one."""
    cfg, batch, cache, workers = CASES[name]
    baseline = Path(context.args.baseline) if context.args.baseline else None
    if baseline is None:
        raise StepSkipped("no --baseline folder (another commit's files: git archive 6e07f71 | tar -x -C .gpu/base)")
    if not (baseline / "train.py").is_file():
        raise StepFailed(f"--baseline {baseline}: no train.py there")
    runs = (("baseline", baseline.resolve(), ()), ("this tree", ROOT, ()))
    return _compare(context, name, runs, cfg, batch, cache, workers, cpus=FEW_CORES if workers == 4 else "")


GENERATED_IMAGES = 10_000  # distinct COCO-like 640x480 JPEGs (benchmarks/generated_dataset.py), made on the machine
GENERATED_EPOCHS = 3


def step_generated(context: Context) -> dict:
    """The issue's second dataset: 10,000 distinct generated images, yolov5s b64 at 640 with --cache off (1.5 GB of
    JPEGs, decoded every epoch: the workers' decode is in the measurement), the baseline tree then this one, 3 epochs
    (images/s over epochs 2-3)."""
    from generated_dataset import make_photo_dataset

    baseline = Path(context.args.baseline) if context.args.baseline else None
    if baseline is None:
        raise StepSkipped("no --baseline folder (another commit's files: git archive 6e07f71 | tar -x -C .gpu/base)")
    data = make_photo_dataset(context.work / "generated", "coco", GENERATED_IMAGES)
    runs = (("baseline", baseline.resolve(), ()), ("this tree", ROOT, ()))
    return _compare(context, "generated", runs, "yolov5s", 64, "off", 8, data=(data, GENERATED_IMAGES),
                    epochs=GENERATED_EPOCHS)


def step_channels_last(context: Context) -> dict:
    """This tree with --channels-last off, then with its default (channels_last on CUDA), batch 64, --cache ram: yolov5n
    (slower than yolov5s at 6e07f71: NHWC kernels for its narrow layers are one suspect) and yolov5s."""
    figures = {}
    for cfg in ("yolov5n", "yolov5s"):
        runs = ((f"{cfg} --channels-last off", ROOT, ("--channels-last", "off")),
                (f"{cfg} default (channels_last)", ROOT, ()))
        figures.update(_compare(context, f"channels_last_{cfg}", runs, cfg, 64, "ram", 8))
    return figures


def step_cuda_graphs(context: Context) -> dict:
    """This tree without and with --cuda-graphs (the forward, loss and backward replayed as CUDA graphs) at batch 64,
    --cache ram, 8 workers: yolov5s eager, graphed, and graphed with --augment-device (4 OpenCV workers made 425
    images/s on the 2026-11-27 H100 node, so 8 make ~850 at most, under what a graphed step may take); yolov5n graphed
    with --augment-device (the issue: at least as fast as yolov5s); yolov5s at batch 16 eager and graphed (the issue's
    800 images/s: the host's launches weigh most on a small batch). Walls projected to DECISION_EPOCHS: whether the
    graphs could be CUDA's default."""
    figures = _compare(context, "cuda_graphs_yolov5s", (
        ("yolov5s eager", ROOT, ()), ("yolov5s --cuda-graphs", ROOT, ("--cuda-graphs",)),
        ("yolov5s --cuda-graphs --augment-device", ROOT, ("--cuda-graphs", "--augment-device"))),
        "yolov5s", 64, "ram", 8, project_to=DECISION_EPOCHS)
    figures.update(_compare(context, "cuda_graphs_yolov5n", (
        ("yolov5n --cuda-graphs --augment-device", ROOT, ("--cuda-graphs", "--augment-device")),),
        "yolov5n", 64, "ram", 8))
    small = _compare(context, "cuda_graphs_yolov5s_b16", (  # the batch-16 target: where launches weigh most
        ("yolov5s b16 eager", ROOT, ()), ("yolov5s b16 --cuda-graphs", ROOT, ("--cuda-graphs",))),
        "yolov5s", 16, "ram", 8, project_to=DECISION_EPOCHS)
    figures.update({key.replace("yolov5s setting", "yolov5s b16 setting"): value for key, value in small.items()})
    return figures


def step_compile(context: Context) -> dict:
    """This tree without and with --compile (torch.compile's inductor: BatchNorm fused with SiLU), yolov5s at batch 64,
    --cache ram, 8 workers: images/s over epochs 2-4 leaves the first epoch's compiling out, the wall counts it."""
    runs = (("yolov5s eager", ROOT, ()), ("yolov5s --compile", ROOT, ("--compile",)))
    return _compare(context, "compile", runs, "yolov5s", 64, "ram", 8, project_to=DECISION_EPOCHS)


def step_augment_device(context: Context) -> dict:
    """This tree's OpenCV workers, then --augment-device (the pixel work on the GPU), yolov5s b64, --cache ram and off,
    with 4 workers (4 CPU cores per GPU: where the workers set the speed); with --cache ram also --augment-device with
    --cuda-graphs (the issue's 4-core target: 1,500 images/s)."""
    figures = {}
    for cache in ("ram", "off"):
        graphed = ((f"--cache {cache}, --augment-device --cuda-graphs", ROOT, ("--augment-device", "--cuda-graphs")),)
        runs = ((f"--cache {cache}, OpenCV workers", ROOT, ()),
                (f"--cache {cache}, --augment-device", ROOT, ("--augment-device",)), *(graphed if cache == "ram" else ()))
        compared = _compare(context, f"augment_device_{cache}", runs, "yolov5s", 64, cache, 4, cpus=FEW_CORES)
        figures.update({key if key != "yolov5s setting" else f"--cache {cache} setting": value
                        for key, value in compared.items()})
    return figures


def step_augment_device_all_cores(context: Context) -> dict:
    """The same comparison with every core and 8 workers, --cache ram (where the OpenCV workers are not the bound):
    whether --augment-device could be CUDA's default without costing the machines with many cores per GPU."""
    runs = (("--cache ram, 8 workers, OpenCV workers", ROOT, ()),
            ("--cache ram, 8 workers, --augment-device", ROOT, ("--augment-device",)))
    return _compare(context, "augment_device_all_cores", runs, "yolov5s", 64, "ram", 8)


def step_decode_device(context: Context) -> dict:
    """--augment-device with the workers decoding the JPEGs, then with the GPU decoding them (--decode-device),
    yolov5s b64, --cache off, 4 workers held to 4 CPU cores (where decoding in the workers sets the speed)."""
    runs = (("--cache off, --augment-device", ROOT, ("--augment-device",)),
            ("--cache off, --augment-device --decode-device", ROOT, ("--augment-device", "--decode-device")))
    return _compare(context, "decode_device", runs, "yolov5s", 64, "off", 4, cpus=FEW_CORES)


def _compare(context: Context, name: str, runs, cfg: str, batch: int, cache: str, workers: int, data=None,
             epochs: int = EPOCHS, cpus: str = "", project_to: int = 0) -> dict:
    """Train once per (label, tree, extra flags) of ``runs``, one after the other, on ``data`` ((data.yaml, train
    images); default: the dataset given, repeated); the figures of each and the last run's images/s over the first's.
    ``cpus``: the processes are held to these CPUs (``taskset -c``) where the machine has more and taskset is there.
    ``project_to``: each run's wall also projected to that many epochs (its wall, then the further epochs at its rate
    over epochs 2..: start-up and a first epoch's one-time work counted once)."""
    data, images = data or repeated_dataset(context.data, REPEAT, context.work / f"dataset_x{REPEAT}")
    held = bool(cpus) and shutil.which("taskset") is not None and (os.cpu_count() or 0) > 4
    prefix = ["taskset", "-c", cpus] if held else []
    figures, rates = {}, []
    for number, (label, tree, extra) in enumerate(runs):
        tag = f"{name}_{number}"
        command = [*prefix, sys.executable, tree / "train.py", "--data", data, "--cfg", tree / "models" / f"{cfg}.yaml",
                   "--weights", "", "--img", IMGSZ, "--batch-size", batch, "--workers", workers, "--cache", cache,
                   "--device", 0, "--epochs", epochs, "--noval", "--noplots", "--seed", 0,
                   "--project", context.work / "runs", "--name", tag, *extra]
        completed = checked(run_command(context, tag, command, context.args.limit_train), f"{label}: train.py")
        measured = training_figures(completed, images)
        first = first_progress_seconds(completed)
        rates.append(float(measured.get("train img/s", 0)))
        figures[label] = (f"{measured.get('train img/s', '?')} img/s, wall {measured['wall']}, first step "
                          f"{first if first is None else f'{first:.1f} s'}, {measured['GPU memory (reserved)']}, "
                          f"{measured['precision']}")
        if project_to and rates[-1] > 0:
            projected = completed.seconds + (project_to - epochs) * images / rates[-1]
            figures[f"{label}: wall projected to {project_to} epochs"] = f"{projected:.0f} s"
    if len(runs) > 1 and rates[0] > 0:
        figures[f"{runs[-1][0]} / {runs[0][0]} (img/s)"] = f"{rates[-1] / rates[0]:.2f}"
    figures[f"{cfg} setting"] = (f"batch {batch} at {IMGSZ}, --cache {cache}, --workers {workers}, {epochs} epochs, "
                                 f"{images} train images" + (f", taskset -c {cpus}" if held else ""))
    return figures
