"""utils/evolve.py: search space files, mutation, evolve.csv (locking, corrupt rows), the driver and its outputs."""
from __future__ import annotations

import logging
import math
import multiprocessing

import numpy as np
import pytest
import yaml

from utils.config import Hyp
from utils.errors import UserError
from utils.evolve import (CSV_NAME, METRIC_COLUMNS, EvolveError, EvolveRow, ProposalLock, SearchSpace, append_row,
                          csv_columns, evolve, mutate, propose, read_rows, row_fitness, select_parent)

BASE = Hyp.load("hyp.scratch-low.yaml")
SPACE = SearchSpace.load("evolve-space.yaml")


def metrics_for(map50: float, map5095: float, tag: float = 0.0) -> dict:
    return dict(zip(METRIC_COLUMNS, (0.5, 0.4, map50, map5095, tag, 0.03, 0.01)))


def fake_training(hyp: Hyp, number: int) -> dict:
    """A 'training' whose mAP peaks at lr0 = 0.02 and mosaic = 0.5."""
    score = max(0.0, 1 - abs(hyp.lr0 - 0.02) * 20 - abs(hyp.mosaic - 0.5) * 0.2)
    return metrics_for(score, score / 2)


def random_rows(count: int, seed: int = 0) -> list[EvolveRow]:
    rng = np.random.default_rng(seed)
    rows = []
    for generation in range(1, count + 1):
        values = {key: float(rng.uniform(*SPACE.bounds[key])) for key in SPACE.keys(BASE)}
        map5095 = float(rng.uniform(0, 0.5))
        rows.append(EvolveRow(generation, metrics_for(map5095 * 1.6, map5095), BASE.replace(**values)))
    return rows


# ----------------------------------------------------------------------------- search space
def test_default_space_has_yolov5_bounds():
    assert SPACE.bounds["lr0"] == (1e-5, 0.1)
    assert SPACE.bounds["anchors"] == (2.0, 10.0)
    assert SPACE.bounds["perspective"] == (0.0, 0.001)
    assert len(SPACE.bounds) == 29 and set(SPACE.bounds) <= set(Hyp.__dataclass_fields__)
    assert "anchors" not in SPACE.keys(BASE)  # the hyp does not set anchors
    assert "anchors" in SPACE.keys(BASE.replace(anchors=3.0))
    assert "lr0              1e-05 .. 0.1  start 0.01" in SPACE.describe(BASE)
    # YOLOv5 v7's mutation gains: never mutated, a third of the step, twice the step, and 1 for the rest
    assert {key: SPACE.gain(key) for key in SPACE.bounds if SPACE.gain(key) != 1} == {
        "momentum": 0.3, "iou_t": 0.0, "anchors": 2.0, "fl_gamma": 0.0, "perspective": 0.0, "fliplr": 0.0}
    assert "fliplr           0 .. 1  start 0.5  never mutated" in SPACE.describe(BASE)


@pytest.mark.parametrize("text, expected", [
    ("lr0: [0.0, 0.1]\nlearning_rate: [0, 1]\n", "unknown hyperparameter(s) learning_rate"),
    ("lr0: [0.1, 0.01]\n", "'lr0' lower bound 0.1 is above the upper bound 0.01"),
    ("lr0: [0.0, .inf]\n", "'lr0' bounds must be finite"),
    ("lr0: 0.1\n", "'lr0' must be [lower, upper] or [lower, upper, gain]"),
    ("lr0: [0, 0.1, 1, 2]\n", "'lr0' must be [lower, upper] or [lower, upper, gain]"),
    ("lr0: [1.0e-5, 0.1, -1]\n", "'lr0' gain must be a number in [0, 10]"),
    ("lr0: [1.0e-5, 0.1, .nan]\n", "'lr0' gain must be a number in [0, 10]"),
    ("lr0: [0, one]\n", "'lr0' bounds must be numbers"),
    ("- lr0\n", "expected a mapping"),
    ("lr0: [0, 1\n", "invalid YAML"),
])
def test_bad_search_space_files(tmp_path, text, expected):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(EvolveError) as error:
        SearchSpace.load(path)
    message = str(error.value)
    assert isinstance(error.value, UserError) and "\n" not in message
    assert message.startswith(str(path)) and expected in message


def test_missing_search_space_file(tmp_path):
    with pytest.raises(EvolveError, match="cannot read the search space"):
        SearchSpace.load(tmp_path / "nothing.yaml")


def test_long_unknown_key_is_cut():
    with pytest.raises(EvolveError) as error:
        SearchSpace.from_dict({"x" * 1000: [0, 1]}, "space.yaml")
    assert len(str(error.value)) < 200


# ----------------------------------------------------------------------------- proposals
def test_first_generation_trains_the_base_hyp():
    assert propose([], BASE, SPACE, seed=0, number=1) == BASE
    mutated = propose([], BASE, SPACE, seed=0, number=2)  # a concurrent first proposal: base, mutated
    assert mutated != BASE


def test_first_generation_clips_and_rounds_the_base_hyp_as_every_proposal():
    base = BASE.replace(lr0=0.0123456789, degrees=60.0, fliplr=0.123456789)
    first = propose([], base, SPACE, seed=0, number=1)
    assert (first.lr0, first.degrees, first.fliplr) == (0.01235, 45.0, 0.12346)
    assert first.replace(lr0=base.lr0, degrees=base.degrees, fliplr=base.fliplr) == base


def test_mutation_stays_in_bounds_changes_something_and_is_reproducible():
    rows = random_rows(12)
    keys = SPACE.keys(BASE)
    for number in range(13, 113):
        hyp = propose(rows, BASE, SPACE, seed=7, number=number)
        for key in keys:
            lower, upper = SPACE.bounds[key]
            value = getattr(hyp, key)
            assert lower <= value <= upper
            assert value == round(value, 5)  # 5 decimal places, as YOLOv5's round(v, 5)
        assert hyp == propose(rows, BASE, SPACE, seed=7, number=number)
        assert hyp.anchors is None
    assert propose(rows, BASE, SPACE, seed=7, number=20) != propose(rows, BASE, SPACE, seed=8, number=20)
    assert propose(rows, BASE, SPACE, seed=7, number=20) != propose(rows, BASE, SPACE, seed=7, number=21)


def test_mutation_changes_at_least_one_key_of_the_parent():
    rows = random_rows(1)  # one row: it is always the parent
    keys = SPACE.keys(BASE)
    for number in range(2, 60):
        hyp = propose(rows, BASE, SPACE, seed=0, number=number)
        assert any(getattr(hyp, key) != getattr(rows[0].hyp, key) for key in keys)
        factors = [getattr(hyp, key) / getattr(rows[0].hyp, key) for key in keys if getattr(rows[0].hyp, key) > 0]
        assert all(0.3 - 1e-4 <= f <= 3.0 + 1e-4 for f in factors)


def test_keys_of_gain_zero_are_never_mutated():
    rows = random_rows(8)
    frozen = [key for key in SPACE.bounds if SPACE.gain(key) == 0]
    for number in range(9, 60):
        hyp = propose(rows, BASE, SPACE, seed=3, number=number)
        assert {key: getattr(hyp, key) for key in frozen} in [{key: round(getattr(row.hyp, key), 5) for key in frozen}
                                                            for row in rows]


def test_a_key_steps_in_proportion_to_its_gain():
    """The same draws with a key's gain halved move it half as far from its parent value."""
    parent = {"degrees": 10.0, "shear": 5.0}
    steps = {}
    for gain in (1.0, 0.5):
        space = SearchSpace.from_dict({"degrees": [0.0, 45.0, gain], "shear": [0.0, 10.0]})
        for number in range(40):
            mutated = mutate(parent, list(parent), space, np.random.default_rng(number))
            steps.setdefault(gain, []).append(mutated["degrees"] - parent["degrees"])
    moved = [i for i, step in enumerate(steps[1.0]) if abs(step) > 0.01 and 3.0 < 10 + step < 30.0]  # not clipped
    assert len(moved) > 10
    assert all(steps[0.5][i] == pytest.approx(steps[1.0][i] / 2, abs=2e-5) for i in moved)


def test_keys_outside_the_space_keep_base_values():
    space = SearchSpace.from_dict({"lr0": [1e-5, 0.1]})
    hyp = propose(random_rows(5), BASE, space, seed=0, number=6)
    assert hyp.replace(lr0=BASE.lr0) == BASE


def test_anchors_are_evolved_only_when_the_hyp_sets_them():
    base = BASE.replace(anchors=3.0)
    values = {propose([], base, SPACE, seed=0, number=n).anchors for n in range(2, 30)}
    assert len(values) > 1 and all(2.0 <= v <= 10.0 for v in values)


def test_evolution_starts_from_three_anchors_unless_noautoanchor():
    """As YOLOv5 v7: a hyp without an anchor count evolves from 3 (every generation fits its anchors with AutoAnchor);
    --noautoanchor keeps the model's anchors and evolves no count."""
    import train as train_script

    assert train_script.evolution_base(BASE, noautoanchor=False).anchors == 3.0
    assert train_script.evolution_base(BASE.replace(anchors=5.0), noautoanchor=False).anchors == 5.0
    assert train_script.evolution_base(BASE.replace(anchors=5.0), noautoanchor=True).anchors is None
    assert "anchors" in SPACE.keys(train_script.evolution_base(BASE, noautoanchor=False))


def test_parent_is_one_of_the_five_fittest_weighted_by_fitness():
    rows = random_rows(10, seed=3)
    order = sorted(rows, key=lambda row: -row.fitness)
    allowed = {row.hyp.lr0 for row in order[:4]}  # the 5th fittest has weight 1e-6
    rng = np.random.default_rng(0)
    picks = [select_parent(rows, ["lr0"], BASE, rng)["lr0"] for _ in range(400)]
    assert set(picks) <= allowed
    counts = [picks.count(row.hyp.lr0) for row in order[:4]]
    assert counts[0] > counts[3]  # the fittest is drawn most often
    weighted = select_parent(rows, ["lr0"], BASE, rng, parent="weighted")["lr0"]
    scores = np.array([row.fitness for row in order[:5]])
    weights = scores - scores.min() + 1e-6
    assert weighted == pytest.approx((weights * [row.hyp.lr0 for row in order[:5]]).sum() / weights.sum())


# ----------------------------------------------------------------------------- evolve.csv
def test_rows_round_trip_in_yolov5_layout(tmp_path):
    hyp = BASE.replace(lr0=0.0123456789)
    assert append_row(tmp_path, metrics_for(0.7, 0.45), hyp) == 1
    assert append_row(tmp_path, metrics_for(0.2, 0.1), BASE) == 2
    lines = (tmp_path / CSV_NAME).read_text().splitlines()
    assert [column.strip() for column in lines[0].split(",")] == csv_columns()
    assert lines[0].split(",")[0] == "   metrics/precision" and all(len(f) == 20 for f in lines[1].split(","))
    rows, count = read_rows(tmp_path / CSV_NAME)
    assert count == 2 and [row.generation for row in rows] == [1, 2]
    assert rows[0].hyp == BASE.replace(lr0=0.012346) and rows[0].hyp.anchors is None
    assert rows[0].fitness == pytest.approx(0.1 * 0.7 + 0.9 * 0.45) == row_fitness(metrics_for(0.7, 0.45))


def test_corrupt_row_is_skipped_with_a_warning(tmp_path, caplog):
    append_row(tmp_path, metrics_for(0.7, 0.45), BASE)
    with open(tmp_path / CSV_NAME, "a") as file:
        file.write("   0.5,  0.4,  garbage\n")
    append_row(tmp_path, metrics_for(0.6, 0.40), BASE)
    with caplog.at_level(logging.WARNING, logger="utils.evolve"):
        rows, count = read_rows(tmp_path / CSV_NAME)
    assert count == 3 and [row.generation for row in rows] == [1, 3]
    assert f"{tmp_path / CSV_NAME}: line 3 skipped (3 values for 36 columns)" in caplog.text


def test_torn_last_line_does_not_swallow_the_next_row(tmp_path):
    append_row(tmp_path, metrics_for(0.7, 0.45), BASE)
    with open(tmp_path / CSV_NAME, "a") as file:
        file.write("                 0.5,                 0.4,   0.")  # a writer killed mid-line
    assert append_row(tmp_path, metrics_for(0.6, 0.40), BASE) == 3
    rows, count = read_rows(tmp_path / CSV_NAME)
    assert count == 3 and [row.generation for row in rows] == [1, 3]


def test_foreign_header_is_refused(tmp_path):
    (tmp_path / CSV_NAME).write_text("epoch,loss\n1,2\n")
    with pytest.raises(EvolveError, match="not an evolve.csv header"):
        read_rows(tmp_path / CSV_NAME)


def _append_many(folder: str, worker: int, count: int, queue) -> None:
    numbers = [append_row(folder, metrics_for(0.5, 0.25, tag=worker * 1000 + i), BASE.replace(lr0=0.001 * worker))
               for i in range(count)]
    queue.put(numbers)


def _claim_many(folder: str, count: int, queue) -> None:
    numbers = []
    for _ in range(count):
        with ProposalLock(folder) as lock:
            numbers.append(lock.claim(0))
    queue.put(numbers)


ROWS_EACH = 60


def test_concurrent_processes_append_whole_rows(tmp_path):
    """Each row rewrites the file (fsynced): 60 rows per process keep the test short."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [context.Process(target=_append_many, args=(str(tmp_path), worker, ROWS_EACH, queue))
               for worker in (1, 2)]
    for process in workers:
        process.start()
    numbers = queue.get(timeout=60) + queue.get(timeout=60)
    for process in workers:
        process.join(60)
        assert process.exitcode == 0
    lines = (tmp_path / CSV_NAME).read_text().splitlines()
    assert len(lines) == 2 * ROWS_EACH + 1 and all(len(line.split(",")) == 36 for line in lines)
    assert sorted(numbers) == list(range(1, 2 * ROWS_EACH + 1))  # each row got its own generation number
    rows, count = read_rows(tmp_path / CSV_NAME)
    assert count == len(rows) == 2 * ROWS_EACH
    tags = sorted(int(row.metrics["val/box_loss"]) for row in rows)
    assert tags == sorted([1000 + i for i in range(ROWS_EACH)] + [2000 + i for i in range(ROWS_EACH)])


def test_concurrent_claims_are_distinct(tmp_path):
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [context.Process(target=_claim_many, args=(str(tmp_path), 100, queue)) for _ in range(2)]
    for process in workers:
        process.start()
    numbers = queue.get(timeout=60) + queue.get(timeout=60)
    for process in workers:
        process.join(60)
    assert sorted(numbers) == list(range(1, 201))


# ----------------------------------------------------------------------------- the driver
def test_interrupted_evolve_continues_counting(tmp_path):
    seen = []

    def interrupted(hyp, number):
        if len(seen) == 2:
            raise KeyboardInterrupt
        seen.append((number, hyp))
        return fake_training(hyp, number)

    with pytest.raises(KeyboardInterrupt):
        evolve(interrupted, 5, tmp_path, SPACE, BASE, plots=False)
    assert [number for number, _ in seen] == [1, 2] and seen[0][1] == BASE
    assert read_rows(tmp_path / CSV_NAME)[1] == 2
    numbers = []

    def recording(hyp, number):
        numbers.append(number)
        return fake_training(hyp, number)

    best = evolve(recording, 3, tmp_path, SPACE, BASE, plots=False)
    assert numbers == [3, 4, 5]
    rows, count = read_rows(tmp_path / CSV_NAME)
    assert count == 5 and [row.generation for row in rows] == [1, 2, 3, 4, 5]
    assert best == max(rows, key=lambda row: row.fitness)


def test_evolve_is_reproducible_and_writes_the_best_hyp(tmp_path):
    for folder in ("a", "b"):
        evolve(fake_training, 6, tmp_path / folder, SPACE, BASE, seed=3, plots=False)
    assert (tmp_path / "a" / CSV_NAME).read_text() == (tmp_path / "b" / CSV_NAME).read_text()
    rows, _ = read_rows(tmp_path / "a" / CSV_NAME)
    best = max(rows, key=lambda row: row.fitness)
    text = (tmp_path / "a" / "hyp_evolve.yaml").read_text()
    header = text.splitlines()[:6]  # YOLOv5's layout: generations from 0, the metrics under their column names
    assert header[:3] == ["# Hyperparameter Evolution Results", f"# Best generation: {best.generation - 1}",
                          "# Last generation: 5"]
    assert [name.strip() for name in header[3][2:].split(",")] == list(METRIC_COLUMNS)
    assert [float(value) for value in header[4][2:].split(",")] == pytest.approx(list(best.metrics.values()), rel=1e-4)
    assert header[5].startswith(f"# fitness {best.fitness:.5g} (0.1 * mAP_0.5 + 0.9 * mAP_0.5:0.95), best of 6 ")
    assert Hyp.from_dict(yaml.safe_load(text)) == best.hyp


def test_concurrent_drivers_share_a_folder(tmp_path):
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=evolve, args=(fake_training, 8, tmp_path, SPACE, BASE),
                               kwargs={"plots": False}) for _ in range(2)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(60)
        assert process.exitcode == 0
    rows, count = read_rows(tmp_path / CSV_NAME)
    assert count == len(rows) == 16
    assert sum(row.hyp == BASE for row in rows) == 1  # one base run; every other proposal is a distinct mutation
    assert len({tuple(sorted(row.hyp.to_dict().items())) for row in rows}) == 16


def test_evolve_png_is_written(tmp_path):
    evolve(fake_training, 2, tmp_path, SearchSpace.from_dict({"lr0": [1e-5, 0.1], "mosaic": [0, 1]}), BASE)
    assert (tmp_path / "evolve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.png"))  # no temp file left behind
    assert math.isfinite(read_rows(tmp_path / CSV_NAME)[0][0].fitness)
