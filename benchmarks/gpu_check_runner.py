"""gpu_check.py's machinery: step results, subprocesses with time limits and timestamped output, parsing
the logs of train.py / val.py, and the CUDA work that runs in a child process (``gpu_check.py --child``)."""
from __future__ import annotations

import codecs
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROGRESS = re.compile(r"^\s*(\d+)/(\d+)\s+(\S+)\s.*?\|\s*(\d+)/(\d+)\s*\[")
NUMBER = r"([\d.]+(?:e[-+]\d+)?)"  # %.3g: 0.512, 1.23e-05
ALL_ROW = re.compile(rf"^\s*all\s+(\d+)\s+(\d+)\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s*$", re.M)


@dataclass
class StepResult:
    name: str
    status: str = "pass"  # pass, fail, skip
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    detail: str = ""      # one line: why it failed or was skipped
    log: Path | None = None
    command: str = ""


class StepFailed(Exception):
    """A check inside a step did not hold; the message is the one-line reason, ``figures`` what the step measured
    before (reported with the failure)."""

    def __init__(self, message: str, figures: dict | None = None):
        super().__init__(message)
        self.figures = figures or {}


class StepSkipped(Exception):
    """A step that cannot run here (its input is missing); the message says why."""


@dataclass
class Completed:
    returncode: int | None  # None: killed at the time limit
    seconds: float
    fragments: list  # (seconds since the start, text): the output split at \r and \n, as it came

    @property
    def text(self) -> str:
        return "\n".join(text for _, text in self.fragments)


@dataclass
class Context:
    args: object  # gpu_check.py's parsed flags
    work: Path
    results: dict = field(default_factory=dict)
    artifacts: dict = field(default_factory=dict)  # what a step leaves for later ones (checkpoints, rates)
    commands: list = field(default_factory=list)
    deadline: float | None = None  # time.monotonic() after which no command runs (--deadline)

    @property
    def data(self) -> str:
        return str(self.args.data)

    def seconds_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()


# ---------------------------------------------------------------------- subprocesses
def run_command(context: Context, step: str, command: list, limit: float, on_fragment=None, extra_env=None
                ) -> Completed:
    """Run ``command`` in its own process group, its output to <work>/logs/<step>.log, killed after ``limit``
    seconds. ``on_fragment(process, seconds, text)`` sees each line or progress-bar update as it comes."""
    log_path = context.work / "logs" / f"{step}.log"
    limit = max(1.0, min(limit, context.seconds_left()))  # --deadline: a command never runs past it
    log_path.parent.mkdir(parents=True, exist_ok=True)
    context.commands.append(" ".join(map(str, command)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    start = time.monotonic()
    process = subprocess.Popen([str(c) for c in command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    expired = threading.Event()
    watchdog = threading.Timer(limit, lambda: (expired.set(), _stop_group(process)))
    watchdog.start()
    fragments, pending = [], ""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span two chunks
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(map(str, command))}\n")
        while chunk := process.stdout.read1(65536):
            text = decoder.decode(chunk)
            log.write(text)
            pending += text
            *complete, pending = re.split(r"[\r\n]", pending)
            for text in filter(None, complete):
                fragments.append((time.monotonic() - start, text))
                if on_fragment is not None:
                    on_fragment(process, fragments[-1][0], text)
    process.wait()
    watchdog.cancel()
    if pending:
        fragments.append((time.monotonic() - start, pending))
    return Completed(None if expired.is_set() else process.returncode, time.monotonic() - start, fragments)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group this script started, SIGKILL 15 s later if it is still there."""
    for number, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 0)):
        try:
            os.killpg(process.pid, number)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def checked(completed: Completed, what: str, expected: int = 0) -> Completed:
    if completed.returncode is None:
        raise StepFailed(f"{what}: stopped at the step's time limit after {completed.seconds:.0f} s")
    if completed.returncode != expected:
        lines = [t for _, t in completed.fragments if "error" in t.lower()] or [t for _, t in completed.fragments][-1:]
        raise StepFailed(f"{what}: exit status {completed.returncode} ({(lines[-1] if lines else '').strip()[:200]})")
    return completed


def python_command(script: str, *args) -> list:
    return [sys.executable, str(ROOT / script), *map(str, args)]


def child_result(completed: Completed) -> dict:
    """The JSON a ``--child`` run printed after 'RESULT '."""
    for _, text in reversed(completed.fragments):
        if text.startswith("RESULT "):
            return json.loads(text[len("RESULT "):])
    raise StepFailed("the child process printed no result")


# ---------------------------------------------------------------------- parsing the logs
def training_figures(completed: Completed, train_images: int) -> dict:
    """Figures from a train.py log: training images/s over epochs 2.. (the progress bars' own times: the
    training steps with their data waits, no validation), the largest Mem column (CUDA reserved memory)."""
    epochs, memory = {}, 0.0
    for seconds, text in completed.fragments:
        match = PROGRESS.match(text)
        if not match:
            continue
        epoch, _, mem, done, total = match.groups()
        first, _ = epochs.setdefault(int(epoch), (seconds, seconds))
        if done == total:
            epochs[int(epoch)] = (first, seconds)
        if mem.endswith("G"):
            memory = max(memory, float(mem[:-1]))
    timed = [end - start for epoch, (start, end) in epochs.items() if epoch > 1 and end > start]
    figures = {"wall": f"{completed.seconds:.1f} s", "GPU memory (reserved)": f"{memory:.2f} GB"}
    if timed:
        figures["train img/s"] = f"{train_images * len(timed) / sum(timed):.0f}"
    amp = next((t.split("AMP: ", 1)[1] for _, t in completed.fragments if "AMP: " in t), "")
    figures["precision"] = amp.split(" (")[0] if amp else "?"
    return figures


def validation_seconds(completed: Completed) -> list[float]:
    """Seconds each validation during training took: from the end of an epoch's training progress bar to the next
    'all' row (the validation's own progress, scoring and printing)."""
    seconds, trained_at = [], None
    for at, text in completed.fragments:
        match = PROGRESS.match(text)
        if match:
            *_, done, total = match.groups()
            trained_at = at if done == total else None
        elif trained_at is not None and ALL_ROW.match(text):
            seconds.append(at - trained_at)
            trained_at = None
    return seconds


def run_folder(completed: Completed) -> Path:
    for _, text in completed.fragments:
        if "Logging results to " in text:
            return Path(text.split("Logging results to ", 1)[1].strip())
    raise StepFailed("train.py printed no 'Logging results to' line")


def results_rows(folder: Path) -> list[dict]:
    lines = (folder / "results.csv").read_text().splitlines()
    header = [h.strip() for h in lines[0].split(",")]
    return [dict(zip(header, (float(v) for v in line.split(",")))) for line in lines[1:] if line.strip()]


def val_figures(completed: Completed) -> dict:
    match = ALL_ROW.search(completed.text)
    if not match:
        raise StepFailed("val.py printed no 'all' row")
    speed = next((t.split("Speed: ", 1)[1].split(" per image")[0] for _, t in completed.fragments if "Speed: " in t),
                 "")
    return {"mAP50": float(match.group(5)), "mAP50-95": float(match.group(6)), "speed": speed}


def count_images(data: str, split: str) -> int:
    from utils.data.dataset_yaml import load_data_config
    from utils.data.verify import list_image_files

    return len(list_image_files(load_data_config(data).split(split)))


def commit_of(root: Path) -> str:
    """HEAD's commit read from .git (no git call), or '' when there is no .git here."""
    git = root / ".git"
    if git.is_file():
        git = (root / git.read_text().split("gitdir:", 1)[-1].strip()).resolve()
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).exists():
            return (git / ref).read_text().strip()
        packed = (git / "packed-refs").read_text().splitlines()
        return next(line.split()[0] for line in packed if line.endswith(" " + ref))
    except (OSError, StopIteration):
        return ""


# ---------------------------------------------------------------------- child processes (CUDA work)
def child_training_step(cfg: str, batch: int, imgsz: int = 640, device: str = "cuda:0"):
    """(TrainStep, images, targets) for ``cfg`` on ``device`` as the trainer builds it: channels_last, --amp auto."""
    import torch

    from models.yolo import DetectionModel
    from utils.config import Hyp
    from utils.loss import DetectionLoss
    from utils.trainer.amp import choose_precision
    from utils.trainer.ema import ModelEMA
    from utils.trainer.loop import TrainStep
    from utils.trainer.optim import build_optimizer

    device = torch.device(device)
    torch.manual_seed(0)
    model = DetectionModel(str(ROOT / "models" / f"{cfg}.yaml"), nc=3).to(device, memory_format=torch.channels_last)
    step = TrainStep(model.train(), build_optimizer(model, "SGD", 0.01, 0.937, 5e-4), DetectionLoss(model, Hyp(), imgsz),
                     choose_precision("auto", device, model), ModelEMA(model), channels_last=True)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(batch, 3, imgsz, imgsz, generator=generator).to(device)
    boxes = torch.rand(batch * 4, 4, generator=generator) * 0.25 + torch.tensor([0.3, 0.3, 0.05, 0.05])
    targets = torch.cat([torch.arange(batch).repeat_interleave(4)[:, None].float(),
                         torch.randint(0, 3, (batch * 4, 1), generator=generator).float(), boxes], 1).to(device)
    return step, images, targets


def child_scaler(imgsz: int = 640, device: str = "cuda:0") -> dict:
    import torch

    step, images, targets = child_training_step("yolov5n", batch=8, imgsz=imgsz, device=device)
    # a smaller starting scale than the default 2**16: the finite steps here must not overflow by themselves
    step.precision.scaler = torch.amp.GradScaler(step.precision.device_type, init_scale=2.0 ** 10,
                                                 enabled=step.precision.scaler.is_enabled())
    scaler, model = step.precision.scaler, step.model
    step.forward_backward(images, targets)
    step.optimizer_step()
    before, scale_before = [p.detach().clone() for p in model.parameters()], scaler.get_scale()
    step.forward_backward(images, targets)
    next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("inf"))
    step.optimizer_step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    scale_after = scaler.get_scale()
    nan_skipped = not step.forward_backward(torch.full_like(images, float("nan")), targets)[1]
    finite = step.forward_backward(images, targets)[1]
    step.optimizer_step()
    moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"precision": step.precision.name, "fp16": step.precision.name == "fp16", "scale_before": scale_before,
            "scale_after": scale_after, "weights_unchanged": unchanged, "inf_step_skipped": unchanged,
            "scale_halved": scale_after == scale_before / 2, "nan_loss_skipped": nan_skipped,
            "trains_after": finite and moved and all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def child_step_rate(cfg: str, batch: int = 16, warmup: int = 5, steps: int = 30, imgsz: int = 640,
                    device: str = "cuda:0") -> dict:
    import torch

    step, images, targets = child_training_step(cfg, batch, imgsz, device)
    synchronize = torch.cuda.synchronize if step.precision.device_type == "cuda" else (lambda: None)
    for index in range(warmup + steps):
        if index == warmup:
            synchronize()
            start = time.perf_counter()
        step.forward_backward(images, targets)
        step.optimizer_step()
    synchronize()
    elapsed = time.perf_counter() - start
    return {"precision": step.precision.name, "images_per_s": steps * batch / elapsed, "step_ms": elapsed / steps * 1e3}


CHILDREN = {"scaler": lambda args: child_scaler(), "step-rate": lambda args: child_step_rate(args.cfg)}
