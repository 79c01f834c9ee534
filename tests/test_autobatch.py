"""AutoBatch (--batch-size -1): the linear fit, the fraction of free memory, clamping, a probe that runs out of
memory, the refusal on the CPU, the decision shared under torchrun, and the chosen batch saved with the run.
The memory probe is a fake here; tests/test_cuda.py measures the real one on a GPU."""
from __future__ import annotations

import argparse
import logging

import pytest
import torch
import yaml

import train as train_script
from tests.conftest import make_tiny_run
from utils import autobatch
from utils.autobatch import AutoBatchError, autobatch as run_autobatch, choose_batch, fit_line, measure
from utils.cli import batch_size, train_batch_size
from utils.config import TrainConfig
from utils.trainer.resume import option_changes

GIB = 1 << 30
CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it in this file


def linear_probe(per_image: float, fixed: float, fails_from: int | None = None, calls: list | None = None):
    """A fake probe: ``per_image * batch + fixed`` bytes, out of memory from ``fails_from`` on."""
    def probe(batch: int) -> int:
        if calls is not None:
            calls.append(batch)
        if fails_from is not None and batch >= fails_from:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
        return int(per_image * batch + fixed)
    return probe


def test_fit_recovers_the_line_through_the_measurements():
    measured = measure(linear_probe(0.25 * GIB, 1.5 * GIB))
    assert list(measured) == [1, 2, 4, 8, 16]
    slope, intercept = fit_line(measured)
    assert slope == pytest.approx(0.25 * GIB, rel=1e-9) and intercept == pytest.approx(1.5 * GIB, rel=1e-9)


FREE = int(10.1 * GIB)


@pytest.mark.parametrize("fraction, expected", [(0.8, 26), (0.5, 14)])
def test_the_batch_fills_the_stated_fraction_of_free_memory(fraction, expected):
    # 10.1 GiB free: 0.8 -> (8.08 - 1.5) / 0.25 = 26.3 images; 0.5 -> (5.05 - 1.5) / 0.25 = 14.2
    choice = run_autobatch(linear_probe(0.25 * GIB, 1.5 * GIB), free=FREE, fraction=fraction)
    assert choice.batch == expected and choice.note == ""
    assert choice.predicted <= fraction * FREE < choice.predicted + choice.per_image


def test_default_fraction_is_yolov5s_and_the_line_says_what_was_chosen():
    choice = run_autobatch(linear_probe(0.25 * GIB, 1.5 * GIB), free=FREE)
    assert autobatch.FREE_FRACTION == 0.8 and choice.fraction == 0.8
    line = choice.summary("cuda:0", 640)
    assert "\n" not in line
    assert line.startswith("AutoBatch: batch 26 for --imgsz 640 on cuda:0: predicted 8 GiB = 79% of 10.1 GiB free "
                           "(target 80%; ")
    assert "0.25 GiB per image + 1.5 GiB, fitted on batches 1, 2, 4, 8, 16" in line
    assert choice.summary("cuda:0", 640, processes=4).startswith("AutoBatch: batch 26 per process, 104 in total")


@pytest.mark.parametrize("free, limit, expected, note", [
    (1000 * GIB, 37, 37, "clamped to 37"),        # the dataset (or MAX_BATCH_SIZE) is the limit
    (1.6 * GIB, 4096, 1, "even batch 1 is predicted above the budget"),  # at least 1
])
def test_clamped_to_one_and_the_limit(free, limit, expected, note):
    choice = run_autobatch(linear_probe(0.25 * GIB, 1.5 * GIB), free=int(free), limit=limit)
    assert choice.batch == expected and note in choice.note


def test_a_probe_out_of_memory_stops_measuring_and_caps_the_batch():
    calls = []
    choice = run_autobatch(linear_probe(0.25 * GIB, 1.5 * GIB, fails_from=8, calls=calls), free=FREE)
    assert calls == [1, 2, 4, 8]  # 16 is not tried after 8 ran out of memory
    assert choice.measured[8] is None and 16 not in choice.measured
    assert choice.batch == 4 and "batch 8 ran out of memory" in choice.note  # the fit said 26
    assert "fitted on batches 1, 2, 4" in choice.summary("cuda:0", 640)


def test_a_fitted_batch_below_the_failure_is_kept():
    choice = run_autobatch(linear_probe(0.25 * GIB, 1.5 * GIB, fails_from=16), free=3 * GIB)
    assert choice.batch == 3 and choice.note == ""  # (2.4 - 1.5) / 0.25 = 3.6, below the failed 16


def test_out_of_memory_at_batch_one_is_a_one_line_error():
    with pytest.raises(AutoBatchError, match="batch 1 ran out of GPU memory.*lower --imgsz") as error:
        run_autobatch(linear_probe(GIB, GIB, fails_from=1), free=GIB)
    assert error.value.exit_code == 2 and "\n" not in str(error.value)


def test_memory_that_does_not_grow_uses_the_largest_measured_batch():
    choice = choose_batch({1: GIB, 2: GIB, 4: GIB}, free=8 * GIB)
    assert choice.batch == 4 and "did not grow" in choice.note


def test_refused_on_the_cpu_with_one_line(tmp_path, capsys):
    with pytest.raises(AutoBatchError, match="memory is not the limit: give --batch-size") as error:
        autobatch.resolve_batch_size(-1, None, 640, torch.device("cpu"), None, lambda: 100)
    assert error.value.exit_code == 2
    project = tmp_path / "runs"
    assert train_script.main(["--batch-size", "-1", "--device", "cpu", "--epochs", "1", "--project", str(project)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["train.py: error: --batch-size -1 (AutoBatch) sizes the batch to fit GPU memory; on cpu memory "
                   "is not the limit: give --batch-size (e.g. 16)"]
    assert not project.exists()  # refused before the run folder


def test_a_given_batch_is_kept_without_measuring():
    def never(*args):
        raise AssertionError("measured a given batch")
    assert autobatch.resolve_batch_size(24, None, 640, torch.device("cpu"), None, never, never, never) == 24


def test_resolved_on_the_main_process_with_the_smallest_free_memory_and_shared(monkeypatch):
    """torchrun with 2 processes: rank 0 decides with the smaller free memory of the two, every process gets
    the per-process batch x 2, and the limit is the training images per process."""
    shared = []
    monkeypatch.setattr(autobatch.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(autobatch.dist, "gather_object", lambda value, phase: [value, 6 * GIB])
    monkeypatch.setattr(autobatch.dist, "broadcast_object", lambda value, phase: shared.append(value) or value)
    factory = lambda model, imgsz, device, dtype: linear_probe(0.25 * GIB, 1.5 * GIB)  # noqa: E731
    total = autobatch.resolve_batch_size(-1, None, 640, CUDA, torch.float16, lambda: 1000, factory, lambda d: 10 * GIB)
    assert shared == [("ok", 13)] and total == 26  # (0.8 * 6 - 1.5) / 0.25 = 13.2 per process
    total = autobatch.resolve_batch_size(-1, None, 640, CUDA, torch.float16, lambda: 20, factory, lambda d: 10 * GIB)
    assert total == 20  # 20 images: at most 10 per process


def test_train_batch_size_takes_minus_one_and_other_scripts_do_not():
    assert train_batch_size("-1") == -1 and train_batch_size("32") == 32
    for text in ("-2", "0", "8.5"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer in \[1, 4096\] or -1, got"):
            train_batch_size(text)
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer in \[1, 4096\], got '-1'"):
        batch_size("-1")  # val.py's --batch-size
    assert train_script.parse_args(["--batch-size", "-1"]).batch_size == -1


def test_minus_one_on_resume_keeps_the_runs_batch():
    assert option_changes({"batch_size": -1}, TrainConfig(batch_size=24)) == {}


@pytest.mark.parametrize("multi_scale", [False, True])
def test_the_chosen_batch_is_saved_with_the_run(tmp_path, monkeypatch, multi_scale):
    """The trainer resolves -1 before writing opt.yaml and checkpoints: the run (and its resume) keeps the
    chosen batch. It is measured in the precision the run trains in (chosen first: on CUDA after the fp16
    self-check) and at the largest size --multi-scale draws. The CUDA parts (device check, free memory, the
    probe) are replaced by fakes."""
    from utils.trainer import trainer
    from utils.trainer.amp import Precision

    data, cfg = make_tiny_run(tmp_path)
    probed = []

    def fake_factory(model, imgsz, device, dtype):
        probed.append((imgsz, dtype))
        return linear_probe(GIB, 0.5 * GIB)

    def fp32_after_a_failed_self_check(amp, device, model):
        return Precision(device.type, None, torch.amp.GradScaler(device.type, enabled=False))
    monkeypatch.setattr(autobatch, "refuse_on", lambda device: None)
    monkeypatch.setattr(autobatch, "training_step_probe", fake_factory)
    monkeypatch.setattr(trainer, "choose_precision", fp32_after_a_failed_self_check)
    monkeypatch.setattr("utils.device.cuda_memory", lambda device: (int(5 / 0.8 * GIB), 80 * GIB))
    args = ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "60", "--batch-size", "-1", "--epochs", "1",
            "--device", "cpu", "--project", str(tmp_path / "runs"), "--noautoanchor", "--noplots", "--workers", "0"]
    assert train_script.main(args + (["--multi-scale"] if multi_scale else [])) == 0
    # the run's image size rounded up to the stride (64); --multi-scale draws up to 1.5 x 64 = 96
    assert probed == [(96 if multi_scale else 64, None)]
    run = tmp_path / "runs" / "exp"
    assert yaml.safe_load((run / "opt.yaml").read_text())["batch_size"] == 4  # (5 - 0.5) / 1 = 4.5
    assert torch.load(run / "weights" / "last.pt", weights_only=True)["config"]["batch_size"] == 4


def test_augment_device_sets_its_tables_memory_aside(tmp_path, monkeypatch, capsys):
    """--augment-device keeps up to three HSV tables on the device (utils/data/device_augment.py: RESIDENT_BYTES,
    154 MiB): AutoBatch sizes the step in what is left, and its line says so."""
    from utils.data.device_augment import RESIDENT_BYTES, hsv_tables_cpu, scalar_rgb_table_cpu

    assert sum(table.nbytes for table in (*hsv_tables_cpu(), scalar_rgb_table_cpu())) == RESIDENT_BYTES
    data, cfg = make_tiny_run(tmp_path)
    monkeypatch.setattr(autobatch, "refuse_on", lambda device: None)
    monkeypatch.setattr(autobatch, "training_step_probe", lambda *args: linear_probe(GIB, 0.5 * GIB))
    free = int((5 + 0.5) / 0.8 * GIB + RESIDENT_BYTES / 2)  # batch 5 with all of it, 4 once the tables are aside
    monkeypatch.setattr("utils.device.cuda_memory", lambda device: (free, 80 * GIB))
    args = ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size", "-1",
            "--epochs", "1", "--device", "cpu", "--project", str(tmp_path / "runs"), "--noautoanchor", "--noplots",
            "--workers", "0", "--amp", "off"]
    assert train_script.main(args) == 0
    assert yaml.safe_load((tmp_path / "runs" / "exp" / "opt.yaml").read_text())["batch_size"] == 5
    assert "set aside" not in capsys.readouterr().out
    assert train_script.main(args + ["--augment-device"]) == 0
    assert yaml.safe_load((tmp_path / "runs" / "exp2" / "opt.yaml").read_text())["batch_size"] == 4
    assert f"(after {RESIDENT_BYTES / GIB:.3g} GiB set aside for --augment-device)" in capsys.readouterr().out
    assert f"{RESIDENT_BYTES / GIB:.3g}" == "0.15"


def test_multi_scale_bounds_are_the_sizes_it_draws():
    import numpy as np

    from utils.data.transforms import multi_scale_bounds, multi_scale_size

    for imgsz, stride in ((64, 32), (640, 32), (320, 64), (100, 32)):
        rng = np.random.default_rng(0)
        drawn = {multi_scale_size(imgsz, stride, rng) for _ in range(5000)}
        assert (min(drawn), max(drawn)) == multi_scale_bounds(imgsz, stride)


def test_cuda_graphs_halve_the_target_on_one_process(monkeypatch, caplog):
    """--cuda-graphs keeps the graphs' own memory pool beside the eager allocator's (where a smaller last batch runs):
    AutoBatch aims at half its usual fraction; under DDP the graphs are not used."""
    factory = lambda model, imgsz, device, dtype: linear_probe(0.25 * GIB, 1.5 * GIB)  # noqa: E731
    with caplog.at_level(logging.INFO):
        plain = autobatch.resolve_batch_size(-1, None, 640, CUDA, torch.float16, lambda: 1000, factory,
                                             lambda d: 11 * GIB)
        graphed = autobatch.resolve_batch_size(-1, None, 640, CUDA, torch.float16, lambda: 1000, factory,
                                               lambda d: 11 * GIB, graphs=True)
    assert (plain, graphed) == (29, 11)  # (0.8 * 11 - 1.5) / 0.25 = 29.2; (0.4 * 11 - 1.5) / 0.25 = 11.6
    assert "target 40%" in caplog.text and "--cuda-graphs: half the usual target" in caplog.text
    monkeypatch.setattr(autobatch.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(autobatch.dist, "gather_object", lambda value, phase: [value, value])
    monkeypatch.setattr(autobatch.dist, "broadcast_object", lambda value, phase: value)
    assert autobatch.resolve_batch_size(-1, None, 640, CUDA, torch.float16, lambda: 1000, factory,
                                        lambda d: 11 * GIB, graphs=True) == 2 * 29
