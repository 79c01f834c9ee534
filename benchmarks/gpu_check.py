"""One command that runs every CUDA path on a machine with an NVIDIA GPU and writes one markdown report.

    python benchmarks/gpu_check.py [--data ../shared/datasets/bccd/data.yaml] [--out DIR] [--only A,B] [--skip A,B]

Steps, most valuable first (``--only`` / ``--skip`` take these names, ``train`` for the four training steps, or
``throughput`` for the throughput_* steps):

  environment   (CPU) versions, GPU, CPUs, commit, the dataset, a YOLOv5 v7 reference install
  cuda          stops here on a machine without CUDA: prints "no CUDA device: ..." and exits 3
  profile       benchmarks/profile_train_step.py --device 0 for yolov5n and yolov5s at batch 16 and 64 (640,
                --amp auto, the loader with 8 workers): images/s, each phase's GPU time, kernels and host-device
                synchronisations per step, peak reserved memory; yolov5n and yolov5s at 64 again with
                YOLO_TRAINER_STEP_CHECKS=immediate (the step before deferred checks), in the same lease
  throughput_*  train.py --epochs 4 at 640 on the train images x8 (hard links), --baseline's tree then this one:
                images/s over epochs 2-4, wall, time to the first step, reserved memory (benchmarks/gpu_throughput.py;
                yolov5s b64/b16 and yolov5n b64 with --cache ram, yolov5s b64 with 4 workers, --cache off)
  augment_device  yolov5s b64 with 4 workers, --cache ram and off: the OpenCV workers, then --augment-device
  decode_device yolov5s b64 with 4 workers, --cache off, --augment-device: the workers decode, then the GPU
                (--decode-device)
  render_ops    --augment-device's rendering of 64 mosaics at 640 on the GPU: operations, bytes, ms a batch
  loss_ops      the loss's two forms (compact; fixed shapes, all levels at once) at b64/640 on the GPU:
                operations and ms per forward and backward
  channels_last yolov5n and yolov5s b64 runs of this tree with --channels-last off, then with its default
  throughput_generated  yolov5s b64 --cache off on 10,000 generated 640x480 JPEGs (made there first), 3 epochs,
                the baseline then this tree
  tests         python -m pytest -m cuda (fails on a skipped CUDA test; a module skipped for a missing package
                is listed)
  scaler        yolov5n at 640: fp16 autocast + GradScaler step; an inf gradient skipped (weights untouched);
                a NaN loss skipped; then training goes on
  train_n_amp, train_n_fp32
                python train.py --device 0 on --data, yolov5n, 640, --epochs 10, batch 16, 8 workers,
                --amp auto (fp16) and --amp off: wall, training images/s, GPU memory, mAP
  amp_accuracy  fp16 against fp32 mAP50-95 at the last epoch (AMP_TOLERANCE)
  torchrun_nccl torchrun --nproc_per_node 1 train.py --device 0 --sync-bn: NCCL group, SyncBatchNorm, DDP
  resume_deterministic
                SIGTERM sent in the middle of epoch 2 of 3 (the run stops at the next optimizer step), --resume,
                against the uninterrupted run: identical weights and results.csv with --deterministic
  half          val.py / detect.py --half against fp32 (HALF_TOLERANCE)
  export        export.py --device 0 --half --include torchscript onnx, then val.py on both files
  tensorrt      export.py --include engine, fp32 and --half, each by val.py against the .pt (square 640 batches
                of 1); skipped with "tensorrt not installed" where the package is missing
  autobatch     train.py --batch-size -1 (yolov5s, 640, 1 epoch): the AutoBatch line, the memory the run used
  train_s_amp, train_s_fp32, amp_accuracy_s
                the same for yolov5s
  resume_default
                as resume_deterministic without --deterministic: RESUME_TOLERANCE (cuDNN)
  gloo_cpu      torchrun --nproc_per_node 2 train.py --device cpu (320, 1 epoch) on this machine's CPUs
  cross_device  the GPU-trained best.pt by val.py / detect.py on the CPU, the CPU-trained one (gloo_cpu) on the GPU
  loader        benchmarks/bench_loader.py at 640, 8 workers, no cache and --cache ram, against the GPU's
                training step on batches already on the GPU (is the GPU starved?)
  reference     YOLOv5 v7 (benchmarks/reference/README.md) with train_n_amp's settings, when installed

Each step is timed, has a time limit, and passes, fails or is skipped with its reason; train/val/detect/export
run as subprocesses whose whole output goes to <work>/logs/<step>.log. The report (gpu_check.md) goes to --out,
else $OUT, else the work folder (--work, default runs/gpu_check: a later call finds the earlier checkpoints); it
is rewritten after every step, so a call cut off at its limit still leaves one.
Exit status: 0 all passed or skipped, 1 a step failed, 3 no CUDA device (2: bad flags).

Short leases (a GPU lent for minutes, its files lost afterwards): ``--deadline SECONDS`` starts no step, and lets
no command run, past that many seconds; ``--state benchmarks/results/gpu_check_state.json`` skips the steps that
passed in an earlier lease and adds each finished step as it ends (a copy goes beside the report: commit it,
and the next lease runs what it lacks).

On a GPU machine that gets a copy of the repository without ../shared: copy the dataset into an ignored folder
of the repository first, e.g. ``mkdir -p .gpu && cp -r ../shared/datasets/bccd .gpu/`` with ``/.gpu/`` in
.git/info/exclude, and pass ``--data .gpu/bccd/data.yaml --commit <sha>`` (without .git the commit cannot be read).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "benchmarks"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from gpu_check_runner import (CHILDREN, PROGRESS, Context, StepFailed, StepResult, StepSkipped,  # noqa: E402
                              checked, child_result, commit_of, count_images, python_command, results_rows,
                              run_command, run_folder, training_figures, val_figures, validation_seconds)
from gpu_throughput import (CASES as THROUGHPUT_CASES, step_augment_device, step_augment_device_all_cores,  # noqa: E402
                            step_channels_last, step_compile, step_cuda_graphs, step_decode_device, step_generated, step_throughput)

EXIT_FAILED, EXIT_NO_CUDA = 1, 3
AMP_TOLERANCE = 0.02  # mAP50-95, fp16 below fp32 at 10 epochs: one seed each; seed-to-seed spread at 100
#                       epochs on BCCD is 0.013-0.016 (README), so a smaller difference is not distinguishable
RESUME_TOLERANCE = {"map": 0.02, "loss": 0.05}  # without --deterministic: mAP50-95 absolute, final losses relative
HALF_TOLERANCE = 0.01  # mAP50 and mAP50-95, --half against fp32 (the same weights)
CROSS_TOLERANCE = 0.005  # mAP, the same fp32 weights validated on the CPU and on the GPU
MIN_STEP_SECONDS = 20  # with --deadline: no step starts with less time than this left
TRAIN_STEPS = ("train_n_amp", "train_n_fp32", "train_s_amp", "train_s_fp32")


# ---------------------------------------------------------------------- steps before CUDA
def step_environment(context: Context) -> dict:
    import platform

    import torch

    from utils.device import usable_cpus

    figures = {"python": platform.python_version(), "torch": torch.__version__,
               "CUDA build": torch.version.cuda or "none (CPU-only torch)", "usable CPUs": usable_cpus(),
               "commit": context.args.commit or commit_of(ROOT) or "unknown (no .git: pass --commit)"}
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        figures["GPU"] = f"{torch.cuda.device_count()} x {properties.name}, {properties.total_memory / 2 ** 30:.0f} GiB"
        figures["cuDNN"] = torch.backends.cudnn.version()
    if "reference" in context.artifacts["steps"]:
        figures["YOLOv5 v7 reference"] = reference_python(context.args.reference_python) or "not installed"
    if not Path(context.data).is_file():
        raise StepFailed(f"--data {context.data}: no such file (see this script's docstring for a lent GPU machine)")
    context.artifacts["train_images"] = count_images(context.data, "train")
    figures["dataset"] = f"{context.data}: {context.artifacts['train_images']} train, " \
                         f"{count_images(context.data, 'val')} val images"
    return figures


def no_cuda_reason() -> str | None:
    """None when a CUDA device is usable, else the one-line reason."""
    import torch

    if torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
    return (f"no CUDA device: torch {torch.__version__} ({build}) sees no GPU; the remaining steps need one "
            "(run this on a machine with an NVIDIA GPU)")


def cuda_device_name() -> str:
    import torch

    return f"cuda:0 {torch.cuda.get_device_name(0)}"


def reference_python(given: str) -> str:
    """A Python that imports the yolov5 package (YOLOv5 v7), or ''."""
    for candidate in filter(None, (given, str(Path.home() / ".cache/yolov5-ref-venv/bin/python"))):
        if Path(candidate).is_file():
            probe = subprocess.run([candidate, "-c", "import yolov5"], capture_output=True, timeout=120)
            if probe.returncode == 0:
                return candidate
    return ""


# ---------------------------------------------------------------------- CUDA steps
def step_tests(context: Context) -> dict:
    completed = run_command(context, "tests", [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p",
                                               "no:cacheprovider"], context.args.limit_tests)
    summary = next((t for _, t in reversed(completed.fragments) if " in " in t and ("passed" in t or "failed" in t)),
                   "no summary line")
    checked(completed, f"pytest -m cuda: {summary.strip('= ')}")
    skips = [t for _, t in completed.fragments if t.startswith("SKIPPED")]
    cuda_skips = [t for t in skips if "CUDA" in t or "cuda" in t]  # a module skipped for a missing package is not
    if cuda_skips:                                                 # a CUDA test skipped
        raise StepFailed(f"pytest -m cuda skipped CUDA tests on a CUDA machine: {cuda_skips[0]}")
    figures = {"pytest -m cuda": summary.strip("= ")}
    if skips:
        figures["skipped (not CUDA)"] = "; ".join(t.split(": ", 1)[-1] for t in skips)
    return figures


def step_scaler(context: Context) -> dict:
    completed = run_command(context, "scaler", [sys.executable, __file__, "--child", "scaler"], 300)
    result = child_result(checked(completed, "scaler check"))
    problems = [k for k in ("fp16", "inf_step_skipped", "weights_unchanged", "scale_halved", "nan_loss_skipped",
                            "trains_after") if not result[k]]
    if problems:
        raise StepFailed(f"failed: {', '.join(problems)} ({result})")
    return {"precision": result["precision"], "scale": f"{result['scale_before']:g} -> {result['scale_after']:g}",
            "weights after the inf step": "unchanged", "NaN loss": "skipped before backward"}


def train_command(context: Context, name: str, cfg: str, *extra, batch: int = 16) -> list:
    return python_command("train.py", "--data", context.data, "--cfg", f"models/{cfg}.yaml", "--weights", "",
                          "--img", 640, "--batch-size", batch, "--workers", 8, "--device", 0, "--seed", 0,
                          "--project", context.work / "runs", "--name", name, *extra)


def step_train(context: Context, name: str) -> dict:
    cfg = "yolov5n" if "_n_" in name else "yolov5s"
    amp = "off" if name.endswith("fp32") else "auto"
    completed = run_command(context, name, train_command(context, name, cfg, "--epochs", context.args.epochs,
                                                         "--amp", amp), context.args.limit_train)
    checked(completed, f"train.py {cfg} --amp {amp}")
    folder = run_folder(completed)
    last = results_rows(folder)[-1]
    figures = training_figures(completed, context.artifacts.get("train_images", 0))
    figures.update({"mAP50": f"{last['metrics/mAP_0.5']:.4f}", "mAP50-95": f"{last['metrics/mAP_0.5:0.95']:.4f}"})
    context.artifacts[name] = {"folder": folder, "map": last["metrics/mAP_0.5:0.95"],
                               "rate": float(figures.get("train img/s", 0))}
    wanted = "fp32" if amp == "off" else "fp16"
    if wanted not in figures["precision"]:
        raise StepFailed(f"trained in '{figures['precision']}', expected {wanted}")
    return figures


def step_bf16(context: Context) -> dict:
    """bf16 autocast on the GPU (no GradScaler, so no scale to keep) against fp16: yolov5s at batch 16 for --epochs on
    the dataset, validating every epoch: training images/s, seconds per validation during training, mAP50-95 (bf16
    within AMP_TOLERANCE of fp16)."""
    figures, maps = {}, {}
    for amp in ("auto", "bf16"):
        name = f"bf16_check_{amp}"
        completed = checked(run_command(context, name, train_command(context, name, "yolov5s", "--epochs",
                                                                     context.args.epochs, "--amp", amp),
                                        context.args.limit_train), f"train.py yolov5s --amp {amp}")
        measured = training_figures(completed, count_images(context.data, "train"))
        maps[amp] = results_rows(run_folder(completed))[-1]["metrics/mAP_0.5:0.95"]
        validations = validation_seconds(completed)
        figures[f"--amp {amp}"] = (f"{measured['precision']}, {measured.get('train img/s', '?')} img/s, validation "
                                   f"{sum(validations) / max(len(validations), 1):.2f} s per epoch over "
                                   f"{len(validations)}, mAP50-95 {maps[amp]:.4f}, {measured['GPU memory (reserved)']}")
    if abs(maps["bf16"] - maps["auto"]) > AMP_TOLERANCE:
        raise StepFailed(f"bf16 mAP50-95 {maps['bf16']:.4f} against fp16 {maps['auto']:.4f}: more than "
                         f"{AMP_TOLERANCE} apart")
    return figures


def step_amp_accuracy(context: Context, model: str) -> dict:
    fp16, fp32 = context.artifacts.get(f"train_{model}_amp"), context.artifacts.get(f"train_{model}_fp32")
    if fp16 is None or fp32 is None:
        raise StepSkipped(f"needs train_{model}_amp and train_{model}_fp32 from this invocation")
    if fp16["map"] < fp32["map"] - AMP_TOLERANCE:
        raise StepFailed(f"yolov5{model}: fp16 mAP50-95 {fp16['map']:.4f} is below fp32 {fp32['map']:.4f} by "
                         f"more than {AMP_TOLERANCE}")
    return {f"yolov5{model} mAP50-95 fp16 / fp32": f"{fp16['map']:.4f} / {fp32['map']:.4f}"}


def step_autobatch(context: Context) -> dict:
    command = train_command(context, "autobatch", "yolov5s", "--epochs", 1, "--noplots", batch=-1)
    completed = run_command(context, "autobatch", command, context.args.limit_train)
    checked(completed, "train.py --batch-size -1")
    line = next((t for _, t in completed.fragments if "AutoBatch: " in t), "")
    if not line:
        raise StepFailed("no 'AutoBatch:' line in the log")
    figures = training_figures(completed, context.artifacts.get("train_images", 0))
    return {"AutoBatch": line.split("AutoBatch: ", 1)[1], "GPU memory (reserved)": figures["GPU memory (reserved)"],
            "wall": figures["wall"]}


def step_torchrun_nccl(context: Context) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               *train_command(context, "torchrun_nccl", "yolov5n", "--epochs", 2, "--sync-bn", "--noplots")[1:]]
    completed = checked(run_command(context, "torchrun_nccl", command, context.args.limit_train), "torchrun")
    text = completed.text
    expected = {"NCCL process group": "backend nccl", "SyncBatchNorm": "Using SyncBatchNorm",
                "ranks agree at the end": "identical on all 1 processes"}
    missing = [what for what, needle in expected.items() if needle not in text]
    if missing:
        raise StepFailed(f"not seen in the log: {', '.join(missing)}")
    last = results_rows(run_folder(completed))[-1]
    return {**training_figures(completed, context.artifacts.get("train_images", 0)),
            "mAP50-95": f"{last['metrics/mAP_0.5:0.95']:.4f}", "seen": ", ".join(expected)}


def step_gloo_cpu(context: Context) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "train.py"), "--data", context.data, "--cfg", "models/yolov5n.yaml", "--weights", "",
               "--img", 320, "--batch-size", 16, "--workers", 2, "--device", "cpu", "--epochs", 1, "--noplots",
               "--project", context.work / "runs", "--name", "gloo_cpu"]
    completed = checked(run_command(context, "gloo_cpu", command, context.args.limit_train), "torchrun gloo")
    starts = [t for _, t in completed.fragments if "backend gloo" in t]
    if len(starts) != 2:
        raise StepFailed(f"{len(starts)} gloo start lines, expected 2 (one per process)")
    folder = run_folder(completed)
    context.artifacts["gloo_cpu"] = {"folder": folder}
    threads = re.search(r"(\d+) compute threads", starts[0])
    return {"wall": f"{completed.seconds:.1f} s", "threads per process": threads.group(1) if threads else "?",
            "mAP50-95": f"{results_rows(folder)[-1]['metrics/mAP_0.5:0.95']:.4f}"}


def step_resume(context: Context, deterministic: bool) -> dict:
    """The uninterrupted run, the same run stopped by SIGTERM in the middle of epoch 2 of 3, its --resume."""
    name = "resume_deterministic" if deterministic else "resume_default"
    extra = ["--epochs", 3, "--noplots", *(["--deterministic"] if deterministic else [])]
    limit = context.args.limit_train
    straight = run_command(context, f"{name}_straight", train_command(context, f"{name}_straight", "yolov5n", *extra),
                           limit)
    signalled = []

    def interrupt(process, seconds, text):
        match = PROGRESS.match(text)
        if match and not signalled and match.group(1) == "2" and 2 * int(match.group(4)) >= int(match.group(5)):
            signalled.append(text.strip())
            process.send_signal(signal.SIGTERM)
    stopped = run_command(context, f"{name}_stopped", train_command(context, f"{name}_stopped", "yolov5n", *extra),
                          limit, interrupt)
    checked(straight, "the uninterrupted run")
    checked(stopped, "the run sent SIGTERM", expected=143)
    folder = run_folder(stopped)
    resumed = run_command(context, f"{name}_resumed", python_command("train.py", "--resume",
                                                                     folder / "weights" / "last.pt"), limit)
    checked(resumed, "train.py --resume")
    stop_line = next((t for _, t in stopped.fragments if "stopped by SIGTERM" in t), "?")
    figures = {"stopped": stop_line.split("stopped by ", 1)[-1].split(";")[0]}
    figures.update(compare_runs(run_folder(straight), folder, exact=deterministic))
    return figures


def compare_runs(straight: Path, resumed: Path, exact: bool) -> dict:
    """Final weights (last.pt, stripped alike) and results.csv of two runs; StepFailed beyond the tolerance."""
    from utils.checkpoint import load_checkpoint, model_entry

    weights = [model_entry(load_checkpoint(folder / "weights" / "last.pt"))["state_dict"] for folder in (straight,
                                                                                                      resumed)]
    difference = max(float((weights[0][k].double() - weights[1][k].double()).abs().max()) for k in weights[0]
                     if weights[0][k].is_floating_point() and weights[0][k].numel())
    same_csv = (straight / "results.csv").read_text() == (resumed / "results.csv").read_text()
    rows = [results_rows(folder)[-1] for folder in (straight, resumed)]
    map_gap = abs(rows[0]["metrics/mAP_0.5:0.95"] - rows[1]["metrics/mAP_0.5:0.95"])
    losses = ("train/box_loss", "train/obj_loss", "train/cls_loss")
    loss_gap = max(abs(rows[0][k] - rows[1][k]) / max(abs(rows[0][k]), 1e-12) for k in losses)
    figures = {"max weight difference": f"{difference:.3g}", "results.csv identical": "yes" if same_csv else "no",
               "mAP50-95 difference": f"{map_gap:.4f}", "final train loss difference": f"{loss_gap:.2%}"}
    if exact and (difference != 0 or not same_csv):
        raise StepFailed(f"--deterministic resume is not bit-identical: {figures}")
    if not exact and (map_gap > RESUME_TOLERANCE["map"] or loss_gap > RESUME_TOLERANCE["loss"]):
        raise StepFailed(f"resume outside the tolerance {RESUME_TOLERANCE}: {figures}")
    return figures


def trained_checkpoint(context: Context, step: str) -> Path:
    """best.pt of ``step``'s run: from this invocation, else the newest one under the work folder."""
    folder = context.artifacts.get(step, {}).get("folder")
    candidates = [folder / "weights" / "best.pt"] if folder else []
    candidates += sorted((context.work / "runs").glob(f"{step}*/weights/best.pt"), key=lambda p: p.stat().st_mtime,
                         reverse=True)
    for path in candidates:
        if path.is_file():
            return path
    raise StepSkipped(f"no best.pt from step {step} (run it first, with the same --work)")


def validate(context: Context, name: str, weights: Path, device, *extra) -> dict:
    command = python_command("val.py", "--data", context.data, "--weights", weights, "--img", 640, "--batch-size", 32,
                             "--device", device, "--project", context.work / "val", "--name", name, *extra)
    return val_figures(checked(run_command(context, name, command, context.args.limit_val), f"val.py {name}"))


def detect(context: Context, name: str, weights: Path, device, *extra) -> None:
    from utils.data.dataset_yaml import load_data_config

    source = load_data_config(context.data).val[0]
    command = python_command("detect.py", "--weights", weights, "--source", source, "--img", 640, "--device", device,
                             "--project", context.work / "detect", "--name", name, *extra)
    checked(run_command(context, name, command, context.args.limit_val), f"detect.py {name}")


def step_cross_device(context: Context) -> dict:
    gpu_trained, cpu_trained = trained_checkpoint(context, "train_n_amp"), trained_checkpoint(context, "gloo_cpu")
    on_cpu = validate(context, "cross_val_gpu_trained_on_cpu", gpu_trained, "cpu", "--amp", "off")
    on_gpu = validate(context, "cross_val_gpu_trained_on_gpu", gpu_trained, 0)
    context.artifacts["val_fp32"] = on_gpu
    detect(context, "cross_detect_gpu_trained_on_cpu", gpu_trained, "cpu")
    cpu_on_gpu = validate(context, "cross_val_cpu_trained_on_gpu", cpu_trained, 0)
    cpu_on_cpu = validate(context, "cross_val_cpu_trained_on_cpu", cpu_trained, "cpu", "--amp", "off")
    detect(context, "cross_detect_cpu_trained_on_gpu", cpu_trained, 0)
    figures = {"GPU-trained mAP50-95 on CPU / GPU": f"{on_cpu['mAP50-95']} / {on_gpu['mAP50-95']}",
               "CPU-trained mAP50-95 on CPU / GPU": f"{cpu_on_cpu['mAP50-95']} / {cpu_on_gpu['mAP50-95']}",
               "detect.py": "GPU-trained on cpu, CPU-trained on cuda: ran"}
    for a, b in ((on_cpu, on_gpu), (cpu_on_cpu, cpu_on_gpu)):
        if max(abs(a[k] - b[k]) for k in ("mAP50", "mAP50-95")) > CROSS_TOLERANCE:
            raise StepFailed(f"the same weights score differently on CPU and GPU beyond {CROSS_TOLERANCE}: {figures}")
    return figures


def step_half(context: Context) -> dict:
    weights = trained_checkpoint(context, "train_n_amp")
    fp32 = context.artifacts.get("val_fp32") or validate(context, "half_val_fp32", weights, 0)
    half = validate(context, "half_val_fp16", weights, 0, "--half")
    context.artifacts["val_half"] = half
    detect(context, "half_detect", weights, 0, "--half")
    figures = {"mAP50 fp32 / --half": f"{fp32['mAP50']} / {half['mAP50']}",
               "mAP50-95 fp32 / --half": f"{fp32['mAP50-95']} / {half['mAP50-95']}",
               "speed fp32 / --half": f"{fp32['speed']} / {half['speed']}"}
    if max(abs(fp32[k] - half[k]) for k in ("mAP50", "mAP50-95")) > HALF_TOLERANCE:
        raise StepFailed(f"--half differs from fp32 by more than {HALF_TOLERANCE}: {figures}")
    return figures


def step_export(context: Context) -> dict:
    weights = trained_checkpoint(context, "train_n_amp")
    command = python_command("export.py", "--weights", weights, "--device", 0, "--half", "--img", 640,
                             "--include", "torchscript", "onnx")
    completed = checked(run_command(context, "export", command, context.args.limit_val), "export.py --half")
    figures = {line.split("parity: ", 1)[0].split()[-1]: line.split("parity: ", 1)[1]
               for _, line in completed.fragments if "parity: " in line}
    failures = []
    for suffix in (".torchscript", ".onnx"):
        try:
            scores = validate(context, f"export_val{suffix.replace('.', '_')}", weights.with_suffix(suffix), 0)
            figures[f"val.py {suffix} mAP50-95 (square 640 batches)"] = scores["mAP50-95"]
        except StepFailed as error:
            failures.append(str(error))
    if failures:
        raise StepFailed("; ".join(failures))
    return figures


def step_tensorrt(context: Context) -> dict:
    """export.py --include engine (fp32, then --half) from train_n_amp's best.pt, each validated by val.py against the
    .pt at the same geometry (square 640 batches of 1: the engine's fixed shape)."""
    try:
        import tensorrt
    except ImportError:
        raise StepSkipped("tensorrt not installed (pip install tensorrt where the machine reaches a registry): the "
                          "TensorRT export is unverified") from None
    weights = trained_checkpoint(context, "train_n_amp")
    figures = {"tensorrt": tensorrt.__version__}
    reference = validate(context, "tensorrt_val_pt", weights, 0, "--task", "speed", "--batch-size", 1)
    figures[".pt mAP50-95 (square 640, batch 1)"] = reference["mAP50-95"]
    failures = []
    for name, extra in (("fp32", ()), ("fp16", ("--half",))):
        folder = context.work / "tensorrt" / name
        folder.mkdir(parents=True, exist_ok=True)
        copy = folder / weights.name
        if not copy.exists():
            copy.write_bytes(weights.read_bytes())
        command = python_command("export.py", "--weights", copy, "--device", 0, "--img", 640, "--include", "engine",
                                 *extra)
        completed = checked(run_command(context, f"tensorrt_export_{name}", command, context.args.limit_val),
                            f"export.py --include engine {name}")
        figures.update({f"{name} {line.split('parity: ', 1)[0].split()[-1]}": line.split("parity: ", 1)[1]
                        for _, line in completed.fragments if "parity: " in line})
        scores = validate(context, f"tensorrt_val_{name}", copy.with_suffix(".engine"), 0, "--task", "speed",
                          "--batch-size", 1)
        figures[f"{name} engine mAP50-95 / speed"] = f"{scores['mAP50-95']} / {scores['speed']}"
        if abs(scores["mAP50-95"] - reference["mAP50-95"]) > HALF_TOLERANCE:
            failures.append(f"the {name} engine scores {scores['mAP50-95']} against the .pt's {reference['mAP50-95']}")
    if failures:
        raise StepFailed("; ".join(failures))
    return figures


def step_loader(context: Context) -> dict:
    command = python_command("benchmarks/bench_loader.py", "--data", context.data, "--imgsz", 640, "--workers", 8,
                             "--seconds", 20, "--cache-rows", "--yolov5", "")
    completed = checked(run_command(context, "loader", command, context.args.limit_train), "bench_loader.py")
    rows = re.findall(r"\| 640 \| 8 \| (\S+) \| ours[^|]* \| ([\d.]+) \|", completed.text)
    figures = {f"loader 640, 8 workers, cache {cache}": f"{float(rate):.0f} img/s" for cache, rate in rows}
    for cfg in ("yolov5n", "yolov5s"):
        step = run_command(context, f"loader_step_{cfg}", [sys.executable, __file__, "--child", "step-rate",
                                                           "--cfg", cfg], 300)
        result = child_result(checked(step, f"{cfg} step rate"))
        figures[f"GPU step {cfg} ({result['precision']}, batch 16, data on the GPU)"] = (
            f"{result['images_per_s']:.0f} img/s ({result['step_ms']:.1f} ms/step)")
        if rows:
            cached = float(dict(rows).get("ram", rows[-1][1]))
            figures[f"GPU starved ({cfg})"] = "yes" if cached < result["images_per_s"] else "no"
    if not rows:
        raise StepFailed("bench_loader.py printed no 640 / 8 workers rows")
    return figures


def step_render_ops(context: Context) -> dict:
    """--augment-device's rendering on the GPU: operations, bytes moved and ms per batch of 64 mosaics at 640
    (benchmarks/render_ops.py)."""
    command = python_command("benchmarks/render_ops.py", "--data", context.data, "--imgsz", IMGSZ_RENDER,
                             "--batch-size", 64, "--batches", 4, "--rounds", 5, "--device", "cuda:0")
    completed = checked(run_command(context, "render_ops", command, 300), "render_ops.py")
    text = "\n".join(text for _, text in completed.fragments)
    row = re.search(r"^render: operations per batch \[([\d, ]+)\]; ([\d.]+) ms a batch", text, re.MULTILINE)
    moved = re.search(r"read and written per batch: ([\d.]+) GB", text)
    if row is None or moved is None:
        raise StepFailed("render_ops.py printed no row")
    return {"render b64 640": f"{row.group(2)} ms a batch, {row.group(1).split(',')[0]} operations, "
                              f"{moved.group(1)} GB read and written"}


IMGSZ_RENDER = 640


# loss_ops.py's row: (form, forward operations, backward operations, ms a call, the loss)
LOSS_OPS_ROW = re.compile(r"^(.+?): operations forward (\d+), backward (\d+); ([\d.]+) ms a call .*; loss ([\d.e+-]+),",
                          re.MULTILINE)


def step_loss_ops(context: Context) -> dict:
    """The loss on the GPU in both forms (compact; fixed shapes, CUDA's with deferred checks, all levels at once):
    operations and ms per forward and backward, yolov5s's head at b64/640 with 8 boxes an image
    (benchmarks/loss_ops.py), and whether the two losses agree."""
    command = python_command("benchmarks/loss_ops.py", "--imgsz", 640, "--batch-size", 64, "--rounds", 20,
                             "--device", "cuda:0")
    completed = checked(run_command(context, "loss_ops", command, 300), "loss_ops.py")
    rows = LOSS_OPS_ROW.findall("\n".join(text for _, text in completed.fragments))
    if len(rows) != 2:
        raise StepFailed("loss_ops.py printed no two rows")
    figures = {f"loss b64 640, {name}": f"{ms} ms a call, {forward} + {backward} operations"
               for name, forward, backward, ms, _ in rows}
    compact, fixed = (float(row[4]) for row in rows)
    figures["loss b64 640, the two forms agree"] = "yes" if abs(compact - fixed) <= 1e-5 * abs(compact) else "NO"
    return figures


def step_graph_memory(context: Context) -> dict:
    """--cuda-graphs' memory with a smaller last batch (yolov5s at 640, 64 then 40 images, as BCCD x8 ends an
    epoch): the peak reserved memory eagerly, with the last batch eager beside the graphs' pool (the flag today), with
    it graphed by a second make_graphed_callables, and with both shapes captured on one stream into one pool
    (benchmarks/graph_memory.py), each against eager, also after a validation pass at twice the batch; and the
    last's replayed gradients against eager ones."""
    command = python_command("benchmarks/graph_memory.py", "--imgsz", 640, "--batch-size", 64, "--last", 40, "--json")
    completed = checked(run_command(context, "graph_memory", command, 300), "graph_memory.py")
    lines = [text for _, text in completed.fragments if text.startswith("{")]
    if not lines:
        raise StepFailed("graph_memory.py printed no JSON line")
    figures = {}
    for case in json.loads(lines[-1])["cases"]:
        name = f"memory, {case['case']}"
        if "error" in case:
            figures[name] = case["error"]
            continue
        figures[name] = (f"peak reserved {case['peak reserved']:.2f} GiB ({case.get('x eager', 0):.2f}x eager; "
                         f"{case['before last']:.2f} before the last batch; with a validation pass "
                         f"{case['peak with validation']:.2f}, {case.get('x eager with validation', 0):.2f}x eager's)")
        if "last batch gradients, largest relative difference" in case:
            figures["memory, one stream and pool: last batch's gradients against eager"] = \
                f"{case['last batch gradients, largest relative difference']:.1e} (relative, largest)"
    return figures


# (label, model, batch, environment, extra flags, profiled): the defaults (deferred checks on CUDA, channels_last,
# cudnn.benchmark off) with batches from the loader, then with held batches (the GPU's step alone) and one change at
# a time: the step as it was before deferred checks and the fixed-shape loss (YOLO_TRAINER_STEP_CHECKS=immediate),
# cuDNN's own algorithm timing, NCHW. All at 640, --amp auto, 8 workers, on the dataset repeated x8.
IMMEDIATE = {"YOLO_TRAINER_STEP_CHECKS": "immediate"}
PROFILE_CASES = (
    ("yolov5s b64 loader", "yolov5s", 64, None, ("--source", "loader"), True),
    ("yolov5s b64 held", "yolov5s", 64, None, (), True),
    ("yolov5s b64 held, immediate checks", "yolov5s", 64, IMMEDIATE, (), False),
    ("yolov5s b64 held, cudnn.benchmark", "yolov5s", 64, None, ("--cudnn-benchmark",), True),
    ("yolov5s b64 held, NCHW", "yolov5s", 64, None, ("--channels-last", "off"), False),
    ("yolov5n b64 held", "yolov5n", 64, None, (), True),
    ("yolov5n b64 held, cudnn.benchmark", "yolov5n", 64, None, ("--cudnn-benchmark",), False),
    ("yolov5n b64 held, NCHW", "yolov5n", 64, None, ("--channels-last", "off"), False),
    ("yolov5s b16 held", "yolov5s", 16, None, (), True),
    ("yolov5s b16 held, cudnn.benchmark", "yolov5s", 16, None, ("--cudnn-benchmark",), False),
    ("yolov5n b64 loader", "yolov5n", 64, None, ("--source", "loader"), False),
)


def profile_case(context: Context, name: str, cfg: str, batch: int, *extra, environment=None, limit: float = 150
                 ) -> dict:
    """benchmarks/profile_train_step.py on the GPU: ``cfg`` at 640 and ``batch``, --amp auto, 4 batches of the dataset
    repeated x8 collated by 8 workers and replayed (the step alone), 20 timed steps; its JSON (also in the logs as
    <name>.json)."""
    from gpu_throughput import REPEAT, repeated_dataset

    data, _ = repeated_dataset(context.data, REPEAT, context.work / f"dataset_x{REPEAT}")
    output = context.work / "logs" / f"{name}.json"
    command = python_command("benchmarks/profile_train_step.py", "--device", 0, "--cfg", f"models/{cfg}.yaml",
                             "--data", data, "--imgsz", 640, "--batch-size", batch, "--amp", "auto",
                             "--source", "memory", "--hold", 4, "--workers", 8, "--steps", 20, "--top", 25,
                             "--json", output, *extra)
    checked(run_command(context, name, command, limit, extra_env=environment), f"profile_train_step.py ({name})")
    return json.loads(output.read_text())


def cuda_tests(context: Context, name: str, keyword: str, *files: str, limit: float = 180) -> dict:
    """``pytest -m cuda`` on ``files`` selected by ``keyword``: its summary line and, when one fails, the frames that
    name where (a synchronisation the sync-debug mode refused, say)."""
    test = run_command(context, name, [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                                       "--tb=short", *files, "-k", keyword], limit)
    lines = [text for _, text in test.fragments]
    figures = {f"cuda tests ({keyword})": next((line for line in reversed(lines) if "passed" in line
                                                or "failed" in line), "no summary")}
    if test.returncode:
        where = [line.strip() for line in lines if line.lstrip().startswith(("utils/", "models/", "tests/", "E "))]
        figures["cuda tests: where"] = " | ".join(where[-8:])[:600]
    return figures


def tests_passed(figures: dict) -> dict:
    """``figures`` of a step that ran cuda_tests before measuring; StepFailed with them when a test failed."""
    if "cuda tests: where" in figures:
        summary = next(value for key, value in figures.items() if key.startswith("cuda tests ("))
        raise StepFailed(f"cuda tests: {summary}", figures)
    return figures


def sites(result: dict) -> str:
    return "; ".join(f"{n:.2f} {site}" for site, n in result.get("sync_sites_per_step", {}).items()) or "none"


def step_profile(context: Context) -> dict:
    """PROFILE_CASES through profile_case: the phases of a training step (CUDA events), kernels and synchronisations
    per step (profile_<n>.json beside the logs)."""
    figures = {}
    for number, (label, cfg, batch, environment, extra, profiled) in enumerate(PROFILE_CASES):
        result = profile_case(context, f"profile_{number}", cfg, batch, *extra,
                              *(() if profiled else ("--no-profile",)), environment=environment, limit=120)
        phases = ", ".join(f"{phase} {times['gpu_ms']:.1f}" for phase, times in result["phases"].items())
        host = sum(times["host_ms"] for phase, times in result["phases"].items() if phase != "data")
        syncs = sum(result.get("syncs_per_step", {}).values())
        counted = (f"; {result['kernels_per_step']:.0f} kernels and {syncs:.1f} syncs per step"
                   if "kernels_per_step" in result else "")
        figures[label] = (f"{result['images_per_s']:.0f} img/s, {result['step_ms']:.1f} ms/step (GPU ms: {phases}; "
                          f"host ms outside data {host:.1f}){counted}; {result.get('max_memory_reserved_gb', 0):.1f} GB")
    return figures


def step_sync_sites(context: Context) -> dict:
    """Where a CUDA training step still waits for the device: tests/test_cuda.py's sync-debug test (its failure names
    the call), then yolov5s at batch 64 profiled, with 10 more steps under ``set_sync_debug_mode("warn")`` tallied by
    the project's frames that asked (profile_train_step.py --sync-debug)."""
    figures = cuda_tests(context, "sync_test", "steady_state_step", "tests/test_cuda.py")
    result = profile_case(context, "sync_sites", "yolov5s", 64, "--sync-debug", 10)
    figures["yolov5s b64 held"] = f"{result['images_per_s']:.0f} img/s, {result['step_ms']:.1f} ms/step"
    figures["syncs per step by site"] = sites(result)
    figures["host ms per step, top operators"] = "; ".join(
        f"{name} {ms:.2f}" for name, ms in list(result.get("host_ms_per_step_by_operator", {}).items())[:12])
    return figures


def step_graphs_step(context: Context) -> dict:
    """--cuda-graphs on the step: the cuda tests of the graphed step (train.py's too, capturing while the loader's
    pin thread pins), of a step that never waits (set_sync_debug_mode), of the pinned loader's reused buffers (every
    CUDA run loads through them), of the JPEG decode's stream, of the batches' side-stream copies and of fp16
    upsampling; then yolov5s at
    batch 64 eager, with the model and loss graphed and with the model alone graphed, phases and host operators each,
    the graphed one also tallying any synchronisation by site (profile_train_step.py --cuda-graphs --sync-debug); and
    eager with each batch copied on the training stream between two steps, as before the side-stream copies (the
    phases only)."""
    figures = cuda_tests(context, "graphs_test",
                         "graphs or steady_state_step or pins_memory or never_writes or side_stream or fp16_upsampling",
                         "tests/test_cuda_graphs.py", "tests/test_cuda.py", "tests/test_decode_device.py",
                         "tests/test_feed.py", "tests/test_amp.py",
                         limit=270)  # with two short train.py runs (the capture beside the pin thread)
    figures.update(profiled_variants(context, (("eager", "graphs_step_eager", ()),
                                               ("--cuda-graphs", "graphs_step_graphs", ("--cuda-graphs", "--sync-debug",
                                                                                        10)),
                                               ("--cuda-graphs, the model alone (the loss eager)", "graphs_step_model",
                                                ("--cuda-graphs-model",)),
                                               ("eager, each batch copied between two steps (as before 8d3a8ea)",
                                                "graphs_step_inline", ("--copies", "inline", "--no-profile")))))
    return tests_passed(figures)


def step_compile_step(context: Context) -> dict:
    """--compile on the step: its cuda test (inductor's kernels train as eager within rounding, with no synchronisation
    in a step), then yolov5s at batch 64 eager and compiled (the warm-up steps compile), each with its phases, kernels
    per step and the kernels' GPU time by family: what fusing BatchNorm with SiLU saves, against what remains."""
    figures = cuda_tests(context, "compile_test", "inductor", "tests/test_compiled.py")
    figures.update(profiled_variants(context, (("eager", "compile_step_eager", ()),
                                               ("--compile", "compile_step_compiled", ("--compile",))), limit=420))
    return tests_passed(figures)


def profiled_variants(context: Context, variants, limit: float = 180) -> dict:
    """profile_case for each (label, name, extra arguments) of yolov5s at batch 64: the rate, the phases' host and
    GPU times, kernels per step, memory, and where present the synchronisations by site and the kernels' time by
    family."""
    figures = {}
    for label, name, extra in variants:
        result = profile_case(context, name, "yolov5s", 64, *extra, limit=limit)
        phases = ", ".join(f"{phase} {times['host_ms']:.1f}/{times['gpu_ms']:.1f}"
                           for phase, times in result["phases"].items())
        figures[f"yolov5s b64 held, {label}"] = (
            f"{result['images_per_s']:.0f} img/s, {result['step_ms']:.1f} ms/step (host/GPU ms: {phases}); "
            f"{result.get('kernels_per_step', 0):.0f} kernels per step; {result.get('max_memory_reserved_gb', 0):.1f} GB")
        if "sync_sites_per_step" in result:
            figures[f"{label}: syncs per step by site"] = sites(result)
        if result.get("gpu_ms_per_step_by_kernel_family"):
            figures[f"{label}: GPU ms per step by kernel family"] = "; ".join(
                f"{family} {ms:.1f}" for family, ms in result["gpu_ms_per_step_by_kernel_family"].items())
        if result.get("gpu_ms_per_step_top_kernels"):
            figures[f"{label}: costliest kernels of the open families, GPU ms per step"] = " | ".join(
                f"{family}: " + "; ".join(f"{name} {ms:.2f}" for name, ms in listed)
                for family, listed in result["gpu_ms_per_step_top_kernels"].items())
    return figures


def step_reference(context: Context) -> dict:
    """YOLOv5 v7 with train_n_amp's settings on a copy of the dataset (it writes label caches beside the labels)."""
    import shutil

    import yaml

    from utils.safe_yaml import read_yaml

    python = reference_python(context.args.reference_python)
    if not python:
        raise StepSkipped("YOLOv5 v7 is not installed here (benchmarks/reference/README.md): our figures alone")
    folder = context.work / "reference"
    dataset = folder / "dataset"
    if not dataset.exists():
        shutil.copytree(Path(context.data).resolve().parent, dataset)
    values = read_yaml(context.data)
    values["path"] = str(dataset.resolve())
    (folder / "data.yaml").write_text(yaml.safe_dump(values))
    name = f"n{int(time.time())}"
    command = [python, "-m", "yolov5.train", "--data", folder / "data.yaml", "--cfg", "yolov5n.yaml", "--weights", "",
               "--img", 640, "--batch-size", 16, "--epochs", context.args.epochs, "--workers", 8, "--device", 0,
               "--project", folder / "runs", "--name", name]
    completed = checked(run_command(context, "reference", command, context.args.limit_reference,
                                    extra_env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}),  # v7 pickles whole models
                        "YOLOv5 v7 train")
    last = results_rows(folder / "runs" / name)[-1]
    ours = context.artifacts.get("train_n_amp", {})
    return {"YOLOv5 v7 wall": f"{completed.seconds:.1f} s", "YOLOv5 v7 mAP50-95": f"{last['metrics/mAP_0.5:0.95']:.4f}",
            "ours (train_n_amp) mAP50-95": f"{ours['map']:.4f}" if ours else "not run in this call"}


# ---------------------------------------------------------------------- the run and the report
STEPS = {  # most valuable first: a short lease runs the head of this list (see --deadline and --state)
    "environment": step_environment,
    "cuda": None,  # the gate: every step below needs a CUDA device
    "graphs_step": step_graphs_step,  # --cuda-graphs: its cuda tests, and the step eager against graphed
    "cuda_graphs": step_cuda_graphs,  # --cuda-graphs in training: yolov5s b64 eager, graphed, with --augment-device
    "graph_memory": step_graph_memory,  # --cuda-graphs' peak memory with a smaller last batch, four ways
    "compile_step": step_compile_step,  # --compile: its cuda test, and the step eager against compiled (kernel families)
    "compile": step_compile,  # --compile in training: yolov5s b64, eager then compiled (the wall counts the compiling)
    "bf16": step_bf16,  # bf16 autocast against fp16: speed, validation time per epoch, accuracy
    "sync_sites": step_sync_sites,  # which calls in a CUDA step still wait for the device, and the host's operators
    "profile": step_profile,  # where a training step's time goes (issue: keep the GPU busy): measured first
    **{name: (lambda context, name=name: step_throughput(context, name)) for name in THROUGHPUT_CASES},
    "augment_device": step_augment_device,  # the pixel work on the GPU against the OpenCV workers, 4 workers
    "augment_device_all_cores": step_augment_device_all_cores,  # the same with every core, 8 workers, --cache ram
    "decode_device": step_decode_device,  # --cache off, 4 workers: JPEGs decoded by the workers, then on the GPU
    "render_ops": step_render_ops,  # --augment-device's rendering on the GPU: operations, bytes moved, time
    "loss_ops": step_loss_ops,  # the loss's two forms, operations and time per call, on the GPU
    "channels_last": step_channels_last,  # re-measured on CUDA: on by default there
    "throughput_generated": step_generated,  # 10,000 distinct generated images, --cache off (generated here first)
    "tests": step_tests,
    "scaler": step_scaler,
    "train_n_amp": lambda context: step_train(context, "train_n_amp"),
    "train_n_fp32": lambda context: step_train(context, "train_n_fp32"),
    "amp_accuracy": lambda context: step_amp_accuracy(context, "n"),
    "torchrun_nccl": step_torchrun_nccl,
    "resume_deterministic": lambda context: step_resume(context, deterministic=True),
    "half": step_half,
    "export": step_export,
    "tensorrt": step_tensorrt,
    "autobatch": step_autobatch,
    "train_s_amp": lambda context: step_train(context, "train_s_amp"),
    "train_s_fp32": lambda context: step_train(context, "train_s_fp32"),
    "amp_accuracy_s": lambda context: step_amp_accuracy(context, "s"),
    "resume_default": lambda context: step_resume(context, deterministic=False),
    "gloo_cpu": step_gloo_cpu,
    "cross_device": step_cross_device,
    "loader": step_loader,
    "reference": step_reference,
}


GROUPS = {"train": TRAIN_STEPS, "throughput": tuple(THROUGHPUT_CASES)}  # names --only/--skip take for several steps


def selected_steps(only: str, skip: str) -> list[str]:
    """Step names in order; 'train' means the four training steps, 'throughput' the throughput_* steps; environment
    and the CUDA gate always run."""
    def expand(text: str) -> set:
        names = set()
        for name in filter(None, (n.strip() for n in text.split(","))):
            if name not in STEPS and name not in GROUPS:
                print(f"gpu_check.py: error: unknown step '{name}' (steps: {', '.join(STEPS)}, {', '.join(GROUPS)})",
                      file=sys.stderr)
                raise SystemExit(2)
            names |= set(GROUPS.get(name, (name,)))
        return names
    wanted, unwanted = expand(only) or set(STEPS), expand(skip)
    return [name for name in STEPS if name in ("environment", "cuda") or (name in wanted and name not in unwanted)]


def run_step(context: Context, name: str) -> StepResult:
    result, start = StepResult(name), time.monotonic()
    first_command = len(context.commands)
    try:
        result.figures = STEPS[name](context) or {}
    except StepFailed as error:
        result.status, result.detail, result.figures = "fail", str(error), error.figures
    except StepSkipped as error:
        result.status, result.detail = "skip", str(error)
    except Exception as error:  # a bug in one step must not hide the others' results
        import traceback

        result.status, result.detail = "fail", f"{type(error).__name__}: {error}"
        log = context.work / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(traceback.format_exc())
    result.seconds = time.monotonic() - start
    result.command = "; ".join(context.commands[first_command:])
    logs = sorted((context.work / "logs").glob(f"{name}*.log"), key=lambda p: p.stat().st_mtime)
    result.log = logs[-1] if logs else None
    context.results[name] = result
    return result


def step_line(result: StepResult) -> str:
    figures = "; ".join(f"{key} {value}" for key, value in result.figures.items())
    return f"{result.name:22s} {result.status:4s} {result.seconds:7.1f} s  {result.detail or figures}"


def report_path(context: Context) -> Path:
    """gpu_check.md (gpu_check2.md, ... if taken) in --out, else $OUT, else the work folder; chosen once a call."""
    if "report" not in context.artifacts:
        folder = Path(context.args.out or os.environ.get("OUT") or context.work)
        folder.mkdir(parents=True, exist_ok=True)
        path, number = folder / "gpu_check.md", 2
        while path.exists():
            path, number = folder / f"gpu_check{number}.md", number + 1
        context.artifacts["report"] = path
    return context.artifacts["report"]


def write_report(context: Context, stopped: str = "") -> Path:
    """The report as it stands: rewritten after every step, so a call cut off at its limit still leaves one."""
    path = report_path(context)
    environment = context.results.get("environment")
    lines = ["# GPU check", "", f"`{' '.join(sys.argv)}` at {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", ""]
    if environment is not None:
        lines += [f"- {key}: {value}" for key, value in environment.figures.items()] + [""]
    if stopped:
        lines += [f"**{stopped}**", ""]
    lines += ["| step | result | time | figures |", "|---|---|---|---|"]
    for result in context.results.values():
        figures = "; ".join(f"{k}: {v}" for k, v in result.figures.items()) or result.detail
        lines.append(f"| {result.name} | {result.status} | {result.seconds:.1f} s | {figures.replace('|', '/')} |")
    lines += ["", f"Tolerances: fp16 vs fp32 training mAP50-95 {AMP_TOLERANCE}; --half vs fp32 validation "
                  f"{HALF_TOLERANCE}; the same weights on CPU vs GPU {CROSS_TOLERANCE}; resume without "
                  f"--deterministic {RESUME_TOLERANCE} (mAP50-95 absolute, final losses relative); with "
                  "--deterministic: identical.", ""]
    for result in context.results.values():
        if result.status == "fail":
            lines += [f"## {result.name}: failed", "", result.detail, "", f"Commands: `{result.command or '-'}`", ""]
            if result.log is not None and result.log.exists():
                tail = result.log.read_text(errors="replace").replace("\r", "\n").splitlines()[-40:]
                lines += [f"Last lines of {result.log}:", "", "```", *tail, "```", ""]
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("\n".join(lines) + "\n", encoding="utf-8")
    temporary.replace(path)
    return path


# ---------------------------------------------------------------------- the state kept across leases
def read_state(path: str) -> dict:
    """{step: {status, seconds, figures, detail, commit, device, date}} from --state, {} when there is none."""
    if not path or not Path(path).is_file():
        return {}
    try:
        steps = json.loads(Path(path).read_text(encoding="utf-8")).get("steps", {})
    except (OSError, ValueError, AttributeError) as error:
        print(f"gpu_check.py: error: --state {path}: not a state file ({error})", file=sys.stderr)
        raise SystemExit(2)
    return {name: entry for name, entry in steps.items() if name in STEPS and isinstance(entry, dict)}


def write_state(context: Context, result: StepResult) -> None:
    """Add one finished step to --state (and a copy beside the report): a later lease runs the steps it lacks."""
    if not context.args.state:
        return
    steps = read_state(context.args.state)
    environment = context.results.get("environment")
    steps[result.name] = {"status": result.status, "seconds": round(result.seconds, 1), "figures": result.figures,
                          "detail": result.detail, "date": time.strftime("%Y-%m-%d"),
                          "commit": (environment.figures.get("commit", "") if environment else ""),
                          "device": context.results["cuda"].figures.get("device", "") if "cuda" in context.results
                          else ""}
    text = json.dumps({"steps": {name: steps[name] for name in STEPS if name in steps}}, indent=1) + "\n"
    for path in {Path(context.args.state), report_path(context).with_name("gpu_check_state.json")}:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(text, encoding="utf-8")
        temporary.replace(path)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT.parent / "shared/datasets/bccd/data.yaml"))
    parser.add_argument("--out", default="", help="folder for gpu_check.md (default: $OUT, else --work)")
    parser.add_argument("--work", default=str(ROOT / "runs/gpu_check"), help="runs, logs, exports")
    parser.add_argument("--only", default="", help="comma-separated step names (or 'train')")
    parser.add_argument("--skip", default="", help="comma-separated step names (or 'train')")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of the train_* and reference steps")
    parser.add_argument("--commit", default="", help="the commit checked, when there is no .git to read it from")
    parser.add_argument("--reference-python", default="", help="a Python with YOLOv5 v7 (yolov5 7.0.14) installed")
    parser.add_argument("--limit-train", type=float, default=480, help="seconds per training command")
    parser.add_argument("--limit-val", type=float, default=240, help="seconds per val/detect/export command")
    parser.add_argument("--limit-tests", type=float, default=480, help="seconds for pytest -m cuda")
    parser.add_argument("--limit-reference", type=float, default=900, help="seconds for YOLOv5 v7's training")
    parser.add_argument("--baseline", default="", help="another commit's files (no .git) for the throughput steps: "
                        "git archive 6e07f71 | tar -x -C .gpu/base")
    parser.add_argument("--deadline", type=float, default=0,
                        help="seconds from the start after which no step starts and no command runs on (0: none)")
    parser.add_argument("--state", default="", help="a JSON file of finished steps: those that passed there are "
                        "not run again (unless --only names them); each step's result is added as it ends")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--cfg", default="yolov5n", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(CHILDREN[args.child](args)), flush=True)
        return 0
    steps = selected_steps(args.only, args.skip)
    context = Context(args, Path(args.work).resolve())
    if args.deadline > 0:
        context.deadline = time.monotonic() + args.deadline
    context.artifacts["steps"] = steps
    context.work.mkdir(parents=True, exist_ok=True)
    earlier = read_state(args.state)
    named = set(selected_steps(args.only, "")) if args.only else set()
    print(f"gpu_check: {len(steps)} steps; logs in {context.work / 'logs'}", flush=True)
    for name in steps:
        if name == "cuda":
            reason = no_cuda_reason()
            if reason:
                print(reason, flush=True)
                context.results["cuda"] = StepResult("cuda", "stop", detail=reason)
                for later in steps[steps.index("cuda") + 1:]:
                    context.results[later] = StepResult(later, "not run", detail="needs a CUDA device")
                print(f"report: {write_report(context, reason)}")
                return EXIT_NO_CUDA
            context.results["cuda"] = StepResult("cuda", figures={"device": cuda_device_name()})
            continue
        entry = earlier.get(name)
        if entry and entry.get("status") == "pass" and name not in named and name != "environment":
            context.results[name] = StepResult(name, "done", detail=f"passed earlier ({entry.get('date', '?')}, "
                                                                     f"{entry.get('commit', '?')}; --state)")
            print(step_line(context.results[name]), flush=True)
            continue
        if context.seconds_left() < MIN_STEP_SECONDS:
            context.results[name] = StepResult(name, "not run", detail=f"--deadline {args.deadline:g} s reached")
            print(step_line(context.results[name]), flush=True)
            continue
        result = run_step(context, name)
        print(step_line(result), flush=True)
        write_state(context, result)
        write_report(context)
    print(f"report: {write_report(context)}")
    return EXIT_FAILED if any(r.status == "fail" for r in context.results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
