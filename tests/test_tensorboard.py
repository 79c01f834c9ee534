"""TensorBoard: the event files in the run folder hold every results.csv column per epoch (read back with
TensorBoard's own reader) and the run's plots as images; the start line; --no-tensorboard and --evolve
generations write none; a real ``tensorboard`` server on 127.0.0.1 serves a finished run's scalars."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator

import train as train_script
from tests.conftest import make_tiny_run
from utils.loggers import RESULTS_KEYS, TensorBoardLogger
from utils.plots import read_results_csv

START_LINE = "TensorBoard: Start with 'tensorboard --logdir {}', view at http://localhost:6006/"
SERVER_WAIT_S = 120  # a cold start of tensorboard on a busy 2-core machine takes seconds, not minutes


def read_events(folder: Path) -> event_accumulator.EventAccumulator:
    everything = {event_accumulator.SCALARS: 0, event_accumulator.IMAGES: 0}
    return event_accumulator.EventAccumulator(str(folder), size_guidance=everything).Reload()


def tiny_args(root: Path, data: Path, cfg: Path, *extra: str) -> list[str]:
    return ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size", "4", "--workers", "0",
            "--device", "cpu", "--project", str(root / "runs"), "--noautoanchor", *extra]


def train_capturing_stdout(args: list[str]) -> tuple[int, str]:
    """train.py's exit status and its console output (train.py logs to stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = train_script.main(args)
    return status, out.getvalue()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished two-epoch tiny run with plots: (run folder, console output)."""
    root = tmp_path_factory.mktemp("tensorboard")
    data, cfg = make_tiny_run(root)
    status, out = train_capturing_stdout(tiny_args(root, data, cfg, "--epochs", "2"))
    assert status == 0, out[-2000:]
    return root / "runs" / "exp", out


@pytest.mark.slow
def test_event_files_hold_the_results_csv_columns_and_the_plots(finished_run):
    run, out = finished_run
    assert out.splitlines().count(START_LINE.format(run.parent)) == 1
    assert len(list(run.glob("events.out.tfevents.*"))) == 1  # in the run folder, as YOLOv5 writes them
    events = read_events(run)
    assert set(events.Tags()["scalars"]) == set(RESULTS_KEYS)  # the results.csv column names, x/lr0-2 included
    table = read_results_csv(run / "results.csv")
    assert len(table["epoch"]) == 2
    for key in RESULTS_KEYS:
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [int(e) for e in table["epoch"]], key
        # results.csv keeps 5 significant digits, the event file float32
        assert [s.value for s in scalars] == pytest.approx(table[key].tolist(), rel=1e-4, abs=1e-12), key
    assert events.Scalars("x/lr0")[0].value > 0 and events.Scalars("metrics/mAP_0.5:0.95")[-1].value >= 0
    at_end = ["results", "confusion_matrix", "PR_curve", "F1_curve", "P_curve", "R_curve", "val_batch0_labels",
              "val_batch0_pred"]
    steps = {"train_batch0": 0, "train_batch1": 0, **dict.fromkeys(at_end, 1)}  # 2 train batches, 1 val batch
    assert set(events.Tags()["images"]) == set(steps)
    for tag, step in steps.items():
        (image,) = events.Images(tag)
        suffix = ".jpg" if "batch" in tag else ".png"
        with Image.open(run / f"{tag}{suffix}") as plot:
            assert (image.step, image.width, image.height) == (step, *plot.size), tag
        assert image.encoded_image_string == (run / f"{tag}{suffix}").read_bytes(), tag  # the file as it is


def test_logger_writes_rows_and_images_and_a_resumed_run_replaces_later_rows(tmp_path, caplog):
    caplog.set_level("INFO")
    run = tmp_path / "project" / "exp"
    run.mkdir(parents=True)
    Image.fromarray(np.full((20, 30, 3), (255, 0, 0), np.uint8)).save(run / "PR_curve.png")
    Image.fromarray(np.full((8, 4), 7, np.uint8)).save(run / "labels.jpg")
    Image.fromarray(np.full((8, 4), 7, np.uint8)).save(run / "odd.bmp")
    rows = [dict.fromkeys(RESULTS_KEYS, 0.5 + epoch) for epoch in range(3)]
    logger = TensorBoardLogger(run)
    for epoch, row in enumerate(rows):
        logger.log(epoch, row)
    # a missing file or another format: a warning each, not an error
    logger.log_images([run / "PR_curve.png", run / "missing.png", run / "odd.bmp", run / "labels.jpg"], 1)
    logger.close()
    logger.close()  # closing twice is harmless
    assert START_LINE.format(tmp_path / "project") in caplog.text
    assert "cannot read" in caplog.text and "missing.png" in caplog.text
    assert "a BMP file, not a PNG or JPEG" in caplog.text
    resumed = TensorBoardLogger(run, purge_step=2)  # resumed from the checkpoint of epoch 1: epoch 2 again
    resumed.log(2, dict.fromkeys(RESULTS_KEYS, 9.0))
    resumed.close()
    events = read_events(run)
    assert [(s.step, s.value) for s in events.Scalars("x/lr2")] == [(0, 0.5), (1, 1.5), (2, 9.0)]
    (image,) = events.Images("PR_curve")
    assert (image.step, image.width, image.height) == (1, 30, 20)  # before the resumed step: kept
    with Image.open(io.BytesIO(image.encoded_image_string)) as shown:
        assert shown.format == "PNG" and np.array_equal(np.asarray(shown), np.asarray(Image.open(run / "PR_curve.png")))
    (gray,) = events.Images("labels")
    assert (gray.width, gray.height) == (4, 8) and gray.encoded_image_string == (run / "labels.jpg").read_bytes()
    assert "odd" not in events.Tags()["images"]


def test_disabled_logger_writes_nothing(tmp_path, caplog):
    caplog.set_level("INFO")
    logger = TensorBoardLogger(tmp_path, enabled=False)
    logger.log(0, dict.fromkeys(RESULTS_KEYS, 1.0))
    logger.log_images([tmp_path / "x.png"], 0)
    logger.close()
    assert list(tmp_path.iterdir()) == [] and "TensorBoard" not in caplog.text


@pytest.mark.slow
def test_no_tensorboard_flag_writes_no_event_files(tmp_path):
    data, cfg = make_tiny_run(tmp_path)
    status, out = train_capturing_stdout(tiny_args(tmp_path, data, cfg, "--epochs", "1", "--noplots",
                                                   "--no-tensorboard"))
    assert status == 0
    run = tmp_path / "runs" / "exp"
    assert (run / "results.csv").exists() and not list(run.glob("events.out.tfevents.*"))
    assert "TensorBoard" not in out


def test_evolve_generations_train_without_tensorboard(tmp_path, monkeypatch):
    import utils.trainer
    from utils.evolve import METRIC_COLUMNS
    from utils.trainer import TrainResult

    generations = []

    def fake_train(config, hyp, device, resume=None, callbacks=None):
        generations.append(config)
        return TrainResult(Path(config.save_dir), None, None, last_row=dict.fromkeys(METRIC_COLUMNS, 0.1))

    monkeypatch.setattr(utils.trainer, "train", fake_train)
    config = train_script.config_from_args(train_script.parse_args(
        ["--evolve", "1", "--project", str(tmp_path), "--device", "cpu"]))
    assert train_script.run_evolution(config, "data/hyps/evolve-space.yaml") == 0
    assert len(generations) == 1 and generations[0].tensorboard is False and config.tensorboard is True


# ---------------------------------------------------------------------- a real tensorboard server

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get_json(port: int, path: str, **query):
    """GET http://127.0.0.1:port/path?query as JSON (never through a proxy)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    url = f"http://127.0.0.1:{port}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with opener.open(url, timeout=10) as response:
        return json.loads(response.read().decode("utf-8"))


def served_scalars(port: int, server: subprocess.Popen, log: Path) -> tuple[str, dict]:
    """Poll the server until it lists one run with every results.csv tag: (run name, {tag: [[time, step,
    value], ...]}); fails after SERVER_WAIT_S or when the server exits."""
    deadline = time.monotonic() + SERVER_WAIT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, f"tensorboard exited: {log.read_text()[-2000:]}"
        try:
            tags = get_json(port, "/data/plugin/scalars/tags")
        except OSError:  # not listening yet
            tags = {}
        if len(tags) == 1 and set(next(iter(tags.values()))) == set(RESULTS_KEYS):
            (run,) = tags
            return run, {key: get_json(port, "/data/plugin/scalars/scalars", run=run, tag=key) for key in RESULTS_KEYS}
        time.sleep(0.5)
    pytest.fail(f"tensorboard served no scalars within {SERVER_WAIT_S} s: {log.read_text()[-2000:]}")


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (tensorboard and the data server it may start), then SIGKILL."""
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=15)


@pytest.mark.slow
def test_tensorboard_server_serves_the_runs_scalars(finished_run, tmp_path):
    run, _ = finished_run
    port = free_port()
    log = tmp_path / "tensorboard.log"
    with open(log, "wb") as output:
        server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(run),
                                   "--host", "127.0.0.1", "--port", str(port)],
                                  stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
    try:
        name, served = served_scalars(port, server, log)
    finally:
        stop_server(server)
    assert name == "."  # --logdir is the run folder itself
    table = read_results_csv(run / "results.csv")
    for key in RESULTS_KEYS:
        assert [step for _, step, _ in served[key]] == [int(e) for e in table["epoch"]], key
        assert [value for _, _, value in served[key]] == pytest.approx(table[key].tolist(), rel=1e-4, abs=1e-12), key
