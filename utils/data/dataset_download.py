"""A dataset YAML's ``download:`` as data: the archives to fetch and where to unpack them. Nothing in it is run.

    download: https://host/coco128.zip          # YOLOv5's form: one URL or a list, unpacked into path's parent
    download:                                   # ours: the folder each archive is unpacked into, relative to the
      - url: https://host/coco2017labels.zip    #   parent of ``path`` (default '.')
      - url: http://host/train2017.zip
        into: coco/images
      - url: http://host/SKU110K_fixed.tar.gz   # a .zip or a tar (.tar, .tar.gz, .tgz, .tar.bz2, .tar.xz);
        from: SKU110K_fixed                     #   optional: what this folder of the archive holds goes into
        into: SKU-110K                          #   ``into`` (the archive's top folder renamed)
      - voc: VOC/source/VOCdevkit/VOC2012       # then our VOC importer (utils/data/importers.py): the XML of a
        into: VOC                               #   VOC root unpacked above -> YOLO labels and images/<split>
        split: train                            #   (optional: all into one split; else ImageSets/Main lists)
      - visdrone: VisDrone/VisDrone2019-DET-train  # or our VisDrone converter: annotations/ -> labels/ beside
                                                #   images/, in place (utils/data/importers.py)
      - sku110k: SKU-110K                       # or our SKU-110K converter: annotations/*.csv -> labels/ and
                                                #   the split lists train.txt, val.txt, test.txt
      - objects365: Objects365                  # or our Objects365 converter (utils/data/converters.py); a
                                                #   ``url`` of a .json file is fetched and placed as it is
    download:                                   # a dataset downloaded by hand (YOLOv5's xView and Argoverse):
      - manual: https://challenge.xviewdataset.org  # where from (shown in the message)
        files: [xView/xView_train.geojson]      # what must be there, relative to path's parent (files the
                                                #   conversion never moves: checked again after an interruption)
      - xview: xView                            # then converted in place: xview or argoverse

``ensure_downloaded`` runs when the YAML's ``path`` does not exist. Everything happens in a staging folder beside
it (``.NAME.download``): each archive is fetched there (through ``YOLO_TRAINER_MIRROR`` by file name, as YOLOv5's
named sources are; utils/downloads.py checks it), unpacked into a temporary folder (members checked first: no path
outside it, no links, the declared size against free space and 100x the archive) and merged into the staged tree,
and only when every archive is in does the staged ``NAME`` folder move to ``path``: an interrupted download never
looks like a dataset. Started again, it keeps the archives already fetched and unpacked (a 20 GB dataset need not
start over). A lock in the parent folder makes processes that start together download once.

``--data x.zip`` (a dataset with its YAML, e.g. a Roboflow export) is unpacked once into ../datasets/x beside the
repository, as YOLOv5 does (``unpack_dataset_archive``); the YAML inside is read from its own folder.

A dataset downloaded by hand has no archives: while the YAML's train or val is missing, each listed file must be
there (else one line with where to get them) and the conversion steps then run in place, under the same lock; each
converter writes the YAML's splits last, so one that was interrupted runs again.

A ``download:`` that is Python or shell code (YOLOv5's scripts) is refused: it is never run.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from utils.downloads import DownloadError, fetch, is_url, url_file_name, verify_zip
from utils.archives import TAR_SUFFIXES, extract_tar, extract_zip, is_tar_name, verify_tar
from utils.errors import UserError, shorten
from utils.paths import archive_stem

LOGGER = logging.getLogger(__name__)
MAX_ARCHIVE_BYTES = 64 << 30  # COCO's train2017.zip is 19 GB


class DatasetDownloadError(UserError):
    """A ``download:`` that is not data this trainer can follow, or a download that failed; one line."""


@dataclass(frozen=True)
class Archive:
    url: str
    into: str = "."  # relative to the dataset's parent folder
    inner: str | None = None  # ``from``: the archive's folder whose contents go into ``into``; None: all of it


@dataclass(frozen=True)
class VocImport:
    voc: str  # a VOC root (Annotations/, JPEGImages/, ImageSets/Main/), relative to the dataset's parent folder
    into: str  # the YOLO dataset folder it is imported into, likewise
    split: str | None = None  # every image into this split; None: ImageSets/Main/{train,val,test}.txt


@dataclass(frozen=True)
class VisDroneImport:
    visdrone: str  # a VisDrone DET folder (annotations/, images/), relative to the dataset's parent folder


@dataclass(frozen=True)
class Sku110kImport:
    sku110k: str  # the SKU-110K folder (annotations/, images/), relative to the dataset's parent folder


@dataclass(frozen=True)
class XviewImport:
    xview: str  # xView as downloaded by hand (train_images/, xView_train.geojson), relative to path's parent


@dataclass(frozen=True)
class ArgoverseImport:
    argoverse: str  # Argoverse-HD as downloaded by hand (Argoverse-1.1/tracking/, Argoverse-HD/annotations/)


@dataclass(frozen=True)
class Objects365Import:
    objects365: str  # Objects365 as its archives unpack (zhiyuan_objv2_*.json, images/{train,val}/)


@dataclass(frozen=True)
class ManualDownload:
    manual: str  # where the dataset is downloaded from by hand (a URL or words, shown in the message)
    files: tuple[str, ...]  # what must be there first, relative to the dataset's parent folder


FOLDER_STEPS = {"visdrone": VisDroneImport, "sku110k": Sku110kImport, "xview": XviewImport,
                "argoverse": ArgoverseImport, "objects365": Objects365Import}  # kind -> step of one folder
PLAIN_FILE_SUFFIXES = (".json",)  # fetched and placed as they are (Objects365's val annotations)


def by_hand(value) -> bool:
    """Whether a ``download:`` value describes a dataset downloaded by hand (a ``manual:`` entry)."""
    return isinstance(value, list) and any(isinstance(entry, dict) and "manual" in entry for entry in value)


def parse_download(value, label: str) -> list:
    """The steps a ``download:`` value describes (Archive, ManualDownload, then the converters' steps);
    DatasetDownloadError for code or anything else."""
    entries = value if isinstance(value, list) else [value]
    archives, manual, imports = [], [], []
    for entry in entries:
        if isinstance(entry, str) and is_url(entry.strip()) and len(entry.split()) == 1:
            archives.append(Archive(entry.strip()))
        elif isinstance(entry, dict) and isinstance(entry.get("url"), str) and is_url(entry["url"]) \
                and set(entry) <= {"url", "into", "from"} and isinstance(entry.get("into", "."), str) \
                and isinstance(entry.get("from", ""), str):
            inner = _relative(entry["from"], label) if entry.get("from") else None
            archives.append(Archive(entry["url"], _relative(entry.get("into", "."), label), inner))
        elif isinstance(entry, dict) and set(entry) <= {"voc", "into", "split"} and {"voc", "into"} <= set(entry) \
                and all(isinstance(entry.get(key, ""), str) for key in ("voc", "into", "split")) \
                and entry.get("split") in (None, "train", "val", "test"):
            imports.append(VocImport(_relative(entry["voc"], label), _relative(entry["into"], label),
                                     entry.get("split")))
        elif isinstance(entry, dict) and len(entry) == 1 and next(iter(entry)) in FOLDER_STEPS \
                and isinstance(next(iter(entry.values())), str):
            kind, folder = next(iter(entry.items()))
            imports.append(FOLDER_STEPS[kind](_relative(folder, label)))
        elif isinstance(entry, dict) and set(entry) == {"manual", "files"} and isinstance(entry["manual"], str) \
                and isinstance(entry["files"], list) and entry["files"] \
                and all(isinstance(name, str) for name in entry["files"]):
            manual.append(ManualDownload(entry["manual"], tuple(_relative(name, label) for name in entry["files"])))
        else:
            raise DatasetDownloadError(f"{label}: download: {shorten(entry)}: not a URL of an archive or a "
                                       "{url, into, from} entry (scripts in a dataset YAML are never run: download the "
                                       "dataset yourself, or describe its archives)")
    for archive in archives:
        path = url_file_name(archive.url).lower()  # the name it is kept as (a query or '#x.zip' fragment aside)
        if not (path.endswith(".zip") or is_tar_name(path) or path.endswith(PLAIN_FILE_SUFFIXES)):
            raise DatasetDownloadError(f"{label}: download: {archive.url}: only .zip and tar archives "
                                       f"({', '.join(TAR_SUFFIXES)}) are unpacked, and "
                                       f"{', '.join(PLAIN_FILE_SUFFIXES)} files placed")
        url_file_name(archive.url)  # a plain file name to keep it as
    if manual and (archives or len(manual) > 1):
        raise DatasetDownloadError(f"{label}: download: a dataset downloaded by hand lists one manual: entry and no "
                                   "archives")
    if not archives and not manual:
        raise DatasetDownloadError(f"{label}: download: no archive URL listed")
    return archives + manual + imports  # the imports run once every archive is in


def _relative(into: str, label: str) -> str:
    parts = Path(into).parts
    if Path(into).is_absolute() or ".." in parts or any(ord(c) < 32 for c in into):
        raise DatasetDownloadError(f"{label}: download: into: {shorten(into)}: must be a folder inside the "
                                   "dataset's parent folder (relative, without '..')")
    return into


def ensure_downloaded(root: Path, value, label: str, names: list[str] | None = None,
                      ready=lambda: False) -> None:
    """Fetch and unpack the archives of ``value`` so that the dataset folder ``root`` exists, or convert a dataset
    downloaded by hand in place (see module doc); ``names``: the YAML's class names, the order VOC imports number
    the classes in; ``ready()``: whether the YAML's splits are there (a dataset downloaded by hand)."""
    steps = parse_download(value, label)
    parent = root.parent
    manual = next((step for step in steps if isinstance(step, ManualDownload)), None)
    if manual is not None:
        _prepare_in_place(root, manual, [step for step in steps if step is not manual], label, names, ready)
        return
    check_download_root(root, label)
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DatasetDownloadError(f"{label}: cannot make {parent} for the download ({error.strerror})") from None
    with _download_lock(parent, root.name, label):  # processes starting together: one downloads, the others wait
        if root.exists():
            return
        _download(root, steps, label, names)


SYSTEM_FOLDERS = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/dev", "/proc",
                  "/sys", "/run", "/var")  # where a new folder can be configuration that runs (cron, systemd, ...)
DATA_IN_SYSTEM_FOLDERS = ("/usr/src", "/usr/local/src", "/var/tmp")  # YOLOv5's Docker image: /usr/src/app, datasets
# beside it in /usr/src/datasets
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pth", ".so", ".pyd")  # what makes a folder an importable package


def check_download_root(root: Path, label: str) -> None:
    """A YAML's ``path`` names where the archives' files land, so a YAML from elsewhere must not choose a place
    where files become code: DatasetDownloadError, before anything is written, for a folder at or under a hidden
    one (``~/.ssh``, ``~/.config/autostart``, ``~/.local/...``, ``~/.ipython/...``), inside the Python
    installation or a site-packages folder (``usercustomize``, ``.pth`` files) or a system folder (``/etc``,
    ``/usr``, ``/var``, ...; not /usr/src, /usr/local/src, /var/tmp). Beside importable modules (a folder on sys.path) the unpacked tree is
    checked too (``check_no_code_at_top``)."""
    import site
    import sys

    resolved = Path(os.path.realpath(root))
    hidden = next((part for part in resolved.parts if part.startswith(".")), None)
    python = {Path(os.path.realpath(folder)) for folder in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                            *site.getsitepackages(), site.getusersitepackages())}
    python |= {Path(os.path.realpath(entry)) for entry in sys.path
               if entry and Path(entry).name in ("site-packages", "dist-packages")}
    inside = next((folder for folder in sorted(python) if resolved == folder or folder in resolved.parents), None)
    allowed = any(Path(folder) in resolved.parents for folder in DATA_IN_SYSTEM_FOLDERS)
    system = None if allowed else next((folder for folder in SYSTEM_FOLDERS
                                        if resolved == Path(folder) or Path(folder) in resolved.parents), None)
    reason = (f"it is in the hidden folder {hidden}" if hidden else
              f"it is inside the Python installation ({inside})" if inside else
              f"it is inside the system folder {system}" if system else "")
    if reason:
        raise DatasetDownloadError(f"{label}: path: {root}: the download is not unpacked there ({reason}, where "
                                   "files can become code); set path: to a folder for data, or download the dataset "
                                   "yourself and put it there")


def check_no_code_at_top(tree: Path, root: Path, label: str) -> None:
    """The unpacked dataset folder, before it moves to ``root``: no Python module, package or ``.pth`` file at its
    top (a dataset has none; beside importable modules such a folder would be imported, e.g. named 'json')."""
    found = sorted(path.name for path in tree.iterdir() if path.suffix.lower() in CODE_SUFFIXES)
    if found:
        raise DatasetDownloadError(f"{label}: the archives put Python code at the top of the dataset folder "
                                   f"({', '.join(shorten(name, 60) for name in found[:3])}), which could be imported "
                                   f"from {root}; refused (nothing was moved there)")


def _download(root: Path, steps: list, label: str, names: list[str] | None) -> None:
    """Under the lock: the archives fetched and unpacked in the staging folder, converted, moved into place."""
    parent, archives = root.parent, [step for step in steps if isinstance(step, Archive)]
    staging = parent / f".{root.name}.download"
    try:
        _remove_leftovers(staging)
        LOGGER.info("%s: downloading %d archive(s) into %s (%s)", label, len(archives), parent,
                    ", ".join(url_file_name(a.url) for a in archives))
        for step in steps:
            if isinstance(step, Archive):
                _fetch_and_unpack(step, staging, label)
            else:
                _import_once(step, staging, label, names)
        staged = staging / "tree" / root.name
        if not staged.is_dir():
            raise DatasetDownloadError(f"{label}: the archives hold no folder '{root.name}' (the YAML's path): "
                                       f"what they hold is in {staging / 'tree'}")
        check_no_code_at_top(staged, root, label)
        os.rename(staged, root)
        shutil.rmtree(staging, ignore_errors=True)
        LOGGER.info("%s: dataset ready in %s", label, root)
    except DownloadError as error:
        if staging.is_dir() and not any(path.is_file() for path in staging.rglob("*")):
            shutil.rmtree(staging, ignore_errors=True)  # nothing fetched yet: nothing to keep for a restart
        raise DatasetDownloadError(f"{label}: {error}") from None


@contextlib.contextmanager
def _download_lock(folder: Path, name: str, label: str):
    """Hold ``folder``/.NAME.download.lock (exclusive; waits for another process holding it)."""
    lock = _open_lock(folder / f".{name}.download.lock", label)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)


def unpack_dataset_archive(archive: Path, datasets: Path, label: str) -> Path:
    """``--data x.zip`` (or a tar), YOLOv5's way: unpacked once into ``datasets``/x, members checked as any
    archive's, under the download lock (a folder already there is used as it is); returns the dataset YAML inside,
    the shallowest (then first by name), leaving out hidden files and macOS's __MACOSX copies."""
    name = archive_stem(archive.name)
    target, source = datasets / name, datasets / f".{name}.unpacked-from"
    identity = f"{os.path.abspath(archive)} {archive.stat().st_size} {archive.stat().st_mtime_ns}\n"
    if target.is_dir() and source.is_file() and source.read_text(errors="replace") != identity:
        LOGGER.warning("WARNING: %s: %s changed since it was unpacked into %s; using what is there (remove %s to "
                       "unpack it again)", label, archive, target, target)
    if not target.is_dir():
        try:
            datasets.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise DatasetDownloadError(f"{label}: cannot make {datasets} ({error.strerror})") from None
        with _download_lock(datasets, name, label):
            if not target.exists():
                LOGGER.info("%s: unpacking into %s", label, target)
                staging = datasets / f".{name}.download"
                shutil.rmtree(staging, ignore_errors=True)  # what a killed unpack left (under the lock: no one's now)
                staging.mkdir()
                try:
                    unpacked = (extract_tar if is_tar_name(archive.name) else extract_zip)(archive, staging)
                    os.rename(unpacked, target)
                    source.write_text(identity)
                except DownloadError as error:
                    raise DatasetDownloadError(f"{label}: {error}") from None
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
    found = sorted((path for path in target.rglob("*") if path.suffix.lower() in (".yaml", ".yml") and path.is_file()
                    and not any(part.startswith(".") or part == "__MACOSX" for part in path.relative_to(target).parts)),
                   key=lambda path: (len(path.parts), str(path)))
    if not found:
        raise DatasetDownloadError(f"{label}: holds no dataset YAML (unpacked into {target})")
    return found[0]


def _prepare_in_place(root: Path, manual: ManualDownload, steps: list, label: str, names: list[str] | None,
                      ready) -> None:
    """A dataset downloaded by hand: its files checked, then its conversion steps run in place, under the lock."""
    parent = root.parent
    if not parent.is_dir():
        raise DatasetDownloadError(f"{label}: this dataset is downloaded by hand (from {manual.manual}): put "
                                   f"{', '.join(manual.files)} into {parent}, then run again")
    with _download_lock(parent, root.name, label):  # another process converting it: wait, then find it done
        if ready():
            return
        missing = [name for name in manual.files if not (parent / name).exists()]
        if missing:
            raise DatasetDownloadError(f"{label}: this dataset is downloaded by hand (from {manual.manual}): put "
                                       f"{', '.join(missing)} into {parent}, then run again (its labels are "
                                       "converted then)")
        LOGGER.info("%s: converting the dataset in %s", label, root)
        for step in steps:
            _convert(step, parent, names, label)


def _open_lock(path: Path, label: str) -> int:
    """The download lock's handle. Another user's lock file in a shared folder cannot be opened for writing:
    a read-only handle locks it just as well. Never through a link."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o666)  # the umask decides, as for any new file
        except PermissionError:
            return os.open(path, os.O_RDONLY | flags)
    except OSError as error:
        raise DatasetDownloadError(f"{label}: cannot open the download lock {path} ({error.strerror or error}): "
                                   "remove it if no download is running, or ask its owner") from None


def _remove_leftovers(staging: Path) -> None:
    """Under the lock: what an interrupted start left in ``staging`` that a new start cannot use. Half-unpacked
    archives (``*.unpack`` folders, which would also count against the free-space check) go; fetched archives,
    the finished steps' markers and a resumable partial archive (``.NAME.partial``) stay."""
    for unpack in staging.glob(".*.unpack"):
        if unpack.is_dir() and not unpack.is_symlink():
            LOGGER.info("%s: removing %s, left by an interrupted unpack", staging, unpack.name)
            shutil.rmtree(unpack, ignore_errors=True)


def _fetch_and_unpack(archive: Archive, staging: Path, label: str) -> None:
    """One archive fetched into the staging folder (a folder per URL: Objects365's train and val patches share
    file names) and unpacked into the staged tree, or a plain file placed there."""
    import hashlib

    name = url_file_name(archive.url)
    tar, plain = is_tar_name(name), name.lower().endswith(PLAIN_FILE_SUFFIXES)
    folder = staging / "archives" / hashlib.sha256(archive.url.encode()).hexdigest()[:12]
    stored, done = folder / name, folder / f"{name}.unpacked"
    if done.exists():
        LOGGER.info("%s: %s unpacked earlier", label, name)
        return
    if not stored.is_file():
        verify = _verify_json if plain else verify_tar if tar else verify_zip
        fetch(archive.url, stored, what="dataset file" if plain else "dataset archive", max_bytes=MAX_ARCHIVE_BYTES,
              verify=verify, named=True,
              resumable=True)  # under the dataset's lock: a broken transfer is resumed by the next start
    tree = staging / "tree" / archive.into
    tree.mkdir(parents=True, exist_ok=True)
    if plain:
        os.replace(stored, tree / name)
        done.touch()
        return
    try:
        unpacked = (extract_tar if tar else extract_zip)(stored, staging)
    except DownloadError:
        stored.unlink(missing_ok=True)  # refused or broken: a later start fetches it again
        raise
    try:
        inner = unpacked / archive.inner if archive.inner else unpacked
        if not inner.is_dir() or inner.is_symlink():
            stored.unlink(missing_ok=True)
            raise DatasetDownloadError(f"{label}: download: {name} holds no folder '{archive.inner}' (its from:)")
        _merge(inner, tree)
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)
    done.touch()
    stored.unlink()  # unpacked: the space goes back


def _verify_json(path: Path, complete: bool = True) -> None:
    """A fetched .json file is one JSON object, read to its end an item at a time (utils/data/json_stream.py):
    a file cut short is not placed to fail every later conversion; ValueError otherwise."""
    from utils.data.json_stream import iter_arrays
    from utils.errors import AnnotationError

    try:
        for _ in iter_arrays(path, ()):
            pass
    except AnnotationError as error:
        raise ValueError(str(error).removeprefix(f"{path}: ")) from None


def _import_once(step, staging: Path, label: str, names: list[str] | None) -> None:
    """A converter step on the staged tree, done once (a marker); an interrupted import starts over."""
    import hashlib

    done = staging / "archives" / f"{_kind(step)}-{hashlib.sha256(repr(step).encode()).hexdigest()[:12]}.imported"
    if done.exists():
        return
    _convert(step, staging / "tree", names, label)
    done.parent.mkdir(parents=True, exist_ok=True)
    done.touch()


def _kind(step) -> str:
    return "voc" if isinstance(step, VocImport) else next(kind for kind, cls in FOLDER_STEPS.items()
                                                          if isinstance(step, cls))


def _convert(step, base: Path, names: list[str] | None, label: str) -> None:
    """Our VOC importer on a VOC root (difficult objects left out, as YOLOv5's VOC.yaml does; the images hard links
    where the file system allows), or one of our converters on its folder, relative to ``base``."""
    import utils.data.converters as converters
    from utils.data.importers import sku110k_to_yolo, visdrone_to_yolo, voc_to_yolo

    kind = _kind(step)
    folder = getattr(step, kind)  # each step's one folder field is named as its kind
    source = base / folder
    if not source.is_dir():
        raise DatasetDownloadError(f"{label}: download: {kind}: {folder} is not in {base}")
    if isinstance(step, VocImport):
        voc_to_yolo(source, base / step.into, names=names, split=step.split, keep_difficult=False)
    elif isinstance(step, Objects365Import):
        converters.objects365_to_yolo(source, names)
    else:
        {"visdrone": visdrone_to_yolo, "sku110k": sku110k_to_yolo, "xview": converters.xview_to_yolo,
         "argoverse": converters.argoverse_to_yolo}[kind](source)


def _merge(source: Path, target: Path) -> None:
    """Move everything in ``source`` into ``target``, folder into folder; otherwise what comes later replaces what
    is there, a file or a folder (a merge that was interrupted is done again the same way)."""
    for entry in source.iterdir():
        destination = target / entry.name
        if entry.is_dir() and not entry.is_symlink() and destination.is_dir():
            _merge(entry, destination)
        else:
            if destination.is_dir() and not destination.is_symlink():
                shutil.rmtree(destination)
            elif entry.is_dir() and (destination.exists() or destination.is_symlink()):
                destination.unlink()  # a folder is not renamed over a file
            os.replace(entry, destination)
