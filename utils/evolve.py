"""Hyperparameter evolution (YOLOv5's ``--evolve``) as a library: search space, evolve.csv, mutation, driver.

One generation = one training run with a proposed hyp; its metrics and hyp become one row of
``evolve.csv``. A proposal takes the (up to) 5 fittest rows (fitness = 0.1 mAP50 + 0.9 mAP50-95), picks
a parent ('single': one row chosen with probability proportional to fitness - min + 1e-6; 'weighted':
their fitness-weighted mean), multiplies each key of the search space by a random factor scaled by the
key's gain (YOLOv5 v7's: 0 for iou_t, fl_gamma, perspective and fliplr, which are never mutated; 0.3 for
momentum; 2 for anchors; 1 for the rest), clips it to the key's bounds and rounds it to 5 decimal places.
Without rows, the base hyp is trained unmutated (clipped and rounded the same way).

Files in the evolve folder (shared safely by several processes, e.g. one per GPU):

- ``evolve.csv``: YOLOv5's layout, a header then one row per generation, each value right-aligned in
  20 characters (``%20.5g``): the metric columns ``METRIC_COLUMNS``, then every Hyp key (an unset
  ``anchors`` is written ``nan``). A row's generation number is its position in the file: a row is added
  under an exclusive ``flock`` of ``evolve.csv.lock`` by writing the whole file anew beside it and renaming
  it into place (fsynced first), and takes the number row count + 1 at that moment, so concurrent processes
  never tear or interleave lines, a reader never sees half a file, and a run restarted after an
  interruption continues the count. When read, precision, recall and mAPs must lie in [0, 1] and the hyp
  values in ``utils.config.HYP_RANGES`` (a line that does not is skipped with a warning); the file may
  hold at most 64 MB (``utils.evolve_folder.MAX_CSV_BYTES``).
- A generation whose training fails because of its hyperparameters (``TrainingDiverged``: the loss or the
  gradients stayed NaN/inf; or an ``ArithmeticError``) is recorded like YOLOv5 records it: precision,
  recall and mAPs 0 (fitness 0), losses ``nan``; the reason is logged and the evolution goes on (the new
  row also changes what the next proposal draws from). When the first ``MAX_FIRST_FAILURES`` generations
  of a process all fail, the cause is probably not the hyp: the evolution stops with the last reason. Any
  other exception (a mistake in the command or a file, an interruption, a full disk, a bug) gives the
  proposal number back and propagates: no row. train.py checks the command once before the first
  generation (``check_evolution_command``: data, model, AutoBatch), so such a mistake is one line and no
  evolve.csv at all.
- ``evolve.csv.lock``: the lock file; it also holds the next proposal number. Each proposal claims
  one under the lock (at least row count + 1), so concurrent processes never propose the same hyp; a
  proposal that fails gives its number back when no later one was claimed. ``run_generation`` gets
  the proposal number, which is the row number the result takes unless another process appends first.
- ``hyp_evolve.yaml``: the best row's hyperparameters, with a comment header; ``evolve.png``: fitness
  against each evolved hyperparameter, best marked. Both are refreshed after every generation.
- ``.generation-<number>-<random>``: one generation's training folder (train.py makes it with
  ``utils.evolve_folder.make_scratch_folder``), removed when it ends; named by a random token because
  process ids repeat across containers sharing a folder.

Nothing in the folder is read or written through a symbolic link (``utils.evolve_folder``): the lock and
evolve.csv are opened with ``O_NOFOLLOW`` (a link is refused, naming it), new files and folders are created
exclusively (``O_EXCL``, ``mkdir``) under random names and renamed into place, which replaces a link, never
its target.

A proposal is reproducible: its random numbers come from ``numpy.random.default_rng([seed, number])``
and the rows present when it was claimed.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

import numpy as np
import yaml

from utils.config import HYP_DIR, HYP_RANGES, Hyp
from utils.errors import TrainingDiverged, WriteError, one_line, shorten
from utils.evolve_folder import CSV_NAME, EvolveError, ProposalLock, read_folder_file, replace_file
from utils.metrics import fitness
from utils.safe_yaml import read_yaml, yaml_reason

LOGGER = logging.getLogger(__name__)

METRIC_COLUMNS = ("metrics/precision", "metrics/recall", "metrics/mAP_0.5", "metrics/mAP_0.5:0.95",
                  "val/box_loss", "val/obj_loss", "val/cls_loss")
HYP_KEYS = tuple(f.name for f in dataclasses.fields(Hyp))
YAML_NAME, PLOT_NAME = "hyp_evolve.yaml", "evolve.png"
DEFAULT_SPACE = HYP_DIR / "evolve-space.yaml"
COLUMN_WIDTH = 20
PARENTS = 5  # fittest rows a parent is chosen from
MUTATION_PROBABILITY = 0.8
MUTATION_SIGMA = 0.2
FACTOR_RANGE = (0.3, 3.0)
DECIMALS = 5  # every value of the search space is rounded to 5 decimal places (YOLOv5's round(v, 5))
MAX_DRAWS = 100  # mutation draws before giving up on changing anything (e.g. every evolvable value is 0)
MAX_LOSS = 1e6  # a validation loss above this (or negative, or not finite) is read and written as nan
MAX_FIRST_FAILURES = 3  # failed generations at a process's start after which the evolution stops
# a generation's own failure, caused by its hyperparameters (the loss or the gradients stayed NaN/inf, an overflow):
# recorded with fitness 0; any other error (a file, the command) is the same for every generation and propagates
RECORDED_FAILURES = (TrainingDiverged, ArithmeticError)
FAILED_METRICS = dict(zip(METRIC_COLUMNS, (0.0, 0.0, 0.0, 0.0, math.nan, math.nan, math.nan)))


UNRECORDED_FAILURES = (WriteError, EvolveError)  # the disk or the folder: every generation would fail alike


# ----------------------------------------------------------------------------- search space
@dataclass(frozen=True)
class SearchSpace:
    """Evolvable hyp keys, their [lower, upper] bounds and mutation gains (1 unless the file gives one), in
    file order."""
    bounds: dict
    source: str = ""
    gains: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, path=DEFAULT_SPACE) -> "SearchSpace":
        path = Path(path)
        if not path.exists() and (HYP_DIR / path.name).exists():
            path = HYP_DIR / path.name
        try:
            content = read_yaml(path)  # bounded: an alias bomb is refused before it is built
        except OSError as error:
            raise EvolveError(f"{path}: cannot read the search space ({error.strerror or type(error).__name__})"
                              ) from None
        except yaml.YAMLError as error:
            raise EvolveError(f"{path}: invalid YAML ({yaml_reason(error)})") from None
        return cls.from_dict(content, str(path))

    @classmethod
    def from_dict(cls, content, source: str = "<search space>") -> "SearchSpace":
        if not isinstance(content, dict) or not content:
            raise EvolveError(f"{source}: expected a mapping of hyp keys to [lower, upper]")
        unknown = [key for key in content if key not in HYP_KEYS]
        if unknown:
            listed = ", ".join(shorten(key, 40).strip("'") for key in unknown[:5])
            raise EvolveError(f"{source}: unknown hyperparameter(s) {listed} (not hyp keys)")
        entries = {key: _entry(key, value, source) for key, value in content.items()}
        return cls({key: entry[:2] for key, entry in entries.items()}, source,
                   {key: entry[2] for key, entry in entries.items()})

    def gain(self, key: str) -> float:
        return self.gains.get(key, 1.0)

    def keys(self, hyp: Hyp) -> list[str]:
        """The keys evolved for ``hyp``: all of the space's, except 'anchors' when the hyp does not set it."""
        return [key for key in self.bounds if key != "anchors" or hyp.anchors is not None]

    def clip(self, key: str, value: float) -> float:
        lower, upper = self.bounds[key]
        return min(max(value, lower), upper)

    def describe(self, hyp: Hyp | None = None) -> str:
        keys = self.keys(hyp) if hyp is not None else list(self.bounds)
        lines = [f"Evolving {len(keys)} hyperparameters ({self.source or 'search space'}):"]
        for key in keys:
            lower, upper = self.bounds[key]
            start = f"  start {getattr(hyp, key):g}" if hyp is not None else ""
            gain = "" if self.gain(key) == 1 else "  never mutated" if self.gain(key) == 0 else \
                f"  gain {self.gain(key):g}"
            lines.append(f"  {key:<16} {lower:g} .. {upper:g}{start}{gain}")
        return "\n".join(lines)


MAX_GAIN = 10.0


def _entry(key: str, value, source: str) -> tuple[float, float, float]:
    """(lower, upper, gain) of one key, from [lower, upper] (gain 1) or [lower, upper, gain]: finite numbers, the
    bounds in order and both inside the values a hyp accepts (``HYP_RANGES``), so that every value a generation
    trains is one its evolve.csv row can hold; the gain in [0, 10]."""
    if not isinstance(value, (list, tuple)) or len(value) not in (2, 3) or any(isinstance(v, bool) for v in value):
        raise EvolveError(f"{source}: '{key}' must be [lower, upper] or [lower, upper, gain], got {shorten(value)}")
    if not all(isinstance(v, (int, float)) or isinstance(v, str) and len(v) <= 100 for v in value):
        raise EvolveError(f"{source}: '{key}' bounds must be numbers, got {shorten(value)}")
    try:
        lower, upper, *gain = (float(v) for v in value)
    except (ValueError, OverflowError):
        raise EvolveError(f"{source}: '{key}' bounds must be numbers, got {shorten(value)}") from None
    if not (math.isfinite(lower) and math.isfinite(upper)):
        raise EvolveError(f"{source}: '{key}' bounds must be finite, got {shorten(value)}")
    gain = gain[0] if gain else 1.0
    if not 0.0 <= gain <= MAX_GAIN:  # nan fails too
        raise EvolveError(f"{source}: '{key}' gain must be a number in [0, {MAX_GAIN:g}], got {shorten(value[2])}")
    if lower > upper:
        raise EvolveError(f"{source}: '{key}' lower bound {lower:g} is above the upper bound {upper:g}")
    allowed = HYP_RANGES[key]
    if lower not in allowed or upper not in allowed:
        raise EvolveError(f"{source}: '{key}' bounds [{lower:g}, {upper:g}] leave the values a hyp accepts, "
                          f"{allowed}: keep both inside it")
    return lower, upper, gain


# ----------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class EvolveRow:
    generation: int  # position in evolve.csv, from 1
    metrics: dict
    hyp: Hyp

    @property
    def fitness(self) -> float:
        return row_fitness(self.metrics)


def row_fitness(metrics: dict) -> float:
    """0.1 * mAP50 + 0.9 * mAP50-95 (utils.metrics.fitness) of a dict of metric columns."""
    return float(fitness([metrics[column] for column in METRIC_COLUMNS[:4]]))


def csv_columns() -> list[str]:
    return list(METRIC_COLUMNS) + list(HYP_KEYS)


def format_line(columns: list[str], metrics: dict, hyp: Hyp) -> str:
    """One evolve.csv line (with newline) in ``columns``' order; an unset hyp value is written nan."""
    values = {**{key: getattr(hyp, key) for key in HYP_KEYS}, **metrics}
    numbers = [math.nan if values[column] is None else float(values[column]) for column in columns]
    return ",".join(f"{number:{COLUMN_WIDTH}.5g}" for number in numbers) + "\n"


def parse_header(line: str, path) -> list[str]:
    columns = [column.strip() for column in line.split(",")]
    required = set(METRIC_COLUMNS) | (set(HYP_KEYS) - {"anchors"})  # YOLOv5's own files may lack anchors
    unknown = [column[:80] for column in columns if column not in csv_columns()]
    missing = sorted(required - set(columns))
    if unknown or missing or len(set(columns)) != len(columns):
        problem = f"unknown column {unknown[0]!r}" if unknown else \
            f"missing column {missing[0]!r}" if missing else "a column appears twice"
        raise EvolveError(f"{path}: first line is not an evolve.csv header ({problem})")
    return columns


def parse_line(columns: list[str], line: str, generation: int) -> EvolveRow:
    """An EvolveRow from one data line; ValueError saying what is wrong. Precision, recall and mAPs must be
    in [0, 1] (so fitnesses, and the parent weights made from them, stay small numbers) and the hyp values in
    HYP_RANGES; a loss out of [0, MAX_LOSS] is read as nan."""
    fields = line.split(",")
    if len(fields) != len(columns):
        raise ValueError(f"{len(fields)} values for {len(columns)} columns")
    if any(len(field) > 100 for field in fields):
        raise ValueError("a value longer than 100 characters")
    values = dict(zip(columns, (float(field) for field in fields)))
    metrics = {column: values[column] for column in METRIC_COLUMNS}
    if not all(0.0 <= metrics[column] <= 1.0 for column in METRIC_COLUMNS[:4]):  # nan fails too
        raise ValueError("precision, recall and mAP must be numbers in [0, 1]")
    metrics.update({column: _loss(metrics[column]) for column in METRIC_COLUMNS[4:]})
    hyp_values = {key: values[key] for key in HYP_KEYS if key in values}
    if not math.isfinite(hyp_values.get("anchors", math.nan)):
        hyp_values.pop("anchors", None)
    if not all(math.isfinite(value) for value in hyp_values.values()):
        raise ValueError("non-finite hyperparameter")
    return EvolveRow(generation, metrics, Hyp.from_dict(hyp_values, "evolve.csv row"))


def _loss(value: float) -> float:
    return float(value) if 0.0 <= value <= MAX_LOSS else math.nan


def read_rows(path, warned: set | None = None) -> tuple[list[EvolveRow], int]:
    """(usable rows, number of data lines) of an evolve.csv; ([], 0) when missing or empty. A corrupt
    line keeps its generation number and is skipped with a warning naming the line (once per ``warned``)."""
    path = Path(path)
    lines = read_folder_file(path).splitlines()
    if not lines:
        return [], 0
    columns = parse_header(lines[0], path)
    rows, generation = [], 0
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        generation += 1
        try:
            rows.append(parse_line(columns, line, generation))
        except ValueError as error:
            if warned is None or number not in warned:
                LOGGER.warning(f"{path}: line {number} skipped ({one_line(error, 120)})")
                if warned is not None:
                    warned.add(number)
    return rows, generation


# ----------------------------------------------------------------------------- the shared folder
def append_row(folder, metrics: dict, hyp: Hyp) -> int:
    """Add one generation's row to ``folder``/evolve.csv under the folder lock; returns its generation
    number (row count + 1). The file is written anew and renamed into place; the header comes with the
    first row; an unterminated last line (a foreign writer killed mid-write) is closed first, so it stays
    one corrupt line instead of joining this row."""
    metrics = _recorded(metrics)
    folder = Path(folder)
    path = folder / CSV_NAME
    with ProposalLock(folder):
        text = read_folder_file(path)
        if text:
            columns = parse_header(text.split("\n", 1)[0], path)
            count = sum(1 for line in text.splitlines()[1:] if line.strip())
            text += "" if text.endswith("\n") else "\n"
        else:
            columns, count = csv_columns(), 0
            text = ",".join(f"{column:>{COLUMN_WIDTH}}" for column in columns) + "\n"
        data = (text + format_line(columns, metrics, hyp)).encode("utf-8")
        replace_file(folder, CSV_NAME, lambda file: file.write(data))
    return count + 1


def _recorded(metrics: dict) -> dict:
    """The metric columns as a row holds them: precision, recall and mAPs checked to lie in [0, 1] (ValueError
    otherwise), losses out of [0, MAX_LOSS] as nan."""
    missing = [column for column in METRIC_COLUMNS if column not in metrics]
    if missing:
        raise ValueError(f"generation metrics lack {', '.join(missing)}")
    values = {column: float(metrics[column]) for column in METRIC_COLUMNS}
    if not all(0.0 <= values[column] <= 1.0 for column in METRIC_COLUMNS[:4]):
        raise ValueError("generation precision, recall and mAP must be numbers in [0, 1]")
    return {**values, **{column: _loss(values[column]) for column in METRIC_COLUMNS[4:]}}


# ----------------------------------------------------------------------------- proposals
def propose(rows: list[EvolveRow], base_hyp: Hyp, space: SearchSpace, seed: int = 0, number: int = 1,
            parent: str = "single") -> Hyp:
    """The hyp to train as proposal ``number``: the base hyp unmutated (its search-space keys clipped and
    rounded, as every proposal's) for the first proposal of an empty evolve.csv, else a mutation of a parent
    chosen from ``rows`` (of the base hyp while there are none). Keys outside the search space keep the base
    hyp's values."""
    if parent not in ("single", "weighted"):
        raise ValueError(f"parent must be 'single' or 'weighted', got {parent!r}")
    keys = space.keys(base_hyp)
    if not keys:
        return base_hyp
    if not rows and number <= 1:
        return base_hyp.replace(**{key: _bounded(space, key, getattr(base_hyp, key)) for key in keys})
    rng = np.random.default_rng([int(seed) % (1 << 64), int(number)])
    start = select_parent(rows, keys, base_hyp, rng, parent) if rows else \
        {key: getattr(base_hyp, key) for key in keys}
    return base_hyp.replace(**mutate(start, keys, space, rng))


def select_parent(rows: list[EvolveRow], keys: list[str], base_hyp: Hyp, rng: np.random.Generator,
                  parent: str = "single") -> dict:
    """Values of ``keys`` from the up to 5 fittest rows: one row drawn with probability proportional to
    fitness - min + 1e-6 ('single'), or their mean weighted so ('weighted')."""
    top = sorted(rows, key=lambda row: -row.fitness)[:PARENTS]
    scores = np.array([row.fitness for row in top])
    weights = scores - scores.min() + 1e-6
    values = np.array([[_value(row.hyp, key, base_hyp) for key in keys] for row in top])
    if parent == "single":
        chosen = values[rng.choice(len(top), p=weights / weights.sum())]
    else:
        chosen = (values * weights[:, None]).sum(0) / weights.sum()
    return dict(zip(keys, chosen.tolist()))


def _value(hyp: Hyp, key: str, base_hyp: Hyp) -> float:
    value = getattr(hyp, key)
    return float(getattr(base_hyp, key) if value is None else value)


def mutate(values: dict, keys: list[str], space: SearchSpace, rng: np.random.Generator,
           probability: float = MUTATION_PROBABILITY, sigma: float = MUTATION_SIGMA) -> dict:
    """Each key times a factor 1 + gain * N(0, 1) * u * sigma (with probability ``probability``; u ~ U(0, 1)
    per draw), clipped to [0.3, 3]; then clipped to the key's bounds and rounded to 5 decimal places. Drawn
    again until at least one value changes (up to 100 draws)."""
    unchanged = {key: _bounded(space, key, values[key]) for key in keys}
    gains = np.array([space.gain(key) for key in keys])
    for _ in range(MAX_DRAWS):
        mask = rng.random(len(keys)) < probability
        factors = (gains * mask * rng.standard_normal(len(keys)) * rng.random() * sigma + 1).clip(*FACTOR_RANGE)
        mutated = {key: _bounded(space, key, values[key] * factor) for key, factor in zip(keys, factors)}
        if mutated != unchanged:
            return mutated
    LOGGER.warning(f"Evolve: no hyperparameter changed in {MAX_DRAWS} mutations (evolvable values all 0?); "
                   "training the parent's values")
    return mutated


def _bounded(space: SearchSpace, key: str, value: float) -> float:
    """``value`` clipped to the key's bounds and rounded to 5 decimal places, clipped again in case the
    rounding crossed a bound given with more digits."""
    return space.clip(key, round(space.clip(key, float(value)), DECIMALS))


# ----------------------------------------------------------------------------- outputs
def best_row(rows: list[EvolveRow]) -> EvolveRow | None:
    """The fittest row (the earliest among equals), None without rows."""
    return max(rows, key=lambda row: row.fitness, default=None)


def write_best_yaml(folder, rows: list[EvolveRow], count: int) -> Path | None:
    """hyp_evolve.yaml: the best row's hyperparameters (a hyp file) under YOLOv5's comment header: the best and
    the last generation counted from 0 (a row's place among evolve.csv's data lines, as YOLOv5 numbers them), the
    best row's metrics under their column names, then a line of our own (fitness, usable rows, how to train)."""
    best = best_row(rows)
    if best is None:
        return None
    names = ", ".join(f"{column:>{COLUMN_WIDTH}s}" for column in best.metrics)
    values = ", ".join(f"{value:{COLUMN_WIDTH}.5g}" for value in best.metrics.values())
    text = ("# Hyperparameter Evolution Results\n"
            f"# Best generation: {best.generation - 1}\n"
            f"# Last generation: {count - 1}\n"
            f"# {names}\n"
            f"# {values}\n"
            f"# fitness {best.fitness:.5g} (0.1 * mAP_0.5 + 0.9 * mAP_0.5:0.95), best of {len(rows)} usable rows in "
            f"{CSV_NAME}; written {datetime.now().isoformat(timespec='seconds')}; train with: python train.py "
            f"--hyp {YAML_NAME}\n\n"
            + yaml.safe_dump(best.hyp.to_dict(), sort_keys=False))
    return replace_file(Path(folder), YAML_NAME, lambda file: file.write(text.encode("utf-8")))


def plot_evolve(rows: list[EvolveRow], keys: list[str], folder) -> Path | None:
    """evolve.png: fitness against each evolved hyperparameter, coloured by fitness, best marked with +."""
    if not rows or not keys:
        return None
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    scores = np.array([row.fitness for row in rows])
    best = int(scores.argmax())
    columns = min(5, len(keys))
    lines = math.ceil(len(keys) / columns)
    figure = Figure(figsize=(2.4 * columns, 2.2 * lines))
    figure.subplots_adjust(left=0.07, right=0.98, bottom=0.04, top=0.96, wspace=0.35, hspace=0.5)  # fixed: one draw
    for i, key in enumerate(keys):
        axes = figure.add_subplot(lines, columns, i + 1)
        values = np.array([math.nan if getattr(row.hyp, key) is None else getattr(row.hyp, key) for row in rows])
        axes.scatter(values, scores, c=scores, cmap="viridis", s=10, alpha=0.8, edgecolors="none")
        axes.plot(values[best], scores[best], "k+", markersize=14)
        axes.set_title(f"{key} = {values[best]:.3g}", fontsize=9)
        axes.tick_params(labelsize=6)
        if i % columns == 0:
            axes.set_ylabel("fitness", fontsize=7)
    return replace_file(Path(folder), PLOT_NAME, lambda file: figure.savefig(file, dpi=120, format="png"))


# ----------------------------------------------------------------------------- the driver
def evolve(run_generation: Callable[[Hyp, int], dict], generations: int, folder, space: SearchSpace,
           base_hyp: Hyp, seed: int = 0, parent: str = "single", plots: bool = True) -> EvolveRow | None:
    """Run ``generations`` more generations in ``folder``, after the rows already in its evolve.csv.

    ``run_generation(hyp, number)`` trains once and returns the metric columns (``METRIC_COLUMNS``).
    Several processes may share ``folder``; a generation that fails is recorded with fitness 0 (see the
    module docstring). Returns the best row of the file.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    keys = space.keys(base_hyp)
    LOGGER.info(space.describe(base_hyp))
    warned, durations, outcomes = set(), [], []
    for index in range(1, generations + 1):
        start = time.monotonic()
        with ProposalLock(folder) as lock:
            rows, count = read_rows(folder / CSV_NAME, warned)
            number = lock.claim(count)
        hyp = propose(rows, base_hyp, space, seed, number, parent)
        metrics, failure = _train_generation(run_generation, hyp, number, folder)
        generation = append_row(folder, metrics, hyp)
        if failure:
            LOGGER.warning(f"Evolve: generation {index}/{generations} (evolve.csv row {generation}) failed: "
                           f"{failure}; recorded with fitness 0, the evolution goes on")
        outcomes.append(failure)
        with ProposalLock(folder):
            rows, count = read_rows(folder / CSV_NAME, warned)
            write_best_yaml(folder, rows, count)
        if plots:
            plot_evolve(rows, keys, folder)
        durations.append(time.monotonic() - start)
        _log_progress(index, generations, generation, row_fitness(metrics), best_row(rows), durations)
        if len(outcomes) == MAX_FIRST_FAILURES and all(outcomes) and index < generations:
            raise EvolveError(f"{folder}: the first {MAX_FIRST_FAILURES} generations of this evolution all failed "
                              f"(recorded in {CSV_NAME} with fitness 0), so the cause is probably not the "
                              f"hyperparameters; the last: {failure}")
    return best_row(read_rows(folder / CSV_NAME, warned)[0])


def _train_generation(run_generation, hyp: Hyp, number: int, folder: Path) -> tuple[dict, str]:
    """(metrics, "") of a generation trained, or (FAILED_METRICS, the reason) of one whose training failed for
    a reason of its own (RECORDED_FAILURES). Anything else gives the proposal number back and propagates."""
    try:
        return run_generation(hyp, number), ""
    except RECORDED_FAILURES as error:
        if not isinstance(error, UNRECORDED_FAILURES):
            return dict(FAILED_METRICS), f"{type(error).__name__}: {one_line(error, 300)}"
        _give_back(folder, number)
        raise
    except BaseException:
        _give_back(folder, number)
        raise


def _give_back(folder: Path, number: int) -> None:
    with ProposalLock(folder) as lock:
        lock.give_back(number)


def _log_progress(index: int, total: int, generation: int, score: float, best: EvolveRow | None,
                  durations: list[float]) -> None:
    remaining = (total - index) * sum(durations) / len(durations)
    best_text = f"best {best.fitness:.5f} (generation {best.generation})" if best else "no usable rows"
    LOGGER.info(f"Evolve: generation {index}/{total} (evolve.csv row {generation}): fitness {score:.5f}, "
                f"{best_text}, ETA {_duration(remaining)}")


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {seconds:02d}s"
