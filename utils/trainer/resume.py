"""Which run a training process continues, and with which options.

- ``--resume`` alone: the newest resumable ``<project>/<run>/weights/last.pt`` under --project (default
  runs/train), never anywhere else on disk (a run folder, weights/ or last.pt that is a symbolic link is
  skipped, with its real path to give); with ``--name`` that run only.
- ``--resume PATH``: that checkpoint, or the run folder holding it. The checkpoint must be a run's
  ``<run>/weights/<file>``: the run continues in ``<run>`` (a last.pt copied elsewhere, e.g. to ~/Downloads,
  is refused with how to resume it: put it at RUN/weights/last.pt). It must also be the run's newest
  work: best.pt, epochN.pt or last.prev.pt while a different last.pt exists is refused with the command
  that continues last.pt (resuming an older file would rewind results.csv and then overwrite last.pt); to
  continue from such a file deliberately, copy it to NEW_RUN/weights/last.pt and resume that.
- a torchrun restart (``torchrun --max-restarts K``): the run folder this launch marked when it started
  (utils.trainer.trainer.LAUNCH_MARKER), resumed from its last.pt with no flag needed; if the group died
  before the first checkpoint, the same folder is started again.

A last.pt that is not a valid checkpoint (truncated, corrupt) falls back to last.prev.pt
(utils.checkpoint.load_resumable); an error of the machine reading it (out of memory, I/O) does not. A bare
``--resume`` whose newest run cannot be read says so and stops, naming the file; it never continues an
older run instead (when the newest run has finished, the older unfinished run it continues is named).

A new run stores ``--data``, ``--cfg``, ``--hyp`` and ``--weights`` as absolute paths (and logs them), so a
resume from another working folder reads the same files. While a process trains in a run folder it holds
the folder's lock (utils.files.FolderLock, ``<run>/.run.lock``; on the main process only, removed when
the run ends): a second process resuming or training in it is refused; the lock of a process that died is
taken over with a log line. Once the lock is held, the checkpoint must still be the file that was read (else
another process finished or continued the run in between, and the resume is refused). A run folder holding
symbolic links is refused before anything is written in it.

The run folder, options, hyperparameters, data and model come from the checkpoint. ``--device``, ``--workers``,
``--cache``, ``--save-every-min``, ``--no-tensorboard``, ``--ndjson-console``/``--ndjson-file`` and the trackers'
flags may be given again (the differences are printed), and the number of processes may change (the total batch is
kept); any other option given with a different value is refused with the reason. A checkpoint's ``--cache disk`` is used only when the command says it again: a file's
options never make a run fill a disk cache.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import replace
from pathlib import Path

from utils import dist
from utils.checkpoint import TrainingState, is_finished, load_resumable, previous_path, training_state
from utils.config import ConfigError, Hyp, TrainConfig, resolve_hyp_path
from utils.downloads import without_credentials
from utils.errors import ArgumentError, UserError, WriteError, writing
from utils.files import FolderBusy, FolderLock, atomic_write, file_identity, read_regular
from utils.paths import increment_path, linked_part, symlinks_in

LOGGER = logging.getLogger(__name__)

CHANGEABLE = ("device", "workers", "cache", "save_every_min", "tensorboard", "ndjson_console", "ndjson_file", "trackers",
              "entity", "upload_dataset", "bbox_interval", "artifact_alias")
LOCATING = ("resume", "project", "name", "exist_ok", "local_rank")  # how the run is found, not what it does
WHY_FIXED = {
    "epochs": "the learning-rate schedule spans the run's epochs",
    "time": "the time budget set the run's epoch count, which its learning-rate schedule spans",
    "batch_size": "the total batch sets accumulation and weight decay (the number of processes may change; "
                  "the total batch is kept)",
    "weights": "the model and its weights come from the checkpoint",
    "cfg": "the model and its weights come from the checkpoint",
    "hyp": "the hyperparameters come from the checkpoint",
}
LAUNCH_MARKER = ".launch"
LOCK_NAME = ".run.lock"
MARKER_BYTES = 512  # a launch marker holds one id; a larger file is no marker of ours
PATH_OPTIONS = ("data", "cfg", "hyp", "weights")  # stored absolute: a resume elsewhere reads the same files


class ResumeError(UserError):
    """Nothing to resume, or an option that cannot change on resume."""


class ResumeOptionError(ArgumentError):
    """An option given with --resume that the resumed run cannot take (a usage error: exit 2)."""


class RunFinished(Exception):
    """The run asked for has finished; the message says how to train it further (not an error)."""


def resolve_run(config: TrainConfig, explicit: dict) -> tuple[TrainConfig, Hyp, TrainingState | None]:
    """(config, hyp, resume state or None) for this process group; ``explicit`` holds the options given on the
    command line (dest -> value). Call on the main process only and broadcast the result."""
    asked_cache = explicit.get("cache")
    if not config.resume:
        launch = dist.launch_info()
        folder = marked_folder(Path(config.project), launch.launch_id) if launch.restarted else None
        if folder is None:
            config = with_absolute_paths(config)
            return config, Hyp.load(config.hyp), None
        last = folder / "weights" / "last.pt"
        if not (last.exists() or last.with_name("last.prev.pt").exists()):
            LOGGER.info("torchrun restart %d: no checkpoint in %s yet, starting it again", launch.restart_count, folder)
            config = with_absolute_paths(config)
            return replace(config, save_dir=str(folder)), Hyp.load(config.hyp), None
        LOGGER.info("torchrun restart %d: resuming %s", launch.restart_count, last)
        asked_cache = config.cache  # the launch's own command line, run again
        config, explicit = replace(config, resume=str(last)), {}
    path = newest_of_run(checkpoint_to_resume(config.resume, Path(config.project), explicit.get("name")))
    identities = {candidate: file_identity(candidate) for candidate in (path, previous_path(path))}
    checkpoint, used = load_resumable(path)
    if is_finished(checkpoint):
        raise RunFinished(finished_message(used, checkpoint))
    state = replace(training_state(checkpoint, used), identity=identities.get(used))  # read before: a change shows
    run_folder_of(used, config.project)  # after the file itself was found valid: its place is the next question
    saved = stored_paths(TrainConfig.from_stored(state.config), used)
    changes = option_changes(explicit, saved)
    resumed = replace(saved, resume=str(used), save_dir="", **{dest: new for dest, (_, new) in changes.items()})
    resumed = disk_cache_when_asked(resumed, asked_cache, used)
    try:
        hyp = Hyp.from_dict(state.hyp, source=f"{used} (hyp)")
    except ConfigError as error:
        raise ResumeError(str(error)) from None
    for dest, (old, new) in changes.items():
        LOGGER.info("Resume: --%s changed from %s to %s", dest.replace("_", "-"), old, new)
    return resumed, hyp, state


def disk_cache_when_asked(config: TrainConfig, asked, source: Path) -> TrainConfig:
    """``--cache disk`` fills a file of the dataset's resized images in the user cache folder (gigabytes for a large
    dataset). A checkpoint's options may name any dataset (a last.pt copied from another run, an older relative
    --data resolved from this folder), so the file alone never makes a run fill one: a resumed run caches on disk
    only when its command line says --cache disk (a torchrun restart: the launch's command), else it caches as
    --cache auto."""
    if config.cache != "disk" or asked == "disk":
        return config
    LOGGER.warning("WARNING: %s: its --cache disk is not used (a resumed run fills a disk cache only when its "
                   "command asks: add --cache disk to cache %s's images on disk); caching with --cache auto", source,
                   config.data or "the dataset")
    return replace(config, cache="auto")


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
        link = linked_part(project, candidate)
        if link is not None:  # a run folder (or its weights/, or last.pt) that lives elsewhere: never followed
            LOGGER.warning("WARNING: --resume: skipping %s: %s is a symbolic link (a bare --resume continues only runs "
                           "inside %s; to continue that run, give its real path: --resume %s)", candidate, link,
                           project, os.path.realpath(candidate))
            continue
        try:
            checkpoint, _ = load_resumable(candidate)
        except UserError as error:  # never skipped for an older run: the user decides
            raise ResumeError(f"--resume: {error}; not continuing an older run instead: repair or remove "
                              f"{candidate.parent.parent}, or name the run to resume: --resume PATH") from None
        if not is_finished(checkpoint):
            if finished is not None:
                LOGGER.info("Resume: the most recent run %s has finished; continuing the most recent unfinished "
                            "run %s", finished[0].parent.parent, candidate.parent.parent)
            return candidate
        finished = finished or (candidate, checkpoint)
    if finished is not None:
        raise RunFinished(f"nothing to resume under {project}: the most recent run has finished. "
                          + finished_message(*finished))
    where = project / name if name else project
    raise ResumeError(f"--resume: no run to resume under {where} (looked for */weights/last.pt; "
                      "give --resume PATH or --project)")


MAX_EPOCHS_SHOWN = 10 ** 7  # an epoch number beyond any run's, shown as "?"


def finished_message(path: Path, checkpoint: dict) -> str:
    config = checkpoint.get("config") if isinstance(checkpoint.get("config"), dict) else {}
    # the epochs it trained (its last finished epoch + 1; --time or early stopping may end before --epochs)
    last = checkpoint.get("epoch")
    epochs = last + 1 if type(last) is int and 0 <= last < MAX_EPOCHS_SHOWN else "?"  # file content: type-checked
    stored = config.get("data")
    data = f" --data {stored}" if isinstance(stored, str) and 0 < len(stored) <= 4096 else ""
    done = f"finished its {epochs} epochs" if epochs != "?" else "has finished"  # YOLOv5's stripped files: epoch -1
    return (f"{path}: this run {done}. To train it further, start a new run from its weights: python train.py "
            f"--weights {path}{data} --epochs N")


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
    if given == saved or (dest == "batch_size" and given == -1):  # -1: the batch AutoBatch chose for the run
        return True
    if dest in PATH_OPTIONS and given and saved:
        return Path(absolute_path(dest, given)).resolve() == Path(absolute_path(dest, saved)).resolve()
    return False


def mark_folder(folder: Path, launch_id: str) -> None:
    """Record that this torchrun launch owns ``folder`` (a restart of the launch finds it again)."""
    if launch_id:
        with writing(folder / LAUNCH_MARKER):
            atomic_write(folder / LAUNCH_MARKER, launch_id + "\n")  # atomic, never through a planted link


def marked_folder(project: Path, launch_id: str) -> Path | None:
    """The run folder under ``project`` that this torchrun launch created (newest if several)."""
    if not launch_id or not project.is_dir():
        return None
    owned = [marker.parent for marker in project.glob(f"*/{LAUNCH_MARKER}") if _marker_text(marker) == launch_id]
    return max(owned, key=lambda folder: folder.stat().st_mtime) if owned else None


def _marker_text(marker: Path) -> str:
    """A launch marker's id; "" for anything that is not a small regular file (a link, a FIFO, a device)."""
    try:
        return read_regular(marker, MARKER_BYTES).decode("utf-8", errors="replace").strip()
    except OSError:  # missing, a link, not a regular file, too large (FileTooLarge), unreadable
        return ""


def clear_marker(folder: Path, launch_id: str) -> None:
    """Remove this launch's marker from ``folder`` when its run has finished (a marker of another launch, or a
    symlink, is left alone: only a regular file holding ``launch_id`` is removed)."""
    marker = Path(folder) / LAUNCH_MARKER
    if not launch_id or _marker_text(marker) != launch_id:
        return
    try:
        marker.unlink()
    except OSError as error:
        LOGGER.warning("WARNING: could not remove %s (%s)", marker, error.strerror or error)


# ---------------------------------------------------------------------- where a resumed run writes

def newest_of_run(path: Path) -> Path:
    """``path`` when it is its run's newest work (last.pt, or a checkpoint in a run without a different
    last.pt); the run's last.pt when ``path`` is the same file (best.pt saved at the last epoch is a hard
    link of it); ResumeError with the command that continues last.pt otherwise."""
    path = Path(path)
    if path.parent.name != "weights" or path.name == "last.pt":
        return path
    last = path.parent / "last.pt"
    newest = next((candidate for candidate in (last, previous_path(last)) if candidate.is_file()), None)
    if newest is None:
        return path
    if path.exists() and os.path.samefile(path, newest):
        return newest
    raise ResumeError(f"--resume {path}: this run has newer work in {newest} (resuming {path.name} would rewind "
                      f"results.csv and then overwrite last.pt). Continue the newest with: python train.py --resume "
                      f"{last} (to continue from {path.name} itself, copy it to NEW_RUN/weights/last.pt and resume "
                      "that)")


def run_folder_of(path: Path, project: str | Path = "runs/train") -> Path:
    """The run folder a resumed checkpoint belongs to: ``<run>`` of ``<run>/weights/<file>`` (the path as
    given, made absolute; symbolic links are not followed to find it). ResumeError saying how to resume it
    when the file is anywhere else."""
    path = Path(os.path.abspath(path))
    if path.parent.name == "weights":
        return path.parent.parent
    example = Path(project) / "resumed" / "weights" / "last.pt"
    raise ResumeError(f"--resume {path}: not inside a run folder (RUN/weights/{path.name}), and a resumed run "
                      "writes its results into the folder above weights/. To resume it, put it at RUN/weights/"
                      f"last.pt (e.g. mkdir -p {example.parent} && cp {path} {example}) and run: python train.py "
                      f"--resume {example}")


def absolute_path(dest: str, value):
    """The absolute path of option ``dest`` (data, cfg, hyp, weights) as its reader finds it from the
    current folder (bare names included: data/, models/, data/hyps/); ``value`` itself when empty or not
    found (its reader then reports it)."""
    if not isinstance(value, str) or not value:
        return value
    found = _locate(dest, value)
    return os.path.abspath(found) if found is not None else value


def _locate(dest: str, value: str) -> Path | None:
    path = Path(value).expanduser()
    try:
        if dest == "data":
            from utils.data.dataset_yaml import find_data_yaml

            return find_data_yaml(value)
        if dest == "hyp":
            return resolve_hyp_path(value)
    except UserError:
        return None
    if dest == "cfg" and not path.exists():
        from models.yolo import MODELS_DIR  # load_model_config's lookup of a bare name

        path = next((folder / path.name for folder in (MODELS_DIR, MODELS_DIR / "hub")
                     if (folder / path.name).exists()), path)
    return path if path.is_file() else None


def with_absolute_paths(config: TrainConfig) -> TrainConfig:
    """``config`` with its data paths absolute (logged), for a new run's opt.yaml and checkpoints."""
    config = replace(config, **{dest: absolute_path(dest, getattr(config, dest)) for dest in PATH_OPTIONS})
    shown = ", ".join(f"--{dest} {without_credentials(getattr(config, dest))}" for dest in PATH_OPTIONS
                      if getattr(config, dest))
    LOGGER.info("Data paths: %s%s", shown or "none given", "" if config.data else " (--data: the default dataset)")
    return config


def stored_paths(saved: TrainConfig, source: Path) -> TrainConfig:
    """A resumed run's options with their data paths logged. --data is the one a resumed run reads again (the
    model and hyperparameters come from the checkpoint): stored relative (by an older version), it is taken
    from the current folder, with a warning that it may not be the dataset the run started with."""
    if saved.data and not os.path.isabs(saved.data):
        found = absolute_path("data", saved.data)
        LOGGER.warning("WARNING: %s stores --data %s relative to the folder the run started in; using %s (check "
                       "that it is the run's dataset)", source, saved.data, found)
        saved = replace(saved, data=found)
    shown = ", ".join(f"--{dest} {without_credentials(getattr(saved, dest))}" for dest in PATH_OPTIONS
                      if getattr(saved, dest))
    LOGGER.info("Data paths: %s%s", shown or "none given", "" if saved.data else " (--data: the default dataset)")
    return saved


# ---------------------------------------------------------------------- the run folder: checked, locked, marked

_LOCKS: dict[str, FolderLock] = {}


def claim_run_folder(config: TrainConfig, resume: TrainingState | None) -> Path:
    """Main process: the run's folder (the resumed checkpoint's run, the folder a torchrun restart owns, or a
    new project/name{,2,3...}), refused when it holds symbolic links, locked for this process, and marked
    for this torchrun launch. ``release_run_folder`` ends the claim."""
    if resume is not None:
        folder = run_folder_of(resume.path, config.project)
    elif config.save_dir:
        folder = Path(config.save_dir)
    else:
        folder = increment_path(Path(config.project) / config.name, exist_ok=config.exist_ok, mkdir=True)
    links = symlinks_in(folder) if folder.is_dir() else []
    if links:
        raise ResumeError(f"{folder}: the run folder holds symbolic links ({', '.join(links[:5])}"
                          f"{', ...' if len(links) > 5 else ''}); a run writes its outputs there and would write "
                          "through them: remove them first")
    (folder / "weights").mkdir(parents=True, exist_ok=True)
    lock_run_folder(folder)
    try:
        if resume is not None:
            check_unchanged(resume)
            if resume.origin == "yolov5":
                from utils.checkpoint.yolov5_run import keep_yolov5_files

                keep_yolov5_files(folder, Path(resume.path))
        mark_folder(folder, dist.launch_info().launch_id)
    except BaseException:
        release_run_folder(folder)
        raise
    return folder


def check_unchanged(resume: TrainingState) -> None:
    """Under the run folder's lock: the checkpoint is still the file that was read. Between reading it and taking
    the lock another process may have finished the run (its stripped last.pt) or saved a newer one; resuming
    the state read before would train past the run's end or rewind it, so that is refused."""
    if resume.identity is not None and file_identity(resume.path) != resume.identity:
        raise ResumeError(f"{resume.path}: was rewritten by another process after this one read it (the run went on "
                          "or finished meanwhile); run the command again to continue from what it holds now")


def lock_run_folder(folder: Path, purpose: str = "train.py") -> None:
    """Take ``folder``'s lock (``<folder>/.run.lock``, utils.files.FolderLock) for this process; FolderBusy while
    another live process holds it. The lock file records the holder (pid, host, purpose, start), for the message
    another process gets; the record of a holder that died is logged as the lock is taken over."""
    key = os.path.abspath(folder)
    if key in _LOCKS:
        raise FolderBusy(f"{folder}: this process is already training in this run folder")
    lock = FolderLock(Path(folder), LOCK_NAME)
    record = f"pid {os.getpid()} on {socket.gethostname()}, {purpose}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    try:
        previous = lock.acquire(record=record)
    except FolderBusy as error:
        raise FolderBusy(f"{folder}: this run folder is in use by another process ({error.record or 'no record'}; "
                         f"lock file {lock.path}); two processes cannot train in one run folder at once: wait for "
                         "it to end or stop it", error.record) from None
    except OSError as error:  # a link or a special file planted under the name, or an unwritable folder
        raise WriteError(f"could not write {lock.path}: {error.strerror or error}") from None
    if previous:
        LOGGER.info("%s: taking over the lock of a process that is no longer running (%s)", lock.path, previous)
    _LOCKS[key] = lock


def release_run_folder(folder) -> None:
    """Drop this process's lock of ``folder`` and remove its lock file (nothing when not held)."""
    lock = _LOCKS.pop(os.path.abspath(folder), None) if folder else None
    if lock is not None:
        lock.release(remove=True)
