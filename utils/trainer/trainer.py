"""train(config, hyp, device, resume): the coordinator of one training run.

Flow: run folder -> dataset YAML -> model (YAML, weights, or the resumed checkpoint) -> loaders ->
optimizer, scheduler, EMA (restored when resuming) -> epochs of steps -> validation on the EMA model ->
checkpoints, results.csv, plots (main process only). ``Trainer.fit`` runs epochs, ``train_one_epoch``
(utils.trainer.loop) runs the steps of one. The run's progress lives in one ``RunState``; a checkpoint
is that state plus the model, EMA, optimizer, scaler and scheduler (layout: utils.checkpoint).
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from models.fused import FusedCopy
from models.yolo import activations_out_of_place
from utils import dist
from utils.autoanchor import format_anchors, write_anchors_yaml
from utils.autobatch import auto_batch_size
from utils.callbacks import Callbacks
from utils.checkpoint import TrainingState, training_checkpoint
from utils.checkpoint.checks import check_against_run
from utils.config import Hyp, TrainConfig
from utils.device import select_device
from utils.errors import UserError
from utils.loggers import RESULTS_KEYS
from utils.loss import DetectionLoss
from utils.plots import FINAL_PLOTS, TRAIN_BATCH_PLOTS, existing_plots
from utils.trainer.amp import choose_precision, use_channels_last
from utils.trainer.compiled import compiled_model
from utils.trainer.cuda_graphs import graphed_model
from utils.trainer.ema import ModelEMA, unwrap_model
from utils.trainer.interrupt import SaveControl
from utils.data.device_augment import DeviceAugment
from utils.data.quad import LOSS_SCALE as QUAD_LOSS_SCALE, QuadBatches
from utils.trainer.loop import TrainStep, make_warmup, train_one_epoch
from utils.trainer.optim import (NOMINAL_BATCH, EpochSchedule, accumulate_steps, build_optimizer, lr_lambda,
                                 restore_optimizer, restore_scaler, restore_schedule, scaled_weight_decay,
                                 warmup_iterations)
import utils.trainer.time_budget as time_budget
from utils.trainer.time_budget import TimeBudget, end_reserve, epochs_that_fit, validation_estimate
from utils.trainer.resume import claim_run_folder, clear_marker, release_run_folder
from utils.trainer.recorder import epoch_values, fitness_of, open_recorder
from utils.trainer.setup import build_training_model, freeze_layers, resumed_model, seed_everything
from utils.trainer.stages import build_data, final_validation, fit_anchors, load_data, validate_epoch
from utils.rng import capture_rng, restore_rng
from utils.trainer.state import RunState
from utils.trainer.step_checks import StepChecks
from utils.trackers import ValPredictions
from utils.trackers.core import PREDICTIONS_FOLDER

LOGGER = logging.getLogger(__name__)


@dataclass
class TrainResult:
    save_dir: Path
    best: Path | None
    last: Path | None
    final_metrics: dict = field(default_factory=dict)
    epochs_run: int = 0
    last_row: dict = field(default_factory=dict)  # the last results.csv row (losses, metrics, learning rates)


class TrainingInterrupted(Exception):
    """A signal stopped the run after last.pt was written; ``exit_status`` is what train.py returns."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


def setup_process(device: str) -> torch.device:
    """The one place that picks this process's device and joins the process group (torchrun)."""
    selected = select_device(device, dist.dist_info().local_rank)
    dist.init_distributed(selected)
    return selected


def train(config: TrainConfig, hyp: Hyp, device: torch.device, resume: TrainingState | None = None,
          callbacks: Callbacks | None = None) -> TrainResult:
    """Train from ``config`` (a new run), or continue ``resume`` (its run folder, state and options)."""
    try:
        return Trainer(config, hyp, device, resume, callbacks or Callbacks()).fit()
    finally:
        release_run_folder(config.save_dir)  # the run folder's lock ends with the run, however it ends


# --time: a later epoch re-plans upwards only when this many more epochs fit (the mean epoch time moves a little
# every epoch; the schedule should not); downwards whenever fewer fit, so the budget holds
REPLAN_MARGIN_EPOCHS = 2


class Trainer:
    def __init__(self, config: TrainConfig, hyp: Hyp, device: torch.device, resume: TrainingState | None,
                 callbacks: Callbacks):
        self.config, self.hyp, self.device, self.callbacks = config, hyp, device, callbacks
        callbacks.run("on_pretrain_routine_start")
        self.info = dist.dist_info()
        self.main = dist.is_main_process()
        self.save_dir = open_run_folder(config, resume)
        seed_everything(config.seed + 1 + max(self.info.rank, 0), config.deterministic)
        data_cfg, names = load_data(config)
        if resume is not None:
            model = resumed_model(resume.model, names, str(resume.path))  # anchors included
        else:
            model = build_training_model(config.cfg, config.weights, len(names), names, anchors=hyp.anchors)
        grid_stride = max(int(model.stride.max()), 32)
        precision = choose_precision(config.amp, device, model)  # CUDA: after the fp16 self-check
        # --batch-size -1: measured in the run's precision, before any save
        requested_batch = config.batch_size
        config.batch_size = auto_batch_size(config, model, device, data_cfg, precision.dtype)
        if config.batch_size != requested_batch and self.main:
            callbacks.run("on_params_update", {"batch_size": config.batch_size})
        self.data = build_data(config, hyp, data_cfg, names, grid_stride, self.info, self.device)
        if resume is None:
            fit_anchors(model, config, hyp, self.data)
        LOGGER.info("%s", format_anchors(model))
        self.model = model.to(device)
        self.step, self.scheduler, self.warmup = build_step(self.model, config, hyp, self.data, device, self.info,
                                                            precision)
        self.model = unwrap_model(self.step.model)  # --sync-bn may have replaced its BatchNorm layers
        self.val_loss = DetectionLoss(self.model, hyp, imgsz=self.data.imgsz, label_smoothing=config.label_smoothing)
        self.state = RunState(world_size=self.info.world_size)
        if resume is not None:
            self._restore(resume)
        self.step.counters = self.state.counters
        self.epochs, self.budget = config.epochs, None
        self._predictions: ValPredictions | None = None  # this epoch's --bbox_interval images, for the trackers
        self._validation = None  # this epoch's validation result (utils.validation.ValResult), for the trackers
        self._start_budget()
        self.eval_model = FusedCopy(self.step.ema.ema) if self.step.ema is not None else None  # what validation runs
        self.recorder = open_recorder(config, hyp, self.save_dir, self.state, resume is not None) if self.main else None
        self.control = SaveControl(0.0 if config.nosave else config.save_every_min,  # signals still save
                                   stop_requested=lambda: callbacks.stop_training)
        if self.main:
            self._start_outputs(resume is None)
            callbacks.run("on_pretrain_routine_end", self.data.labels, dict(enumerate(self.data.names)))
        if resume is not None:
            self._restore_rng(resume.rng)  # last: nothing above may draw from the generators afterwards

    # ------------------------------------------------------------------ setup
    def _start_outputs(self, new_run: bool) -> None:
        if new_run:
            write_anchors_yaml(self.model, self.save_dir / "anchors.yaml")
            _save_yaml(self.save_dir / "hyp.yaml", self.hyp.to_dict())
            _save_yaml(self.save_dir / "opt.yaml", self.config.to_dict())
            if not self.config.noplots:
                from utils.data.plots import plot_label_correlogram, plot_labels

                plot_labels(self.data.labels, self.data.names, self.save_dir)
                plot_label_correlogram(self.data.labels, self.save_dir)
        self.recorder.restart_results(self.state.results)

    def _restore(self, resume: TrainingState) -> None:
        """Optimizer state, loss scale, EMA and run state as they were saved (checked against the model,
        optimizer and loader first); learning rates and every optimizer setting from the hyp and position."""
        step = self.step
        names = {id(parameter): name for name, parameter in self.model.named_parameters()}
        check_against_run(resume, step.optimizer, step.ema.ema if step.ema is not None else None,
                          self.data.batches_per_epoch, len(self.data.names),
                          [names.get(id(p), "?") for group in step.optimizer.param_groups for p in group["params"]])
        restore_optimizer(step.optimizer, resume.optimizer)
        restore_scaler(step.precision.scaler, resume.scaler)
        restore_schedule(self.scheduler, resume.run["epoch"])
        if step.ema is not None:
            ema_entry = resume.ema if resume.ema is not None else resume.model
            step.ema.ema.load_state_dict(ema_entry["state_dict"])
            step.ema.updates = int(resume.ema_updates)
        self.state = RunState.from_dict(resume.run)
        if resume.origin == "yolov5":  # its files count no batches: YOLOv5 numbers them epoch x batches per epoch
            counters = self.state.counters
            counters.global_step = self.state.epoch * self.data.batches_per_epoch
            counters.last_optimizer_step = counters.global_step - 1  # an optimizer step ended the epoch
        planned = self.state.planned_epochs or (None if self.config.time else self.config.epochs)
        LOGGER.info("Resuming %s from epoch %d/%s, batch %d/%d", resume.path, self.state.epoch + 1,
                    planned or "?", self.state.batch, self.data.batches_per_epoch)

    def _restore_rng(self, saved: list) -> None:
        """Each process's generators as saved; with another number of processes, a warning instead; a file without
        them (a YOLOv5 run's), the generators as --seed set them."""
        if not saved:
            LOGGER.info("Resume: %s holds no generator states; the random draws go on from --seed %d",
                        self.config.resume, self.config.seed)
            self.state.world_size = self.info.world_size
            return
        if self.state.world_size == self.info.world_size and len(saved) == self.info.world_size:
            restore_rng(saved[max(self.info.rank, 0)])
            return
        LOGGER.warning("WARNING: resuming a run trained by %d processes with %d: the total batch is kept, but the "
                       "result will not be bit-identical to an uninterrupted run", self.state.world_size,
                       self.info.world_size)
        self.state.world_size = self.info.world_size

    def _start_budget(self) -> None:
        """--time: the run's clock (a resumed run's time spent included) and the epoch count it chose, if any."""
        if self.config.time:
            self.budget = TimeBudget(self.config.time, self.state.train_seconds)
        if self.state.planned_epochs:
            self._set_epoch_count(self.state.planned_epochs)
            LOGGER.info("--time %g h: continuing the %d epochs chosen after the first epoch (%.1f s spent)",
                        self.config.time or 0, self.epochs, self.state.train_seconds)

    def _set_epoch_count(self, epochs: int) -> None:
        """Train ``epochs`` epochs in all: the LR schedule (and the warmup's target) span them from here on, as
        they would for ``--epochs epochs``; warmup keeps its length."""
        self.epochs = self.state.planned_epochs = int(epochs)
        lf = lr_lambda(self.epochs, self.hyp.lrf, cos=self.config.cos_lr)
        self.scheduler.retarget(lf)
        warmup_iters = warmup_iterations(self.hyp.warmup_epochs, self.data.batches_per_epoch)
        self.warmup = make_warmup(self.step.optimizer, warmup_iters, lf, self.hyp, self.config.batch_size,
                                  self.config.nbs)

    def _length_text(self) -> str:
        if self.budget is not None and not self.state.planned_epochs:
            return f"--time {self.budget.hours:g} h (the epoch count is set after the first epoch)"
        return f"{self.epochs} epochs"

    def _check_budget(self, stats, done: int) -> bool:
        """--time, after ``done`` epochs (decided by the main process, the same on every process): after the
        first, set the epoch count to what fits; after a later one, True when not even one more epoch fits."""
        if self.budget is None:
            return False
        decision = self._budget_decision(stats, done) if self.main else None
        planned, stop = dist.broadcast_object(decision, phase="decide the --time epoch count")
        if planned:
            self._set_epoch_count(planned)
        return stop

    def _budget_decision(self, stats, done: int) -> tuple[int, bool]:
        """(epoch count to set or 0, stop now) from the time spent and a reserve for the final validation."""
        spent, config = self.budget.spent(), self.config
        validation_s = stats.validation_time
        if config.noval and done < self.epochs:  # not measured: estimated from the training batches' time
            validation_s = validation_estimate(spent / done, self.data.batches_per_epoch, len(self.data.val_loader))
        reserve = end_reserve(validation_s, config.noval, plots=not config.noplots)
        fit = epochs_that_fit(self.budget.seconds, spent, done, reserve, most=config.epochs)
        if not self.state.planned_epochs:
            kept = "validation" if config.noplots else "validation and plots"
            capped = "; --epochs is the most" if fit == config.epochs else ""
            LOGGER.info("--time %g h: 1 epoch took %.1f s, training %d epoch%s (%.1f s kept for the final %s%s)",
                        self.budget.hours, spent, fit, "s" * (fit != 1), reserve, kept, capped)
            return fit, fit <= done
        if done >= self.epochs:
            return 0, False
        if fit <= done:
            LOGGER.info("--time %g h: %.1f s spent after %d of %d epochs, another epoch would not fit: stopping now",
                        self.budget.hours, spent, done, self.epochs)
            return 0, True
        if fit < self.epochs or fit >= self.epochs + REPLAN_MARGIN_EPOCHS:
            LOGGER.info("--time %g h: %.1f s spent after %d epochs, %d epochs in all now fit instead of %d: the LR "
                        "schedule spans %d", self.budget.hours, spent, done, fit, self.epochs, fit)
            return fit, False
        return 0, False

    # ------------------------------------------------------------------ the run
    def fit(self) -> TrainResult:
        data = self.data
        self.callbacks.run("on_train_start")
        LOGGER.info("Image sizes %d train, %d val\nUsing %d dataloader workers\nLogging results to %s\n"
                    "Starting training for %s...", data.imgsz, data.imgsz, data.workers, self.save_dir,
                    self._length_text())
        start = time.time()
        if self.budget is not None:
            self.budget.start()
        try:
            self.control.install()
            try:
                while self.state.epoch < self.epochs:
                    if self._run_epoch(self.state.epoch):
                        break
            except TrainingInterrupted:
                if not self.control.requested:
                    raise
                return self._stopped_by_callback()
            finally:
                self.control.uninstall()
            return self._finish(start)
        finally:
            if self.recorder is not None:
                self.recorder.close()  # on every way out: TensorBoard's and the trackers' threads end with the run
            self.callbacks.run("teardown")

    def _run_epoch(self, epoch: int) -> bool:
        """Train, validate and record one epoch; True when early stopping or the --time budget ends the run."""
        config, state, step = self.config, self.state, self.step
        state.start_epoch(epoch)
        self.callbacks.run("on_train_epoch_start")
        ahead = loader_runs_ahead(self.device, config.image_weights)
        self.data.set_epoch(epoch, state.batch, through=self.epochs - 1 if ahead else epoch)
        if config.image_weights:
            self.data.update_image_weights(state.maps)
        multi_scale = self.data.multi_scale_size if config.multi_scale else None
        batch_hook = _batch_plotter(self.save_dir, self.data.names) if self.main and not config.noplots else None
        transforms = [DeviceAugment(self.device) if config.augment_device else None,  # plans -> images first
                      QuadBatches(config.seed, self.info.rank) if config.quad else None]
        stats = train_one_epoch(step, self.data.batches, state, self._epochs_shown(), self.device, self.warmup,
                                self._at_step_boundary, multi_scale, batch_hook, chained(transforms), self.callbacks)
        if stats.stopped:
            raise TrainingInterrupted(self._interrupted_message(), self.control.exit_status)
        learning_rates = [group["lr"] for group in step.optimizer.param_groups]
        self.scheduler.step()
        if self.main:
            self.callbacks.run("on_train_epoch_end", epoch=epoch)
        self._agree_on_weights()
        may_end = state.stop_possible(config.patience)  # --patience may make this epoch the last
        validated = not config.noval or epoch + 1 >= self.epochs or may_end  # --noval: only the final epoch
        values, fitness, maps = self._validate(stats, learning_rates, validated, self._plots_at(epoch), epoch)
        out_of_time = self._check_budget(stats, epoch + 1)  # --time: may set self.epochs, or end the run here
        if out_of_time:
            self.epochs = state.planned_epochs = epoch + 1  # recorded: a resume trains no further epoch
        if epoch + 1 >= self.epochs and not validated:  # the budget made this the final epoch: it is validated too
            values, fitness, maps = self._validate(stats, learning_rates, True, self._plots_at(epoch), epoch)
        # the main process's row (its training losses); the metrics agree already
        values = dist.broadcast_object(values, phase="share the epoch's results row")
        improved = state.end_epoch(values, fitness)
        state.maps = maps if maps is not None else state.maps
        final_epoch = state.epoch >= self.epochs
        if self.main:
            self.recorder.log(epoch, values)
            self.recorder.trackers.log_predictions(self._predictions)  # --bbox_interval, at this epoch's step
            self._predictions = None
            if self._validation is not None:  # per-class results (and confusion matrix, if counted) for Comet
                self.recorder.trackers.log_validation(epoch, self._validation.per_class,
                                                      self._validation.confusion, self.data.names)
                self._validation = None
            if epoch == 0 and not config.noplots:
                self.recorder.log_images(existing_plots(self.save_dir, TRAIN_BATCH_PLOTS), epoch)
            self.callbacks.run("on_fit_epoch_end", [values[key] for key in RESULTS_KEYS], epoch,
                               state.best_fitness, fitness)
        saved = not config.nosave or final_epoch or may_end  # decided alike on every process (the save gathers from all)
        if saved:
            self._save_checkpoint(epoch=epoch, improved=improved)
            if self.main:
                self.callbacks.run("on_model_save", self.save_dir / "weights" / "last.pt", epoch, final_epoch,
                                   state.best_fitness, fitness)
        if not final_epoch:
            self._stop_if_signalled(saved)
        self.callbacks.run("on_epoch_stats", epoch=epoch, values=values, fitness=fitness, stats=stats)
        stop = config.patience > 0 and state.epochs_without_improvement() >= config.patience
        if stop and not final_epoch:
            LOGGER.info("Stopping training early as no improvement observed in last %d epochs. "
                        "Best results observed at epoch %d.", config.patience, state.best_epoch)
            return True
        return out_of_time

    def _plots_at(self, epoch: int) -> bool:
        """Whether ``epoch``'s validation draws the validation plots: only the final epoch's, and only when the final
        validation of best.pt (which draws them, as in YOLOv5) may not run. best.pt exists from the first epoch on,
        so that is a run of one epoch, or --nosave (best.pt is then written at the final epoch only if it improved).
        Drawing them again at the last epoch cost ~2 s of a 10-epoch BCCD run on a 2-core Xeon."""
        if epoch + 1 < self.epochs:
            return False
        return self.config.nosave or self.state.best_epoch < 0

    def _epochs_shown(self) -> int | None:
        """The run's epoch count for messages; None while --time has not chosen it yet (shown as '?')."""
        if self.budget is not None and not self.state.planned_epochs:
            return None
        return self.epochs

    def _agree_on_weights(self) -> None:
        """DDP: the main process's BatchNorm running statistics (each process updated its own from its own
        batches unless --sync-bn) and EMA become every process's, before validating and saving."""
        if not self.info.distributed:
            return
        buffers = [b for b in self.model.buffers() if b.dtype.is_floating_point]
        ema = [v for v in self.step.ema.ema.state_dict().values() if v.dtype.is_floating_point]
        dist.broadcast_tensors(buffers + ema, phase="send BatchNorm statistics and EMA")

    def _validate(self, stats, learning_rates, validate: bool, plots: bool, epoch: int):
        """Validate the EMA model through its fused copy, every process its share of the val set (when
        ``validate``); (results row, fitness, per-class mAPs), the same on every process. Every --bbox_interval
        epochs the first val batch's predictions go to the experiment trackers (``_keep_predictions``)."""
        val_start = time_budget.clock()  # the --time budget's clock: the reserve it sets aside is on it too
        metrics = None
        if validate:
            keep = self._keep_predictions(epoch)
            metrics = validate_epoch(self.eval_model.refresh(), self.data.val_loader, self.data.names, self.device,
                                     self.val_loss, self.save_dir, plots=plots and not self.config.noplots,
                                     precision=self.step.precision, distributed=self.info.distributed,
                                     first_batch=keep, callbacks=self.callbacks)
            self._validation = metrics if self.main else None
        stats.validation_time = time_budget.clock() - val_start
        values = epoch_values(stats.mean_losses.tolist(), metrics, learning_rates)
        fitness = fitness_of(values) if metrics is not None else 0.0
        return values, fitness, (metrics.maps.tolist() if metrics is not None else None)

    def _keep_predictions(self, epoch: int):
        """What this epoch's validation calls with its first batch (images, predictions, paths) to keep them for the
        trackers, or None: every --bbox_interval epochs (YOLOv5's W&B default for -1: a tenth of the epochs, every
        epoch up to 10), on the main process, only while a tracker is on. Only copies are made here; the drawing, if a
        tracker wants a picture, happens in the trackers' threads (into <run>/val_predictions/val_pred_epoch<N>.jpg)."""
        if not self.main or not self.recorder.trackers.trackers:
            return None
        interval = self.config.bbox_interval
        if interval < 1:
            interval = self.epochs // 10 if self.epochs > 10 else 1
        if (epoch + 1) % interval:
            return None
        file = self.save_dir / PREDICTIONS_FOLDER / f"val_pred_epoch{epoch}.jpg"

        def keep(images, detections, paths) -> None:
            self._predictions = ValPredictions(epoch, images, detections, paths, self.data.names, file)
        return keep

    def _stop_if_signalled(self, saved: bool) -> None:
        """At an epoch's end: a signal that came during its last batch, its validation or its save (the loop looks
        only after the optimizer steps before its last batch) stops the run here, at the epoch boundary, rather than
        after the next epoch's first steps; its checkpoint is written first where the epoch's was not (--nosave)."""
        if not self.control.decide()[1]:
            return
        if not saved:
            self._save_checkpoint()
        raise TrainingInterrupted(self._interrupted_message(), self.control.exit_status)

    def _at_step_boundary(self) -> bool:
        """After an optimizer step: write a mid-epoch checkpoint when the clock or a signal asks; True = stop."""
        save, stop = self.control.decide()
        if save:
            self.step.settle(self.state)  # the deferred checks' counts go into the checkpoint
            self._save_checkpoint()
            LOGGER.info("Saved %s at epoch %d, batch %d/%d", self.save_dir / "weights" / "last.pt",
                        self.state.epoch + 1, self.state.batch, self.data.batches_per_epoch)
        return stop

    def _save_checkpoint(self, epoch: int | None = None, improved: bool = False) -> None:
        """last.pt with the whole state (every process takes part: the random generator states are gathered)."""
        rng = dist.gather_object(capture_rng(), phase="collect generator states for the checkpoint")
        if self.main:
            if self.budget is not None:
                self.state.train_seconds = self.budget.spent()
            self.state.tracker_runs.update(self.recorder.tracker_runs())  # a --resume continues the trackers' runs
            step = self.step
            checkpoint = training_checkpoint(step.model, step.ema, step.optimizer, step.precision.scaler,
                                             self.scheduler, self.state.to_dict(), rng, self.config.to_dict(),
                                             self.hyp.to_dict())
            self.recorder.save(checkpoint, epoch, improved)
        self.control.saved()

    def _interrupted_message(self) -> str:
        last = self.save_dir / "weights" / "last.pt"
        return (f"stopped by {_signal_name(self.control.signal_number)} at epoch {self.state.epoch + 1}/"
                f"{self._epochs_shown() or '?'}, batch {self.state.batch}/{self.data.batches_per_epoch}; {last} holds this "
                f"position. Resume with: python train.py --resume {last}")

    def _finish(self, start: float) -> TrainResult:
        result = TrainResult(self.save_dir, None, None, epochs_run=self.state.epoch,
                             last_row=dict(self.state.results[-1]) if self.state.results else {})
        self._check_ranks_agree()
        LOGGER.info("\n%d epochs completed in %.3f hours.", self.state.epoch, (time.time() - start) / 3600)
        weights, final = self.save_dir / "weights", None
        if not self.config.evolve:  # a generation of --evolve is judged by its final epoch's row
            result.final_metrics, final = final_validation(self.config, weights, self.data.val_loader,
                                                           self.data.names, self.device, self.val_loss, self.save_dir,
                                                           self.info.distributed, self.step.precision, self.data.coco,
                                                           self.callbacks)
            if self.recorder is not None and final is not None and final.confusion is not None:
                # best.pt's confusion matrix (the epochs' validations count none), at the last epoch's step; its
                # per-class rows are not sent again (each epoch's are)
                self.recorder.trackers.log_validation(max(self.state.epoch - 1, 0), [], final.confusion,
                                                      self.data.names)
        if self.budget is not None:
            spent = self.budget.spent()
            LOGGER.info("--time %g h: %d epoch%s and the end of the run took %.3f h (%.1f s) of training time",
                        self.budget.hours, self.state.epoch, "s" * (self.state.epoch != 1), spent / 3600, spent)
        if self.recorder is not None:
            if not self.config.noplots:
                self.recorder.log_images(existing_plots(self.save_dir, FINAL_PLOTS), max(self.state.epoch - 1, 0))
            result.best = weights / "best.pt" if (weights / "best.pt").exists() else None
            result.last = weights / "last.pt" if (weights / "last.pt").exists() else None
            self.recorder.close(finished=True)  # best.pt, stripped, to the trackers
            clear_marker(self.save_dir, dist.launch_info().launch_id)  # finished: no restart may adopt it
            results = ((final.mp, final.mr, final.map50, final.map, *(float(x) for x in final.losses))
                       if final is not None else tuple(result.last_row.get(key, 0.0) for key in RESULTS_KEYS[3:10]))
            self.callbacks.run("on_train_end", weights / "last.pt", weights / "best.pt", max(self.state.epoch - 1, 0),
                               results)
        return result

    def _stopped_by_callback(self) -> TrainResult:
        """``callbacks.stop_training`` ended the run at an optimizer step (last.pt written there, as for a signal): no
        final validation, no ``on_train_end`` (YOLOv5's train() returns at once); the run can be resumed."""
        weights = self.save_dir / "weights"
        LOGGER.info("Stopped by callbacks.stop_training at epoch %d/%s, batch %d/%d; %s holds this position "
                    "(python train.py --resume %s continues it)", self.state.epoch + 1, self._epochs_shown() or "?",
                    self.state.batch, self.data.batches_per_epoch, weights / "last.pt", weights / "last.pt")
        return TrainResult(self.save_dir, *(weights / name if (weights / name).exists() else None
                                            for name in ("best.pt", "last.pt")),
                           epochs_run=self.state.epoch,
                           last_row=dict(self.state.results[-1]) if self.state.results else {})

    def _check_ranks_agree(self) -> None:
        """DDP: every process must end with the same weights, BatchNorm statistics and EMA; a checksum of
        each is compared across processes and the result logged (a difference is a bug worth reporting)."""
        if not self.info.distributed:
            return
        sums = [float(sum(t.double().sum() for t in module.state_dict().values() if t.dtype.is_floating_point))
                for module in (self.model, self.step.ema.ema)]
        gathered = dist.gather_object(sums, phase="compare final weights")
        if all(values == gathered[0] for values in gathered):
            LOGGER.info("DDP: model, BatchNorm statistics and EMA identical on all %d processes (checksums %.6f, %.6f)",
                        len(gathered), *gathered[0])
        else:
            LOGGER.warning("WARNING: DDP processes ended with different weights (checksums per rank: %s)", gathered)


def loader_runs_ahead(device, image_weights: bool) -> bool:
    """Whether the training loader's iterator goes on into the run's later epochs (utils.data.loader.EpochStream):
    on CUDA, unless image weights change the sampling after each epoch; not on the CPU, where the workers would build
    the next epoch's batches on the cores that validate (measured slower there: see EpochStream)."""
    return torch.device(device).type == "cuda" and not image_weights


def build_step(model, config: TrainConfig, hyp: Hyp, data, device, info, precision):
    """Memory format, SyncBatchNorm, frozen layers, optimizer, LR schedule, EMA, loss and the DDP wrapper, for
    training in ``precision`` (utils.trainer.amp.choose_precision)."""
    channels_last = use_channels_last(config.channels_last, device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = _sync_batchnorm(model, config, device, info)
    freeze_layers(model, config.freeze)
    accumulate = accumulate_steps(config.batch_size, config.nbs)
    weight_decay = scaled_weight_decay(hyp.weight_decay, config.batch_size, accumulate, config.nbs)
    if config.nbs != NOMINAL_BATCH:
        LOGGER.info("--nbs %d: an optimizer step every %d batch%s of %d after warmup, weight decay %.3g",
                    config.nbs, accumulate, "es" * (accumulate > 1), config.batch_size, weight_decay)
    optimizer = build_optimizer(model, config.optimizer, hyp.lr0, hyp.momentum, weight_decay)
    lf = lr_lambda(config.epochs, hyp.lrf, cos=config.cos_lr)
    scheduler = EpochSchedule(optimizer, lf)
    ema = ModelEMA(model)  # on every process: each validates its share of the val set
    activations_out_of_place(model)  # after the EMA's copy, which only infers and keeps them in place
    checks = StepChecks.chosen(device, optimizer)  # deferred: the loss takes fixed shapes too (nothing read)
    compute_loss = DetectionLoss(model, hyp, imgsz=data.imgsz, label_smoothing=config.label_smoothing,
                               world_size=info.world_size, fixed_shapes=checks is not None,
                               reduce_counts=_count_reducer(checks is not None) if info.distributed else None)
    train_model = model
    if info.distributed:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    per_process = max(config.batch_size // max(info.world_size, 1), 1)
    quads = config.quad and per_process >= 4  # the model then sees batches of per_process // 4 (utils/data/quad.py)
    seen = per_process // 4 if quads else per_process  # the batch the model sees
    runner = (graphed_model(config.cuda_graphs, model, precision, seen, torch.device(device), info.distributed,
                            config.multi_scale, compute_loss)
              or compiled_model(config.compile, train_model, precision, seen, torch.device(device),
                                info.distributed and config.sync_bn, config.multi_scale))
    step = TrainStep(train_model, optimizer, compute_loss, precision, ema, channels_last, checks=checks, runner=runner)
    if config.quad:
        step.loss_scale = QUAD_LOSS_SCALE
        LOGGER.info("--quad: each 4 images of a batch train as one of twice the side (2x2 tiles, or the first "
                    "upscaled), %d per batch of %d; loss x%g, as YOLOv5", per_process // 4, per_process,
                    QUAD_LOSS_SCALE)
        if per_process < 4:
            LOGGER.warning("WARNING: --quad groups 4 images of a batch, and a batch here holds %d: batches train as "
                           "they are (use --batch-size %d or more)", per_process, 4 * max(info.world_size, 1))
    warmup_iters = warmup_iterations(hyp.warmup_epochs, data.batches_per_epoch)
    warmup = make_warmup(optimizer, warmup_iters, lf, hyp, config.batch_size, config.nbs)
    return step, scheduler, warmup


def _count_reducer(in_place: bool):
    """The loss's per-step sum of match and image counts over all processes: read by the host (named for its
    timeout message), or in place on the device for the fixed-shape loss."""
    if in_place:
        return dist.all_reduce_in_place
    return functools.partial(dist.all_reduce_sum, phase="sum the batch's targets (a training step)")


def _sync_batchnorm(model, config: TrainConfig, device, info):
    """--sync-bn under DDP; a warning without DDP, and a hint when DDP batches are small without it."""
    per_process = config.batch_size // max(info.world_size, 1)
    if config.sync_bn and not info.distributed:
        LOGGER.warning("WARNING: --sync-bn has no effect in a single process (it synchronises BatchNorm across DDP "
                       "processes); training with plain BatchNorm")
        return model
    if config.sync_bn:
        from utils.trainer.sync_bn import convert_sync_batchnorm

        LOGGER.info("Using SyncBatchNorm (BatchNorm statistics over the global batch of %d)", config.batch_size)
        return convert_sync_batchnorm(model, device)
    if info.distributed and per_process < 8 and dist.is_main_process():  # the same on every process: said once
        LOGGER.warning("WARNING: %d images per process: BatchNorm statistics from so few images are noisy; "
                       "consider --sync-bn", per_process)
    return model


def open_run_folder(config: TrainConfig, resume: TrainingState | None) -> Path:
    """The run's folder on every process: the resumed checkpoint's own run (``<run>/weights/<file>``), the
    folder a torchrun restart already owns (``config.save_dir`` set by the caller), or a new
    project/name{,2,3...}, claimed by the main process (utils.trainer.resume.claim_run_folder: refused when it
    holds symbolic links, locked against a second process until ``train`` returns, marked for torchrun
    restarts). A refusal reaches every process (the others raise SharedError)."""
    outcome = None
    if dist.is_main_process():
        try:
            outcome = str(claim_run_folder(config, resume))
        except UserError as error:
            outcome = error
    outcome = dist.broadcast_object(outcome, phase="open the run folder")
    if isinstance(outcome, UserError):
        raise outcome if dist.is_main_process() else dist.SharedError(str(outcome), outcome.exit_code)
    config.save_dir = outcome
    return Path(outcome)


def _signal_name(number) -> str:
    import signal

    return signal.Signals(number).name if number else "a signal"


def chained(transforms):
    """One ``batch_transform`` applying those of ``transforms`` that are not None in order (None when there are none)."""
    transforms = [t for t in transforms if t is not None]
    if len(transforms) <= 1:
        return transforms[0] if transforms else None

    def transform(epoch, batch_index, images, targets, paths):
        for each in transforms:
            images, targets, paths = each(epoch, batch_index, images, targets, paths)
        return images, targets, paths
    return transform


def _batch_plotter(save_dir: Path, names: list[str]):
    """train_batch0..2.jpg: the first three augmented batches with their boxes."""
    from utils.drawing import plot_images

    def hook(epoch, batch_index, images, targets, paths):
        if epoch == 0 and batch_index < 3:
            plot_images(images, targets, paths, save_dir / f"train_batch{batch_index}.jpg", names)
    return hook


def _save_yaml(path: Path, values: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(values, f, sort_keys=False)
