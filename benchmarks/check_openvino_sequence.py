"""OpenVINO models, then loader workers and child processes, in one process (and the reverse): the process must
end cleanly. Each run is a fresh process; its exit status is reported.

    python benchmarks/check_openvino_sequence.py                  # each order once
    python benchmarks/check_openvino_sequence.py --repeat 10      # each order 10 times
    python benchmarks/check_openvino_sequence.py --folder runs/train/exp/weights/best_openvino_model --data data.yaml

One run, in one Python process: a tiny dataset (utils/data/synthetic.py, 8 training and 4 validation images) and a
randomly initialised yolov5n exported to OpenVINO with export.py's own code (--dynamic, 64x64), unless --folder
(with its --data) is given; then the steps of its order:

    forward   load, detect, train, val, child
    reverse   val, train, detect, load, child

    load      the folder loaded twice into one variable, as a caller who reloads a model does (the first model is
              freed once the second is loaded), each run on one image
    detect    detect.run on the folder (the validation images)
    train     train.run: 1 epoch at 64, batch 4, --workers 2, --cache off (worker processes read the images)
    val       val.run on the folder, --workers 2
    child     a child process started and waited for

Runs start with faulthandler on (as pytest does). After every step the calling thread's alternate signal stack must
be the one the process started with (OpenVINO's CPU plugin replaces it with its own; see
models.backends.kept_signal_stack): a step that leaves another one fails the run (exit 1), whose later steps still
run. A run killed by a signal (SIGSEGV: -11) is reported as such. Exit status: 0 when every run ended
cleanly, 1 otherwise, 2 bad flags; 3 without the optional openvino package.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ORDERS = {"forward": ("load", "detect", "train", "val", "child"),
          "reverse": ("val", "train", "detect", "load", "child")}
IMGSZ = 64
NO_OPENVINO = 3


class SignalStack(ctypes.Structure):
    """``stack_t`` of <signal.h> on Linux (read here, not through models/backends.py, so that the check also runs
    on versions without the fix)."""

    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


def signal_stack() -> tuple | None:
    """(address, flags, size) of the calling thread's alternate signal stack, None where it cannot be read."""
    if not sys.platform.startswith("linux"):
        return None
    current = SignalStack()
    if ctypes.CDLL(None).sigaltstack(None, ctypes.byref(current)) != 0:
        return None
    return current.ss_sp or 0, current.ss_flags, current.ss_size


def describe_stack(stack: tuple | None) -> str:
    if stack is None:
        return "unknown"
    address, flags, size = stack
    return "none (disabled)" if flags & 2 else f"{size} bytes at {address:#x}"


def prepare(work: Path) -> tuple[Path, Path]:
    """A tiny synthetic dataset and a random yolov5n exported to OpenVINO under ``work``: (data.yaml, folder)."""
    import export
    from models.yolo import DetectionModel
    from utils.checkpoint import model_state, save_checkpoint
    from utils.data.synthetic import CLASS_NAMES, generate_dataset

    data = generate_dataset(work / "data", train_count=8, val_count=4, workers=1)
    model = DetectionModel(str(ROOT / "models" / "yolov5n.yaml"), nc=len(CLASS_NAMES))
    model.names = list(CLASS_NAMES)
    weights = work / "weights" / "best.pt"
    weights.parent.mkdir(parents=True)
    save_checkpoint({"model": model_state(model), "ema": None}, weights)
    export.run(export.ExportConfig(weights=str(weights), imgsz=(IMGSZ, IMGSZ), include=("openvino",), dynamic=True))
    return data, weights.parent / "best_openvino_model"


def validation_images(data: Path) -> str:
    from utils.data.dataset_yaml import load_data_config

    return load_data_config(data).val[0]


def run_step(step: str, data: Path, folder: Path, work: Path) -> None:
    import detect
    import torch
    import train
    import val
    from models.backends import load_backend

    if step == "load":
        image = torch.rand(1, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(0))
        model = load_backend(folder)
        model(image)
        model = load_backend(folder)  # the first model is freed here, after the second one was loaded
        model(image)
        del model
    elif step == "detect":
        detect.run(weights=str(folder), source=validation_images(data), imgsz=IMGSZ, device="cpu", nosave=True,
                   project=str(work / "detect"))
    elif step == "train":
        train.run(data=str(data), cfg=str(ROOT / "models" / "yolov5n.yaml"), weights="", epochs=1, imgsz=IMGSZ, batch_size=4,
                  workers=2, cache=False, device="cpu", project=str(work / "train"), noplots=True,
                  no_tensorboard=True, noautoanchor=True)
    elif step == "val":
        val.run(data=str(data), weights=str(folder), imgsz=IMGSZ, batch_size=4, workers=2, device="cpu",
                project=str(work / "val"), plots=False)
    elif step == "child":
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    gc.collect()


def run_sequence(order: str, work: Path, data: Path | None, folder: Path | None) -> int:
    """One run in this process: 0 when every step left the signal stack as it found it, else 1 (the steps all run
    either way)."""
    from models.backends import BackendError, import_openvino

    try:
        import_openvino("the OpenVINO sequence")
    except BackendError as error:
        print(f"check_openvino_sequence.py: {error}", file=sys.stderr)
        return NO_OPENVINO
    start = signal_stack()
    print(f"signal stack at start: {describe_stack(start)}", flush=True)
    if folder is None:
        data, folder = prepare(work)
        print(f"exported {folder}", flush=True)
    changed = False
    for step in ORDERS[order]:
        run_step(step, data, folder, work)
        now = signal_stack()
        if now != start:  # the run goes on: a later signal shows what that stack does
            print(f"after {step}: the thread's alternate signal stack is {describe_stack(now)}, not "
                  f"{describe_stack(start)} as at start", flush=True)
            changed = True
        else:
            print(f"after {step}: signal stack as at start", flush=True)
    return 1 if changed else 0


def exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return {0: "clean", NO_OPENVINO: "openvino not installed"}.get(code, "failed")


def run_fresh(order: str, number: int, args, work: Path) -> int:
    """One run in a fresh process, in <work>/<order>-<number>-<random>/; its output goes to run.log there (its end
    is shown when the run fails)."""
    work.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{order}-{number}-", dir=work))
    command = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--in-process",
               "--order", order, "--work", str(folder)]
    if args.folder:
        command += ["--folder", str(args.folder.resolve()), "--data", str(args.data.resolve())]
    log = folder / "run.log"
    with open(log, "w") as output:
        code = subprocess.run(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT,
                              timeout=args.timeout).returncode
    print(f"{order} run {number}/{args.repeat}: exit {code} ({exit_text(code)})", flush=True)
    if code != 0 or args.verbose:
        lines = log.read_text(errors="replace").splitlines()
        print("\n".join(f"    {line}" for line in lines[-20:]), flush=True)
    return code


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--order", choices=(*ORDERS, "both"), default="both")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each order, each in a fresh process")
    parser.add_argument("--folder", type=Path, help="an OpenVINO folder to use instead of exporting a tiny model")
    parser.add_argument("--data", type=Path, help="the dataset YAML for --folder")
    parser.add_argument("--work", type=Path, help="folder for the runs' files (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--verbose", action="store_true", help="show the end of every run's output")
    parser.add_argument("--in-process", action="store_true", help="one run of --order in this process")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if (args.folder is None) != (args.data is None):
        parser.error("--folder and --data go together (the dataset the exported model was trained on)")
    if args.in_process and (args.order == "both" or args.work is None):
        parser.error("--in-process runs one --order (forward or reverse) in --work")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.in_process:
        return run_sequence(args.order, args.work, args.data, args.folder)
    orders = list(ORDERS) if args.order == "both" else [args.order]
    with tempfile.TemporaryDirectory(prefix="openvino-sequence-") as temporary:
        work = args.work or Path(temporary)
        codes = {order: [run_fresh(order, number, args, work) for number in range(1, args.repeat + 1)]
                 for order in orders}
    for order, results in codes.items():
        clean = sum(code == 0 for code in results)
        print(f"{order}: {clean}/{len(results)} clean; exit codes {results}")
    if all(code == NO_OPENVINO for results in codes.values() for code in results):
        return NO_OPENVINO
    return 0 if all(code == 0 for results in codes.values() for code in results) else 1


if __name__ == "__main__":
    sys.exit(main())
