"""The image cache: one store per machine (utils/data/image_store.py, image_cache.py). The same pixels as no cache
in loader workers of every start method (none unpickles the pixels), the store removed when its run ends and a
killed run's store removed by the next (before anything is measured), room kept in shared memory for the loaders'
batches, stores and their folders this user's alone, --cache disk kept in the user cache folder (a restart decodes
nothing, a read-only dataset folder trains), and two torchrun processes filling one store together."""
from __future__ import annotations

import gc
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, make_tiny_dataset, make_tiny_run
from utils.config import Hyp
from utils.data import dataset as dataset_module
from utils.data import image_cache
from utils.data.cache_folders import CacheFolderError
from utils.data.dataset import YoloDataset
from utils.data.image_store import PAGE, CacheError, ImageStore, StoreMismatch, create_store
from utils.data.loader import create_dataloader, loader_shared_bytes, set_loader_epoch, worker_count
from utils.data.verify import scan_split


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A private shared-memory folder for the RAM stores (the machine's /dev/shm is left alone)."""
    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setattr(image_cache, "RAM_FOLDER", folder)
    return folder


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("YOLO_TRAINER_CACHE", str(tmp_path / "user-cache"))
    return tmp_path / "user-cache"


@pytest.fixture
def small_shm(tmp_path, monkeypatch):
    """A 4 MB tmpfs as the machine's shared memory (a container's /dev/shm in small); needs root to mount it."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    folder = tmp_path / "small-shm"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=1777", "tmpfs", str(folder)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    monkeypatch.setattr(image_cache, "RAM_FOLDER", folder)
    yield folder
    gc.collect()
    if subprocess.run(["umount", str(folder)], capture_output=True, timeout=30).returncode != 0:
        subprocess.run(["umount", "--lazy", str(folder)], capture_output=True, timeout=30)


@pytest.fixture
def no_umask():
    """Umask 0: the modes the tests see are the code's own, not the umask's."""
    saved = os.umask(0)
    yield
    os.umask(saved)


def killed_runs_store(folder: Path, nbytes: int) -> Path:
    """A store of about ``nbytes`` as a killed run leaves it: unlocked, its name a run store's, an hour old."""
    path = folder / f"{image_cache.RAM_PREFIX}0123456789abcdef0123-99999-deadbeef{image_cache.SUFFIX}"
    create_store(path, "killed", np.array([[max((nbytes - 2 * PAGE) // (3 * 1024), 1), 1024]]))
    past = time.time() - 3600
    os.utime(path, (past, past))
    return path


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def split(tmp_path):
    data = make_tiny_dataset(tmp_path / "data", num_train=6, num_val=2)
    return scan_split([str(data.parent / "images" / "train")], nc=2)


def batches(loader, epoch=1):
    set_loader_epoch(loader, epoch)
    return [(images.clone(), targets.clone()) for images, targets, _, _ in loader]


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_shared_cache_gives_the_same_pixels_as_no_cache(split, shm, method):
    """Loader workers of each start method read the one store (the dataset they receive names its file, never
    holds its pixels) and give the batches an uncached loader gives."""
    hyp = Hyp()
    cached, dataset = create_dataloader(None, 96, 2, 32, hyp=hyp, augment=True, shuffle=True, cache="ram", workers=2,
                                        labels=split, multiprocessing_context=method)
    plain, _ = create_dataloader(None, 96, 2, 32, hyp=hyp, augment=True, shuffle=True, cache="off", workers=0,
                                 labels=split)
    assert cached.num_workers == 2 and dataset.in_ram and len(list(shm.iterdir())) == 1
    pickled = pickle.dumps(dataset)
    assert dataset.store[0].tobytes() not in pickled and len(pickled) < dataset.store.total / 4
    assert dataset.flat.is_shared == (method != "fork")  # labels: shared memory only where workers unpickle them
    for (a, ta), (b, tb) in zip(batches(cached), batches(plain), strict=True):
        assert torch.equal(a, b) and torch.equal(ta, tb)


def test_store_format_checks(tmp_path):
    sizes = np.array([[4, 6], [2, 3]])
    path = tmp_path / "a.images"
    create_store(path, "key", sizes)
    writer = ImageStore(path, "key", sizes, writable=True)
    images = [np.full((4, 6, 3), 7, np.uint8), np.arange(18, dtype=np.uint8).reshape(2, 3, 3)]
    for i, image in enumerate(images):
        writer.write(i, image)
    with pytest.raises(ValueError, match="the store holds"):
        writer.write(1, images[0])
    with pytest.raises(StoreMismatch, match="incomplete"):
        ImageStore(path, "key", sizes)
    writer.finish()
    reader = ImageStore(path, "key", sizes)
    assert all(np.array_equal(reader[i], image) for i, image in enumerate(images))
    with pytest.raises(ValueError, match="read-only"):
        reader[0][0, 0, 0] = 1
    with pytest.raises(StoreMismatch, match="magic or key"):
        ImageStore(path, "other", sizes)
    with pytest.raises(StoreMismatch):
        ImageStore(path, "key", np.array([[4, 6], [3, 2]]))
    with pytest.raises(FileExistsError):
        create_store(path, "key", sizes)  # never an existing file
    again = pickle.loads(pickle.dumps(reader))
    assert again.identity == reader.identity and np.array_equal(again[1], images[1])
    state = pickle.dumps(reader)
    path.unlink()
    with pytest.raises(CacheError, match="gone or changed while the run uses it"):
        pickle.loads(state)


def test_a_full_file_system_is_one_line_before_any_pixel_is_written(tmp_path, monkeypatch):
    """The store's blocks are reserved when it is created: a full file system is a CacheError then, never a
    SIGBUS while a mapped page is written; nothing is left behind."""
    def full(handle, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(CacheError, match=r"a\.images: not enough space for the image cache \(0\.00 GB\): No space"):
        create_store(tmp_path / "a.images", "key", np.array([[4, 6]]))
    assert list(tmp_path.iterdir()) == []


def test_ram_store_is_removed_with_its_dataset_and_a_killed_runs_store_by_the_next(split, shm, monkeypatch):
    data = YoloDataset(split, imgsz=64, cache="ram")
    (path,) = shm.iterdir()
    assert path.name.startswith("yolo-trainer-images-") and f"-{os.getpid()}-" in path.name
    del data
    assert list(shm.iterdir()) == []
    script = KILLED_SCRIPT.format(root=str(ROOT), shm=str(shm), split=pickle.dumps(split).hex())
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    (stale,) = shm.iterdir()
    monkeypatch.setattr(image_cache, "STALE_SECONDS", 0)
    live = YoloDataset(split, imgsz=64, cache="ram")  # its creator finds the killed run's store unlocked
    assert [p.name for p in shm.iterdir()] == [Path(live.store.path).name] and not stale.exists()


KILLED_SCRIPT = '''
import os, pickle, signal, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from utils.data import image_cache
from utils.data.dataset import YoloDataset

image_cache.RAM_FOLDER = Path({shm!r})
data = YoloDataset(pickle.loads(bytes.fromhex({split!r})), imgsz=64, cache="ram")
os.kill(os.getpid(), signal.SIGKILL)
'''


def test_a_killed_runs_store_filling_shared_memory_is_removed_and_the_next_run_caches_in_ram(split, small_shm,
                                                                                             user_cache):
    """A killed run's store that fills /dev/shm (a 4 MB tmpfs here) is removed before the next run measures the free
    space: that run's store goes to shared memory, not to the disk fallback."""
    stale = killed_runs_store(small_shm, image_cache._free_bytes(small_shm))
    request_bytes = image_cache.layout(YoloDataset(split, imgsz=64)._resized_shapes())[2]
    assert image_cache._free_bytes(small_shm) < request_bytes * image_cache.RAM_MARGIN  # no room while it stays
    data = YoloDataset(split, imgsz=64, cache="ram")
    assert not stale.exists() and Path(data.store.path).parent == small_shm and data.in_ram
    assert not (user_cache / "ram").exists()  # the fallback was never needed
    path = Path(data.store.path)
    del data
    assert not path.exists()


def test_killed_runs_stores_are_removed_before_free_space_and_memory_are_read(split, shm, user_cache, monkeypatch):
    """Without root (no tmpfs to fill): the free space reported is small while the killed run's store exists, and
    the memory check records whether it still did when it ran."""
    stale = killed_runs_store(shm, 64 * 1024)
    real = image_cache._free_bytes
    monkeypatch.setattr(image_cache, "_free_bytes", lambda folder: 10 if stale.exists() else real(folder))
    seen = []
    monkeypatch.setattr(dataset_module, "check_ram_cache", lambda *args: seen.append(stale.exists()))
    data = YoloDataset(split, imgsz=64, cache="ram")
    assert seen == [False] and not stale.exists() and Path(data.store.path).parent == shm


def test_shared_memory_keeps_room_for_the_loaders_batches(tmp_path, shm, user_cache, monkeypatch):
    """/dev/shm must hold the store (RAM_MARGIN) and the loaders' batches: those of this split, and those of the
    splits this process cached before (while their stores live)."""
    request = image_cache.StoreRequest([str(tmp_path / "a.jpg")], np.array([[100, 100]]), lambda i: None, "64-area",
                                       loader_bytes=50_000)
    assert request.nbytes == 2 * PAGE + 30_000
    gc.collect()
    earlier = image_cache.shared_memory_need(0, 0)
    need = request.nbytes * 1.05 + 50_000 + earlier
    assert image_cache.shared_memory_need(request.nbytes, 50_000) == need
    for free, folder in [(need, shm), (need - 1, user_cache / "ram")]:
        monkeypatch.setattr(image_cache, "_free_bytes", lambda _, free=free: free)
        assert image_cache.RamPlacement(request).folder() == folder
    monkeypatch.undo()
    request.load = lambda i: np.full((100, 100, 3), 5, np.uint8)
    store = image_cache.shared_image_store(request, "ram")
    path = Path(store.path)
    assert image_cache.shared_memory_need(0, 0) == earlier + 50_000  # the next split keeps this one's room
    del store
    gc.collect()
    assert image_cache.shared_memory_need(0, 0) == earlier and not path.exists()


def test_loader_room_is_the_workers_batch_buffers(split, shm, monkeypatch):
    """Each worker keeps PREFETCH + SPARE_SLOTS uint8 batches of 3 x side x side (a rect batch: its padded side),
    on every process of the machine; create_dataloader hands that to the cache, 0 when loading stays inline."""
    assert loader_shared_bytes(2, 16, 640, 32, processes=2) == 2 * 2 * 6 * (16 * 3 * 640 * 640 + 24)
    assert loader_shared_bytes(3, 32, 640, 32, pad=0.5) == 3 * 6 * (32 * 3 * 672 * 672 + 24)
    assert loader_shared_bytes(0, 16, 640, 32) == 0
    given = []
    real = dataset_module.shared_image_store
    monkeypatch.setattr(dataset_module, "shared_image_store",
                        lambda request, *args, **kwargs: (given.append(request.loader_bytes),
                                                          real(request, *args, **kwargs))[1])
    create_dataloader(None, 64, 3, 32, cache="ram", workers=2, labels=split)
    create_dataloader(None, 64, 3, 32, cache="ram", workers=2, labels=split, cpus_busy=True)
    assert given == [loader_shared_bytes(worker_count(2, 3), 3, 64, 32), 0]


@pytest.mark.parametrize("mode", ["ram", "ram-fallback", "disk"])
def test_stores_and_their_folders_are_this_users_alone(split, shm, user_cache, monkeypatch, no_umask, mode):
    """Files 0600 and the user cache folders 0700 whatever the umask (0 here): others cannot read the pixels."""
    if mode == "ram-fallback":
        monkeypatch.setattr(image_cache, "_free_bytes", lambda folder: 10)
    data = YoloDataset(split, imgsz=64, cache=mode.split("-")[0])
    path = Path(data.store.path)
    assert mode_of(path) == 0o600
    assert path.parent == {"ram": shm, "ram-fallback": user_cache / "ram", "disk": user_cache / "images"}[mode]
    if mode != "ram":
        assert mode_of(path.parent) == 0o700 and mode_of(user_cache) == 0o700


def test_an_existing_cache_folder_is_narrowed_and_anothers_refused(split, user_cache):
    (user_cache / "images").mkdir(parents=True)
    (user_cache / "images").chmod(0o755)
    YoloDataset(split, imgsz=64, cache="disk")
    assert mode_of(user_cache / "images") == 0o700
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    os.chown(user_cache / "images", 65534, 65534)
    with pytest.raises(CacheFolderError, match=r"images belongs to another user \(uid 65534\): set "
                                               r"YOLO_TRAINER_CACHE to a folder of your own$") as error:
        YoloDataset(split, imgsz=64, cache="disk")
    assert "\n" not in str(error.value)


def test_a_live_runs_store_is_never_removed(split, shm, monkeypatch):
    monkeypatch.setattr(image_cache, "STALE_SECONDS", 0)
    first = YoloDataset(split, imgsz=64, cache="ram")
    second = YoloDataset(split, imgsz=96, cache="ram")
    assert Path(first.store.path).exists() and Path(second.store.path).exists()
    assert image_cache.remove_stale(shm, "*.images") == 0


def test_disk_store_is_kept_in_the_user_cache_and_read_on_restart(split, user_cache, monkeypatch):
    first = YoloDataset(split, imgsz=64, cache="disk")
    (stored,) = (user_cache / "images").iterdir()
    assert str(stored) == first.store.path
    monkeypatch.setattr(YoloDataset, "_load_resized", lambda self, i: pytest.fail("decoded on a restart"))
    again = YoloDataset(split, imgsz=64, cache="disk")
    assert again.store.path == first.store.path and np.array_equal(again.store[3], first.store[3])
    monkeypatch.undo()
    monkeypatch.setenv("YOLO_TRAINER_CACHE", str(user_cache))
    image = Path(split.im_files[0])
    os.utime(image, ns=(1, 1))  # a changed image: a new store replaces the older one of the same files
    changed = YoloDataset(split, imgsz=64, cache="disk")
    assert [p.name for p in (user_cache / "images").iterdir()] == [Path(changed.store.path).name] != [stored.name]


def test_disk_store_refused_in_one_line_when_the_disk_is_full(split, user_cache, monkeypatch):
    monkeypatch.setattr(image_cache, "_free_bytes", lambda folder: 1000)
    with pytest.raises(CacheError, match=r"^--cache disk: .* has 0\.00 GB free, the image cache needs") as error:
        YoloDataset(split, imgsz=64, cache="disk")
    assert "\n" not in str(error.value) and not list((user_cache / "images").glob("*"))


def test_small_shared_memory_falls_back_to_a_mapped_file(split, shm, user_cache, monkeypatch):
    real = image_cache._free_bytes
    monkeypatch.setattr(image_cache, "_free_bytes", lambda folder: 10 if folder == shm else real(folder))
    data = YoloDataset(split, imgsz=64, cache="ram")
    assert Path(data.store.path).parent == user_cache / "ram" and data.in_ram
    path = Path(data.store.path)
    del data
    assert not path.exists()


def test_a_read_only_dataset_folder_caches_on_disk_and_writes_nothing_there(tmp_path, user_cache):
    data = make_tiny_dataset(tmp_path / "data", num_train=4, num_val=2)
    root = data.parent
    for folder in [root, *root.rglob("*")]:
        if folder.is_dir():
            folder.chmod(0o555)
    before = sorted(root.rglob("*"))
    try:
        loader, dataset = create_dataloader(str(root / "images" / "train"), 64, 2, 32, cache="disk", workers=0,
                                            names=["a", "b"])
        assert len(list(loader)) == 2 and Path(dataset.store.path).parent == user_cache / "images"
        assert sorted(root.rglob("*")) == before  # neither label cache nor images cache beside the dataset
        assert len(list((user_cache / "labels").glob("*.npz"))) == 1
    finally:
        for folder in [root, *root.rglob("*")]:
            if folder.is_dir():
                folder.chmod(0o755)


@pytest.mark.slow
def test_a_read_only_dataset_folder_trains_with_cache_disk(tmp_path):
    """train.py end to end on a dataset whose folders are read-only (by mode bits; also through a read-only
    bind mount where this machine allows one: the mode bits alone do not stop root from writing)."""
    data, cfg = make_tiny_run(tmp_path, num_train=4, num_val=2)
    root = data.parent
    for folder in [root, *root.rglob("*")]:
        if folder.is_dir():
            folder.chmod(0o555)
    before = sorted(root.rglob("*"))
    env = {**os.environ, "YOLO_TRAINER_CACHE": str(tmp_path / "user-cache")}
    command = [sys.executable, str(ROOT / "train.py"), "--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64",
               "--batch-size", "2", "--epochs", "1", "--workers", "0", "--device", "cpu", "--noautoanchor",
               "--noplots", "--project", str(tmp_path / "runs"), "--cache", "disk"]
    bind = read_only_bind_mount(root)
    try:
        if bind:
            command = ["unshare", "--mount", "sh", "-c", f"{bind} && exec \"$@\"", "sh", *command]
        done = subprocess.run(command + ["--name", "ro"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert sorted(root.rglob("*")) == before
        assert len(list((tmp_path / "user-cache" / "images").glob("*.images"))) == 2  # train and val
    finally:
        for folder in [root, *root.rglob("*")]:
            if folder.is_dir():
                folder.chmod(0o755)


def read_only_bind_mount(root: Path) -> str:
    """The shell command that remounts ``root`` read-only in a private mount namespace, or "" where this
    machine does not allow it (not root, or no mount namespaces in a container)."""
    command = f"mount --bind {root} {root} && mount -o remount,ro,bind {root}"
    if shutil.which("unshare") is None:
        return ""
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", f"{command} && ! touch {root}/probe 2>/dev/null"],
                           capture_output=True, timeout=30)
    return command if probe.returncode == 0 else ""


@pytest.mark.slow
def test_two_torchrun_processes_fill_one_store_together(tmp_path, shm):
    data = make_tiny_dataset(tmp_path / "data", num_train=8, num_val=2)
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS_SCRIPT.format(root=str(ROOT), images=str(data.parent / "images" / "train"),
                                              shm=str(shm), out=str(tmp_path)))
    from tests.test_ddp import free_port

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    assert results[0][2] == results[1][2]  # one store, mapped by both
    assert sorted(results[0][0] + results[1][0]) == list(range(8))  # each image filled once, by one of them
    assert results[0][0] and results[1][0]  # both took a share
    assert results[0][1] and results[1][1]  # the pixels of no cache
    assert list(shm.iterdir()) == []  # removed when the run ended


TWO_RANKS_SCRIPT = '''
import json, sys, torch
sys.path.insert(0, {root!r})
from pathlib import Path
from utils import dist
from utils.data import dataset as dataset_module, image_cache
from utils.data.loader import create_dataloader
from utils.data.verify import scan_split

image_cache.RAM_FOLDER = Path({shm!r})
dist.init_distributed(torch.device("cpu"))
loads = []
original = dataset_module.YoloDataset._load_resized
dataset_module.YoloDataset._load_resized = lambda self, i: (loads.append(i), original(self, i))[1]
with dist.main_process_first("scan"):
    split = scan_split([{images!r}], nc=2)
_, data = create_dataloader(None, 64, 2, 32, cache="ram", workers=0, labels=split, rank=dist.get_rank(),
                            world_size=dist.get_world_size())
filled = sorted(loads)
cached = [data.store[i].copy() for i in range(len(data))]
path = data.store.path
store, data.store = data.store, None
same = all((a == data.load_image(i)[0]).all() for i, a in enumerate(cached))
data.store = store
Path({out!r}, f"rank{{dist.get_rank()}}.json").write_text(json.dumps([filled, same, path]))
dist.barrier("compare")
dist.cleanup()
'''


def test_auto_cache_past_its_limit_only_where_shared_memory_holds_it(split, shm, user_cache, monkeypatch):
    """--cache auto caches more than AUTO_CACHE_LIMIT when /dev/shm has room for the store and the loaders' batches
    (a GPU node's data), never as the user-cache file that a small /dev/shm falls back to; the share of the
    available memory bounds both."""
    need = dataset_module.ram_cache_bytes(split.shapes, 64)
    monkeypatch.setattr(dataset_module, "AUTO_CACHE_LIMIT", need - 1)
    monkeypatch.setattr(dataset_module, "available_memory", lambda: 10 * need)  # the share allows exactly need
    room = image_cache.shared_memory_need(need, 0)
    for free, cached in [(room, True), (room - 1, False)]:
        monkeypatch.setattr(image_cache, "_free_bytes", lambda folder, free=free: free)
        loader, data = create_dataloader(None, 64, 3, 32, cache="auto", workers=0, labels=split)
        assert data.in_ram is cached and (not cached or Path(data.store.path).parent == shm)
        del loader, data
        gc.collect()
    assert not (user_cache / "ram").exists() or not any((user_cache / "ram").iterdir())
    monkeypatch.setattr(dataset_module, "available_memory", lambda: 10 * need - 10)  # the share is short
    monkeypatch.setattr(image_cache, "_free_bytes", lambda folder: 100 * need)
    assert dataset_module.auto_cache_refusal(split.shapes, 64)[0].startswith("over 10% of the available memory")
    monkeypatch.setattr(dataset_module, "available_memory", lambda: 10 * need)
    monkeypatch.setattr(dataset_module, "AUTO_CACHE_LIMIT", need)  # within the limit: /dev/shm is not asked
    monkeypatch.setattr(image_cache, "_free_bytes", lambda folder: 0)
    assert dataset_module.auto_cache_refusal(split.shapes, 64) == (None, need)
