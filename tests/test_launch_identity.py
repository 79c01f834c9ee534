"""utils/dist.py launch_info: the id that lets a torchrun restart find its own run folder is unique per launch,
even in containers where the host name, the agent's process id (1) and the run id ('none') repeat; a finished
run's marker is removed (utils/trainer/resume.py clear_marker)."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch.distributed as torch_dist

from utils import dist
from utils.config import TrainConfig
from utils.trainer.resume import LAUNCH_MARKER, clear_marker, mark_folder, marked_folder, resolve_run

TORCHRUN_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                      "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def container(monkeypatch):
    """A process of a container's torchrun launch: host 'trainer-0', agent PID 1, run id 'none'. Returns a
    function that makes this process a worker of restart ``restart`` under the agent store at ``port`` (None:
    no agent store) and returns its launch_info()."""
    monkeypatch.setattr(socket, "gethostname", lambda: "trainer-0")
    monkeypatch.setattr(dist.os, "getppid", lambda: 1)
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def worker(restart: int, port: int | None):
        monkeypatch.setattr(dist, "_LAUNCH_IDS", {})  # a new process: nothing asked yet
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
        if port is None:
            monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
            return dist.launch_info()
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        return dist.launch_info()
    return worker


STORES = []  # kept alive until the end of the module's tests


def agent_store() -> int:
    """The port of what torchrun's agent hosts for the whole launch (a fresh store per launch)."""
    STORES.append(torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
    return STORES[-1].port


def test_a_plain_process_has_no_launch(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert dist.launch_info() == dist.LaunchInfo(0, "") and not dist.launch_info().restarted


def test_restarts_share_the_launch_id_and_a_new_launch_gets_another(container):
    first_store = agent_store()
    first = container(0, first_store)
    restarted = container(1, first_store)
    again = container(2, first_store)
    second = container(0, agent_store())  # the same container started again: same host, PID and run id
    assert first.launch_id.startswith("token:") and len(first.launch_id) == len("token:") + 32
    assert restarted == dist.LaunchInfo(1, first.launch_id) and again.launch_id == first.launch_id
    assert second.launch_id != first.launch_id


def test_a_new_launch_does_not_adopt_an_old_run(container, tmp_path):
    """The old launch died before its first checkpoint; a new launch in the same container, restarted once,
    must not take the old folder (with the host:ppid:run_id id it did: 'no checkpoint yet, starting it again')."""
    old = container(0, agent_store())
    (tmp_path / "exp" / "weights").mkdir(parents=True)
    mark_folder(tmp_path / "exp", old.launch_id)
    store = agent_store()
    new = container(0, store)
    container(1, store)  # the new launch's restart
    config = TrainConfig(project=str(tmp_path))
    resolved, _, resume = resolve_run(config, {})
    assert resolved.save_dir == "" and resume is None  # a new run
    assert marked_folder(tmp_path, new.launch_id) is None
    assert marked_folder(tmp_path, old.launch_id) == tmp_path / "exp"


def test_a_restart_finds_its_own_run(container, tmp_path):
    store = agent_store()
    launch = container(0, store)
    (tmp_path / "exp" / "weights").mkdir(parents=True)
    mark_folder(tmp_path / "exp", launch.launch_id)
    container(1, store)
    resolved, _, resume = resolve_run(TrainConfig(project=str(tmp_path)), {})
    assert resolved.save_dir == str(tmp_path / "exp") and resume is None  # no checkpoint yet: started again


def fake_proc(root: Path, start_time: int, boot: str = "4f0c2a5e-0000-4000-8000-000000000001") -> Path:
    (root / "sys/kernel/random").mkdir(parents=True, exist_ok=True)
    (root / "sys/kernel/random/boot_id").write_text(boot + "\n")
    (root / "1").mkdir(exist_ok=True)
    fields = ["S", "0", "1", "1", "0", "-1", "4194560"] + ["0"] * 12 + [str(start_time)] + ["0"] * 30
    (root / "1" / "stat").write_text(f"1 (python3 -m (torch) run) {' '.join(fields)}\n")
    return root


def test_without_an_agent_store_the_agent_process_identifies_the_launch(container, tmp_path, monkeypatch):
    monkeypatch.setattr(dist, "PROC_ROOT", fake_proc(tmp_path / "a", start_time=123456))
    first = container(0, None)
    restarted = container(1, None)
    monkeypatch.setattr(dist, "PROC_ROOT", fake_proc(tmp_path / "b", start_time=987654))  # PID 1 again, later
    second = container(0, None)
    monkeypatch.setattr(dist, "PROC_ROOT", fake_proc(tmp_path / "c", start_time=123456, boot="another-boot"))
    other_machine = container(0, None)
    assert first.launch_id == "process:4f0c2a5e-0000-4000-8000-000000000001:1:123456"
    assert restarted.launch_id == first.launch_id
    assert len({first.launch_id, second.launch_id, other_machine.launch_id}) == 3


def test_unidentifiable_launch_resumes_nothing(container, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(dist, "PROC_ROOT", tmp_path / "no-proc")
    assert container(1, None).launch_id == ""
    assert "a torchrun restart will start a new run folder" in caplog.text
    mark_folder(tmp_path / "exp", "")  # nothing to mark with
    assert not (tmp_path / "exp" / LAUNCH_MARKER).exists()


def test_unreachable_agent_store_falls_back_to_the_agent_process(container, tmp_path, monkeypatch):
    monkeypatch.setattr(dist, "PROC_ROOT", fake_proc(tmp_path, start_time=5))
    monkeypatch.setattr(dist, "STORE_TIMEOUT_SECONDS", 1)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert container(0, port).launch_id.startswith("process:")


def test_the_marker_is_cleared_only_for_its_own_launch(tmp_path):
    folder = tmp_path / "exp"
    folder.mkdir()
    mark_folder(folder, "token:aaaa")
    clear_marker(folder, "token:bbbb")  # another launch's: kept
    assert (folder / LAUNCH_MARKER).read_text().strip() == "token:aaaa"
    clear_marker(folder, "token:aaaa")
    assert not (folder / LAUNCH_MARKER).exists()
    clear_marker(folder, "token:aaaa")  # nothing left: no error
    outside = tmp_path / "outside.txt"
    outside.write_text("token:aaaa\n")
    (folder / LAUNCH_MARKER).symlink_to(outside)
    clear_marker(folder, "token:aaaa")  # a planted link: neither followed nor removed
    assert outside.read_text() == "token:aaaa\n" and (folder / LAUNCH_MARKER).is_symlink()
