"""RunState: everything about a training run's progress that is not a tensor of the model or optimizer.

The one holder of the run's position (epoch, batches done in it, optimizer-step counters), its
record (best fitness and epoch for early stopping, the results rows so far, the last per-class mAPs
for --image-weights), the running loss sums of the epoch in progress, and the number of processes that produced it. ``to_dict`` / ``from_dict`` turn it into plain
data for the checkpoint (``utils.checkpoint`` owns where it goes in the file; the generator states beside it come from
utils.rng).

Positions are always optimizer-step boundaries: no gradient is pending when a RunState is saved, so a
run resumed from it continues exactly as if it had not stopped.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class StepCounters:
    global_step: int = 0               # batches trained since the start of training
    last_optimizer_step: int = -1      # global_step of the batch that last stepped the optimizer
    nonfinite_in_row: int = 0          # iterations with a NaN/inf loss
    nonfinite_total: int = 0
    skipped_steps_in_row: int = 0      # optimizer steps skipped for NaN/inf gradients
    skipped_steps_total: int = 0


@dataclass
class RunState:
    epoch: int = 0                     # the epoch in progress (the next one at an epoch boundary)
    batch: int = 0                     # batches of ``epoch`` already trained (0 at an epoch boundary)
    counters: StepCounters = field(default_factory=StepCounters)
    best_fitness: float = -1.0
    best_epoch: int = -1
    results: list = field(default_factory=list)  # one dict per finished epoch: {"epoch": e, column: value}
    maps: list | None = None           # per-class mAP50-95 of the last validation (--image-weights)
    loss_sums: list = field(default_factory=lambda: [0.0, 0.0, 0.0])  # box, obj, cls summed over the epoch so far
    # (while train_one_epoch runs: a float32 tensor on the training device, read only when a checkpoint is written)
    loss_batches: int = 0              # batches whose losses are in loss_sums (finite ones)
    world_size: int = 1                # processes that trained this run
    finished: bool = False
    planned_epochs: int = 0            # --time: the epoch count chosen after the first epoch (0: not yet)
    train_seconds: float = 0.0         # --time: training time spent so far (a resumed run's included)
    tracker_runs: dict = field(default_factory=dict)  # experiment trackers' run ids ({"mlflow": id}): --resume continues them

    # ------------------------------------------------------------------ epoch bookkeeping
    def start_epoch(self, epoch: int) -> None:
        """Enter ``epoch``; a resumed epoch keeps its position and loss sums."""
        if epoch != self.epoch or self.batch == 0:
            self.epoch, self.batch = epoch, 0
            self.loss_sums, self.loss_batches = [0.0, 0.0, 0.0], 0

    def end_epoch(self, values: dict[str, float], fitness: float) -> bool:
        """Record the finished epoch's results row; returns True when its fitness is at least the best so far. A tie
        counts, as in YOLOv5: best.pt is then the later epoch, and epochs of equal fitness (zero while --noval leaves
        them unvalidated, or early in a run from scratch) never count towards --patience."""
        self.results.append({"epoch": self.epoch, **values})
        improved = fitness >= self.best_fitness
        if improved:
            self.best_fitness, self.best_epoch = float(fitness), self.epoch
        self.epoch, self.batch = self.epoch + 1, 0
        self.loss_sums, self.loss_batches = [0.0, 0.0, 0.0], 0
        return improved

    def epochs_without_improvement(self) -> int:
        """Finished epochs since the best one (early stopping compares this with --patience)."""
        return self.epoch - 1 - self.best_epoch

    def stop_possible(self, patience: int) -> bool:
        """Whether --patience ends the run after the epoch in progress unless it improves: such an epoch may be the
        last, so it is validated under --noval and saved under --nosave as the final one is (YOLOv5's possible_stop)."""
        return patience > 0 and self.best_epoch >= 0 and self.epochs_without_improvement() >= patience - 1

    # ------------------------------------------------------------------ plain data
    def to_dict(self) -> dict:
        values = asdict(self)
        values["loss_sums"] = [float(value) for value in self.loss_sums]  # a device tensor while an epoch trains
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "RunState":
        """The state saved by ``to_dict``. A checkpoint's run state is validated field by field before it
        gets here (utils.checkpoint.checks.check_run); this raises ValueError on malformed data."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in values.items() if k in known}
        if not isinstance(values.get("counters"), dict):
            raise ValueError("run state field 'counters' is missing or not a dict")
        counters = StepCounters(**{k: int(v) for k, v in values.pop("counters").items()})
        state = cls(counters=counters, **values)
        state.epoch, state.batch = int(state.epoch), int(state.batch)
        state.planned_epochs, state.train_seconds = int(state.planned_epochs), float(state.train_seconds)
        if state.planned_epochs < 0 or not 0 <= state.train_seconds < float("inf"):
            raise ValueError("malformed run state (--time epoch count or time spent)")
        state.tracker_runs = dict(state.tracker_runs)  # absent from checkpoints written before trackers: {}
        state.loss_sums = [float(v) for v in state.loss_sums]
        if len(state.loss_sums) != 3 or not isinstance(state.results, list):
            raise ValueError("malformed run state")
        return state
