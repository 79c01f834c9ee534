"""utils/evolve.py with hostile or unlucky inputs: a generation that fails, search spaces that are alias bombs or
leave the hyp ranges, extreme evolve.csv values, symbolic links planted in the evolve folder, generation folders
of processes that share one evolve folder (train.py run_evolution)."""
from __future__ import annotations

import logging
import math
import time

import pytest

from utils.config import Hyp
from utils.errors import WriteError
from utils.evolve import (CSV_NAME, FAILED_METRICS, MAX_FIRST_FAILURES, METRIC_COLUMNS, YAML_NAME, EvolveError,
                          ProposalLock, SearchSpace, append_row, csv_columns, evolve, format_line, propose, read_rows)
from utils.evolve_folder import (LOCK_NAME, MAX_CSV_BYTES, SCRATCH_PREFIX, make_scratch_folder,
                                 remove_scratch_folder)
from utils.trainer.loop import NonFiniteLossError

BASE = Hyp.load("hyp.scratch-low.yaml")
SPACE = SearchSpace.from_dict({"lr0": [1e-5, 0.1], "mosaic": [0.0, 1.0]}, "space.yaml")


def metrics_for(map50: float, map5095: float) -> dict:
    return dict(zip(METRIC_COLUMNS, (0.5, 0.4, map50, map5095, 0.05, 0.03, 0.01)))


def diverging_at(*numbers, error=NonFiniteLossError("loss was NaN/inf for 20 iterations in a row: lower lr0")):
    """A 'training' that fails at the given proposal numbers; records every call."""
    calls = []

    def run_generation(hyp: Hyp, number: int) -> dict:
        calls.append((number, hyp))
        if number in numbers:
            raise error
        return metrics_for(0.5, 0.3 - abs(hyp.lr0 - 0.02))
    run_generation.calls = calls
    return run_generation


# ----------------------------------------------------------------------------- failed generations
@pytest.mark.parametrize("error", [NonFiniteLossError("loss was NaN/inf for 20 iterations in a row"),
                                   FloatingPointError("overflow encountered in exp")])
def test_a_failed_generation_is_recorded_with_fitness_0_and_the_evolution_goes_on(tmp_path, caplog, error):
    training = diverging_at(2, error=error)
    with caplog.at_level(logging.WARNING, logger="utils.evolve"):
        best = evolve(training, 4, tmp_path, SPACE, BASE, plots=False)
    assert [number for number, _ in training.calls] == [1, 2, 3, 4]
    rows, count = read_rows(tmp_path / CSV_NAME)
    assert count == 4 and [row.generation for row in rows] == [1, 2, 3, 4]
    failed = rows[1]
    assert failed.fitness == 0 and failed.hyp == training.calls[1][1]
    assert [failed.metrics[c] for c in METRIC_COLUMNS[:4]] == [0, 0, 0, 0]
    assert all(math.isnan(failed.metrics[c]) for c in METRIC_COLUMNS[4:])  # no validation losses: nan
    assert f"(evolve.csv row 2) failed: {type(error).__name__}: {error}" in caplog.text
    assert "recorded with fitness 0, the evolution goes on" in caplog.text
    assert best.generation != 2 and best.fitness > 0


def test_rerunning_after_a_failure_proposes_something_else(tmp_path):
    first = diverging_at(2)
    evolve(first, 2, tmp_path, SPACE, BASE, plots=False)
    failed_hyp = first.calls[1][1]
    second = diverging_at()
    evolve(second, 1, tmp_path, SPACE, BASE, plots=False)
    assert second.calls[0][0] == 3 and second.calls[0][1] != failed_hyp
    assert read_rows(tmp_path / CSV_NAME)[1] == 3


def test_a_process_whose_first_generations_all_fail_stops(tmp_path):
    training = diverging_at(*range(1, 100))
    with pytest.raises(EvolveError) as error:
        evolve(training, 10, tmp_path, SPACE, BASE, plots=False)
    message = str(error.value)
    assert len(training.calls) == MAX_FIRST_FAILURES and "\n" not in message
    assert f"the first {MAX_FIRST_FAILURES} generations of this evolution all failed" in message
    assert "NonFiniteLossError: loss was NaN/inf" in message
    assert read_rows(tmp_path / CSV_NAME)[1] == MAX_FIRST_FAILURES


def test_failures_after_a_success_never_stop_the_evolution(tmp_path):
    training = diverging_at(*range(2, 100))
    evolve(training, 6, tmp_path, SPACE, BASE, plots=False)
    rows, count = read_rows(tmp_path / CSV_NAME)
    assert count == 6 and sum(row.fitness == 0 for row in rows) == 5


@pytest.mark.parametrize("error", [RuntimeError("a bug"), KeyboardInterrupt(),
                                   WriteError("could not write runs/x: No space left on device")])
def test_other_failures_propagate_and_give_the_number_back(tmp_path, error):
    with pytest.raises(type(error)):
        evolve(diverging_at(1, error=error), 3, tmp_path, SPACE, BASE, plots=False)
    assert read_rows(tmp_path / CSV_NAME) == ([], 0)
    with ProposalLock(tmp_path) as lock:
        assert lock.claim(0) == 1  # the next process proposes number 1 again: the base hyp


# ----------------------------------------------------------------------------- search space
def test_alias_bomb_search_space_is_refused_quickly(tmp_path):
    levels = ["&a0 [0.0, 0.1]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    path = tmp_path / "space.yaml"
    path.write_text("lr0: [" + ", ".join(levels) + "]\n")  # 10^8 numbers once expanded, under 1 KB on disk
    start = time.perf_counter()
    with pytest.raises(EvolveError) as error:
        SearchSpace.load(path)
    assert time.perf_counter() - start < 2.0
    message = str(error.value)
    assert message.startswith(f"{path}: invalid YAML (document too large once aliases are expanded")


def test_values_with_shared_references_and_long_keys_are_shown_bounded():
    """A search space given as data (SearchSpace.from_dict): a value of 10^9 shared elements is cut in the
    message, never expanded; so is a key of a million characters."""
    value = [0.0, 0.1]
    for _ in range(9):
        value = [value] * 10
    start = time.perf_counter()
    with pytest.raises(EvolveError) as bad_value:
        SearchSpace.from_dict({"lr0": value}, "space.yaml")
    with pytest.raises(EvolveError) as bad_key:
        SearchSpace.from_dict({"k" * 10 ** 6: [0, 1]}, "space.yaml")
    assert time.perf_counter() - start < 1.0
    assert str(bad_value.value).startswith("space.yaml: 'lr0' must be [lower, upper] or [lower, upper, gain], got [[[")
    assert str(bad_key.value).startswith("space.yaml: unknown hyperparameter(s) kkk")
    assert len(str(bad_value.value)) < 200 and len(str(bad_key.value)) < 200


@pytest.mark.parametrize("text, expected", [
    ("lr0: [0.0, 0.1]\n", "'lr0' bounds [0, 0.1] leave the values a hyp accepts, (0, 10]"),
    ("momentum: [0.6, 1.2]\n", "'momentum' bounds [0.6, 1.2] leave the values a hyp accepts, [0, 1)"),
    ("scale: [0.0, 1.0]\n", "'scale' bounds [0, 1] leave the values a hyp accepts, [0, 1)"),
    ("anchor_t: [0.5, 4]\n", "'anchor_t' bounds [0.5, 4] leave the values a hyp accepts, [1, 100]"),
    ("anchors: [0, 3]\n", "'anchors' bounds [0, 3] leave the values a hyp accepts, [1, 16]"),
    ("lr0: [1e-5, 1e400]\n", "'lr0' bounds must be finite"),
    ("lr0: [1, " + "9" * 500 + "]\n", "'lr0' bounds must be numbers"),
    ("lr0: [0.001, '" + "1" * 500 + "']\n", "'lr0' bounds must be numbers"),
])
def test_bounds_outside_the_hyp_ranges_are_refused(tmp_path, text, expected):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(EvolveError) as error:
        SearchSpace.load(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and expected in message and "\n" not in message and len(message) < 300


def test_every_proposal_of_the_shipped_space_is_a_valid_hyp():
    space = SearchSpace.load("evolve-space.yaml")
    rows = read_rows_of([BASE.replace(lr0=0.1, momentum=0.98, scale=0.9, anchors=10.0)])
    for number in range(2, 40):
        hyp = propose(rows, BASE.replace(anchors=3.0), space, seed=0, number=number)
        assert Hyp.from_dict(hyp.to_dict()) == hyp  # inside HYP_RANGES


def read_rows_of(hyps):
    from utils.evolve import EvolveRow
    return [EvolveRow(i + 1, metrics_for(0.5, 0.3), hyp) for i, hyp in enumerate(hyps)]


# ----------------------------------------------------------------------------- evolve.csv values
def write_csv(path, rows):
    columns = csv_columns()
    header = ",".join(f"{column:>20}" for column in columns) + "\n"
    path.write_text(header + "".join(format_line(columns, metrics, hyp) for metrics, hyp in rows))


@pytest.mark.parametrize("values", [(1e308, -1e308), (1e300, 0.5), (-0.5, 0.2), (1.5, 0.2)])
def test_extreme_metric_values_are_skipped_not_fatal(tmp_path, caplog, values):
    extreme = [(metrics_for(value, value), BASE.replace(lr0=0.001 * (i + 1))) for i, value in enumerate(values)]
    write_csv(tmp_path / CSV_NAME, extreme + [(metrics_for(0.6, 0.4), BASE)])
    with caplog.at_level(logging.WARNING, logger="utils.evolve"):
        rows, count = read_rows(tmp_path / CSV_NAME)
    usable = [value for value in values if 0 <= value <= 1]
    assert count == 3 and len(rows) == 1 + len(usable)
    assert "precision, recall and mAP must be numbers in [0, 1]" in caplog.text
    hyp = propose(rows, BASE, SPACE, seed=0, number=4)  # the parent draw works
    assert 1e-5 <= hyp.lr0 <= 0.1
    best = evolve(diverging_at(), 1, tmp_path, SPACE, BASE, plots=False)
    assert 0 <= best.fitness <= 1


def test_extreme_losses_are_read_as_nan(tmp_path):
    metrics = dict(zip(METRIC_COLUMNS, (0.5, 0.4, 0.3, 0.2, 1e300, -3.0, math.inf)))
    write_csv(tmp_path / CSV_NAME, [(metrics, BASE)])
    (row,), _ = read_rows(tmp_path / CSV_NAME)
    assert all(math.isnan(row.metrics[c]) for c in METRIC_COLUMNS[4:])
    append_row(tmp_path, metrics, BASE)  # written the way it is read
    last = (tmp_path / CSV_NAME).read_text().splitlines()[-1].split(",")
    assert [field.strip() for field in last[4:7]] == ["nan", "nan", "nan"]


def test_out_of_range_hyp_values_in_a_row_are_skipped(tmp_path, caplog):
    write_csv(tmp_path / CSV_NAME, [(metrics_for(0.5, 0.3), BASE.replace(lr0=1e30)),
                                    (metrics_for(0.5, 0.3), BASE.replace(momentum=-1.0))])
    with caplog.at_level(logging.WARNING, logger="utils.evolve"):
        assert read_rows(tmp_path / CSV_NAME) == ([], 2)
    assert "hyperparameter 'lr0' must be a finite number in (0, 10]" in caplog.text


def test_an_oversized_evolve_csv_is_refused_in_one_line(tmp_path):
    write_csv(tmp_path / CSV_NAME, [(metrics_for(0.5, 0.3), BASE)])
    with open(tmp_path / CSV_NAME, "r+b") as file:
        file.truncate(MAX_CSV_BYTES + 1)  # sparse: no real disk use
    with pytest.raises(EvolveError, match="larger than 64 MB"):
        read_rows(tmp_path / CSV_NAME)


def test_the_writer_checks_metrics_as_the_reader_does(tmp_path):
    with pytest.raises(ValueError, match="must be numbers in \\[0, 1\\]"):
        append_row(tmp_path, metrics_for(1.5, 0.2), BASE)
    assert append_row(tmp_path, FAILED_METRICS, BASE) == 1


# ----------------------------------------------------------------------------- planted links
def test_a_planted_lock_link_is_refused_and_not_written_through(outside):
    folder, target = outside
    (folder / LOCK_NAME).symlink_to(target)
    with pytest.raises(EvolveError) as error:
        evolve(diverging_at(), 1, folder, SPACE, BASE, plots=False)
    assert str(error.value) == (f"{folder / LOCK_NAME}: is a symbolic link; files in an evolve folder are never used "
                                "through links (remove it)")
    assert target.read_text() == "precious\n"


def test_a_planted_csv_link_is_refused_and_not_written_through(outside):
    folder, target = outside
    (folder / CSV_NAME).symlink_to(target)
    with pytest.raises(EvolveError, match="is a symbolic link"):
        append_row(folder, metrics_for(0.5, 0.3), BASE)
    assert target.read_text() == "precious\n"


def test_a_planted_fifo_does_not_hang(outside):
    import os
    folder, _ = outside
    os.mkfifo(folder / CSV_NAME)
    with pytest.raises(EvolveError, match="not a regular file"):
        read_rows(folder / CSV_NAME)


def test_outputs_replace_a_planted_link_instead_of_following_it(outside):
    folder, target = outside
    (folder / YAML_NAME).symlink_to(target)
    (folder / "evolve.png").symlink_to(target)
    evolve(diverging_at(), 1, folder, SPACE, BASE, plots=True)
    assert target.read_text() == "precious\n"
    assert not (folder / YAML_NAME).is_symlink() and "# Hyperparameter Evolution Results" in (folder / YAML_NAME).read_text()
    assert not (folder / "evolve.png").is_symlink()
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []  # no temp file left


def test_generation_folders_never_repeat_nor_follow_links(outside, monkeypatch):
    """Two containers, both PID 1: each generation folder has its own random name; a link planted under the
    name drawn is not followed (another name is drawn) and removing a folder never follows a link."""
    import secrets
    folder, target = outside
    monkeypatch.setattr("os.getpid", lambda: 1)
    names = {make_scratch_folder(folder, 7).name for _ in range(20)}
    assert len(names) == 20 and all(name.startswith(f"{SCRATCH_PREFIX}7-") for name in names)
    tokens = iter(["aaaa", "bbbb"])
    monkeypatch.setattr(secrets, "token_hex", lambda size: next(tokens))
    (folder / f"{SCRATCH_PREFIX}8-aaaa").symlink_to(target.parent)
    made = make_scratch_folder(folder, 8)
    assert made.name == f"{SCRATCH_PREFIX}8-bbbb" and made.is_dir() and not made.is_symlink()
    remove_scratch_folder(folder / f"{SCRATCH_PREFIX}8-aaaa")  # the link goes, its target stays
    remove_scratch_folder(made)
    assert target.read_text() == "precious\n" and not made.exists()
    assert not (folder / f"{SCRATCH_PREFIX}8-aaaa").exists()


def test_run_evolution_records_a_diverged_generation_and_cleans_its_folders(tmp_path, monkeypatch):
    """train.py run_evolution with the training replaced: generation 2 diverges; both rows are recorded and no
    generation folder is left behind."""
    import train as train_script
    import utils.trainer as trainer
    from utils.config import TrainConfig
    from utils.trainer import TrainResult

    folders = []

    def fake_train(config, hyp, device):
        folders.append(config.save_dir)
        assert (tmp_path / "e").is_dir() and config.save_dir.startswith(str(tmp_path / "e" / SCRATCH_PREFIX))
        if len(folders) == 2:
            raise NonFiniteLossError("loss was NaN/inf for 20 iterations in a row")
        return TrainResult(save_dir=config.save_dir, best=None, last=None, last_row=metrics_for(0.5, 0.3))

    monkeypatch.setattr(trainer, "train", fake_train)
    monkeypatch.setattr(trainer, "setup_process", lambda device: "cpu")
    space = tmp_path / "space.yaml"
    space.write_text("lr0: [1.0e-5, 0.1]\n")
    config = TrainConfig(project=str(tmp_path), name="e", evolve=3, cfg="models/yolov5n.yaml")
    assert train_script.run_evolution(config, str(space)) == 0
    assert len(set(folders)) == 3
    rows, count = read_rows(tmp_path / "e" / CSV_NAME)
    assert count == 3 and [row.fitness == 0 for row in rows] == [False, True, False]
    assert not [p for p in (tmp_path / "e").iterdir() if p.name.startswith(SCRATCH_PREFIX)]


# ----------------------------------------------------------------------------- a mistake in the command
def evolve_args(root, *extra):
    return ["--evolve", "3", "--epochs", "1", "--imgsz", "64", "--batch-size", "4", "--workers", "0",
            "--device", "cpu", "--project", str(root / "runs"), "--name", "evolve", "--noautoanchor", *extra]


@pytest.mark.parametrize("mistake, status, expected", [
    ("data", 1, "missing.yaml"),
    ("cfg", 1, "bad.yaml"),
    ("autobatch", 2, "--batch-size -1 (AutoBatch)"),
])
def test_a_mistake_in_the_command_stops_before_any_generation(tmp_path, capsys, mistake, status, expected):
    """--evolve with a missing --data, a bad --cfg or AutoBatch refused: one line before the first generation,
    no evolve folder and no evolve.csv row (YOLOv5 records three fitness-0 generations and exits 0)."""
    import train as train_script
    from tests.conftest import make_tiny_run

    data, cfg = make_tiny_run(tmp_path)
    bad_cfg = tmp_path / "bad.yaml"
    bad_cfg.write_text("nc: 2\nbackbone: [[-1, 1, NoSuchBlock, [16]]]\nhead: []\n")
    options = {"data": ["--data", str(tmp_path / "missing.yaml"), "--cfg", str(cfg), "--weights", ""],
               "cfg": ["--data", str(data), "--cfg", str(bad_cfg), "--weights", ""],
               "autobatch": ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--batch-size", "-1"]}[mistake]
    assert train_script.main(evolve_args(tmp_path, *options)) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: ") and expected in err[0], err
    assert not (tmp_path / "runs" / "evolve").exists()


def test_only_failures_of_the_hyperparameters_are_recorded(tmp_path):
    """A generation that fails for another reason (a file, the data: the same for every generation) gives its
    number back and stops the evolution with that reason: no fitness-0 row."""
    from utils.errors import UserError

    with pytest.raises(UserError, match="labels folder vanished"):
        evolve(diverging_at(2, error=UserError("data/labels: labels folder vanished")), 3, tmp_path, SPACE, BASE,
               plots=False)
    rows, count = read_rows(tmp_path / CSV_NAME)
    assert count == 1 and rows[0].fitness > 0  # generation 1 only
    with ProposalLock(tmp_path) as lock:
        assert lock.claim(count) == 2


@pytest.mark.slow
def test_autobatch_is_decided_once_for_the_whole_evolution(tmp_path, monkeypatch):
    """--evolve 2 --batch-size -1: AutoBatch measures once, before the first generation, and every generation
    trains with that batch (the CUDA parts are fakes: free memory, the probe)."""
    import train as train_script
    from tests.conftest import make_tiny_run
    from tests.test_autobatch import GIB, linear_probe
    from utils import autobatch
    from utils.trainer import trainer

    data, cfg = make_tiny_run(tmp_path)
    probed, batches = [], []

    def fake_factory(model, imgsz, device, dtype):
        probed.append(imgsz)
        return linear_probe(GIB, 0.5 * GIB)
    real_build_data = trainer.build_data

    def recording_build_data(config, *args, **kwargs):
        batches.append(config.batch_size)
        return real_build_data(config, *args, **kwargs)
    monkeypatch.setattr(autobatch, "refuse_on", lambda device: None)
    monkeypatch.setattr(autobatch, "training_step_probe", fake_factory)
    monkeypatch.setattr("utils.device.cuda_memory", lambda device: (int(5 / 0.8 * GIB), 80 * GIB))
    monkeypatch.setattr(trainer, "build_data", recording_build_data)
    args = evolve_args(tmp_path, "--data", str(data), "--cfg", str(cfg), "--weights", "", "--batch-size", "-1", "--noplots")
    args[1] = "2"
    assert train_script.main(args) == 0
    assert probed == [64] and batches == [4, 4]  # (5 - 0.5) / 1 GiB per image = 4.5
    assert read_rows(tmp_path / "runs" / "evolve" / CSV_NAME)[1] == 2
