"""Which run a training process continues, and with which options.

- ``--resume`` alone: the newest resumable ``<project>/<run>/weights/last.pt`` under --project (default
  runs/train), never anywhere else on disk; with ``--name`` that run only.
- ``--resume PATH``: that checkpoint, or the run folder holding it.
- a torchrun restart (``torchrun --max-restarts K``): the run folder this launch marked when it started
  (utils.trainer.trainer.LAUNCH_MARKER), resumed from its last.pt with no flag needed; if the group died
  before the first checkpoint, the same folder is started again.

An unreadable last.pt falls back to last.prev.pt (utils.checkpoint.load_resumable). The run folder,
options, hyperparameters, data and model come from the checkpoint. ``--device``, ``--workers``,
``--cache`` and ``--save-every-min`` may be given again (the differences are printed), and the number
of processes may change (the total batch is kept); any other option given with a different value is
refused with the reason.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from utils import dist
from utils.checkpoint import TrainingState, is_finished, load_resumable, training_state
from utils.config import ConfigError, Hyp, TrainConfig
from utils.errors import ArgumentError, UserError

LOGGER = logging.getLogger(__name__)

CHANGEABLE = ("device", "workers", "cache", "save_every_min")
LOCATING = ("resume", "project", "name", "exist_ok", "local_rank")  # how the run is found, not what it does
WHY_FIXED = {
    "epochs": "the learning-rate schedule spans the run's epochs",
    "batch_size": "the total batch sets accumulation and weight decay (the number of processes may change; "
                  "the total batch is kept)",
    "weights": "the model and its weights come from the checkpoint",
    "cfg": "the model and its weights come from the checkpoint",
    "hyp": "the hyperparameters come from the checkpoint",
}
LAUNCH_MARKER = ".launch"


class ResumeError(UserError):
    """Nothing to resume, or an option that cannot change on resume."""


class ResumeOptionError(ArgumentError):
    """An option given with --resume that the resumed run cannot take (a usage error: exit 2)."""


class RunFinished(Exception):
    """The run asked for has finished; the message says how to train it further (not an error)."""


def resolve_run(config: TrainConfig, explicit: dict) -> tuple[TrainConfig, Hyp, TrainingState | None]:
    """(config, hyp, resume state or None) for this process group; ``explicit`` holds the options given on the
    command line (dest -> value). Call on the main process only and broadcast the result."""
    if not config.resume:
        launch = dist.launch_info()
        folder = marked_folder(Path(config.project), launch.launch_id) if launch.restarted else None
        if folder is None:
            return config, Hyp.load(config.hyp), None
        last = folder / "weights" / "last.pt"
        if not (last.exists() or last.with_name("last.prev.pt").exists()):
            LOGGER.info("torchrun restart %d: no checkpoint in %s yet, starting it again", launch.restart_count, folder)
            return replace(config, save_dir=str(folder)), Hyp.load(config.hyp), None
        LOGGER.info("torchrun restart %d: resuming %s", launch.restart_count, last)
        config, explicit = replace(config, resume=str(last)), {}
    path = checkpoint_to_resume(config.resume, Path(config.project), explicit.get("name"))
    checkpoint, used = load_resumable(path)
    if is_finished(checkpoint):
        raise RunFinished(finished_message(used, checkpoint))
    state = training_state(checkpoint, used)
    saved = TrainConfig.from_dict(state.config)
    changes = option_changes(explicit, saved)
    resumed = replace(saved, resume=str(used), save_dir="", **{dest: new for dest, (_, new) in changes.items()})
    try:
        hyp = Hyp.from_dict(state.hyp, source=f"{used} (hyp)")
    except ConfigError as error:
        raise ResumeError(str(error)) from None
    for dest, (old, new) in changes.items():
        LOGGER.info("Resume: --%s changed from %s to %s", dest.replace("_", "-"), old, new)
    return resumed, hyp, state


def checkpoint_to_resume(resume, project: Path, name: str | None = None) -> Path:
    """The last.pt that ``--resume [PATH]`` means (see the module docstring)."""
    if resume is not True and resume not in ("", "True"):
        path = Path(resume)
        if path.is_dir():
            path = path / "weights" / "last.pt" if (path / "weights").is_dir() else path / "last.pt"
        if not path.exists() and not path.with_name(f"{path.stem}.prev{path.suffix}").exists():
            raise ResumeError(f"--resume {str(resume)[:200]}: no such checkpoint")
        return path
    pattern = f"{name}/weights/last.pt" if name else "*/weights/last.pt"
    candidates = sorted(project.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    finished = None
    for candidate in candidates:
        try:
            checkpoint, _ = load_resumable(candidate)
        except UserError as error:
            LOGGER.warning("WARNING: skipping %s (%s)", candidate, error)
            continue
        if not is_finished(checkpoint):
            return candidate
        finished = finished or (candidate, checkpoint)
    if finished is not None:
        raise RunFinished(f"nothing to resume under {project}: the most recent run has finished. "
                          + finished_message(*finished))
    where = project / name if name else project
    raise ResumeError(f"--resume: no run to resume under {where} (looked for */weights/last.pt; "
                      "give --resume PATH or --project)")


def finished_message(path: Path, checkpoint: dict) -> str:
    config = checkpoint.get("config") or {}
    epochs = config.get("epochs", "?")
    data = f" --data {config['data']}" if config.get("data") else ""
    return (f"{path}: this run finished its {epochs} epochs. To train it further, start a new run from its "
            f"weights: python train.py --weights {path}{data} --epochs N")


def option_changes(explicit: dict, saved: TrainConfig) -> dict:
    """{dest: (saved value, given value)} for the options that may change; ResumeError for any other option
    given with a value other than the run's."""
    changes = {}
    for dest, given in explicit.items():
        if dest in LOCATING or not hasattr(saved, dest):
            continue
        old = getattr(saved, dest)
        if _same(dest, given, old):
            continue
        if dest in CHANGEABLE:
            changes[dest] = (old, given)
            continue
        reason = WHY_FIXED.get(dest, "a resumed run continues with its own options; start a new run to change it")
        raise ResumeOptionError(f"--{dest.replace('_', '-')} {str(given)[:80]} differs from the resumed run's "
                          f"{str(old)[:80]}: {reason}")
    return changes


def _same(dest: str, given, saved) -> bool:
    if given == saved:
        return True
    if dest in ("data", "cfg", "weights") and given and saved:
        return Path(given).resolve() == Path(saved).resolve()
    return False


def mark_folder(folder: Path, launch_id: str) -> None:
    """Record that this torchrun launch owns ``folder`` (a restart of the launch finds it again)."""
    if launch_id:
        (folder / LAUNCH_MARKER).write_text(launch_id + "\n", encoding="utf-8")


def marked_folder(project: Path, launch_id: str) -> Path | None:
    """The run folder under ``project`` that this torchrun launch created (newest if several)."""
    if not launch_id or not project.is_dir():
        return None
    owned = [marker.parent for marker in project.glob(f"*/{LAUNCH_MARKER}")
             if marker.read_text(encoding="utf-8", errors="replace").strip() == launch_id]
    return max(owned, key=lambda folder: folder.stat().st_mtime) if owned else None
